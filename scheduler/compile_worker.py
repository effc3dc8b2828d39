"""The grammar compile worker: structured output's grammars are compiled first in a process of their own, where a
compile past its timeout can be killed, then again, known to finish in time, on a thread of the scheduler's.

    scheduler process                                                 compile worker (spawned by the scheduler)
    grammars.py ──submit(key)──▶ CompileWorker thread ──CompileGrammar──────▶ xgrammar compile (the trial)
                                                      ◀─GrammarCompiled───── it compiled in time (or its error)
                                  xgrammar compile (the one kept, GIL released)
    loop ◀─doorbell─ outcomes ◀──────────────────────┘

One grammar at a time, in submission order (a job nobody waits for any more is skipped). The worker prepares
the tokenizer's vocabulary (xgrammar's TokenizerInfo) when it starts, with the scheduler, and hands it over as
JSON: the scheduler compiles with it, and a restarted worker starts from it.

A compile still running at --grammar-compile-timeout is killed with its worker (SIGKILL: a compile cannot be
interrupted) and another worker is started at once, at low priority; the request is refused (400, naming its
field) and the jobs behind it wait for the new worker's start (a process importing xgrammar, and torch with it;
the vocabulary is given, not prepared again). A worker that dies on a grammar is replaced the same way. The
timeout bounds the trial; the second compile takes about as long again.

Why a process rather than a thread (measured on this 2-core CPU, GPT-2's vocabulary, xgrammar 0.2.8):
- xgrammar's compile does release the GIL: a Python thread ticking every millisecond kept ticking through an
  8,000-choice compile (median tick 1.2 ms as before it; largest gap 13 ms with one compile thread, 72 ms
  with xgrammar's default 8 on 2 cores). A thread would not stall the loop by itself;
- but a compile cannot be stopped: a thread past its timeout would keep a core busy to the end (90 s for a
  50,000-branch regex) with every compile queued behind it; a process is killed at the timeout;
- and xgrammar's compiler holds memory outside its byte-bounded cache, freed only with the compiler
  (grammar_cache.py): both compilers run with xgrammar's cache off, and memory stays flat;
- a process can run at a lower CPU priority (COMPILE_NICENESS): on a machine whose cores serve requests, a
  compile takes what they leave.
Why compile twice rather than hand the worker's grammar over: xgrammar's only way across is its JSON, which
costs more than the compile it carries. For 8,000 choices (36 MB of token masks), on a quiet CPU: compile 2.4 s,
serialize 4.1 s, read back 1.8 s, with 37 MB through the pipe and a 350 MB parse tree in the scheduler: 70 % of
the work to the verdict (34 s at nice 10 beside a running stream), and the stream's longest gaps but the first
fell in it (docs/benchmarks.md, "Grammars beside a running stream"). For ordinary grammars it is milliseconds
either way (a 10-field schema: compile 12.6 ms, serialize 13.3 ms, read back 6.3 ms).
A grammar served from the cache is compiled by nobody.
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing as mp
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from common.messages import CompileGrammar, CompileWorkerReady, GrammarCompiled
from common.process import exit_child, init_child_process
from common.sampling_params import STRUCTURED_KIND_NAMES
from common.wire import decode, encode
from scheduler.grammar_cache import GrammarKey
from scheduler.structured_output import compile_error_message, compile_spec

ROLE = "grammar-compile"
# Nice 10: a compile (and reading its grammar back) gets about a tenth of a core that a nice-0 serving process wants
# too, all of an idle one. Measured beside a stream on 2 cores (docs/benchmarks.md): nice 0 slowed the stream 2.4x
# while 8,000 choices compiled, nice 10 by 10-15%, and at nice 19 that compile never finished within 10 s.
COMPILE_NICENESS = 10
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
    init_child_process(ROLE, log_level, parent_pid)  # (at COMPILE_NICENESS: the spawning thread's, inherited)
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
    reads each compiled grammar back, and reports every outcome through `on_outcome` (called in that thread)."""

    def __init__(
        self,
        model_folder: str,
        vocab_size: int,
        eos_token_ids: list[int],
        timeout_s: float,
        still_wanted: Callable[[GrammarKey], bool],
        on_outcome: Callable[[GrammarKey, Outcome], None],
    ):
        self.model_folder = model_folder
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.timeout_s = timeout_s
        self._still_wanted = still_wanted
        self._on_outcome = on_outcome
        self._jobs: queue.SimpleQueue[GrammarKey | None] = queue.SimpleQueue()
        self._process: Any = None  # multiprocessing's SpawnProcess
        self._conn: Connection | None = None
        self._tokenizer_info_json = ""  # from the first worker
        self._compiler: Any = None  # xgrammar.GrammarCompiler, this thread's: for the grammars the worker passed
        self._closing = False
        self.ready = threading.Event()  # set once the first worker has prepared the vocabulary
        self.first_start_over = threading.Event()  # ... or failed to
        self.compiles = 0  # grammars handed to a worker
        self.restarts = 0  # workers killed (timeout) or lost (died on a grammar) and started again
        self._thread = threading.Thread(target=self._run, name="grammar-compiles", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def submit(self, key: GrammarKey) -> None:
        self._jobs.put(key)

    def close(self) -> None:
        self._closing = True
        self._jobs.put(None)
        process = self._process
        if process is not None:
            process.kill()  # the thread, waiting on a compile, sees the pipe close and leaves
        self._thread.join(timeout=5)

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def _run(self) -> None:
        # This thread compiles the grammars the worker passed (seconds for the largest) and spawns the workers,
        # which inherit its priority: both below the loop's and the serving processes'. (Linux: a nice value is a
        # thread's own, and xgrammar's compile threads inherit this one's.)
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), COMPILE_NICENESS)
        try:
            while True:
                if self._conn is None and not self._closing:
                    self._start_process()  # the first worker, or the replacement of one killed or lost
                key = self._jobs.get()
                if key is None or self._closing:
                    return
                if not self._still_wanted(key):
                    continue  # every request that asked for it was aborted before its turn
                try:
                    outcome = self._compile(key)
                except Exception:  # this thread must outlive any one grammar: requests wait on it
                    log.exception("compiling a grammar failed")
                    self._replace()
                    outcome = GrammarRefused("the grammar compiler failed", 500)
                if self._closing:
                    return
                self._on_outcome(key, outcome)
        finally:
            self._stop_process()

    def _compile(self, key: GrammarKey) -> Outcome:
        if self._conn is None:
            self._start_process()
            if self._conn is None:
                return GrammarRefused("structured output is unavailable: the grammar compiler did not start", 500)
        kind = STRUCTURED_KIND_NAMES.get(key[0], key[0])
        self._conn.send_bytes(encode(CompileGrammar(*key)))
        self.compiles += 1
        if not self._conn.poll(self.timeout_s):
            log.warning("a %s took over %g s to compile: its worker is killed and replaced", kind, self.timeout_s)
            self._replace()
            return GrammarRefused(
                f"the {kind} did not compile within {self.timeout_s:g} s (--grammar-compile-timeout); "
                f"a simpler or smaller one may"
            )
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
        try:
            compiled = compile_spec(self._compiler, *key)
        except (RuntimeError, ValueError):  # the worker's compile passed: the server's fault, not the request's
            log.exception("a %s that compiled in the worker did not compile in the scheduler", kind)
            return GrammarRefused(f"the {kind} could not be compiled", 500)
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
        process = context.Process(target=serve, args=args, name=ROLE, daemon=True)
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
            self.first_start_over.set()
            return
        if not self._tokenizer_info_json:
            self._tokenizer_info_json = ready.tokenizer_info_json
            info = xgrammar.TokenizerInfo.deserialize_json(ready.tokenizer_info_json)
            self._compiler = xgrammar.GrammarCompiler(info, max_threads=compile_threads(), cache_enabled=False)
        self._conn = conn
        self.ready.set()
        self.first_start_over.set()
        log.info("grammar compile worker (pid %d) ready in %.1f s", process.pid, time.perf_counter() - started)

    def _stop_process(self) -> None:
        if self._process is not None:
            self._process.kill()
            self._process.join(5)
            self._process = None
        if self._conn is not None:
            self._conn.close()
            self._conn = None
