"""Bad input gets a clear 4xx in the client's format, and the server keeps serving afterwards."""

from __future__ import annotations

import orjson
import pytest
import trio

from helpers import FORMATS, assert_error_shape, http_client, path_of, raw_stream, request_body

MODES = pytest.mark.parametrize("supervised", [True, False], ids=["supervised", "disabled"])


async def assert_still_serving(url: str, fmt: str) -> None:
    reply, data = await raw_stream(url, fmt, request_body(fmt))
    assert reply.status_code == 200, data
    assert orjson.loads(data)


def bad_bodies(fmt: str) -> list[tuple[str, bytes, str, int]]:
    """(what, body, content type, expected status)"""
    good = orjson.dumps(request_body(fmt))
    return [
        ("malformed JSON", b'{"model": "m", "messages": [', "application/json", 400),
        ("invalid UTF-8", b'{"model": "\xff\xfe\xfd", "messages": []}', "application/json", 400),
        ("wrong content type", good, "text/plain", 415),
        ("form content type", b"model=m", "application/x-www-form-urlencoded", 415),
    ]


@MODES
@pytest.mark.parametrize("fmt", FORMATS)
async def test_bad_bodies_get_4xx_in_the_clients_format(fmt: str, supervised: bool, start_proxy) -> None:
    async with start_proxy(supervised=supervised) as rp, http_client(rp.url) as client:
        for what, body, ctype, status in bad_bodies(fmt):
            reply = await client.post(path_of(fmt), content=body, headers={"content-type": ctype})
            assert reply.status_code == status, what
            assert_error_shape(fmt, status, reply.content)
            await assert_still_serving(rp.url, fmt)


@pytest.mark.parametrize("fmt", FORMATS)
async def test_supervised_path_explains_what_is_wrong(fmt: str, proxy) -> None:
    async with http_client(proxy.url) as client:
        cases = [(b"[1, 2]", "must be a JSON object, got an array"), (b"null", "must be a JSON object, got null"),
                 (b"7", "must be a JSON object, got a number"), (b"{", "not valid JSON"),
                 (b"\xff", "not valid UTF-8 (byte 0: 0xff)"), (b'{"a": "\xc3\x28"}', "not valid UTF-8 (byte 7: 0xc3)")]
        for body, words in cases:
            reply = await client.post(path_of(fmt), content=body, headers={"content-type": "application/json"})
            assert reply.status_code == 400
            assert words in assert_error_shape(fmt, 400, reply.content)["message"]
        reply = await client.post(path_of(fmt), content=b"{}", headers={"content-type": "text/plain"})
        assert "application/json" in assert_error_shape(fmt, 415, reply.content)["message"]


async def test_the_scripted_token_count_refuses_a_body_that_is_not_a_request(proxy) -> None:
    async with http_client(proxy.url) as client:
        for body, words in [(b"null", "got null"), (b"{", "invalid JSON body"), (b"[1]", "got an array")]:
            reply = await client.post("/v1/messages/count_tokens", content=body,
                                      headers={"content-type": "application/json"})
            assert words in assert_error_shape("messages", 400, reply.content)["message"]
        reply = await client.post("/v1/messages/count_tokens", json={"model": "m", "messages": []})
        assert reply.status_code == 200 and reply.json() == {"input_tokens": 0}


@MODES
@pytest.mark.parametrize("fmt", FORMATS)
async def test_body_over_the_limit_gets_413(fmt: str, supervised: bool, start_proxy) -> None:
    async with start_proxy(supervised=supervised, proxy={"max_body_bytes": 2048}) as rp, \
            http_client(rp.url) as client:
        big = orjson.dumps(request_body(fmt, padding="x" * 100_000))

        async def chunked():  # no content-length: the limit applies while reading
            for i in range(0, len(big), 1000):
                yield big[i:i + 1000]

        for content in (big, chunked()):
            reply = await client.post(path_of(fmt), content=content, headers={"content-type": "application/json"})
            assert reply.status_code == 413
            assert "2048" in assert_error_shape(fmt, 413, reply.content)["message"]
        await assert_still_serving(rp.url, fmt)
        # A body just under the limit still passes.
        small = orjson.dumps(request_body(fmt))
        assert len(small) < 2048
        reply, _ = await raw_stream(rp.url, fmt, small)
        assert reply.status_code == 200


async def test_unknown_paths_and_methods(proxy) -> None:
    async with http_client(proxy.url) as client:
        cases = [("POST", "/v1/nope", "chat", 404), ("GET", "/v2/chat/completions", "chat", 404),
                 ("POST", "/v1/messages/nope", "messages", 404), ("GET", "/v1/chat/completions", "chat", 405),
                 ("GET", "/s/abc/v1/messages", "messages", 405), ("PUT", "/v1/responses", "responses", 405),
                 ("GET", "/v1/messages/count_tokens", "messages", 405), ("PUT", "/healthz", "chat", 405),
                 ("POST", "/proxyvisor/sessions", "chat", 405), ("DELETE", "/proxyvisor/ui", "chat", 405),
                 ("POST", "/v1/models", "chat", 405)]
        for method, path, fmt, status in cases:
            reply = await client.request(method, path)
            assert reply.status_code == status, path
            assert_error_shape(fmt, status, reply.content)
            if status == 405:  # the methods the path takes (RFC 9110)
                takes_get = not path.startswith(("/v1", "/s/")) or path == "/v1/models"
                assert reply.headers["allow"] == ("GET, HEAD" if takes_get else "POST"), path
    await assert_still_serving(proxy.url, "chat")


async def test_websocket_upgrade_on_a_model_path_gets_426(proxy) -> None:
    """Codex falls back from the Responses WebSocket to POST at once only on 426 (on a 405: 5 retries, about 6 s)."""
    handshake = {"connection": "Upgrade", "upgrade": "websocket", "sec-websocket-version": "13",
                 "sec-websocket-key": "dGhlIHNhbXBsZSBub25jZQ=="}
    async with http_client(proxy.url) as client:
        for path, fmt in (("/s/abc/v1/responses", "responses"), ("/v1/chat/completions", "chat")):
            reply = await client.get(path, headers=handshake)
            assert reply.status_code == 426, path
            assert "WebSocket upgrade refused" in assert_error_shape(fmt, 426, reply.content)["message"]
        assert (await client.get("/v1/responses")).status_code == 405  # a plain GET is still the wrong method
    await assert_still_serving(proxy.url, "responses")
    assert proxy.pipeline.sessions.get("abc") is None  # a refused upgrade is not a model request


@pytest.mark.parametrize("fmt", FORMATS)
async def test_bad_session_ids_are_refused(fmt: str, proxy) -> None:
    """Path and header ids that could leave the state directory or are not ids at all get 400."""
    bad_prefixes = ["/s/.hidden", "/s/a%2F..%2Fb", "/s/", "/s/" + "a" * 129, "/s/a b", "/s/%00x"]
    async with http_client(proxy.url) as client:
        for prefix in bad_prefixes:
            reply, data = await raw_stream(proxy.url + prefix, fmt, request_body(fmt))
            assert reply.status_code == 400, prefix
            assert "session id" in assert_error_shape(fmt, 400, data)["message"]
        for value in ("../../etc/passwd", ".x", "a/b", "a" * 129):
            reply = await client.post(path_of(fmt), json=request_body(fmt), headers={"x-proxyvisor-session": value})
            assert reply.status_code == 400, value
            assert_error_shape(fmt, 400, reply.content)
    await assert_still_serving(proxy.url, fmt)
    (only,) = proxy.pipeline.store.sessions()  # the good request's, named by the hash fallback
    assert only.startswith("h-")


async def raw_exchange(port: int, data: bytes) -> bytes:
    """Send raw bytes and read until the server closes (or 64 KiB)."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        await stream.send_all(data)
        received = b""
        with trio.fail_after(10):
            while chunk := await stream.receive_some(65536):
                received += chunk
    return received


async def test_a_request_framed_both_by_length_and_by_chunks_is_refused_and_its_connection_closed(proxy) -> None:
    """``Content-Length`` beside ``Transfer-Encoding: chunked`` (a request smuggling vector behind a front end that
    reads the other framing): 400 in the path's format, the connection closed, what followed never served."""
    smuggled = b"POST /v1/messages HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n\r\n{}"
    for path in (b"/v1/messages", b"/v1/chat/completions"):
        reply = await raw_exchange(proxy.port, b"POST " + path + b" HTTP/1.1\r\nhost: x\r\ncontent-length: 5\r\n"
                                   b"transfer-encoding: chunked\r\ncontent-type: application/json\r\n\r\n"
                                   b"2\r\n{}\r\n0\r\n\r\n" + smuggled)
        head, _, body = reply.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 400 Bad Request\r\n") and b"connection: close" in head.lower(), reply
        error = orjson.loads(body)
        assert ("both Content-Length and Transfer-Encoding" in (error["error"]["message"]),
                error.get("type") == "error") == (True, path == b"/v1/messages"), error
        assert reply.count(b"HTTP/1.1") == 1, "nothing after the refused request was served"
    await assert_still_serving(proxy.url, "messages")


async def test_malformed_http_gets_400_and_the_server_keeps_serving(proxy) -> None:
    for junk in (b"NOT HTTP AT ALL\r\n\r\n", b"POST /v1/messages HTTP/1.1\r\nno colon here\r\n\r\n",
                 b"POST /v1/messages HTTP/1.1\r\nhost: x\r\ncontent-length: nope\r\n\r\n",
                 b"POST /v1/messages HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n"):
        reply = await raw_exchange(proxy.port, junk)
        assert reply.startswith(b"HTTP/1.1 400 Bad Request\r\n"), (junk, reply)
        head, _, body = reply.partition(b"\r\n\r\n")
        assert b"connection: close" in head.lower()
        assert orjson.loads(body)["error"]["message"]
    # A raw path traversal target, which HTTP clients would normalise away.
    reply = await raw_exchange(proxy.port, b"POST /s/../v1/messages HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n"
                                           b"connection: close\r\n\r\n{}")
    assert reply.startswith(b"HTTP/1.1 400 Bad Request\r\n")
    for fmt in FORMATS:
        await assert_still_serving(proxy.url, fmt)


@pytest.mark.parametrize("fmt", FORMATS)
async def test_a_body_whose_framing_breaks_gets_400_in_the_apis_own_shape_saying_what_broke(proxy, fmt: str) -> None:
    """Bad chunked encoding, or a body cut short by the client's half-close: the server answers in the API of the
    request's path (known once the head was read), saying what broke, and closes the connection."""
    head = f"POST {path_of(fmt)} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n".encode()
    cases = {b"transfer-encoding: chunked\r\n\r\nzz\r\n{}\r\n": "chunk",
             b"content-length: 100\r\n\r\n{\"model\": ": "after 10 of the 100 bytes"}
    for junk, said in cases.items():
        async with await trio.open_tcp_stream("127.0.0.1", proxy.port) as stream:
            await stream.send_all(head + junk)
            await stream.send_eof()
            reply = b""
            with trio.fail_after(10):
                while chunk := await stream.receive_some(65536):
                    reply += chunk
        assert reply.startswith(b"HTTP/1.1 400 Bad Request\r\n"), (junk, reply)
        top, _, body = reply.partition(b"\r\n\r\n")
        assert b"connection: close" in top.lower()
        message = assert_error_shape(fmt, 400, body)["message"]
        assert message.startswith("malformed HTTP request: its body") and said in message, message
    await assert_still_serving(proxy.url, fmt)


async def test_a_client_that_sends_no_headers_is_dropped_and_others_are_served(start_proxy) -> None:
    async with start_proxy(proxy={"request_header_timeout_s": 0.2}) as rp:
        for opening in (b"", b"POST /v1/messages HTTP/1.1\r\nhost: x\r\n"):
            assert await raw_exchange(rp.port, opening) == b""  # closed by the server, without an answer
        await assert_still_serving(rp.url, "messages")


def test_status_lines_carry_the_standard_reason_phrase_or_their_class() -> None:
    from proxyvisor.proxy.server import reason

    assert (reason(200), reason(413), reason(429), reason(499)) == (b"OK", b"Request Entity Too Large",
                                                                    b"Too Many Requests", b"Client Error")
