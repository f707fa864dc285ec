"""A lean HTTP/1.1 server on trio and h11.

Why not an ASGI server: proxyvisor's disabled path must add under a millisecond, and an ASGI layer (scope dicts,
receive/send callables, a task per request) costs more than the whole relay (DESIGN.md, principle 4). h11 does
the protocol; this module only moves bytes, applies limits and timeouts, and watches for clients that hang up.

Contract of a handler: ``async def handler(request: Request) -> Response``. It runs inside a cancel scope that
is cancelled when the client disconnects before the response is complete, so an upstream call made inside it is
cancelled too. A streaming :class:`Response` body is an async iterator of bytes; it is sent with chunked transfer
encoding (or the ``content-length`` the handler set) as each chunk arrives, and closed (``aclose``) whatever
happens.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import h11
import trio

log = logging.getLogger("proxyvisor.server")

Headers = list[tuple[bytes, bytes]]
_READ_SIZE = 65536
"""Bytes per socket read. Not larger: h11 bounds an incomplete request head (``max_incomplete_event_size``) only
between reads, so a bigger read could take in an oversized head whole."""


@dataclass
class Request:
    """A complete request. Header names are lowercase bytes, as h11 gives them; ``body`` is the whole body."""

    method: str
    target: str
    headers: Headers
    body: bytes = b""
    received_at: float = 0.0
    """``time.perf_counter()`` when the request head was parsed (s)."""
    too_large: bool = False
    """The body exceeded the server's limit and was not read; ``body`` is empty."""
    peer: str = ""

    @property
    def path(self) -> str:
        return self.target.partition("?")[0]

    @property
    def query(self) -> str:
        return self.target.partition("?")[2]

    def header(self, name: str) -> str | None:
        key = name.lower().encode()
        for k, v in self.headers:
            if k == key:
                return v.decode("latin-1")
        return None


@dataclass
class Response:
    status: int
    headers: Headers = field(default_factory=list)
    body: bytes | AsyncIterator[bytes] = b""


Handler = Callable[[Request], Awaitable[Response]]


@dataclass(frozen=True)
class Limits:
    max_body_bytes: int = 32 * 1024 * 1024
    header_timeout_s: float = 30.0
    keepalive_timeout_s: float = 75.0
    body_timeout_s: float = 120.0


class _ClientGone(Exception):
    pass


class AbortConnection(Exception):
    """Raised by a streaming body to drop the connection at once, without ending the message (a reset)."""


class Connection:
    """One client connection: reads requests, runs the handler, writes responses, until either side closes."""

    def __init__(self, stream: trio.abc.Stream, handler: Handler, limits: Limits, peer: str = "") -> None:
        self.stream = stream
        self.handler = handler
        self.limits = limits
        self.peer = peer
        self.conn = h11.Connection(h11.SERVER)
        # The reader task hands what it reads to this task; unbuffered, so it reads ahead by one piece at most.
        self._inbox_in, self._inbox = trio.open_memory_channel[bytes](0)
        self._handling: trio.CancelScope | None = None
        self._hung_up = False

    async def _reader(self) -> None:
        """Owns the socket's receiving side for the connection's whole life, so a hang-up is seen at once, also
        while a handler runs (then it cancels the handler's scope). One long-lived task per connection: a
        watcher task per request cost more than the rest of the server's work (``bench/overhead.py``)."""
        async with self._inbox_in:
            while True:
                try:
                    data = await self.stream.receive_some(_READ_SIZE)
                except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                    data = b""
                if not data:
                    self._hung_up = True
                    if self._handling is not None:
                        self._handling.cancel()
                    return
                await self._inbox_in.send(data)

    async def _receive(self) -> None:
        try:
            data = await self._inbox.receive()
        except trio.EndOfChannel:
            data = b""
        self.conn.receive_data(data)

    async def _next_event(self, timeout: float) -> object:
        event = self.conn.next_event()
        if event is not h11.NEED_DATA:  # already buffered: no deadline to set up
            return event
        with trio.fail_after(timeout):
            while True:
                await self._receive()
                event = self.conn.next_event()
                if event is not h11.NEED_DATA:
                    return event

    async def _send(self, *events: object) -> None:
        # Several events go out in one write: each write wakes the client, and a wake-up costs more than a copy.
        data = b"".join([self.conn.send(event) or b"" for event in events])
        if data:
            try:
                await self.stream.send_all(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
                raise _ClientGone() from exc

    async def serve(self) -> None:
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._reader)
                await self._serve_requests()
                nursery.cancel_scope.cancel()
        finally:
            with trio.move_on_after(1) as scope:
                scope.shield = True
                try:
                    await self.stream.aclose()
                except Exception:  # noqa: BLE001 - closing a dead socket may fail in many ways; nothing to do
                    pass

    async def _serve_requests(self) -> None:
        first = True
        try:
            while True:
                timeout = self.limits.header_timeout_s if first else self.limits.keepalive_timeout_s
                first = False
                try:
                    event = await self._next_event(timeout)
                except trio.TooSlowError:
                    return
                except h11.RemoteProtocolError as exc:
                    await self._bad_request(exc)
                    return
                if isinstance(event, h11.ConnectionClosed) or not isinstance(event, h11.Request):
                    return
                request = Request(event.method.decode("ascii", "replace"), event.target.decode("latin-1"),
                                  list(event.headers), received_at=time.perf_counter(), peer=self.peer)
                if not await self._read_body(request):
                    return
                await self._respond(request)
                if self.conn.our_state is h11.MUST_CLOSE or self.conn.their_state is h11.MUST_CLOSE:
                    return
                try:
                    self.conn.start_next_cycle()
                except h11.LocalProtocolError:
                    return
        except _ClientGone:
            return

    async def _bad_request(self, exc: Exception) -> None:
        if self.conn.our_state not in (h11.IDLE, h11.SEND_RESPONSE):
            return
        body = b'{"error":{"message":"malformed HTTP request","type":"invalid_request_error"}}'
        try:
            await self._send(h11.Response(status_code=400, headers=[(b"content-type", b"application/json"),
                                                                    (b"content-length", str(len(body)).encode()),
                                                                    (b"connection", b"close")]),
                             h11.Data(data=body), h11.EndOfMessage())
        except (_ClientGone, h11.LocalProtocolError):
            pass

    async def _read_body(self, request: Request) -> bool:
        declared = request.header("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limits.max_body_bytes:
            request.too_large = True
            return True
        parts: list[bytes] = []
        size = 0
        try:
            while True:
                event = await self._next_event(self.limits.body_timeout_s)
                if isinstance(event, h11.Data):
                    size += len(event.data)
                    if size > self.limits.max_body_bytes:
                        request.too_large = True
                        return True
                    parts.append(event.data)  # bytes or bytearray: the join below copies either way
                elif isinstance(event, h11.EndOfMessage):
                    break
                else:
                    return False
        except trio.TooSlowError:
            return False
        except h11.RemoteProtocolError as exc:
            await self._bad_request(exc)
            return False
        request.body = b"".join(parts)
        return True

    async def _respond(self, request: Request) -> None:
        gone = False
        with trio.CancelScope() as scope:
            # Clients do not send while awaiting a response (no pipelining in practice); EOF means they hung up.
            self._handling = scope
            if self._hung_up:
                scope.cancel()
            try:
                await self._run_handler(request)
            except (_ClientGone, AbortConnection):
                gone = True
            finally:
                self._handling = None
        if gone or self._hung_up:
            raise _ClientGone()

    async def _run_handler(self, request: Request) -> None:
        response = await self.handler(request)
        body = response.body
        headers = list(response.headers)
        if request.too_large:
            headers.append((b"connection", b"close"))
        if isinstance(body, (bytes, bytearray)):
            if not any(k == b"content-length" for k, _ in headers):
                headers.append((b"content-length", str(len(body)).encode()))
            head = h11.Response(status_code=response.status, headers=headers)
            if body and request.method != "HEAD":
                await self._send(head, h11.Data(data=body), h11.EndOfMessage())
            else:
                await self._send(head, h11.EndOfMessage())
            return
        try:
            if not any(k in (b"content-length", b"transfer-encoding") for k, _ in headers):
                headers.append((b"transfer-encoding", b"chunked"))
            await self._send(h11.Response(status_code=response.status, headers=headers))
            async for chunk in body:
                if chunk:
                    await self._send(h11.Data(data=chunk))
            await self._send(h11.EndOfMessage())
        finally:
            aclose = getattr(body, "aclose", None)
            if aclose is not None:
                with trio.CancelScope(shield=True):
                    await aclose()


async def serve_listeners(listeners: list[trio.SocketListener], handler: Handler, limits: Limits,
                          task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """Accept connections on ``listeners`` forever; each connection runs in its own task of one nursery."""

    async def handle(stream: trio.SocketStream) -> None:
        try:
            peer = "%s:%s" % stream.socket.getpeername()[:2]
        except OSError:
            peer = ""
        try:
            await Connection(stream, handler, limits, peer).serve()
        except Exception:  # noqa: BLE001 - one broken connection must never take the server down
            log.exception("connection from %s failed", peer)

    await trio.serve_listeners(handle, listeners, task_status=task_status)


class CannotListen(OSError):
    """The address cannot be bound (taken, not this machine's, not permitted); ``errno`` and ``strerror`` are
    the socket's."""


async def open_listeners(host: str, port: int) -> list[trio.SocketListener]:
    """Bind ``host:port`` (port 0 picks a free one).

    Raises:
        CannotListen: the address cannot be bound.
    """
    try:
        return await trio.open_tcp_listeners(port, host=host)
    except OSError as exc:
        raise CannotListen(exc.errno, exc.strerror or str(exc)) from exc


def bound_port(listeners: list[trio.SocketListener]) -> int:
    return listeners[0].socket.getsockname()[1]
