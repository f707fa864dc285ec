"""The C allocator's settings in the proxy process (glibc's ``malloc``; with another C library nothing is done).

Two needs pull apart, so the setting changes with the work:

- **Requests**: an agent sends its whole history, MBs, on every request, and the proxy allocates and frees a few
  blocks of that size for each (the body joined, its serialisation upstream). A block the allocator maps on its own
  is unmapped when freed, and the next request's faults in every page again: about 2.5 us a page on a 2-core
  virtual machine (0.6 ms per MB per block), 20 to 25 us on a newly booted one, where the host backs each page on
  first touch. So, by default (:func:`tune`), blocks up to :data:`HEAP_BLOCKS` come from the heap, and up to
  :data:`KEEP_FREE` of freed memory at its top is kept rather than given back: a request's big blocks reuse pages
  that are already there (the supervised proxy's own CPU per MB of history about halved: bench/RESULTS.md).
- **Big events** (an SSE event of MBs, :mod:`proxyvisor.bigtext`): its text is built by appending slices to it in
  place, and in the heap a growing block that runs into another is copied whole (15 ms on 30 MB, holding the
  interpreter lock, so the event loop that serves every session waits); a block mapped on its own grows by
  remapping its pages instead. So while such work runs (:func:`big_blocks_mapped`), every block of
  :data:`proxyvisor.bigtext.MMAP_THRESHOLD` bytes or more is mapped.

Between bursts (:func:`trim_when_idle`), what the heap holds free is given back: MB-sized blocks freed in the
middle of the heap, among smaller live ones, are never at its top, so a proxy that served big histories to several
sessions at once kept GBs it no longer used (2.5 GB resident for some 300 MB in use, after a load of 4 sessions of
1-28 MB histories and 100 MB events; 610 MB after a trim).

One arena for every thread (set by :func:`tune`, before threads start: a thread keeps the arena it got): the
interpreter lock already lets one thread allocate at a time, and a worker thread's own arena is a heap where a big
text would be copied as it grows.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import trio

from ..bigtext import MMAP_THRESHOLD

HEAP_BLOCKS = 32 * 1024 * 1024
"""Blocks up to this size come from the heap by default: glibc's largest mapping threshold on 64-bit systems."""
KEEP_FREE = 64 * 1024 * 1024
"""Freed memory at the top of the heap kept for later requests rather than given back to the system."""

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
"""glibc's ``mallopt`` parameter numbers (``malloc.h``)."""

IDLE_S = 10.0
"""Seconds without a request ended or in flight after which :func:`trim_when_idle` gives free memory back."""

_libc: ctypes.CDLL | None = None
_lock = threading.Lock()
_mapping = 0
"""How many works want big blocks mapped (:func:`big_blocks_mapped`) now."""


def tune() -> None:
    """Set the proxy's default (module docstring). Call it before threads start."""
    global _libc
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # no mallopt: another C library, with its own allocator
        return
    if mallopt(_M_MMAP_THRESHOLD, HEAP_BLOCKS) and mallopt(_M_TRIM_THRESHOLD, KEEP_FREE):
        mallopt(_M_ARENA_MAX, 1)
        _libc = libc


@contextmanager
def big_blocks_mapped() -> Iterator[None]:
    """Within the block, the allocator maps each block of :data:`~proxyvisor.bigtext.MMAP_THRESHOLD` bytes or more on
    its own (for every thread of the process: the setting is global), as building a big text needs (module
    docstring); the default again once no work wants it. Nothing when :func:`tune` did not set the allocator.

    The allocator maps a block only when its heap has no room for it, so the free memory kept at the heap's top is
    given back first (:func:`trim`, some 0.1 ms). A free region inside the heap (a big block freed while later
    ones live) can still take a big text's start: it is copied once when it outgrows the region (a copy of that
    region's size), then grows by remapping."""
    global _mapping
    if _libc is None:
        yield
        return
    with _lock:
        _mapping += 1
        if _mapping == 1:
            _libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)
            trim()
    try:
        yield
    finally:
        with _lock:
            _mapping -= 1
            if not _mapping:
                _libc.mallopt(_M_MMAP_THRESHOLD, HEAP_BLOCKS)


def trim() -> None:
    """Give the heap's free memory back to the system (``malloc_trim``: its free top, and the pages of free blocks
    inside it); nothing when :func:`tune` did not set the allocator. It holds the allocator for its time (some
    70 ms per GB free): every thread's allocations wait."""
    if _libc is not None:
        _libc.malloc_trim(0)


async def trim_when_idle(in_flight: Callable[[], int], ended: Callable[[], int]) -> None:
    """Run until cancelled: :func:`trim` once the proxy has served requests (``ended``: how many have ended so
    far) and then been idle for :data:`IDLE_S` (no request in flight, none ended), and not again before it serves
    more. Between a request's end and the trim, the next request meets the memory the last ones freed."""
    trimmed = seen = ended()
    while True:
        await trio.sleep(IDLE_S)
        now = ended()
        if now == seen and now != trimmed and not in_flight():
            trim()  # on the loop: it is idle, and another thread's allocations would wait for the trim all the same
            trimmed = now
        seen = now
