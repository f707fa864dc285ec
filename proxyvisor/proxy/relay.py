"""The byte relay: forwards a request to an upstream that speaks the client's format, over :mod:`.client`.

Bodies are never re-encoded: the request body goes up as received, and the response body comes back as the
upstream sent it (even a compressed body is passed through with its ``content-encoding``). Server-Sent Event
streams are forwarded as they arrive, each piece as soon as it is read (what arrived together is forwarded
together); other bodies, and every error body (status 400 and above), are read whole first (so a body cut short
becomes a clean 502 instead of a truncated 200). The one change ever made to a body: an error body that quotes
the upstream's configured API key gets ``[redacted]`` in its place. A compressed error body is searched decoded
and, when it quoted the key, relayed decoded (without its ``content-encoding``); one that cannot be decoded
within :data:`MAX_DECODED_ERROR` is not relayed at all. The client's headers go up as they are, less hop-by-hop
ones: nothing is added but ``host`` and ``content-length``.

Failures become :class:`UpstreamError` with the status the client should see: 502 for a refused or reset
connection or a DNS failure, 504 for a first byte later than ``first_byte_timeout_s``. A stream that breaks
after its headers were sent is reported by :class:`RelayedStream` through its ``error`` attribute, and the
caller ends the client's stream with the format's error event.
"""

from __future__ import annotations

import ssl
import time
from collections.abc import AsyncIterable, AsyncIterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import h11
import trio

from .. import wirejson
from ..adapters.failures import retry_after_header
from ..config import UpstreamConfig
from . import limits
from .client import Connection, ConnectionPool, ConnectTimeout, Cut
from .codings import UndecodableBody, decode

Headers = list[tuple[bytes, bytes]]

# RFC 9110 hop-by-hop headers, plus the ones h11 computes itself.
_HOP_BY_HOP = frozenset({b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"te",
                         b"trailer", b"transfer-encoding", b"upgrade", b"host", b"content-length"})
_AUTH = frozenset({b"authorization", b"x-api-key", b"api-key"})
MAX_DECODED_ERROR = 16 * 1024 * 1024
"""The most bytes a compressed error body may decode to for its search for the configured key."""
# What a broken upstream connection raises: resets and refusals (OSError, including ssl.SSLError and DNS
# failures), trio's wrappers of them, and h11's verdict on a malformed or truncated message.
_BROKEN = (OSError, trio.BrokenResourceError, trio.ClosedResourceError, h11.ProtocolError)


class UpstreamError(Exception):
    """The upstream could not be reached, did not answer in time, or answered an error that cannot be relayed.

    ``status`` is what the client should get (502 unreachable or broken, 504 timed out, the upstream's own
    status for an error body that cannot be checked for the configured key); ``message`` says which upstream and
    what happened, without any credential.
    """

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass
class UpstreamReply:
    """The upstream's status and headers, and its body as bytes or as a live stream (a :class:`RelayedStream`, a
    translated stream, a stage of the reply path: ``proxyvisor.proxy.reply``)."""

    status: int
    headers: Headers
    body: bytes | AsyncIterable[Any]
    upstream_s: float = 0.0
    """Time spent waiting on the upstream before the reply was ready (s): to the headers for a stream, to the
    last byte otherwise."""
    reason: bytes = b""
    """The upstream's reason phrase (``proxyvisor.proxy.server.reason`` keeps it for a status the standard does not
    name)."""

    decoded: Any = field(default=None, repr=False, compare=False)
    """The JSON body decoded, once a stage read it (:meth:`json`); a stage that rewrites the body sets it to what it
    wrote, so that the stages after it read the object instead of decoding the bytes again."""

    @property
    def streaming(self) -> bool:
        return not isinstance(self.body, bytes)

    def with_body(self, body: bytes | AsyncIterable[Any], decoded: Any = None,
                  headers: Headers | None = None) -> UpstreamReply:
        """This reply with ``body`` in its place (``decoded``: that body's JSON, when known), as a stage rewrites
        it: its status, reason phrase, headers (unless ``headers``) and upstream time kept."""
        return UpstreamReply(self.status, self.headers if headers is None else headers, body, self.upstream_s,
                             self.reason, decoded)

    def json(self) -> Any:
        """The JSON body decoded, once for all the stages a reply passes (the object is theirs to read; a stage
        that must change it works on a copy, or replaces the reply).

        Raises:
            orjson.JSONDecodeError: the body is not JSON.
        """
        if self.decoded is None:
            assert isinstance(self.body, bytes)
            self.decoded = wirejson.loads(self.body)
        return self.decoded


STOPPED_MID_STREAM = "the proxy stopped before the stream ended ([proxy] shutdown_grace_s)"
"""The error a stream still relaying when the proxy's shutdown grace is over ends with (status 503)."""


def stopped_or_idle(cut: Cut, idle_timeout_s: float) -> UpstreamError:
    """The failure of an upstream stream whose wait for its next piece ended: the proxy's stop (``cut``), or its
    idle timeout."""
    if cut.done:
        return UpstreamError(503, STOPPED_MID_STREAM)
    return UpstreamError(504, f"upstream sent nothing for {idle_timeout_s:g} s mid-stream")


@dataclass
class RelayedStream:
    """An upstream SSE body. Iterate it once; afterwards ``error`` is None or the failure that cut it short.

    Each item is what one read brought (several upstream chunks when they arrived together), yielded at once.
    The connection goes back to the pool when the body ended cleanly, and is closed otherwise. A wait for the next
    piece ends at ``cut`` (:class:`~.client.Cut`).
    """

    conn: Connection
    pool: ConnectionPool
    idle_timeout_s: float
    cut: Cut
    error: UpstreamError | None = None
    last_chunk: bytes = b""
    wait_s: float = 0.0
    """Time spent waiting for upstream chunks (s)."""
    _closed: bool = field(default=False, repr=False)
    _complete: bool = field(default=False, repr=False)

    async def __aiter__(self) -> AsyncIterator[bytes]:
        try:
            while not self._complete:
                started = time.perf_counter()
                try:
                    chunk, self._complete = await self.conn.next_piece(self.idle_timeout_s, self.cut)
                except trio.TooSlowError:
                    self.error = stopped_or_idle(self.cut, self.idle_timeout_s)
                    return
                except _BROKEN as exc:
                    self.error = UpstreamError(502, f"upstream stream broke: {_describe(exc)}")
                    return
                finally:
                    self.wait_s += time.perf_counter() - started
                if chunk:
                    self.last_chunk = chunk
                    yield chunk
        finally:
            await self.aclose()

    async def aclose(self) -> None:
        if not self._closed:
            self._closed = True
            await self.pool.release(self.conn, self._complete)


def _describe(exc: BaseException) -> str:
    # trio wraps the OS or TLS error that broke a stream in a bare BrokenResourceError: its cause says what.
    while isinstance(exc, trio.BrokenResourceError) and not str(exc) and exc.__cause__ is not None:
        exc = exc.__cause__
    text = str(exc) or type(exc).__name__
    return f"{type(exc).__name__}: {text}" if str(exc) else text


def base_url(url: str) -> str:
    """The upstream origin and path prefix, without a trailing ``/`` or ``/v1`` (request paths carry ``/v1``)."""
    url = url.rstrip("/")
    return url[:-3] if url.endswith("/v1") else url


def upstream_headers(client_headers: Headers, api_key: str | None, key_header: bytes,
                     accept_identity: bool = False) -> Headers:
    """The headers sent upstream: the client's, less hop-by-hop ones and proxyvisor's own ``x-proxyvisor-*``.

    With ``api_key``, the client's credentials are dropped and the key is sent in ``key_header`` (``x-api-key``
    for Anthropic, else ``authorization: Bearer``).
    """
    out: Headers = []
    for name, value in client_headers:
        if name in _HOP_BY_HOP or name.startswith(b"x-proxyvisor-"):
            continue
        if api_key is not None and name in _AUTH:
            continue
        if accept_identity and name == b"accept-encoding":
            continue
        out.append((name, value))
    if api_key is not None:
        value = api_key.encode() if key_header == b"x-api-key" else b"Bearer " + api_key.encode()
        out.append((key_header, value))
    if accept_identity:
        out.append((b"accept-encoding", b"identity"))
    return out


def reply_headers(headers: Headers, status: int) -> Headers:
    """The upstream's response headers (names as sent) for the client, less hop-by-hop ones; a 429 always gets
    Retry-After (from ``retry-after-ms`` when the upstream sent only that, else 1 s)."""
    out = [(k, v) for k, v in headers if k.lower() not in _HOP_BY_HOP]
    if status == 429 and not any(k.lower() == b"retry-after" for k, _ in out):
        ms = next((v.decode("latin-1") for k, v in out if k.lower() == b"retry-after-ms"), None)
        seconds = retry_after_header(None, 0.0, ms) or 1
        out.append((b"retry-after", str(seconds).encode()))
    return out


class HttpRelay:
    """Pooled keep-alive connections to one configured upstream. Create inside trio; close with :meth:`aclose`."""

    def __init__(self, upstream: UpstreamConfig, url: str | None = None, api_key: str | None = None,
                 ssl_context: ssl.SSLContext | None = None) -> None:
        self.upstream = upstream
        self.base = base_url(url or upstream.url)
        self.api_key = api_key
        self.prefix = urlsplit(self.base).path
        """The upstream URL's path, put before each request's target (``/openai`` in ``https://h/openai/v1``)."""
        self.pool = ConnectionPool(self.base, upstream.connect_timeout_s, max_idle=256,
                                   idle_expiry_s=upstream.keepalive_timeout_s, ssl_context=ssl_context)
        self.cut = Cut()
        """Ends the waits of this relay's streams (:class:`RelayedStream`) when the proxy stops."""

    async def expire_idle(self) -> None:
        """Close idle upstream connections as they expire (``keepalive_timeout_s``); runs until cancelled, in the
        nursery that owns the relay."""
        await self.pool.expire_idle()

    async def aclose(self) -> None:
        await self.pool.aclose()

    async def send(self, method: str, target: str, headers: Headers, body: bytes | tuple[bytes, ...]) -> UpstreamReply:
        """Send one request and return the reply (SSE bodies as a live :class:`RelayedStream`). ``body`` is the
        request body, or its pieces in order (a large piece written as it is, small ones joined into writes of up to
        256 KB: :func:`proxyvisor.proxy.client._writes`).

        ``target`` is the path and query as the client sent them, without any session prefix. Cancellation
        closes the upstream connection.

        Raises:
            UpstreamError: unreachable or broken before the head (502), no connection within
                ``connect_timeout_s`` or no head within ``first_byte_timeout_s`` (504), a non-streaming body
                cut short (502) or stalled for ``idle_timeout_s`` (504), an error body in a content coding that
                cannot be undone within :data:`MAX_DECODED_ERROR` bytes while a key is configured (the
                upstream's status).
        """
        name = self.upstream.name
        started = time.perf_counter()
        try:
            with trio.fail_after(self.upstream.first_byte_timeout_s):
                # latin-1: the exact bytes the server decoded the client's target from.
                conn, head = await self.pool.request(method.encode("latin-1"), (self.prefix + target).encode("latin-1"),
                                                     headers, body)
        except trio.TooSlowError:
            raise UpstreamError(504, f"upstream {name!r} sent no response within "
                                     f"{self.upstream.first_byte_timeout_s:g} s") from None
        except ConnectTimeout as exc:
            raise UpstreamError(504, f"upstream {name!r} timed out: {exc}") from None
        except _BROKEN as exc:
            raise UpstreamError(502, f"upstream {name!r} unreachable: {_describe(exc)}") from None
        status = head.status_code
        headers_out = reply_headers(head.headers.raw_items(), status)
        ctype = next((v for k, v in head.headers if k == b"content-type"), b"")
        if ctype.startswith(b"text/event-stream") and status < 400:
            return UpstreamReply(status, headers_out, RelayedStream(conn, self.pool, self.upstream.idle_timeout_s,
                                                                     self.cut),
                                 time.perf_counter() - started, head.reason)
        parts: list[bytes] = []
        size, complete = 0, False
        try:
            while not complete:
                piece, complete = await conn.next_piece(self.upstream.idle_timeout_s)
                size += len(piece)
                if size > limits.MAX_BUFFERED_BODY:
                    raise UpstreamError(502, f"upstream {name!r} response exceeds {limits.MAX_BUFFERED_BODY} "
                                             "bytes")
                parts.append(piece)
        except trio.TooSlowError:
            raise UpstreamError(504, f"upstream {name!r} sent nothing for {self.upstream.idle_timeout_s:g} s "
                                     "mid-body") from None
        except _BROKEN as exc:
            raise UpstreamError(502, f"upstream {name!r} response cut short: {_describe(exc)}") from None
        finally:
            await self.pool.release(conn, complete)
        data = b"".join(parts)
        if status >= 400 and self.api_key and len(self.api_key) >= 4:
            data, headers_out = self._redacted(status, headers_out, data)
        return UpstreamReply(status, headers_out, data, time.perf_counter() - started, head.reason)

    def _redacted(self, status: int, headers: Headers, data: bytes) -> tuple[bytes, Headers]:
        """An error body and its headers with the configured key replaced by ``[redacted]``.

        An upstream quoting the credential back ("Incorrect API key provided: ...") must not hand the key
        configured for proxyvisor to its client (the translation path redacts litellm's errors alike). A body in a
        content coding is searched decoded, and only when it holds the key is it relayed decoded, without its
        ``content-encoding`` (the server sets the new length).

        Raises:
            UpstreamError: with ``status``, the body is in a coding that cannot be undone within
                :data:`MAX_DECODED_ERROR` bytes, so it cannot be checked.
        """
        assert self.api_key is not None  # the caller redacts only when a key is configured
        key = self.api_key.encode()
        codings = ", ".join(v.decode("latin-1") for k, v in headers if k.lower() == b"content-encoding")
        try:
            plain = decode(data, codings, MAX_DECODED_ERROR)
        except UndecodableBody as exc:
            raise UpstreamError(status, f"upstream {self.upstream.name!r} answered {status} with an error body in "
                                        f"content-encoding {codings!r} that proxyvisor cannot check for its "
                                        f"configured key ({exc}); not relayed") from None
        if key not in plain:
            return data, headers
        return plain.replace(key, b"[redacted]"), [(k, v) for k, v in headers if k.lower() != b"content-encoding"]
