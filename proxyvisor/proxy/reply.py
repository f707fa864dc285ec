"""The supervised reply path for streams: the upstream's bytes scanned once into event blocks, the stages as
transforms over those blocks, bytes written once on the way out.

A :class:`ReplyStream` is iterated once and yields batches (what one upstream read completed) of items: a
:class:`~.sse.Block` as the upstream sent it, or an :class:`Edit`, the bytes a stage put in place of blocks. A stage
that reads events takes the items through :func:`scanned`, which hands it each unchanged block with the event the
one scan read from it and scans only the bytes an earlier stage wrote; :class:`Encoded` turns the last stage's
items into writes for the client, each unchanged block as its original bytes. Afterwards a stream's ``error`` is
None or what cut it short (the pipeline then ends the client's stream with the format's error event).

The stages, innermost first: :class:`Blocks` (the upstream's bytes, scanned), the delegation continuation
(:class:`~.continuation.ContinuedStream`), the verify-gate's hold (:class:`~.gating.GatedStream`), the self-report
stripper (:class:`Edited`, also the continuation's recorder). Each closes the stream it reads (:func:`~.closing.close`)
however it stops, so a client going away closes the chain down to the upstream connection.
"""

from __future__ import annotations

import functools
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import trio
import trio.testing

from .. import bigtext
from ..transcript import StreamEditor
from .allocator import big_blocks_mapped, defer_free, deferred_bytes, free_deferred
from .closing import close
from .relay import UpstreamError
from .sse import Block, EventTooLarge, SSEScanner, feed_cost

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Edit:
    """Bytes a stage wrote in place of blocks: whole events in the stream's format, as pieces in order (never
    joined: an event may be 100 MB). Empty when the blocks were dropped or held back."""

    pieces: list[bytes]

    def __post_init__(self) -> None:
        if self.size >= OFF_LOOP_BYTES:
            defer_free(self.pieces)  # (see _deferring)

    @property
    def size(self) -> int:
        return sum(map(len, self.pieces))


Item = Block | Edit


class ReplyStream:
    """A stream of the supervised reply path (module docstring): iterate it once for batches of items; afterwards
    :attr:`error` is None or what cut it short."""

    _error: UpstreamError | None = None

    @property
    def error(self) -> UpstreamError | None:
        return self._error

    def __aiter__(self) -> AsyncIterator[list[Item]]:
        raise NotImplementedError


OFF_LOOP_BYTES = 1024 * 1024
"""Work on this many bytes of one batch or more runs in a worker thread (:func:`off_loop`)."""

RUN_S = 0.002
"""How long a worker thread works on (a step at a time) before it lets the event loop go first."""
YIELD_S = 0.005
"""Longest a worker thread then waits for the event loop to have nothing to run."""


async def off_loop(size: int, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)``, run in a worker thread when it handles ``size`` bytes or more (:data:`OFF_LOOP_BYTES`).

    Scanning and editing one big event takes long (a 100 MB one half a second or more of CPU): in a thread, the
    event loop, which serves every session, gets the interpreter back between its steps and waits at most for the
    longest single step, which the scanner (:func:`~.sse.decode`), the formats (:mod:`~.formats.largejson`) and
    the stripper keep to a slice of the event (:mod:`proxyvisor.bigtext`). Between steps the thread also lets the
    loop go first (:func:`_loop_first`): with the lock shared turn by turn (the switch interval), a busy loop's
    tasks wait for the thread's every turn while the event relays. A stream cancelled meanwhile (its client went
    away) stops the thread's work at its next pause. ``fn`` must touch only state of its own stream.
    """
    if size < OFF_LOOP_BYTES:
        return fn(*args)
    return await trio.to_thread.run_sync(functools.partial(_yielding, fn, *args))


def _yielding(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` in a worker thread, where a pause between two of its steps (:data:`proxyvisor.bigtext.PAUSE`)
    lets the loop go first (:func:`_loop_first`) once the thread has worked :data:`RUN_S` since it last did, with big
    blocks mapped (:func:`.allocator.big_blocks_mapped`: the big texts it builds grow without being copied), after
    freeing, the same way, the big objects that streams no longer use (:func:`_deferring`). (The thread runs in a
    copy of the caller's context: the setting stays in it.)"""
    since = time.perf_counter()

    def pause() -> None:
        nonlocal since
        if time.perf_counter() - since >= RUN_S:
            _loop_first()
            since = time.perf_counter()

    bigtext.PAUSE.set(pause)
    with big_blocks_mapped():
        free_deferred()
        return fn(*args)


def _loop_first() -> None:
    """From a worker thread: wait until the event loop has no task to run and no socket ready, for at most
    :data:`YIELD_S` once it takes this request (a loop that is never idle still lets the thread go on, a step per
    turn of the loop)."""
    trio.from_thread.run(_idle)


async def _idle() -> None:
    with trio.move_on_after(YIELD_S):
        await trio.testing.wait_all_tasks_blocked()


def _deferring(blocks: list[T]) -> list[T]:
    """``blocks`` (scanned :class:`~.sse.Block` items), each big one's bytes and event data kept to be freed off the
    loop (:func:`.allocator.defer_free`), as each big :class:`Edit` is when made.

    The stages pass a batch on and let go of it on the event loop; the last to let go of a 128 MB event would free
    it there (6 to 12 ms of the loop's time, 256 MB twice that). Kept, they are freed in a worker thread's steps:
    each :func:`off_loop` call's thread first frees those no stage uses any longer, and so does
    :class:`Encoded` once its stream is over (and the idle trim, what is left)."""
    for block in blocks:
        if isinstance(block, Block) and block.size >= OFF_LOOP_BYTES:
            defer_free(block.pieces)
            # (its event's data is read from those bytes: a small block's is small too)
            if block.event is not None and len(block.event.data) >= OFF_LOOP_BYTES:
                defer_free(block.event.data)
    return blocks


def size(items: Sequence[Item]) -> int:
    """The bytes ``items`` hold."""
    return sum(item.size for item in items)


def _scan(items: list[Item]) -> list[Block]:
    out: list[Block] = []
    for item in items:
        if isinstance(item, Block):
            out.append(item)
            continue
        scanner = SSEScanner()
        for piece in item.pieces:
            out += scanner.feed(piece)
        if rest := scanner.finish():  # not an event: kept as bytes all the same, never lost
            out.append(Block(rest, None))
    return out


async def scanned(items: list[Item]) -> list[Block]:
    """``items`` as blocks, each with its event: the upstream's as they were scanned, an :class:`Edit`'s bytes
    scanned now (off the event loop when big)."""
    if all(isinstance(item, Block) for item in items):
        return cast(list[Block], items)
    return _deferring(await off_loop(size([item for item in items if isinstance(item, Edit)]), _scan, items))


def pieces(items: list[Item]) -> list[bytes]:
    """The bytes of ``items``, as pieces in order."""
    out: list[bytes] = []
    for item in items:
        out += item.pieces
    return out


def writes(items: list[Item]) -> Iterator[bytes]:
    """The bytes of ``items`` as writes of at most :data:`OFF_LOOP_BYTES` bytes: small pieces joined, a big one cut
    in slices (each write to the client, copied once by h11, stays short, and the loop serves others between
    them). Lazily: a write is cut or joined only when the one before it went out."""
    limit = OFF_LOOP_BYTES
    run: list[bytes] = []
    held = 0
    for piece in pieces(items):
        if held and held + len(piece) > limit:
            yield b"".join(run)
            run, held = [], 0
        if len(piece) > limit:
            for start in range(0, len(piece), limit):
                yield piece[start:start + limit]
            continue
        if piece:
            run.append(piece)
            held += len(piece)
    if held:
        yield b"".join(run)


class Blocks(ReplyStream):
    """The upstream's stream (a ``RelayedStream``, a translated stream: any async iterable of bytes with an
    ``error``) scanned into blocks, once.

    ``error`` is the inner stream's, or says the stream stopped inside an event (its bytes are held back: an SDK
    would drop half an event silently or choke on it, while the format's error event that follows is an error it
    reports), or had an event over the size limit (the events before it are delivered; reading stops there).
    """

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    async def __aiter__(self) -> AsyncIterator[list[Item]]:
        scanner = SSEScanner()
        iterator = aiter(self.inner)
        try:
            async for chunk in iterator:
                try:
                    blocks = _deferring(cast(list[Item], await off_loop(feed_cost(scanner.pending, chunk),
                                                                        scanner.feed, chunk)))
                except EventTooLarge as exc:
                    if exc.complete:
                        yield _deferring(exc.complete)
                    self._error = UpstreamError(502, str(exc))
                    return
                if blocks:
                    yield blocks
            self._error = getattr(self.inner, "error", None)
            if scanner.finish() and self._error is None:
                self._error = UpstreamError(502, "upstream stream ended in the middle of an event")
        finally:
            await close(iterator)


def blocks(body: Any) -> ReplyStream:
    """``body``, a reply's stream, as a :class:`ReplyStream`: itself when it is one already."""
    return body if isinstance(body, ReplyStream) else Blocks(body)


Observer = Callable[[str | None, str], None]
"""Sees each event (its name, its data) before the editor does."""


class Edited(ReplyStream):
    """``stream`` with each event run past ``editor`` (a :class:`~proxyvisor.transcript.StreamEditor`): its
    replacement goes out in the event's place, an event it leaves alone (and every comment, such as a keep-alive)
    as it came. :attr:`observe`, when set before iterating, sees each event first: a reader of the stream (the
    pipeline's usage) that need not scan it again. ``on_end(complete)`` runs once when iteration stops:
    ``complete`` is True when the stream ended normally and everything was sent.
    """

    def __init__(self, stream: ReplyStream, editor: StreamEditor, on_end: Callable[[bool], None]) -> None:
        self.stream = stream
        self.editor = editor
        self.on_end = on_end
        self.observe: Observer | None = None

    @property
    def error(self) -> UpstreamError | None:
        return self.stream.error

    def _edit(self, blocks: list[Block]) -> list[Item]:
        out: list[Item] = []
        for block in blocks:
            event = block.event
            replaced = None
            if event is not None:
                if self.observe is not None:
                    self.observe(event.event, event.data)
                replaced = self.editor.event(event.event, event.data)
            out.append(block if replaced is None else Edit(replaced))
        return out

    async def __aiter__(self) -> AsyncIterator[list[Item]]:
        iterator = aiter(self.stream)
        complete = False
        try:
            async for batch in iterator:
                blocks = await scanned(batch)
                yield await off_loop(size(blocks), self._edit, blocks)
            if self.stream.error is None:
                tail = self.editor.close()
                if tail:
                    yield [Edit(tail)]
            complete = self.stream.error is None
        finally:
            self.on_end(complete)
            await close(iterator)


class Encoded:
    """The client's bytes of a :class:`ReplyStream`: each batch's items as writes (:func:`writes`). ``error`` is the
    stream's; ``observe`` is its :attr:`Edited.observe` when it has one (None otherwise)."""

    def __init__(self, stream: ReplyStream) -> None:
        self.stream = stream

    @property
    def error(self) -> UpstreamError | None:
        return self.stream.error

    @property
    def edited(self) -> Edited | None:
        return self.stream if isinstance(self.stream, Edited) else None

    async def __aiter__(self) -> AsyncIterator[bytes]:
        iterator = aiter(self.stream)
        batch: list[Item] = []
        try:
            async for batch in iterator:
                for write in writes(batch):
                    yield write
        finally:
            await close(iterator)  # (the stages' frames end, and with them their references to batches)
            del batch
            with trio.CancelScope(shield=True):  # (a client gone still leaves nothing kept)
                await off_loop(deferred_bytes(), free_deferred)
