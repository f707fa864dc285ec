"""The verify-gate through a running proxy: every gate path in all three formats, streamed and not.

The verifier is a scripted stand-in (:class:`Verifier`, passed as the supervisor model): it answers the gate's
calls from a queue per purpose and records what it was asked. The agent's model is the scripted upstream.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import orjson
import pytest
import trio

from proxyvisor.scripted import verifier as scripted_verifier
from proxyvisor.config import Config, GateConfig
from proxyvisor.gate.outcome import naming
from proxyvisor.gate.verdict import FORMAT_RETRY, REFUTER_INSTRUCTIONS, VERIFIER_INSTRUCTIONS, Gap
from proxyvisor.proxy import continuation, gating
from proxyvisor.proxy.client import Cut
from proxyvisor.proxy.reply import Encoded
from proxyvisor.proxy.formats import BY_NAME, AssistantTurn, ToolCall, ToolSpec
from proxyvisor.proxy.formats.base import CallResult
from proxyvisor.proxy.info import summarize, supervisor_text
from proxyvisor.supervisor_model import ModelAnswer

from helpers import FORMATS, MODEL, ProxyRun, http_client, request_body, scripted_proxy, sse_events

MODES = [(f, s) for f in FORMATS for s in (False, True)]
IDS = [f"{f}-{'sse' if s else 'json'}" for f, s in MODES]
DONE = {"text": "Done: the bug is fixed.", "output_tokens": 7}
REWORKED = {"text": "Fixed, and the tests pass now.", "output_tokens": 8}


def verdict(verdict: str = "pass", gaps: tuple[tuple[str, str], ...] = (), handback: bool | None = None) -> str:
    requirement = {"id": 1, "requirement": "fix the bug", "status": "unmatched" if gaps else "matched",
                   "basis": "recorded_output" if gaps else None, "evidence": "x"}
    return orjson.dumps({"requirements": [requirement],
                         "gaps": [{"requirement": 1, "gap": g, "settles": s} for g, s in gaps],
                         "handback": None if handback is None else {"needs_user": handback, "reason": "r"},
                         "verdict": verdict}).decode()


NOTICE = GateConfig().unverified_notice


NOTICE_HEAD = NOTICE.partition(": ")[0]
"""What every notice starts with, naming a gap or not."""


def noticed(text: str, gap: str | None = None) -> str:
    """``text`` as the agent reads it with the unverified notice appended, naming ``gap`` when one stands (a blank
    line between, whichever way the format adds it: a new block or item is read back joined)."""
    return f"{text}\n\n{naming(NOTICE, Gap(gap, '')) if gap is not None else NOTICE}"


def read_noticed(text: str) -> str:
    """The agent's text with the notice's separator normalised (formats join an added block without one)."""
    head, sep, notice = text.rpartition(NOTICE_HEAD)
    return f"{head.rstrip()}\n\n{sep}{notice}" if sep else text


GAP = ("the tests were not run", "a passing test run")
OTHER_GAP = ("the docs were not updated", "the updated README")


class Verifier:
    """A supervisor model double: ``verify`` and ``refute`` answers, in order (text, a :class:`ModelAnswer` with
    its usage, a callable of the messages giving text, or an exception instance, raised); every call's messages
    are kept in ``calls``."""

    def __init__(self, verify: list[Any] | None = None, refute: list[Any] | None = None) -> None:
        self.answers = {"verify": list(verify or []), "refute": list(refute or [])}
        self.calls: list[tuple[str, list[dict[str, str]]]] = []
        self.release: trio.Event | None = None

    async def __call__(self, messages: list[dict[str, str]]) -> ModelAnswer:
        system = messages[0]["content"]
        purpose = "verify" if system == VERIFIER_INSTRUCTIONS else "refute" if system == REFUTER_INSTRUCTIONS else "?"
        self.calls.append((purpose, messages))
        if self.release is not None:
            await self.release.wait()
        queue = self.answers[purpose]
        answer = queue.pop(0) if queue else (verdict() if purpose == "verify" else '{"findings": []}')
        if isinstance(answer, Exception):
            raise answer
        if callable(answer):
            answer = answer(messages)
        return answer if isinstance(answer, ModelAnswer) else ModelAnswer(answer)

    def purposes(self) -> list[str]:
        return [p for p, _ in self.calls]


@asynccontextmanager
async def gated(tmp_path: Path, steps: list[dict[str, Any]], verifier: Verifier,
                **gate: Any) -> AsyncIterator[ProxyRun]:
    """A proxy with the gate configured by ``gate`` (``hold = "answer"`` unless given: the agent's text is then
    the last answer alone, which most tests read)."""
    config = Config().with_overrides(supervisor={"gate": GateConfig(**{"hold": "answer", **gate})})
    async with scripted_proxy(tmp_path, config, steps, verifier) as run:
        yield run


async def send(run: ProxyRun, fmt: str, stream: bool, body: dict[str, Any] | None = None,
               on_chunk: Callable[[bytes], None] | None = None) -> tuple[str, list[str], bytes]:
    """Send one agent request; returns the answer's text, its tool call names and the raw bytes received."""
    body = body or request_body(fmt, stream)
    got = b""
    async with http_client() as client, client.stream(
            "POST", run.proxy.url + BY_NAME[fmt].path, content=orjson.dumps(body),
            headers={"content-type": "application/json", "x-proxyvisor-session": "gate-test"}) as response:
        assert response.status_code == 200, await response.aread()
        async for chunk in response.aiter_raw():
            got += chunk
            if on_chunk is not None:
                on_chunk(got)
    w = BY_NAME[fmt]
    if stream:
        turn = w.assemble([(e.event, e.data) for e in sse_events(got)])
    else:
        turn = w.parse_response(orjson.loads(got))
    # A stripped self-report leaves the newline before it; the agent's text is otherwise as the model wrote it.
    return turn.text.rstrip("\n"), [c.name for c in turn.tool_calls], got


def with_history(fmt: str, stream: bool, prompt: str, mutation: bool = True, check: str | None = None,
                 failed_first: str | None = None) -> dict[str, Any]:
    """An agent request whose turn holds an edit (``mutation``) and optionally a test command's result (``check``),
    after a first run of it that printed ``failed_first``."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are a coding agent."},
                                      {"role": "user", "content": prompt}]
    calls = []
    if mutation:
        calls.append(("c1", {"command": "sed -i 's/a/b/' app.py"}, ""))
    if failed_first is not None:
        calls.append(("c1b", {"command": "pytest -q -x"}, failed_first))
    if check is not None:
        calls.append(("c2", {"command": "pytest -q"}, check))
    for call_id, arguments, result in calls:
        messages.append({"role": "assistant", "content": None, "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": "Bash", "arguments": orjson.dumps(arguments).decode()}}]})
        messages.append({"role": "tool", "tool_call_id": call_id, "content": result})
    tools = (ToolSpec("Bash", {"type": "object", "properties": {"command": {"type": "string"}}}, "Run a command"),)
    return BY_NAME[fmt].request_from_chat(messages, MODEL, stream, tools)


def with_report(text: str, state: str) -> str:
    report = {"state": state, "focus": "the fix", "next": None, "carry": [], "plan": None}
    return f"{text}\n<sup>{orjson.dumps(report).decode()}</sup>"


# ---- pass --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("fmt", "stream"), MODES, ids=IDS)
async def test_a_passing_answer_is_delivered_unchanged_and_labelled(tmp_path: Path, fmt: str, stream: bool) -> None:
    async with gated(tmp_path, [DONE], Verifier([verdict()])) as run:
        text, calls, _ = await send(run, fmt, stream)
    assert (text, calls) == (DONE["text"], [])
    assert run.model.purposes() == ["verify"]
    assert len(run.upstream.requests) == 1
    gate = run.last("gate")
    assert (gate["verdicts"], gate["outcome"], gate["passed"], gate["reentries"]) == (["pass"], "unknown", True, 0)
    assert run.ledger()[-1]["supervisor_model"]["calls"] == {"verify": 1}


@pytest.mark.parametrize(("fmt", "stream"), MODES, ids=IDS)
async def test_an_edit_followed_by_a_passing_check_is_verified(tmp_path: Path, fmt: str, stream: bool) -> None:
    body = with_history(fmt, stream, "Fix the bug in app.py.", check="3 passed")
    async with gated(tmp_path, [DONE], Verifier([verdict()])) as run:
        text, _, _ = await send(run, fmt, stream, body)
    assert text == DONE["text"]
    assert run.last("gate")["outcome"] == "verified"
    digest = run.model.calls[0][1][1]["content"]
    assert "3 passed" in digest and "Fix the bug in app.py." in digest


# ---- gaps then pass ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("fmt", "stream"), MODES, ids=IDS)
async def test_gaps_continue_the_turn_and_the_agent_gets_the_reworked_answer(
        tmp_path: Path, fmt: str, stream: bool) -> None:
    verifier = Verifier([verdict("gaps", (GAP,)), verdict()])
    async with gated(tmp_path, [DONE, REWORKED], verifier) as run:
        text, calls, raw = await send(run, fmt, stream)
    assert (text, calls) == (REWORKED["text"], [])
    assert DONE["text"].encode() not in raw  # the held answer never reached the agent
    assert verifier.purposes() == ["verify", "refute", "verify"]
    first, second = run.upstream_bodies()
    continued = orjson.dumps(second).decode()
    assert "the tests were not run" in continued and "a passing test run" in continued  # the advisory
    assert DONE["text"] in continued  # the held answer, carried on
    assert "the tests were not run" not in orjson.dumps(first).decode()
    gate = run.last("gate")
    assert (gate["verdicts"], gate["reentries"], gate["outcome"], gate["passed"]) == (["gaps", "pass"], 1, "unknown",
                                                                                       True)
    # The second verifier pass saw both finals and the previous gaps.
    second_digest = verifier.calls[2][1][1]["content"]
    assert DONE["text"] in second_digest and REWORKED["text"] in second_digest
    assert "previously_flagged_gaps" in second_digest


@pytest.mark.parametrize(("fmt", "stream"), MODES, ids=IDS)
async def test_a_continued_turn_that_calls_tools_goes_to_the_agent_and_is_remembered(
        tmp_path: Path, fmt: str, stream: bool) -> None:
    tool_turn = {"tool_calls": [{"name": "Bash", "arguments": {"command": "pytest -q"}, "id": "call_t1"}]}
    verifier = Verifier([verdict("gaps", (GAP,))])
    async with gated(tmp_path, [DONE, tool_turn, REWORKED], verifier) as run:
        _, calls, _ = await send(run, fmt, stream)
        assert calls == ["Bash"]
        assert run.last("gate")["reentries"] == 1 and "outcome" not in run.last("gate")
        # The agent runs the test and sends its history on: the held answer and the advisory go back in place.
        w = BY_NAME[fmt]
        first = request_body(fmt, stream)
        response_items = _tool_call_items(fmt, "call_t1")
        w.extend_history(first, response_items + w.tool_results([CallResult("call_t1", "3 passed")]))
        text, _, _ = await send(run, fmt, stream, first)
    assert text == REWORKED["text"]
    third = orjson.dumps(run.upstream_bodies()[2]).decode()
    assert DONE["text"] in third and "the tests were not run" in third
    assert verifier.purposes() == ["verify", "refute", "verify"]


def _tool_call_items(fmt: str, call_id: str) -> list[Any]:
    w = BY_NAME[fmt]
    response = w.render(AssistantTurn("", (ToolCall("Bash", {"command": "pytest -q"}, call_id),)), MODEL)
    return w.assistant_items(response, lambda _name: True)


# ---- usage: each answer's tokens and cost, as the model reported them ------------------------------------------------
@pytest.mark.parametrize(("fmt", "stream"), [("chat", False), ("messages", True), ("responses", True)])
async def test_each_gate_answers_usage_reaches_the_ledger_and_info_unchanged(tmp_path: Path, fmt: str,
                                                                             stream: bool) -> None:
    """A verdict with gaps, the refuter's answer (not priced) and the passing verdict after the rework: the
    request's ledger line and the session's /info add up exactly the tokens and cost each answer carried, and the
    unpriced answer is counted as not priced, never as $0."""
    verifier = Verifier([ModelAnswer(verdict("gaps", (GAP,)), 1200, 80, 0.0042),
                         ModelAnswer(verdict(), 900, 61, 0.0031)], [ModelAnswer('{"findings": []}', 700, 15, None)])
    async with gated(tmp_path, [DONE, REWORKED], verifier) as run:
        text, _, _ = await send(run, fmt, stream)
        async with http_client(run.proxy.url) as client:
            info = (await client.get("/proxyvisor/sessions/gate-test/info")).json()
    assert text == REWORKED["text"] and verifier.purposes() == ["verify", "refute", "verify"]
    (line,) = run.ledger()
    use = line["supervisor_model"]
    assert (use["calls"], use["input_tokens"], use["output_tokens"], use["unpriced"]) == (
        {"verify": 2, "refute": 1}, 2800, 156, 1)
    assert use["cost_usd"] == pytest.approx(0.0073)
    sup = info["supervisor_model"]
    assert (sup["total_calls"], sup["input_tokens"], sup["output_tokens"], sup["unpriced_calls"]) == (3, 2800, 156, 1)
    assert sup["cost_usd"] == pytest.approx(0.0073)
    assert "2,800 in / 156 out tokens · $0.0073 + 1 answer not priced" in supervisor_text(sup)


async def test_answers_that_are_not_priced_stay_not_priced(tmp_path: Path) -> None:
    verifier = Verifier([ModelAnswer(verdict("gaps", (GAP,)), 300, 20, None), ModelAnswer(verdict(), 310, 22, None)],
                        [ModelAnswer('{"findings": []}', 100, 5, None)])
    async with gated(tmp_path, [DONE, REWORKED], verifier) as run:
        await send(run, "chat", False)
    (line,) = run.ledger()
    use = line["supervisor_model"]
    assert (use["input_tokens"], use["output_tokens"], use["cost_usd"], use["unpriced"]) == (710, 47, 0.0, 3)
    text = supervisor_text(summarize(run.ledger())["supervisor_model"])
    assert "710 in / 47 out tokens · not priced ·" in text and "$" not in text


# ---- the same gaps after new evidence: failed ----------------------------------------------------------------------
@pytest.mark.parametrize(("fmt", "stream"), MODES, ids=IDS)
async def test_the_same_gaps_after_new_evidence_end_the_turn_failed(tmp_path: Path, fmt: str, stream: bool) -> None:
    tool_turn = {"tool_calls": [{"name": "Bash", "arguments": {"command": "pytest -q"}, "id": "call_t1"}]}
    verifier = Verifier([verdict("gaps", (GAP,)), verdict("gaps", (GAP,))])
    async with gated(tmp_path, [DONE, tool_turn, REWORKED], verifier) as run:
        await send(run, fmt, stream)
        w = BY_NAME[fmt]
        body = request_body(fmt, stream)
        w.extend_history(body, _tool_call_items(fmt, "call_t1") + w.tool_results([CallResult("call_t1", "1 failed")]))
        text, _, _ = await send(run, fmt, stream, body)
    assert read_noticed(text) == noticed(REWORKED["text"], GAP[0])  # delivered, labelled, naming the gap
    gate = run.last("gate")
    assert (gate["outcome"], gate["passed"], gate["gaps"]) == ("failed", False, [GAP[0]])
    assert len(run.upstream.requests) == 3  # no further re-entry


# ---- budget spent: unverified -------------------------------------------------------------------------------------
@pytest.mark.parametrize(("fmt", "stream"), MODES, ids=IDS)
async def test_a_spent_reentry_budget_delivers_the_last_answer_unverified(tmp_path: Path, fmt: str, stream: bool) -> None:
    answers = [{"text": f"Attempt {n}."} for n in range(1, 5)]
    verifier = Verifier([verdict("gaps", (GAP,))] * 3)
    async with gated(tmp_path, answers, verifier, reentry_budget=2) as run:
        text, _, _ = await send(run, fmt, stream)
    assert read_noticed(text) == noticed("Attempt 3.", GAP[0])
    assert len(run.upstream.requests) == 3  # the first answer and two re-entries
    gate = run.last("gate")
    assert (gate["outcome"], gate["passed"], gate["reentries"]) == ("unverified", False, 2)
    assert gate["verdicts"] == ["gaps"] * 3 and "budget spent" in gate["reason"]


async def test_an_answer_delivered_on_a_failed_check_names_it_in_the_notice_and_the_warning(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    body = with_history("chat", False, "Fix the bug in app.py.", check="1 failed")
    async with gated(tmp_path, [DONE], Verifier(), reentry_budget=0) as run:
        with caplog.at_level(logging.WARNING, "proxyvisor.gate"):
            text, _, _ = await send(run, "chat", False, body)
    gap = 'The latest check after the last change failed: `pytest -q` reported "1 failed".'
    assert text == noticed(DONE["text"], gap) == (
        f'{DONE["text"]}\n\n[proxyvisor] This answer could not be verified: the latest check after the last change '
        'failed: `pytest -q` reported "1 failed". Check it before relying on it.')
    gate = run.last("gate")
    assert (gate["outcome"], gate["decided_by"], run.model.calls) == ("unverified", ["evidence"], [])
    assert f"turn unverified: verification gaps remain: re-entry budget spent: {gap}" in caplog.text


async def test_a_budget_of_zero_never_continues(tmp_path: Path) -> None:
    async with gated(tmp_path, [DONE, REWORKED], Verifier([verdict("gaps", (GAP,))]), reentry_budget=0) as run:
        text, _, _ = await send(run, "chat", False)
    assert text == noticed(DONE["text"], GAP[0]) and len(run.upstream.requests) == 1
    assert run.last("gate")["outcome"] == "unverified"


# ---- refutation -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("fmt", "stream"), MODES, ids=IDS)
async def test_a_refuted_finding_is_dropped_from_the_advisory(tmp_path: Path, fmt: str, stream: bool) -> None:
    refutation = orjson.dumps({"findings": [{"id": 1, "status": "stands", "citation": ""},
                                            {"id": 2, "status": "refuted", "citation": "the request never asks for docs"}]}
                              ).decode()
    verifier = Verifier([verdict("gaps", (GAP, OTHER_GAP)), verdict()], [refutation])
    async with gated(tmp_path, [DONE, REWORKED], verifier) as run:
        await send(run, fmt, stream)
    continued = orjson.dumps(run.upstream_bodies()[1]).decode()
    assert GAP[0] in continued and OTHER_GAP[0] not in continued
    refuter_input = verifier.calls[1][1][1]["content"]
    assert "charged_findings" in refuter_input and OTHER_GAP[0] in refuter_input
    assert run.last("gate")["refuted"] == 1


@pytest.mark.parametrize(("fmt", "stream"), MODES, ids=IDS)
async def test_refuting_every_finding_passes_the_answer(tmp_path: Path, fmt: str, stream: bool) -> None:
    refutation = '{"findings": [{"id": 1, "status": "refuted", "citation": "action #1 ran the tests"}]}'
    async with gated(tmp_path, [DONE, REWORKED], Verifier([verdict("gaps", (GAP,))], [refutation])) as run:
        text, _, _ = await send(run, fmt, stream)
    assert text == DONE["text"] and len(run.upstream.requests) == 1
    assert (run.last("gate")["passed"], run.last("gate")["refuted"]) == (True, 1)


# ---- malformed then repaired --------------------------------------------------------------------------------------
@pytest.mark.parametrize(("fmt", "stream"), MODES, ids=IDS)
async def test_a_malformed_answer_gets_one_format_retry(tmp_path: Path, fmt: str, stream: bool) -> None:
    verifier = Verifier(["I think it is fine.", verdict()])
    async with gated(tmp_path, [DONE], verifier) as run:
        text, _, _ = await send(run, fmt, stream)
    assert text == DONE["text"]
    assert verifier.purposes() == ["verify", "verify"]
    retry = verifier.calls[1][1]
    assert retry[-1]["content"] == FORMAT_RETRY and retry[-2] == {"role": "assistant", "content": "I think it is fine."}
    assert run.last("gate")["verdicts"] == ["malformed", "pass"] and run.last("gate")["passed"]


async def test_malformed_twice_counts_as_unavailable(tmp_path: Path) -> None:
    async with gated(tmp_path, [DONE], Verifier(["nope", "still nope"])) as run:
        text, _, _ = await send(run, "messages", True)
    assert read_noticed(text) == noticed(DONE["text"])
    gate = run.last("gate")
    assert (gate["verdicts"], gate["outcome"], gate["passed"]) == (["malformed", "malformed"], "unverified", False)


# ---- verifier down ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("policy", ["fail_closed", "fail_open"])
@pytest.mark.parametrize(("fmt", "stream"), MODES, ids=IDS)
async def test_a_verifier_that_is_down_never_costs_the_answer(tmp_path: Path, fmt: str, stream: bool,
                                                              policy: str) -> None:
    async with gated(tmp_path, [DONE], Verifier([ConnectionError("verifier down")]), failure_policy=policy) as run:
        text, calls, _ = await send(run, fmt, stream)
    # Under fail_closed the agent sees that the answer is unverified; under fail_open nothing is added.
    assert (read_noticed(text), calls) == (noticed(DONE["text"]) if policy == "fail_closed" else DONE["text"], [])
    gate = run.last("gate")
    assert (gate["verdicts"], gate["outcome"]) == (["unavailable"], "unverified")
    assert gate["passed"] is (policy == "fail_open")
    assert run.ledger()[-1]["status"] == 200


async def test_a_verifier_that_hangs_times_out_as_unavailable(tmp_path: Path) -> None:
    verifier = Verifier()
    verifier.release = trio.Event()  # never set
    async with gated(tmp_path, [DONE], verifier, timeout_s=0.2) as run:
        text, _, _ = await send(run, "responses", True)
    assert read_noticed(text) == noticed(DONE["text"]) and run.last("gate")["outcome"] == "unverified"


# ---- hand-backs --------------------------------------------------------------------------------------------------------
NEEDS_INPUT = {"text": with_report("Which database should I migrate, staging or production?", "need_input")}


@pytest.mark.parametrize(("fmt", "stream"), MODES, ids=IDS)
async def test_a_handback_that_needs_the_user_passes(tmp_path: Path, fmt: str, stream: bool) -> None:
    verifier = Verifier([verdict(handback=True)])
    async with gated(tmp_path, [NEEDS_INPUT, REWORKED], verifier) as run:
        text, _, _ = await send(run, fmt, stream)
    assert text == "Which database should I migrate, staging or production?"
    assert "state: need_input" in verifier.calls[0][1][1]["content"]
    assert (run.last("gate")["outcome"], run.last("gate")["passed"]) == ("unknown", True)
    assert "hand-back" in run.last("gate")["reason"]


@pytest.mark.parametrize(("fmt", "stream"), MODES, ids=IDS)
async def test_a_handback_the_agent_could_clear_itself_is_sent_back(tmp_path: Path, fmt: str, stream: bool) -> None:
    verifier = Verifier([verdict(handback=False), verdict()])
    async with gated(tmp_path, [NEEDS_INPUT, REWORKED], verifier) as run:
        text, _, _ = await send(run, fmt, stream)
    assert text == REWORKED["text"]
    assert run.last("gate")["reentries"] == 1


# ---- prohibitions -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("fmt", "stream"), MODES, ids=IDS)
async def test_a_forbidden_check_is_compliance_not_a_gap(tmp_path: Path, fmt: str, stream: bool) -> None:
    policy = Verifier([scripted_verifier_answer] * 3)
    forbidden = with_history(fmt, stream, "Fix the typo in app.py. Do not run tests, the suite takes an hour.")
    async with gated(tmp_path, [DONE, REWORKED], policy) as run:
        text, _, _ = await send(run, fmt, stream, forbidden)
    digest = policy.calls[0][1][1]["content"]
    assert "<prohibitions" in digest and "Do not run tests, the suite takes an hour." in digest
    assert text == DONE["text"] and run.last("gate")["passed"]
    assert run.last("gate")["decided_by"] == ["model"]
    # The same turn without the prohibition: the missing check is a gap of the free evidence, with no model call;
    # the reworked answer ran nothing and changed nothing more, so the model judges it (the checks are asked for
    # once per change).
    async with gated(tmp_path / "b", [DONE, REWORKED], Verifier([verdict()])) as run:
        await send(run, fmt, stream, with_history(fmt, stream, "Fix the typo in app.py."))
        gate = run.last("gate")
        assert (gate["decided_by"], gate["verdicts"]) == (["evidence", "model"], ["gaps", "pass"])
        assert "no check ran after the last change" in gate["gaps"][0] and len(run.model.calls) == 1


# ---- the evidence pre-check ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(("fmt", "stream"), MODES, ids=IDS)
async def test_done_despite_a_failing_check_is_sent_back_by_evidence_then_verified_once_it_passes(
        tmp_path: Path, fmt: str, stream: bool) -> None:
    tool_turn = {"tool_calls": [{"name": "Bash", "arguments": {"command": "pytest -q"}, "id": "call_t1"}]}
    verifier = Verifier([verdict()])
    body = with_history(fmt, stream, "Fix the bug in app.py.", check="FAILED t.py::test_a\n1 failed, 2 passed in 0.1s")
    async with gated(tmp_path, [DONE, tool_turn, REWORKED], verifier) as run:
        _, calls, _ = await send(run, fmt, stream, body)
        assert calls == ["Bash"] and not verifier.calls
        gate = run.last("gate")
        assert (gate["decided_by"], gate["verdicts"], gate["reentries"]) == (["evidence"], ["gaps"], 1)
        assert '"1 failed, 2 passed in 0.1s"' in gate["gaps"][0]
        assert "1 failed, 2 passed in 0.1s" in orjson.dumps(run.upstream_bodies()[1]).decode()  # the advisory
        # The agent runs the check again and it passes: the model judges now, and its pass is verified.
        w = BY_NAME[fmt]
        w.extend_history(body, _tool_call_items(fmt, "call_t1") + w.tool_results([CallResult("call_t1",
                                                                                              "3 passed in 0.1s")]))
        text, _, _ = await send(run, fmt, stream, body)
    assert text == REWORKED["text"] and verifier.purposes() == ["verify"]
    gate = run.last("gate")
    assert (gate["decided_by"], gate["outcome"]) == (["model"], "verified")


def across_turns(fmt: str, stream: bool, *turns: str) -> dict[str, Any]:
    """A request of a session over several user ``turns`` (each but the last answered with text), whose last
    turn holds an edit."""
    chat = with_history("chat", stream, turns[-1])["messages"]
    earlier: list[dict[str, Any]] = []
    for text in turns[:-1]:
        earlier += [{"role": "user", "content": text}, {"role": "assistant", "content": "Noted."}]
    tools = (ToolSpec("Bash", {"type": "object", "properties": {"command": {"type": "string"}}}, "Run a command"),)
    return BY_NAME[fmt].request_from_chat(chat[:1] + earlier + chat[1:], MODEL, stream, tools)


@pytest.mark.parametrize(("fmt", "stream"), MODES, ids=IDS)
async def test_the_digest_carries_the_prohibitions_in_force_from_every_turn(tmp_path: Path, fmt: str,
                                                                           stream: bool) -> None:
    standing = across_turns(fmt, stream, "Fix the typo in app.py.", "Do not run tests, the suite takes an hour.",
                            "Go on with the fix.")
    policy = Verifier([scripted_verifier_answer] * 3)
    async with gated(tmp_path, [DONE, REWORKED], policy) as run:
        text, _, _ = await send(run, fmt, stream, standing)
    digest = policy.calls[0][1][1]["content"]
    assert "- [turn 2] Do not run tests, the suite takes an hour." in digest
    assert text == DONE["text"] and run.last("gate")["passed"]  # the forbidden check's absence is compliance
    # A later permission lifts it: the missing check is a gap again, the free evidence's (no model call for it;
    # the reworked answer, with no further change, is the model's to judge).
    lifted = across_turns(fmt, stream, "Fix the typo in app.py.", "Do not run tests, the suite takes an hour.",
                          "You can run the tests now.")
    async with gated(tmp_path / "b", [DONE, REWORKED], Verifier([verdict()])) as run:
        await send(run, fmt, stream, lifted)
        gate = run.last("gate")
        assert (gate["decided_by"], gate["verdicts"]) == (["evidence", "model"], ["gaps", "pass"])
        assert "no check ran after the last change" in gate["gaps"][0] and len(run.model.calls) == 1


def scripted_verifier_answer(messages: list[dict[str, str]]) -> str:
    """The scripted upstream's fixed verifier policy, as a model double."""
    fmt = BY_NAME["chat"]
    return scripted_verifier.answer(fmt, {"messages": messages})


# ---- streams: held, kept alive, tool rounds untouched ---------------------------------------------------------------
async def judged_after_keepalives(tmp_path: Path, fmt: str, **gate: Any) -> tuple[str, bytes, bytes]:
    """A streamed turn end whose verifier answers only once the client has two keep-alives: its text, the bytes
    received, and those received when the verifier was let go (set ``continuation.KEEPALIVE_S`` low first)."""
    verifier = Verifier([verdict()])
    verifier.release = trio.Event()
    keepalive = BY_NAME[fmt].keepalive
    at_release: list[bytes] = []

    def on_chunk(got: bytes) -> None:
        if not verifier.release.is_set() and got.count(keepalive) >= 2:
            at_release.append(got)
            verifier.release.set()

    async with gated(tmp_path, [DONE], verifier, **gate) as run:
        with trio.fail_after(10):
            text, _, raw = await send(run, fmt, True, on_chunk=on_chunk)
    return text, raw, at_release[0]


@pytest.mark.parametrize("fmt", FORMATS)
async def test_a_held_stream_gets_keepalives_and_nothing_else_until_the_verdict(
        tmp_path: Path, fmt: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(continuation, "KEEPALIVE_S", 0.01)
    keepalive = BY_NAME[fmt].keepalive
    text, raw, held = await judged_after_keepalives(tmp_path, fmt)
    assert text == DONE["text"]
    assert held.replace(keepalive, b"") == b""  # only keep-alives went out while the verdict was pending
    assert raw.startswith(held)


@pytest.mark.parametrize(("fmt", "stream"), MODES, ids=IDS)
async def test_tool_call_rounds_are_not_gated(tmp_path: Path, fmt: str, stream: bool) -> None:
    tool_turn = {"text": "Let me look.", "tool_calls": [{"name": "Bash", "arguments": {"command": "ls"}}]}
    verifier = Verifier()
    async with gated(tmp_path, [tool_turn], verifier) as run:
        text, calls, _ = await send(run, fmt, stream)
    assert (text, calls) == ("Let me look.", ["Bash"])
    assert verifier.calls == [] and all("gate" not in line for line in run.ledger())


async def test_a_request_without_tools_is_not_gated(tmp_path: Path) -> None:
    verifier = Verifier()
    body = request_body("messages", True)
    del body["tools"]
    async with gated(tmp_path, [DONE], verifier) as run:
        text, _, _ = await send(run, "messages", True, body)
    assert text == DONE["text"] and verifier.calls == []


@pytest.mark.parametrize(("fmt", "stream"), MODES, ids=IDS)
async def test_an_upstream_that_refuses_the_continuation_leaves_the_held_answer(
        tmp_path: Path, fmt: str, stream: bool) -> None:
    async with gated(tmp_path, [DONE, {"fault": {"status": 429}}], Verifier([verdict("gaps", (GAP,))])) as run:
        text, _, _ = await send(run, fmt, stream)
    assert read_noticed(text) == noticed(DONE["text"])
    gate = run.last("gate")
    assert (gate["outcome"], gate["passed"]) == ("unverified", False) and "429" in gate["reason"]


async def test_the_gate_off_holds_nothing(tmp_path: Path) -> None:
    verifier = Verifier()
    async with gated(tmp_path, [DONE], verifier, enabled=False) as run:
        text, _, _ = await send(run, "chat", True)
    assert text == DONE["text"] and verifier.calls == []


# ---- headless nudges --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("fmt", "stream"), MODES, ids=IDS)
async def test_headless_a_turn_ending_in_progress_is_nudged_twice_then_verified(
        tmp_path: Path, fmt: str, stream: bool) -> None:
    progressing = [{"text": with_report(f"Still working ({n}).", "progressing")} for n in (1, 2, 3)]
    verifier = Verifier([verdict()])
    async with gated(tmp_path, progressing, verifier, headless=True) as run:
        text, _, _ = await send(run, fmt, stream)
    assert text == "Still working (3)."
    assert len(run.upstream.requests) == 3 and verifier.purposes() == ["verify"]
    assert "Continue the work" in orjson.dumps(run.upstream_bodies()[1]).decode()
    assert run.last("gate")["nudges"] == 2


async def test_interactive_sessions_are_not_nudged(tmp_path: Path) -> None:
    progressing = {"text": with_report("Still working.", "progressing")}
    async with gated(tmp_path, [progressing], Verifier([verdict()])) as run:
        text, _, _ = await send(run, "chat", False)
    assert text == "Still working." and run.last("gate")["nudges"] == 0


# ---- a supervisor failure never costs the answer ------------------------------------------------------------------
@pytest.mark.parametrize("where", ["digest", "continuation"])
@pytest.mark.parametrize(("fmt", "stream"), MODES, ids=IDS)
async def test_a_bug_in_the_gate_delivers_the_answer_unverified(tmp_path: Path, fmt: str, stream: bool, where: str,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*_args: Any, **_kwargs: Any) -> Any:
        raise RuntimeError("a supervisor bug")

    if where == "digest":
        monkeypatch.setattr(gating.digest, "build", broken)
    else:
        monkeypatch.setattr(BY_NAME[fmt], "extend_history", broken)
    async with gated(tmp_path, [DONE, REWORKED], Verifier([verdict("gaps", (GAP,))])) as run:
        text, calls, _ = await send(run, fmt, stream)
    assert (read_noticed(text), calls) == (noticed(DONE["text"]), [])
    gate = run.last("gate")
    assert (gate["outcome"], gate["passed"]) == ("unverified", False) and "RuntimeError" in gate["reason"]
    assert run.ledger()[-1]["status"] == 200


async def test_a_client_leaving_mid_verdict_cancels_it_and_its_retry_is_judged_afresh(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(continuation, "KEEPALIVE_S", 0.01)
    cancelled = trio.Event()

    class Hanging(Verifier):
        async def __call__(self, messages: list[dict[str, str]]) -> ModelAnswer:
            try:
                return await super().__call__(messages)
            except trio.Cancelled:
                cancelled.set()
                raise

    verifier = Hanging([verdict()])
    verifier.release = trio.Event()
    body = request_body("messages", True)
    async with gated(tmp_path, [DONE, DONE], verifier) as run:
        async with http_client() as client, client.stream(
                "POST", run.proxy.url + BY_NAME["messages"].path, content=orjson.dumps(body),
                headers={"content-type": "application/json", "x-proxyvisor-session": "gate-test"}) as response:
            async for chunk in response.aiter_raw():
                assert chunk.replace(BY_NAME["messages"].keepalive, b"") == b""
                break  # a keep-alive came: the verdict is pending; the client goes away
        with trio.fail_after(10):
            await cancelled.wait()
        verifier.release.set()
        text, _, _ = await send(run, "messages", True, body)
    assert text == DONE["text"]
    assert (run.last("gate")["verdicts"], run.last("gate")["passed"]) == (["pass"], True)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_a_request_cut_off_mid_verdict_has_its_ledger_line_saying_the_verdict_was_abandoned(
        tmp_path: Path, stream: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The client leaves while its turn's verdict is awaited: one ledger line, saying how the request ended (a
    stream: its status and "client disconnected mid-stream"; JSON: 499, as any request left before its answer) and
    that the turn is unverified, its verdict abandoned."""
    monkeypatch.setattr(continuation, "KEEPALIVE_S", 0.01)
    verifier = Verifier([verdict()])
    verifier.release = trio.Event()  # the verdict never comes
    async with gated(tmp_path, [DONE], verifier) as run:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(send, run, "chat", stream)
            with trio.fail_after(10):
                while not verifier.calls:
                    await trio.sleep(0.005)
            nursery.cancel_scope.cancel()  # the client leaves
        with trio.fail_after(10):
            while not run.store.sessions() or not run.ledger():
                await trio.sleep(0.01)
        (line,) = run.ledger()
    assert (line["status"], line["error"]) == ((200, "client disconnected mid-stream") if stream else
                                               (499, "cancelled before the answer: the client left"))
    assert (line["gate"]["outcome"], line["gate"]["passed"], line["gate"]["reason"]) == ("unverified", False,
                                                                                          gating.ABANDONED)


# ---- GatedStream on arbitrary chunking ----------------------------------------------------------------------------------


def _gated(judge: Any, chunks: Any) -> Encoded:
    """The agent's bytes of a :class:`~proxyvisor.proxy.gating.GatedStream` over ``chunks``."""
    return Encoded(gating.GatedStream(judge, chunks))


class _Chunks:
    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks = chunks
        self.error = None

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for chunk in self.chunks:
            yield chunk


def _chunked(data: bytes, size: int) -> list[bytes]:
    return [data[i:i + size] for i in range(0, len(data), size)]


class _Judge:
    """A stand-in ``Gating`` for :class:`GatedStream`: records the held responses it is asked to judge and
    delivers each unchanged, with ``notice`` appended when given."""

    def __init__(self, fmt: str, hold: str = "answer", notice: str | None = None) -> None:
        self.fmt = BY_NAME[fmt]
        self.config = GateConfig(hold=hold)
        self.background = None
        self.cut = Cut()
        self.notice = notice
        self.judged_texts: list[str] = []

    def _calls_tools(self, response: dict[str, Any]) -> bool:
        return bool(self.fmt.parse_response(response).tool_calls)

    async def judged(self, held: Callable[[], dict[str, Any]]) -> None:
        self.judged_texts.append(self.fmt.parse_response(held()).text)


@pytest.mark.parametrize("size", [1, 7, 64, 1 << 16])
@pytest.mark.parametrize("fmt", FORMATS)
async def test_a_held_stream_split_anywhere_is_judged_whole_and_sent_byte_for_byte(fmt: str, size: int) -> None:
    w = BY_NAME[fmt]
    data = b"".join(w.render_stream(AssistantTurn("Done: the bug is fixed, all \u00e9 of it."), MODEL,
                                    request_body(fmt, True)))
    judge = _Judge(fmt)
    stream = _gated(judge, _Chunks(_chunked(data, size)))
    out = b"".join([chunk async for chunk in stream])
    assert out == data and stream.error is None
    assert judge.judged_texts == ["Done: the bug is fixed, all \u00e9 of it."]


@pytest.mark.parametrize("size", [1, 7, 64, 1 << 16])
@pytest.mark.parametrize("fmt", FORMATS)
async def test_a_tool_call_starting_mid_chunk_flushes_everything_held_and_streams_the_rest(fmt: str,
                                                                                          size: int) -> None:
    w = BY_NAME[fmt]
    turn = AssistantTurn("Let me look.", (ToolCall("Bash", {"command": "ls"}, "call_1"),))
    data = b"".join(w.render_stream(turn, MODEL, request_body(fmt, True)))
    judge = _Judge(fmt)
    stream = _gated(judge, _Chunks(_chunked(data, size)))
    out = b"".join([chunk async for chunk in stream])
    assert out == data and stream.error is None
    assert judge.judged_texts == []


@pytest.mark.parametrize(("fmt", "stream"), MODES, ids=IDS)
async def test_a_failed_continuation_is_not_put_back_into_later_requests(
        tmp_path: Path, fmt: str, stream: bool) -> None:
    # The agent received the held answer itself: its next request carries it, and the advisory that was never
    # answered must not come back in front of it. (A 400: a 5xx would cool the pool, refusing the next request.)
    async with gated(tmp_path, [DONE, {"fault": {"status": 400}}, REWORKED], Verifier([verdict("gaps", (GAP,))])) as run:
        text, _, _ = await send(run, fmt, stream)
        assert read_noticed(text) == noticed(DONE["text"])
        w = BY_NAME[fmt]
        body = request_body(fmt, stream)
        w.extend_history(body, [{"role": "assistant", "content": DONE["text"]}, w.user_item("Thanks. Next, add docs.")])
        await send(run, fmt, stream, body)
    last = orjson.dumps(run.upstream_bodies()[-1]).decode()
    assert GAP[0] not in last and last.count(DONE["text"]) == 1


# ---- read-back -------------------------------------------------------------------------------------------------------
LONG_FAILURE = "\n".join([f"tests/test_{n:03d}.py::test_case PASSED" for n in range(1, 200)]
                         + ["E   assert parse('<x>') == 4", "FAILED tests/test_200.py::test_case", "1 failed, 199 passed",
                            *[f"teardown {n:03d} ..... ok" for n in range(110)], "Exit code 1"])
"""A failing run whose summary sits just before the digest's tail (2,000 characters of teardown lines)."""
PASSED = "200 passed in 1.52s"


@pytest.mark.parametrize("fmt", FORMATS)
async def test_the_verifier_reads_back_a_clipped_failure_once_then_judges(tmp_path: Path, fmt: str) -> None:
    # A failed run, then the same check passing: the free evidence leaves the turn to the model, whose digest
    # shows the failure clipped; the scripted policy reads its omitted end back before it judges.
    policy = Verifier([scripted_verifier_answer] * 3, [scripted_verifier_answer])
    body = with_history(fmt, True, "Fix the parser.", check=PASSED, failed_first=LONG_FAILURE)
    async with gated(tmp_path, [DONE], policy) as run:
        await send(run, fmt, True, body)
    assert policy.purposes() == ["verify", "verify"]
    first, second = policy.calls[0][1][1]["content"], policy.calls[1][1][1]["content"]
    asked = orjson.loads(scripted_verifier_answer(policy.calls[0][1]))
    (entry,) = asked["read"]
    low, high = (int(n) for n in entry["lines"].split("-"))
    lines = LONG_FAILURE.split("\n")
    assert "E   assert parse" not in first and "chars omitted: lines" in first
    assert second.startswith(first) and "<readback" in second  # the same evidence, then the lines asked for
    readback = second[len(first):]
    assert f"{lines.index('1 failed, 199 passed') + 1}| 1 failed, 199 passed" in readback
    assert "E   assert parse('&lt;x&gt;') == 4" in readback  # verbatim, escaped as data
    assert readback.count("| ") == high - low + 1
    gate = run.last("gate")
    assert (gate["readbacks"], gate["verdicts"], gate["outcome"]) == (1, ["pass"], "verified")
    assert run.ledger()[-1]["supervisor_model"]["calls"] == {"verify": 2}


async def test_a_second_read_request_is_malformed(tmp_path: Path) -> None:
    read = orjson.dumps({"verdict": "read", "read": [{"action": 2, "lines": "1-3"}]}).decode()
    verifier = Verifier([read, read, verdict()])
    body = with_history("chat", False, "Fix the parser.", check=PASSED, failed_first=LONG_FAILURE)
    async with gated(tmp_path, [DONE], verifier) as run:
        text, _, _ = await send(run, "chat", False, body)
    assert text == DONE["text"] and verifier.purposes() == ["verify"] * 3
    assert verifier.calls[2][1][-1]["content"] == FORMAT_RETRY  # the second read: one format retry
    gate = run.last("gate")
    assert (gate["readbacks"], gate["verdicts"], gate["passed"]) == (1, ["malformed", "pass"], True)
