"""Long prompts are encoded on a thread of their own, so the worker's loop goes on detokenizing meanwhile.

A tokenizer worker streams the text of every request it owns: while it encodes a 7,000-token prompt (10-35 ms
on the lent GPU machine's CPU), the tokens of all its other requests wait, and their clients see the stall as one
long inter-token gap. The Rust tokenizer's batch encode releases the GIL (its single-text encode does not), so a
long prompt handed to a thread costs the loop almost nothing:

    loop:    GenerateRequest ─ long? ─▶ submit      TokenBatch ... TokenBatch    (detokenized meanwhile)
    thread:                     encode_batch([text]) ─▶ done queue, a wake-up on an inproc socket
    loop:    wake-up polled ─▶ finished() ─▶ TokenizedRequest to the scheduler

One thread: prompts are encoded one after another, in arrival order.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from itertools import count

import zmq

_addresses = count()


@dataclass(slots=True)
class EncodeJob:
    rid: int
    text: str
    add_special_tokens: bool


class BackgroundEncoder:
    def __init__(self, encode: Callable[[str, bool], list[int]], ctx: zmq.Context):
        """encode(text, add_special_tokens): called on the thread; must release the GIL to be worth it."""
        self._encode = encode
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prompt-encoder")
        address = f"inproc://prompt-encoder-{next(_addresses)}"
        self.wake = ctx.socket(zmq.PULL)  # the loop polls it; read only by the loop's thread
        self.wake.bind(address)
        self._notify = ctx.socket(zmq.PUSH)  # written only by the encoding thread
        self._notify.connect(address)
        self._done: deque[tuple[int, list[int] | Exception]] = deque()
        self.in_flight = 0

    def submit(self, job: EncodeJob) -> None:
        self.in_flight += 1
        self._executor.submit(self._run, job)

    def _run(self, job: EncodeJob) -> None:
        result: list[int] | Exception
        try:
            result = self._encode(job.text, job.add_special_tokens)
        except Exception as exc:  # the loop turns it into the request's rejection
            result = exc
        self._done.append((job.rid, result))
        self._notify.send(b"")

    def finished(self) -> list[tuple[int, list[int] | Exception]]:
        """The jobs done since the last call: (rid, ids or the encode's exception)."""
        while True:
            try:
                self.wake.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
        done = []
        while self._done:
            done.append(self._done.popleft())
        self.in_flight -= len(done)
        return done

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._notify.close(linger=0)
        self.wake.close(linger=0)
