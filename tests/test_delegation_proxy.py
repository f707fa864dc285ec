"""Delegation through the proxy: the model calls a role's tool, proxyvisor runs the child and continues the turn,
the agent sees only the continued answer (every format, JSON and streams), later requests get the delegation back
at the same place, and with either gate off nothing of it exists."""

from __future__ import annotations

import dataclasses
import io
import re
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import msgspec
import orjson
import pytest
import trio
from rich.console import Console

from proxyvisor.scripted.upstream import ScriptedUpstream, turn_of
from proxyvisor.scripted.runtime import ScriptedRuntime
from proxyvisor.config import Config, GateConfig, SupervisorConfig, UpstreamConfig
from proxyvisor.demo_delegation import run_delegating_agent
from proxyvisor.proxy import continuation
from proxyvisor.proxy.delegation import ROUNDS
from proxyvisor.cli import main
from proxyvisor.proxy.formats import BY_NAME, CHAT, ToolSpec
from proxyvisor.proxy.info import render_text, summarize
from proxyvisor.transcript import fingerprint
from proxyvisor.proxy.server import Request
from proxyvisor.proxy.service import RunningProxy, running
from proxyvisor.proxy.sessions import Session
from proxyvisor.proxy.supervise import Delegated, Note, Supervisor
from proxyvisor.store import Store

from helpers import (FORMATS, MODEL, ask, assert_ends_with_error_event, assert_error_shape, files_under,
                     http_client, json_events, raw_stream, request_body, sse_events, without_generated_ids)
from routing_support import routing_config

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = f"00-{TRACE}-00f067aa0ba902b7-01"
REVIEWER = {"reviewer": {"adapter": "scripted", "description": "Reviews code and says what is wrong."}}
CALL = {"text": "Let me ask the reviewer.",
        "tool_calls": [{"name": "reviewer", "arguments": {"prompt": "Review app.py for bugs."}, "id": "call_rev_1"}]}
FINAL = {"text": "The reviewer found nothing wrong with app.py."}
CHILD = {"text": "app.py looks correct to me."}
BASH = ToolSpec("Bash", {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]})


def proxy_config(roles: dict[str, Any] | None = REVIEWER, supervised: bool = True, **routing: Any) -> Config:
    config = routing_config(roles, **routing)
    config = msgspec.structs.replace(config, upstreams=(UpstreamConfig(name="scripted"),))
    return config.with_overrides(supervisor={"enabled": supervised})


ONCE = proxy_config(children={"attempts": 1})
"""No retry of a hand-off: the breaker's own behaviour, one child run per delegation."""


@dataclasses.dataclass
class Setup:
    proxy: RunningProxy
    parent: ScriptedUpstream
    child: ScriptedUpstream
    store: Store

    def ledger(self) -> list[dict[str, Any]]:
        return [r for s in self.store.sessions() for r in self.store.read_ledger(s)]


@asynccontextmanager
async def delegating(state: Path, parent: list[dict[str, Any]], child: list[dict[str, Any]] | None = None,
                     config: Config | None = None) -> AsyncIterator[Setup]:
    """A supervised proxy with the ``reviewer`` role on the scripted adapter: the parent model plays ``parent``,
    the child's model ``child`` (both recording what they receive)."""
    upstream, child_model = ScriptedUpstream(parent), ScriptedUpstream(child or [])
    store = Store(state)
    async with running(config or proxy_config(), port=0, store=store, scripted={"scripted": upstream}) as rp:
        if rp.pipeline.delegation is not None:
            delegator = rp.pipeline.delegation.delegator
            delegator._runtimes["scripted"] = ScriptedRuntime(delegator.registry.get("scripted"), {},
                                                              upstream=child_model)
        yield Setup(rp, upstream, child_model, store)


def sent(upstream: ScriptedUpstream, index: int = -1) -> dict[str, Any]:
    return orjson.loads(upstream.requests[index][1])


def messages(fmt: str, body: dict[str, Any]) -> list[Any]:
    f = BY_NAME[fmt]
    return [f.message(item) for item in f.history(body)]


# ---- the delegated turn -------------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("fmt", FORMATS)
async def test_the_agent_sees_only_the_continued_answer(fmt: str, stream: bool, tmp_path: Path) -> None:
    async with delegating(tmp_path / "state", [CALL, FINAL], [CHILD]) as s:
        answer = await ask(fmt, s.proxy.url, stream=stream, headers={"traceparent": PARENT})
    # The SDK's own stream accumulator checked the spliced event grammar while it built this answer.
    assert answer.tool_calls == ()
    # A stream already showed the text before the held call; a JSON reply is the continuation's alone.
    assert answer.text == (CALL["text"] + ("\n\n" if fmt == "chat" else "") if stream else "") + FINAL["text"]
    first, continued = sent(s.parent, 0), sent(s.parent, 1)
    offered = {t.name for t in BY_NAME[fmt].tools(first)}
    assert offered == {"Bash", "reviewer"}
    # The continuation is the first request with the model's call and the child's result appended, nothing else.
    key = BY_NAME[fmt].history_field
    assert {k: v for k, v in continued.items() if k != key} == {k: v for k, v in first.items() if k != key}
    n = len(first[key])
    assert continued[key][:n] == first[key]
    *reply, result = messages(fmt, continued)[n:]  # Responses: a message item, then a function_call item
    assert {m.role for m in reply} == {"assistant"} and "".join(m.text for m in reply) == CALL["text"]
    assert [(u.id, u.name, u.arguments) for m in reply for u in m.tool_uses] == [
        ("call_rev_1", "reviewer", {"prompt": "Review app.py for bugs."})]
    assert result.role == "tool" and [(o.call_id, o.text) for o in result.tool_outputs] == [
        ("call_rev_1", CHILD["text"])]
    # The child got the prompt and nothing of the parent's conversation, in the parent's trace.
    (child_request,) = s.child.requests
    assert orjson.loads(child_request[1])["messages"] == [{"role": "user", "content": "Review app.py for bugs."}]
    assert child_request[2]["traceparent"].split("-")[1] == TRACE
    (record,) = s.ledger()
    (delegation,) = record["delegations"]
    assert {k: delegation[k] for k in ("role", "status", "gen_ai.provider.name", "gen_ai.agent.id",
                                       "gen_ai.request.model", "capacity_scope", "health_state", "health_probe",
                                       "error_category", "trace_id")} == {
        "role": "reviewer", "status": "ok", "gen_ai.provider.name": "scripted", "gen_ai.agent.id": "reviewer",
        "gen_ai.request.model": "scripted-model", "capacity_scope": "scripted:scripted", "health_state": "healthy",
        "health_probe": False, "error_category": None, "trace_id": TRACE}
    assert record["status"] == 200 and "error" not in record


def agent_request(fmt: str, history: list[dict[str, Any]], stream: bool) -> dict[str, Any]:
    return BY_NAME[fmt].request_from_chat([{"role": "system", "content": "You are a coding agent."}] + history,
                                          MODEL, stream, (BASH,))


async def agent_turn(url: str, fmt: str, history: list[dict[str, Any]], stream: bool,
                     headers: dict[str, str] | None = None) -> tuple[int, Any]:
    """Send the agent's request; (status, the assistant turn it read)."""
    response, data = await raw_stream(url + "/s/agent", fmt, agent_request(fmt, history, stream), headers)
    if response.status_code != 200:
        return response.status_code, data
    f = BY_NAME[fmt]
    if stream:
        return 200, f.assemble([(e, d if isinstance(d, str) else orjson.dumps(d).decode())
                                for e, d in json_events(data)])
    return 200, f.parse_response(orjson.loads(data))


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("fmt", FORMATS)
async def test_later_requests_get_the_delegation_back_so_the_upstream_prefix_stays_stable(
        fmt: str, stream: bool, tmp_path: Path) -> None:
    later = [{"text": "Next I will run the tests.", "tool_calls": [{"name": "Bash", "arguments":
                                                                     {"command": "pytest"}, "id": "call_b_2"}]},
             {"text": "All tests pass."}]
    async with delegating(tmp_path / "state", [CALL, FINAL] + later, [CHILD]) as s:
        history: list[dict[str, Any]] = [{"role": "user", "content": "Is app.py right?"}]
        status, turn = await agent_turn(s.proxy.url, fmt, history, stream)
        assert status == 200 and not turn.tool_calls
        history += [{"role": "assistant", "content": turn.text}, {"role": "user", "content": "Now test it."}]
        status, turn = await agent_turn(s.proxy.url, fmt, history, stream)
        assert status == 200 and [c.name for c in turn.tool_calls] == ["Bash"]
        history += [{"role": "assistant", "content": turn.text, "tool_calls": [
            {"id": turn.tool_calls[0].id, "type": "function",
             "function": {"name": "Bash", "arguments": orjson.dumps(turn.tool_calls[0].arguments).decode()}}]},
                    {"role": "tool", "tool_call_id": turn.tool_calls[0].id, "content": "3 passed"}]
        status, turn = await agent_turn(s.proxy.url, fmt, history, stream)
        assert status == 200 and turn.text == "All tests pass."
    key = BY_NAME[fmt].history_field
    bodies = [sent(s.parent, i) for i in range(4)]
    assert len(s.parent.requests) == 4 and len(s.child.requests) == 1
    # Each upstream request starts with the whole of the one before: the delegation the agent never saw is put
    # back right after the user message it answered, before the agent's own copy of the answer.
    for before, after in zip(bodies[1:], bodies[2:], strict=False):
        assert orjson.dumps(after[key][:len(before[key])]) == orjson.dumps(before[key])
    assert [o.call_id for m in messages(fmt, bodies[3]) for o in m.tool_outputs] == ["call_rev_1", "call_b_2"]


async def test_a_retry_or_a_rewritten_history_does_not_get_it_back(tmp_path: Path) -> None:
    steps = [{"text": "Hello."}, CALL, FINAL, {"text": "again"}, {"text": "fresh"}]
    async with delegating(tmp_path / "state", steps, [CHILD]) as s:
        history: list[dict[str, Any]] = [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello."},
                                         {"role": "user", "content": "Is app.py right?"}]
        assert (await agent_turn(s.proxy.url, "chat", history[:1], False))[0] == 200
        assert (await agent_turn(s.proxy.url, "chat", history, False))[0] == 200
        thread = next(iter(s.proxy.pipeline.sessions.get("agent").supervision.threads.values()))
        assert [d.index for d in thread.delegated] == [3]  # after the system prompt and three messages
        # The same request again (the agent retried): nothing follows the delegation's place, nothing goes back.
        assert (await agent_turn(s.proxy.url, "chat", history, False))[0] == 200
        assert len(messages("chat", sent(s.parent))) == 4
        # The question at that place was replaced (a rewritten history): the delegation is forgotten.
        rewritten = history[:2] + [{"role": "user", "content": "Is lib.py right?"},
                                   {"role": "assistant", "content": "x"}, {"role": "user", "content": "go on"}]
        assert (await agent_turn(s.proxy.url, "chat", rewritten, False))[0] == 200
        assert [m.role for m in messages("chat", sent(s.parent))] == ["system", "user", "assistant", "user",
                                                                       "assistant", "user"]
        assert thread.delegated == []


@pytest.mark.parametrize("fmt", FORMATS)
async def test_calls_streamed_before_the_held_call_stay_and_the_continuation_follows_them(fmt: str,
                                                                                           tmp_path: Path) -> None:
    both = {"text": "Two things at once.",
            "tool_calls": [{"name": "Bash", "arguments": {"command": "ls"}, "id": "call_ls"}] + CALL["tool_calls"]}
    then = {"text": "And the tests.", "tool_calls": [{"name": "Bash", "arguments": {"command": "pytest"},
                                                      "id": "call_pytest"}]}
    async with delegating(tmp_path / "state", [both, then], [CHILD]) as s:
        answer = await ask(fmt, s.proxy.url, stream=True)
    # Positions of the continuation's call are shifted past the call the agent already has.
    assert [(c[0], c[1], c[2]) for c in answer.tool_calls] == [("call_ls", "Bash", {"command": "ls"}),
                                                               ("call_pytest", "Bash", {"command": "pytest"})]
    # What the upstream saw: the model's response with its delegation call only (the model calls Bash again).
    n = len(BY_NAME[fmt].history(sent(s.parent, 0)))
    assert [u.name for m in messages(fmt, sent(s.parent, 1))[n:-1] for u in m.tool_uses] == ["reviewer"]


async def test_an_ordinary_tool_round_streams_through_unbuffered(tmp_path: Path) -> None:
    """The upstream stalls inside a Bash call; the agent has its start while the upstream still hangs."""
    async with delegating(tmp_path / "state", [{"fault": {"stall_after_events": 11}}]) as s:
        body = orjson.dumps(request_body("messages", stream=True))
        async with http_client() as client, client.stream("POST", s.proxy.url + "/v1/messages", content=body,
                                                          headers={"content-type": "application/json"}) as r:
            got = b""
            with trio.fail_after(10):
                async for chunk in r.aiter_raw():
                    got += chunk
                    if b'"partial_json"' in got:
                        break
    assert b'"type":"tool_use"' in got and b'"name":"Bash"' in got


async def test_parallel_delegation_calls_run_together_under_one_budget(tmp_path: Path) -> None:
    two = {"tool_calls": [{"name": "reviewer", "arguments": {"prompt": "first"}, "id": "call_1"},
                          {"name": "reviewer", "arguments": {"prompt": "second"}, "id": "call_2"}]}
    async with delegating(tmp_path / "state", [two, FINAL], [{"text": "one"}, {"text": "two"}]) as s:
        answer = await ask("messages", s.proxy.url, stream=False)
    assert answer.text == FINAL["text"]
    results = messages("messages", sent(s.parent, 1))[-1].tool_outputs
    assert [o.call_id for o in results] == ["call_1", "call_2"]
    assert sorted(o.text for o in results) == ["one", "two"]
    assert [d["status"] for d in s.ledger()[0]["delegations"]] == ["ok", "ok"]


# ---- failures ---------------------------------------------------------------------------------------------


async def test_a_rate_limited_child_is_an_error_result_its_pool_cools_and_the_next_call_is_refused(
        tmp_path: Path) -> None:
    limited = {"fault": {"status": 429, "retry_after": "30", "message": "rate limit exceeded"}}
    async with delegating(tmp_path / "state", [CALL, FINAL, CALL, FINAL], [limited, CHILD], ONCE) as s:
        for _ in range(2):
            answer = await ask("messages", s.proxy.url, stream=True)
            assert answer.text.endswith(FINAL["text"]) and answer.tool_calls == ()
        pool = s.proxy.pipeline.delegation.delegator.health.get("scripted:scripted")
    assert len(s.child.requests) == 1, "the cooling pool got no second request"
    first, second = (messages("messages", sent(s.parent, i))[-1].tool_outputs[0] for i in (1, 3))
    assert first.is_error and "capacity" in first.text and "retry after 30 s" in first.text
    assert second.is_error and "cooling_down" in second.text
    (one,), (two,) = (r["delegations"] for r in s.ledger())
    assert (one["status"], one["error_category"], one["retry_after_s"]) == ("failed", "capacity", 30)
    assert (two["status"], two["error_category"], two["health_state"]) == ("refused", "capacity", "cooling_down")
    assert pool.state == "cooling_down" and pool.failure_count == 1


QUICK_RETRY = proxy_config(children={"retry_backoff_s": 0.05})
"""Retries a test can wait for: the backoff starts at 50 ms (1 s by default)."""


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("fmt", FORMATS)
async def test_a_child_failing_429_then_answering_is_retried_and_the_parent_gets_its_result(
        fmt: str, stream: bool, tmp_path: Path) -> None:
    limited = {"fault": {"status": 429, "retry_after": "1", "message": "rate limit exceeded"}}
    async with delegating(tmp_path / "state", [CALL, FINAL], [limited, CHILD], QUICK_RETRY) as s:
        answer = await ask(fmt, s.proxy.url, stream=stream)
    assert answer.tool_calls == () and answer.text.endswith(FINAL["text"])
    assert len(s.child.requests) == 2
    (result,) = messages(fmt, sent(s.parent, 1))[-1].tool_outputs
    assert (result.call_id, result.text) == ("call_rev_1", CHILD["text"]) and not result.is_error
    (record,) = s.ledger()
    (delegation,) = record["delegations"]
    assert delegation["status"] == "ok" and delegation["dead_letter"] is None
    assert [(a["attempt"], a["outcome"], a.get("error_category"), a["health_probe"])
            for a in delegation["attempts"]] == [(1, "failed", "capacity", False), (2, "answered", None, True)]
    info = summarize(s.ledger())["delegations"]
    assert {k: info[k] for k in ("runs", "child_runs", "retries", "dead_letters")} == {
        "runs": 1, "child_runs": 2, "retries": 1, "dead_letters": 0}


@pytest.mark.parametrize("fmt", FORMATS)
async def test_a_child_failing_past_the_bound_is_a_dead_letter_the_parents_error_names(
        fmt: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    overloaded = {"fault": {"status": 529, "message": "Overloaded"}}
    async with delegating(tmp_path / "state", [CALL, FINAL], [overloaded] * 3, QUICK_RETRY) as s:
        answer = await ask(fmt, s.proxy.url, stream=True)
    assert answer.tool_calls == () and answer.text.endswith(FINAL["text"])
    assert len(s.child.requests) == 3
    (delegation,) = s.ledger()[0]["delegations"]
    letter = delegation["dead_letter"]
    assert delegation["status"] == "failed" and re.fullmatch(r"dl_[0-9a-f]{20}", letter)
    # The parent model got the error as a tool result in its own format, naming the dead letter.
    (result,) = messages(fmt, sent(s.parent, 1))[-1].tool_outputs
    assert result.call_id == "call_rev_1" and result.text.startswith("Tool 'reviewer' failed: provider: HTTP 529")
    assert f"gave up: 3 attempts failed; dead letter {letter}" in result.text
    assert fmt != "messages" or result.is_error, "only Messages has an error flag on a tool result"
    info = summarize(s.ledger())
    assert (info["delegations"]["dead_letters"], info["delegations"]["recent_dead_letters"]) == (1, [letter])
    assert info["delegations"]["retries"] == 2 and f"dead letters 1 (last: {letter})" in render_text(info)
    # `proxyvisor delegate --dead-letters` lists it, as text and as JSON.
    assert main(["delegate", "--dead-letters", "--state-dir", str(tmp_path / "state")]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{letter}  ") and "role reviewer on scripted:scripted: 3 attempts failed" in out
    assert "last failure: provider: HTTP 529: Overloaded" in out and "Review app.py for bugs." in out
    assert main(["delegate", "--dead-letters", "--json", "--state-dir", str(tmp_path / "state")]) == 0
    (listed,) = orjson.loads(capsys.readouterr().out)["dead_letters"]
    assert (listed["id"], listed["prompt"], len(listed["attempts"])) == (letter, "Review app.py for bugs.", 3)
    assert listed["trace_id"] == delegation["trace_id"]


async def test_a_child_stream_reset_after_output_is_not_retried(tmp_path: Path) -> None:
    reset = {"text": "app.py has a bug in", "fault": {"reset_after_events": 2}}
    async with delegating(tmp_path / "state", [CALL, FINAL], [reset, CHILD], QUICK_RETRY) as s:
        await ask("messages", s.proxy.url, stream=False)
    assert len(s.child.requests) == 1
    (delegation,) = s.ledger()[0]["delegations"]
    assert (delegation["status"], delegation["dead_letter"], len(delegation["attempts"])) == ("failed", None, 1)


@pytest.mark.parametrize("fault", [{"status": 400}, {"status": 401}], ids=["400", "401"])
async def test_a_child_failing_400_or_401_is_not_retried(fault: dict[str, Any], tmp_path: Path) -> None:
    async with delegating(tmp_path / "state", [CALL, FINAL], [{"fault": fault}, CHILD], QUICK_RETRY) as s:
        await ask("chat", s.proxy.url, stream=False)
    assert len(s.child.requests) == 1
    (delegation,) = s.ledger()[0]["delegations"]
    assert (delegation["status"], delegation["dead_letter"], len(delegation["attempts"])) == ("failed", None, 1)


async def test_an_invalid_call_is_an_error_result_and_runs_nothing(tmp_path: Path) -> None:
    bad = {"tool_calls": [{"name": "reviewer", "arguments": {"task": "no prompt"}, "id": "call_bad"}]}
    async with delegating(tmp_path / "state", [bad, FINAL], [CHILD]) as s:
        assert (await ask("chat", s.proxy.url, stream=False)).text == FINAL["text"]
    result = messages("chat", sent(s.parent, 1))[-1].tool_outputs[0]
    assert "Tool 'reviewer' failed: invalid" in result.text and s.child.requests == []


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("fmt", FORMATS)
async def test_a_failing_continuation_reaches_the_agent_as_an_error_in_its_format(fmt: str, stream: bool,
                                                                                tmp_path: Path) -> None:
    async with delegating(tmp_path / "state", [CALL, {"fault": {"status": 529}}], [CHILD]) as s:
        response, data = await raw_stream(s.proxy.url, fmt, request_body(fmt, stream=stream))
    if stream:
        assert response.status_code == 200
        assert_ends_with_error_event(fmt, data)
        assert b"call_rev_1" not in data, "the delegation call never reaches the agent"
    else:
        assert response.status_code == 529
        assert_error_shape(fmt, 529, data)
    assert s.ledger()[0]["delegations"][0]["status"] == "ok"


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_a_model_that_keeps_delegating_is_stopped_after_the_round_limit(stream: bool, tmp_path: Path) -> None:
    forever = {**CALL, "until": "never-in-any-request"}
    async with delegating(tmp_path / "state", [forever], [CHILD] * (ROUNDS + 1)) as s:
        response, data = await raw_stream(s.proxy.url, "chat", request_body("chat", stream=stream))
    assert len(s.child.requests) == ROUNDS and len(s.parent.requests) == ROUNDS + 1
    if stream:
        assert_ends_with_error_event("chat", data)
    else:
        assert response.status_code == 502 and b"rounds" in data
    assert b"call_rev_1" not in data, "a delegation call never reaches the agent"


# ---- keep-alives and cancellation ---------------------------------------------------------------------------


class GatedRuntime:
    """A child runtime that answers only once ``release`` is set, and notes whether it was cancelled."""

    def __init__(self, descriptor: Any) -> None:
        self.descriptor = descriptor
        self.started = trio.Event()
        self.release = trio.Event()
        self.cancelled = False

    def readiness(self) -> None:
        return None

    def normalise(self, error: Any, now: float) -> Any:
        raise AssertionError("not used")

    async def run(self, job: Any, progress: Any) -> None:
        self.started.set()
        try:
            await self.release.wait()
        except trio.Cancelled:
            self.cancelled = True
            raise
        progress.finish("released")


@pytest.mark.parametrize("gate", [GateConfig(enabled=False), GateConfig(hold="stop"), GateConfig(hold="answer")],
                         ids=["gate-off", "hold-stop", "hold-answer"])
async def test_a_stream_waiting_on_a_child_gets_keepalives_and_then_the_answer(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, gate: GateConfig) -> None:
    monkeypatch.setattr(continuation, "KEEPALIVE_S", 0.01)
    # A gate holding the answer still lets the child's keep-alives through.
    config = proxy_config().with_overrides(supervisor={"gate": gate})
    async with delegating(tmp_path / "state", [CALL, FINAL], config=config) as s:
        delegator = s.proxy.pipeline.delegation.delegator
        gated = delegator._runtimes["scripted"] = GatedRuntime(delegator.registry.get("scripted"))
        body = orjson.dumps(request_body("chat", stream=True))
        got = b""
        async with http_client() as client, client.stream("POST", s.proxy.url + "/v1/chat/completions",
                                                          content=body,
                                                          headers={"content-type": "application/json"}) as r:
            with trio.fail_after(10):
                async for chunk in r.aiter_raw():
                    got += chunk
                    if CHAT.keepalive in got and not gated.release.is_set():
                        gated.release.set()  # the child answers only after the agent saw a keep-alive
    events = json_events(got)
    assert events[-1] == (None, "[DONE]")
    text = "".join(c["choices"][0]["delta"].get("content") or "" for _, c in events[:-1] if c.get("choices"))
    assert text.endswith(FINAL["text"]) and not gated.cancelled


async def test_an_agent_that_goes_away_cancels_the_running_child(tmp_path: Path) -> None:
    async with delegating(tmp_path / "state", [CALL, FINAL]) as s:
        delegator = s.proxy.pipeline.delegation.delegator
        gated = delegator._runtimes["scripted"] = GatedRuntime(delegator.registry.get("scripted"))
        body = orjson.dumps(request_body("chat", stream=True))
        with trio.fail_after(10):
            async with http_client() as client, client.stream("POST", s.proxy.url + "/v1/chat/completions",
                                                              content=body,
                                                              headers={"content-type": "application/json"}):
                await gated.started.wait()
            while not gated.cancelled:
                await trio.sleep(0.01)
        assert len(s.parent.requests) == 1, "no continuation after the agent left"
        health = delegator.health.get("scripted:scripted")
    assert (health.state, health.lease_id) == ("healthy", "")


class SlowToStopRuntime(GatedRuntime):
    """A child whose own clean-up on cancellation takes a while (a runtime closing its connection)."""

    async def run(self, job: Any, progress: Any) -> None:
        self.started.set()
        try:
            await self.release.wait()
        except trio.Cancelled:
            with trio.CancelScope(shield=True):
                await trio.sleep(1.5)
            self.cancelled = True
            raise


async def test_a_stream_closed_while_its_child_runs_returns_once_the_child_has_ended(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Closing the client's stream ends the child it waits on before the close returns, the child's own clean-up
    included: what the pipeline does next (the request's ledger line, its state's save) never runs beside it."""
    monkeypatch.setattr(continuation, "KEEPALIVE_S", 0.01)
    async with delegating(tmp_path / "state", [CALL, FINAL]) as s:
        delegator = s.proxy.pipeline.delegation.delegator
        slow = delegator._runtimes["scripted"] = SlowToStopRuntime(delegator.registry.get("scripted"))
        response = await s.proxy.pipeline(Request("POST", CHAT.path, [(b"content-type", b"application/json")],
                                                  orjson.dumps(request_body("chat", stream=True)),
                                                  time.perf_counter()))
        assert not isinstance(response.body, bytes)
        stream = aiter(response.body)
        with trio.fail_after(10):
            while not slow.started.is_set():
                await anext(stream)
            await stream.aclose()  # the client leaves
        assert slow.cancelled
        health = delegator.health.get("scripted:scripted")
    assert (health.state, health.lease_id) == ("healthy", "")


# ---- which requests get the tools ----------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["no tools", "ends with assistant", "clash", "adaptive", "not top-level"])
async def test_requests_the_tools_are_not_offered_to(case: str, tmp_path: Path) -> None:
    roles: dict[str, Any] = REVIEWER
    routing: dict[str, Any] = {}
    body = request_body("chat")
    if case == "no tools":
        del body["tools"]
    elif case == "ends with assistant":
        body["messages"].append({"role": "assistant", "content": "Sure,"})
    elif case == "clash":
        body["tools"][0]["function"]["name"] = "reviewer"
    elif case == "adaptive":
        routing["mode"] = "adaptive"
    else:
        roles = {"lead": {"adapter": "scripted", "supervises": ["reviewer"]}, **REVIEWER}
    async with delegating(tmp_path / "state", [{"text": "ok"}], config=proxy_config(roles, **routing)) as s:
        response, _ = await raw_stream(s.proxy.url, "chat", body)
        assert response.status_code == 200
    names = [t.name for t in BY_NAME["chat"].tools(sent(s.parent))]
    assert names == {"no tools": [], "ends with assistant": ["Bash"], "clash": ["reviewer"], "adaptive": ["Bash"],
                     "not top-level": ["Bash", "lead"]}[case]


# ---- disabled is free ------------------------------------------------------------------------------------------


async def requests_through(config: Config, state: Path) -> list[bytes]:
    steps = [{"tool_calls": [{"name": "Bash", "arguments": {"command": "ls"}, "id": "call_x"}]}, FINAL] * 6
    async with delegating(state, steps, config=config) as s:
        assert s.proxy.pipeline.delegation is None
        for fmt in FORMATS:
            for stream in (False, True):
                response, _ = await raw_stream(s.proxy.url + "/s/same", fmt,
                                               request_body(fmt, stream=stream, user="u1"))
                assert response.status_code == 200
    return [without_generated_ids(body) for _, body, _ in s.parent.requests]


@pytest.mark.parametrize("supervised", [True, False], ids=["supervised", "relay"])
async def test_with_model_routing_disabled_requests_are_byte_identical_and_nothing_is_spent(
        supervised: bool, tmp_path: Path) -> None:
    plain = Config(upstreams=(UpstreamConfig(name="scripted"),)).with_overrides(supervisor={"enabled": supervised})
    roles_but_off = proxy_config(REVIEWER, supervised=supervised, enabled=False)
    assert roles_but_off.model_routing.roles and not roles_but_off.model_routing.enabled
    baseline = await requests_through(plain, tmp_path / "plain")
    assert await requests_through(roles_but_off, tmp_path / "off") == baseline
    assert [p.name for p in files_under(tmp_path / "off") if p.is_dir()] == (["ledger", "sessions"] if supervised else [])
    if not supervised:  # the other gate: routing on, supervision off
        assert await requests_through(proxy_config(REVIEWER, supervised=False), tmp_path / "on") == baseline
        assert files_under(tmp_path / "on") == []


# ---- POST /proxyvisor/delegate ------------------------------------------------------------------------------


async def post(url: str, payload: Any, headers: dict[str, str] | None = None) -> Any:
    async with http_client() as client:
        return await client.post(url + "/proxyvisor/delegate", content=orjson.dumps(payload),
                                 headers={"content-type": "application/json", **(headers or {})})


async def test_the_delegate_endpoint_runs_one_child_in_the_callers_trace(tmp_path: Path) -> None:
    async with delegating(tmp_path / "state", [], [CHILD]) as s:
        r = await post(s.proxy.url, {"role": "reviewer", "prompt": "Review app.py"}, {"traceparent": PARENT})
    assert r.status_code == 200
    out = r.json()
    assert (out["status"], out["result"], out["is_error"]) == ("ok", CHILD["text"], False)
    assert out["evidence"]["trace_id"] == TRACE and out["evidence"]["gen_ai.agent.id"] == "reviewer"
    assert s.child.requests[0][2]["traceparent"].split("-")[1] == TRACE
    assert s.parent.requests == []


async def test_the_delegate_endpoint_says_why_it_did_not_run(tmp_path: Path) -> None:
    limited = {"fault": {"status": 429, "retry_after": "45"}}
    async with delegating(tmp_path / "state", [], [limited], ONCE) as s:
        assert (await post(s.proxy.url, {"role": "ghost", "prompt": "x"})).status_code == 400
        assert (await post(s.proxy.url, {"role": "reviewer"})).status_code == 400
        assert (await post(s.proxy.url, [1])).status_code == 400
        assert (await post(s.proxy.url, {"role": "reviewer", "prompt": "x", "complexity": "HUGE"})).status_code == 400
        async with http_client() as client:
            assert (await client.get(s.proxy.url + "/proxyvisor/delegate")).status_code == 405
        failed = await post(s.proxy.url, {"role": "reviewer", "prompt": "x"})
        assert failed.status_code == 200 and failed.json()["status"] == "failed"
        refused = await post(s.proxy.url, {"role": "reviewer", "prompt": "x"})
        assert refused.status_code == 429 and refused.json()["status"] == "refused"
        assert 40 <= int(refused.headers["retry-after"]) <= 45
    async with delegating(tmp_path / "off", [], config=proxy_config(enabled=False)) as s:
        off = await post(s.proxy.url, {"role": "reviewer", "prompt": "x"})
        assert off.status_code == 409 and "model_routing" in off.json()["error"]["message"]
    assert len(s.child.requests) == 0


# ---- the format pieces -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_stream_reads_back_as_the_response_it_streams(fmt: str) -> None:
    f = BY_NAME[fmt]
    turn = turn_of({"text": "héllo ✓", "tool_calls": [
        {"name": "Bash", "arguments": {"command": "ls"}, "id": "call_a"},
        {"name": "reviewer", "arguments": {"prompt": "p"}, "id": "call_b"}]})
    events = [(e.event, e.data) for chunk in f.render_stream(turn, MODEL, {}) for e in sse_events(chunk)]
    response = f.stream_response(events)
    assert f.parse_response(response) == f.parse_response(f.render(turn, MODEL)) == turn  # usage is not read back
    kept = f.assistant_items(response, lambda name: name == "reviewer")
    uses = [u for item in kept for u in f.message(item).tool_uses]
    assert [(u.id, u.name) for u in uses] == [("call_b", "reviewer")]


def test_a_messages_stream_keeps_thinking_blocks_and_their_signatures() -> None:
    f = BY_NAME["messages"]
    events = [
        ("message_start", '{"type":"message_start","message":{"id":"msg_1","role":"assistant","content":[]}}'),
        ("content_block_start", '{"type":"content_block_start","index":0,"content_block":{"type":"thinking",'
                                '"thinking":"","signature":""}}'),
        ("content_block_delta", '{"type":"content_block_delta","index":0,"delta":{"type":"thinking_delta",'
                                '"thinking":"Let me think."}}'),
        ("content_block_delta", '{"type":"content_block_delta","index":0,"delta":{"type":"signature_delta",'
                                '"signature":"sig=="}}'),
        ("content_block_stop", '{"type":"content_block_stop","index":0}'),
        ("content_block_start", '{"type":"content_block_start","index":1,"content_block":{"type":"tool_use",'
                                '"id":"toolu_1","name":"reviewer","input":{}}}'),
        ("content_block_delta", '{"type":"content_block_delta","index":1,"delta":{"type":"input_json_delta",'
                                '"partial_json":"{\\"prompt\\":\\"p\\"}"}}'),
        ("content_block_stop", '{"type":"content_block_stop","index":1}'),
        ("message_delta", '{"type":"message_delta","delta":{"stop_reason":"tool_use"},"usage":{"output_tokens":9}}'),
    ]
    (item,) = f.assistant_items(f.stream_response(events), lambda _name: True)
    assert item == {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "Let me think.", "signature": "sig=="},
        {"type": "tool_use", "id": "toolu_1", "name": "reviewer", "input": {"prompt": "p"}}]}


def test_a_note_and_a_delegation_at_one_place_go_back_note_first() -> None:
    f, supervisor, session = BY_NAME["chat"], Supervisor(SupervisorConfig()), Session("s", 0.0, 0.0)
    history = [{"role": "user", "content": "q"}, {"role": "tool", "tool_call_id": "c", "content": "r"}]
    supervisor.begin(session, f, {"messages": [dict(m) for m in history[:1]]})
    thread = next(iter(session.supervision.threads.values()))
    anchor = fingerprint(f.message(history[0]))
    run = [{"role": "assistant", "content": None, "tool_calls": []}, {"role": "tool", "content": "d"}]
    thread.notes = [Note(0, anchor, "loop", "NOTE")]
    thread.delegated = [Delegated(0, anchor, run)]
    body = {"messages": [dict(m) for m in history] + [{"role": "user", "content": "next"}]}
    supervisor.begin(session, f, body)
    assert [m.get("content") for m in body["messages"]][1:6] == ["q", "NOTE", None, "d", "r"]  # 0: the instruction



# ---- the demo ----------------------------------------------------------------------------------------------


async def test_the_demo_delegates_and_shows_a_pool_cool_down_and_recover_through_its_probe(tmp_path: Path) -> None:
    out = io.StringIO()
    store = Store(tmp_path / "state")
    await run_delegating_agent(Config(), store, BY_NAME["chat"], Console(file=out, width=300))
    text = out.getvalue()
    ran = re.findall(r"supervisor ran reviewer: (\w+)", text)
    breaker = re.findall(r"breaker +pool scripted:scripted is (\w+)", text)
    assert ran == ["ok", "ok", "failed", "refused", "ok"]
    assert breaker == ["healthy", "healthy", "cooling_down", "cooling_down", "healthy"]
    assert "2 attempts: failed (capacity), answered" in text
    assert "3 attempts: failed (capacity), failed (capacity), failed (capacity)" in text
    assert "failed; capacity, retry after 1 s" in text and "half_open at dispatch, the half-open probe" in text
    assert "tool calls the agent saw: none" in text and "tool calls the agent saw: reviewer" not in text
    assert "The reviewer is back: app.py is fine." in text
    # Evidence went to the ledger: one delegation per agent request, the refused one with no child run, the
    # exhausted one a dead letter that the parent model's error result names.
    (session,) = store.sessions()
    lines = store.read_ledger(session)
    assert [line["delegations"][0]["status"] for line in lines] == ["ok", "ok", "failed", "refused", "ok"]
    letter = lines[2]["delegations"][0]["dead_letter"]
    assert re.fullmatch(r"dl_[0-9a-f]{20}", letter) and f"dead letter {letter}" in text


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_a_delegated_turn_also_works_through_translation(stream: bool, tmp_path: Path) -> None:
    """The agent speaks Messages, the upstream only Chat: the turn is continued through litellm's translation."""
    config = msgspec.structs.replace(proxy_config(), upstreams=(UpstreamConfig(name="scripted", formats=("chat",)),))
    async with delegating(tmp_path / "state", [CALL, FINAL], [CHILD], config=config) as s:
        answer = await ask("messages", s.proxy.url, stream=stream)
    assert answer.tool_calls == () and answer.text.endswith(FINAL["text"])
    continued = sent(s.parent, 1)
    assert s.parent.requests[1][0] == "/v1/chat/completions"
    assert continued["messages"][-1] == {"role": "tool", "tool_call_id": "call_rev_1", "content": CHILD["text"]}
