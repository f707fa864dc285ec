"""The h11 server (proxyvisor.proxy.server): a hang-up cancels the handler even before any reply byte, and a
connection serves requests one after another, pipelined ones included."""

from __future__ import annotations

import random

import h11
import trio

from proxyvisor.proxy.server import Request, Response

from helpers import serve_handler


async def connect(url: str) -> trio.SocketStream:
    return await trio.open_tcp_stream("127.0.0.1", int(url.rsplit(":", 1)[1]))


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
    """The next response on ``stream`` as (status, body), read with ``client``'s h11 state."""
    status, body = 0, b""
    while True:
        event = client.next_event()
        if event is h11.NEED_DATA:
            client.receive_data(await stream.receive_some(65536))
        elif isinstance(event, h11.Response):
            status = event.status_code
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
