"""Supervised request bodies read and written in proportion to what is new (``proxyvisor.proxy.bodies``): a body
that extends an earlier one parses to what ``orjson.loads`` gives, from its new bytes only; anything else is parsed
whole, with the same result or the same error; the upstream body is written byte for byte as ``orjson.dumps``
writes it; and a whole supervised session (steer notes, a recitation, condensed results) sends the upstream the
very bytes that parsing and serialising every request whole sends."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from proxyvisor.config import Config
from proxyvisor.detectors.steer import note_text
from proxyvisor.detectors.detectors import LOOP
from proxyvisor.gate.plan import PLANNER_INSTRUCTIONS
from proxyvisor.proxy import bodies
from proxyvisor.proxy.bodies import BodyCache, chunks, dumps
from proxyvisor.proxy.formats import BY_NAME, ToolSpec, WireFormat
from proxyvisor.proxy.formats.base import Item
from proxyvisor.proxy.service import running
from proxyvisor.scripted.upstream import ScriptedUpstream
from proxyvisor.store import Store
from proxyvisor.supervisor_model import ModelAnswer

FORMATS = ("chat", "messages", "responses")
BASH = ToolSpec("Bash", {"type": "object", "properties": {"command": {"type": "string"}}})
READ = ToolSpec("Read", {"type": "object", "properties": {"file_path": {"type": "string"}}})


def rounds(n: int, start: int = 0) -> list[dict[str, Any]]:
    """``n`` tool rounds as Chat messages: text and a call, then its output (every third one large, with
    non-ASCII text and characters JSON escapes)."""
    out: list[dict[str, Any]] = []
    for i in range(start, start + n):
        output = "\n".join(f"{j:04d} café \"quoted\" \\ tab\t{i}" for j in range(400 if i % 3 == 2 else 3))
        out += [{"role": "assistant", "content": f"Step {i}: looking ✓",
                 "tool_calls": [{"id": f"call_{i}", "type": "function",
                                 "function": {"name": "Bash", "arguments": json.dumps({"command": f"ls {i}"})}}]},
                {"role": "tool", "tool_call_id": f"call_{i}", "content": output}]
    return out


def body_of(fmt: WireFormat, history: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    body = fmt.request_from_chat(orjson.loads(orjson.dumps(history)), "m", False, (BASH, READ))
    body.update(extra)
    return body


START = [{"role": "system", "content": "You are a coding agent."}, {"role": "user", "content": "Fix the tests."}]


def encodings(body: dict[str, Any]) -> list[bytes]:
    """``body`` as different clients write it: orjson's compact form, Python's json with its spaces and ASCII
    escapes, and indented."""
    return [orjson.dumps(body), json.dumps(body).encode(), json.dumps(body, indent=1, ensure_ascii=False).encode()]


@pytest.mark.parametrize("encoding", [0, 1, 2], ids=["compact", "json-spaces", "indented"])
@pytest.mark.parametrize("fmt_name", FORMATS)
def test_a_growing_history_is_read_from_its_new_bytes_and_parses_as_a_whole_read_does(
        fmt_name: str, encoding: int) -> None:
    fmt, cache = BY_NAME[fmt_name], BodyCache()
    history = START + rounds(2)
    previous: list[Any] = []
    for step in range(8):
        raw = encodings(body_of(fmt, history))[encoding]
        body = cache.loads(fmt.history_field, fmt.name, raw)
        assert body == orjson.loads(raw) and list(body) == list(orjson.loads(raw))
        assert orjson.dumps(body) == orjson.dumps(orjson.loads(raw))
        items = fmt.history(body)
        if step:
            # The items of the earlier request are the very same objects: nothing read again.
            assert all(a is b for a, b in zip(previous, items)) and len(items) > len(previous)
        previous = items
        history = history + rounds(1, start=10 + step)
    assert cache.reused == 7


@pytest.mark.parametrize("fmt_name", FORMATS)
def test_anything_but_a_grown_history_is_read_whole_with_the_same_result(fmt_name: str) -> None:
    fmt, field = BY_NAME[fmt_name], BY_NAME[fmt_name].history_field
    cache = BodyCache()
    history = START + rounds(3)

    def check(raw: bytes) -> dict[str, Any]:
        body = cache.loads(field, fmt.name, raw)
        assert body == orjson.loads(raw) and list(body) == list(orjson.loads(raw))
        return body

    check(orjson.dumps(body_of(fmt, history)))
    check(orjson.dumps(body_of(fmt, history)))  # a retry: nothing new
    check(orjson.dumps(body_of(fmt, history + rounds(1, 20), temperature=0.5)))  # the part after the history changed
    check(orjson.dumps(body_of(fmt, history[:2] + history[-2:])))  # a compaction
    rewritten = [dict(m) for m in history]
    rewritten[3]["content"] = "edited"
    check(orjson.dumps(body_of(fmt, rewritten)))  # an item edited in place
    check(orjson.dumps(body_of(fmt, START[:1] + [])))  # a history with nothing after the system prompt
    check(orjson.dumps(body_of(fmt, START[:1] + rounds(1))))
    grown = orjson.dumps(body_of(fmt, history))
    # Bytes that only look like a continuation: a repeated key, a value after the history spliced in.
    cut = grown.rindex(b"]")
    for raw in (grown[:cut] + b',1]' + grown[cut + 1:], grown.replace(b'"model":"m"', b'"model":"m","model":"x"'),
                grown[:-1] + b',"' + field.encode() + b'":[]}'):
        try:
            orjson.loads(raw)
        except orjson.JSONDecodeError:
            with pytest.raises(orjson.JSONDecodeError):
                cache.loads(field, fmt.name, raw)
            continue
        check(raw)
    assert cache.loads(field, fmt.name, b"[1,2]") == [1, 2]
    for bad in (grown[:-3], grown[:len(grown) // 2], b"", grown + b"x", grown[:-1] + b"\xff}"):
        with pytest.raises(orjson.JSONDecodeError) as got:
            cache.loads(field, fmt.name, bad)
        with pytest.raises(orjson.JSONDecodeError) as whole:
            orjson.loads(bad)
        assert str(got.value) == str(whole.value)


def test_items_are_items_and_edits_go_to_copies() -> None:
    fmt = BY_NAME["chat"]
    cache = BodyCache()
    raw = orjson.dumps(body_of(fmt, START + rounds(3)))
    first = cache.loads(fmt.history_field, fmt.name, raw)
    assert all(type(i) is Item for i in first["messages"])
    fmt.add_instruction(first, "INSTRUCTION")
    fmt.replace_tool_results(first, {"call_2": "narrowed"})
    again = cache.loads(fmt.history_field, fmt.name, raw)
    assert again == orjson.loads(raw)  # the agent's items, as sent, for the next request
    assert "INSTRUCTION" in first["messages"][0]["content"] and first["messages"][-1]["content"] == "narrowed"
    fmt.replace_tool_results(again, {"call_2": "narrowed"})
    assert again["messages"][-1] is first["messages"][-1]  # the same copy: its bytes are kept on it


@pytest.mark.parametrize("fmt_name", FORMATS)
def test_the_upstream_body_is_written_as_orjson_writes_it(fmt_name: str) -> None:
    fmt, cache = BY_NAME[fmt_name], BodyCache()
    history = START + rounds(70)  # more than two runs of items
    sent: list[tuple[bytes, ...]] = []
    for step in range(6):
        if step == 4:  # back to an earlier, shorter history (a retry): its last run has fewer items than kept
            history = START + rounds(70) + rounds(1, 300)
        body = cache.loads(fmt.history_field, fmt.name, orjson.dumps(body_of(fmt, history, metadata={"x": [1.5]})))
        fmt.add_instruction(body, "INSTRUCTION")
        fmt.insert_notes(body, [(3, "a note")])
        fmt.replace_tool_results(body, {"call_2": "narrowed"})
        assert dumps(body, fmt.history_field) == orjson.dumps(body)
        sent.append(chunks(body, fmt.history_field))
        assert b"".join(sent[-1]) == orjson.dumps(body)
        history += rounds(1, 300 + step)
    # The runs of items the first request sent go again as the very same bytes objects, the first one too: the
    # note in it is the same object on every request, kept on the item it follows, like the instruction's copy.
    assert len(sent[0]) > 4 and all(a is b for a, b in zip(sent[0][1:-2], sent[3][1:-2]))
    deep: Any = []
    for _ in range(260):  # deeper than orjson writes: the standard library writes it
        deep = [deep]
    for value in ({"messages": [{"x": deep}]}, {"messages": [1], "x": deep}):
        with pytest.raises(TypeError):
            orjson.dumps(value)
        assert json.loads(dumps(value, "messages")) == value
    for _ in range(1100 - 260):  # deeper than either writes
        deep = [deep]
    for value in ({"messages": [{"x": deep}]}, {"messages": [1], "x": deep}):
        with pytest.raises(TypeError):
            dumps(value, "messages")
    assert dumps({"messages": "text", "a": 1}, "messages") == orjson.dumps({"messages": "text", "a": 1})


def test_a_history_that_grows_shrinks_or_changes_is_written_as_orjson_writes_it() -> None:
    items = [Item({"role": "user", "content": f"message {n}"}) for n in range(200)]
    other = Item({"role": "user", "content": "another"})
    for history in (items[:70], items[:90], items[:128], items[:130], items[:66], items[:70],
                    items[:67] + [other] + items[68:80], items[:80], items[:3] + [other] + items[4:80]):
        body = {"model": "m", "messages": history}
        assert b"".join(chunks(body, "messages")) == orjson.dumps(body)


# ---- a whole supervised session, cached against whole reads ---------------------------------------------------
PLAN = json.dumps({"decision": "create", "title": "Fix the tests", "tasks": [
    {"title": "Run them", "done_when": "the failures are listed", "valid_if": None},
    {"title": "Fix them", "done_when": "they pass", "valid_if": None}]})


def report(plan: str | None = None) -> str:
    return "<sup>" + json.dumps({"state": "progressing", "focus": "tests", "next": None, "carry": [],
                                 "plan": plan}) + "</sup>"


async def supervisor(messages: list[dict[str, str]]) -> ModelAnswer:
    """The planner gets ``PLAN``; a condenser call keeps lines 1-3 of each result; anything else finds nothing."""
    if messages[0]["content"] == PLANNER_INSTRUCTIONS:
        return ModelAnswer(PLAN)
    try:
        payload = json.loads(messages[1]["content"])
    except (ValueError, IndexError, KeyError):
        payload = None
    if isinstance(payload, dict) and "results" in payload:
        return ModelAnswer(json.dumps({"results": [{"id": r["id"], "verdict": "extract", "lines": ["1-3"]}
                                                   for r in payload["results"]]}))
    return ModelAnswer('{"findings": []}')


async def session(root: Path, fmt: WireFormat, stream: bool) -> list[bytes]:
    """One agent session through a supervised proxy, from a fresh state directory at ``root``: rounds that loop
    (steer notes), a plan request (a recitation), large outputs (condensed) and a compaction; returns the upstream
    bodies."""
    shutil.rmtree(root, ignore_errors=True)
    async with running(Config(), port=0, store=Store(root), scripted={"scripted": ScriptedUpstream()},
                       model=supervisor) as proxy:
        upstream = proxy.scripted["scripted"]
        history = [dict(m) for m in START]
        async with httpx.AsyncClient(timeout=30) as client:
            for n in range(14):
                if n == 10:
                    history = history[:2] + history[-4:]  # the agent compacts its history
                command = "make test" if 3 <= n < 8 else f"ls {n}"  # five identical rounds: the loop fires
                upstream.queue({"text": f"Round {n}. " + report("request" if n == 2 else None),
                                "tool_calls": [{"name": "Bash", "arguments": {"command": command}, "id": f"c{n}"}]})
                body = fmt.request_from_chat(orjson.loads(orjson.dumps(history)), "m", stream, (BASH, READ))
                response = await client.post(f"{proxy.url}/s/bodies{fmt.path}", json=body)
                assert response.status_code == 200, response.text
                output = "\n".join(f"{i:05d} compiling unit_{i}.c ({n})" for i in range(1500)) if n in (1, 9, 12) \
                    else "3 failed" if command == "make test" else f"ok {n}"
                history += [{"role": "assistant", "content": f"Round {n}.", "tool_calls": [
                    {"id": f"c{n}", "type": "function",
                     "function": {"name": "Bash", "arguments": json.dumps({"command": command})}}]},
                            {"role": "tool", "tool_call_id": f"c{n}", "content": output}]
        return [b for _, b, _ in upstream.requests]


@pytest.mark.parametrize(("fmt_name", "stream"), [(f, False) for f in FORMATS] + [("messages", True)],
                         ids=[*FORMATS, "messages-sse"])
async def test_a_supervised_session_sends_the_bytes_of_whole_reads_and_writes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fmt_name: str, stream: bool) -> None:
    fmt = BY_NAME[fmt_name]
    cached = await session(tmp_path / "state", fmt, stream)
    with monkeypatch.context() as whole:
        whole.setattr(BodyCache, "loads", lambda self, field, name, raw: orjson.loads(raw))
        whole.setattr(bodies, "dumps", lambda body, field: orjson.dumps(body))
        expected = await session(tmp_path / "state", fmt, stream)
    assert len(cached) == len(expected) == 14
    for n, (got, want) in enumerate(zip(cached, expected)):
        assert got == want, f"upstream request {n} differs"
    # What the comparison covered: steer notes, the recitation, condensed results, the compaction.
    assert any(note_text(LOOP).replace('"', '\\"').encode() in b for b in cached)
    assert any(b'signal=\\"recite\\"' in b for b in cached)
    assert any(b"full original at " in b for b in cached)
