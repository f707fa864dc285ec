"""A sans-IO Server-Sent Events scanner: bytes in, complete event blocks out, each with its parsed event.

Follows the WHATWG grammar: lines end in CRLF, LF or CR; an empty line dispatches the event; ``data`` lines join
with ``\\n``; lines starting with ``:`` are comments. Input may be split at any byte, including inside a
multi-byte UTF-8 sequence or between the CR and LF of one line ending: bytes are only decoded once a line is
complete (a line ending is ASCII, so never inside a character), and invalid UTF-8 becomes U+FFFD rather than an
exception.

:class:`SSEScanner` is the one scanner: it hands out each event as a :class:`Block`, its bytes exactly as they
came (to send on unchanged) beside the event they hold (to read), both from one pass over the input.
:class:`SSEParser` is the same scanner for readers that want only the events.
"""

from __future__ import annotations

import codecs
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ..bigtext import SLICE, concat
from . import limits


@dataclass(frozen=True)
class Event:
    """One dispatched event. ``event`` is None when the stream named none (the default ``message``)."""

    event: str | None
    data: str


class Block:
    """The bytes of one event block as they came (its lines and the blank line that ends it) and its event, or
    None for a block with no data (a comment such as a keep-alive, a lone blank line).

    A big block keeps its bytes as the pieces they came in (:attr:`pieces`), never joined: they are only sent on,
    and joining 100 MB is one step that holds the interpreter (and so every session's event loop) for a tenth of
    a second. :attr:`raw` joins them for a reader that wants one ``bytes``.
    """

    __slots__ = ("pieces", "size", "event")

    def __init__(self, raw: bytes | list[bytes], event: Event | None) -> None:
        self.pieces: list[bytes] = [raw] if isinstance(raw, bytes) else raw
        self.size = sum(map(len, self.pieces))
        self.event = event

    @property
    def raw(self) -> bytes:
        return self.pieces[0] if len(self.pieces) == 1 else b"".join(self.pieces)

    def is_bytes(self, data: bytes) -> bool:
        """Whether the block's bytes are ``data`` (without joining a big block's pieces)."""
        return self.size == len(data) and self.raw == data

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Block) and (self.raw, self.event) == (other.raw, other.event)

    __hash__ = None  # type: ignore[assignment]  # (mutable pieces: compared by value, never hashed)

    def __repr__(self) -> str:
        return f"Block({self.raw[:80]!r}{'...' if self.size > 80 else ''}, {self.event!r})"


JOIN_LIMIT = 1024 * 1024
"""A block of more bytes than this keeps its pieces (:class:`Block`)."""


class EventTooLarge(ValueError):
    """An event grew past the scanner's limit (a line that never ends counts as it grows). ``complete`` holds
    what the same feed completed before it (blocks, or events for :class:`SSEParser`), so nothing before it is
    lost."""

    def __init__(self, limit: int, complete: list[Any]) -> None:
        super().__init__(f"upstream stream has an event larger than {limit} bytes")
        self.limit = limit
        self.complete = complete


def next_line_end(chunk: bytes, pos: int) -> tuple[int, int]:
    """(where the first line ending at or after ``pos`` starts, where the next line starts), or (-1, -1).

    A CR at the very end of ``chunk`` counts as a line ending of its own; whether an LF follows it is for the
    next chunk to say. Only the bytes from ``pos`` to the first LF are looked at, so a scan is linear.
    """
    n = len(chunk)
    lf = chunk.find(b"\n", pos)
    cr = chunk.find(b"\r", pos, lf if lf >= 0 else n)
    if cr < 0:
        return (lf, lf + 1) if lf >= 0 else (-1, -1)
    return cr, cr + 2 if cr + 1 < n and chunk[cr + 1] == 0x0A else cr + 1


def feed_cost(pending: int, chunk: bytes) -> int:
    """Bytes that feeding ``chunk`` to a scanner holding ``pending`` bytes may copy and hand on: all of them when
    ``chunk`` ends a line (it may complete the event), else only ``chunk``'s."""
    return pending + len(chunk) if b"\n" in chunk or b"\r" in chunk else len(chunk)


class SSEScanner:
    """Feed bytes with :meth:`feed`; it returns the event blocks that became complete, in order.

    Each byte is scanned once and copied a bounded number of times however the input is split (the unfinished
    block and line are kept as lists of pieces, joined once), so the work per event is linear in its size, and
    the blocks' bytes joined are the input's. One block may hold at most ``max_event`` bytes (default
    :data:`~.limits.MAX_BUFFERED_BODY`; a line that never ends counts as it grows): past that :meth:`feed` raises
    :class:`EventTooLarge`. A blank line ended by a CR completes its block at once; an LF that then starts the
    next chunk belongs to that line ending and goes out as a block of its own, with no event.
    """

    def __init__(self, max_event: int | None = None) -> None:
        self.max_event = limits.MAX_BUFFERED_BODY if max_event is None else max_event
        self._raw: list[bytes] = []  # the unfinished block's bytes
        self._size = 0
        self._line: list[Any] = []  # pieces (memoryviews) of the unfinished line
        self._event: str | None = None
        self._data: list[str] = []
        self._has_data = False
        self._skip_lf = False  # the last chunk ended in a CR: an LF starting the next one belongs to it

    @property
    def pending(self) -> int:
        """Bytes of the unfinished block held."""
        return self._size

    def feed(self, chunk: bytes) -> list[Block]:
        """The blocks ``chunk`` completed.

        Raises:
            EventTooLarge: the unfinished block passed ``max_event`` bytes (the blocks before it are in the
                exception); the scanner is then spent.
        """
        if not chunk:  # an empty read between the CR and LF of one line ending must not forget the CR
            return []
        blocks: list[Block] = []
        n = len(chunk)
        start = pos = 0  # chunk[:start] went out in blocks; pos is where the next line starts
        if self._skip_lf and chunk[0] == 0x0A:
            pos = 1
            if not self._raw:  # the CR ended a block, which went out: so does its LF
                blocks.append(Block(b"\n", None))
                start = 1
        self._skip_lf = False
        view = memoryview(chunk)
        while pos < n:
            end, nxt = next_line_end(chunk, pos)
            if end < 0:
                break
            if self._size + end - start > self.max_event:
                self._spend(blocks)
            if self._line or end > pos:
                self._line.append(view[pos:end])
                self._take(self._line)
                self._line = []
            else:  # a blank line: the block is complete
                self._raw.append(chunk if start == 0 and nxt == n else chunk[start:nxt])
                self._size += nxt - start
                blocks.append(self._complete())
                start = nxt
            self._skip_lf = nxt == end + 1 == n and chunk[end] == 0x0D  # its LF may start the next chunk
            pos = nxt
        if pos < n:
            self._line.append(view[pos:])
        if start < n:
            self._raw.append(chunk if start == 0 else chunk[start:])
            self._size += n - start
        if self._size > self.max_event:
            self._spend(blocks)
        return blocks

    def finish(self) -> bytes:
        """At the end of the input, once: the bytes of an unfinished event, empty when the input stopped between
        events."""
        raw = b"".join(self._raw)
        self._raw, self._size, self._line = [], 0, []
        self._event, self._data, self._has_data, self._skip_lf = None, [], False, False
        return raw

    def _spend(self, blocks: list[Block]) -> None:
        self._raw, self._size, self._line, self._data = [], 0, [], []
        raise EventTooLarge(self.max_event, blocks)

    def _complete(self) -> Block:
        raw: bytes | list[bytes] = self._raw
        if len(self._raw) == 1 or self._size <= JOIN_LIMIT:
            raw = self._raw[0] if len(self._raw) == 1 else b"".join(self._raw)
        event = None
        if self._has_data:
            data = self._data[0] if len(self._data) == 1 else concat(_lines(self._data))
            event = Event(self._event, data)
        self._raw, self._size = [], 0
        self._event, self._data, self._has_data = None, [], False
        return Block(raw, event)

    def _take(self, line: list[Any]) -> None:
        """The non-empty line whose bytes are the buffers ``line`` in order: a field the scanner keeps is decoded
        from them where they lie (never joined as bytes first: a big data line is decoded, then copied once)."""
        head = bytes(line[0][:7])  # the field name and what follows it: "event: " is 7 bytes
        for part in line[1:]:
            if len(head) == 7:
                break
            head += bytes(part[:7 - len(head)])
        if head[0] == 0x3A:  # ":" starts a comment
            return
        colon = head.find(b":")
        name = head if colon < 0 else head[:colon]
        if name not in (b"data", b"event"):  # (a name without a colon is the whole line: head holds it)
            return
        skip = len(head) if colon < 0 else colon + 2 if head[colon + 1:colon + 2] == b" " else colon + 1
        value = decode(line, skip)
        if name == b"data":
            self._data.append(value)
            self._has_data = True
        else:
            self._event = value


class SSEParser:
    """:class:`SSEScanner` for a reader that wants only the events: :meth:`feed` returns those ``chunk``
    completed (raising :class:`EventTooLarge` with the events before it), :meth:`pending` the bytes held."""

    def __init__(self, max_event: int | None = None) -> None:
        self._scanner = SSEScanner(max_event)

    def pending(self) -> int:
        return self._scanner.pending

    def feed(self, chunk: bytes) -> list[Event]:
        try:
            blocks = self._scanner.feed(chunk)
        except EventTooLarge as exc:
            raise EventTooLarge(exc.limit, events(exc.complete)) from None
        return events(blocks)


def events(blocks: list[Block]) -> list[Event]:
    """The events of ``blocks``, in order."""
    return [block.event for block in blocks if block.event is not None]


def decode(parts: list[Any], skip: int = 0) -> str:
    """The text of the bytes-like ``parts`` joined, less their first ``skip`` bytes: UTF-8, an invalid sequence
    read as U+FFFD. Big input is decoded :data:`DECODE_SLICE` bytes at a time and the text built a slice at a time
    (:func:`~proxyvisor.bigtext.concat`), so no single step (which holds Python's interpreter lock) covers all of
    it."""
    views = []
    for part in parts:
        view = memoryview(part)
        views.append(view[skip:])
        skip = max(0, skip - len(view))
    if len(views) == 1 and len(views[0]) <= DECODE_SLICE:
        return str(views[0], "utf-8", "replace")
    return concat(_decoded(views))


def _decoded(views: list[memoryview]) -> Iterator[str]:
    """The text of ``views`` (as :func:`decode` reads them), :data:`DECODE_SLICE` bytes at a time."""
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    for view in views:
        for start in range(0, len(view), DECODE_SLICE):
            yield decoder.decode(view[start:start + DECODE_SLICE])
    yield decoder.decode(b"", final=True)


def _lines(data: list[str]) -> Iterator[str]:
    """The data lines of one event with the ``\\n`` that joins them between each two."""
    for n, line in enumerate(data):
        if n:
            yield "\n"
        yield line


DECODE_SLICE = SLICE
"""Bytes decoded per step: a step makes a text of at most as many characters (:data:`proxyvisor.bigtext.SLICE`)."""


def last_event_start(chunk: bytes) -> int:
    """Where the last event that starts inside ``chunk`` begins (just after a blank line, with more than line
    endings after it), or -1 when none starts inside it (``chunk`` goes on with an event begun before it, or holds
    one event from its first byte: :func:`at_event_end` of what came before tells those apart).

    Looked for from the end, a line at a time, so the cost is the last event's size, not the chunk's: cheap enough
    for the byte relay's every chunk.
    """
    end = len(chunk)
    while end and chunk[end - 1] in (0x0A, 0x0D):
        end -= 1
    if b"\r" not in chunk:  # LF line endings, as every provider sends: one search
        blank = chunk.rfind(b"\n\n", 0, end)
        return blank + 2 if blank >= 0 else -1
    pos = end
    while True:
        eol = max(chunk.rfind(b"\n", 0, pos), chunk.rfind(b"\r", 0, pos))
        if eol < 0:
            return -1
        run = eol
        while run and chunk[run - 1] in (0x0A, 0x0D):
            run -= 1
        if chunk[run:eol + 1] not in (b"\n", b"\r", b"\r\n"):  # two line endings: a blank line
            return eol + 1
        pos = run


def at_event_end(data: bytes) -> bool:
    """Whether a stream whose last bytes are ``data`` (non-empty) stops right after an event's blank line.

    Only the tail is looked at: the check is O(1), cheap enough for the byte relay. A CRLF is one line ending
    (WHATWG), so ``b"x\\r\\n"`` ends a line, not an event.
    """
    if data.endswith(b"\r\n"):
        rest = data[:-2]
    elif data.endswith((b"\n", b"\r")):
        rest = data[:-1]
    else:
        return False
    return not rest or rest.endswith((b"\n", b"\r"))
