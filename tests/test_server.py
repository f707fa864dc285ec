"""The h11 server (proxyvisor.proxy.server): a hang-up cancels the handler even before any reply byte, and a
connection serves requests one after another, pipelined ones included."""

from __future__ import annotations

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
