"""The upstream side of a flaky or hostile upstream: a compressed error body quoting the configured key.

What each test pins is listed in ``docs/reliability.md``.
"""

from __future__ import annotations

import gzip
import os
import tracemalloc
import zlib

import orjson
import pytest

from proxyvisor.proxy.codings import UndecodableBody, decode
from proxyvisor.proxy.relay import MAX_DECODED_ERROR
from proxyvisor.proxy.server import Request, Response

from helpers import FORMATS, assert_error_shape, http_client, path_of, request_body, serve_handler

MODES = pytest.mark.parametrize("supervised", [True, False], ids=["supervised", "disabled"])
KEY = "sk-canary-config-" + os.urandom(12).hex()
_JSON = [(b"content-type", b"application/json")]


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
                start_proxy(supervised=supervised, upstream_url=url, upstream={"api_key_env": "PV_KEY"}) as rp:
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
            start_proxy(supervised=supervised, upstream_url=url, upstream={"api_key_env": "PV_KEY"}) as rp:
        for _fmt, _stream, status, headers, body in await post_all(rp.url):
            assert (status, headers["content-encoding"], body) == (429, "gzip", plain)
    async with serve_handler(QuotingUpstream(None, ctype=b"text/event-stream")) as url, \
            start_proxy(supervised=supervised, upstream_url=url, upstream={"api_key_env": "PV_KEY"}) as rp:
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
