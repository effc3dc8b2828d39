"""A frontend keeps the heap memory that large request bodies freed, for the next ones.

A large body passes through several buffers of its size on the event loop (uvloop's reads, uvicorn's bytearray
and its bytes copy, Starlette's join). glibc's malloc serves them from the heap once one as large was freed
(its mmap threshold follows the largest block freed, up to 32 MiB), but hands the heap's top back to the kernel
whenever more than twice that lies free there, so every burst of large bodies faulted its memory in again, page
by page, on the loop's thread: eight 16 MiB bodies posted at once were up to 60,000 minor faults, and the
loop's CPU for them 170-330 ms on a 2-core machine (docs/notes/benchmark-history.md, "Large request bodies").
With the heap's top kept (up to KEPT_FREE_BYTES), a burst after the first faulted almost none, and the loop's
CPU for it was 113-210 ms. The price: after a burst, up to that much freed memory stays resident in the frontend.

The first burst after start still faulted its memory in (40,000-49,000 pages for eight 16 MiB bodies): so the
frontend faults in, at start, the heap that BODIES_IN_FLIGHT bodies at the size limit take, and frees it to the
kept top (pre_fault_heap, ~90 ms). That burst then faulted under 100 pages and the loop's CPU for it fell from
204-245 ms to 142-163 ms. The price: that memory is resident from the start (the frontend's RSS ~250 MiB
instead of ~60 at the default limit), where before the first large burst left it resident.
"""

from __future__ import annotations

import ctypes

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 * 2**20  # glibc's largest: blocks up to this size come from the heap
KEPT_FREE_BYTES = 256 * 2**20  # free memory at the heap's top kept: ~eight bodies of 16 MiB in flight
BODIES_IN_FLIGHT = 8  # bodies at the size limit whose heap is faulted in at start
HEAP_PER_BODY = 1.5  # heap per byte of body in flight, its buffers on the loop overlapping (eight at once: 1.3-1.5)
PRE_FAULT_BLOCK_BYTES = 8 * 2**20  # under MMAP_THRESHOLD_BYTES: from the heap, not a mapping of its own


def keep_freed_heap() -> bool:
    """Sets glibc's malloc to keep freed heap memory (True), where this process's C library is glibc."""
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is None:  # not glibc: its own policy stays
        return False
    # Either setting alone turns off glibc's moving threshold, which would leave blocks over 128 KiB to mmap.
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(mallopt(M_TRIM_THRESHOLD, KEPT_FREE_BYTES))


def heap_for_bodies(max_body_bytes: int) -> int:
    """The heap that BODIES_IN_FLIGHT bodies of `max_body_bytes` take at once, within what the heap keeps (with a
    margin for what else lies free at its top: past KEPT_FREE_BYTES, glibc would hand it all back)."""
    return min(int(BODIES_IN_FLIGHT * HEAP_PER_BODY * max_body_bytes), KEPT_FREE_BYTES * 3 // 4)


def pre_fault_heap(total_bytes: int) -> int:
    """Grows the heap by `total_bytes`, writing every page, then frees it to the heap's top, where (with
    keep_freed_heap) it stays: resident before large bodies need it. Returns the bytes faulted in. Call it on
    the main thread: others allocate from arenas of their own."""
    libc = ctypes.CDLL(None)
    malloc, free = libc.malloc, libc.free
    malloc.restype, malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    free.restype, free.argtypes = None, [ctypes.c_void_p]
    blocks: list[int] = []
    try:
        while len(blocks) * PRE_FAULT_BLOCK_BYTES < total_bytes:
            block = malloc(PRE_FAULT_BLOCK_BYTES)
            if not block:
                break
            blocks.append(block)
            ctypes.memset(block, 0, PRE_FAULT_BLOCK_BYTES)  # written: a read would map the shared zero page
    finally:
        for block in reversed(blocks):  # the last first: each joins the heap's top as it is freed
            free(block)
    return len(blocks) * PRE_FAULT_BLOCK_BYTES
