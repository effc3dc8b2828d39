"""The grammar compile worker: structured output's grammars are compiled in a process of their own, never on the
scheduler's loop.

    scheduler process                                                 compile worker (spawned by the scheduler)
    grammars.py ──submit(key)──▶ CompileWorker thread ──CompileGrammar──────▶ xgrammar compile
                                                      ◀─GrammarCompiled───── the compile is over (or its error)
    loop ◀─doorbell─ outcomes ◀─deserialize_json─────◀─the grammar's JSON──── serialize_json

One grammar at a time, in submission order (a job nobody waits for any more is skipped). The worker prepares
the tokenizer's vocabulary (xgrammar's TokenizerInfo) when it starts, with the scheduler, and hands it over as
JSON: the scheduler needs it to read compiled grammars, and a restarted worker starts from it.

A compile still running at --grammar-compile-timeout is killed with its worker (SIGKILL: a compile cannot be
interrupted) and another worker is started at once, at low priority; the request is refused (400, naming its
field) and the jobs behind it wait for the new worker's start (a process importing xgrammar, and torch with it;
the vocabulary is given, not prepared again). A worker that dies on a grammar is replaced the same way. The
timeout bounds the compile only: the handover after it is linear in the compiled grammar's size, which
--max-grammar-bytes bounds.

Why a process rather than a thread (measured on this 2-core CPU, GPT-2's vocabulary, xgrammar 0.2.8):
- xgrammar's compile does release the GIL: a Python thread ticking every millisecond kept ticking through an
  8,000-choice compile (median tick 1.2 ms as before it; largest gap 13 ms with one compile thread, 72 ms
  with xgrammar's default 8 on 2 cores). A thread would not stall the loop by itself;
- but a compile cannot be stopped: a thread past its timeout would keep a core busy to the end (90 s for a
  50,000-branch regex) with every compile queued behind it; a process is killed at the timeout;
- and xgrammar's compiler holds memory outside its byte-bounded cache, freed only with the compiler
  (grammar_cache.py): here it runs with xgrammar's cache off, and the worker's memory stays flat;
- a process can run at a lower CPU priority (COMPILE_NICENESS): on a machine whose cores serve requests, a
  compile takes what they leave.
The price is the handover: xgrammar's JSON serialization costs about the compile again in the worker, reading it
back half that in the scheduler's thread (which holds the GIL at most ~20 ms at a time meanwhile). For ordinary
grammars this is milliseconds (a 10-field schema: compile 12.6 ms, serialize 13.3 ms, deserialize 6.3 ms; a
2-field one 1.8 / 1.9 / 0.8 ms); for 8,000 choices (36 MB of token masks) 2.4 s / 4.1 s / 1.8 s on a quiet CPU.
A grammar served from the cache crosses nothing. What a compile costs a running stream on this CPU (the model's
forward uses both cores): docs/benchmarks.md, "Grammars beside a running stream".
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


# Reading a compiled grammar back parses its JSON into a tree about ten times the text's size, freed at once but
# kept by glibc's heap: 37 MB of JSON (8,000 choices) left the scheduler 350 MB larger for good. Past this size
# the heap is trimmed after the read (27 ms, off the loop; the GIL is released meanwhile).
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
            conn.send_bytes(encode(GrammarCompiled()))  # the compile is over: its timeout no longer runs
            conn.send_bytes(compiled.serialize_json().encode())
            del compiled
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
        self._tokenizer_info: Any = None  # xgrammar.TokenizerInfo, from the first worker
        self._tokenizer_info_json = ""
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
        # This thread reads compiled grammars back (seconds for the largest) and spawns the workers, which inherit
        # its priority: both below the loop's and the serving processes'. (Linux: a nice value is a thread's own.)
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
        import xgrammar

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
            if reply.error:
                return GrammarRefused(reply.error)
            # The handover is not timed: it is linear in the compiled grammar's size, which the source's bound
            # (--max-grammar-bytes) bounds; a worker that dies meanwhile closes the pipe.
            compiled_json = self._conn.recv_bytes().decode()
        except (EOFError, OSError):
            code = self._process.exitcode if self._process is not None else None
            log.error("the grammar compile worker died on a %s (exit code %s): replaced", kind, code)
            self._replace()
            return GrammarRefused(f"the grammar compiler failed on this {kind}")
        try:
            return xgrammar.CompiledGrammar.deserialize_json(compiled_json, self._tokenizer_info)
        except Exception:  # a compiled grammar the scheduler cannot read: the server's fault, not the request's
            log.exception("a compiled %s could not be read back", kind)
            return GrammarRefused(f"the compiled {kind} could not be read back", 500)
        finally:
            if len(compiled_json) >= TRIM_AFTER_BYTES:
                del compiled_json
                _return_freed_heap()

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
            self._tokenizer_info = xgrammar.TokenizerInfo.deserialize_json(ready.tokenizer_info_json)
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
