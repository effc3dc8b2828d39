"""The compile worker's jobs: the grammars wanted, in submission order, and the one under way.

    submit(key) ──▶ pending (once: a grammar pending, or under way and wanted, is not queued again)
    withdraw(key), nobody waits for it any more ─┬─ pending: dropped, never compiled
                                                 └─ under way: unwanted; abandon() gives it up once another
                                                    grammar is wanted (its worker is killed: seconds to replace)
    take() ──▶ the next pending grammar, now under way ── done() or abandon(): nothing under way

An unwanted compile with nothing wanted behind it goes on: it delays nobody, and a client that retries after its
503 joins it or finds it compiled. submit and withdraw are the scheduler loop's (grammars.py); take, done and
abandon the compile thread's (compile_worker.py).
"""

from __future__ import annotations

import threading

from scheduler.grammar_cache import GrammarKey


class CompileQueue:
    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._pending: dict[GrammarKey, None] = {}  # in submission order
        self._under_way: GrammarKey | None = None
        self._under_way_wanted = False
        self._closed = False

    def __len__(self) -> int:
        """Grammars waiting for their turn."""
        with self._changed:
            return len(self._pending)

    @property
    def under_way(self) -> GrammarKey | None:
        with self._changed:
            return self._under_way

    def submit(self, key: GrammarKey) -> None:
        with self._changed:
            if key == self._under_way:
                self._under_way_wanted = True  # wanted again before it was given up: its outcome serves
            elif key not in self._pending:
                self._pending[key] = None
                self._changed.notify()

    def withdraw(self, key: GrammarKey) -> None:
        """Nobody waits for this grammar any more."""
        with self._changed:
            if key == self._under_way:
                self._under_way_wanted = False
            else:
                self._pending.pop(key, None)

    def take(self) -> GrammarKey | None:
        """The next grammar to compile, now under way (waits for one); None once closed."""
        with self._changed:
            while not self._pending and not self._closed:
                self._changed.wait()
            if self._closed:
                return None
            key = next(iter(self._pending))
            del self._pending[key]
            self._under_way, self._under_way_wanted = key, True
            return key

    def done(self) -> None:
        """The compile under way is over (its outcome posted next: a request for it from now on queues it again)."""
        with self._changed:
            self._under_way = None

    def abandon(self) -> bool:
        """True, and nothing under way any more, if nobody wants the compile under way while another grammar is
        wanted: it would only delay that one."""
        with self._changed:
            if self._under_way is None or self._under_way_wanted or not self._pending:
                return False
            self._under_way = None
            return True

    def close(self) -> None:
        with self._changed:
            self._closed = True
            self._changed.notify_all()
