"""The upstream side of a flaky or hostile upstream: a compressed error body quoting the configured key, idle
kept-alive connections expiring on their own, and kept-alive connections the upstream dropped without a word.

What each test pins is listed in ``docs/reliability.md``.
"""

from __future__ import annotations

import gzip
import os
import tracemalloc
import zlib

import orjson
import pytest
import trio

from proxyvisor.proxy.codings import UndecodableBody, decode
from proxyvisor.proxy.relay import MAX_DECODED_ERROR
from proxyvisor.proxy.server import Request, Response
from proxyvisor.testing import KeepAliveUpstream, serve

from helpers import FORMATS, assert_error_shape, http_client, path_of, request_body, serve_handler

MODES = pytest.mark.parametrize("supervised", [True, False], ids=["supervised", "disabled"])
KEY = "sk-canary-config-" + os.urandom(12).hex()


def _brotli(data: bytes) -> bytes:
    brotli = pytest.importorskip("brotli")
    return brotli.compress(data)


def _deflate_raw(data: bytes) -> bytes:
    deflater = zlib.compressobj(wbits=-zlib.MAX_WBITS)
    return deflater.compress(data) + deflater.flush()


ENCODERS = {"gzip": gzip.compress, "deflate": zlib.compress, "deflate-raw": _deflate_raw, "br": _brotli,
            "gzip, br": lambda data: _brotli(gzip.compress(data))}


def gzip_bomb(total: int) -> bytes:
    """Gzip members of 1 MiB of zeros each, ``total`` bytes once decoded, about a thousandth of that on the wire."""
    return gzip.compress(bytes(1 << 20), 9) * (total >> 20)


class QuotingUpstream:
    """Answers ``status`` with a body that quotes every request header back (the configured key among them),
    encoded in ``coding`` (a key of :data:`ENCODERS`, a coding nobody decodes, or none), with ``ctype``; or
    answers ``body`` as given, already encoded, under ``content-encoding: coding``."""

    def __init__(self, coding: str | None, status: int = 401, ctype: bytes = b"application/json",
                 body: bytes | None = None) -> None:
        self.coding, self.status, self.ctype, self.body = coding, status, ctype, body

    async def __call__(self, request: Request) -> Response:
        quoted = "; ".join(f"{k.decode()}={v.decode('latin-1')}" for k, v in request.headers)
        body = self.body if self.body is not None else orjson.dumps(
            {"error": {"message": f"Incorrect API key provided. You sent: {quoted}", "type": "invalid_request_error",
                       "param": None, "code": "invalid_api_key"}})
        if self.ctype.startswith(b"text/event-stream") and self.body is None:
            body = b"event: error\ndata: " + body + b"\n\n"
        headers = [(b"content-type", self.ctype)]
        if self.coding in ENCODERS and self.body is None:
            body = ENCODERS[self.coding](body)
        if self.coding is not None:
            headers.append((b"content-encoding", self.coding.removesuffix("-raw").encode()))
        return Response(self.status, headers, body)


async def post_all(url: str) -> list[tuple[str, bool, int, dict[str, str], bytes]]:
    """Every format, streamed and not, through proxyvisor at ``url``: (format, stream, status, headers, the body
    as the client's HTTP library decodes it)."""
    out = []
    async with http_client() as client:
        for fmt in FORMATS:
            for stream in (False, True):
                reply = await client.post(url + path_of(fmt), content=orjson.dumps(request_body(fmt, stream)),
                                          headers={"content-type": "application/json",
                                                   "authorization": "Bearer sk-client", "x-api-key": "sk-client"})
                out.append((fmt, stream, reply.status_code, dict(reply.headers), reply.content))
    return out


# ---- a compressed error body quoting the configured key ---------------------------------------------------------


@MODES
@pytest.mark.parametrize("coding", list(ENCODERS))
async def test_a_compressed_error_body_quoting_the_configured_key_is_redacted(
        coding: str, supervised: bool, start_proxy, monkeypatch: pytest.MonkeyPatch) -> None:
    """The upstream compresses its 401 whatever the request's ``accept-encoding`` says (the supervised path asks
    for identity). The client gets the body decoded, the key replaced, without ``content-encoding``."""
    monkeypatch.setenv("PV_KEY", KEY)
    async with serve_handler(QuotingUpstream(coding)) as url, \
            start_proxy(supervised=supervised, upstream_url=url, upstream={"api_key_env": "PV_KEY"}) as rp:
        answers = await post_all(rp.url)
    for fmt, stream, status, headers, body in answers:
        assert status == 401, (fmt, stream)
        assert "content-encoding" not in headers
        assert KEY.encode() not in body and b"[redacted]" in body
        assert orjson.loads(body)["error"]["code"] == "invalid_api_key"  # the upstream's own error, decoded


@MODES
async def test_an_error_body_that_cannot_be_checked_is_refused_in_the_clients_format(
        supervised: bool, start_proxy, monkeypatch: pytest.MonkeyPatch) -> None:
    """A coding proxyvisor cannot undo, data invalid for its coding, and a zip bomb (1 GiB of zeros) are answered
    with proxyvisor's own error in the client's format, naming the upstream's status, and never the key."""
    monkeypatch.setenv("PV_KEY", KEY)
    cases = [(QuotingUpstream("zstd"), "unknown content coding 'zstd'"),
             (QuotingUpstream("gzip", body=b"not gzip " + KEY.encode()), "invalid gzip data"),
             (QuotingUpstream("gzip", status=429, body=gzip_bomb(1 << 30)), f"more than {MAX_DECODED_ERROR} bytes")]
    for upstream, reason in cases:
        async with serve_handler(upstream) as url, \
                start_proxy(supervised=supervised, upstream_url=url, upstream={"api_key_env": "PV_KEY"},
                            breakers=False) as rp:
            for fmt, stream, status, headers, body in await post_all(rp.url):
                assert status == upstream.status, (fmt, stream, body[:200])
                message = assert_error_shape(fmt, status, body)["message"]
                assert f"answered {upstream.status}" in message and reason in message and "not relayed" in message
                assert KEY.encode() not in body and "content-encoding" not in headers


@MODES
async def test_a_compressed_error_body_without_the_key_and_a_streamed_error_body_are_handled(
        supervised: bool, start_proxy, monkeypatch: pytest.MonkeyPatch) -> None:
    """A compressed error body that does not hold the key is relayed as sent, compressed; an error body sent as
    an event stream is read whole and redacted like any other."""
    monkeypatch.setenv("PV_KEY", KEY)
    plain = b'{"error":{"message":"rate limited","type":"rate_limit_error","param":null,"code":null}}'
    async with serve_handler(QuotingUpstream("gzip", status=429, body=gzip.compress(plain))) as url, \
            start_proxy(supervised=supervised, upstream_url=url, upstream={"api_key_env": "PV_KEY"},
                        breakers=False) as rp:
        for _fmt, _stream, status, headers, body in await post_all(rp.url):
            assert (status, headers["content-encoding"], body) == (429, "gzip", plain)
    async with serve_handler(QuotingUpstream(None, ctype=b"text/event-stream")) as url, \
            start_proxy(supervised=supervised, upstream_url=url, upstream={"api_key_env": "PV_KEY"},
                        breakers=False) as rp:
        for _fmt, _stream, status, _headers, body in await post_all(rp.url):
            assert status == 401 and body.startswith(b"event: error\ndata: ")
            assert KEY.encode() not in body and b"[redacted]" in body


def test_decoding_a_zip_bomb_stops_at_the_bound_without_inflating_it() -> None:
    bomb = gzip_bomb(1 << 30)
    limit = 4 << 20
    tracemalloc.start()
    try:
        with pytest.raises(UndecodableBody, match="more than"):
            decode(bomb, "gzip", limit)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 3 * limit
    assert decode(gzip.compress(b"x" * limit), "gzip", limit) == b"x" * limit  # exactly the bound is fine


# ---- idle upstream connections -------------------------------------------------------------------------------


@MODES
async def test_idle_upstream_connections_are_closed_on_time_without_another_request(supervised: bool,
                                                                                   start_proxy) -> None:
    upstream = KeepAliveUpstream(delay_s=0.1)
    keepalive_s = 0.3
    async with trio.open_nursery() as nursery:
        url = await serve(nursery, upstream)
        async with start_proxy(supervised=supervised, upstream_url=url,
                               upstream={"keepalive_timeout_s": keepalive_s}) as rp:
            async with http_client() as client:
                async def one(fmt: str) -> None:
                    reply = await client.post(rp.url + path_of(fmt), content=orjson.dumps(request_body(fmt)),
                                              headers={"content-type": "application/json"})
                    assert reply.status_code == 200

                async with trio.open_nursery() as burst:
                    for n in range(12):
                        burst.start_soon(one, FORMATS[n % 3])
            assert upstream.opened >= 6 and upstream.open == upstream.opened  # all kept alive after the burst
            burst_done = trio.current_time()
            with trio.fail_after(keepalive_s + 2):
                await upstream.all_closed.wait()
            assert trio.current_time() - burst_done >= keepalive_s - 0.05  # kept for reuse meanwhile
            assert upstream.requests == 12  # no request was needed to close them
        nursery.cancel_scope.cancel()


# ---- kept-alive connections the upstream dropped -----------------------------------------------------------------


@MODES
async def test_a_kept_alive_connection_the_upstream_dropped_is_retried_once_on_a_fresh_one(
        supervised: bool, start_proxy) -> None:
    """Sequential requests, each but the first on the connection the one before left, which the upstream drops
    as the request arrives: every one is answered, each sent once more on a fresh connection."""
    upstream = KeepAliveUpstream(answers=1)
    n = 200
    async with trio.open_nursery() as nursery:
        url = await serve(nursery, upstream)
        async with start_proxy(supervised=supervised, upstream_url=url) as rp, http_client() as client:
            statuses = []
            for i in range(n):
                fmt = FORMATS[i % 3]
                reply = await client.post(rp.url + path_of(fmt), content=orjson.dumps(request_body(fmt)),
                                          headers={"content-type": "application/json"})
                statuses.append(reply.status_code)
        nursery.cancel_scope.cancel()
    assert statuses.count(200) == n, [s for s in statuses if s != 200][:5]
    assert (upstream.answered, upstream.requests, upstream.opened) == (n, 2 * n - 1, n)


async def test_a_request_crossing_an_idle_close_of_the_upstream_is_retried_on_a_fresh_connection(
        start_proxy) -> None:
    """An upstream that closes a connection idle for 5 ms, the close arriving 5 ms late (a load balancer's idle
    timeout, as ``bench/upstream_drops.py`` measures it): requests sent 0 to 20 ms apart are all answered, though
    the upstream dropped connections under them."""
    upstream = KeepAliveUpstream(idle_s=0.005, close_latency_s=0.005)
    async with trio.open_nursery() as nursery:
        url = await serve(nursery, upstream)
        async with start_proxy(supervised=False, upstream_url=url) as rp, http_client() as client:
            statuses = []
            for i in range(40):
                await trio.sleep(0.02 * (i % 5) / 4)
                reply = await client.post(rp.url + path_of("chat"), content=orjson.dumps(request_body("chat")),
                                          headers={"content-type": "application/json"})
                statuses.append(reply.status_code)
        nursery.cancel_scope.cancel()
    assert statuses == [200] * 40
    assert upstream.answered == 40 and upstream.opened > 5, "the upstream dropped idle connections"


@MODES
async def test_a_fresh_connections_failure_and_a_half_sent_response_are_never_retried(
        supervised: bool, start_proxy) -> None:
    async with trio.open_nursery() as nursery:
        hangs_up = KeepAliveUpstream(answers=0)
        hangs_up_url = await serve(nursery, hangs_up)
        half = KeepAliveUpstream(answers=1, half_head=True)
        half_url = await serve(nursery, half)
        async with start_proxy(supervised=supervised, upstream_url=hangs_up_url, breakers=False) as rp, \
                http_client() as client:
            reply = await client.post(rp.url + path_of("chat"), content=orjson.dumps(request_body("chat")),
                                      headers={"content-type": "application/json"})
            # A fresh connection closed without an answer: a real error, never resent.
            assert reply.status_code == 502 and (hangs_up.requests, hangs_up.opened) == (1, 1)
        async with start_proxy(supervised=supervised, upstream_url=half_url, breakers=False) as rp, \
                http_client() as client:
            statuses = []
            for _ in range(2):
                reply = await client.post(rp.url + path_of("chat"), content=orjson.dumps(request_body("chat")),
                                          headers={"content-type": "application/json"})
                statuses.append(reply.status_code)
            # The second request, on the reused connection, got a response byte: a real error, never resent.
            assert statuses == [200, 502] and (half.requests, half.answered, half.opened) == (2, 1, 1)
        nursery.cancel_scope.cancel()
