"""The scheduler's grammars: compiled ones from the cache, the others from the compile worker while their requests
wait, the loop woken the moment one is ready; no request waits past its bound.

    add_request ── cached(spec) ── a matcher now: the request is queued like any other
                             └─ None: submit(rid, spec); the request waits for its grammar, no verdict sent yet
    the loop ◀── doorbell ── take_ready(): (rid, matcher | GrammarRefused) for each request whose grammar came,
             ◀── overdue() ─            and a 503 for each whose wait bound passed first

Requests that ask for a grammar already on its way wait for that one compile. The doorbell is a pipe whose read
end the scheduler's loop polls with its sockets: a finished compile wakes it at once, not at its next idle tick.

The wait bound (compile_budget.py: WAIT_BOUND_FACTOR times --grammar-compile-timeout) counts from submit(), the
request's arrival at the scheduler: the vocabulary's preparation, the grammars queued ahead and its own compile,
whatever it waits for. Past it the request is refused as the server's fault (503, retry later) and no longer
waits; a grammar nobody waits for any more is withdrawn from the compile worker (compile_queue.py: dropped if
queued, given up if under way and another is wanted). Requests are kept in arrival order, so their deadlines are
in order: overdue() reads the first. The loop polls at least every 100 ms, so a refusal is at most that late.
Everything here runs on the loop's thread except _post, which the compile worker's thread calls.
"""

from __future__ import annotations

import os
import queue
import time
from dataclasses import dataclass
from typing import Any

from common.sampling_params import STRUCTURED_KIND_NAMES, StructuredOutput
from scheduler import compile_budget
from scheduler.compile_worker import CompileWorker, GrammarRefused, Outcome
from scheduler.grammar_cache import GrammarCache, GrammarKey
from scheduler.structured_output import RequestGrammar

# Compiled grammars kept for requests to come (grammar_cache.py). A grammar of --max-grammar-bytes' default, 256
# KiB of 8,000 choices, compiles to 36 MB of token masks: the cache holds at least seven of the largest.
GRAMMAR_CACHE_BYTES = 256 * 2**20


@dataclass(slots=True)
class GrammarWait:
    """A request waiting for its grammar."""

    key: GrammarKey
    deadline: float  # time.monotonic() past which it is refused: its arrival plus the wait bound


class Grammars:
    def __init__(
        self,
        model_folder: str,
        vocab_size: int,
        eos_token_ids: list[int],
        compile_timeout_s: float,
        cache_bytes: int = GRAMMAR_CACHE_BYTES,
    ):
        self.model_folder = model_folder
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.compile_timeout_s = compile_timeout_s
        self.wait_factor = compile_budget.WAIT_BOUND_FACTOR
        # The same for every request (never shortened): deadlines then come in arrival order.
        self.wait_bound_s = self.wait_factor * compile_timeout_s
        self.wait_refusals = 0  # requests refused at the wait bound
        self.cache = GrammarCache(cache_bytes)
        self._waiters: dict[GrammarKey, list[int]] = {}  # grammars submitted -> the requests waiting for each
        self._waits: dict[int, GrammarWait] = {}  # in arrival order, so deadlines are in order
        self._outcomes: queue.SimpleQueue[tuple[GrammarKey, Outcome]] = queue.SimpleQueue()
        self._doorbell: tuple[int, int] | None = None  # (read, write) ends of the pipe
        self.worker: CompileWorker | None = None

    def start(self) -> None:
        """Start the compile worker, which prepares the vocabulary (the server: at start-up, while it serves;
        offline.LLM: on the first grammar). Grammars submitted meanwhile wait for it. xgrammar, and torch with it,
        is imported here, not on the loop when a grammar comes."""
        if self.worker is not None:
            return
        import xgrammar  # noqa: F401

        read, write = os.pipe()
        os.set_blocking(read, False)
        os.set_blocking(write, False)
        self._doorbell = (read, write)
        self.worker = CompileWorker(
            self.model_folder,
            self.vocab_size,
            self.eos_token_ids,
            self.compile_timeout_s,
            on_outcome=self._post,
        )
        self.worker.start()

    @property
    def vocabulary_ready(self) -> bool:
        """The compile worker has prepared the vocabulary: grammars compile from now (until then they wait)."""
        return self.worker is not None and self.worker.ready.is_set()

    @property
    def doorbell(self) -> int | None:
        """A file descriptor readable when take_ready() has something (None: not started)."""
        return None if self._doorbell is None else self._doorbell[0]

    @property
    def num_waiting(self) -> int:
        """Requests waiting for their grammar."""
        return len(self._waits)

    def overdue(self) -> bool:
        """A request has waited past its bound: take_ready() refuses it."""
        first = next(iter(self._waits.values()), None)
        return first is not None and first.deadline <= time.monotonic()

    def cached(self, structured: StructuredOutput) -> RequestGrammar | None:
        """A matcher for the grammar if it is compiled already."""
        compiled = self.cache.get((structured.kind, structured.spec))
        return None if compiled is None else self._matcher(compiled)

    def submit(self, rid: int, structured: StructuredOutput) -> None:
        """Have the grammar compiled for request `rid`, arrived now: take_ready() gives its matcher, or why there is
        none."""
        self.start()
        key = (structured.kind, structured.spec)
        self._waits[rid] = GrammarWait(key, time.monotonic() + self.wait_bound_s)
        waiting = self._waiters.get(key)
        if waiting is not None:
            waiting.append(rid)  # already on its way
            return
        self._waiters[key] = [rid]
        assert self.worker is not None
        self.worker.submit(key)

    def cancel(self, rid: int) -> None:
        """Request `rid` no longer waits (aborted, or past its bound). Its grammar, if nobody else waits for it, is
        withdrawn: not compiled if still queued; if under way, given up once another grammar is wanted, or else
        kept in the cache when done."""
        key = self._waits.pop(rid).key
        waiting = self._waiters[key]
        waiting.remove(rid)
        if not waiting:
            del self._waiters[key]
            assert self.worker is not None
            self.worker.withdraw(key)

    def take_ready(self, timeout_s: float = 0.0) -> list[tuple[int, RequestGrammar | GrammarRefused]]:
        """Each waiting request whose grammar has come: its matcher, or why there is none; and each that waited past
        its bound: a 503. With timeout_s, waits that long for a grammar if none has come (offline.LLM; the server's
        loop polls the doorbell and overdue() instead)."""
        outcomes = []
        if timeout_s > 0:
            try:
                outcomes.append(self._outcomes.get(timeout=timeout_s))
            except queue.Empty:
                pass
        # Silenced before the queue is read: an outcome posted from now on rings again, so none is missed.
        if self._doorbell is not None:
            try:
                while os.read(self._doorbell[0], 4096):
                    pass
            except BlockingIOError:
                pass
        try:
            while True:
                outcomes.append(self._outcomes.get_nowait())
        except queue.Empty:
            pass
        ready: list[tuple[int, RequestGrammar | GrammarRefused]] = []
        for key, outcome in outcomes:
            if not isinstance(outcome, GrammarRefused):
                self.cache.put(key, outcome)
            for rid in self._waiters.pop(key, []):
                del self._waits[rid]
                ready.append((rid, outcome if isinstance(outcome, GrammarRefused) else self._matcher(outcome)))
        return ready + self._refuse_overdue()

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()
            self.worker = None
        if self._doorbell is not None:
            for fd in self._doorbell:
                os.close(fd)
            self._doorbell = None

    def _refuse_overdue(self) -> list[tuple[int, GrammarRefused]]:
        refused = []
        while self.overdue():
            rid, wait = next(iter(self._waits.items()))
            refused.append((rid, GrammarRefused(self._not_ready_message(wait.key), 503)))
            self.cancel(rid)
            self.wait_refusals += 1
        return refused

    def _not_ready_message(self, key: GrammarKey) -> str:
        assert self.worker is not None
        if not self.vocabulary_ready:
            why = "the server is still preparing its grammar vocabulary"
        elif self.worker.under_way == key:
            why = "the server is too busy to finish compiling it"
        else:
            why = "the server is busy compiling other grammars"
        return (
            f"the {STRUCTURED_KIND_NAMES.get(key[0], key[0])} was not ready within {self.wait_bound_s:g} s of the "
            f"request's arrival ({self.wait_factor:g}x --grammar-compile-timeout): {why}; retry later"
        )

    def _matcher(self, compiled: Any) -> RequestGrammar:
        import xgrammar

        return RequestGrammar(xgrammar.GrammarMatcher(compiled), self.vocab_size)

    def _post(self, key: GrammarKey, outcome: Outcome) -> None:
        """(The compile worker's thread.) A grammar's outcome, for take_ready(); the loop's doorbell rung."""
        self._outcomes.put((key, outcome))
        doorbell = self._doorbell
        if doorbell is not None:
            try:
                os.write(doorbell[1], b"\0")
            except (BlockingIOError, OSError):
                pass  # full: it is ringing already (closed: nobody listens any more)
