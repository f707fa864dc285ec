"""A sans-IO Server-Sent Events parser: bytes in, complete events out.

Follows the WHATWG grammar: lines end in CRLF, LF or CR; an empty line dispatches the event; ``data`` lines join
with ``\\n``; lines starting with ``:`` are comments. Input may be split at any byte, including inside a
multi-byte UTF-8 sequence or between the CR and LF of one line ending: bytes are only decoded once an event is
complete, and invalid UTF-8 becomes U+FFFD rather than an exception.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Event:
    """One dispatched event. ``event`` is None when the stream named none (the default ``message``)."""

    event: str | None
    data: str


class SSEParser:
    """Feed bytes with :meth:`feed`; it returns the events that became complete.

    Memory is bounded by the longest single event in the stream; :meth:`pending` says how many bytes wait.
    """

    def __init__(self) -> None:
        self._buffer = b""
        self._event: str | None = None
        self._data: list[bytes] = []
        self._has_data = False
        self._skip_lf = False

    def pending(self) -> int:
        return len(self._buffer) + sum(len(d) for d in self._data)

    def feed(self, chunk: bytes) -> list[Event]:
        if not chunk:  # an empty read between the CR and LF of one line ending must not forget the CR
            return []
        if self._skip_lf and chunk[:1] == b"\n":
            chunk = chunk[1:]
        self._skip_lf = False
        buffer = self._buffer + chunk
        events: list[Event] = []
        start = 0
        n = len(buffer)
        while start < n:
            # A CR only matters before the next LF: bounding its search keeps a big chunk linear, not quadratic.
            lf = buffer.find(b"\n", start)
            cr = buffer.find(b"\r", start, lf if lf != -1 else n)
            if cr == -1 and lf == -1:
                break
            if cr == -1 or (lf != -1 and lf < cr):
                end, nxt = lf, lf + 1
            else:
                end = cr
                if cr + 1 < n:
                    nxt = cr + 2 if buffer[cr + 1:cr + 2] == b"\n" else cr + 1
                else:
                    nxt = cr + 1
                    self._skip_lf = True
            self._line(buffer[start:end], events)
            start = nxt
        self._buffer = buffer[start:]
        return events

    def _line(self, line: bytes, events: list[Event]) -> None:
        if not line:
            if self._has_data:
                data = b"\n".join(self._data).decode("utf-8", "replace")
                events.append(Event(self._event, data))
            self._event, self._data, self._has_data = None, [], False
            return
        if line[:1] == b":":
            return
        name, sep, value = line.partition(b":")
        if sep and value[:1] == b" ":
            value = value[1:]
        if name == b"data":
            self._data.append(value)
            self._has_data = True
        elif name == b"event":
            self._event = value.decode("utf-8", "replace")


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
