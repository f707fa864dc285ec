"""The byte relay's own HTTP/1.1 client (proxyvisor.proxy.client): keep-alive reuse, stale connections, TLS,
and body pieces forwarded as they arrive."""

from __future__ import annotations

import random
import ssl

import pytest
import trio
import trustme

from proxyvisor.config import UpstreamConfig
from proxyvisor.proxy.client import Connection as UpstreamConnection
from proxyvisor.proxy.client import ConnectionPool
from proxyvisor.proxy.relay import HttpRelay, UpstreamError
from proxyvisor.proxy.server import Connection, Limits, Request, Response, bound_port, open_listeners

from helpers import serve_handler

JSON = [(b"content-type", b"application/json")]


def relay_for(url: str, **context: ssl.SSLContext) -> HttpRelay:
    return HttpRelay(UpstreamConfig(name="up", url=url, connect_timeout_s=5, first_byte_timeout_s=5,
                                    idle_timeout_s=5), **context)


async def test_sequential_requests_share_one_connection_and_headers_go_up_as_given() -> None:
    seen: list[Request] = []

    async def handler(request: Request) -> Response:
        seen.append(request)
        return Response(200, JSON, b'{"n":%d}' % len(seen))

    async with serve_handler(handler) as url:
        relay = relay_for(url + "/v1")
        try:
            for n in (1, 2, 3):
                reply = await relay.send("POST", "/v1/chat/completions?x=1", JSON + [(b"x-custom", b"yes")], b"{}")
                assert (reply.status, reply.body) == (200, b'{"n":%d}' % n)
        finally:
            await relay.aclose()
    assert len({r.peer for r in seen}) == 1
    assert seen[0].target == "/v1/chat/completions?x=1" and seen[0].body == b"{}"
    # Only host and content-length are added; no accept-encoding, user-agent or the like.
    assert [k for k, _ in seen[0].headers] == [b"host", b"content-type", b"x-custom", b"content-length"]


async def test_a_connection_the_upstream_closed_while_idle_is_not_reused() -> None:
    """The upstream answers each connection once, keep-alive in its headers, then closes it."""
    connections = 0

    async def answer_once(stream: trio.SocketStream) -> None:
        nonlocal connections
        connections += 1
        data = b""
        while b"\r\n\r\n{}" not in data:
            data += await stream.receive_some(65536)
        await stream.send_all(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}")
        await stream.aclose()

    listeners = await open_listeners("127.0.0.1", 0)
    async with trio.open_nursery() as nursery:
        await nursery.start(trio.serve_listeners, answer_once, listeners)
        relay = relay_for(f"http://127.0.0.1:{bound_port(listeners)}")
        try:
            assert (await relay.send("POST", "/v1/messages", JSON, b"{}")).body == b"{}"
            (idle,) = relay.pool._idle
            with trio.fail_after(5):
                while not idle.stale():  # the upstream's FIN has to arrive first
                    await trio.sleep(0.01)
            assert (await relay.send("POST", "/v1/messages", JSON, b"{}")).body == b"{}"
        finally:
            await relay.aclose()
            nursery.cancel_scope.cancel()
    assert connections == 2


async def test_stream_pieces_that_arrived_together_are_relayed_together_and_nothing_waits_for_more() -> None:
    more = trio.Event()
    events = [b"data: {\"n\":1}\n\n", b"data: {\"n\":2}\n\n", b"data: [DONE]\n\n"]

    def chunk(data: bytes) -> bytes:
        return b"%x\r\n%s\r\n" % (len(data), data)

    async def upstream(stream: trio.SocketStream) -> None:
        data = b""
        while b"\r\n\r\n{}" not in data:
            data += await stream.receive_some(65536)
        await stream.send_all(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                              b"transfer-encoding: chunked\r\n\r\n" + chunk(events[0]) + chunk(events[1]))
        await more.wait()
        await stream.send_all(chunk(events[2]) + b"0\r\n\r\n")
        await stream.receive_some(65536)

    listeners = await open_listeners("127.0.0.1", 0)
    async with trio.open_nursery() as nursery:
        await nursery.start(trio.serve_listeners, upstream, listeners)
        relay = relay_for(f"http://127.0.0.1:{bound_port(listeners)}")
        try:
            reply = await relay.send("POST", "/v1/chat/completions", JSON, b"{}")
            pieces = []
            with trio.fail_after(5):
                async for piece in reply.body:
                    pieces.append(piece)
                    more.set()
            assert pieces == [events[0] + events[1], events[2]]
            assert reply.body.error is None
            assert len(relay.pool._idle) == 1  # a cleanly ended stream gives its connection back
        finally:
            await relay.aclose()
            nursery.cancel_scope.cancel()


async def tls_upstream(nursery: trio.Nursery, cert: trustme.LeafCert) -> str:
    async def handler(request: Request) -> Response:
        return Response(200, JSON, b'{"tls":true}')

    server_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    cert.configure_cert(server_context)
    listeners = await open_listeners("127.0.0.1", 0)
    tls = [trio.SSLListener(listener, server_context, https_compatible=True) for listener in listeners]
    await nursery.start(trio.serve_listeners, lambda stream: Connection(stream, handler, Limits()).serve(), tls)
    return f"https://127.0.0.1:{bound_port(listeners)}/v1"


async def test_https_upstreams_are_verified() -> None:
    ca = trustme.CA()
    async with trio.open_nursery() as nursery:
        url = await tls_upstream(nursery, ca.issue_cert("127.0.0.1"))
        trusting = ssl.create_default_context()
        ca.configure_trust(trusting)
        relay = relay_for(url, ssl_context=trusting)
        try:
            for _ in range(2):
                reply = await relay.send("POST", "/v1/messages", JSON, b"{}")
                assert (reply.status, reply.body) == (200, b'{"tls":true}')
        finally:
            await relay.aclose()
        relay = relay_for(url)  # the default trust store does not know this CA
        try:
            with pytest.raises(UpstreamError) as raised:
                await relay.send("POST", "/v1/messages", JSON, b"{}")
            assert raised.value.status == 502 and "CERTIFICATE_VERIFY_FAILED" in raised.value.message
        finally:
            await relay.aclose()
            nursery.cancel_scope.cancel()


async def test_an_upstream_answering_before_reading_a_large_body_has_its_answer_relayed() -> None:
    async def refuses_early(stream: trio.SocketStream) -> None:
        data = b""
        while b"\r\n\r\n" not in data:
            data += await stream.receive_some(65536)
        await stream.send_all(b"HTTP/1.1 413 Payload Too Large\r\ncontent-type: application/json\r\n"
                              b"content-length: 15\r\nconnection: close\r\n\r\n{\"error\":\"big\"}")
        await stream.aclose()

    listeners = await open_listeners("127.0.0.1", 0)
    async with trio.open_nursery() as nursery:
        await nursery.start(trio.serve_listeners, refuses_early, listeners)
        relay = relay_for(f"http://127.0.0.1:{bound_port(listeners)}")
        try:
            reply = await relay.send("POST", "/v1/messages", JSON, b"x" * 8_000_000)
            assert (reply.status, reply.body) == (413, b'{"error":"big"}')
        finally:
            await relay.aclose()
            nursery.cancel_scope.cancel()


class RecordedStream(trio.abc.Stream):
    """A stream that keeps what each ``send_all`` was given."""

    def __init__(self, inner: trio.SocketStream) -> None:
        self.inner, self.writes, self.socket = inner, list[bytes](), inner.socket

    async def send_all(self, data: bytes) -> None:
        self.writes.append(data)
        await self.inner.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self.inner.wait_send_all_might_not_block()

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        return await self.inner.receive_some(max_bytes)

    async def aclose(self) -> None:
        await self.inner.aclose()


async def test_a_body_that_arrived_in_many_small_reads_goes_up_in_few_writes_and_a_large_piece_uncopied() -> None:
    """The server keeps a body as its reads brought it, a few KB each over a real network: the upstream gets it in
    writes of up to 256 KB, not one per read, and a piece that large goes as it is."""
    seen: list[bytes] = []

    async def handler(request: Request) -> Response:
        seen.append(request.body)
        return Response(200, JSON, b"{}")

    class RecordingPool(ConnectionPool):
        async def _connect(self) -> UpstreamConnection:
            conn = await super()._connect()
            assert isinstance(conn.stream, trio.SocketStream)
            conn.stream = recorded = RecordedStream(conn.stream)
            streams.append(recorded)
            return conn

    rng = random.Random(7)
    small = tuple(rng.randbytes(1000) for _ in range(4000))
    large = rng.randbytes(600_000)
    streams: list[RecordedStream] = []
    async with serve_handler(handler) as url:
        pool = RecordingPool(url, 5)
        try:
            for body, most_writes in ((small[:200], 1), (small[:300] + (large,) + small[300:], 4_600_000 // 262_144 + 3)):
                with trio.fail_after(20):
                    conn, head = await pool.request(b"POST", b"/", JSON, body)
                    assert head.status_code == 200 and await conn.next_piece(5) == (b"{}", True)
                    await pool.release(conn, True)
                (stream,) = streams
                assert seen[-1] == b"".join(body)
                assert 0 < len(stream.writes) <= most_writes, len(stream.writes)
                assert large not in body or any(write is large for write in stream.writes)
                stream.writes.clear()
        finally:
            await pool.aclose()
