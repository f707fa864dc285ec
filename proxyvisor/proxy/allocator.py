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

A big event's objects (its bytes, its text, its rewrite: 128 MB each) are freed by :func:`free_deferred`, a
bounded step at a time, in a worker thread, not where the stream's stages let go of them (:func:`defer_free`):
freed at once, each holds Python's interpreter lock, and so the event loop, for some 50 us per MB.

One arena for every thread (set by :func:`tune`, before threads start: a thread keeps the arena it got): the
interpreter lock already lets one thread allocate at a time, and a worker thread's own arena is a heap where a big
text would be copied as it grows.
"""

from __future__ import annotations

import ctypes
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import trio

from ..bigtext import MMAP_THRESHOLD, pause

HEAP_BLOCKS = 32 * 1024 * 1024
"""Blocks up to this size come from the heap by default: glibc's largest mapping threshold on 64-bit systems."""
KEEP_FREE = 64 * 1024 * 1024
"""Freed memory at the top of the heap kept for later requests rather than given back to the system."""

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
"""glibc's ``mallopt`` parameter numbers (``malloc.h``)."""
_MADV_DONTNEED = 4
_PAGE = 4096
_HEADER = 128
"""Bytes at the start of a ``str`` or ``bytes`` object that its free still reads (its header; the data follows)."""
_STR_STATE = 32
_COMPACT = 1 << 5
"""Where a ``str``'s state bits are (CPython's ``PyASCIIObject``, 64-bit) and its ``compact`` bit among them."""
FREE_STEP = 1024 * 1024
"""Bytes of one big object's pages given back per step of :func:`free_deferred` (some 50 us each)."""

IDLE_S = 10.0
"""Seconds without a request ended or in flight after which :func:`trim_when_idle` gives free memory back."""

_libc: ctypes.CDLL | None = None
_lock = threading.Lock()
_mapping = 0
"""How many works want big blocks mapped (:func:`big_blocks_mapped`) now."""
_deferred: list[str | bytes | list[bytes]] = []
"""Objects :func:`defer_free` keeps until :func:`free_deferred` frees them (guarded by ``_lock``)."""


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
            # On the loop: it is idle, and another thread's allocations would wait for the trim all the same.
            free_deferred()  # what the last streams' stages let go of after their last sweep
            trim()
            trimmed = now
        seen = now


def defer_free(obj: str | bytes | list[bytes]) -> None:
    """Keep ``obj`` (a big text or bytes, or a list of bytes) alive until a :func:`free_deferred` finds nothing
    else refers to it, and frees it there, in steps.

    Freeing 128 MB gives its 32,768 pages back to the system: 6 to 12 ms (some 50 us per MB), in one call that
    holds Python's interpreter lock, wherever the last reference goes away. For a big event's objects that is
    mostly the event loop, as the stages of a stream let go of a batch; in a worker thread it would stop the loop
    all the same. Kept here, they are freed only by :func:`free_deferred`, a bounded step at a time."""
    with _lock:
        if all(kept is not obj for kept in _deferred):  # (kept twice, it would never look unused)
            _deferred.append(obj)


def free_deferred() -> int:
    """Free each object kept by :func:`defer_free` that nothing else refers to any longer (the others stay kept),
    with :func:`~proxyvisor.bigtext.pause` after each step of at most :data:`FREE_STEP` bytes: a list a piece at
    a time, a big text or bytes by giving its pages back (``madvise``) a step at a time before its (then cheap)
    free. Meant for a worker thread (``proxyvisor.proxy.reply.off_loop``). Returns how many objects stay kept."""
    with _lock:
        # (the list's reference, the loop's variable, getrefcount's argument: nothing else)
        unused = [obj for obj in _deferred if sys.getrefcount(obj) == 3]
        freed = {id(obj) for obj in unused}
        _deferred[:] = [obj for obj in _deferred if id(obj) not in freed]
        left = len(_deferred)
    while unused:
        _free_in_steps(unused.pop())
    return left


def deferred_bytes() -> int:
    """About how many bytes :func:`defer_free` keeps now (each list counted by its pieces)."""
    with _lock:
        return sum(sum(map(len, obj)) if isinstance(obj, list) else len(obj) for obj in _deferred)


def _free_in_steps(obj: object) -> None:
    """Free ``obj``, the one reference to it being the caller's argument, in steps (:func:`free_deferred`)."""
    if isinstance(obj, list):
        while obj:
            _free_in_steps(obj.pop())
        return
    if _libc is not None and _contiguous(obj) and sys.getrefcount(obj) == 2:
        # Only this frame refers to it (the argument, popped by the caller, and getrefcount's): its data pages
        # are read by no one again, and its free reads only its header, left alone.
        start = -(-(id(obj) + _HEADER) // _PAGE) * _PAGE
        end = (id(obj) + sys.getsizeof(obj)) // _PAGE * _PAGE
        for at in range(start, end, FREE_STEP):
            _libc.madvise(ctypes.c_void_p(at), ctypes.c_size_t(min(FREE_STEP, end - at)), _MADV_DONTNEED)
            pause()
    del obj
    pause()


def _contiguous(obj: object) -> bool:
    """Whether ``obj`` is a ``bytes`` or a compact ``str`` (as every text Python code makes is): one block, its data
    right after its header, of ``sys.getsizeof(obj)`` bytes in all. (A subclass's or a legacy string's data is a
    block of its own.)"""
    if type(obj) is bytes:
        return True
    return type(obj) is str and bool(ctypes.c_uint32.from_address(id(obj) + _STR_STATE).value & _COMPACT)
