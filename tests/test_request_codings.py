"""A request body in a content coding: read decoded where proxyvisor reads it (supervised), forwarded as it came
by the byte relay, and refused with a clear error in the API's own format when it cannot be decoded."""

from __future__ import annotations

import gzip
import zlib

import orjson
import pytest

from helpers import FORMATS, TOOL_STEP, path_of, raw_stream, request_body, serve_handler
from proxyvisor.proxy.server import Request, Response


@pytest.mark.parametrize("coding", ["gzip", "deflate"])
@pytest.mark.parametrize("fmt", FORMATS)
async def test_a_supervised_request_in_a_content_coding_is_read_decoded_and_goes_up_plain(
        fmt: str, coding: str, start_proxy, scripted_server) -> None:
    upstream = scripted_server.script
    body = request_body(fmt, False)
    plain = orjson.dumps(body)
    coded = gzip.compress(plain) if coding == "gzip" else zlib.compress(plain)
    async with start_proxy(supervised=True, upstream_url=scripted_server.url) as rp:
        upstream.queue(TOOL_STEP)
        reply, _ = await raw_stream(rp.url, fmt, coded, headers={"content-encoding": coding,
                                                                  "x-proxyvisor-session": "coded"})
    assert reply.status_code == 200
    target, sent_up, headers = upstream.requests[-1]
    assert target == path_of(fmt)
    assert orjson.loads(sent_up)[{"chat": "messages", "messages": "messages", "responses": "input"}[fmt]]
    assert "content-encoding" not in headers


async def test_the_byte_relay_forwards_a_coded_body_as_it_came(start_proxy) -> None:
    seen: list[Request] = []

    async def upstream(request: Request) -> Response:
        seen.append(request)
        return Response(200, [(b"content-type", b"application/json")], b"{}")

    coded = gzip.compress(orjson.dumps(request_body("chat", False)))
    async with serve_handler(upstream) as url, start_proxy(supervised=False, upstream_url=url) as rp:
        reply, _ = await raw_stream(rp.url, "chat", coded, headers={"content-encoding": "gzip"})
    assert reply.status_code == 200
    assert seen[0].body == coded and seen[0].header("content-encoding") == "gzip"


@pytest.mark.parametrize(("fmt", "error_type"), [("chat", "invalid_request_error"),
                                                 ("messages", "invalid_request_error"),
                                                 ("responses", "invalid_request_error")])
@pytest.mark.parametrize(("coding", "data", "why"), [
    ("gzip", b"{\"not\": \"gzip\"}", "gzip"),
    ("zstd", b"\x28\xb5\x2f\xfd anything", "unknown content coding 'zstd'"),
])
async def test_a_body_its_coding_cannot_read_is_refused_naming_the_coding(
        fmt: str, error_type: str, coding: str, data: bytes, why: str, start_proxy, scripted_server) -> None:
    async with start_proxy(supervised=True, upstream_url=scripted_server.url) as rp:
        reply, received = await raw_stream(rp.url, fmt, data, headers={"content-encoding": coding})
    assert reply.status_code == 415
    error = orjson.loads(received)["error"]
    assert error["type"] == error_type
    assert f"content-encoding {coding!r}" in error["message"] and why in error["message"]
    assert scripted_server.script.requests == []
