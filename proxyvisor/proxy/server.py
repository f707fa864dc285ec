"""A lean HTTP/1.1 server on trio and h11.

Why not an ASGI server: proxyvisor's disabled path must add under a millisecond, and an ASGI layer (scope dicts,
receive/send callables, a task per request) costs more than the whole relay (DESIGN.md, principle 4). h11 does
the protocol; this module only moves bytes, applies limits and timeouts, and watches for clients that hang up.

Contract of a handler: ``async def handler(request: Request) -> Response``. It runs inside a cancel scope that
is cancelled when the client disconnects before the response is complete, so an upstream call made inside it is
cancelled too. A client that only closes its sending side after its request (``shutdown(SHUT_WR)``, a
half-close) has not disconnected: it gets its response (see :meth:`Connection._tell_apart`). A streaming :class:`Response` body is an async iterator of bytes; it is sent with chunked transfer
encoding (or the ``content-length`` the handler set) as each chunk arrives, and closed (``aclose``) whatever
happens. A :class:`Response`'s ``after`` step runs once the response is done with (its last byte written, or the
client gone), before the connection reads its next request: work the client need not wait for (Starlette's
background task, on the connection's own task).
"""

from __future__ import annotations

import functools
import hmac
import http
import logging
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import h11
import trio

from ..bigtext import MMAP_THRESHOLD
from .closing import close

log = logging.getLogger("proxyvisor.server")

Headers = list[tuple[bytes, bytes]]
Bytes = bytes | bytearray | memoryview
READ_SIZE = MMAP_THRESHOLD - 1024
"""Bytes per socket read, the upstream client's too: each read is a hand-over between two tasks, which costs more
than the bytes of a body of a few hundred KB (a 79 KB request in one read instead of two: about 4% less CPU; a 4 MB
body: about half the time with 256 KB reads as with 64 KB ones). Just under the allocator's mapping threshold while
big texts are built (:data:`proxyvisor.bigtext.MMAP_THRESHOLD`, ``allocator.big_blocks_mapped``): a read's buffer is
allocated at this size before the bytes arrive, and one at the threshold would then be a fresh mapping whose pages
fault in on every read (the relay's CPU per MB of body 1.41 -> 0.90 ms, per 79 KB request 0.83 -> 0.78 ms, with
that threshold always set: bench/overhead.py)."""
_FEED_SIZE = 65536
"""The most bytes h11 is given at once (what a read brought past it waits in ``Connection._pending``). Not more:
h11 bounds an incomplete request head (``max_incomplete_event_size``) only between two feeds, so a bigger one could
take in an oversized head whole."""


_REASONS = {529: b"Overloaded"}
"""Reason phrases of statuses the standard does not name that model APIs send: Anthropic's 529 (its SDK and
Claude Code say "529 Overloaded")."""

_CLASS_REASONS = {1: b"Informational", 2: b"Success", 3: b"Redirection", 4: b"Client Error", 5: b"Server Error"}
"""The names of the status classes (RFC 9110, section 15): the phrase of a status that nothing names. A client
treats an unknown status as the x00 of its class, so its class is what the phrase can say."""


@functools.cache
def _named(status: int) -> bytes:
    """The phrase the standard or :data:`_REASONS` gives ``status``; empty if neither does."""
    try:
        return http.HTTPStatus(status).phrase.encode()
    except ValueError:
        return _REASONS.get(status, b"")


def reason(status: int, relayed: bytes = b"") -> bytes:
    """The reason phrase of ``status`` for the status line, never empty: the standard's or :data:`_REASONS`'s;
    else ``relayed``, the upstream's own phrase for a status it answered with (h11 read it, so it holds no line
    break); else its class's name (:data:`_CLASS_REASONS`; ``Unknown`` past 5xx)."""
    return _named(status) or relayed or _CLASS_REASONS.get(status // 100, b"Unknown")


ALLOW_GET: Headers = [(b"allow", b"GET, HEAD")]
ALLOW_POST: Headers = [(b"allow", b"POST")]
"""The ``Allow`` header of a 405 answer (RFC 9110 section 15.5.6: it lists the methods the path takes)."""


@dataclass
class Request:
    """A complete request. Header names are lowercase bytes, as h11 gives them; the body is :attr:`body`."""

    method: str
    target: str
    headers: Headers
    content: bytes | tuple[bytes, ...] = b""
    """The body, or the pieces it arrived in, in order (what the server's reads brought): the byte relay sends the
    pieces as they are, so a body it only forwards is never copied; :attr:`body` joins them, once."""
    received_at: float = 0.0
    """``time.perf_counter()`` when the request head was parsed (s)."""
    body_at: float = 0.0
    """``time.perf_counter()`` when the body was read whole, or refused (s); 0 for a request the server did not
    read (one made in process)."""
    too_large: bool = False
    """The body exceeded the server's limit and was not read; ``body`` is empty."""
    too_slow: bool = False
    """The body did not arrive whole within the server's total deadline (``Limits.body_deadline_s``); ``body``
    is empty."""
    peer: str = ""

    @property
    def body(self) -> bytes:
        """The whole body."""
        if not isinstance(self.content, bytes):
            self.content = b"".join(self.content)
        return self.content

    @property
    def since_body(self) -> float:
        """Seconds since the body was whole (since the head for a request made in process). The proxy overhead is
        counted from there: the time a client takes to send its body is not time proxyvisor added."""
        return time.perf_counter() - max(self.received_at, self.body_at)

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

    def header_is(self, name: str, secret: str) -> bool:
        """Whether header ``name`` holds exactly ``secret``, compared in constant time (no guessing by timing)."""
        return hmac.compare_digest((self.header(name) or "").encode("latin-1"), secret.encode())


@dataclass
class Response:
    status: int
    headers: Headers = field(default_factory=list)
    body: bytes | AsyncIterator[bytes] = b""
    reason: bytes = b""
    """The phrase of a relayed status, as the upstream wrote it (:func:`reason` prefers the standard's)."""
    after: Callable[[], Awaitable[None]] | None = None
    """Awaited once the response is done with: its last byte handed to the socket (a stream's body closed), or its
    sending given up (the client left, the server stopping), and before the connection reads its next request. It
    runs shielded from cancellation for at most :data:`AFTER_S` seconds; an exception in it is logged (its type and
    message, no traceback) and changes nothing the client gets."""


Handler = Callable[[Request], Awaitable[Response]]


@dataclass(frozen=True)
class Limits:
    max_body_bytes: int = 32 * 1024 * 1024
    header_timeout_s: float = 30.0
    keepalive_timeout_s: float = 75.0
    body_timeout_s: float = 120.0
    """Seconds between two reads of a request body; past it the connection is closed without an answer."""
    body_deadline_s: float = 300.0
    """Seconds for a whole request body; past it the handler gets the request with ``too_slow`` set."""
    error_body: Callable[[str, int, str], bytes] | None = None
    """The JSON body of an error the server answers itself (a body whose framing broke), in the API of the
    request's path: ``error_body(path, status, message)``; None: OpenAI's shape."""


AFTER_S = 5.0
"""Seconds a response's ``after`` step may take: it is shielded from the connection's cancellation (it runs when
the client left or the server stops too), so a step that hung would hold the connection and the server's stop."""


class Stopping:
    """A server's drain, shared by its connections: once :meth:`begin` is called the server accepts no connection,
    closes the connections waiting for their next request, answers a request that arrives anyway with
    ``connection: close``, and closes each connection once its response is done."""

    def __init__(self) -> None:
        self.begun = trio.Event()
        self.in_flight = 0
        """Requests in flight: from their head's arrival to their response's end."""
        self.ended = 0
        """Requests whose response ended, since the server started."""
        self._quiet = trio.Event()
        self.idle: set[Connection] = set()

    def begin(self) -> None:
        self.begun.set()
        for connection in list(self.idle):
            connection.close_idle()
        if not self.in_flight:
            self._quiet.set()

    async def quiet(self) -> None:
        """Return once the drain has begun and no request is in flight."""
        await self._quiet.wait()

    def request_done(self) -> None:
        self.in_flight -= 1
        self.ended += 1
        if not self.in_flight and self.begun.is_set():
            self._quiet.set()


class _ClientGone(Exception):
    pass


class AbortConnection(Exception):
    """Raised by a streaming body to drop the connection at once, without ending the message (a reset)."""


class Connection:
    """One client connection: reads requests, runs the handler, writes responses, until either side closes."""

    def __init__(self, stream: trio.abc.Stream, handler: Handler, limits: Limits, peer: str = "",
                 stopping: Stopping | None = None) -> None:
        self.stream = stream
        self.stopping = stopping or Stopping()
        self.handler = handler
        self.limits = limits
        self.peer = peer
        self.conn = h11.Connection(h11.SERVER)
        # The reader task hands what it reads to this task; unbuffered, so it reads ahead by one piece at most.
        self._inbox_in, self._inbox = trio.open_memory_channel[bytes | bytearray](0)
        self._pending: Bytes = b""
        """What a read brought that h11 has not been given yet (:data:`_FEED_SIZE`, :meth:`_read_body`)."""
        self._nursery: trio.Nursery | None = None
        self._handling: trio.CancelScope | None = None
        self._read_closed = False
        """The client sent EOF: it will send nothing more (it left, or closed only its sending side)."""
        self._gone = False
        """The client is gone for sure: a reset, or a write that failed."""
        self._probing: trio.Event | None = None
        """Set while :meth:`_tell_apart` writes its interim response; other writes wait for it."""
        self._body_past_h11 = False
        """The current request's body was read around h11 (:meth:`_read_body`)."""

    async def _reader(self) -> None:
        """Owns the socket's receiving side for the connection's whole life, so a hang-up is seen at once, also
        while a handler runs (then it cancels the handler's scope). One long-lived task per connection: a
        watcher task per request cost more than the rest of the server's work (``bench/overhead.py``)."""
        async with self._inbox_in:
            while True:
                try:
                    data = await self.stream.receive_some(READ_SIZE)
                except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                    self._lose()  # a reset: the client is gone
                    return
                if not data:
                    break
                await self._inbox_in.send(data)
        self._read_closed = True
        if self._handling is not None:
            await self._tell_apart(self._handling)

    def _lose(self) -> None:
        """The client is gone: cancel the handler, if one runs."""
        self._gone = True
        if self._handling is not None:
            self._handling.cancel()

    async def _tell_apart(self, scope: trio.CancelScope) -> None:
        """EOF came while the response of the handler running in ``scope`` is due: tell a client that left from
        one that only half-closed, and cancel the handler of the first.

        TCP shows both as the same EOF until something is written: a client that left answers a write with a
        reset. Before the response has started, the probe is an interim ``100 Continue``, which an HTTP/1.1 client
        must accept and skip before the final response (RFC 9110, 15.2); the reset is then seen as the socket's
        pending error within about a round trip (watched for 1 s). An HTTP/1.0 client may not get an interim
        response: it gets its answer, and only a failed write of it counts as gone. Once the response body has
        started, EOF is taken as the client leaving (no byte can be added to a body to probe it); once the whole
        response is on its way out, its write tells.
        """
        if self.conn.our_state is h11.SEND_BODY:
            self._lose()
            return
        sock = getattr(self.stream, "socket", None)
        if self.conn.our_state is not h11.SEND_RESPONSE or sock is None \
                or self.conn.their_http_version is None or self.conn.their_http_version < b"1.1":
            return
        try:
            data = self.conn.send(h11.InformationalResponse(status_code=100, reason=b"Continue", headers=[])) or b""
        except h11.LocalProtocolError:
            return
        self._probing = written = trio.Event()
        try:
            await self.stream.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            self._lose()
            return
        finally:
            self._probing = None
            written.set()
        delay = 0.001
        while scope is self._handling:
            if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
                self._lose()
                return
            if delay > 1.0:
                return  # no reset within a second of a round trip: the client is there, only done sending
            await trio.sleep(delay)
            delay *= 2

    def close_idle(self) -> None:
        """The server drains while this connection waits for a request: close it (its serving task ends)."""
        if self._nursery is not None:
            self._nursery.cancel_scope.cancel()

    async def _take(self) -> Bytes:
        """The client's next bytes that h11 has not been given: those pending, else the reader's next read; empty at
        the client's EOF."""
        if self._pending:
            data, self._pending = self._pending, b""
            return data
        try:
            return await self._inbox.receive()
        except trio.EndOfChannel:
            return b""

    def _feed(self, data: Bytes) -> None:
        """Give h11 ``data`` (empty: the client's EOF), at most :data:`_FEED_SIZE` bytes of it; the rest is pending."""
        if len(data) > _FEED_SIZE:
            view = memoryview(data)
            data, self._pending = view[:_FEED_SIZE], view[_FEED_SIZE:]
        # h11 takes any bytes-like object; its annotation says bytes
        self.conn.receive_data(data)  # type: ignore[arg-type]

    async def _receive(self) -> None:
        self._feed(await self._take())

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

    async def _send(self, *events: h11.Event) -> None:
        if self._probing is not None:  # the interim response goes out first, whole
            await self._probing.wait()
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
                self._nursery = nursery
                nursery.start_soon(self._reader)
                await self._serve_requests()
                nursery.cancel_scope.cancel()
        finally:
            try:
                await close(self.stream, timeout=1)
            except Exception:  # noqa: BLE001 - closing a dead socket may fail in many ways; nothing to do
                pass

    async def _serve_requests(self) -> None:
        first = True
        stopping = self.stopping
        try:
            while True:
                timeout = self.limits.header_timeout_s if first else self.limits.keepalive_timeout_s
                first = False
                if stopping.begun.is_set():
                    return
                # Idle while nothing of the next request has arrived: a drain closes the connection then.
                idle = not self._pending and not self.conn.trailing_data[0]
                if idle:
                    stopping.idle.add(self)
                try:
                    event = await self._next_event(timeout)
                except trio.TooSlowError:
                    return
                except h11.RemoteProtocolError:
                    await self._bad_request()
                    return
                finally:
                    if idle:
                        stopping.idle.discard(self)
                if isinstance(event, h11.ConnectionClosed) or not isinstance(event, h11.Request):
                    return
                request = Request(event.method.decode("ascii", "replace"), event.target.decode("latin-1"),
                                  list(event.headers), received_at=time.perf_counter(), peer=self.peer)
                stopping.in_flight += 1
                try:
                    if not await self._read_body(request):
                        return
                    request.body_at = time.perf_counter()
                    await self._respond(request)
                finally:
                    stopping.request_done()
                if self.conn.our_state is h11.MUST_CLOSE or self.conn.their_state is h11.MUST_CLOSE:
                    return
                try:
                    self._next_cycle()
                except h11.LocalProtocolError:
                    return
        except _ClientGone:
            return

    def _next_cycle(self) -> None:
        """Make the connection ready for its next request, once the response is complete.

        Raises:
            h11.LocalProtocolError: the response is not complete.
        """
        if not self._body_past_h11:
            self.conn.start_next_cycle()
            return
        # h11 still awaits the body it did not see (_read_body): a fresh state (what came after the body is pending).
        if self.conn.our_state is not h11.DONE:
            raise h11.LocalProtocolError("the response is not complete")
        self.conn = h11.Connection(h11.SERVER)
        self._body_past_h11 = False

    async def _bad_request(self, path: str | None = None, detail: str = "") -> None:
        """Answer 400 to a request HTTP/1.1 cannot read: in the API of its ``path`` when the head was read (the
        limits' ``error_body``) and saying what broke (``detail``); else in OpenAI's shape, quoting nothing of the
        head (h11's words on a head may quote a header's value, a key)."""
        if self.conn.our_state not in (h11.IDLE, h11.SEND_RESPONSE):
            return
        message = f"malformed HTTP request: {detail}" if detail else "malformed HTTP request"
        if path is not None and self.limits.error_body is not None:
            body = self.limits.error_body(path, 400, message)
        else:
            # Imported here: the HTTP clients and the scripted upstream import this module without the formats
            # (26 ms), and only a head that cannot be read needs them.
            from .formats.base import openai_error_body
            body = openai_error_body(400, message)
        try:
            await self._send(h11.Response(status_code=400, reason=reason(400), headers=[(b"content-type", b"application/json"),
                                                                    (b"content-length", str(len(body)).encode()),
                                                                    (b"connection", b"close")]),
                             h11.Data(data=body), h11.EndOfMessage())
        except (_ClientGone, h11.LocalProtocolError):
            pass

    async def _read_body(self, request: Request) -> bool:
        """Read the body of ``request`` into it; False when the connection is to be closed: without an answer, or
        after a 400 for a body framed both by ``content-length`` and ``transfer-encoding`` (RFC 9112 section 6.3: a
        front end that reads the other framing would see another request where this one ends).

        A body framed by its ``content-length`` goes through h11 only as far as h11 was given it already (with the
        head); the rest is kept as the socket's reads brought it (``Request.content``), never given to h11, which
        would copy each byte twice more before the pieces were joined (for a body of megabytes those copies and the
        fresh memory they fill cost more than the reads). h11 then still awaits that body: the connection's next
        request starts on a fresh h11 state (:meth:`_next_cycle`).
        """
        declared = request.header("content-length")
        chunked = request.header("transfer-encoding") is not None
        if chunked and declared is not None:
            await self._bad_request(request.path, "both Content-Length and Transfer-Encoding are set")
            return False
        length = int(declared) if declared is not None and declared.isdigit() else None
        if length is not None and length > self.limits.max_body_bytes:
            request.too_large = True
            return True
        if chunked:
            length = None  # chunked: h11 reads it whole
        parts: list[Bytes] = []  # all join and write alike (h11's Data holds bytes or a bytearray, too)
        size = 0
        try:
            if self.conn.they_are_waiting_for_100_continue:
                # A client that sent `Expect: 100-continue` holds its body back until told to go on (curl waits
                # 1 s for it on every body over 1 MiB); one refused by its declared size got its 413 above.
                await self._send(h11.InformationalResponse(status_code=100, reason=b"Continue", headers=[]))
            # The total deadline shortens the wait for the next read instead of wrapping the loop in a cancel scope
            # of its own: a scope costs about 10 us, and most bodies arrive with their head, needing no wait.
            deadline = trio.current_time() + self.limits.body_deadline_s
            while True:
                event = self.conn.next_event()
                if event is h11.NEED_DATA:
                    if self._pending:  # what the last read brought past h11's feed: nothing to wait for
                        data = await self._take()
                    else:
                        try:
                            with trio.fail_after(min(self.limits.body_timeout_s,
                                                     max(0.0, deadline - trio.current_time()))):
                                data = await self._take()
                        except trio.TooSlowError:
                            if trio.current_time() < deadline:
                                return False  # a stall between two reads: the client is not sending
                            request.too_slow = True
                            return True
                    if not data and length is not None:  # h11 has not seen what came past it: its count is not ours
                        await self._bad_request(request.path, f"its body ended after {size} of the {length} bytes "
                                                              "its content-length declares")
                        return False
                    if length is None or not data:  # chunked, or the client's EOF (which h11 judges)
                        self._feed(data)
                        continue
                    if len(data) > length - size:  # the next request's start came too (pipelined)
                        view = memoryview(data)
                        data, self._pending = view[:length - size], view[length - size:]
                    parts.append(data)
                    size += len(data)
                    if size == length:
                        self._body_past_h11 = True
                        break
                elif isinstance(event, h11.Data):
                    size += len(event.data)
                    if size > self.limits.max_body_bytes:
                        request.too_large = True
                        return True
                    parts.append(event.data)
                elif isinstance(event, h11.EndOfMessage):
                    break
                else:
                    return False
        except h11.RemoteProtocolError as exc:
            # h11's words on a body's framing quote no header (a chunk's size line at most: the client's own bytes).
            await self._bad_request(request.path, f"its body: {str(exc)[:200]}")
            return False
        request.content = tuple(parts)  # type: ignore[arg-type]  # bytes-like pieces (see parts)
        return True

    async def _respond(self, request: Request) -> None:
        gone = False
        with trio.CancelScope() as scope:
            # Clients do not send while awaiting a response (no pipelining in practice): the reader sees only an EOF
            # or a reset, and tells them apart (_tell_apart).
            self._handling = scope
            if self._gone:
                scope.cancel()
            elif self._read_closed and self._nursery is not None:
                self._nursery.start_soon(self._tell_apart, scope)
            try:
                await self._run_handler(request)
            except (_ClientGone, AbortConnection):
                gone = True
            finally:
                self._handling = None
        if gone or self._gone:
            raise _ClientGone()

    async def _run_handler(self, request: Request) -> None:
        response = await self.handler(request)
        try:
            await self._write(request, response)
        finally:
            if response.after is not None:
                await _after(response.after)

    async def _write(self, request: Request, response: Response) -> None:
        body = response.body
        headers = list(response.headers)
        # The rest of its body may still come, or the server drains: no next request.
        if request.too_large or request.too_slow or self.stopping.begun.is_set():
            headers.append((b"connection", b"close"))
        if isinstance(body, (bytes, bytearray)):
            if not any(k == b"content-length" for k, _ in headers):
                headers.append((b"content-length", str(len(body)).encode()))
            head = h11.Response(status_code=response.status, reason=reason(response.status, response.reason), headers=headers)
            if body and request.method != "HEAD":
                await self._send(head, h11.Data(data=body), h11.EndOfMessage())
            else:
                await self._send(head, h11.EndOfMessage())
            return
        try:
            if not any(k in (b"content-length", b"transfer-encoding") for k, _ in headers):
                headers.append((b"transfer-encoding", b"chunked"))
            await self._send(h11.Response(status_code=response.status, reason=reason(response.status, response.reason), headers=headers))
            async for chunk in body:
                if chunk:
                    await self._send(h11.Data(data=chunk))
            await self._send(h11.EndOfMessage())
        finally:
            await close(body)


async def _after(step: Callable[[], Awaitable[None]]) -> None:
    """Run a response's ``after`` step (:attr:`Response.after`)."""
    with trio.CancelScope(shield=True, deadline=trio.current_time() + AFTER_S) as scope:
        try:
            await step()
        except Exception as exc:  # noqa: BLE001 - the response is out: a failure after it is only reported
            log.error("the step after a response failed (%s: %s)", type(exc).__name__, exc)
    if scope.cancelled_caught:
        log.error("the step after a response was given up after %g s", AFTER_S)


async def serve_listeners(
        listeners: list[trio.SocketListener], handler: Handler, limits: Limits, stopping: Stopping | None = None,
        task_status: trio.TaskStatus[list[trio.SocketListener]] = trio.TASK_STATUS_IGNORED) -> None:
    """Accept connections on ``listeners``, each connection in its own task of one nursery, until ``stopping``
    begins (:class:`Stopping`; without one, forever); then close the listeners (a load balancer moves on at once)
    and return once every connection is done."""
    stopping = stopping or Stopping()

    async def handle(stream: trio.SocketStream) -> None:
        try:
            peer = "%s:%s" % stream.socket.getpeername()[:2]
        except OSError:
            peer = ""
        try:
            await Connection(stream, handler, limits, peer, stopping).serve()
        except Exception:  # noqa: BLE001 - one broken connection must never take the server down
            log.exception("connection from %s failed", peer)

    async with trio.open_nursery() as connections:
        async with trio.open_nursery() as accepting:
            await accepting.start(functools.partial(trio.serve_listeners, handle, listeners,
                                                    handler_nursery=connections))
            task_status.started(listeners)
            await stopping.begun.wait()
            accepting.cancel_scope.cancel()
        for listener in listeners:
            await listener.aclose()


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
    port: int = listeners[0].socket.getsockname()[1]
    return port
