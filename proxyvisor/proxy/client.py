"""A lean HTTP/1.1 client on trio and h11: the byte relay's connection to its upstream.

Why not httpx: on the disabled path the upstream call is most of proxyvisor's own cost, and httpx (request and
response models, URL and header objects, httpcore's pool and anyio backend beneath) spent about 1.0 ms of CPU
on a 77 KB chat request where h11 alone spends about 0.35 ms (``bench/overhead.py``; DESIGN.md, principle 4).
This module keeps what the relay needs and nothing else: keep-alive connections per upstream origin, TLS,
head and body in one write, and response bodies read as the bytes arrive (several chunks that arrived together
come back as one piece, so a burst costs one write to the client, not one per chunk).

It sends exactly the headers it is given, plus ``host`` and ``content-length``: nothing like httpx's default
``accept-encoding`` or ``user-agent`` is added. Errors are raised as they occur (``OSError``, including
``ssl.SSLError`` and DNS failures, ``trio.BrokenResourceError``, ``h11.ProtocolError``, :class:`ConnectTimeout`);
the caller maps them to what its client should see. The one exception: a kept-alive connection that the upstream
closed while it sat idle (providers and load balancers drop them without a ``Connection: close``) fails before
any byte of the response; such a request is sent once more on a fresh connection (:meth:`ConnectionPool.request`).
"""

from __future__ import annotations

import logging
import ssl
from collections.abc import Awaitable
from typing import TypeVar
from urllib.parse import urlsplit

import h11
import trio

from .server import READ_SIZE

Headers = list[tuple[bytes, bytes]]
T = TypeVar("T")
log = logging.getLogger("proxyvisor.upstream")

_JOINED_BODY = 256 * 1024
"""Bytes a request goes out in per write: consecutive pieces (the head, then the body's) are joined while together
they are at most this, so a body up to it goes in one write with its head, and a body that arrived in many small
reads (over a real network, a few KB each) in writes of this size, not one per read; a piece this large goes alone,
as it is (bench/overhead.py: a copy of a few MB costs more than the extra writes, one of 79 KB less, and each write
of a few KB costs more than its copy)."""
_BODY_METHODS = frozenset({b"POST", b"PUT", b"PATCH"})
# How a connection the upstream closed shows itself: a reset or a broken pipe, or h11 seeing the end of the
# stream where a response should start.
_DROPPED = (OSError, trio.BrokenResourceError, trio.ClosedResourceError, h11.RemoteProtocolError)


def _writes(pieces: list[bytes]) -> list[bytes]:
    """``pieces`` as the writes that send them: runs of consecutive pieces joined while together at most
    :data:`_JOINED_BODY` bytes, a piece that large alone and as it is (not copied); empty pieces dropped."""
    writes: list[bytes] = []
    run: list[bytes] = []
    size = 0
    for piece in pieces:
        if run and size + len(piece) > _JOINED_BODY:
            writes.append(run[0] if len(run) == 1 else b"".join(run))
            run, size = [], 0
        if piece:
            run.append(piece)
            size += len(piece)
    if run:
        writes.append(run[0] if len(run) == 1 else b"".join(run))
    return writes


class ConnectTimeout(Exception):
    """No connection (TCP, and TLS for https) within the pool's ``connect_timeout_s``."""


def tls_context() -> ssl.SSLContext:
    """Certificate checks as httpx makes them with ``trust_env=False``: certifi's CA bundle, HTTP/1.1 by ALPN."""
    import certifi

    context = ssl.create_default_context(cafile=certifi.where())
    context.set_alpn_protocols(["http/1.1"])
    return context


class Cut:
    """Ends waits for an upstream's next piece at once, those under way and those to come: the proxy's stop, once
    its shutdown grace is over, so a stream whose upstream sends nothing ends then rather than at its idle timeout.

    A wait runs through :meth:`during` with the cancel scope of its idle timeout (``trio.fail_after``: the wait
    raises ``trio.TooSlowError`` when the scope is cancelled); :meth:`cut` cancels the scopes of the waits under
    way, and of every one after it; :attr:`done` tells a wait that ended so from a timeout."""

    def __init__(self) -> None:
        self.done = False
        self._scopes: set[trio.CancelScope] = set()

    async def during(self, scope: trio.CancelScope, wait: Awaitable[T]) -> T:
        """Await ``wait``, whose scope is ``scope``, with the scope cancelled at :meth:`cut`."""
        if self.done:
            scope.cancel()
        self._scopes.add(scope)
        try:
            return await wait
        finally:
            self._scopes.discard(scope)

    def cut(self) -> None:
        self.done = True
        for scope in self._scopes:
            scope.cancel()
        self._scopes.clear()


class Connection:
    """One upstream connection and its h11 state; :meth:`next_piece` reads a response body as it arrives.

    ``exchanges`` counts the requests it completed (a connection with some is a reused one); ``received`` the
    bytes it read since its current request was sent; ``idle_since`` is the trio time it went idle.
    """

    __slots__ = ("stream", "h11", "idle_since", "exchanges", "received")

    def __init__(self, stream: trio.abc.Stream) -> None:
        self.stream = stream
        self.h11 = h11.Connection(h11.CLIENT)
        self.idle_since = 0.0
        self.exchanges = 0
        self.received = 0

    async def _receive(self) -> None:
        data = await self.stream.receive_some(READ_SIZE)
        self.received += len(data)
        # h11 takes any bytes-like object; its annotation says bytes
        self.h11.receive_data(data)  # type: ignore[arg-type]

    async def _event(self) -> object:
        while True:
            event = self.h11.next_event()
            if event is not h11.NEED_DATA:
                return event
            await self._receive()

    async def response(self) -> h11.Response:
        """The response head, past any 1xx. Raises h11.RemoteProtocolError when the upstream hangs up first."""
        while True:
            event = await self._event()
            if isinstance(event, h11.Response):
                return event
            if not isinstance(event, h11.InformationalResponse):
                raise h11.RemoteProtocolError(f"expected a response, got {type(event).__name__}")

    async def next_piece(self, timeout_s: float, cut: Cut | None = None) -> tuple[bytes, bool]:
        """(body bytes, whether the body is complete): waits for at least one byte or the end, then also takes
        what has already arrived, without waiting for more.

        Raises:
            trio.TooSlowError: a wait for the socket lasted ``timeout_s`` seconds, or ``cut`` ended it
                (``cut.done``).
            h11.RemoteProtocolError: the body was cut short.
        """
        parts: list[bytes] = []
        while True:
            event = self.h11.next_event()
            if event is h11.NEED_DATA:
                if parts:
                    return b"".join(parts), False
                # Only a wait for the socket gets a deadline: a cancel scope costs about 10 us, and a piece that
                # arrived with the head (most whole bodies) needs none.
                with trio.fail_after(timeout_s) as scope:
                    await (self._receive() if cut is None else cut.during(scope, self._receive()))
            elif isinstance(event, h11.Data):
                parts.append(event.data)
            elif isinstance(event, h11.EndOfMessage):
                return b"".join(parts), True
            else:
                raise h11.RemoteProtocolError(f"unexpected {type(event).__name__} in a response body")

    @property
    def reusable(self) -> bool:
        return self.h11.our_state is h11.DONE and self.h11.their_state is h11.DONE

    def stale(self) -> bool:
        """An idle connection with something to read has been closed by the upstream (or is out of step)."""
        stream = self.stream
        if isinstance(stream, trio.SSLStream):
            stream = stream.transport_stream
        sock = getattr(stream, "socket", None)
        return sock is None or sock.is_readable()


class ConnectionPool:
    """Keep-alive connections to one origin (``http://`` or ``https://`` host and port of ``url``).

    At most ``max_idle`` idle connections are kept, each for at most ``idle_expiry_s`` seconds: :meth:`expire_idle`,
    run in the nursery that owns the pool, closes each as its time is up (without it, expired connections are
    closed only when a request next looks for one). There is no cap on connections in use. Create and use inside
    one trio run; close with :meth:`aclose`.
    """

    def __init__(self, url: str, connect_timeout_s: float, max_idle: int = 256, idle_expiry_s: float = 30.0,
                 ssl_context: ssl.SSLContext | None = None) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {url!r}")
        self.https = parts.scheme == "https"
        self.host = parts.hostname
        default_port = 443 if self.https else 80
        self.port = parts.port or default_port
        host = f"[{self.host}]" if ":" in self.host else self.host
        host = host if self.port == default_port else f"{host}:{self.port}"
        self.host_header = host.encode("ascii") if host.isascii() else host.encode("idna")
        self.connect_timeout_s = connect_timeout_s
        self.max_idle = max_idle
        self.idle_expiry_s = idle_expiry_s
        self.ssl_context = (ssl_context or tls_context()) if self.https else None
        self._idle: list[Connection] = []
        """Oldest first: released connections are appended and taken from the end."""
        self._went_idle = trio.Event()
        self._closed = False

    async def _connect(self) -> Connection:
        try:
            with trio.fail_after(self.connect_timeout_s):
                stream: trio.abc.Stream = await trio.open_tcp_stream(self.host, self.port)
                if self.ssl_context is not None:
                    stream = trio.SSLStream(stream, self.ssl_context, server_hostname=self.host,
                                            https_compatible=True)
                    try:
                        await stream.do_handshake()
                    except BaseException:
                        await trio.aclose_forcefully(stream)
                        raise
        except trio.TooSlowError:
            raise ConnectTimeout(f"no connection to {self.host}:{self.port} within "
                                 f"{self.connect_timeout_s:g} s") from None
        return Connection(stream)

    async def _acquire(self) -> Connection:
        now = trio.current_time()
        while self._idle:
            conn = self._idle.pop()
            if now - conn.idle_since < self.idle_expiry_s and not conn.stale():
                return conn
            await trio.aclose_forcefully(conn.stream)
        return await self._connect()

    async def request(self, method: bytes, target: bytes, headers: Headers,
                      body: bytes | tuple[bytes, ...]) -> tuple[Connection, h11.Response]:
        """Send a request and wait for the response head. ``body`` is the body, or its pieces in order; a body up
        to :data:`_JOINED_BODY` bytes goes in one write with the head, a larger one in writes of about that size.

        Returns the connection, positioned at the response body (read it with :meth:`Connection.next_piece`,
        then hand it back with :meth:`release`), and the head. A reused connection that breaks before any byte
        of the response arrived (the upstream had closed it while it sat idle) is closed and the request sent
        once more on a fresh connection; a fresh connection's failure, and any failure after a response byte,
        propagate. On any error or cancellation the connection is closed and the error propagates.
        """
        head = [(b"host", self.host_header), *headers]
        pieces = (body,) if isinstance(body, bytes) else body
        size = sum(map(len, pieces))
        if size or method in _BODY_METHODS:
            head.append((b"content-length", b"%d" % size))
        request = h11.Request(method=method, target=target, headers=head)
        conn = await self._acquire()
        while True:
            try:
                return conn, await self._exchange(conn, request, pieces)
            except _DROPPED as exc:
                await trio.aclose_forcefully(conn.stream)
                if not conn.exchanges or conn.received:
                    raise
                log.debug("upstream %s:%d had closed a kept-alive connection (%s); sending the request again on "
                          "a fresh one", self.host, self.port, type(exc).__name__)
            except BaseException:
                await trio.aclose_forcefully(conn.stream)
                raise
            conn = await self._connect()

    @staticmethod
    async def _exchange(conn: Connection, request: h11.Request, pieces: tuple[bytes, ...]) -> h11.Response:
        conn.received = 0
        # h11 hands content-length body data back as the same objects: a large piece goes up without a copy.
        out = [conn.h11.send(request) or b""]
        for piece in pieces:
            if piece:
                out += conn.h11.send_with_data_passthrough(h11.Data(data=piece)) or []
        out.append(conn.h11.send(h11.EndOfMessage()) or b"")  # nothing, for a content-length body
        try:
            for data in _writes(out):
                await conn.stream.send_all(data)
        except trio.BrokenResourceError as exc:
            # An upstream may answer early (a 413, say) and close before reading the whole body: relay that
            # answer if there is one, as httpx does, rather than a bare "connection reset".
            try:
                return await conn.response()
            except (h11.ProtocolError, trio.BrokenResourceError, trio.ClosedResourceError):
                raise exc from None
        return await conn.response()

    async def release(self, conn: Connection, completed: bool) -> None:
        """Keep ``conn`` for reuse when its exchange ``completed`` cleanly and both sides allow it; else close it."""
        if completed and not self._closed and conn.reusable and len(self._idle) < self.max_idle:
            conn.h11.start_next_cycle()
            conn.exchanges += 1
            conn.idle_since = trio.current_time()
            self._idle.append(conn)
            self._went_idle.set()
        else:
            await trio.aclose_forcefully(conn.stream)

    async def expire_idle(self) -> None:
        """Close each idle connection once it has been idle for ``idle_expiry_s``; runs until cancelled."""
        while True:
            if not self._idle:
                self._went_idle = trio.Event()
                await self._went_idle.wait()
            elif trio.current_time() < (expiry := self._idle[0].idle_since + self.idle_expiry_s):
                await trio.sleep_until(expiry)
            else:
                await trio.aclose_forcefully(self._idle.pop(0).stream)

    async def aclose(self) -> None:
        self._closed = True
        idle, self._idle = self._idle, []
        for conn in idle:
            await trio.aclose_forcefully(conn.stream)
