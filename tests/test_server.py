"""The h11 server (proxyvisor.proxy.server): a hang-up cancels the handler even before any reply byte, and a
connection serves requests one after another, pipelined ones included."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator

import h11
import pytest
import trio

from proxyvisor.proxy.server import Limits, Request, Response, Stopping, bound_port, open_listeners, serve_listeners

from helpers import serve_handler


async def connect(url: str) -> trio.SocketStream:
    return await trio.open_tcp_stream("127.0.0.1", int(url.rsplit(":", 1)[1]))


async def read_to_end(stream: trio.SocketStream) -> bytes:
    data = b""
    with trio.fail_after(10):
        while chunk := await stream.receive_some(65536):
            data += chunk
    return data


async def test_a_drain_refuses_connections_closes_idle_ones_and_ends_the_one_in_flight_after_its_answer() -> None:
    started, release = trio.Event(), trio.Event()

    async def handler(request: Request) -> Response:
        if request.path == "/slow":
            started.set()
            await release.wait()
        return Response(200, [], b"ok")

    stopping = Stopping()
    listeners = await open_listeners("127.0.0.1", 0)
    port = bound_port(listeners)
    # serve_listeners returns by itself once its connections are done: the nursery closes without a cancel.
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            await nursery.start(serve_listeners, listeners, handler, Limits(), stopping)
            idle = await trio.open_tcp_stream("127.0.0.1", port)
            await idle.send_all(b"GET /fast HTTP/1.1\r\nhost: x\r\n\r\n")
            answer = b""
            while not answer.endswith(b"ok"):
                answer += await idle.receive_some(65536)
            busy = await trio.open_tcp_stream("127.0.0.1", port)
            await busy.send_all(b"GET /slow HTTP/1.1\r\nhost: x\r\n\r\n")
            with trio.fail_after(10):
                await started.wait()

            stopping.begin()
            assert await read_to_end(idle) == b""  # the idle keep-alive connection is closed, with no answer
            with trio.fail_after(5):  # the serving task closes its listeners at its next turn
                while True:
                    try:
                        await (await trio.open_tcp_stream("127.0.0.1", port)).aclose()
                    except OSError:
                        break
                    await trio.sleep(0.01)
            release.set()
            answer = await read_to_end(busy)
            assert answer.startswith(b"HTTP/1.1 200 ") and answer.endswith(b"ok")
            assert b"\r\nconnection: close\r\n" in answer.lower()
            with trio.fail_after(10):
                await stopping.quiet()


# Every status proxyvisor answers with itself or relays from a model API: its refusals, a failed upstream, a
# translated error (test_formats.py's list), and Anthropic's 529.
_STATUSES = (200, 400, 401, 403, 404, 405, 408, 409, 413, 415, 426, 429, 500, 501, 502, 503, 504, 529)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_every_status_goes_out_with_its_reason_phrase(stream: bool) -> None:
    async def handler(request: Request) -> Response:
        async def body() -> AsyncIterator[bytes]:
            yield b"x"

        return Response(int(request.path.strip("/")), [], body() if stream else b"x")

    phrases = {}
    async with serve_handler(handler) as url:
        for status in _STATUSES:
            conn = await connect(url)
            await conn.send_all(b"GET /%d HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n" % status)
            line = (await read_to_end(conn)).split(b"\r\n", 1)[0]
            assert line.startswith(b"HTTP/1.1 %d " % status), line
            phrases[status] = line.split(b" ", 2)[2]
    assert phrases[529] == b"Overloaded" and phrases[408] == b"Request Timeout"
    assert all(phrases.values()), phrases


async def status_line(url: str, target: bytes = b"/") -> bytes:
    """The status line of the answer to a GET of ``target`` on a connection of its own."""
    conn = await connect(url)
    await conn.send_all(b"GET %s HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n" % target)
    return (await read_to_end(conn)).split(b"\r\n", 1)[0]


async def test_a_status_nothing_names_goes_out_with_its_class_as_its_phrase() -> None:
    async def handler(request: Request) -> Response:
        return Response(int(request.path.strip("/")), [], b"x")

    async with serve_handler(handler) as url:
        lines = [await status_line(url, b"/%d" % status) for status in (299, 399, 420, 499, 520, 599, 999)]
    assert lines == [b"HTTP/1.1 299 Success", b"HTTP/1.1 399 Redirection", b"HTTP/1.1 420 Client Error",
                     b"HTTP/1.1 499 Client Error", b"HTTP/1.1 520 Server Error", b"HTTP/1.1 599 Server Error",
                     b"HTTP/1.1 999 Unknown"]


@pytest.mark.parametrize("supervised", [False, True], ids=["relay", "supervised"])
async def test_a_relayed_status_nothing_names_keeps_the_upstreams_phrase(supervised: bool, start_proxy) -> None:
    """An upstream's own phrase goes out with a status the standard does not name (one it names keeps the
    standard's), whole or streamed, on a model path or another."""
    statuses = {b"/v1/chat/completions": (520, b"Web Server Returned an Unknown Error"),
                b"/v1/models": (299, b"Fine But Odd"), b"/v1/other": (404, b"Gone Fishing")}

    async def upstream(request: Request) -> Response:
        if b'"stream"' in request.body:
            return Response(299, [(b"content-type", b"text/event-stream")], b"data: [DONE]\n\n", b"Streaming Oddly")
        status, phrase = statuses[request.path.encode()]
        return Response(status, [(b"content-type", b"application/json")], b"{}", phrase)

    async def post(url: str, body: bytes) -> bytes:
        conn = await connect(url)
        await conn.send_all(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                            b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(body), body))
        return (await read_to_end(conn)).split(b"\r\n", 1)[0]

    async with serve_handler(upstream) as url, start_proxy(supervised=supervised, upstream_url=url, breakers=False) as rp:
        lines = [await post(rp.url, b"{}"), await post(rp.url, b'{"stream": true}')]
        lines += [await status_line(rp.url, target) for target in (b"/v1/models", b"/v1/other")]
    assert lines == [b"HTTP/1.1 520 Web Server Returned an Unknown Error", b"HTTP/1.1 299 Streaming Oddly",
                     b"HTTP/1.1 299 Fine But Odd", b"HTTP/1.1 404 Not Found"]


async def test_a_client_hanging_up_cancels_a_handler_that_has_not_answered_yet() -> None:
    started, cancelled = trio.Event(), trio.Event()

    async def waits_for_ever(request: Request) -> Response:
        started.set()
        try:
            await trio.sleep_forever()
        except trio.Cancelled:
            cancelled.set()
            raise
        raise AssertionError("unreachable")

    async with serve_handler(waits_for_ever) as url:
        stream = await connect(url)
        await stream.send_all(b"POST /v1/messages HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\n{}")
        with trio.fail_after(10):
            await started.wait()
        await stream.aclose()
        with trio.fail_after(10):
            await cancelled.wait()


async def test_requests_on_one_connection_are_answered_in_order_pipelined_or_not() -> None:
    async def echo(request: Request) -> Response:
        return Response(200, [(b"content-type", b"text/plain")], request.target.encode() + b" " + request.body)

    def post(target: bytes, body: bytes) -> bytes:
        return b"POST %s HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n%s" % (target, len(body), body)

    async with serve_handler(echo) as url:
        stream = await connect(url)
        client = h11.Connection(h11.CLIENT)
        client.send(h11.Request(method="POST", target="/", headers=[("host", "x"), ("content-length", "0")]))
        client.send(h11.EndOfMessage())
        answers: list[bytes] = []

        async def read_answer() -> None:
            body = b""
            while True:
                event = client.next_event()
                if event is h11.NEED_DATA:
                    client.receive_data(await stream.receive_some(65536))
                elif isinstance(event, h11.Data):
                    body += event.data
                elif isinstance(event, h11.EndOfMessage):
                    answers.append(body)
                    client.start_next_cycle()
                    client.send(h11.Request(method="POST", target="/", headers=[("host", "x"),
                                                                               ("content-length", "0")]))
                    client.send(h11.EndOfMessage())
                    return

        with trio.fail_after(10):
            await stream.send_all(post(b"/one", b"1"))
            await read_answer()
            await stream.send_all(post(b"/two", b"2") + post(b"/three", b"3"))
            await read_answer()
            await read_answer()
        await stream.aclose()
    assert answers == [b"/one 1", b"/two 2", b"/three 3"]


async def read_response(stream: trio.SocketStream, client: h11.Connection) -> tuple[int, bytes]:
    """The next response on ``stream`` as (status, body), read with ``client``'s h11 state, past any 1xx."""
    status, body = 0, b""
    while True:
        event = client.next_event()
        if event is h11.NEED_DATA:
            client.receive_data(await stream.receive_some(65536))
        elif isinstance(event, h11.Response):
            status = event.status_code
        elif isinstance(event, h11.InformationalResponse):
            pass
        elif isinstance(event, h11.Data):
            body += event.data
        elif isinstance(event, h11.EndOfMessage):
            return status, body
        else:
            raise AssertionError(f"unexpected {event!r}")


async def test_a_body_that_arrives_over_several_reads_is_whole_and_the_next_request_is_answered() -> None:
    """The server takes a body's later reads past h11 (server.Connection._read_body): sizes from one byte past
    the head to several reads of the largest size, with the next request's head in the body's last write
    (pipelined) or sent after the answer, and a head, body and next request in one write."""
    seen: list[bytes] = []

    async def echo(request: Request) -> Response:
        seen.append(request.body)
        return Response(200, [(b"content-type", b"application/octet-stream")], request.body)

    rng = random.Random(5)
    bodies = [rng.randbytes(n) for n in (1, 70_000, 900_000)]
    async with serve_handler(echo) as url:
        stream = await connect(url)
        client = h11.Connection(h11.CLIENT)
        with trio.fail_after(20):
            for i, body in enumerate(bodies):
                pipelined = i % 2 == 1
                head = b"POST /%d HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n" % (i, len(body))
                await stream.send_all(head)
                for start in range(0, len(body) - 1, 300_000):  # pieces, then the last byte alone
                    await trio.sleep(0.02)
                    await stream.send_all(body[start:min(start + 300_000, len(body) - 1)])
                await trio.sleep(0.02)
                await stream.send_all(body[-1:] + (b"GET /next HTTP/1.1\r\nhost: x\r\n\r\n" if pipelined else b""))
                for expected in [body] + ([b""] if pipelined else []):
                    client.send(h11.Request(method="POST", target="/", headers=[("host", "x"),
                                                                               ("content-length", "0")]))
                    client.send(h11.EndOfMessage())
                    assert await read_response(stream, client) == (200, expected)
                    client.start_next_cycle()
            # All in one write: the head, a body past what h11 is given at once, and the next request.
            body = rng.randbytes(100_000)
            await stream.send_all(b"POST /all HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n%s"
                                  b"GET /next HTTP/1.1\r\nhost: x\r\n\r\n" % (len(body), body))
            for expected in (body, b""):
                client.send(h11.Request(method="GET", target="/", headers=[("host", "x")]))
                client.send(h11.EndOfMessage())
                assert await read_response(stream, client) == (200, expected)
                client.start_next_cycle()
        await stream.aclose()
    assert [len(b) for b in seen] == [1, 70_000, 0, 900_000, 100_000, 0]


async def test_a_client_that_stops_mid_body_gets_a_400() -> None:
    async def unreachable(request: Request) -> Response:
        raise AssertionError("a cut-short body reached the handler")

    async with serve_handler(unreachable) as url:
        stream = await connect(url)
        with trio.fail_after(10):
            await stream.send_all(b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 100000\r\n\r\n" + b"x" * 70_000)
            await trio.sleep(0.05)
            await stream.send_all(b"x" * 20_000)
            await stream.send_eof()
            client = h11.Connection(h11.CLIENT)
            client.send(h11.Request(method="POST", target="/", headers=[("host", "x"), ("content-length", "0")]))
            client.send(h11.EndOfMessage())
            status, body = await read_response(stream, client)
        assert status == 400 and b"malformed HTTP request" in body
        await stream.aclose()


def _post(target: bytes, length: int, *extra: bytes, version: bytes = b"1.1") -> bytes:
    return b"POST %s HTTP/%s\r\nhost: x\r\n%scontent-length: %d\r\n\r\n" % (target, version, b"".join(extra), length)


_NEXT = b"GET /next HTTP/1.1\r\nhost: x\r\n\r\n"
_MALFORMED = (b'{"error":{"message":"malformed HTTP request","type":"invalid_request_error","param":null,'
              b'"code":null}}')
"""OpenAI's error body, every field of it, as for the errors the formats write."""
_CHUNKED = b"POST /c HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n"
_BIG = b"abcdefghij" * 30_000
"""Over a read's feed to h11 (64 KB) and a read (256 KB)."""


@pytest.mark.parametrize(("writes", "answers", "closed"), [
    ([_post(b"/a", 5), b"hel", b"lo" + _NEXT], [b"/a hello", b"/next "], False),
    ([_post(b"/a", 5), b"hel", b"loNOT A REQUEST\r\n\r\n"], [b"/a hello", _MALFORMED], True),
    ([_post(b"/a", 5), b"hel", b"lo" + _post(b"/b", 3), b"ab", b"c" + _NEXT], [b"/a hello", b"/b abc", b"/next "],
     False),
    ([_post(b"/a", 5, b"expect: 100-continue\r\n"), b"he", b"llo" + _NEXT], [b"/a hello", b"/next "], False),
    ([_post(b"/a", 5, version=b"1.0"), b"he", b"llo"], [b"/a hello"], True),
    ([_post(b"/a", 5, b"connection: close\r\n"), b"he", b"llo"], [b"/a hello"], True),
    ([_post(b"/a", 0) + _NEXT], [b"/a ", b"/next "], False),
    ([_CHUNKED, b"3\r\nhel\r\n", b"2\r\nlo\r\n0\r\n\r\n" + _NEXT], [b"/c hello", b"/next "], False),
    ([_CHUNKED + b"".join(b"3e8\r\n%s\r\n" % _BIG[i:i + 1000] for i in range(0, len(_BIG), 1000)) + b"0\r\n\r\n"
      + _NEXT], [b"/c " + _BIG, b"/next "], False),
    ([_post(b"/a", 7) + b"a" * 7 + _post(b"/big", len(_BIG)) + _BIG + _NEXT], [b"/a aaaaaaa", b"/big " + _BIG,
                                                                             b"/next "], False),
    ([_post(b"/big", len(_BIG), b"expect: 100-continue\r\n"), _BIG + _NEXT], [b"/big " + _BIG, b"/next "], False),
    ([b"".join(_post(b"/%d" % i, 3) + b"abc" for i in range(4000))], [b"/%d abc" % i for i in range(4000)], False),
], ids=["past-the-declared-length", "garbage-after-it", "two-bodies-past-h11", "100-continue", "http-1.0",
        "connection-close", "content-length-0", "chunked", "chunked-one-write", "one-write-over-a-feed",
        "100-continue-large", "4000-pipelined"])
async def test_a_body_read_past_h11_leaves_the_connection_where_h11_would(
        writes: list[bytes], answers: list[bytes], closed: bool) -> None:
    """What comes after a body (framed by content-length or chunked, read past h11 or through it) is the next
    request, answered in turn, or a 400; the connection closes when HTTP says so. The client half-closes after its
    last write: it still gets every answer."""

    async def echo(request: Request) -> Response:
        return Response(200, [], request.target.encode() + b" " + request.body)

    async with serve_handler(echo) as url:
        stream = await connect(url)
        client = h11.Connection(h11.CLIENT)
        got: list[bytes] = []
        with trio.fail_after(20):
            for data in writes:
                await stream.send_all(data)
                await trio.sleep(0.02)  # each write its own read
            await stream.send_eof()
            for _ in answers:
                client.send(h11.Request(method="GET", target="/", headers=[("host", "x")]))
                client.send(h11.EndOfMessage())
                got.append((await read_response(stream, client))[1])
                if client.our_state is h11.MUST_CLOSE:
                    break
                client.start_next_cycle()
            assert await stream.receive_some(1) == b"" if closed else client.our_state is h11.IDLE
        await stream.aclose()
    assert got == answers
