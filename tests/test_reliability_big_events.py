"""Big SSE events: a supervised stream's work per event is linear in the event's size, an event past
``MAX_BUFFERED_BODY`` ends the stream with the format's error event (everything before it delivered), and a line
that never ends stops being read at that size instead of filling memory. So does a JSON answer past it (502).

What each test pins is listed in ``docs/reliability.md``.
"""

from __future__ import annotations

import time

import orjson
import pytest
import trio

from proxyvisor.detectors.selfreport import Stripper, strip
from proxyvisor.proxy import limits
from proxyvisor.proxy.formats import BY_NAME, AssistantTurn
from proxyvisor.proxy.server import Request, Response
from proxyvisor.proxy.sse import SSEParser
from proxyvisor.proxy.streamedit import EditedStream

from helpers import (FORMATS, MODEL, assert_ends_with_error_event, assert_error_shape, raw_stream, request_body,
                     serve_handler, sse_events)

ALL_FORMATS = pytest.mark.parametrize("fmt", FORMATS)
_SSE = [(b"content-type", b"text/event-stream")]
LIMIT = 64 * 1024
BIG_WORD = "x" * (2 * LIMIT)


def _big_event_stream(size: int, piece: int) -> tuple[bytes, list[bytes]]:
    """A Chat stream with one content delta of ``size`` bytes, and the same bytes cut into ``piece``-byte reads."""
    head = b'data: {"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"'
    tail = b'"},"finish_reason":null}]}\n\n'
    data = head + b"y" * size + tail + b"data: [DONE]\n\n"
    return data, [data[i:i + piece] for i in range(0, len(data), piece)]


async def test_a_big_event_in_small_reads_is_edited_in_linear_time() -> None:
    """16 MB in 4 KiB reads: joining the pending event on every read (quadratic) copies about 32 GB, tens of
    seconds; scanning only the new bytes takes well under a second. The bound leaves room for a loaded machine."""
    data, pieces = _big_event_stream(16 * 1024 * 1024, 4096)

    async def upstream():
        for piece in pieces:
            yield piece
            await trio.sleep(0)

    editor = BY_NAME["chat"].stream_editor(Stripper, lambda text: strip(text)[0])
    stream = EditedStream(upstream(), editor, lambda _complete: None)
    started = time.perf_counter()
    with trio.fail_after(10):
        out = b"".join([chunk async for chunk in stream])
    assert time.perf_counter() - started < 5
    assert out == data and stream.error is None
    parser, events, started = SSEParser(), [], time.perf_counter()
    for piece in pieces:  # the parser the pipeline reads usage with, fed the raw reads
        events += parser.feed(piece)
    assert time.perf_counter() - started < 5
    assert [len(e.data) for e in events] == [len(data.split(b"\n\n")[0]) - len(b"data: "), len("[DONE]")]


class BigEventUpstream:
    """Streams a turn whose text has one word of ``2 * LIMIT`` bytes, so one delta event is past the limit.
    ``endless`` sends, after the events before that one, a data line that never ends, until it is no longer
    read; ``stopped`` is set when the upstream's body was closed."""

    def __init__(self, fmt: str, endless: bool = False) -> None:
        self.fmt = BY_NAME[fmt]
        self.endless = endless
        self.stopped = trio.Event()
        self.before = b""

    async def __call__(self, request: Request) -> Response:
        events = self.fmt.render_stream(AssistantTurn(f"Here: {BIG_WORD} done."), MODEL, orjson.loads(request.body))
        big = next(i for i, event in enumerate(events) if BIG_WORD.encode() in event)
        self.before = b"".join(events[:big])

        async def play():
            try:
                yield self.before
                if self.endless:
                    yield b"data: "
                    while True:
                        yield b"z" * 8192
                        await trio.sleep(0)
                else:
                    for event in events[big:]:
                        yield event
            finally:
                self.stopped.set()

        return Response(200, _SSE, play())


@ALL_FORMATS
@pytest.mark.parametrize("gate", [False, True], ids=["edited", "gated"])
async def test_an_event_over_the_limit_ends_the_stream_with_the_formats_error_event_after_all_before_it(
        fmt: str, gate: bool, start_proxy, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(limits, "MAX_BUFFERED_BODY", LIMIT)
    upstream = BigEventUpstream(fmt)
    async with serve_handler(upstream) as url, start_proxy(upstream_url=url, gate=gate) as rp:
        with trio.fail_after(10):
            reply, data = await raw_stream(rp.url + "/s/big", fmt, request_body(fmt, stream=True))
        assert reply.status_code == 200
        assert data.startswith(upstream.before)  # every event before the big one, byte for byte
        assert_ends_with_error_event(fmt, data)
        assert len(sse_events(data[len(upstream.before):])) == 1  # then only the error event
        assert f"larger than {LIMIT} bytes" in sse_events(data)[-1].data
        (record,) = rp.pipeline.store.read_ledger("big")
        assert record["status"] == 502 and f"larger than {LIMIT} bytes" in record["error"]


@ALL_FORMATS
async def test_a_line_that_never_ends_is_read_only_up_to_the_limit(
        fmt: str, start_proxy, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(limits, "MAX_BUFFERED_BODY", LIMIT)
    upstream = BigEventUpstream(fmt, endless=True)
    async with serve_handler(upstream) as url, start_proxy(upstream_url=url) as rp:
        with trio.fail_after(10):
            reply, data = await raw_stream(rp.url + "/s/endless", fmt, request_body(fmt, stream=True))
            await upstream.stopped.wait()  # proxyvisor closed the upstream's stream: nothing more is held
        assert reply.status_code == 200 and data.startswith(upstream.before)
        assert_ends_with_error_event(fmt, data)
        assert b"zzz" not in data


async def test_a_json_answer_over_the_limit_gives_502(start_proxy, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(limits, "MAX_BUFFERED_BODY", LIMIT)

    async def upstream(request: Request) -> Response:
        return Response(200, [(b"content-type", b"application/json")],
                        orjson.dumps({"choices": [{"message": {"content": BIG_WORD}}]}))

    async with serve_handler(upstream) as url, start_proxy(upstream_url=url) as rp:
        reply, data = await raw_stream(rp.url + "/s/json", "chat", request_body("chat"))
    assert reply.status_code == 502
    assert f"exceeds {LIMIT} bytes" in assert_error_shape("chat", 502, data)["message"]
