"""The server side of a connection: `Expect: 100-continue`, the total deadlines of a request body and of a stream,
a client that half-closes after its request, and who may read which session.

What each test pins is listed in ``docs/reliability.md``.
"""

from __future__ import annotations

import socket

import h11
import orjson
import pytest
import trio

from proxyvisor.proxy.formats import BY_NAME, AssistantTurn
from proxyvisor.proxy.server import Request, Response

from helpers import (FORMATS, MODEL, assert_ends_with_error_event, assert_error_shape, http_client, path_of,
                     request_body, serve_handler)

MODES = pytest.mark.parametrize("supervised", [True, False], ids=["supervised", "disabled"])
ALL_FORMATS = pytest.mark.parametrize("fmt", FORMATS)


async def connect(port: int) -> trio.SocketStream:
    return await trio.open_tcp_stream("127.0.0.1", port)


def head(fmt: str, size: int, *extra: tuple[str, str], target: str | None = None) -> bytes:
    return h11.Connection(h11.CLIENT).send(h11.Request(
        method="POST", target=target or path_of(fmt),
        headers=[("host", "proxy"), ("content-type", "application/json"), ("content-length", str(size)), *extra]))


async def responses_until_eof(stream: trio.SocketStream, timeout: float = 10) -> list[object]:
    """Every h11 event of the server's answers, read until the server closes (or ``timeout`` s pass)."""
    conn = h11.Connection(h11.CLIENT)
    conn.send(h11.Request(method="POST", target="/", headers=[("host", "x"), ("transfer-encoding", "chunked")]))
    conn.send(h11.EndOfMessage())  # h11 reads a response only after a request of its own
    events: list[object] = []
    with trio.fail_after(timeout):
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                conn.receive_data(await stream.receive_some(65536))
                continue
            events.append(event)
            if isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)):
                return events


def final(events: list[object]) -> tuple[int, bytes]:
    """(status, body) of the final response among ``events``."""
    (response,) = [e for e in events if isinstance(e, h11.Response)]
    return response.status_code, b"".join(bytes(e.data) for e in events if isinstance(e, h11.Data))


# ---- Expect: 100-continue --------------------------------------------------------------------------------------

@MODES
async def test_expect_100_continue_is_answered_before_the_body_is_read(supervised: bool, start_proxy) -> None:
    """A client that holds its body back until told to go on (curl does for bodies over 1 MiB) is told at once;
    one whose declared size is over the limit gets its 413 instead, without sending the body."""
    body = orjson.dumps(request_body("chat"))
    async with start_proxy(supervised=supervised, proxy={"max_body_bytes": 4096}) as rp:
        stream = await connect(rp.port)
        await stream.send_all(head("chat", len(body), ("expect", "100-continue")))
        with trio.fail_after(0.5):  # curl gives up waiting after 1 s
            interim = await stream.receive_some(65536)
        assert interim.startswith(b"HTTP/1.1 100 ")
        await stream.send_all(body)
        status, answer = final(await responses_until_eof(stream))
        assert status == 200 and orjson.loads(answer)["choices"]

        stream = await connect(rp.port)
        await stream.send_all(head("chat", 5000, ("expect", "100-continue")))
        events = await responses_until_eof(stream)
        assert not any(isinstance(e, h11.InformationalResponse) for e in events)
        status, answer = final(events)
        assert status == 413
        assert_error_shape("chat", 413, answer)
        assert len(rp.scripted["scripted"].requests) == 1  # the first request only


# ---- deadlines ---------------------------------------------------------------------------------------------------

@MODES
async def test_a_body_that_trickles_past_the_deadline_gets_408_in_the_clients_format(supervised: bool,
                                                                                      start_proxy) -> None:
    """A byte every 50 ms never trips the pause limit between reads (2 s here); the total deadline (0.4 s) cuts
    it with a 408 the SDKs read, the connection is closed, and nothing reaches the upstream."""
    body = orjson.dumps(request_body("messages"))
    async with start_proxy(supervised=supervised, proxy={"request_body_timeout_s": 2.0,
                                                         "request_body_deadline_s": 0.4}) as rp:
        stream = await connect(rp.port)
        await stream.send_all(head("messages", len(body)))
        started = trio.current_time()

        async def trickle() -> None:
            for byte in body:
                await stream.send_all(bytes([byte]))
                await trio.sleep(0.05)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(trickle)
            events = await responses_until_eof(stream)
            nursery.cancel_scope.cancel()
        status, answer = final(events)
        # The trickle itself lasts len(body) * 50 ms (tens of seconds): the upper bound only tells the deadline
        # from the end of the body, with room for a loaded machine.
        assert status == 408 and 0.4 <= trio.current_time() - started < len(body) * 0.05 / 2
        assert "request_body_deadline_s" in assert_error_shape("messages", 408, answer)["message"]
        assert dict(next(e for e in events if isinstance(e, h11.Response)).headers)[b"connection"] == b"close"
        assert rp.scripted["scripted"].requests == []


@MODES
async def test_the_time_a_client_takes_to_send_its_body_is_not_proxy_overhead(supervised: bool, start_proxy) -> None:
    """A body sent in two writes 0.6 s apart: the answer's overhead header (the ledger's figure too) counts from the
    body's last byte, so the client's pause, time proxyvisor did not add, is not in it."""
    body = orjson.dumps(request_body("chat"))
    async with start_proxy(supervised=supervised) as rp:
        stream = await connect(rp.port)
        await stream.send_all(head("chat", len(body), ("connection", "close")) + body[:10])
        await trio.sleep(0.6)
        await stream.send_all(body[10:])
        events = await responses_until_eof(stream)
        status, _ = final(events)
        headers = dict(next(e for e in events if isinstance(e, h11.Response)).headers)
        assert status == 200 and float(headers[b"x-proxyvisor-overhead-ms"]) < 300


def keep_alive_only(fmt: str):
    """An upstream that sends the first event of a ``fmt`` stream, then only `: ping` comments, forever."""
    first = BY_NAME[fmt].render_stream(AssistantTurn("hello"), MODEL, request_body(fmt, stream=True))[0]

    async def handler(request: Request) -> Response:
        async def play():
            yield first
            while True:
                await trio.sleep(0.02)
                yield b": ping\n\n"

        return Response(200, [(b"content-type", b"text/event-stream")], play())

    return handler


@ALL_FORMATS
@MODES
async def test_a_stream_of_keep_alives_ends_at_max_stream_s_with_the_formats_error_event(
        fmt: str, supervised: bool, start_proxy) -> None:
    async with serve_handler(keep_alive_only(fmt)) as url, \
            start_proxy(supervised=supervised, upstream_url=url, proxy={"max_stream_s": 0.3}) as rp:
        stream = await connect(rp.port)
        body = orjson.dumps(request_body(fmt, stream=True))
        await stream.send_all(head(fmt, len(body), target="/s/pinged" + path_of(fmt)) + body)
        started = trio.current_time()
        status, data = final(await responses_until_eof(stream, timeout=5))
        assert status == 200 and 0.3 <= trio.current_time() - started < 3
        assert_ends_with_error_event(fmt, data)
        assert b"max_stream_s" in data
        if supervised:
            (record,) = rp.pipeline.store.read_ledger("pinged")
            assert record["status"] == 504 and "max_stream_s" in record["error"]


# ---- half-close ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@MODES
async def test_a_request_followed_by_a_half_close_is_answered(supervised: bool, stream: bool, start_proxy) -> None:
    """`shutdown(SHUT_WR)` after the request says "no more requests", not "I left": the answer comes whole and
    the ledger says 200 (a client that closes its socket is still taken to have left: test_reliability_faults)."""
    body = orjson.dumps(request_body("chat", stream=stream))
    async with start_proxy([{"text": "the answer"}], supervised=supervised,
                           upstream={"first_byte_timeout_s": 5}) as rp:
        client = await connect(rp.port)
        await client.send_all(head("chat", len(body), target="/s/halfclosed/v1/chat/completions") + body)
        client.socket.shutdown(socket.SHUT_WR)
        status, answer = final(await responses_until_eof(client))
        assert status == 200
        if stream:
            assert answer.endswith(b"data: [DONE]\n\n")
        else:
            assert orjson.loads(answer)["choices"][0]["message"]["content"].startswith("the answer")
        if supervised:
            (record,) = rp.pipeline.store.read_ledger("halfclosed")
            assert record["status"] == 200 and "error" not in record


# ---- who reads which session ------------------------------------------------------------------------------------

async def test_the_session_listing_needs_the_admin_token_and_a_session_is_read_with_its_id(start_proxy) -> None:
    """The listing names every session: only the admin gets it (403 without the token, and to everyone when none
    is configured). A session's own endpoints answer whoever holds its id."""
    for admin, secret in (("", "a" + "3f9c" * 8), ("adm-7f3e", "b" + "81d2" * 8)):
        async with start_proxy([{"text": "one"}], proxy={"admin_token": admin}) as rp, \
                http_client(rp.url) as client:
            assert (await client.post(f"/s/{secret}/v1/chat/completions", json=request_body("chat"))).status_code \
                == 200
            for headers in ({}, {"x-proxyvisor-admin": "wrong"}, {"x-proxyvisor-admin": ""}):
                reply = await client.get("/proxyvisor/sessions", headers=headers)
                assert reply.status_code == 403
                error = assert_error_shape("chat", 403, reply.content)
                assert "admin_token" in error["message"] and secret not in reply.text
            if admin:
                reply = await client.get("/proxyvisor/sessions", headers={"x-proxyvisor-admin": admin})
                assert reply.status_code == 200 and reply.json()["sessions"][0]["id"] == secret
            info = (await client.get(f"/proxyvisor/sessions/{secret}/info")).json()
            assert (info["session"], info["requests"]) == (secret, 1)
            assert (await client.get(f"/proxyvisor/sessions/{secret}/plan")).json()["session"] == secret
