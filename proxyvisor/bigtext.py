"""Very large strings (a big SSE event's text: 100 MB and more) built, searched and cut in bounded steps.

Each C-level call on a string holds Python's interpreter lock for its whole length: ``"".join`` of 100 MB, a slice
of it, ``in`` over it, 40 to 130 ms each on a loaded machine. Run in a worker thread, such a call still stops the
event loop, which serves every session, for that long. These helpers do the same work a :data:`SLICE` at a time,
and call :func:`pause` between steps, where the thread that runs them may let the loop go first. Pure: no I/O, no
clock; what a pause does is the caller's (:data:`PAUSE`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextvars import ContextVar

SLICE = 256 * 1024
"""Characters handled per step. What bounds a step is less its copying than the fresh memory it touches: each step
makes a slice (a new mapping) and grows the text by one, and every page of those faults in once, which on a newly
booted virtual machine (the host backs each page on first touch) costs 20 to 25 us a page. A step of 1 Mi
characters faulted about 1,000 pages: 2.6 ms here, 24 ms on such a machine; one of 256 Ki characters faults at most
about 130."""

MMAP_THRESHOLD = 256 * 1024
"""The allocation size, in bytes, from which the process's allocator should map memory of its own for each block
(glibc's ``M_MMAP_THRESHOLD``) while big texts are built (the proxy sets it around that work:
``proxyvisor.proxy.allocator.big_blocks_mapped``). :func:`concat` relies on it: a mapped block grows by remapping
its pages, never by a copy. A slice of :data:`SLICE` characters is a block over it (the string's header comes on
top), so that the slices are mapped too: freed, they go back to the system instead of leaving big free regions in
the heap, where the allocator would place a growing text and copy it whole once it outgrows one."""

PAUSE: ContextVar[Callable[[], None] | None] = ContextVar("bigtext_pause", default=None)
"""Called between two steps of the work on one big text, when set (the reply path sets it in its worker thread,
to let the event loop run first: ``proxyvisor.proxy.reply.off_loop``)."""


def pause() -> None:
    """The :data:`PAUSE` of this context, if any: called by each step loop here and by the readers and writers of
    big JSON texts."""
    between = PAUSE.get()
    if between is not None:
        between()


def concat(parts: Iterable[str]) -> str:
    """``"".join(parts)``, built a slice at a time, with a :func:`pause` after each.

    Why it is bounded: CPython appends to a string in place when nothing else refers to it (``text += part`` on a
    local), growing its block with ``realloc``. A block of :data:`MMAP_THRESHOLD` bytes or more is mapped on its own
    (when the process set that threshold), and ``realloc`` grows a mapped block by remapping its pages: each step
    copies one slice. So the text is first joined up to that size (a copy of about a slice), then appended to. A part of a wider character kind than the text so far (an emoji after ASCII text) makes one whole copy at
    that point (at most two per text: 1 to 2 to 4 bytes a character).
    """
    head: list[str] | None = []
    size = 0
    text = ""
    for part in parts:
        for start in range(0, len(part), SLICE):
            piece = part[start:start + SLICE]  # (a part of one slice or less is not copied)
            if head is not None:
                head.append(piece)
                size += len(piece)
                if size >= MMAP_THRESHOLD:
                    text, head = "".join(head), None
            else:
                text += piece
            pause()
    return "".join(head) if head is not None else text


def slices(text: str, stop: int | None = None) -> Iterator[str]:
    """``text[:stop]`` (all of it when ``stop`` is None) as consecutive slices of :data:`SLICE` characters."""
    end = len(text) if stop is None else stop
    return (text[start:min(start + SLICE, end)] for start in range(0, end, SLICE))


def contains(text: str, needle: str) -> bool:
    """``needle in text``, searched a slice at a time."""
    reach = SLICE + len(needle) - 1
    for start in range(0, max(len(text), 1), SLICE):
        if text.find(needle, start, start + reach) >= 0:
            return True
        pause()
    return False


def has_text(text: str) -> bool:
    """``bool(text.strip())`` without copying ``text``: whether it has a character that is not whitespace."""
    for part in slices(text):
        if not part.isspace():
            return True
        pause()
    return False
