"""Rewriting an SSE stream on the fly while keeping every event that needs no change byte-identical.

:class:`EventSplitter` cuts raw bytes into complete event blocks (sans-IO; any split, CRLF/CR/LF line endings);
:class:`EditedStream` runs each block past a format's :class:`~proxyvisor.transcript.StreamEditor` and forwards it
as soon as it is complete, so an edited stream adds no buffering beyond one event. Comments (keep-alives such as
``: ping``) and events the editor leaves alone pass through as the upstream sent them.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import trio

from ..transcript import StreamEditor
from .relay import UpstreamError
from . import limits
from .sse import EventTooLarge, SSEParser, feed_cost, next_line_end

T = TypeVar("T")


class EventSplitter:
    """Feed bytes; get back each complete event block (its lines and the blank line ending it), in order.

    The unfinished event is kept as a list of pieces and only new bytes are scanned, so each byte is looked at
    and copied a bounded number of times: the work per event is linear in its size, however it was split. One
    event may hold at most ``max_event`` bytes (default :data:`~.limits.MAX_BUFFERED_BODY`; a line that never ends
    counts as it grows): past that
    :meth:`feed` raises :class:`~.sse.EventTooLarge`.
    """

    def __init__(self, max_event: int | None = None) -> None:
        self.max_event = limits.MAX_BUFFERED_BODY if max_event is None else max_event
        self._parts: list[bytes] = []  # the unfinished event's bytes
        self._size = 0
        self._mid_line = False  # the unfinished event ends inside a line
        self._cr = False  # it ends with a CR whose LF may start the next chunk
        self._cr_blank = False  # ... and that CR ended a blank line: the event is complete but for that LF

    def feed(self, chunk: bytes) -> list[bytes]:
        """The event blocks ``chunk`` completed.

        Raises:
            EventTooLarge: the unfinished event passed ``max_event`` bytes (the blocks before it are in the
                exception); the splitter is then spent.
        """
        if not chunk:
            return []
        blocks: list[bytes] = []
        start = pos = 0  # chunk[:start] went out in blocks; pos is where the next line starts
        n = len(chunk)
        if self._cr:
            self._cr = False
            pos = 1 if chunk[0] == 0x0A else 0
            if self._cr_blank:
                self._block(chunk[:pos], blocks)
                start = pos
        while pos < n:
            end, nxt = next_line_end(chunk, pos)
            if end < 0:
                self._mid_line = True
                break
            blank = end == pos and not self._mid_line
            self._mid_line = False
            if nxt == end + 1 == n and chunk[end] == 0x0D:
                self._cr, self._cr_blank = True, blank
            elif blank:
                self._block(chunk[start:nxt], blocks)
                start = nxt
            pos = nxt
        if start < n:
            self._parts.append(chunk[start:])
            self._size += n - start
        if self._size > self.max_event:
            self._parts, self._size = [], 0
            raise EventTooLarge(self.max_event, blocks)
        return blocks

    def _block(self, piece: bytes, blocks: list[bytes]) -> None:
        """Append to ``blocks`` the unfinished event completed by ``piece``."""
        if self._size + len(piece) > self.max_event:
            self._parts, self._size = [], 0
            raise EventTooLarge(self.max_event, blocks)
        self._parts.append(piece)
        blocks.append(self._parts[0] if len(self._parts) == 1 else b"".join(self._parts))
        self._parts, self._size = [], 0

    @property
    def pending(self) -> int:
        """Bytes of the unfinished event held."""
        return self._size

    def rest(self) -> bytes:
        """Bytes of an unfinished last event (a stream cut short), returned once."""
        rest = b"".join(self._parts)
        self._parts, self._size, self._mid_line, self._cr, self._cr_blank = [], 0, False, False, False
        return rest


OFF_LOOP_BYTES = 1024 * 1024
"""Work on this many bytes of one event or more runs in a worker thread (:func:`off_loop`)."""


async def off_loop(size: int, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)``, run in a worker thread when it handles ``size`` bytes or more (:data:`OFF_LOOP_BYTES`).

    Parsing and editing one big event takes long (a 100 MB one a second or more): in a thread, the event loop,
    which serves every session, gets the interpreter back between its steps and waits at most for the longest
    single step, which the parser (:func:`~.sse.decode`) and the formats (:mod:`~.formats.largejson`) keep to a
    slice of the event; joining a long string once is the one step on the whole event that remains. ``fn`` must
    touch only state of its own stream.
    """
    if size < OFF_LOOP_BYTES:
        return fn(*args)
    return await trio.to_thread.run_sync(functools.partial(fn, *args))


Observer = Callable[[str | None, str], None]
"""Sees each upstream event (its name, its data) before the editor does."""


def edit_blocks(blocks: list[bytes], editor: StreamEditor, parser: SSEParser | None = None,
                observe: Observer | None = None) -> list[bytes]:
    """The bytes to send for ``blocks``, as pieces in order (never joined: an event may be 100 MB): each
    event's replacement from ``editor``, or the block itself.

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
        if replaced is None:
            out.append(block)
        else:
            out += replaced
    return out


def sends(pieces: list[bytes]) -> list[bytes]:
    """``pieces`` regrouped as writes of at most :data:`OFF_LOOP_BYTES` bytes: small ones joined, a big one cut
    in slices (each write to the client, copied once by h11, stays short, and the loop serves others between
    them)."""
    size = OFF_LOOP_BYTES
    out: list[bytes] = []
    run: list[bytes] = []
    held = 0
    for piece in pieces:
        if held and held + len(piece) > size:
            out.append(b"".join(run))
            run, held = [], 0
        if len(piece) > size:
            out += [piece[i:i + size] for i in range(0, len(piece), size)]
            continue
        run.append(piece)
        held += len(piece)
    if held:
        out.append(b"".join(run))
    return out


class EditedStream:
    """An upstream stream (a ``RelayedStream`` or any async iterable of bytes) rewritten by ``editor``.

    ``error`` is the inner stream's (or says the stream stopped inside an event, or had an event over the size
    limit: the events before it are delivered, then the pipeline sends the format's error event);
    ``last_chunk`` is the last bytes sent. ``on_end(complete)`` runs once when iteration stops: ``complete`` is
    True when the upstream stream ended normally and everything was sent. The inner stream is closed whatever
    happens, also when the client goes away mid-stream. :attr:`observe`, when set before iterating, sees each
    complete upstream event: a reader of the stream (the pipeline's usage) that need not parse the bytes a second
    time. A big event is parsed and edited off the event loop (:func:`off_loop`).
    """

    def __init__(self, inner: Any, editor: StreamEditor, on_end: Callable[[bool], None]) -> None:
        self.inner = inner
        self.editor = editor
        self.on_end = on_end
        self.observe: Observer | None = None
        self.last_chunk = b""
        self.cut_short = False
        """The stream stopped inside an event; its bytes were held back (:attr:`error` then says so)."""
        self.too_large: EventTooLarge | None = None
        """The stream had an event over :data:`~.limits.MAX_BUFFERED_BODY`; reading stopped there."""

    @property
    def error(self) -> Any:
        error = getattr(self.inner, "error", None)
        if error is None and self.too_large is not None:
            return UpstreamError(502, str(self.too_large))
        if error is None and self.cut_short:
            return UpstreamError(502, "upstream stream ended in the middle of an event")
        return error

    def _edit(self, splitter: EventSplitter, parser: SSEParser, chunk: bytes) -> list[bytes]:
        try:
            blocks = splitter.feed(chunk)
        except EventTooLarge as exc:
            blocks, self.too_large = exc.complete, exc
        return sends(edit_blocks(blocks, self.editor, parser, self.observe))

    async def __aiter__(self) -> AsyncIterator[bytes]:
        splitter, parser = EventSplitter(), SSEParser()
        iterator = self.inner.__aiter__()
        complete = False
        try:
            async for chunk in iterator:
                for piece in await off_loop(feed_cost(splitter.pending, chunk), self._edit, splitter, parser,
                                            chunk):
                    self.last_chunk = piece
                    yield piece
                if self.too_large is not None:
                    break
            if self.too_large is None and splitter.rest():
                # Half an event is held back: the client's SDK would drop it silently or choke on it, while the
                # format's error event that follows (the pipeline sends it) is an error it reports.
                self.cut_short = True
            elif self.too_large is None:
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
