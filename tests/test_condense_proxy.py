"""Condensing on the supervised path: candidates in every format, one condenser call per round, the same narrowed
bytes on every later request, tool calls and results never separated, failing open, the read-back rule, the
adaptive threshold per session, replay with condense, and the scripted upstream as a condenser."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import trio

from proxyvisor.scripted.upstream import ScriptedUpstream, policy
from proxyvisor.scripted.condenser import answer
from proxyvisor.cli import main
from proxyvisor.proxy.condense_engine import ToolResult, prepare_items
from proxyvisor.condense.protocol import TaskContext, build_messages
from proxyvisor.condense.text import count_tokens
from proxyvisor.config import CondenseConfig, Config, GateConfig, ModelConfig
from proxyvisor.proxy.condensing import RequestCondenser, _scanned, can_read_back, request_condenser
from proxyvisor.proxy.formats.base import Item
from proxyvisor.proxy.formats import BY_NAME, CHAT, MESSAGES, RESPONSES, ToolSpec, WireFormat
from proxyvisor.proxy.server import Request
from proxyvisor.proxy.service import running
from proxyvisor.proxy.sse import SSEParser
from proxyvisor.replay import recorded_turn, replay
from proxyvisor.store import Store
from proxyvisor.supervisor_model import ModelAnswer

FORMATS = ("chat", "messages", "responses")
BASH = ToolSpec("bash", {"type": "object", "properties": {"command": {"type": "string"}}})
READ = ToolSpec("Read", {"type": "object", "properties": {"file_path": {"type": "string"}}})
NO_GATE = Config().with_overrides(supervisor={"gate": GateConfig(enabled=False),
                                              "condense": CondenseConfig(deterministic_kinds=())})
"""These tests count condenser calls; the verify-gate (which would use the same model) is tested elsewhere, and so
is the deterministic condenser that builds (``make``) get by default (tests/test_condense_deterministic.py)."""


def build_log(lines: int = 1500, *, error_at: int = 700, tag: str = "module") -> str:
    rows = [f"[{i:05d}] compiling {tag}_{i}.c -> {tag}_{i}.o ({i * 7 % 1000} ms)" for i in range(lines)]
    rows[error_at] = f"src/widget.c:88:3: error: '{tag}_frob' undeclared (first use in this function)"
    return "\n".join(rows) + "\n"


BIG_A = build_log()
BIG_C = build_log(1200, error_at=40, tag="parser")
SMALL = "total 3\n-rw-r--r-- 1 me me 12 a.txt\n"


def call(call_id: str, name: str, **arguments: Any) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}


TRAJECTORY = [
    {"role": "system", "content": "You are a careful coding agent."},
    {"role": "user", "content": "Why does the widget build fail?"},
    {"role": "assistant", "content": "Let me build it.", "tool_calls": [call("call_a", "bash", command="make")]},
    {"role": "tool", "tool_call_id": "call_a", "content": BIG_A},
    {"role": "assistant", "content": None, "tool_calls": [call("call_b", "bash", command="ls"),
                                                          call("call_c", "Read", file_path="parser.log")]},
    {"role": "tool", "tool_call_id": "call_b", "content": SMALL},
    {"role": "tool", "tool_call_id": "call_c", "content": BIG_C},
    {"role": "assistant", "content": "One more look.", "tool_calls": [call("call_d", "bash", command="cat x")]},
    {"role": "tool", "tool_call_id": "call_d", "content": SMALL},
    {"role": "assistant", "content": "widget.c line 88 uses frob before declaring it."},
]
ROUNDS = [i for i, m in enumerate(TRAJECTORY) if m["role"] == "assistant"]


class Scripted:
    """A condenser double: answers ``reply(payload)`` (by default: extract lines 1-3 of every result), with the
    usage ``usage`` (input tokens, output tokens, cost in USD or None: not priced)."""

    def __init__(self, reply: Any = None, usage: tuple[int, int, float | None] = (0, 0, 0.0)) -> None:
        self.payloads: list[dict[str, Any]] = []
        self.usage = usage
        self.reply = reply or (lambda payload: {"results": [
            {"id": r["id"], "verdict": "extract", "lines": ["1-3"]} for r in payload["results"]]})

    async def __call__(self, messages: list[dict[str, str]]) -> ModelAnswer:
        self.payloads.append(json.loads(messages[1]["content"]))
        return ModelAnswer(json.dumps(self.reply(self.payloads[-1])), *self.usage)


def request(fmt: WireFormat, messages: list[dict[str, Any]], stream: bool = False,
            tools: tuple[ToolSpec, ...] = (BASH, READ)) -> dict[str, Any]:
    """A request carrying ``messages`` (copied: the Chat format would share the dicts, and tests edit bodies)."""
    return fmt.request_from_chat(orjson.loads(orjson.dumps(messages)), "m", stream, tools)


def config_with(**condense: Any) -> Config:
    condense.setdefault("deterministic_kinds", ())
    return NO_GATE.with_overrides(supervisor={"condense": CondenseConfig(**condense)})


async def send(client: httpx.AsyncClient, url: str, fmt: WireFormat, body: dict[str, Any], stream: bool) -> Any:
    response = await client.post(url + fmt.path, json=body)
    assert response.status_code == 200, response.text
    if not stream:
        return fmt.parse_response(response.json())
    return fmt.assemble([(e.event, e.data) for e in SSEParser().feed(response.content)])


async def drive(proxy: Any, fmt: WireFormat, messages: list[dict[str, Any]], session: str, stream: bool = False,
                tools: tuple[ToolSpec, ...] = (BASH, READ)) -> list[dict[str, Any]]:
    """Send the growing history of ``messages`` (one request per assistant message, answered with the recorded
    turn); returns the bodies sent (the agent's copies)."""
    upstream = proxy.scripted["scripted"]
    sent = []
    async with httpx.AsyncClient(timeout=30) as client:
        for index in (i for i, m in enumerate(messages) if m["role"] == "assistant"):
            expected = recorded_turn(messages[index])
            upstream.queue({"text": expected.text, "tool_calls": [
                {"name": c.name, "arguments": c.arguments, "id": c.id} for c in expected.tool_calls]})
            body = request(fmt, messages[:index], stream, tools)
            sent.append(orjson.loads(orjson.dumps(body)))
            got = await send(client, f"{proxy.url}/s/{session}", fmt, body, stream)
            assert (got.text, got.tool_calls) == (expected.text, expected.tool_calls)  # the reply is untouched
    return sent


def outputs(fmt: WireFormat, body: dict[str, Any] | bytes) -> dict[str, str]:
    """Call id to tool result text, as the body carries them."""
    body = orjson.loads(body) if isinstance(body, bytes) else body
    return {o.call_id: o.text for item in fmt.history(body) for o in fmt.message(item).tool_outputs}


def pairing(fmt: WireFormat, body: dict[str, Any] | bytes) -> list[tuple[str, list[str], list[str]]]:
    """The body's tool calls and results in order, item by item (items with neither are left out)."""
    body = orjson.loads(body) if isinstance(body, bytes) else body
    shape = []
    for item in fmt.history(body):
        message = fmt.message(item)
        if message.tool_uses or message.tool_outputs:
            shape.append((message.role, [u.id for u in message.tool_uses], [o.call_id for o in message.tool_outputs]))
    return shape


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("fmt_name", FORMATS)
async def test_each_oversized_result_is_condensed_once_and_carried_identically(
        tmp_path: Path, fmt_name: str, stream: bool) -> None:
    fmt, condenser = BY_NAME[fmt_name], Scripted(usage=(4100, 37, 0.0125))
    async with running(NO_GATE, port=0, store=Store(tmp_path / "state"),
                       scripted={"scripted": ScriptedUpstream()}, model=condenser) as proxy:
        sent = await drive(proxy, fmt, TRAJECTORY, "s1", stream)
        upstream = [body for _, body, _ in proxy.scripted["scripted"].requests]
        records = [r.condense for r in proxy.pipeline.sessions.get("s1").supervision.records]

    # One condenser call per round with an oversized result, showing only that round's new result.
    assert [[r["tool"] for r in p["results"]] for p in condenser.payloads] == [["bash"], ["Read"]]
    assert condenser.payloads[0]["tool_round_intent"] == "Let me build it."
    assert "Why does the widget build fail?" in condenser.payloads[0]["task_context"]
    assert [r.new if r else 0 for r in records] == [0, 1, 1, 0]
    narrowed = {"call_a": outputs(fmt, upstream[1])["call_a"], "call_c": outputs(fmt, upstream[2])["call_c"]}
    for call_id, original in (("call_a", BIG_A), ("call_c", BIG_C)):
        text = narrowed[call_id]
        assert text.startswith(original[:original.index("\n", 120) + 1]) and len(text) < len(original) / 10
        spill = Path(text.rsplit("full original at ", 1)[1].split(" ", 1)[0])
        assert spill.is_relative_to(tmp_path / "state" / "spill") and spill.read_text() == original
    for n, body in enumerate(upstream):
        carried = outputs(fmt, body)
        agent = outputs(fmt, sent[n])
        for call_id, text in carried.items():
            # Later requests carry the identical narrowed bytes; small results go up as the agent sent them.
            assert text == narrowed.get(call_id, agent[call_id])
        assert pairing(fmt, body) == pairing(fmt, sent[n])  # nothing split, dropped or reordered
    assert records[3].saved_tokens == records[2].saved_tokens > records[1].saved_tokens > 0
    assert records[3].applied == 2 and records[3].round == []
    # Each condenser call is counted in its request's ledger line (what /info sums), with its answer's usage.
    ledger = Store(tmp_path / "state").read_ledger("s1")
    assert [line.get("supervisor_model", {}).get("calls") for line in ledger] == [None, {"condense": 1},
                                                                                  {"condense": 1}, None]
    uses = [line["supervisor_model"] for line in ledger if "supervisor_model" in line]
    assert [(u["input_tokens"], u["output_tokens"], u["cost_usd"], u.get("unpriced")) for u in uses] == \
        [(4100, 37, 0.0125, None)] * 2


async def test_decisions_outlive_a_restart_of_the_proxy(tmp_path: Path) -> None:
    condenser, bodies = Scripted(), []
    for messages in (TRAJECTORY[:5], TRAJECTORY):  # the second proxy gets the whole session again
        async with running(NO_GATE, port=0, store=Store(tmp_path / "state"),
                           scripted={"scripted": ScriptedUpstream()}, model=condenser) as proxy:
            await drive(proxy, CHAT, messages, "s1")
            bodies.append(proxy.scripted["scripted"].requests[-1][1])
    assert len(condenser.payloads) == 2  # call_a once (first proxy), call_c once (second proxy)
    assert outputs(CHAT, bodies[1])["call_a"] == outputs(CHAT, bodies[0])["call_a"] != BIG_A


async def test_nothing_is_condensed_for_an_agent_that_cannot_read_a_file_back(tmp_path: Path) -> None:
    condenser = Scripted()
    search = ToolSpec("web_search", {"type": "object", "properties": {"query": {"type": "string"}}})
    async with running(NO_GATE, port=0, store=Store(tmp_path / "state"),
                       scripted={"scripted": ScriptedUpstream()}, model=condenser) as proxy:
        await drive(proxy, CHAT, TRAJECTORY[:5], "s1", tools=(search,))
        upstream = proxy.scripted["scripted"].requests
    assert condenser.payloads == [] and outputs(CHAT, upstream[-1][1])["call_a"] == BIG_A
    assert not (tmp_path / "state" / "spill").exists()


def test_the_read_back_rule_knows_the_agents_tools() -> None:
    schema = {"type": "object", "properties": {"cmd": {"type": "string"}}}
    assert can_read_back([ToolSpec("Bash"), ToolSpec("Read")])  # Claude Code
    assert can_read_back([ToolSpec("exec_command", schema)])  # Codex
    assert can_read_back([ToolSpec("read_file"), ToolSpec("write_file")])  # Gemini CLI
    assert can_read_back([ToolSpec("str_replace_editor")]) and can_read_back([ToolSpec("mytool", schema)])
    assert not can_read_back([])  # aider: no tools at all
    assert not can_read_back([ToolSpec("git", {"properties": {"command": {"type": "string", "enum": ["log"]}}}),
                              ToolSpec("web_search"), ToolSpec("swe_agent_command", {"type": "object"})])


def image_result(fmt: WireFormat) -> dict[str, Any]:
    """A request whose latest (and only) tool result holds an image besides a large text."""
    body = request(fmt, TRAJECTORY[:4])
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
    if fmt is CHAT:
        body["messages"][-1]["content"] = [{"type": "text", "text": BIG_A},
                                           {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}]
    elif fmt is MESSAGES:
        body["messages"][-1]["content"][0]["content"] = [{"type": "text", "text": BIG_A}, image]
    else:
        body["input"][-1]["output"] = [{"type": "input_text", "text": BIG_A},
                                       {"type": "input_image", "image_url": "data:image/png;base64,AA=="}]
    return body


@pytest.mark.parametrize("fmt_name", FORMATS)
async def test_structured_results_and_ambiguous_ids_fail_open(tmp_path: Path, fmt_name: str) -> None:
    fmt, condenser = BY_NAME[fmt_name], Scripted()
    duplicated = [*TRAJECTORY[:4], {"role": "assistant", "content": None, "tool_calls": [call("call_a", "bash")]},
                  {"role": "tool", "tool_call_id": "call_a", "content": BIG_C}]
    async with running(NO_GATE, port=0, store=Store(tmp_path / "state"),
                       scripted={"scripted": ScriptedUpstream()}, model=condenser) as proxy:
        async with httpx.AsyncClient(timeout=30) as client:
            for n, body in enumerate([image_result(fmt), request(fmt, duplicated)]):
                await send(client, f"{proxy.url}/s/s{n}", fmt, body, False)
        upstream = [orjson.loads(body) for _, body, _ in proxy.scripted["scripted"].requests]
    assert condenser.payloads == []
    assert image_result(fmt)["messages" if fmt is not RESPONSES else "input"][-1] == \
        upstream[0]["messages" if fmt is not RESPONSES else "input"][-1]
    assert [o.text for item in fmt.history(upstream[1]) for o in fmt.message(item).tool_outputs] == [BIG_A, BIG_C]


async def test_a_condenser_timeout_leaves_the_round_to_the_deterministic_condenser_for_good(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    calls = []

    async def hangs(messages: list[dict[str, str]]) -> ModelAnswer:
        calls.append(messages)
        await trio.sleep_forever()
        raise AssertionError("unreachable")

    async with running(config_with(timeout_s=0.05), port=0, store=Store(tmp_path / "state"),
                       scripted={"scripted": ScriptedUpstream()}, model=hangs) as proxy:
        with caplog.at_level(logging.WARNING, logger="proxyvisor.condense"):
            await drive(proxy, MESSAGES, TRAJECTORY, "s1", stream=True)
        upstream = proxy.scripted["scripted"].requests
        records = [r.condense for r in proxy.pipeline.sessions.get("s1").supervision.records]
    assert len(calls) == 2  # one per round with an oversized result; neither is retried later
    narrowed = outputs(MESSAGES, upstream[1][1])["call_a"]
    assert narrowed != BIG_A and "src/widget.c:88:3: error: 'module_frob' undeclared" in narrowed
    assert all(outputs(MESSAGES, body)["call_a"] == narrowed for _, body, _ in upstream[1:])  # the same bytes
    assert records[1].failure == "condenser timed out after 0.05 s" and records[1].applied == 1
    assert records[1].round[0].decision.condenser == "deterministic"
    assert "condenser gave nothing usable (condenser timed out after 0.05 s): condensing without a model" \
        in caplog.text


async def test_a_request_cut_off_while_the_condenser_works_has_its_ledger_line(tmp_path: Path) -> None:
    """The client leaves while its request's oversized result is being condensed (a step before forwarding): the
    request's one ledger line says so (499), as for one cut off upstream."""
    called = trio.Event()

    async def hangs(messages: list[dict[str, str]]) -> ModelAnswer:
        called.set()
        await trio.sleep_forever()
        raise AssertionError("unreachable")

    async with running(config_with(timeout_s=60), port=0, store=Store(tmp_path / "state"),
                       scripted={"scripted": ScriptedUpstream()}, model=hangs) as proxy:
        body = orjson.dumps(request(CHAT, TRAJECTORY[:ROUNDS[1]]))
        headers = [(b"content-type", b"application/json"), (b"x-proxyvisor-session", b"cut")]
        async with trio.open_nursery() as nursery:
            nursery.start_soon(proxy.pipeline, Request("POST", CHAT.path, headers, body, time.perf_counter()))
            with trio.fail_after(10):
                await called.wait()
            nursery.cancel_scope.cancel()  # the client leaves
        lines = proxy.pipeline.store.read_ledger("cut")
        assert not proxy.scripted["scripted"].requests
    assert [(line["status"], line["error"]) for line in lines] == [(499, "cancelled before the answer: the client left")]


async def test_a_result_the_proxy_first_sees_in_an_earlier_round_is_never_condensed(tmp_path: Path) -> None:
    condenser = Scripted()
    async with running(NO_GATE, port=0, store=Store(tmp_path / "state"),
                       scripted={"scripted": ScriptedUpstream()}, model=condenser) as proxy:
        async with httpx.AsyncClient(timeout=30) as client:
            # The proxy's first request of this session already holds two rounds (a restart, a resumed session):
            # call_a may have gone upstream whole before, so only the latest round's call_c is a candidate.
            body = request(CHAT, TRAJECTORY[:7])
            await send(client, f"{proxy.url}/s/s1", CHAT, body, False)
        (_, upstream, _), = proxy.scripted["scripted"].requests
    assert [[r["tool"] for r in p["results"]] for p in condenser.payloads] == [["Read"]]
    carried = outputs(CHAT, upstream)
    assert carried["call_a"] == BIG_A and carried["call_c"] != BIG_C


async def test_the_adaptive_threshold_is_learned_per_session(tmp_path: Path) -> None:
    mid = build_log(255, error_at=3)
    async with running(config_with(adaptive=True), port=0, store=Store(tmp_path / "state"),
                       scripted={"scripted": ScriptedUpstream()}, model=Scripted()) as proxy:
        await drive(proxy, CHAT, TRAJECTORY[:5], "a")  # condensed with a large saving: session a lowers its bar
        engine = proxy.pipeline.supervisor.condenser.engine
        learned, fresh = engine.adaptive.for_session("a", 5000, ""), engine.adaptive.for_session("b", 5000, "")
        assert learned.threshold < count_tokens(mid) <= 5000 == fresh.threshold
        mid_round = [{"role": "assistant", "content": None, "tool_calls": [call("call_m", "bash")]},
                     {"role": "tool", "tool_call_id": "call_m", "content": mid}, {"role": "assistant", "content": "ok"}]
        await drive(proxy, CHAT, [*TRAJECTORY[:4], *mid_round], "a")
        await drive(proxy, CHAT, [*TRAJECTORY[:2], *mid_round], "b")
        upstream = [body for _, body, _ in proxy.scripted["scripted"].requests]
    assert outputs(CHAT, upstream[4])["call_m"] != mid  # session a: condensed
    assert outputs(CHAT, upstream[6])["call_m"] == mid  # session b: below its (baseline) threshold


@pytest.mark.parametrize("fmt_name", FORMATS)
def test_replace_tool_results_changes_only_the_named_texts(fmt_name: str) -> None:
    fmt = BY_NAME[fmt_name]
    body = request(fmt, TRAJECTORY[:7])
    before = orjson.loads(orjson.dumps(body))
    assert fmt.replace_tool_results(body, {"call_c": "narrowed", "call_zzz": "x"}) == {"call_c"}
    assert outputs(fmt, body) == {**outputs(fmt, before), "call_c": "narrowed"}
    assert pairing(fmt, body) == pairing(fmt, before)
    # A list of text parts becomes one part, the last one, keeping its other keys (a cache breakpoint).
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b", "cache_control": {"type": "ephemeral"}}]
    if fmt is MESSAGES:
        body["messages"][-1]["content"][-1]["content"] = parts
        fmt.replace_tool_results(body, {"call_c": "n2"})
        assert body["messages"][-1]["content"][-1]["content"] == [{**parts[1], "text": "n2"}]
    image = image_result(fmt)
    assert fmt.replace_tool_results(image, {"call_a": "x"}) == set() and outputs(fmt, image)["call_a"].startswith(
        BIG_A)


@pytest.mark.parametrize("fmt_name", FORMATS)
def test_replacing_in_a_growing_history_reads_its_new_items_and_writes_what_a_whole_read_writes(
        fmt_name: str) -> None:
    fmt = BY_NAME[fmt_name]
    whole = request(fmt, TRAJECTORY)
    shared = [Item(i) for i in fmt.history(whole)]  # as the body cache hands them to the requests that repeat them

    def replaced(history: list[Any], texts: dict[str, str]) -> tuple[set[str], bytes]:
        body = {**whole, fmt.history_field: history}
        done = fmt.replace_tool_results(body, texts)
        return done, orjson.dumps(body)

    texts = {"call_a": "narrowed a"}
    for n in range(1, len(shared) + 1):
        if n > len(shared) // 2:
            texts["call_c"] = "narrowed c"  # a decision made on a later request
        plain = orjson.loads(orjson.dumps(shared[:n]))  # read whole: no Item to keep anything on
        assert replaced(shared[:n], texts) == replaced(plain, texts)
    # Only the last item keeps where the results are (the earlier ones gave it up as the history grew).
    assert [n for n, i in enumerate(shared) if "results_at" in i.derived] == [len(shared) - 1]
    # A history whose start changed (an item in place of another, the rest shared) is read whole.
    rewritten = [Item({**dict(i), "x": 1}) if n == 0 else i for n, i in enumerate(shared)]
    assert replaced(rewritten, texts) == replaced(orjson.loads(orjson.dumps(rewritten)), texts)


async def test_replay_shows_per_round_what_was_condensed(tmp_path: Path) -> None:
    rounds = await replay(NO_GATE, TRAJECTORY, RESPONSES, True, store=Store(tmp_path), model=Scripted())
    assert all(r.matches for r in rounds)
    assert [[c["tool"] for c in r.condensed] for r in rounds] == [[], ["bash"], ["Read"], []]
    first = rounds[1].condensed[0]
    assert first["reason"] == "condensed" and first["tokens_after"] < first["tokens_before"] / 10
    assert Path(first["spill_path"]).read_text() == BIG_A and "text" not in first
    assert [r.condense_new for r in rounds] == [0, 1, 1, 0]
    assert rounds[3].condense_saved_tokens == rounds[2].condense_saved_tokens > rounds[1].condense_saved_tokens > 0


def test_replay_command_condenses_with_the_scripted_upstream(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(m) + "\n" for m in TRAJECTORY))
    assert main(["replay", "--condense", "--json", "--state-dir", str(tmp_path / "state"), str(path)]) == 0
    rounds = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [len(r["condensed"]) for r in rounds] == [0, 1, 1, 0]
    for r in rounds[1:3]:
        (c,) = r["condensed"]
        assert c["reason"] == "condensed" and c["condenser"] == "deterministic" and Path(c["spill_path"]).is_file()
        assert c["tokens_after"] <= CondenseConfig().budget_tokens < c["tokens_before"]
    assert main(["replay", "--condense", "--state-dir", str(tmp_path / "state"), str(path)]) == 0
    text = capsys.readouterr().out
    assert f"condensed bash {count_tokens(BIG_A):,} -> " in text and "condensed 2 tool results" in text


def test_the_scripted_upstream_answers_condenser_requests_with_no_verdict() -> None:
    result = ToolResult("c1", "bash", BIG_A, arguments=json.dumps({"command": "grep -n frob src/widget.c"}))
    context = TaskContext(request="Why does the build fail?", intent="Looking for frob.")
    items = prepare_items([(result, count_tokens(BIG_A))], context, 32_000)
    body = {"model": "m", "messages": build_messages(context, items)}
    assert policy(CHAT, body) is answer
    assert json.loads(answer(CHAT, body)) == {"results": []}  # the deterministic condenser decides
    assert policy(CHAT, request(CHAT, TRAJECTORY[:4])) is None


async def test_the_scripted_upstream_prefers_a_queued_condense_answer(tmp_path: Path) -> None:
    upstream = ScriptedUpstream([{"condense": {"results": [{"id": "r1", "verdict": "keep"}]}}, {"text": "a turn"}])
    context, result = TaskContext(), ToolResult("c1", "bash", BIG_A)
    body = {"model": "m", "messages": build_messages(context, prepare_items([(result, 30_000)], context, 1000))}
    config = Config().with_overrides(supervisor={"model": ModelConfig(name="openai/x", api_base="scripted:")})
    async with running(config, port=0, store=Store(tmp_path), scripted={"scripted": upstream}) as proxy, \
            httpx.AsyncClient(timeout=30) as client:
        base = proxy.scripted_urls["scripted"]
        queued = (await client.post(base + CHAT.path, json=body)).json()
        policy = (await client.post(base + CHAT.path, json=body)).json()
        turn = (await client.post(base + CHAT.path, json={"model": "m", "messages": [
            {"role": "user", "content": "hi"}]})).json()
    assert json.loads(CHAT.parse_response(queued).text) == {"results": [{"id": "r1", "verdict": "keep"}]}
    assert json.loads(CHAT.parse_response(policy).text) == {"results": []}
    assert CHAT.parse_response(turn).text == "a turn" and len(upstream.condenser_requests) == 2


def test_a_scan_goes_on_from_the_last_request_and_a_branch_reads_its_history_again() -> None:
    """Condensing's scan of a history goes on from the one kept on the last request's last item; a request that
    branches off an earlier item (a retried round answered differently) finds no scan that matches there and
    reads its history whole, so it sees its own calls and results, not the other branch's."""
    def call(n: int) -> list[dict[str, Any]]:
        return [{"role": "assistant", "content": None, "tool_calls": [
                    {"id": f"c{n}", "type": "function", "function": {"name": "Bash",
                                                                    "arguments": f'{{"command":"make t{n}"}}'}}]},
                {"role": "tool", "tool_call_id": f"c{n}", "content": f"line {n}\n" * 200}]

    start = [{"role": "system", "content": "s"}, {"role": "user", "content": "fix it"}, *call(1)]
    first = [Item(m) for m in start]
    extended = first + [Item(m) for m in call(2)]
    branch = first + [Item(m) for m in call(3)]

    def seen(scan: Any) -> tuple[Any, ...]:
        return (scan.index, sorted(scan.uses), dict(scan.ids), [r[:2] for r in scan.results], scan.commands,
                [r.call_id for r in scan.found])

    kept = _scanned(CHAT, first)
    assert _scanned(CHAT, extended) is kept
    assert seen(kept) == seen(_scanned(CHAT, [Item(m) for m in start + call(2)]))
    assert seen(_scanned(CHAT, branch)) == seen(_scanned(CHAT, [Item(m) for m in start + call(3)]))
    assert seen(_scanned(CHAT, extended)) == seen(_scanned(CHAT, [Item(m) for m in start + call(2)]))


def test_candidates_read_from_the_new_items_are_those_of_a_whole_read(tmp_path: Path) -> None:
    """Collecting goes on from the last request's scan; at every request of a growing history its latest and
    earlier results are those a read of the whole history gives, also once a later call reuses an earlier
    result's call id (that result then has no candidate any more, and the scan is read one result at a time)."""
    condenser = request_condenser(NO_GATE.supervisor, tmp_path)
    assert isinstance(condenser, RequestCondenser)
    rounds = [[{"role": "assistant", "content": f"step {n}", "tool_calls": [call(f"c{n % 4 if n >= 6 else n}", "bash",
                                                                                command=f"make t{n % 3}")]},
               {"role": "tool", "tool_call_id": f"c{n % 4 if n >= 6 else n}", "content": build_log(300 + n, error_at=n)}]
              for n in range(9)]
    history: list[Any] = [Item(m) for m in TRAJECTORY[:2]]

    def candidates(items: list[Any]) -> tuple[Any, ...]:
        pending = condenser.collect(CHAT, items, [BASH], CHAT.fingerprint_parts({"messages": items}))
        assert pending is not None
        return pending.latest, pending.earlier, pending.context

    for n, messages in enumerate(rounds):
        history = history + [Item(m) for m in messages]
        latest, earlier, context = candidates(history)
        assert (latest, earlier, context) == candidates([dict(item) for item in history])
        if n == 5:
            assert ([r.call_id for r in latest], [r.call_id for r in earlier]) == (["c5"], ["c0", "c1", "c2", "c3", "c4"])
        if n == 6:  # c2 answered twice: neither result is a candidate
            assert ([r.call_id for r in latest], [r.call_id for r in earlier]) == ([], ["c0", "c1", "c3", "c4", "c5"])
