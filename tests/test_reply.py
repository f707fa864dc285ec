"""The supervised reply path's plumbing (``proxyvisor.proxy.reply``, ``proxyvisor.proxy.closing``): events scanned
once and sent on as their own bytes where no stage changed them, a stage's edit scanned again only for the stages
after it, and one close that reaches the upstream whoever stops reading, shielded and within a deadline."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
import trio

from proxyvisor.proxy import closing, sse
from proxyvisor.proxy.reply import Blocks, Edit, Edited, Encoded, scanned
from proxyvisor.proxy.sse import Block, Event

from helpers import FORMATS, ask

# An upstream's own formatting: CRLF and bare CR line endings, a comment, a field proxyvisor ignores, no space
# after the colon. A stage that re-encoded events would normalise all of it.
ODD = b": hello\r\nid: 1\r\ndata:{\"a\":1}\r\n\r\nevent: z\rdata: two\r\r"


class Upstream:
    """Yields ``chunks``, then ends; records whether it was closed and how far it was read."""

    def __init__(self, chunks: list[bytes], error: Any = None) -> None:
        self.chunks = chunks
        self.error = error
        self.read = 0
        self.closed = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        try:
            for chunk in self.chunks:
                self.read += 1
                yield chunk
                await trio.sleep(0)
        finally:
            self.closed = True


class Renamer:
    """A stream editor that rewrites the events named ``x`` and leaves the rest alone."""

    def __init__(self) -> None:
        self.seen: list[tuple[str | None, str]] = []

    def event(self, name: str | None, data: str) -> list[bytes] | None:
        self.seen.append((name, data))
        return [b"event: y\ndata: " + data.encode() + b"\n\n"] if name == "x" else None

    def close(self) -> list[bytes]:
        return [b"data: tail\n\n"]


async def _read(stream: Encoded) -> bytes:
    return b"".join([piece async for piece in stream])


@pytest.mark.parametrize("size", [1, 2, 5, len(ODD)])
async def test_events_no_stage_changed_go_out_as_the_upstreams_bytes(size: int) -> None:
    chunks = [ODD[i:i + size] for i in range(0, len(ODD), size)]
    ended: list[bool] = []
    stream = Encoded(Edited(Blocks(Upstream(chunks)), Renamer(), ended.append))
    assert await _read(stream) == ODD + b"data: tail\n\n"  # nothing named x: every byte as it came
    assert ended == [True] and stream.error is None


async def test_a_stage_after_an_edit_reads_the_edited_event() -> None:
    first, second = Renamer(), Renamer()
    data = b"event: x\ndata: one\n\ndata: two\n\n"
    inner = Edited(Blocks(Upstream([data])), first, lambda _complete: None)
    stream = Encoded(Edited(inner, second, lambda _complete: None))
    out = await _read(stream)
    assert first.seen == [("x", "one"), (None, "two")]
    assert second.seen == [("y", "one"), (None, "two"), (None, "tail")]  # the first's edit and tail, scanned
    assert out == b"event: y\ndata: one\n\ndata: two\n\ndata: tail\n\ndata: tail\n\n"


async def test_scanned_keeps_unchanged_blocks_and_scans_only_edits() -> None:
    kept = Block(b"data: a\n\n", Event(None, "a"))
    got = await scanned([kept, Edit([b"data: b\n\nda", b"ta: c\n\n"]), Edit([b"partial"])])
    assert got[0] is kept
    assert got[1:] == [Block(b"data: b\n\n", Event(None, "b")), Block(b"data: c\n\n", Event(None, "c")),
                       Block(b"partial", None)]  # bytes that are no event still go out


async def test_a_stream_cut_inside_an_event_holds_it_back_and_says_so() -> None:
    ended: list[bool] = []
    stream = Encoded(Edited(Blocks(Upstream([b"data: one\n\ndata: tw"])), Renamer(), ended.append))
    assert await _read(stream) == b"data: one\n\n"
    assert stream.error is not None and stream.error.status == 502 and "middle of an event" in stream.error.message
    assert ended == [False]


async def test_an_event_over_the_limit_stops_reading_and_closes_the_upstream(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sse.limits, "MAX_BUFFERED_BODY", 32)
    upstream = Upstream([b"data: one\n\n", b"data: " + b"x" * 40, b"never read"])
    stream = Encoded(Blocks(upstream))
    assert await _read(stream) == b"data: one\n\n"
    assert stream.error is not None and "larger than 32 bytes" in stream.error.message
    assert upstream.closed and upstream.read == 2


async def test_a_reader_that_stops_closes_the_chain_down_to_the_upstream() -> None:
    upstream = Upstream([b"data: %d\n\n" % i for i in range(10)])
    ended: list[bool] = []
    stream = Encoded(Edited(Edited(Blocks(upstream), Renamer(), ended.append), Renamer(), ended.append))
    pieces = aiter(stream)
    assert await anext(pieces) == b"data: 0\n\n"
    await closing.close(pieces)
    assert upstream.closed and upstream.read == 1
    assert ended == [False, False]


async def test_close_runs_when_the_caller_is_cancelled_and_gives_up_at_its_deadline(
        monkeypatch: pytest.MonkeyPatch) -> None:
    class Slow:
        started = finished = False

        async def aclose(self) -> None:
            self.started = True
            await trio.sleep(0.05)
            self.finished = True

    slow = Slow()
    with trio.CancelScope() as scope:
        scope.cancel()  # the client went away: the close still runs to its end
        await closing.close(slow)
    assert slow.finished

    class Hung:
        async def aclose(self) -> None:
            await trio.sleep_forever()

    monkeypatch.setattr(closing, "CLOSE_S", 0.01)
    with trio.fail_after(5):  # guards a hang only
        await closing.close(Hung())
    await closing.close(object())  # nothing to close: nothing happens


@pytest.mark.parametrize("fmt", FORMATS)
async def test_a_json_reply_is_decoded_once_for_all_the_stages(fmt: str, start_proxy,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The stripper rewrites the answer and the pipeline reads its usage and text: one decode of the upstream's
    bytes between them (each used to decode it again)."""
    import orjson

    mark = "Distinct answer text"
    decodes: list[int] = []
    loads = orjson.loads

    def counting(data: Any) -> Any:
        text = data if isinstance(data, str) else bytes(data).decode("utf-8", "replace")
        if mark in text:
            decodes.append(len(data))
        return loads(data)

    async with start_proxy([{"text": f"{mark}. <sup>{{\"state\": \"done\"}}</sup>"}]) as rp:
        monkeypatch.setattr(orjson, "loads", counting)
        answer = await ask(fmt, rp.url, stream=False)
        monkeypatch.setattr(orjson, "loads", loads)
    assert answer.text.startswith(mark) and "<sup>" not in answer.text
    assert len(decodes) == 1
