"""The requests waiting for a seat, in the order the scheduling policy (--scheduling-policy) admits them.

    fcfs       arrival order; a preempted request goes back to the front (it arrived before the others)
    priority   by (priority, arrival): a lower priority value first, as vLLM's; arrival order among equals. A
               preempted request goes back to its place by the same key.

The scheduler admits from the front and stops at the first request that cannot be admitted, so the order is
kept whichever policy makes it.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Iterator

from scheduler.request import Request


def priority_key(request: Request) -> tuple[int, int]:
    return request.priority, request.arrival


class WaitingQueue:
    def __init__(self, policy: str = "fcfs"):
        if policy not in ("fcfs", "priority"):
            raise ValueError(f"unknown scheduling policy {policy!r}")
        self.by_priority = policy == "priority"
        self._queue: deque[Request] = deque()

    def __len__(self) -> int:
        return len(self._queue)

    def __bool__(self) -> bool:
        return bool(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)

    def first(self) -> Request:
        return self._queue[0]

    def pop_first(self) -> Request:
        return self._queue.popleft()

    def add(self, request: Request) -> None:
        """A request just arrived."""
        if self.by_priority:
            self._insert(request)
        else:
            self._queue.append(request)

    def add_preempted(self, request: Request) -> None:
        """A running request sent back to wait."""
        if self.by_priority:
            self._insert(request)
        else:
            self._queue.appendleft(request)

    def remove(self, request: Request) -> None:
        self._queue.remove(request)

    def _insert(self, request: Request) -> None:
        queue, key = self._queue, priority_key(request)
        if not queue or priority_key(queue[-1]) <= key:
            queue.append(request)  # the common case: no more urgent than the last
        else:
            queue.insert(bisect.bisect_right(queue, key, key=priority_key), request)
