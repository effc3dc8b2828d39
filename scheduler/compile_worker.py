"""The grammar compile worker: structured output's grammars are compiled first in a process of their own, where a
compile past its timeout can be killed, then again, known to finish in time, on a thread of the scheduler's.

    scheduler process                                                 compile worker (spawned by the scheduler)
    grammars.py ──submit(key)──▶ CompileWorker thread ──CompileGrammar──────▶ xgrammar compile (the trial)
                                                      ◀─GrammarCompiled───── it compiled in time (or its error)
                                  xgrammar compile (the one kept, GIL released)
    loop ◀─doorbell─ outcomes ◀──────────────────────┘

One grammar at a time, in submission order (compile_queue.py: a grammar nobody waits for any more is dropped from
the queue; one under way that nobody waits for is given up, its worker replaced, once another is wanted). The
worker prepares
the tokenizer's vocabulary (xgrammar's TokenizerInfo) when it starts, with the scheduler, and hands it over as
JSON: the scheduler compiles with it, and a restarted worker starts from it.

A compile is timed by its CPU time, not wall time, and runs only on cycles that serving leaves idle (SCHED_IDLE):
compile_budget.py says why. One past --grammar-compile-timeout of CPU is killed with its worker (SIGKILL: a compile
cannot be interrupted) and another worker is started at once; the request is refused (400, naming its field) and the
jobs behind it wait for the new worker's start (a process importing xgrammar, and torch with it; the vocabulary is
given, not prepared again). A worker that dies on a grammar, or whose compile is given up, is replaced the same way.
A compile that gets no CPU is not this thread's to end: its requests are refused at their wait bound (grammars.py),
and then it is given up for the next grammar.

The server does not wait for the vocabulary: until the first worker has prepared it, grammars wait in the queue
(their requests in WAITING_FOR_GRAMMAR, their wait bound counting), and a grammar's CPU clock starts when it is
handed to a worker.

Why a process rather than a thread (measured on this 2-core CPU, GPT-2's vocabulary, xgrammar 0.2.8):
- xgrammar's compile does release the GIL: a Python thread ticking every millisecond kept ticking through an
  8,000-choice compile (median tick 1.2 ms as before it; largest gap 13 ms with one compile thread, 72 ms
  with xgrammar's default 8 on 2 cores). A thread would not stall the loop by itself;
- but a compile cannot be stopped: a thread past its timeout would keep a core busy to the end (90 s for a
  50,000-branch regex) with every compile queued behind it; a process is killed at the timeout;
- and xgrammar's compiler holds memory outside its byte-bounded cache, freed only with the compiler
  (grammar_cache.py): both compilers run with xgrammar's cache off, and memory stays flat.
Why compile twice rather than hand the worker's grammar over: xgrammar's only way across is its JSON, which
costs more than the compile it carries. For 8,000 choices (36 MB of token masks), on a quiet CPU: compile 2.4 s,
serialize 4.1 s, read back 1.8 s, with 37 MB through the pipe and a 350 MB parse tree in the scheduler: 70 % of
the work to the verdict (34 s at nice 10 beside a running stream), and the stream's longest gaps but the first
fell in it (docs/notes/benchmark-history.md, "Grammars beside a running stream"). For ordinary grammars it is
milliseconds either way (a 10-field schema: compile 12.6 ms, serialize 13.3 ms, read back 6.3 ms).
The second compile is not timed: it cannot be stopped, and needs none. It is the trial's work again (the same
grammar, compiler and threads), so the trial bounds its CPU time; like the trial it takes idle cycles only, so its
cost is the request's wait, not the other streams' time. Neither alternative is cheaper: a trial skipped for grammars
that look small is unsafe (a short regex of nested counted repeats compiles for minutes), and a second compile run
beside the trial, dropped if the trial times out, would leave a thread that cannot be stopped compiling to the end.
A grammar served from the cache is compiled by nobody.
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing as mp
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from common.messages import CompileGrammar, CompileWorkerReady, GrammarCompiled
from common.process import entry_point_of, exit_child, init_child_process, run_spawned
from common.sampling_params import STRUCTURED_KIND_NAMES
from common.wire import decode, encode
from scheduler.compile_budget import CompileDeadline, yield_to_serving
from scheduler.compile_queue import CompileQueue
from scheduler.grammar_cache import GrammarKey
from scheduler.structured_output import compile_error_message, compile_spec

ROLE = "grammar-compile"
# How often the thread waiting for a compile reads the worker's CPU time (the pipe wakes it at once when done).
CLOCK_READ_S = 0.1
SLOW_COMPILE_S = 1.0  # a compile that took longer is logged with its times: CPU, and wall (its wait for idle cycles)
log = logging.getLogger(__name__)


# A compile's scratch memory is freed at its end but kept by glibc's heap. After a grammar of this size or more the
# heap is trimmed (tens of ms, off the loop; the GIL is released meanwhile).
TRIM_AFTER_BYTES = 4 * 2**20


def _return_freed_heap() -> None:
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


@dataclass(slots=True)
class GrammarRefused:
    """Why a request's grammar cannot be had: its 400 (or, for the server's own failure, 500)."""

    message: str
    status: int = 400


Outcome = Any  # xgrammar.CompiledGrammar | GrammarRefused


def compile_threads() -> int:
    """xgrammar's threads for one compile: half the cores this process may use (the rest serve), at least one."""
    return max(1, min(8, len(os.sched_getaffinity(0)) // 2))


# ---------------------------------------------------------------- the worker process


def serve(
    conn: Connection,
    model_folder: str,
    vocab_size: int,
    eos_token_ids: list[int],
    tokenizer_info_json: str,
    log_level: str,
    parent_pid: int,
) -> None:
    """The compile worker's entry point (spawned). tokenizer_info_json: the vocabulary an earlier worker prepared
    ("": prepare it from the model's tokenizer)."""
    init_child_process(ROLE, log_level, parent_pid)
    yield_to_serving(whole_process=True)  # (inherited from the spawning thread already, on Linux)
    try:
        import xgrammar

        if tokenizer_info_json:
            info = xgrammar.TokenizerInfo.deserialize_json(tokenizer_info_json)
        else:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(model_folder)
            info = xgrammar.TokenizerInfo.from_huggingface(
                tokenizer, vocab_size=vocab_size, stop_token_ids=eos_token_ids
            )
        compiler = xgrammar.GrammarCompiler(info, max_threads=compile_threads(), cache_enabled=False)
        conn.send_bytes(encode(CompileWorkerReady("" if tokenizer_info_json else info.serialize_json())))
        while True:
            job: CompileGrammar = decode(conn.recv_bytes())
            try:
                compiled = compile_spec(compiler, job.kind, job.spec)
            except (RuntimeError, ValueError) as exc:
                conn.send_bytes(encode(GrammarCompiled(error=compile_error_message(job.kind, exc))))
                continue
            del compiled  # (its destructor holds this process's GIL for a while: the scheduler's is not held)
            conn.send_bytes(encode(GrammarCompiled()))
    except (EOFError, SystemExit):  # the scheduler let go of the pipe, or stopped us
        pass
    exit_child()


# ---------------------------------------------------------------- the scheduler's side


class CompileWorker:
    """The scheduler's handle on its compile worker: a thread that starts the process, hands it one job at a time,
    reads each compiled grammar back, and reports every outcome through `on_outcome` (called in that thread). A
    compile given up is reported to nobody (nobody waits for it)."""

    def __init__(
        self,
        model_folder: str,
        vocab_size: int,
        eos_token_ids: list[int],
        timeout_s: float,
        on_outcome: Callable[[GrammarKey, Outcome], None],
    ):
        self.model_folder = model_folder
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.timeout_s = timeout_s
        self._on_outcome = on_outcome
        self._jobs = CompileQueue()
        self._process: Any = None  # multiprocessing's SpawnProcess
        self._conn: Connection | None = None
        self._tokenizer_info_json = ""  # from the first worker
        self._compiler: Any = None  # xgrammar.GrammarCompiler, this thread's: for the grammars the worker passed
        self._closing = False
        self.ready = threading.Event()  # set once the first worker has prepared the vocabulary
        self.compiles = 0  # grammars handed to a worker
        self.restarts = 0  # workers killed (timeout, compile given up) or lost (died on a grammar) and started again
        self._thread = threading.Thread(target=self._run, name="grammar-compiles", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def submit(self, key: GrammarKey) -> None:
        self._jobs.submit(key)

    def withdraw(self, key: GrammarKey) -> None:
        """Nobody waits for this grammar any more: not compiled if still queued, given up if under way and another
        grammar is wanted."""
        self._jobs.withdraw(key)

    @property
    def under_way(self) -> GrammarKey | None:
        """The grammar being compiled now."""
        return self._jobs.under_way

    @property
    def native_id(self) -> int | None:
        """The compile thread's id for the OS (None before it starts): its scheduling policy is the compiles'."""
        return self._thread.native_id

    def close(self) -> None:
        self._closing = True
        self._jobs.close()
        process = self._process
        if process is not None:
            process.kill()  # the thread, waiting on a compile, sees the pipe close and leaves
        self._thread.join(timeout=5)

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def _run(self) -> None:
        # This thread compiles the grammars the worker passed (seconds for the largest) and spawns the workers:
        # they, and xgrammar's compile threads, inherit its priority, below every serving thread (compile_budget.py).
        priority = yield_to_serving()
        log.debug("grammar compiles run at %s", priority)
        try:
            while True:
                if self._conn is None and not self._closing:
                    self._start_process()  # the first worker, or the replacement of one killed or lost
                key = self._jobs.take()
                if key is None or self._closing:
                    return
                try:
                    outcome = self._compile(key)
                except Exception:  # this thread must outlive any one grammar: requests wait on it
                    log.exception("compiling a grammar failed")
                    self._replace()
                    outcome = GrammarRefused("the grammar compiler failed", 500)
                if self._closing:
                    return
                if outcome is None:
                    continue  # given up: nobody waits for it
                self._jobs.done()
                self._on_outcome(key, outcome)
        finally:
            self._stop_process()

    def _compile(self, key: GrammarKey) -> Outcome | None:
        """The grammar compiled (the trial in the worker, then the one kept), or why not; None: given up."""
        if self._conn is None:
            self._start_process()
            if self._conn is None:
                return GrammarRefused("structured output is unavailable: the grammar compiler did not start", 500)
        kind = STRUCTURED_KIND_NAMES.get(key[0], key[0])
        deadline = CompileDeadline(self._process.pid, self.timeout_s, compile_threads())
        self._conn.send_bytes(encode(CompileGrammar(*key)))
        self.compiles += 1
        while not self._conn.poll(CLOCK_READ_S):
            if deadline.past_timeout:
                log.warning(
                    "a %s took over %g CPU s to compile: its worker is killed and replaced", kind, self.timeout_s
                )
                self._replace()
                return GrammarRefused(
                    f"the {kind} did not compile within {self.timeout_s:g} s of CPU (--grammar-compile-timeout); "
                    f"a simpler or smaller one may"
                )
            if self._jobs.abandon():
                log.info(
                    "a %s nobody waits for any more (%.1f CPU s in %.0f s) is given up for the next grammar: its "
                    "worker is killed and replaced",
                    kind,
                    deadline.cpu_s,
                    deadline.wall_s,
                )
                self._replace()
                return None
        try:
            reply: GrammarCompiled = decode(self._conn.recv_bytes())
        except (EOFError, OSError):
            code = self._process.exitcode if self._process is not None else None
            log.error("the grammar compile worker died on a %s (exit code %s): replaced", kind, code)
            self._replace()
            return GrammarRefused(f"the grammar compiler failed on this {kind}")
        if reply.error:
            return GrammarRefused(reply.error)
        # It compiles within the timeout: compiled again here, at this thread's priority, and kept.
        trial_cpu_s, trial_wall_s, started = deadline.cpu_s, deadline.wall_s, time.monotonic()
        try:
            compiled = compile_spec(self._compiler, *key)
        except (RuntimeError, ValueError):  # the worker's compile passed: the server's fault, not the request's
            log.exception("a %s that compiled in the worker did not compile in the scheduler", kind)
            return GrammarRefused(f"the {kind} could not be compiled", 500)
        if trial_wall_s > SLOW_COMPILE_S:
            log.info(
                "a %s compiled in %.1f CPU s (%.1f s in the worker, idle cycles only), then again in %.1f s",
                kind,
                trial_cpu_s,
                trial_wall_s,
                time.monotonic() - started,
            )
        if compiled.memory_size_bytes >= TRIM_AFTER_BYTES:
            _return_freed_heap()
        return compiled

    def _replace(self) -> None:
        """Kill the worker; _run starts the next one once this job's refusal is out (its start takes seconds)."""
        self._stop_process()
        self.restarts += 1

    def _start_process(self) -> None:
        import xgrammar

        started = time.perf_counter()
        context = mp.get_context("spawn")  # never fork: the parent's threads and sockets are not the child's
        conn, child_conn = context.Pipe()
        log_level = logging.getLevelName(logging.getLogger().getEffectiveLevel())
        args = (
            child_conn,
            self.model_folder,
            self.vocab_size,
            self.eos_token_ids,
            self._tokenizer_info_json,
            log_level,
            os.getpid(),
        )
        spawned_args = (os.getpid(), entry_point_of(serve), *args)
        process = context.Process(target=run_spawned, args=spawned_args, name=ROLE, daemon=True)
        process.start()
        child_conn.close()  # the child's end is the child's: its exit must close the pipe for us
        self._process = process
        try:
            ready: CompileWorkerReady = decode(conn.recv_bytes())
        except (EOFError, OSError):
            process.join(5)
            log.error("the grammar compile worker did not start (exit code %s)", process.exitcode)
            self._process = None
            conn.close()
            return
        if not self._tokenizer_info_json:
            self._tokenizer_info_json = ready.tokenizer_info_json
            info = xgrammar.TokenizerInfo.deserialize_json(ready.tokenizer_info_json)
            self._compiler = xgrammar.GrammarCompiler(info, max_threads=compile_threads(), cache_enabled=False)
        self._conn = conn
        if not self.ready.is_set():
            log.info(
                "grammar vocabulary ready: structured requests compile from now (compile worker pid %d, %.1f s)",
                process.pid,
                time.perf_counter() - started,
            )
        else:
            log.info("grammar compile worker (pid %d) ready in %.1f s", process.pid, time.perf_counter() - started)
        self.ready.set()

    def _stop_process(self) -> None:
        if self._process is not None:
            self._process.kill()
            self._process.join(5)
            self._process = None
        if self._conn is not None:
            self._conn.close()
            self._conn = None
