"""``[supervisor.gate] hold = "stop"``: a gated answer's text streams as it comes, only its stop event waits for the
verdict, and a continued turn goes on in the same message; the unverified notice in every format and hold.

End to end through a running proxy and the real SDKs (their stream accumulators check the event grammar of the
one spliced message), and on :class:`~proxyvisor.proxy.gating.GatedStream` alone for arbitrary chunking.
"""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from proxyvisor.proxy import continuation, gating
from proxyvisor.proxy.reply import Encoded
from proxyvisor.proxy.formats import BY_NAME, AssistantTurn, ToolCall
from proxyvisor.proxy.relay import UpstreamReply

from helpers import FORMATS, MODEL, REPORT, ask, request_body, sse_events, without_generated_ids
from test_gate_proxy import (DONE, GAP, NOTICE, REWORKED, Verifier, _chunked, _Chunks, _Judge, gated,
                             judged_after_keepalives, noticed, read_noticed, send, verdict, with_report)

STOP = "stop"
SIZES = [1, 7, 64, 1 << 16]


def _streamed_text(fmt: str, data: bytes) -> str:
    """The answer text the client has read from ``data`` so far (Responses: its text deltas, since a message's
    ``done`` events wait with the stop)."""
    events = sse_events(data)
    if fmt == "responses":
        return "".join(orjson.loads(e.data).get("delta") or "" for e in events
                       if e.event == "response.output_text.delta")
    return BY_NAME[fmt].assemble([(e.event, e.data) for e in events]).text


def _stop_events(fmt: str, data: bytes) -> list[str]:
    """The events of ``data`` that end an answer (the ones ``hold = "stop"`` keeps back)."""
    out = []
    for event in sse_events(data):
        if fmt == "chat":
            obj = orjson.loads(event.data) if event.data.startswith("{") else {}
            if event.data.strip() == "[DONE]" or any(c.get("finish_reason") for c in obj.get("choices") or ()):
                out.append(event.data)
        elif fmt == "messages" and event.event in ("message_delta", "message_stop"):
            out.append(event.event)
        elif fmt == "responses" and event.event in ("response.completed", "response.incomplete", "response.failed"):
            out.append(event.event)
    return out


# ---- end to end --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", FORMATS)
async def test_gaps_continue_the_same_message_the_agent_is_already_reading(tmp_path: Any, fmt: str) -> None:
    steps = [{"text": with_report(DONE["text"], "done")}, {"text": with_report(REWORKED["text"], "done")}]
    verifier = Verifier([verdict("gaps", (GAP,)), verdict()])
    async with gated(tmp_path, steps, verifier, hold=STOP) as run:
        answer = await ask(fmt, run.proxy.url, stream=True)
    # One answer: the first text, then the reworked one, every self-report stripped, one stop at the end.
    assert DONE["text"] in answer.text and REWORKED["text"] in answer.text and "<sup>" not in answer.text
    assert answer.text.index(DONE["text"]) < answer.text.index(REWORKED["text"])
    assert answer.stop in ("end_turn", "stop", "completed") and answer.tool_calls == ()
    assert verifier.purposes() == ["verify", "refute", "verify"] and len(run.upstream.requests) == 2
    line = [line for line in run.ledger() if "gate" in line][-1]
    assert (line["gate"]["reentries"], line["gate"]["outcome"]) == (1, "unknown")
    assert line["report"]["status"] == "ok"  # the continued answer's report, read and stripped


@pytest.mark.parametrize("fmt", FORMATS)
async def test_a_continued_answer_that_calls_tools_ends_the_same_message_with_its_calls(tmp_path: Any,
                                                                                        fmt: str) -> None:
    tool_turn = {"text": "Running them.", "tool_calls": [{"name": "Bash", "arguments": {"command": "pytest -q"},
                                                          "id": "call_t1"}]}
    async with gated(tmp_path, [DONE, tool_turn], Verifier([verdict("gaps", (GAP,))]), hold=STOP) as run:
        answer = await ask(fmt, run.proxy.url, stream=True)
    assert answer.text.startswith(DONE["text"]) and answer.text.endswith("Running them.")
    assert [name for _id, name, _args in answer.tool_calls] == ["Bash"]
    assert answer.stop in ("tool_use", "tool_calls", "completed")


@pytest.mark.parametrize("fmt", FORMATS)
async def test_the_text_streams_before_the_verdict_and_only_keepalives_follow_until_it(
        tmp_path: Any, fmt: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(continuation, "KEEPALIVE_S", 0.01)
    keepalive = BY_NAME[fmt].keepalive
    text, raw, pending = await judged_after_keepalives(tmp_path, fmt, hold=STOP)
    assert text == DONE["text"]
    before_keepalives = pending[:pending.index(keepalive)]
    assert _streamed_text(fmt, before_keepalives) == DONE["text"]
    assert _stop_events(fmt, pending) == [] and _stop_events(fmt, raw)  # the stop came after the verdict
    assert pending[len(before_keepalives):].replace(keepalive, b"") == b""


@pytest.mark.parametrize("policy", ["fail_closed", "fail_open"])
@pytest.mark.parametrize("fmt", FORMATS)
async def test_an_unverified_answer_ends_with_the_notice_as_its_last_text(tmp_path: Any, fmt: str,
                                                                          policy: str) -> None:
    async with gated(tmp_path, [DONE], Verifier([ConnectionError("down")]), hold=STOP,
                     failure_policy=policy) as run:
        answer = await ask(fmt, run.proxy.url, stream=True)
    expected = noticed(DONE["text"]) if policy == "fail_closed" else DONE["text"]
    assert read_noticed(answer.text) == expected and answer.stop in ("end_turn", "stop", "completed")


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("fmt", FORMATS)
async def test_the_notice_follows_the_answer_without_the_space_its_report_left(tmp_path: Any, fmt: str,
                                                                             stream: bool) -> None:
    async with gated(tmp_path, [{"text": "Done thrice." + REPORT}], Verifier([ConnectionError("down")]),
                     hold=STOP) as run:
        text, _, _ = await send(run, fmt, stream)
    assert "Done thrice. " not in text and read_noticed(text) == noticed("Done thrice.")
    if fmt == "chat":  # one content string: the notice after a blank line, as the format adds it
        assert text == noticed("Done thrice.")


@pytest.mark.parametrize("fmt", FORMATS)
async def test_a_continued_turn_follows_the_answer_without_the_space_its_report_left(tmp_path: Any,
                                                                                   fmt: str) -> None:
    steps = [{"text": "Done thrice." + REPORT}, {"text": "Running tests now." + REPORT}]
    async with gated(tmp_path, steps, Verifier([verdict("gaps", (GAP,)), verdict()]), hold=STOP) as run:
        text, _, _ = await send(run, fmt, True)
    assert "Done thrice. " not in text and text.startswith("Done thrice.") and text.endswith("Running tests now.")
    if fmt == "chat":  # spliced into the same content: after a blank line
        assert text == "Done thrice.\n\nRunning tests now."


def _last_text(fmt: str, raw: bytes, stream: bool) -> str:
    """The text a client that shows only the answer's last text gets (``claude -p``: the last text block;
    ``codex exec``: the last message item), read from the final message object or the stream's events."""
    if fmt == "messages":
        if not stream:
            return [b for b in orjson.loads(raw)["content"] if b["type"] == "text"][-1]["text"]
        texts: dict[int, str] = {}
        for e in sse_events(raw):
            obj = orjson.loads(e.data)
            if obj.get("type") == "content_block_start" and obj["content_block"]["type"] == "text":
                texts[obj["index"]] = ""
            elif obj.get("type") == "content_block_delta" and obj["delta"]["type"] == "text_delta":
                texts[obj["index"]] += obj["delta"]["text"]
        return texts[max(texts)]
    output = orjson.loads(raw)["output"] if not stream else next(
        orjson.loads(e.data)["response"]["output"] for e in sse_events(raw) if e.event == "response.completed")
    if stream:  # the done events agree with the final object
        items = [orjson.loads(e.data)["item"] for e in sse_events(raw) if e.event == "response.output_item.done"]
        assert [i for i in items if i["type"] == "message"] == [i for i in output if i["type"] == "message"]
    return [i for i in output if i["type"] == "message"][-1]["content"][-1]["text"]


@pytest.mark.parametrize("hold", ["answer", STOP])
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("fmt", ["messages", "responses"])
async def test_the_notice_ends_the_answers_last_text_so_a_client_showing_only_that_shows_both(
        tmp_path: Any, fmt: str, stream: bool, hold: str) -> None:
    async with gated(tmp_path, [DONE], Verifier([ConnectionError("down")]), hold=hold) as run:
        _, _, raw = await send(run, fmt, stream)
    assert read_noticed(_last_text(fmt, raw, stream).rstrip("\n")) == noticed(DONE["text"])


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("fmt", FORMATS)
async def test_an_empty_notice_adds_nothing(tmp_path: Any, fmt: str, stream: bool) -> None:
    async with gated(tmp_path, [DONE], Verifier([ConnectionError("down")]), hold=STOP, unverified_notice="") as run:
        answer = await ask(fmt, run.proxy.url, stream=stream)
    assert answer.text == DONE["text"] and run.last("gate")["outcome"] == "unverified"


# ---- GatedStream on arbitrary chunking -----------------------------------------------------------------------------


def _gated(judge: Any, chunks: Any) -> Encoded:
    """The agent's bytes of a :class:`~proxyvisor.proxy.gating.GatedStream` over ``chunks``."""
    return Encoded(gating.GatedStream(judge, chunks))


def _stream(fmt: str, turn: AssistantTurn) -> bytes:
    return b"".join(BY_NAME[fmt].render_stream(turn, MODEL, request_body(fmt, True)))


class _Consumer:
    """Iterates a :class:`GatedStream`, keeping what the agent has received so far."""

    def __init__(self) -> None:
        self.got = b""

    async def run(self, stream: Encoded) -> bytes:
        async for chunk in stream:
            self.got += chunk
        return self.got


class _Watching(_Judge):
    """A stand-in gate that notes, in :attr:`seen`, what the client had received when each verdict was asked."""

    def __init__(self, consumer: Any, fmt: str, **kwargs: Any) -> None:
        super().__init__(fmt, **kwargs)
        self.consumer = consumer
        self.seen: list[bytes] = []

    async def judged(self, held: Any) -> None:
        self.seen.append(self.consumer.got)
        await super().judged(held)


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("fmt", FORMATS)
async def test_split_anywhere_the_text_goes_out_before_the_verdict_and_the_stop_after_it(fmt: str,
                                                                                          size: int) -> None:
    data = _stream(fmt, AssistantTurn("Done: the bug is fixed, all \u00e9 of it."))
    consumer = _Consumer()
    judge = _Watching(consumer, fmt, hold=STOP)
    seen = judge.seen
    stream = _gated(judge, _Chunks(_chunked(data, size)))
    out = await consumer.run(stream)
    assert out == data and stream.error is None  # delivered unchanged: byte for byte
    assert judge.judged_texts == ["Done: the bug is fixed, all \u00e9 of it."]
    (at_verdict,) = seen
    assert _streamed_text(fmt, at_verdict) == judge.judged_texts[0]
    assert _stop_events(fmt, at_verdict) == [] and data.startswith(at_verdict)


@pytest.mark.parametrize("hold", ["answer", STOP])
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("fmt", FORMATS)
async def test_split_anywhere_the_notice_is_the_last_text_before_the_stop(fmt: str, size: int, hold: str) -> None:
    data = _stream(fmt, AssistantTurn("Done."))
    judge = _Judge(fmt, hold=hold, notice=NOTICE)
    out = await _Consumer().run(_gated(judge, _Chunks(_chunked(data, size))))
    w = BY_NAME[fmt]
    events = [(e.event, e.data) for e in sse_events(out)]
    assert read_noticed(w.assemble(events).text) == noticed("Done.")
    stops = _stop_events(fmt, out)
    assert stops == _stop_events(fmt, data)  # the same stop, once
    assert out.index(NOTICE.encode()) < out.index(stops[0].encode())
    _check_grammar(fmt, out)


@pytest.mark.parametrize("size", [1, 7, 64, 1 << 16])
@pytest.mark.parametrize("fmt", FORMATS)
async def test_split_anywhere_a_tool_call_round_streams_through_unheld(fmt: str, size: int) -> None:
    data = _stream(fmt, AssistantTurn("Let me look.", (ToolCall("Bash", {"command": "ls"}, "call_1"),)))
    judge = _Judge(fmt, hold=STOP)
    stream = _gated(judge, _Chunks(_chunked(data, size)))
    out = await _Consumer().run(stream)
    assert out == data and judge.judged_texts == []


class _Continuing(_Judge):
    """Continues the turn once with ``second`` (the continued upstream stream), then delivers."""

    def __init__(self, fmt: str, second: bytes, size: int, notice: str | None = None) -> None:
        super().__init__(fmt, hold=STOP)
        self.second = second
        self.size = size
        self.final_notice = notice

    async def judged(self, held: Any) -> list[Any] | None:
        await super().judged(held)
        if len(self.judged_texts) == 1:
            return ["continue"]
        self.notice = self.final_notice
        return None

    async def carry_on(self, items: list[Any], stream: bool = False) -> UpstreamReply:
        assert items == ["continue"] and stream
        return UpstreamReply(200, [], _Chunks(_chunked(self.second, self.size)), 0.0)


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("fmt", FORMATS)
async def test_split_anywhere_a_continued_answer_is_spliced_into_the_same_message(fmt: str, size: int) -> None:
    first = _stream(fmt, AssistantTurn("First answer."))
    second = _stream(fmt, AssistantTurn("Reworked answer."))
    judge = _Continuing(fmt, second, size, notice=NOTICE)
    out = await _Consumer().run(_gated(judge, _Chunks(_chunked(first, size))))
    assert judge.judged_texts == ["First answer.", "Reworked answer."]
    w = BY_NAME[fmt]
    text = w.assemble([(e.event, e.data) for e in sse_events(out)]).text
    assert text.index("First answer.") < text.index("Reworked answer.") < text.index(NOTICE)
    assert len(_stop_events(fmt, out)) == len(_stop_events(fmt, first))  # one stop, at the end
    _check_grammar(fmt, out)
    reference = _Continuing(fmt, second, 1 << 16, notice=NOTICE)
    whole = await _Consumer().run(_gated(reference, _Chunks([first])))
    assert without_generated_ids(out) == without_generated_ids(whole)  # chunking changes nothing


def _check_grammar(fmt: str, data: bytes) -> None:
    """What the SDKs' accumulators rely on: one message head, block indexes announced in order and each closed
    (Messages); Responses sequence numbers 0, 1, 2, ... and the final response listing every item sent."""
    events = [(e.event, orjson.loads(e.data)) for e in sse_events(data) if e.data.startswith("{")]
    if fmt == "messages":
        assert [name for name, _ in events].count("message_start") == 1
        starts = [obj["index"] for name, obj in events if name == "content_block_start"]
        stops = [obj["index"] for name, obj in events if name == "content_block_stop"]
        assert starts == list(range(len(starts))) == stops
        assert [name for name, _ in events][-2:] == ["message_delta", "message_stop"]
    elif fmt == "responses":
        assert [obj["sequence_number"] for _, obj in events] == list(range(len(events)))
        done = [obj["item"] for name, obj in events if name == "response.output_item.done"]
        final = events[-1][1]
        assert events[-1][0] == "response.completed" and final["response"]["output"] == done
        assert len({obj["response"]["id"] for name, obj in events if "response" in obj}) == 1
    else:
        with_choices = [obj for _, obj in events if obj.get("choices")]
        finishes = [c for obj in with_choices for c in obj["choices"] if c.get("finish_reason")]
        assert len(finishes) == 1 and with_choices[-1]["choices"][0]["finish_reason"]
        assert sse_events(data)[-1].data == "[DONE]"


@pytest.mark.parametrize("size", SIZES)
async def test_a_chat_finish_chunk_that_carries_text_sends_the_text_and_keeps_back_only_the_finish(size: int) -> None:
    # Some servers put the last content in the chunk with the finish_reason (and usage): the text is the
    # answer's, so it streams; the finish, the usage and [DONE] wait for the verdict.
    base = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": MODEL}
    chunks = [{**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": "Done: "},
                                    "finish_reason": None}]},
              {**base, "choices": [{"index": 0, "delta": {"content": "all fixed."}, "finish_reason": "stop"}],
               "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}}]
    data = b"".join(b"data: " + orjson.dumps(c) + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"
    consumer = _Consumer()
    judge = _Watching(consumer, "chat", hold=STOP, notice=NOTICE)
    seen = judge.seen
    out = await consumer.run(_gated(judge, _Chunks(_chunked(data, size))))
    w = BY_NAME["chat"]
    (at_verdict,) = seen
    assert w.assemble([(e.event, e.data) for e in sse_events(at_verdict)]).text == "Done: all fixed."
    assert _stop_events("chat", at_verdict) == []
    assert read_noticed(w.assemble([(e.event, e.data) for e in sse_events(out)]).text) == noticed("Done: all fixed.")
    _check_grammar("chat", out)
    usage = [orjson.loads(e.data)["usage"] for e in sse_events(out) if e.data.startswith("{") and '"usage"' in e.data]
    assert usage == [chunks[1]["usage"]]  # kept with the finish, once
