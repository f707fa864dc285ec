"""Rewriting an SSE stream on the fly while keeping every event that needs no change byte-identical.

:class:`EventSplitter` cuts raw bytes into complete event blocks (sans-IO; any split, CRLF/CR/LF line endings);
:class:`EditedStream` runs each block past a format's :class:`~.formats.transcript.StreamEditor` and forwards it
as soon as it is complete, so an edited stream adds no buffering beyond one event. Comments (keep-alives such as
``: ping``) and events the editor leaves alone pass through as the upstream sent them.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import trio

from .formats.transcript import StreamEditor
from .relay import UpstreamError
from .sse import SSEParser


class EventSplitter:
    """Feed bytes; get back each complete event block (its lines and the blank line ending it), in order."""

    def __init__(self) -> None:
        self._buf = b""
        self._pos = 0  # where the next unread line starts in _buf

    def feed(self, chunk: bytes) -> list[bytes]:
        buf = self._buf + chunk if self._buf else chunk
        blocks: list[bytes] = []
        start, pos, n = 0, self._pos, len(buf)
        while pos < n:
            # A CR only matters before the next LF: bounding its search keeps a big chunk linear, not quadratic.
            lf = buf.find(b"\n", pos)
            cr = buf.find(b"\r", pos, lf if lf >= 0 else n)
            if cr < 0 and lf < 0:
                break
            if cr < 0 or 0 <= lf < cr:
                end, nxt = lf, lf + 1
            elif cr + 1 == n:
                break  # a CR at the end may be the first half of a CRLF
            else:
                end, nxt = cr, cr + 2 if buf[cr + 1] == 0x0A else cr + 1
            if end == pos:  # a blank line ends the event
                blocks.append(buf[start:nxt])
                start = nxt
            pos = nxt
        self._buf, self._pos = buf[start:], pos - start
        return blocks

    def rest(self) -> bytes:
        """Bytes of an unfinished last event (a stream cut short), returned once."""
        rest, self._buf, self._pos = self._buf, b"", 0
        return rest


Observer = Callable[[str | None, str], None]
"""Sees each upstream event (its name, its data) before the editor does."""


def edit_blocks(blocks: list[bytes], editor: StreamEditor, parser: SSEParser | None = None,
                observe: Observer | None = None) -> bytes:
    """The bytes to send for ``blocks``: each event's replacement from ``editor``, or the block itself.

    ``parser`` may be one kept across calls (fed whole event blocks, it holds nothing between them); ``observe``
    sees each event as the upstream sent it.
    """
    parser = parser if parser is not None else SSEParser()
    out: list[bytes] = []
    for block in blocks:
        events = parser.feed(block)
        replaced = None
        if events:
            name, data = events[0].event, events[0].data
            if observe is not None:
                observe(name, data)
            replaced = editor.event(name, data)
        out.append(block if replaced is None else b"".join(replaced))
    return b"".join(out)


class EditedStream:
    """An upstream stream (a ``RelayedStream`` or any async iterable of bytes) rewritten by ``editor``.

    ``error`` is the inner stream's (or says the stream stopped inside an event); ``last_chunk`` is the last bytes
    sent. ``on_end(complete)`` runs once when iteration stops: ``complete`` is True when the upstream stream ended
    normally and everything was sent. The inner stream is closed whatever happens, also when the client goes away
    mid-stream. :attr:`observe`, when set before iterating, sees each complete upstream event: a reader of the
    stream (the pipeline's usage) that need not parse the bytes a second time.
    """

    def __init__(self, inner: Any, editor: StreamEditor, on_end: Callable[[bool], None]) -> None:
        self.inner = inner
        self.editor = editor
        self.on_end = on_end
        self.observe: Observer | None = None
        self.last_chunk = b""
        self.cut_short = False
        """The stream stopped inside an event; its bytes were held back (:attr:`error` then says so)."""

    @property
    def error(self) -> Any:
        error = getattr(self.inner, "error", None)
        if error is None and self.cut_short:
            return UpstreamError(502, "upstream stream ended in the middle of an event")
        return error

    async def __aiter__(self) -> AsyncIterator[bytes]:
        splitter, parser = EventSplitter(), SSEParser()
        iterator = self.inner.__aiter__()
        complete = False
        try:
            async for chunk in iterator:
                out = edit_blocks(splitter.feed(chunk), self.editor, parser, self.observe)
                if out:
                    self.last_chunk = out
                    yield out
            if splitter.rest():
                # Half an event is held back: the client's SDK would drop it silently or choke on it, while the
                # format's error event that follows (the pipeline sends it) is an error it reports.
                self.cut_short = True
            else:
                tail = b"".join(self.editor.close())
                if tail:
                    self.last_chunk = tail
                    yield tail
            complete = self.error is None
        finally:
            self.on_end(complete)
            aclose = getattr(iterator, "aclose", None)
            if aclose is not None:
                with trio.CancelScope(shield=True):
                    await aclose()
