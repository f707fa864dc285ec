"""The byte relay: forwards a request to an upstream that speaks the client's format, with httpx on trio.

Bodies are never re-encoded: the request body goes up as received, and the response body comes back as the
upstream sent it (``aiter_raw``: even a compressed body is passed through with its ``content-encoding``).
Server-Sent Event streams are forwarded chunk by chunk as they arrive; other bodies are read whole first (so
a body cut short becomes a clean 502 instead of a truncated 200).

Failures become :class:`UpstreamError` with the status the client should see: 502 for a refused or reset
connection or a DNS failure, 504 for a first byte later than ``first_byte_timeout_s``. A stream that breaks
after its headers were sent is reported by :class:`RelayedStream` through its ``error`` attribute, and the
caller ends the client's stream with the format's error event.
"""

from __future__ import annotations

import math
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import httpx
import trio

from ..config import UpstreamConfig

Headers = list[tuple[bytes, bytes]]

# RFC 9110 hop-by-hop headers, plus the ones httpx/h11 compute themselves.
_HOP_BY_HOP = frozenset({b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"te",
                         b"trailer", b"transfer-encoding", b"upgrade", b"host", b"content-length"})
_AUTH = frozenset({b"authorization", b"x-api-key", b"api-key"})
MAX_BUFFERED_BODY = 256 * 1024 * 1024


class UpstreamError(Exception):
    """The upstream could not be reached or did not answer in time.

    ``status`` is what the client should get (502 unreachable or broken, 504 timed out); ``message`` says which
    upstream and what happened, without any credential.
    """

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass
class UpstreamReply:
    """The upstream's status and headers, and its body as bytes or as a live stream."""

    status: int
    headers: Headers
    body: bytes | RelayedStream
    upstream_s: float = 0.0
    """Time spent waiting on the upstream before the reply was ready (s): to the headers for a stream, to the
    last byte otherwise."""

    @property
    def streaming(self) -> bool:
        return not isinstance(self.body, bytes)


@dataclass
class RelayedStream:
    """An upstream SSE body. Iterate it once; afterwards ``error`` is None or the failure that cut it short."""

    response: httpx.Response
    idle_timeout_s: float
    error: UpstreamError | None = None
    last_chunk: bytes = b""
    wait_s: float = 0.0
    """Time spent waiting for upstream chunks (s)."""
    _closed: bool = field(default=False, repr=False)

    async def __aiter__(self) -> AsyncIterator[bytes]:
        raw = self.response.aiter_raw()
        try:
            while True:
                started = time.perf_counter()
                try:
                    with trio.fail_after(self.idle_timeout_s):
                        chunk = await raw.__anext__()
                except StopAsyncIteration:
                    return
                except trio.TooSlowError:
                    self.error = UpstreamError(504, f"upstream sent nothing for {self.idle_timeout_s:g} s mid-stream")
                    return
                except httpx.HTTPError as exc:
                    self.error = UpstreamError(502, f"upstream stream broke: {_describe(exc)}")
                    return
                finally:
                    self.wait_s += time.perf_counter() - started
                self.last_chunk = chunk
                yield chunk
        finally:
            await self.aclose()

    async def aclose(self) -> None:
        if not self._closed:
            self._closed = True
            with trio.CancelScope(shield=True):
                await self.response.aclose()


def _describe(exc: BaseException) -> str:
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


def reply_headers(headers: httpx.Headers, status: int) -> Headers:
    """The upstream's response headers for the client, less hop-by-hop ones; a 429 always gets Retry-After."""
    out = [(k, v) for k, v in headers.raw if k.lower() not in _HOP_BY_HOP]
    if status == 429 and not any(k.lower() == b"retry-after" for k, _ in out):
        ms = headers.get("retry-after-ms")
        seconds = max(1, math.ceil(float(ms) / 1000)) if ms and ms.replace(".", "", 1).isdigit() else 1
        out.append((b"retry-after", str(seconds).encode()))
    return out


class HttpRelay:
    """A pooled httpx client for one configured upstream. Create inside trio; close with :meth:`aclose`."""

    def __init__(self, upstream: UpstreamConfig, url: str | None = None, api_key: str | None = None) -> None:
        self.upstream = upstream
        self.base = base_url(url or upstream.url)
        self.api_key = api_key
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(connect=upstream.connect_timeout_s, read=upstream.idle_timeout_s,
                                  write=upstream.idle_timeout_s, pool=upstream.connect_timeout_s),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=256, keepalive_expiry=30),
            trust_env=False, follow_redirects=False,
        )

    async def aclose(self) -> None:
        await self.client.aclose()

    async def send(self, method: str, target: str, headers: Headers, body: bytes) -> UpstreamReply:
        """Send one request and return the reply (SSE bodies as a live :class:`RelayedStream`).

        ``target`` is the path and query as the client sent them, without any session prefix. Cancellation
        closes the upstream connection.

        Raises:
            UpstreamError: unreachable (502), first byte later than ``first_byte_timeout_s`` (504), or a
                non-streaming body cut short (502).
        """
        started = time.perf_counter()
        request = self.client.build_request(method, self.base + target, headers=headers, content=body)
        try:
            with trio.fail_after(self.upstream.first_byte_timeout_s):
                response = await self.client.send(request, stream=True)
        except trio.TooSlowError:
            raise UpstreamError(504, f"upstream {self.upstream.name!r} sent no response within "
                                     f"{self.upstream.first_byte_timeout_s:g} s") from None
        except httpx.TimeoutException as exc:
            raise UpstreamError(504, f"upstream {self.upstream.name!r} timed out: {_describe(exc)}") from None
        except httpx.HTTPError as exc:
            raise UpstreamError(502, f"upstream {self.upstream.name!r} unreachable: {_describe(exc)}") from None
        headers_out = reply_headers(response.headers, response.status_code)
        if response.headers.get("content-type", "").startswith("text/event-stream"):
            return UpstreamReply(response.status_code, headers_out,
                                 RelayedStream(response, self.upstream.idle_timeout_s),
                                 time.perf_counter() - started)
        try:
            parts, size = [], 0
            async for chunk in response.aiter_raw():
                size += len(chunk)
                if size > MAX_BUFFERED_BODY:
                    raise UpstreamError(502, f"upstream {self.upstream.name!r} response exceeds "
                                             f"{MAX_BUFFERED_BODY} bytes")
                parts.append(chunk)
        except httpx.HTTPError as exc:
            raise UpstreamError(502, f"upstream {self.upstream.name!r} response cut short: {_describe(exc)}") from None
        finally:
            await response.aclose()
        return UpstreamReply(response.status_code, headers_out, b"".join(parts), time.perf_counter() - started)
