"""How many steps are in flight at once: one number, from which every ring and limit that depends on it
is derived.

    scheduler:  plan N+1 is sent while step N runs           at most PIPELINE_DEPTH plans without a result
    worker:     launch N+1, then finish N                    at most PIPELINE_DEPTH launched, unfinished steps
    host rings: a pinned buffer per step in flight, plus the one being filled       PIPELINE_DEPTH + 1
    mirrors:    a request whose last sample is planned gives its seat away at once, but the worker keeps its
                mirror until the plan that releases it: that plan is made after the result, PIPELINE_DEPTH
                plans later, so each step in flight may hold up to a seat's worth of such mirrors

Raising the depth raises all of them together; nothing else assumes a value (the worker's persistent batch
accepts a decode up to PIPELINE_DEPTH - 1 steps ahead of the tokens its host holds). Depth 3 passes the CUDA
tests but was slower on an H200 (GPT-2 W1 through HTTP, 3 runs each: 68k tok/s against 79k at depth 2;
docs/notes/benchmark-history.md), and later the same under Poisson arrivals (GPT-2 sweep on one H200, ecbc958:
goodput 1,000 req/s and saturation within 0.5 % at either depth; docs/benchmarks.md), so the depth stays 2.
"""

from __future__ import annotations

PIPELINE_DEPTH = 2


def host_ring_size() -> int:
    """Pinned host buffers a per-step copy cycles through: one per step in flight, plus the one being
    filled, so a buffer whose copy is still queued on the device is never rewritten."""
    return PIPELINE_DEPTH + 1


def max_live_mirrors(max_num_seqs: int) -> int:
    """Requests the worker mirrors at once: the seated ones, plus those whose last token is in flight
    (seat already given away, mirror released with a plan up to PIPELINE_DEPTH - 1 steps later)."""
    return PIPELINE_DEPTH * max_num_seqs
