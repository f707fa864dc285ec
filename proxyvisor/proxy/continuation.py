"""Continuing an assistant turn upstream: the request sent again with extra history items, and the reply the
client gets in place of the first one.

Sometimes proxyvisor answers part of a model's response itself: a call of one of its own tools (a delegation
tool, :mod:`proxyvisor.proxy.delegation`; later the verify-gate's) is run by proxyvisor, never by the agent, and
the model must then go on with the result before the agent sees anything. :class:`Continuation` is that one
mechanism, in three parts:

- :meth:`Continuation.send` sends the upstream request again the way the original went (the caller's ``resend``:
  the same relay or translation, the same headers), with the turn's extra items appended to its history. Items
  accumulate: a second round sends the first round's items too.
- :meth:`Continuation.reply` drives it for one upstream reply: while the reply holds a call of a tool ``hold``
  selects, it asks ``step`` for the items that answer it (``WireFormat.assistant_items`` of the response, with
  the held calls only, then ``WireFormat.tool_results``) and continues upstream, at most ``rounds`` times. A JSON
  reply is replaced by the last one. A stream becomes a :class:`ContinuedStream`: its events pass as they arrive
  until a held call starts, the rest of that upstream stream is held back, and the continuation's events are
  spliced in (``WireFormat.stream_splice``) so the client reads one response, in its own format, as if the
  model had answered that way at once. Ordinary tool-call rounds stream through unbuffered: nothing is held until
  a held call starts.
- :attr:`Continuation.items` is then what the upstream saw beyond the client's history. The client's next
  request lacks it, so each time it grows it goes to ``remember`` (``Exchange.remember`` in
  :mod:`proxyvisor.proxy.supervise`), which re-inserts it at the same place in later requests, and the upstream
  prefix stays byte-stable for provider prompt caches.

While ``step`` runs on a stream (a child can take minutes), the client gets a keep-alive every
:data:`KEEPALIVE_S` seconds so its read timeout does not fire. ``step`` then runs in ``background``, a nursery
that outlives one iteration of the stream (an async generator must not yield inside a nursery of its own), and
is cancelled as soon as the stream is closed, e.g. when the client goes away. Without ``background`` it runs
inline and no keep-alive is sent.

How a later user plugs in (the verify-gate): give ``hold`` its tool names and a ``step`` that returns the
answering items; the JSON loop, the splicing, the keep-alives and the re-insertion come with it.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

import orjson
import trio

from .formats import WireFormat
from ..transcript import StreamSplice
from .client import Cut
from .relay import UpstreamError, UpstreamReply
from .closing import CLOSE_S, close
from .reply import Edited, Item, ReplyStream, blocks
from .sse import Block

if TYPE_CHECKING:  # supervise imports this module
    from .supervise import Exchange

log = logging.getLogger("proxyvisor.continuation")

Resend = Callable[[dict[str, Any]], Awaitable[UpstreamReply]]
"""Sends an upstream body (a parsed request in the client's format) the way the original request went.
Raises :class:`~proxyvisor.proxy.relay.UpstreamError` like the first send."""
Step = Callable[[dict[str, Any]], Awaitable[list[Any]]]
"""Given a held response (as a non-streaming response body), runs the held calls and returns the history items
to continue with: the response's own items (held calls only), then the calls' results."""

KEEPALIVE_S = 10.0
"""Seconds between keep-alives (``WireFormat.keepalive``) on a stream held while proxyvisor works."""
_JSON = [(b"content-type", b"application/json")]


def rewritable(reply: UpstreamReply) -> bool:
    """Whether proxyvisor may read and rewrite ``reply``: a success in no content encoding but ``identity`` (an
    error, or an encoding proxyvisor did not ask for, passes unchanged)."""
    return reply.status < 400 and not any(k.lower() == b"content-encoding" and v.strip().lower() != b"identity"
                                          for k, v in reply.headers)


class Continuation:
    """One turn that proxyvisor may continue upstream (module docstring).

    ``body``: the upstream body as first sent (not modified). ``hold(name)``: whether a tool call is proxyvisor's
    to run, and ``step`` runs it (None when nothing is held: then only :meth:`send` is used). ``rounds``: how many times the turn may be continued; a reply still holding a held call after that is
    answered with an error (502), never passed on (the agent does not have those tools). ``remember`` is given
    :attr:`items` each time they grow, before they are sent.
    """

    def __init__(self, fmt: WireFormat, body: dict[str, Any], resend: Resend, hold: Callable[[str], bool],
                 step: Step | None = None, rounds: int = 4, background: trio.Nursery | None = None,
                 remember: Callable[[list[Any]], None] | None = None, cut: Cut | None = None) -> None:
        self.fmt = fmt
        self.body = body
        self.resend = resend
        self.hold = hold
        self.step = step
        self.rounds = rounds
        self.background = background
        self.remember = remember
        self.cut = cut or Cut()
        """Ends the waits of the continued stream held while ``step`` runs (``Exchange.cut``)."""
        self.items: list[Any] = []
        self.done = 0
        """Rounds continued so far."""
        self.waited_s = 0.0
        """Seconds spent in ``step`` and in continued upstream calls: upstream time, not proxyvisor's own."""

    def add(self, items: list[Any]) -> None:
        """Append ``items`` to the turn without sending it: the upstream sees them in the thread's later requests
        (``remember``), e.g. a blocked call the agent never received and its error, beside calls it did."""
        self.items = self.items + list(items)
        if self.remember is not None:
            self.remember(self.items)

    def take_back(self, items: list[Any]) -> None:
        """Put the turn's items back to ``items`` (what they were before a continuation that failed), for the
        thread's later requests too (``remember``)."""
        self.items = items
        if self.remember is not None:
            self.remember(items)

    async def send(self, items: list[Any]) -> UpstreamReply:
        """Append ``items`` to the turn and send the request again with every item of the turn so far.

        Raises:
            UpstreamError: as ``resend``.
        """
        self.add(items)
        body = dict(self.body)
        self.fmt.extend_history(body, self.items)
        started = time.perf_counter()
        try:
            return await self.resend(body)
        finally:
            self.waited_s += time.perf_counter() - started

    def _held(self, response: dict[str, Any]) -> bool:
        try:
            return any(self.hold(call.name) for call in self.fmt.parse_response(response).tool_calls)
        except (AttributeError, IndexError, KeyError, TypeError):  # not a response this format can read
            return False

    def _too_many(self) -> str:
        return (f"the model went on calling proxyvisor's own tools after {self.rounds} rounds in one turn; "
                "proxyvisor stopped the turn rather than pass those calls to the agent")

    async def _step(self, response: dict[str, Any]) -> list[Any]:
        assert self.step is not None, "a held call needs a step"
        started = time.perf_counter()
        try:
            return await self.step(response)
        finally:
            self.waited_s += time.perf_counter() - started

    async def reply(self, reply: UpstreamReply) -> UpstreamReply:
        """The reply for the client: ``reply`` itself when it holds no held call (or is an error, or in an encoding
        proxyvisor cannot read), else the continued turn's (module docstring). Continuing fails into an error reply
        (JSON) or the stream's ``error`` (streams), never into a lost response.

        Raises:
            trio.Cancelled: the caller's scope was cancelled (a running ``step`` is cancelled with it).
        """
        if not rewritable(reply):
            return reply
        if reply.streaming:
            return reply.with_body(ContinuedStream(self, reply.body))
        first_s = reply.upstream_s
        while True:
            assert isinstance(reply.body, bytes)
            try:
                response = reply.json()
            except orjson.JSONDecodeError:
                return reply
            if not isinstance(response, dict) or not self._held(response):
                return dataclasses.replace(reply, upstream_s=first_s + self.waited_s)
            if self.done >= self.rounds:
                return UpstreamReply(502, _JSON, self.fmt.error_body(502, self._too_many()), first_s + self.waited_s)
            items = await self._step(response)
            try:
                reply = await self.send(items)
            except UpstreamError as exc:
                return UpstreamReply(exc.status, _JSON, self.fmt.error_body(exc.status, exc.message),
                                     first_s + self.waited_s)
            self.done += 1
            if reply.status >= 400 or reply.streaming:
                return dataclasses.replace(reply, upstream_s=first_s + self.waited_s)


class _Recorder:
    """A stream editor that keeps every event of one upstream stream (to read the held response from) and hands
    each to the splice."""

    def __init__(self, splice: StreamSplice) -> None:
        self.splice = splice
        self.events: list[tuple[str | None, str]] = []

    def event(self, name: str | None, data: str) -> list[bytes] | None:
        self.events.append((name, data))
        return self.splice.event(name, data)

    def close(self) -> list[bytes]:
        return self.splice.close()


class Job:
    """``work(arg)`` run for a held stream; afterwards ``result`` is what it returned (None if it raised, with
    ``error`` what it raised), ``done`` is set however it ended, and cancelling ``scope`` stops it."""

    def __init__(self, work: Callable[[Any], Awaitable[Any]], arg: Any) -> None:
        self.work = work
        self.arg = arg
        self.done = trio.Event()
        self.scope = trio.CancelScope()
        self.result: Any = None
        self.error: Exception | None = None

    async def run(self) -> None:
        try:
            with self.scope:
                self.result = await self.work(self.arg)
        except Exception as exc:  # noqa: BLE001 - reported to the stream, which decides what the client gets
            self.error = exc
        finally:
            self.done.set()

    async def stop(self) -> None:
        """Cancel the job and wait for its end (its own clean-up on cancellation done), shielded from the caller's
        cancellation (a stream closed because its client left), for at most :data:`~.closing.CLOSE_S` seconds."""
        self.scope.cancel()
        with trio.CancelScope(shield=True, deadline=trio.current_time() + CLOSE_S):
            await self.done.wait()

    async def keepalives(self, fmt: WireFormat, background: trio.Nursery | None, cut: Cut) -> AsyncIterator[bytes]:
        """Run the job, yielding ``fmt.keepalive`` every :data:`KEEPALIVE_S` seconds until it ends: in
        ``background`` (the stream owning the job cancels ``scope`` when it is closed), or inline with no
        keep-alive when ``background`` is None (an async generator must not yield inside a nursery of its own).
        At ``cut`` (the proxy stops: ``Exchange.cut``) one keep-alive goes out at once, so that the stream's
        relay sees the stop then (``Pipeline.stop`` ends the stream at its next piece) rather than at the next
        keep-alive's time; the ones after it keep their pace."""
        if background is None:
            await self.run()
            return
        background.start_soon(self.run)
        was_cut = False
        while not self.done.is_set():
            with trio.move_on_after(KEEPALIVE_S) as scope:
                await (self.done.wait() if was_cut else cut.during(scope, self.done.wait()))
            was_cut = cut.done
            if not self.done.is_set():
                yield fmt.keepalive


def of_turn(exchange: Exchange, resend: Resend, background: trio.Nursery | None) -> Continuation:
    """``exchange``'s continuation, made when the turn has none yet (holding no tool, remembered through
    ``Exchange.remember``): a stage that continues the turn with items of its own (the verify-gate, the tool
    authorizer) goes on from what the turn's continuation sent so far."""
    if exchange.continuation is None:
        exchange.continuation = Continuation(exchange.fmt, exchange.body, resend, lambda _name: False,
                                             background=background, remember=exchange.remember, cut=exchange.cut)
    return exchange.continuation


def _error_text(body: Any) -> str:
    try:
        error = orjson.loads(body).get("error") if isinstance(body, bytes) else None
    except (orjson.JSONDecodeError, AttributeError):
        error = None
    message = error.get("message") if isinstance(error, dict) else None
    return str(message) if message else "no details"


class ContinuedStream(ReplyStream):
    """The client's stream: the first upstream stream, then each continuation spliced in (module docstring).
    A :class:`~.reply.ReplyStream` (``error`` set when continuing failed)."""

    def __init__(self, continuation: Continuation, first: Any) -> None:
        self.continuation = continuation
        self.first = first

    async def __aiter__(self) -> AsyncIterator[list[Item]]:
        c = self.continuation
        splice = c.fmt.stream_splice(c.hold)
        stream = blocks(self.first)
        job: Job | None = None
        try:
            while True:
                recorder = _Recorder(splice)
                edited = Edited(stream, recorder, lambda _complete: None)
                async for batch in edited:
                    yield batch
                if edited.error is not None:
                    self._error = edited.error
                    return
                if not splice.held:
                    return
                if c.done >= c.rounds:
                    self._error = UpstreamError(502, c._too_many())
                    return
                job = Job(c._step, c.fmt.stream_response(recorder.events))
                async for keepalive in job.keepalives(c.fmt, c.background, c.cut):
                    yield [Block(keepalive, None)]
                if job.error is not None:  # the stream ends with an error event instead
                    log.error("continuing a turn failed", exc_info=job.error)
                items: list[Any] | None = job.result
                if items is None:
                    self._error = UpstreamError(500, "proxyvisor failed while running part of this turn; see the "
                                                     "proxyvisor log")
                    return
                try:
                    reply = await c.send(items)
                except UpstreamError as exc:
                    self._error = exc
                    return
                c.done += 1
                if reply.status >= 400 or not reply.streaming:
                    await close(reply.body)
                    self._error = UpstreamError(reply.status if reply.status >= 400 else 502,
                                                f"upstream refused to continue the turn ({reply.status}): "
                                                f"{_error_text(reply.body)}" if reply.status >= 400 else
                                                "upstream continued the turn without a stream")
                    return
                splice.next_response()
                stream = blocks(reply.body)
        finally:
            if job is not None:
                await job.stop()
