"""Faults beyond ``test_faults.py`` (issue 7, items 2 and 3): DNS failures, SSE cut inside an event, a session's
state after every kind of fault, slow readers, slow writers and a storm of dropped connections.

What each test pins is listed in ``docs/reliability.md``.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable

import anthropic
import h11
import openai
import orjson
import pytest
import trio

from proxyvisor.proxy.formats import BY_NAME, AssistantTurn, ToolCall, WireFormat
from proxyvisor.proxy.closing import close
from proxyvisor.proxy.server import Request, Response

from helpers import (FORMATS, MODEL, TOOL_STEP, ask, assert_ends_with_error_event, assert_error_shape, path_of,
                     raw_stream, request_body, serve_handler, sse_events, task_count)

MODES = pytest.mark.parametrize("supervised", [True, False], ids=["supervised", "disabled"])
ALL_FORMATS = pytest.mark.parametrize("fmt", FORMATS)
_SSE = [(b"content-type", b"text/event-stream")]


def own_errors(caplog: pytest.LogCaptureFixture) -> list[str]:
    """Records of proxyvisor's own failures: an internal error, a broken connection handler, a supervision
    failure (each logged with a traceback at ERROR)."""
    return [r.getMessage() for r in caplog.records if r.name.startswith("proxyvisor") and r.levelno >= logging.ERROR]


# ---- DNS ----------------------------------------------------------------------------------------------------


@MODES
@ALL_FORMATS
async def test_an_upstream_host_that_does_not_resolve_gives_502_in_the_clients_format(
        fmt: str, supervised: bool, start_proxy) -> None:
    """``.invalid`` never resolves (RFC 6761). A resolver slower than ``connect_timeout_s`` gives 504 instead."""
    async with start_proxy(supervised=supervised, upstream_url="http://proxyvisor-test.invalid",
                           upstream={"connect_timeout_s": 5}, breakers=False) as rp:
        for stream in (False, True):
            with trio.fail_after(10):
                reply, data = await raw_stream(rp.url + "/s/dns", fmt, request_body(fmt, stream))
            assert reply.status_code in (502, 504)
            message = assert_error_shape(fmt, reply.status_code, data)["message"]
            assert "'scripted'" in message and ("unreachable" in message or "timed out" in message)
        if supervised:
            records = rp.pipeline.store.read_ledger("dns")
            assert [r["status"] for r in records] == [reply.status_code] * 2
            assert all(r["error"] == message for r in records)
            assert rp.pipeline.sessions.get("dns").errors == 2


# ---- SSE cut inside an event ------------------------------------------------------------------------------


class ShortStream:
    """An upstream that streams a turn and ends its body cleanly (a proper last chunk) before the stream's end:
    ``shorten(events)`` gives what it sends. Every other request gets the whole stream when ``alternate``."""

    def __init__(self, fmt: str, shorten: Callable[[WireFormat, list[bytes]], bytes], alternate: bool = False,
                 text: str = "héllo wörld ✓", calls: tuple[ToolCall, ...] = ()) -> None:
        self.fmt = BY_NAME[fmt]
        self.shorten = shorten
        self.alternate = alternate
        self.turn = AssistantTurn(text, calls)
        self.requests = 0

    async def __call__(self, request: Request) -> Response:
        self.requests += 1
        events = self.fmt.render_stream(self.turn, MODEL, orjson.loads(request.body))
        payload = b"".join(events) if self.alternate and self.requests % 2 == 0 else self.shorten(self.fmt, events)

        async def play():
            yield payload

        return Response(200, _SSE, play())


def cut_stream(fmt: str) -> ShortStream:
    """Ends in the middle of an event, as an upstream that frames SSE by closing the connection does when it dies;
    every other request gets the whole stream."""
    return ShortStream(fmt, lambda _fmt, events: b"".join(events[:4]) + events[4][: len(events[4]) // 2],
                       alternate=True, calls=(ToolCall("Bash", {"command": "ls"}, "c1"),))


@MODES
@ALL_FORMATS
async def test_a_stream_that_ends_inside_an_event_ends_with_the_formats_error_event(
        fmt: str, supervised: bool, start_proxy) -> None:
    upstream = cut_stream(fmt)
    async with serve_handler(upstream) as url, start_proxy(supervised=supervised, upstream_url=url) as rp:
        reply, data = await raw_stream(rp.url + "/s/cut", fmt, request_body(fmt, stream=True))
        assert reply.status_code == 200
        if supervised:  # the unfinished event is held back: every event the client gets is whole
            assert_ends_with_error_event(fmt, data)
        events = sse_events(data)
        assert "ended in the middle of an event" in events[-1].data
        assert data.endswith(b"\n\n")
        reply, data = await raw_stream(rp.url + "/s/cut", fmt, request_body(fmt, stream=True))
        assert reply.status_code == 200 and b"ended in the middle" not in data  # the next request is whole
        # Through the SDK: an error, never a cut-short answer taken for a whole one.
        errors = (openai.APIError, anthropic.APIError) if supervised else (openai.APIError, anthropic.APIError,
                                                                           ValueError)
        with pytest.raises(errors):
            await ask(fmt, rp.url, stream=True)
        if supervised:
            first, second = rp.pipeline.store.read_ledger("cut")
            assert first["status"] == 502 and first["error"] == "upstream stream ended in the middle of an event"
            assert second["status"] == 200 and "error" not in second


def endless_answer(fmt: str) -> ShortStream:
    """Stops between two events, before the format's last one (``[DONE]`` and the finish, ``message_stop``,
    ``response.completed``)."""
    return ShortStream(fmt, lambda w, events: b"".join(e for e in events if not w.ends_stream(e)),
                       text="an answer whose stream never finishes")


@MODES
@ALL_FORMATS
async def test_a_stream_that_stops_before_its_last_event_ends_with_the_formats_error_event(
        fmt: str, supervised: bool, start_proxy) -> None:
    async with serve_handler(endless_answer(fmt)) as url, start_proxy(supervised=supervised, upstream_url=url) as rp:
        reply, data = await raw_stream(rp.url + "/s/short", fmt, request_body(fmt, stream=True))
        assert reply.status_code == 200 and b"finishes" in data  # the answer so far, then the error
        assert_ends_with_error_event(fmt, data)
        assert "ended before its last event" in sse_events(data)[-1].data
        with pytest.raises((openai.APIError, anthropic.APIError)):  # not a short answer taken for a whole one
            await ask(fmt, rp.url, stream=True)
        if supervised:
            (first,) = rp.pipeline.store.read_ledger("short")  # (the SDK call is a session of its own)
            assert first["status"] == 502 and first["error"] == "upstream stream ended before its last event"


# ---- a session after every kind of fault --------------------------------------------------------------------

# (step, stream, status the client gets, ledger status, ledger error or None)
FAULTS = [
    ({"fault": {"status": 429, "retry_after": "2"}}, False, 429, 429, None),
    ({"fault": {"status": 500}}, True, 500, 500, None),
    ({"fault": {"status": 503}}, False, 503, 503, None),
    ({"fault": {"status": 529}}, True, 529, 529, None),
    ({"fault": {"reset_after_events": 2}}, True, 200, 502, "upstream stream broke"),
    ({"fault": {"stall_after_events": 2, "stall_s": 60}}, True, 200, 504, "mid-stream"),
    ({"fault": {"first_byte_delay_s": 60}}, True, 504, 504, "sent no response within"),
    ({"fault": {"first_byte_delay_s": 60}}, False, 504, 504, "sent no response within"),
    ({"fault": {"truncate_body": True}}, False, 502, 502, "cut short"),
    ({"fault": {"garbage": True}}, True, 200, 502, "ended before its last event"),
]


@ALL_FORMATS
async def test_after_each_fault_the_session_answers_its_next_request_and_the_ledger_tells_what_happened(
        fmt: str, start_proxy, caplog: pytest.LogCaptureFixture) -> None:
    async with start_proxy(upstream={"first_byte_timeout_s": 0.3, "idle_timeout_s": 0.3}, breakers=False) as rp:
        upstream = rp.scripted["scripted"]
        for step, stream, status, _ledger_status, _error in FAULTS:
            upstream.queue(step, TOOL_STEP)
            with trio.fail_after(10):
                reply, data = await raw_stream(rp.url + "/s/faulty", fmt, request_body(fmt, stream))
            assert reply.status_code == status, step
            if status >= 400:
                assert_error_shape(fmt, status, data)
            elif step["fault"].get("garbage") is None:
                assert_ends_with_error_event(fmt, data)
            answer = await ask(fmt, rp.url + "/s/faulty", stream=stream)  # the same session, right after
            assert answer.tool_calls == (("call_fixed_1", "Bash", TOOL_STEP["tool_calls"][0]["arguments"]),)
        session = rp.pipeline.sessions.get("faulty")
        ledger = rp.pipeline.store.read_ledger("faulty")
    assert session.requests == len(ledger) == 2 * len(FAULTS)
    assert session.errors == sum(1 for f in FAULTS if f[3] >= 400)
    assert len(session.supervision.records) == 2 * len(FAULTS)
    for (step, stream, _status, ledger_status, error), faulty, fine in zip(FAULTS, ledger[::2], ledger[1::2]):
        assert (faulty["status"], faulty["stream"]) == (ledger_status, stream), step
        assert (error is None and "error" not in faulty) or error in faulty["error"], (step, faulty)
        assert fine["status"] == 200 and "error" not in fine
        if fmt == "chat" and stream:  # chat streams report usage on request only: proxyvisor counts it itself
            assert fine["usage_estimated"] is True and fine["output_tokens"] > 0
        else:
            assert fine["output_tokens"] == 17 and "usage_estimated" not in fine
    assert own_errors(caplog) == []


class StalledBody:
    """An upstream whose JSON answer stops half-way (its content-length promises more) and then sends nothing."""

    def __init__(self) -> None:
        self.stalled = trio.Event()

    async def __call__(self, request: Request) -> Response:
        data = orjson.dumps(BY_NAME["chat"].render(AssistantTurn("hello"), MODEL))

        async def play():
            yield data[: len(data) // 2]
            self.stalled.set()
            await trio.sleep(3600)
            yield data[len(data) // 2:]

        return Response(200, [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(data))], play())


@MODES
async def test_a_json_answer_that_stalls_half_way_gives_504_after_the_idle_timeout(supervised: bool,
                                                                                   start_proxy) -> None:
    upstream = StalledBody()
    async with serve_handler(upstream) as url, \
            start_proxy(supervised=supervised, upstream_url=url, upstream={"idle_timeout_s": 0.3}) as rp:
        with trio.fail_after(10):
            reply, data = await raw_stream(rp.url + "/s/stalled", "chat", request_body("chat"))
        assert upstream.stalled.is_set()
        assert reply.status_code == 504
        assert "mid-body" in assert_error_shape("chat", 504, data)["message"]
        if supervised:
            (record,) = rp.pipeline.store.read_ledger("stalled")
            assert record["status"] == 504 and "0.3 s" in record["error"]


@ALL_FORMATS
async def test_a_client_that_leaves_mid_stream_is_in_the_ledger(fmt: str, start_proxy) -> None:
    """The ledger line of a stream the client did not wait for says so, rather than passing for a whole answer."""
    async with start_proxy([{"fault": {"stall_after_events": 2, "stall_s": 3600}}]) as rp:
        stream = await open_client(rp.port)
        body = orjson.dumps(request_body(fmt, stream=True))
        await stream.send_all(request_bytes(h11.Connection(h11.CLIENT), fmt, body, "/s/gone" + path_of(fmt)))
        with trio.fail_after(10):
            assert (await stream.receive_some(65536)).startswith(b"HTTP/1.1 200")
        await stream.aclose()
        with trio.fail_after(10):
            while not rp.pipeline.store.read_ledger("gone"):
                await trio.sleep(0.01)
        (record,) = rp.pipeline.store.read_ledger("gone")
    assert record["status"] == 200 and record["error"] == "client disconnected mid-stream"


@pytest.mark.parametrize("supervised", [True, False], ids=["supervised", "unsupervised"])
async def test_a_stream_whose_head_never_went_out_is_in_the_ledger(supervised: bool, start_proxy) -> None:
    """The server closes the body of a response whose head it could not send (the client gone just as the answer
    began): the stream never ran, yet its ledger line (or count) says how it ended and its upstream is closed."""
    async with start_proxy([{"fault": {"stall_after_events": 2, "stall_s": 3600}}], supervised=supervised) as rp:
        body = orjson.dumps(request_body("chat", stream=True))
        headers = [(b"content-type", b"application/json")]
        response = await rp.pipeline(Request("POST", "/s/unsent" + path_of("chat"), headers, body,
                                             time.perf_counter()))
        assert response.status == 200 and not isinstance(response.body, bytes)
        await close(response.body)  # as Connection._write does when the head cannot go out
        session = rp.pipeline.sessions.get("unsent")
        assert session is not None and session.requests == 1
        if supervised:
            (record,) = rp.pipeline.store.read_ledger("unsent")
            assert record["status"] == 200 and record["error"] == "client disconnected mid-stream"


@ALL_FORMATS
async def test_a_client_that_leaves_before_the_answer_is_in_the_ledger(fmt: str, start_proxy) -> None:
    async with start_proxy([{"fault": {"first_byte_delay_s": 3600}}]) as rp:
        stream = await open_client(rp.port)
        body = orjson.dumps(request_body(fmt))
        await stream.send_all(request_bytes(h11.Connection(h11.CLIENT), fmt, body, "/s/early" + path_of(fmt)))
        with trio.fail_after(10):
            while not rp.scripted["scripted"].requests:  # the request is upstream
                await trio.sleep(0.01)
        await stream.aclose()
        with trio.fail_after(10):
            while not rp.pipeline.store.read_ledger("early"):
                await trio.sleep(0.01)
        (record,) = rp.pipeline.store.read_ledger("early")
    assert record["status"] == 499 and record["error"].startswith("cancelled before the answer")


# ---- clients that read or write slowly ----------------------------------------------------------------------


class Firehose:
    """An upstream that streams ``count`` chat events of ``size`` bytes as fast as its connection takes them;
    ``sent`` counts the bytes its server has taken from it."""

    def __init__(self, count: int, size: int) -> None:
        delta = {"id": "x", "object": "chat.completion.chunk", "created": 0, "model": MODEL,
                 "choices": [{"index": 0, "delta": {"content": "z" * size}, "finish_reason": None}]}
        self.event = b"data: " + orjson.dumps(delta) + b"\n\n"
        self.count = count
        self.sent = 0
        self.total = count * len(self.event) + len(b"data: [DONE]\n\n")

    async def __call__(self, request: Request) -> Response:
        async def play():
            for _ in range(self.count):
                yield self.event
                self.sent += len(self.event)
            yield b"data: [DONE]\n\n"
            self.sent += len(b"data: [DONE]\n\n")

        return Response(200, _SSE, play())


async def read_response(stream: trio.SocketStream, conn: h11.Connection) -> tuple[int, bytes]:
    """Read one whole response with ``conn`` (an h11 client); (status, body)."""
    status, parts = 0, []
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            conn.receive_data(await stream.receive_some(1 << 20))
        elif isinstance(event, h11.Response):
            status = event.status_code
        elif isinstance(event, h11.Data):
            parts.append(bytes(event.data))
        elif isinstance(event, h11.EndOfMessage):
            return status, b"".join(parts)
        else:
            raise AssertionError(f"unexpected {event!r}")


async def open_client(port: int, rcvbuf: int = 0) -> trio.SocketStream:
    sock = trio.socket.socket()
    if rcvbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)  # before connect: the window is set then
    await sock.connect(("127.0.0.1", port))
    return trio.SocketStream(sock)


def request_bytes(conn: h11.Connection, fmt: str, body: bytes, target: str | None = None) -> bytes:
    head = h11.Request(method="POST", target=target or path_of(fmt),
                       headers=[("host", "proxy"), ("content-type", "application/json"),
                                ("content-length", str(len(body)))])
    return conn.send(head) + conn.send(h11.Data(data=body)) + conn.send(h11.EndOfMessage())


@MODES
async def test_a_slow_reader_back_pressures_the_upstream_instead_of_filling_memory(supervised: bool,
                                                                                     start_proxy) -> None:
    """A client that stops reading: the proxy stops reading the upstream once the sockets' buffers are full,
    so what it holds is bounded by those buffers, not by the size of the answer. The client then reads on and
    gets every byte."""
    firehose = Firehose(count=1024, size=64 * 1024)  # 64 MiB
    bound = 16 * 1024 * 1024  # kernel socket buffers on two loopback hops, plus one read in flight
    async with serve_handler(firehose) as url, start_proxy(supervised=supervised, upstream_url=url) as rp:
        stream = await open_client(rp.port, rcvbuf=64 * 1024)
        conn = h11.Connection(h11.CLIENT)
        await stream.send_all(request_bytes(conn, "chat", orjson.dumps(request_body("chat", stream=True))))
        with trio.fail_after(20):
            seen, still = -1, 0
            while still < 25:  # no progress for 0.5 s: the upstream is blocked
                await trio.sleep(0.02)
                seen, still = firehose.sent, still + 1 if firehose.sent == seen else 0
        assert 0 < firehose.sent < bound, f"the proxy took {firehose.sent} bytes from the upstream"
        with trio.fail_after(60):
            status, body = await read_response(stream, conn)
        await stream.aclose()
    assert status == 200
    assert firehose.sent == firehose.total
    assert body.count(b"data: ") == firehose.count + 1 and body.endswith(b"data: [DONE]\n\n")
    if not supervised:
        assert len(body) == firehose.total


async def test_a_body_sent_slowly_is_served_and_others_are_served_meanwhile(start_proxy) -> None:
    async with start_proxy(proxy={"request_body_timeout_s": 2}) as rp:
        body = orjson.dumps(request_body("messages"))
        stream = await open_client(rp.port)
        conn = h11.Connection(h11.CLIENT)
        data = request_bytes(conn, "messages", body)
        head_end = data.index(b"\r\n\r\n") + 4
        await stream.send_all(data[:head_end])
        pieces = [data[i:i + 64] for i in range(head_end, len(data), 64)]
        for i, piece in enumerate(pieces):
            await stream.send_all(piece)
            await trio.sleep(0.01)
            if i == len(pieces) // 2:  # another client is not held up by the slow one
                reply, _ = await raw_stream(rp.url, "chat", request_body("chat"))
                assert reply.status_code == 200
        with trio.fail_after(10):
            status, answer = await read_response(stream, conn)
        await stream.aclose()
    assert status == 200 and orjson.loads(answer)["type"] == "message"
    requests = rp.scripted["scripted"].requests
    assert len(requests) == 2  # the other client's, then the slow one's, whole:
    assert orjson.loads(requests[1][1])["messages"] == request_body("messages")["messages"]


async def test_a_body_that_stops_coming_is_dropped_without_reaching_the_upstream(start_proxy, state_dir) -> None:
    async with start_proxy(proxy={"request_body_timeout_s": 0.3}) as rp:
        body = orjson.dumps(request_body("responses"))
        stream = await open_client(rp.port)
        data = request_bytes(h11.Connection(h11.CLIENT), "responses", body)
        await stream.send_all(data[: len(data) - 10])
        with trio.fail_after(10):
            assert await stream.receive_some(65536) == b""  # closed by the proxy, without an answer
        await stream.aclose()
        reply, _ = await raw_stream(rp.url, "responses", request_body("responses"))
        assert reply.status_code == 200
        assert len(rp.scripted["scripted"].requests) == 1
    assert len(rp.pipeline.store.sessions()) == 1


# ---- a storm of connections ----------------------------------------------------------------------------------


def open_sockets() -> int:
    """The process's socket descriptors (files are the stores' business: a kept ledger file, a worker thread's own
    SQLite connection)."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        except OSError:  # closed meanwhile (the listing's own descriptor)
            pass
    return count


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts descriptors in /proc (Linux)")
async def test_a_thousand_connections_opened_and_dropped_leave_no_socket_or_task_behind(
        start_proxy, caplog: pytest.LogCaptureFixture) -> None:
    """Five ways to leave, 200 of each: at once, mid-head, mid-body, right after a streaming request, and after
    the first bytes of its answer. Afterwards the proxy serves every format, and its sockets and tasks are
    back where they were."""
    async with start_proxy(chunk_delay_ms=5) as rp:
        for fmt in FORMATS:
            assert (await raw_stream(rp.url, fmt, request_body(fmt, stream=True)))[0].status_code == 200
        pool = rp.pipeline.relays["scripted"].pool
        fds, tasks, idle = open_sockets(), task_count(), len(pool._idle)
        streaming = orjson.dumps(request_body("messages", stream=True))

        async def leave(i: int) -> None:
            stream = await open_client(rp.port)
            data = request_bytes(h11.Connection(h11.CLIENT), "messages", streaming, f"/s/storm-{i}/v1/messages")
            head_end = data.index(b"\r\n\r\n") + 4
            how = i % 5
            try:
                if how == 1:
                    await stream.send_all(data[: head_end // 2])
                elif how == 2:
                    await stream.send_all(data[: head_end + 10])
                elif how == 3:
                    await stream.send_all(data)
                elif how == 4:
                    await stream.send_all(data)
                    await stream.receive_some(100)
            finally:
                await stream.aclose()

        with trio.fail_after(60):
            for batch in range(0, 1000, 200):
                async with trio.open_nursery() as nursery:
                    for i in range(batch, batch + 200):
                        nursery.start_soon(leave, i)
        with trio.fail_after(15):  # the proxy notices each hang-up; upstream calls it cancelled are closed
            while open_sockets() > fds + 2 * (len(pool._idle) - idle) or task_count() > tasks:
                await trio.sleep(0.05)
        for fmt in FORMATS:
            assert (await ask(fmt, rp.url, stream=True)).tool_calls
    assert own_errors(caplog) == []
