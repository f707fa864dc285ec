"""A sans-IO Server-Sent Events parser: bytes in, complete events out.

Follows the WHATWG grammar: lines end in CRLF, LF or CR; an empty line dispatches the event; ``data`` lines join
with ``\\n``; lines starting with ``:`` are comments. Input may be split at any byte, including inside a
multi-byte UTF-8 sequence or between the CR and LF of one line ending: bytes are only decoded once a line is
complete (a line ending is ASCII, so never inside a character), and invalid UTF-8 becomes U+FFFD rather than an
exception.
"""

from __future__ import annotations

import codecs
from dataclasses import dataclass
from typing import Any

from . import limits


@dataclass(frozen=True)
class Event:
    """One dispatched event. ``event`` is None when the stream named none (the default ``message``)."""

    event: str | None
    data: str


class EventTooLarge(ValueError):
    """An event grew past the parser's limit (a line that never ends counts as it grows). ``complete`` holds
    what the same feed completed before it (events or blocks, in order), so nothing before it is lost."""

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
    """Bytes that feeding ``chunk`` to a parser or splitter holding ``pending`` bytes may copy and hand on: all
    of them when ``chunk`` ends a line (it may complete the event), else only ``chunk``'s."""
    return pending + len(chunk) if b"\n" in chunk or b"\r" in chunk else len(chunk)


class SSEParser:
    """Feed bytes with :meth:`feed`; it returns the events that became complete.

    Each byte is scanned and copied a bounded number of times however the input is split (an unfinished line is
    kept as a list of pieces, joined once), so the work per event is linear in its size. One event may hold at
    most ``max_event`` bytes (default :data:`~.limits.MAX_BUFFERED_BODY`), its data lines and any unfinished line
    counted: past that :meth:`feed` raises :class:`EventTooLarge`. :meth:`pending` says how many bytes wait.
    """

    def __init__(self, max_event: int | None = None) -> None:
        self.max_event = limits.MAX_BUFFERED_BODY if max_event is None else max_event
        self._line: list[bytes] = []  # pieces of the unfinished last line
        self._line_size = 0
        self._event: str | None = None
        self._data: list[bytes] = []
        self._data_size = 0
        self._has_data = False
        self._skip_lf = False

    def pending(self) -> int:
        return self._line_size + self._data_size

    def feed(self, chunk: bytes) -> list[Event]:
        """The events ``chunk`` completed.

        Raises:
            EventTooLarge: the current event passed ``max_event`` bytes (the events before it are in the
                exception); the parser is then spent.
        """
        if not chunk:  # an empty read between the CR and LF of one line ending must not forget the CR
            return []
        start = 1 if self._skip_lf and chunk[:1] == b"\n" else 0
        self._skip_lf = False
        events: list[Event] = []
        n = len(chunk)
        while start < n:
            end, nxt = next_line_end(chunk, start)
            if end < 0:
                break
            self._skip_lf = nxt == end + 1 == n and chunk[end] == 0x0D  # its LF may start the next chunk
            if self._data_size + self._line_size + end - start > self.max_event:
                self._spend(events)
            if self._line:
                self._line.append(memoryview(chunk)[start:end])
                self._take(self._line)
                self._line, self._line_size = [], 0
            elif start == end:
                self._dispatch(events)
            else:
                self._take([memoryview(chunk)[start:end]])
            start = nxt
        if start < n:
            self._line.append(chunk[start:])
            self._line_size += n - start
        if self.pending() > self.max_event:
            self._spend(events)
        return events

    def _spend(self, events: list[Event]) -> None:
        self._line, self._data, self._line_size, self._data_size = [], [], 0, 0
        raise EventTooLarge(self.max_event, events)

    def _dispatch(self, events: list[Event]) -> None:
        """A blank line: the event so far, if it has data, is complete."""
        if self._has_data:
            events.append(Event(self._event, self._data[0] if len(self._data) == 1 else "\n".join(self._data)))
        self._event, self._data, self._data_size, self._has_data = None, [], 0, False

    def _take(self, line: list[Any]) -> None:
        """The non-empty line whose bytes are the buffers ``line`` in order: a field the parser keeps is decoded
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
            self._data_size += sum(map(len, line)) - skip + 1
            self._has_data = True
        else:
            self._event = value


def decode(parts: list[Any], skip: int = 0) -> str:
    """The text of the bytes-like ``parts`` joined, less their first ``skip`` bytes: UTF-8, an invalid sequence
    read as U+FFFD. Big input is decoded :data:`DECODE_SLICE` bytes at a time, so no single step (which holds
    Python's interpreter lock) covers all of it; only joining the text is one step."""
    views = []
    for part in parts:
        view = memoryview(part)
        views.append(view[skip:])
        skip = max(0, skip - len(view))
    if len(views) == 1 and len(views[0]) <= DECODE_SLICE:
        return str(views[0], "utf-8", "replace")
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    text = [decoder.decode(view[i:i + DECODE_SLICE]) for view in views for i in range(0, len(view), DECODE_SLICE)]
    text.append(decoder.decode(b"", final=True))
    return "".join(text)


DECODE_SLICE = 1024 * 1024


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
