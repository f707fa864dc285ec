"""The plan on the supervised path (``proxyvisor.proxy.planning``), through a running proxy in every format: a
``request`` signal leads to one planner call on the next request, the plan is recited at the request tail,
``phase_complete`` advances it, a planner failure changes nothing, a broken ``file_exists`` assumption adds a note
and reassesses; and the gate's hooks (``reconcile``, ``clear``); and the scripted upstream as a planner."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import trio

from proxyvisor.scripted import upstream as scripted
from proxyvisor.scripted import planner as scripted_planner
from proxyvisor.scripted.upstream import ScriptedUpstream
from proxyvisor.config import Config, GateConfig, ModelConfig, PlanConfig
from proxyvisor.detectors.selfreport import SelfReport
from proxyvisor.gate.recite import CONSTRAINTS
from proxyvisor.gate.plan import COMPLETED, IN_PROGRESS, PLANNER_INSTRUCTIONS, planner_input
from proxyvisor.proxy.formats import BY_NAME, CHAT, ToolSpec, WireFormat
from proxyvisor.proxy.planning import clear, reconcile
from proxyvisor.proxy.service import running
from proxyvisor.proxy.sessions import Session
from proxyvisor.proxy.sse import SSEParser
from proxyvisor.proxy.supervise import Supervisor
from proxyvisor.store import Store
from proxyvisor.supervisor_model import ModelAnswer

FORMATS = ("chat", "messages", "responses")
BASH = ToolSpec("Bash", {"type": "object", "properties": {"command": {"type": "string"}}})
GOAL = "Split the parser into a lexer and a grammar module, port the rules, then run the suite."


def report(plan: str | None, state: str = "progressing") -> str:
    return "<sup>" + json.dumps({"state": state, "focus": "parser split", "next": "go on", "carry": ["parser.py"],
                                 "plan": plan}) + "</sup>"


def create(valid_if: str | None = None) -> str:
    return json.dumps({"decision": "create", "title": "Split the parser", "tasks": [
        {"title": "Read the parser", "done_when": "its rules are listed", "valid_if": valid_if},
        {"title": "Split it", "done_when": "lexer.py and grammar.py exist", "valid_if": None},
        {"title": "Run the suite", "done_when": "the tests pass", "valid_if": None}]})


class Planner:
    """A planner double: answers each call with the next of ``answers`` (text, or a :class:`ModelAnswer` with its
    usage; an exception is raised; ``hang`` never answers); records each call's input."""

    def __init__(self, *answers: Any) -> None:
        self.answers = list(answers)
        self.inputs: list[dict[str, Any]] = []

    async def __call__(self, messages: list[dict[str, str]]) -> ModelAnswer:
        assert messages[0] == {"role": "system", "content": PLANNER_INSTRUCTIONS}
        self.inputs.append(json.loads(messages[1]["content"]))
        answer = self.answers.pop(0)
        if answer == "hang":
            await trio.sleep_forever()
        if isinstance(answer, Exception):
            raise answer
        return answer if isinstance(answer, ModelAnswer) else ModelAnswer(answer)


def config(**plan: Any) -> Config:
    # The gate is off: its verifier calls would go to the same model double.
    return Config().with_overrides(supervisor={"gate": GateConfig(enabled=False), "plan": PlanConfig(**plan)})


def call(n: int, command: str = "ls") -> dict[str, Any]:
    return {"id": f"call_{n}", "type": "function", "function": {"name": "Bash",
                                                                "arguments": json.dumps({"command": command})}}


class Agent:
    """Drives one conversation through the proxy: each :meth:`turn` queues the model's next answer, sends the
    history so far (in ``fmt``) and appends the answer and a tool result to it, as an agent would."""

    def __init__(self, proxy: Any, fmt: WireFormat, stream: bool = False) -> None:
        self.proxy, self.fmt, self.stream = proxy, fmt, stream
        self.upstream: ScriptedUpstream = proxy.scripted["scripted"]
        self.history: list[dict[str, Any]] = [{"role": "system", "content": "You are a coding agent."},
                                              {"role": "user", "content": GOAL}]
        self.n = 0

    async def turn(self, text: str, output: str = "ok") -> dict[str, Any]:
        """One request; the model answers ``text`` and one ``ls`` call, whose result is ``output``. Returns the
        body the upstream received."""
        self.n += 1
        self.upstream.queue({"text": text, "tool_calls": [{"name": "Bash", "arguments": {"command": "ls"},
                                                           "id": f"call_{self.n}"}]})
        body = self.fmt.request_from_chat(orjson.loads(orjson.dumps(self.history)), "m", self.stream, (BASH,))
        async with httpx.AsyncClient(timeout=30) as client:
            response = await client.post(f"{self.proxy.url}/s/planning{self.fmt.path}", json=body)
        assert response.status_code == 200, response.text
        if self.stream:
            got = self.fmt.assemble([(e.event, e.data) for e in SSEParser().feed(response.content)])
        else:
            got = self.fmt.parse_response(response.json())
        assert "<sup>" not in got.text and [c.id for c in got.tool_calls] == [f"call_{self.n}"]
        self.history += [{"role": "assistant", "content": got.text or None, "tool_calls": [call(self.n)]},
                         {"role": "tool", "tool_call_id": f"call_{self.n}", "content": output}]
        return orjson.loads(self.upstream.requests[-1][1])

    def tail(self, body: dict[str, Any]) -> str:
        """The text of the last history item the upstream received."""
        return self.fmt.message(self.fmt.history(body)[-1]).text

    def recitation(self, body: dict[str, Any]) -> str:
        """The text of the latest history item carrying a recitation the upstream received ("" when none)."""
        texts = [self.fmt.message(item).text for item in self.fmt.history(body)]
        return next((t for t in reversed(texts) if 'signal="recite"' in t), "")

    def thread(self) -> Any:
        (session,) = self.proxy.pipeline.sessions.all()
        (thread,) = session.supervision.threads.values()
        return thread

    def plan_calls(self) -> int:
        (session,) = self.proxy.pipeline.sessions.all()
        return sum(r.model.calls["plan"] for r in session.supervision.records)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("fmt_name", FORMATS)
async def test_a_request_signal_makes_a_plan_that_is_recited_and_advanced(tmp_path: Path, fmt_name: str,
                                                                          stream: bool) -> None:
    planner = Planner(ModelAnswer(create(), 2300, 140, 0.0021),
                      ModelAnswer(json.dumps({"decision": "advance", "summary": "listed the rules"}), 2600, 30, None))
    store = Store(tmp_path / "state")
    async with running(config(), port=0, store=store, scripted={"scripted": ScriptedUpstream()},
                       model=planner) as proxy:
        agent = Agent(proxy, BY_NAME[fmt_name], stream)
        first = await agent.turn("Reading the parser. " + report("request"))
        assert "Live plan" not in json.dumps(first) and planner.inputs == []
        # The next request carries the pending signal: one planner call, before it goes upstream.
        second = await agent.turn("Listed the rules. " + report("phase_complete"))
        assert len(planner.inputs) == 1 and agent.plan_calls() == 1
        sent = planner.inputs[0]
        assert sent["signal"] == "request" and sent["current_request"] == GOAL and sent["active_plan"] is None
        assert sent["agent_tools"] == ["Bash"] and sent["agent_handoff"]["carry"] == ["parser.py"]
        assert sent["agent_instructions"] == "You are a coding agent."
        assert any("Bash" in line and "ok" in line for line in sent["recent_actions"])
        assert "Live plan (0/3 done): Split the parser" in agent.tail(second)
        assert "[>] 1. Read the parser - done when: its rules are listed" in agent.tail(second)
        # phase_complete: the planner sees the plan and the new evidence, and advances.
        third = await agent.turn("Splitting now. " + report(None))
        assert len(planner.inputs) == 2 and planner.inputs[1]["signal"] == "phase_complete"
        assert planner.inputs[1]["active_plan"]["current_phase"] == 1
        plan = agent.thread().plan
        assert [p.status for p in plan.phases] == [COMPLETED, IN_PROGRESS, "pending"]
        assert plan.phases[0].summary == "listed the rules"
        assert "Live plan (1/3 done)" in agent.tail(third)
        # No signal: no call; the plan is unchanged, so not recited again: each earlier recitation is back where
        # it was first sent, once.
        fourth = await agent.turn("Still splitting. " + report("request"))
        assert len(planner.inputs) == 2
        assert "Live plan" not in agent.tail(fourth)
        text = json.dumps(fourth)
        assert text.count("Live plan (0/3 done)") == 1 and text.count("Live plan (1/3 done)") == 1
        # A request signal while a plan is open is ignored.
        await agent.turn("More. " + report(None))
        assert len(planner.inputs) == 2
    # Each planner answer's usage is in its request's ledger line, as the answer carried it.
    uses = [line.get("supervisor_model") for line in store.read_ledger("planning")]
    assert [(u["calls"], u["input_tokens"], u["output_tokens"], u["cost_usd"], u.get("unpriced")) if u else None
            for u in uses] == [None, ({"plan": 1}, 2300, 140, 0.0021, None), ({"plan": 1}, 2600, 30, 0.0, 1), None,
                               None]


@pytest.mark.parametrize("failure", ["raises", "malformed", "not allowed", "hang"])
@pytest.mark.parametrize("fmt_name", FORMATS)
async def test_a_planner_failure_changes_nothing(tmp_path: Path, fmt_name: str, failure: str) -> None:
    answer = {"raises": RuntimeError("planner down"), "malformed": "I think a plan is good",
              "not allowed": json.dumps({"decision": "advance", "summary": "x"}), "hang": "hang"}[failure]
    planner = Planner(answer)
    async with running(config(timeout_s=0.05), port=0, store=Store(tmp_path / "state"),
                       scripted={"scripted": ScriptedUpstream()}, model=planner) as proxy:
        agent = Agent(proxy, BY_NAME[fmt_name])
        await agent.turn("Start. " + report("request"))
        second = await agent.turn("Go on. " + report(None))
        assert len(planner.inputs) == 1 and agent.plan_calls() == 1  # counted, failed or not
        thread = agent.thread()
        assert thread.plan is None and thread.plan_signal is None  # consumed: not retried on every request
        assert "Live plan" not in json.dumps(second)
        await agent.turn("Again. " + report("request"))
        await agent.turn("More. " + report(None))
        assert len(planner.inputs) == 1  # the latch: one request signal per user turn


@pytest.mark.parametrize("fmt_name", FORMATS)
async def test_a_broken_assumption_adds_a_note_once_and_reassesses(tmp_path: Path, fmt_name: str) -> None:
    marker = tmp_path / "parser.py"
    marker.write_text("rules\n")
    planner = Planner(create(f"file_exists: {marker}"), json.dumps({"decision": "hold", "reason": "re-read it"}))
    async with running(config(), port=0, store=Store(tmp_path / "state"), scripted={"scripted": ScriptedUpstream()},
                       model=planner) as proxy:
        agent = Agent(proxy, BY_NAME[fmt_name])
        await agent.turn("Start. " + report("request"))
        second = await agent.turn("Reading. " + report(None))
        assert agent.thread().plan.phases[0].valid_if.path == str(marker)
        assert "plan_assumption" not in json.dumps(second)
        marker.unlink()
        third = await agent.turn("Reading on. " + report(None))
        text = json.dumps(third)
        assert text.count('signal=\\"plan_assumption\\"') == 1 and str(marker) in text
        assert len(planner.inputs) == 2 and planner.inputs[1]["signal"] == "reassess"
        assert text.count('signal=\\"plan_hold\\"') == 1 and "re-read it" in text  # the hold's reason
        # The plan is unchanged (held): its recitation stays where the second request put it.
        assert text.count("(valid if file_exists:") == 1 and "(valid if" not in agent.tail(third)
        fourth = await agent.turn("Done reading. " + report(None))
        text = json.dumps(fourth)
        # The same broken set: no new note (the first is re-inserted where it was), no new call.
        assert text.count('signal=\\"plan_assumption\\"') == 1 and text.count('signal=\\"plan_hold\\"') == 1
        assert len(planner.inputs) == 2
        assert agent.thread().plan.phases[0].status == IN_PROGRESS  # held


async def test_prohibitions_are_recited_after_the_request_is_no_longer_last(tmp_path: Path) -> None:
    async with running(config(), port=0, store=Store(tmp_path / "state"), scripted={"scripted": ScriptedUpstream()},
                       model=Planner()) as proxy:
        agent = Agent(proxy, CHAT)
        agent.history[1]["content"] = "Tidy the README. Do not run the test suite."
        first = await agent.turn("Looking. " + report(None))
        assert CONSTRAINTS not in json.dumps(first)  # the request itself is the last item
        second = await agent.turn("Editing. " + report(None))
        assert agent.tail(second).endswith(
            f"{CONSTRAINTS}\n- Do not run the test suite.\n"
            "</pay-attention></supervisor-note>")
        assert "Goal (fixed)" not in agent.tail(second)  # the request is still in the context


async def test_the_goal_is_recited_once_the_history_was_rewritten(tmp_path: Path) -> None:
    async with running(config(), port=0, store=Store(tmp_path / "state"), scripted={"scripted": ScriptedUpstream()},
                       model=Planner()) as proxy:
        agent = Agent(proxy, CHAT)
        await agent.turn("One. " + report(None))
        second = await agent.turn("Two. " + report(None))
        assert "pay-attention" not in json.dumps(second)  # no plan, no prohibition, the request still in view
        agent.history = agent.history[:2] + agent.history[-2:]  # the agent prunes its older rounds
        third = await agent.turn("Three. " + report(None))
        assert f"Goal (fixed): <intent>{GOAL}</intent>" in agent.tail(third)
        agent.history.append({"role": "user", "content": "Now update the changelog too."})
        fourth = await agent.turn("Four. " + report(None))
        # A new request: in plain view, nothing new to recite; the goal's recitation stays where it was.
        assert "pay-attention" not in agent.tail(fourth) and json.dumps(fourth).count("pay-attention") == 2
        fifth = await agent.turn("Five. " + report(None))
        assert json.dumps(fifth).count("pay-attention") == 2
        assert agent.thread().planning.goal == "Now update the changelog too."
        # A rewritten history whose request is another one: a new turn, not the old goal recited over it.
        changelog = next(i for i, m in enumerate(agent.history) if m["content"] == "Now update the changelog too.")
        agent.history = agent.history[:changelog] + [{"role": "user", "content": "Rename the module instead."}]
        await agent.turn("Six. " + report(None))
        seventh = await agent.turn("Seven. " + report(None))
        assert "pay-attention" not in agent.tail(seventh)
        assert json.dumps(seventh).count("pay-attention") == 2  # the old one is still in the kept history
        assert agent.thread().planning.goal == "Rename the module instead."


async def test_recitation_off_and_planning_off(tmp_path: Path) -> None:
    planner = Planner(create())
    async with running(config(recite=False), port=0, store=Store(tmp_path / "state"),
                       scripted={"scripted": ScriptedUpstream()}, model=planner) as proxy:
        agent = Agent(proxy, CHAT)
        await agent.turn("Start. " + report("request"))
        second = await agent.turn("Go. " + report(None))
        assert len(planner.inputs) == 1 and agent.thread().plan is not None
        assert "pay-attention" not in json.dumps(second)
    planner = Planner(create())
    async with running(config(enabled=False), port=0, store=Store(tmp_path / "state2"),
                       scripted={"scripted": ScriptedUpstream()}, model=planner) as proxy:
        agent = Agent(proxy, CHAT)
        await agent.turn("Start. " + report("request"))
        await agent.turn("Go. " + report(None))
        assert planner.inputs == [] and agent.thread().plan is None


def _exchange(planner: Planner) -> tuple[Any, Any]:
    supervisor = Supervisor(config().supervisor, model=planner)
    body = CHAT.request_from_chat([{"role": "system", "content": "sys"}, {"role": "user", "content": GOAL},
                                   {"role": "assistant", "content": None, "tool_calls": [call(1, "pytest")]},
                                   {"role": "tool", "tool_call_id": "call_1", "content": "3 passed"}],
                                  "m", False, (BASH,))
    session = Session("s", 0.0, 0.0)
    return supervisor.begin(session, CHAT, body), session


async def test_reconcile_runs_the_final_answers_signal_before_the_gate_and_clear_drops_the_plan() -> None:
    planner = Planner(create())
    exchange, _session = _exchange(planner)
    await exchange.before_forward()
    assert planner.inputs == []
    final = SelfReport("done", "parser split", None, (), "request")
    await reconcile(exchange, final)
    assert len(planner.inputs) == 1 and exchange.record.model.calls["plan"] == 1
    assert any("pytest" in line for line in planner.inputs[0]["recent_actions"])
    thread = exchange.thread
    assert thread.plan is not None and thread.plan_signal is None
    # The reply's report, taken by reconcile already, is not taken again when the exchange finishes...
    exchange._finish(['{"state":"done","focus":"parser split","next":null,"carry":[],"plan":"request"}'])
    assert thread.plan_signal is None
    # ...but a reply continued past it (a gate re-entry that ended in tool calls) has its own signal, taken.
    exchange._finish(['{"state":"progressing","focus":"x","next":null,"carry":[],"plan":"phase_complete"}'])
    assert thread.plan_signal == "phase_complete"
    clear(thread)
    assert thread.plan is None and thread.plan_signal is None


async def test_reconcile_without_a_planner_or_a_signal_does_nothing() -> None:
    planner = Planner()
    exchange, _session = _exchange(planner)
    await reconcile(exchange, None)
    await reconcile(exchange, SelfReport("done", "x", None, (), None))
    assert planner.inputs == [] and exchange.thread.plan is None
    bare = Supervisor(config().supervisor).begin(Session("t", 0.0, 0.0), CHAT, CHAT.request_from_chat(
        [{"role": "user", "content": GOAL}], "m", False, (BASH,)))
    await reconcile(bare, SelfReport("done", "x", None, (), "request"))  # no model: no planner
    assert bare.thread.plan is None


# ---- the scripted upstream as a planner ----------------------------------------------------------------------------
def planner_call(document: str) -> dict[str, Any]:
    return CHAT.request_from_chat([{"role": "system", "content": PLANNER_INSTRUCTIONS},
                                   {"role": "user", "content": document}], "scripted-model", False, ())


def test_the_scripted_policy_creates_advances_and_holds() -> None:
    body = planner_call(planner_input("request", "Add a --json flag to the CLI\nand document it"))
    assert scripted.policy(CHAT, body) is scripted_planner.answer
    created = json.loads(scripted_planner.answer(CHAT, body))
    assert created["decision"] == "create" and created["title"] == "Add a --json flag to the CLI"
    assert [t["title"].split(":")[0] for t in created["tasks"]] == ["Understand", "Change", "Verify"]
    assert all(t["done_when"] for t in created["tasks"])
    exchange, _ = _exchange(Planner())
    ok = json.loads(scripted_planner.answer(CHAT, planner_call(planner_input(
        "phase_complete", "r", actions=_actions(exchange)))))
    assert ok["decision"] == "advance" and "pytest" in ok["summary"]
    held = json.loads(scripted_planner.answer(CHAT, planner_call(planner_input("phase_complete", "r"))))
    assert held["decision"] == "hold"
    assert json.loads(scripted_planner.answer(CHAT, planner_call(planner_input("reassess", "r"))))["decision"] == "hold"
    assert scripted.policy(CHAT, CHAT.request_from_chat(
        [{"role": "system", "content": "You are a coding agent."}, {"role": "user", "content": "{}"}], "m", False, ())) is None


def _actions(exchange: Any) -> list[Any]:
    from proxyvisor.gate.digest import turn_actions

    return turn_actions([CHAT.message(i) for i in exchange.items[2:]], exchange.schemas)


@pytest.mark.parametrize("fmt", ["chat", "messages", "responses"])
async def test_the_planner_call_takes_the_sessions_own_route_by_default(tmp_path: Path, fmt: str) -> None:
    """No ``[supervisor.model]``: the planner call goes to the agent's upstream in its format, asking for the
    decision's schema (a forced tool on Anthropic, which the scripted upstream answers with that tool's call)."""
    async with running(config(), port=0, store=Store(tmp_path / "state"),
                       scripted={"scripted": ScriptedUpstream()}) as proxy:
        agent = Agent(proxy, BY_NAME[fmt])
        await agent.turn("Start. " + report("request"))
        second = await agent.turn("Looked. " + report("phase_complete"))
        (call_body,) = [orjson.loads(b) for b in agent.upstream.supervisor_requests]
        assert "Live plan (0/3 done)" in agent.tail(second)
    assert call_body["model"] == "m" and call_body["stream"] is False
    structured = {"chat": "response_format", "messages": "tool_choice", "responses": "text"}[fmt]
    assert structured in call_body


async def test_the_scripted_upstream_answers_planner_calls_through_litellm(tmp_path: Path) -> None:
    """``api_base = "scripted:"``: the planner call goes through litellm to the embedded scripted upstream."""
    cfg = config().with_overrides(supervisor={"model": ModelConfig(name="scripted-model", api_base="scripted:")})
    async with running(cfg, port=0, store=Store(tmp_path / "state"),
                       scripted={"scripted": ScriptedUpstream()}) as proxy:
        agent = Agent(proxy, CHAT)
        await agent.turn("Start. " + report("request"))
        second = await agent.turn("Looked. " + report("phase_complete"))
        assert len(agent.upstream.supervisor_requests) == 1
        assert "Live plan (0/3 done)" in agent.tail(second)
        third = await agent.turn("Changed. " + report(None))
        assert len(agent.upstream.supervisor_requests) == 2
        assert "Live plan (1/3 done)" in agent.tail(third)


@pytest.mark.parametrize("fmt_name", FORMATS)
async def test_prohibitions_stand_across_user_turns_until_lifted(tmp_path: Path, fmt_name: str) -> None:
    """A prohibition of turn 1 stands through turn 2, a permission in turn 3 lifts it, turn 4 adds another: /plan
    (the chat command and the endpoint) and the recitation show what is in force, with its source turn."""
    async with running(config(), port=0, store=Store(tmp_path / "state"), scripted={"scripted": ScriptedUpstream()},
                       model=Planner()) as proxy:
        agent = Agent(proxy, BY_NAME[fmt_name])
        agent.history[1]["content"] = "Tidy the README. Do not run the tests."

        async def user(text: str) -> dict[str, Any]:
            # The agent ended its turn with an answer; the user writes the next one.
            agent.history += [{"role": "assistant", "content": "Done for now."}, {"role": "user", "content": text}]
            await agent.turn("On it. " + report(None))
            return await agent.turn("Still on it. " + report(None))  # the user turn is no longer the last item

        async def plan() -> dict[str, Any]:
            async with httpx.AsyncClient(timeout=30) as client:
                return (await client.get(f"{proxy.url}/proxyvisor/sessions/planning/plan")).json()

        await agent.turn("Reading. " + report(None))
        after_two = await user("Also fix the typo in the intro.")
        assert agent.recitation(after_two).endswith(f"{CONSTRAINTS}\n- Do not run the tests.\n"
                                              "</pay-attention></supervisor-note>")
        assert (await plan())["prohibitions"] == [{"turn": 1, "text": "Do not run the tests."}]
        after_three = await user("You can run the tests now.")
        assert CONSTRAINTS not in agent.tail(after_three) and (await plan())["prohibitions"] == []
        after_four = await user("Never push to main.")
        assert agent.recitation(after_four).endswith(f"{CONSTRAINTS}\n- Never push to main.\n"
                                               "</pay-attention></supervisor-note>")
        got = await plan()
        assert got["prohibitions"] == [{"turn": 4, "text": "Never push to main."}]
        assert "Prohibitions in force" in got["text"] and "- [turn 4] Never push to main." in got["text"]
        # The agent's user asks /plan in the chat: the same text, answered by proxyvisor.
        body = agent.fmt.request_from_chat(orjson.loads(orjson.dumps(agent.history))
                                           + [{"role": "assistant", "content": "Done for now."},
                                              {"role": "user", "content": "/plan"}], "m", False, (BASH,))
        async with httpx.AsyncClient(timeout=30) as client:
            response = await client.post(f"{proxy.url}/s/planning{agent.fmt.path}", json=body)
        assert agent.fmt.parse_response(response.json()).text == got["text"]


async def test_a_compacted_history_keeps_the_prohibitions_in_force(tmp_path: Path) -> None:
    """The turn that stated a prohibition is pruned from the history; the latest request is unchanged, so the
    prohibition still stands and is recited (a compaction lifts nothing)."""
    async with running(config(), port=0, store=Store(tmp_path / "state"), scripted={"scripted": ScriptedUpstream()},
                       model=Planner()) as proxy:
        agent = Agent(proxy, CHAT)
        await agent.turn("Reading. " + report(None))
        agent.history += [{"role": "assistant", "content": "Done for now."},
                          {"role": "user", "content": "Do not run the tests."},
                          {"role": "assistant", "content": "Understood."},
                          {"role": "user", "content": "Go on with the split."}]
        await agent.turn("Splitting. " + report(None))
        before = await agent.turn("Still splitting. " + report(None))
        assert "- Do not run the tests." in agent.recitation(before)
        agent.history = agent.history[:2] + agent.history[-5:]  # turn 2 is pruned; the latest request stays
        assert all(m.get("content") != "Do not run the tests." for m in agent.history)
        after = await agent.turn("Three. " + report(None))
        assert agent.tail(after).endswith(f"{CONSTRAINTS}\n- Do not run the tests.\n"
                                          "</pay-attention></supervisor-note>")
        assert [(r.turn, r.text) for r in agent.thread().planning.rules] == [(2, "Do not run the tests.")]
