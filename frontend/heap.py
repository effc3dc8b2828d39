"""A frontend keeps the heap memory that large request bodies freed, for the next ones.

A large body passes through several buffers of its size on the event loop (uvloop's reads, uvicorn's bytearray
and its bytes copy, Starlette's join). glibc's malloc serves them from the heap once one as large was freed
(its mmap threshold follows the largest block freed, up to 32 MiB), but hands the heap's top back to the kernel
whenever more than twice that lies free there, so every burst of large bodies faulted its memory in again, page
by page, on the loop's thread: eight 16 MiB bodies posted at once were up to 60,000 minor faults, and the
loop's CPU for them 170-330 ms on a 2-core machine (docs/notes/benchmark-history.md, "Large request bodies").
With the heap's top kept (up to KEPT_FREE_BYTES), a burst after the first faulted almost none, and the loop's
CPU for it was 113-210 ms. The price: after a burst, up to that much freed memory stays resident in the frontend.
"""

from __future__ import annotations

import ctypes

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 * 2**20  # glibc's largest: blocks up to this size come from the heap
KEPT_FREE_BYTES = 256 * 2**20  # free memory at the heap's top kept: ~eight bodies of 16 MiB in flight


def keep_freed_heap() -> bool:
    """Sets glibc's malloc to keep freed heap memory (True), where this process's C library is glibc."""
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is None:  # not glibc: its own policy stays
        return False
    # Either setting alone turns off glibc's moving threshold, which would leave blocks over 128 KiB to mmap.
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(mallopt(M_TRIM_THRESHOLD, KEPT_FREE_BYTES))
