"""Supervision through the proxy: the self-report never reaches the agent (every format, streamed or not, split
anywhere), reports are counted, tool results stay data, a looping agent gets its note, and replay and the demo
show it."""

from __future__ import annotations

import importlib
from collections.abc import AsyncIterator
import io
import json
from typing import Any
from unittest import mock

import orjson
import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st
from rich.console import Console

from proxyvisor.scripted.upstream import turn_of
from proxyvisor.config import Config
from proxyvisor.demo import LOOP_MARK, demo
from proxyvisor.detectors.detectors import LOOP
from proxyvisor.detectors.selfreport import INSTRUCTION, Stripper, strip
from proxyvisor.detectors.steer import note_text
from proxyvisor.proxy.formats import BY_NAME, ToolSpec
from proxyvisor.proxy.formats.base import sse
from proxyvisor.proxy.formats.messages import EMPTIED
from proxyvisor.proxy.reply import Blocks, Edited, Encoded
from proxyvisor.proxy.supervise import Supervisor
from proxyvisor.replay import format_round, replay
from proxyvisor.store import Store

from helpers import FORMATS, MODEL, ask, json_events, raw_stream, request_body, sse_events

REPORT = '{"state":"progressing","focus":"inspect routing","next":"read handlers","carry":[],"plan":null}'
TOKEN = f"<sup>{REPORT}</sup>"
TEXTS = [
    f"Let me look — 🔍 first.\n{TOKEN}",
    TOKEN,  # a turn whose only text is the report
    "Done: x<sup>2</sup> is fixed; see <sup>th</sup> note.\n<sup>done · tests pass</sup>",
    f"a < b <su <sup <sup>{REPORT}</sup> trailing",
    f"unclosed <sup>{REPORT} and more",
    # Superscripts of the answer's own (a legacy report's shape in mid-text included) are content.
    f"E = mc<sup>2</sup>; <sup>done</sup> is a label, <sup>a | b</sup> a choice.  \n{TOKEN}",
]
CALL = [{"name": "Bash", "arguments": {"command": "ls -la"}, "id": "call_fixed_1"}]


def expected_text(fmt: str, text: str, calls: bool = True) -> str:
    clean = strip(text)[0]
    # Anthropic refuses an empty text block, and an assistant message without content, when the agent sends them
    # back: an emptied block is dropped, and a response left with nothing gets a placeholder.
    if fmt == "messages" and text.strip() and not clean.strip():
        return "" if calls else EMPTIED
    return clean


def session_state(rp: Any) -> Any:
    (session,) = rp.pipeline.sessions.all()
    return session.supervision


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("fmt", FORMATS)
async def test_the_agent_never_sees_a_report_token(fmt: str, stream: bool, start_proxy) -> None:
    async with start_proxy() as rp:
        for text in TEXTS:
            for calls in (CALL, []):
                rp.scripted["scripted"].queue({"text": text, "tool_calls": calls})
                answer = await ask(fmt, rp.url, stream=stream)
                assert answer.text == expected_text(fmt, text, bool(calls)), text
                assert [c[0] for c in answer.tool_calls] == [c["id"] for c in calls]
                assert "<sup>{" not in answer.text or "unclosed" in text
        reports = session_state(rp).reports
        assert reports == {"ok": 10, "missing": 2}  # the unclosed token is no token: plain text


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("fmt", FORMATS)
async def test_the_instruction_is_appended_and_the_raw_reply_has_no_token(fmt: str, stream: bool,
                                                                          start_proxy) -> None:
    async with start_proxy([{"text": TEXTS[0], "tool_calls": CALL}]) as rp:
        reply, data = await raw_stream(rp.url, fmt, request_body(fmt, stream))
        assert reply.status_code == 200 and REPORT.encode() not in data
        sent = orjson.loads(rp.scripted["scripted"].requests[-1][1])
        system, _ = BY_NAME[fmt].fingerprint_parts(sent)
        assert system.startswith("You are a terse assistant.") and system.endswith(INSTRUCTION)
        if stream:
            assert all(e[1] == "[DONE]" or isinstance(e[1], dict) for e in json_events(data))


async def test_without_supervision_nothing_is_stripped_or_added(start_proxy) -> None:
    async with start_proxy([{"text": TEXTS[0]}], supervised=False) as rp:
        answer = await ask("messages", rp.url, stream=True)
        assert answer.text == TEXTS[0]
        assert INSTRUCTION.encode() not in rp.scripted["scripted"].requests[-1][1]


@pytest.mark.parametrize("fmt", FORMATS)
async def test_a_token_in_a_tool_result_is_data_not_a_report(fmt: str, start_proxy) -> None:
    history = [{"role": "system", "content": "sys"}, {"role": "user", "content": "cat notes.md"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "c1", "type": "function", "function": {"name": "Bash", "arguments": '{"command":"cat"}'}}]},
               {"role": "tool", "tool_call_id": "c1", "content": f"notes: {TOKEN} <sup>done</sup>"}]
    body = BY_NAME[fmt].request_from_chat(history, MODEL, False, (ToolSpec("Bash", {}),))
    async with start_proxy([{"text": "The notes say nothing new."}]) as rp:
        reply, data = await raw_stream(rp.url, fmt, body)
        assert reply.status_code == 200
        sent = orjson.loads(rp.scripted["scripted"].requests[-1][1])
        (output,) = BY_NAME[fmt].message(BY_NAME[fmt].history(sent)[-1]).tool_outputs
        assert output.text == f"notes: {TOKEN} <sup>done</sup>"  # the tool result went up unchanged
        state = session_state(rp)
        assert state.reports == {"missing": 1}
        assert next(iter(state.threads.values())).state is None


async def test_malformed_and_missing_reports_are_counted_never_fatal(start_proxy) -> None:
    steps = [{"text": 'ok <sup>{"state":"finished","focus":"x","carry":[]}</sup>'}, {"text": "no report"},
             {"text": "<sup>blocked | need credentials</sup>"}]
    async with start_proxy(steps) as rp:
        answers = [await ask("chat", rp.url, stream=stream) for stream in (True, False, True)]
        assert [a.text for a in answers] == ["ok", "no report", ""]  # chat: an empty text is fine
        assert session_state(rp).reports == {"malformed": 1, "missing": 1, "ok": 1}
        assert [r.report.status for r in session_state(rp).records] == ["malformed", "missing", "ok"]


async def test_a_supervision_failure_forwards_the_request_unsupervised(start_proxy) -> None:
    with mock.patch.object(Supervisor, "begin", side_effect=RuntimeError("boom")):
        async with start_proxy([{"text": TEXTS[0]}]) as rp:
            answer = await ask("responses", rp.url, stream=True)
            assert answer.text == TEXTS[0]  # nothing supervised: the reply is not rewritten either


# ---- a looping agent through the proxy ---------------------------------------------------------------------

def _has_note(items: list[Any]) -> bool:
    return note_text(LOOP) in json.dumps(items, ensure_ascii=False).replace('\\"', '"')


def _poll_history(rounds: int) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are an agent."},
                                      {"role": "user", "content": "Wait for the build."}]
    for n in range(rounds):
        messages.append({"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": f"c{n}", "type": "function", "function": {"name": "Bash", "arguments": '{"command":"cat s"}'}}]})
        messages.append({"role": "tool", "tool_call_id": f"c{n}", "content": "building: 3 of 7"})
    return messages


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("fmt", FORMATS)
async def test_a_looping_agent_gets_a_note_that_ends_the_loop(fmt: str, stream: bool, start_proxy) -> None:
    poll = {"text": f"Still building.\n{TOKEN}", "tool_calls": [{"name": "Bash", "arguments": {"command": "cat s"}}],
            "until": LOOP_MARK}
    stop = {"text": "The build is stuck; handing back.\n<sup>blocked · build stuck</sup>"}
    f = BY_NAME[fmt]
    async with start_proxy([poll, stop]) as rp:
        upstream = rp.scripted["scripted"]
        sent = []
        for rounds in range(5):
            reply, data = await raw_stream(rp.url, fmt, f.request_from_chat(_poll_history(rounds), MODEL, stream,
                                                                            (ToolSpec("Bash", {}),)))
            assert reply.status_code == 200 and REPORT.encode() not in data
            sent.append(f.history(orjson.loads(upstream.requests[-1][1])))
            turn = f.assemble([(e.event, e.data) for e in sse_events(data)]) if stream \
                else f.parse_response(orjson.loads(data))
            if rounds < 3:
                assert turn.tool_calls and not _has_note(sent[-1])
            elif rounds == 3:  # the model saw the note and stopped polling (the script moves on at the note)
                assert not turn.tool_calls and turn.text == "The build is stuck; handing back."
        # The note went up with the 4th request (after the 3rd identical round) and stays at its place.
        assert _has_note(sent[3]) and not _has_note(sent[3][:-1])
        assert sent[4][:len(sent[3])] == sent[3]
        state = session_state(rp)
        assert state.notes == {LOOP: 1}
        assert [r.report.status for r in state.records] == ["ok", "ok", "ok", "ok", "missing"]
        assert state.records[3].report.report.state == "blocked"


# ---- the stream editors, split at every boundary ------------------------------------------------------------

def _render(fmt: str, text: str, pieces: list[str], calls: list[dict[str, Any]]) -> bytes:
    """SSE bytes of a turn whose text streams in ``pieces`` (the formats render word by word otherwise)."""
    module = importlib.import_module(f"proxyvisor.proxy.formats.{fmt}")
    with mock.patch.object(module, "words", lambda _text: list(pieces)):
        events = BY_NAME[fmt].render_stream(turn_of({"text": text, "tool_calls": calls}), MODEL,
                                            {"stream_options": {"include_usage": True}})
    return b"".join(events)


def _edit(fmt: str, data: bytes, cuts: list[int]) -> tuple[bytes, list[str]]:
    strippers: list[Stripper] = []

    def new_filter() -> Stripper:
        strippers.append(Stripper())
        return strippers[-1]

    editor = BY_NAME[fmt].stream_editor(new_filter, lambda t: strip(t)[0])
    bounds = [0, *sorted({min(c, len(data)) for c in cuts}), len(data)]

    async def upstream() -> AsyncIterator[bytes]:
        for a, b in zip(bounds, bounds[1:]):
            yield data[a:b]

    async def edited() -> bytes:
        stream = Encoded(Edited(Blocks(upstream()), editor, lambda _complete: None))
        out = b"".join([piece async for piece in stream])
        assert stream.error is None
        return out

    return trio.run(edited), [body for s in strippers for body in s.bodies]


@settings(max_examples=120, deadline=None)
@given(fmt=st.sampled_from(FORMATS), text=st.sampled_from(TEXTS), with_call=st.booleans(),
       text_cuts=st.lists(st.integers(min_value=0, max_value=160), max_size=20),
       byte_cuts=st.lists(st.integers(min_value=0, max_value=4000), max_size=20))
def test_streams_split_anywhere_give_the_agent_the_text_without_the_token(
        fmt: str, text: str, with_call: bool, text_cuts: list[int], byte_cuts: list[int]) -> None:
    bounds = [0, *sorted({min(c, len(text)) for c in text_cuts}), len(text)]
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:]) if b > a]
    data = _render(fmt, text, pieces, CALL if with_call else [])
    edited, bodies = _edit(fmt, data, byte_cuts)
    assert bodies == strip(text)[1]
    events = [(e.event, e.data) for e in sse_events(edited)]
    turn = BY_NAME[fmt].assemble(events)
    assert turn.text == expected_text(fmt, text, with_call)
    assert [c.name for c in turn.tool_calls] == (["Bash"] if with_call else [])
    assert REPORT not in edited.decode() or "unclosed" in text
    if fmt == "messages":  # block indices stay consecutive when an emptied block is dropped
        starts = [orjson.loads(d)["index"] for name, d in events if name == "content_block_start"]
        assert starts == list(range(len(starts)))
    if fmt == "responses":  # the deltas add up to the full-text copies, and the numbering has no gap
        objs = [orjson.loads(d) for _, d in events]
        deltas = "".join(o["delta"] for o in objs if o["type"] == "response.output_text.delta")
        assert deltas == turn.text
        assert [o["sequence_number"] for o in objs] == list(range(len(objs)))


def test_unchanged_events_pass_through_byte_identical() -> None:
    data = _render("responses", "plain text, nothing to strip", ["plain text,", " nothing to strip"], CALL)
    assert _edit("responses", data, [7, 100, 333])[0] == data
    data = _render("messages", "plain <b>text</b>", ["plain <b>", "text</b>"], CALL)
    assert _edit("messages", data, [1, 50])[0] == data
    data = b": keep-alive\n\n" + _render("chat", "plain", ["pla", "in"], []) + b"data: [DONE]\r\n\r\n"
    assert _edit("chat", data, [3, 17, 40])[0] == data


def test_a_messages_block_held_until_it_shows_text_goes_out_as_it_came() -> None:
    """A text block's start is held until its text shows something (the stripper's rule), then goes out with its
    first delta: both as the upstream wrote them when neither changed (spaced JSON, escaped characters kept)."""
    events = [("message_start", '{"type": "message_start", "message": {"id": "msg_1", "type": "message", '
                                '"role": "assistant", "content": [], "model": "m", "usage": {"input_tokens": 1}}}'),
              ("content_block_start", '{"type": "content_block_start", "index": 0, '
                                      '"content_block": {"type": "text", "text": ""}}'),
              ("content_block_delta", '{"type": "content_block_delta", "index": 0, '
                                      '"delta": {"type": "text_delta", "text": "caf\\u00e9 \\u2014 ok"}}'),
              ("content_block_delta", '{"type": "content_block_delta", "index": 0, '
                                      '"delta": {"type": "text_delta", "text": " done"}}'),
              ("content_block_stop", '{"type": "content_block_stop", "index": 0}'),
              ("message_delta", '{"type": "message_delta", "delta": {"stop_reason": "end_turn"}, '
                                '"usage": {"output_tokens": 3}}'),
              ("message_stop", '{"type": "message_stop"}')]
    data = b"".join(sse(d, name) for name, d in events)
    assert _edit("messages", data, [5, 200, 333])[0] == data


def test_whitespace_ending_a_delta_goes_out_with_the_next_text() -> None:
    """A report that ends the text takes the whitespace before it along: until more text comes, that
    whitespace is held, so only the deltas ending in whitespace are rewritten, and the text is the same."""
    data = _render("chat", "plain text,\n\nnothing to strip", ["plain text,\n\n", "nothing to strip"], [])
    edited = _edit("chat", data, [])[0]
    texts = [e[1]["choices"][0]["delta"].get("content") for e in json_events(edited) if e[1] != "[DONE]"
             and e[1]["choices"]]
    assert "".join(t or "" for t in texts) == "plain text,\n\nnothing to strip"
    assert "plain text," in texts and "\n\nnothing to strip" in texts


# ---- replay and demo -----------------------------------------------------------------------------------------

async def test_replay_shows_reports_detectors_and_notes(tmp_path) -> None:
    messages = _poll_history(4) + [{"role": "assistant", "content": "Still building; stopping."}]
    rounds = await replay(Config(), messages, BY_NAME["chat"], False, store=Store(tmp_path))
    assert [r.detectors for r in rounds] == [[], [], [], ["loop@6"], ["loop@8"]]
    assert [r.steer for r in rounds] == [None, None, None, LOOP, LOOP]
    assert rounds[3].steer_note == note_text(LOOP) and all(r.matches for r in rounds)
    assert "fired loop@6" in format_round(rounds[3]) and "steer note: loop" in format_round(rounds[3])
    assert json.loads(json.dumps(rounds[3].__dict__))["detectors"] == ["loop@6"]


def test_the_demo_shows_the_loop_the_note_and_its_effect(tmp_path) -> None:
    out = io.StringIO()
    assert demo(Config().with_overrides(state={"dir": str(tmp_path)}), "responses", Console(file=out, width=300)) == 0
    text = out.getvalue()
    assert text.count("round 1: calls bash") == 1 and "round 4: calls" not in text
    assert "the loop detector fired on round 3: " in text and "added a steer note" in text
    assert "self-report, removed before the agent saw it: blocked" in text
    # The hand-back asks the user a question, so the verify-gate (introduced here) lets it through (no extra round).
    assert ("the verify-gate, which reads each answer that ends a turn before the agent gets it, let this one "
            "through: hand-back accepted: the remaining work needs the user (turn outcome: unknown)") in text
    assert "the agent saw a <sup> token: no" in text
    assert LOOP_MARK in note_text(LOOP)
