"""A recitation stays put (``proxyvisor.proxy.planning``, "Recitation"): over consecutive supervised requests of a
growing history, in every format, streamed and not, each upstream request is a byte prefix of the next
(``WireFormat.prompt``, ``shared_prefix``) except where the agent rewrote its history; a recitation whose content
changes is recited once more, at the new tail, the old one staying where it was; a gate re-entry of a turn that
carried one keeps the prefix; an unchanged recitation far back is recited again at the tail."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from proxyvisor.scripted.upstream import ScriptedUpstream
from proxyvisor.config import Config
from proxyvisor.gate.plan import PLANNER_INSTRUCTIONS
from proxyvisor.gate.verdict import VERIFIER_INSTRUCTIONS
from proxyvisor.proxy.formats import BY_NAME, ToolSpec, WireFormat
from proxyvisor.proxy.formats.base import shared_prefix
from proxyvisor.proxy.planning import RECITE_AFTER
from proxyvisor.proxy.service import running
from proxyvisor.proxy.sse import SSEParser
from proxyvisor.store import Store
from proxyvisor.supervisor_model import ModelAnswer

FORMATS = ("chat", "messages", "responses")
MODES = [(f, s) for f in FORMATS for s in (False, True)]
IDS = [f"{f}-{'sse' if s else 'json'}" for f, s in MODES]
BASH = ToolSpec("Bash", {"type": "object", "properties": {"command": {"type": "string"}}})
GOAL = "Split the parser into a lexer and a grammar module. Do not push to main."
RECITED = b'signal=\\"recite\\"'
"""A recitation's wrapper as it appears inside a JSON body."""
PLAN = json.dumps({"decision": "create", "title": "Split the parser", "tasks": [
    {"title": "Read the parser", "done_when": "its rules are listed", "valid_if": None},
    {"title": "Split it", "done_when": "lexer.py and grammar.py exist", "valid_if": None}]})


def report(state: str = "progressing", plan: str | None = None) -> str:
    return "<sup>" + json.dumps({"state": state, "focus": "the split", "next": None, "carry": [], "plan": plan}) + "</sup>"


def verdict(gaps: bool) -> str:
    requirement = {"id": 1, "requirement": "split the parser", "status": "unmatched" if gaps else "matched",
                   "basis": "recorded_output" if gaps else None, "evidence": "x"}
    return json.dumps({"requirements": [requirement],
                       "gaps": [{"requirement": 1, "gap": "the split was not checked", "settles": "a listing"}]
                       if gaps else [], "handback": None, "verdict": "gaps" if gaps else "pass"})


class Model:
    """The supervisor model double: the planner gets ``PLAN``, the verifier gaps once then a pass; anything else
    (a refuter) finds nothing."""

    def __init__(self) -> None:
        self.verdicts = [verdict(True)]
        self.purposes: list[str] = []

    async def __call__(self, messages: list[dict[str, str]]) -> ModelAnswer:
        system = messages[0]["content"]
        if system == PLANNER_INSTRUCTIONS:
            self.purposes.append("plan")
            return ModelAnswer(PLAN)
        if system == VERIFIER_INSTRUCTIONS:
            self.purposes.append("verify")
            return ModelAnswer(self.verdicts.pop(0) if self.verdicts else verdict(False))
        self.purposes.append("other")
        return ModelAnswer('{"findings": []}')


class Agent:
    """Drives one conversation through the proxy as an agent does: each :meth:`turn` queues the model's answers,
    sends the history so far in ``fmt`` and appends what it got back (and a result for each tool call)."""

    def __init__(self, proxy: Any, fmt: WireFormat, stream: bool) -> None:
        self.proxy, self.fmt, self.stream = proxy, fmt, stream
        self.upstream: ScriptedUpstream = proxy.scripted["scripted"]
        self.history: list[dict[str, Any]] = [{"role": "system", "content": "You are a coding agent."},
                                              {"role": "user", "content": GOAL}]
        self.n = 0
        self.prefix = "/s/prefix"
        """The session path prefix the agent sends its requests under ("": none, a client that sends no id)."""
        self.rewrites: set[int] = set()
        """Upstream request numbers (0-based) before which the agent rewrote its history."""

    def step(self, text: str) -> dict[str, Any]:
        """A model answer with ``text`` and one tool call."""
        self.n += 1
        return {"text": text, "tool_calls": [{"name": "Bash", "arguments": {"command": f"ls {self.n}"},
                                              "id": f"call_{self.n}"}]}

    async def turn(self, *steps: dict[str, Any]) -> None:
        """One agent request; the upstream answers ``steps`` in order (more than one: the gate continued it)."""
        self.upstream.queue(*steps)
        body = self.fmt.request_from_chat(orjson.loads(orjson.dumps(self.history)), "m", self.stream, (BASH,))
        async with httpx.AsyncClient(timeout=30) as client:
            response = await client.post(f"{self.proxy.url}{self.prefix}{self.fmt.path}", json=body)
        assert response.status_code == 200, response.text
        if self.stream:
            got = self.fmt.assemble([(e.event, e.data) for e in SSEParser().feed(response.content)])
        else:
            got = self.fmt.parse_response(response.json())
        calls = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
                 for c in got.tool_calls]
        self.history.append({"role": "assistant", "content": got.text or None, **({"tool_calls": calls} if calls
                                                                                   else {})})
        self.history += [{"role": "tool", "tool_call_id": c["id"], "content": f"output of {c['id']}"} for c in calls]

    async def list_again(self, proxies: tuple[Any, ...], turns: int = 6) -> None:
        """``turns`` requests, each through the next of ``proxies`` in turn, in which the model runs ``ls`` again
        and gets the same listing: a loop, once it has gone on long enough."""
        for turn in range(turns):
            self.proxy = proxies[turn % len(proxies)]
            self.n += 1
            await self.turn({"text": "Listing again. " + report(), "tool_calls": [
                {"name": "Bash", "arguments": {"command": "ls"}, "id": f"call_{self.n}"}]})
            self.history[-1]["content"] = "a.txt b.txt"

    def rewrite(self, keep: int) -> None:
        """Prune the history to its first two items and its last ``keep`` (a compaction)."""
        self.history = self.history[:2] + self.history[-keep:]
        self.rewrites.add(len(self.upstream.requests))

    def bodies(self) -> list[bytes]:
        return [body for _target, body, _headers in self.upstream.requests]

    def assert_prefix_stable(self) -> None:
        """Each upstream request's prompt begins the next one's, but where the agent rewrote its history."""
        prompts = [self.fmt.prompt(orjson.loads(body)) for body in self.bodies()]
        for i in range(1, len(prompts)):
            if i in self.rewrites:
                continue
            before, after = prompts[i - 1], prompts[i]
            assert shared_prefix(before, after) == sum(map(len, before)), f"request {i} breaks the prefix"


@pytest.mark.parametrize(("fmt", "stream"), MODES, ids=IDS)
async def test_a_recitation_stays_where_it_was_first_recited(tmp_path: Path, fmt: str, stream: bool) -> None:
    model = Model()
    async with running(Config(), port=0, store=Store(tmp_path / "state"), scripted={"scripted": ScriptedUpstream()},
                       model=model) as proxy:
        agent = Agent(proxy, BY_NAME[fmt], stream)
        await agent.turn(agent.step("Reading. " + report()))
        assert RECITED not in agent.bodies()[-1]  # the request stating the prohibition is the last item
        for _ in range(3):
            await agent.turn(agent.step("Reading on. " + report()))
        # Recited once, after the first tool result, and back at that place in every later request.
        assert [body.count(RECITED) for body in agent.bodies()] == [0, 1, 1, 1]
        agent.assert_prefix_stable()

        # The content changes (a plan is made): recited once more, at the new tail; the old one stays.
        await agent.turn(agent.step("Planning. " + report(plan="request")))
        await agent.turn(agent.step("Split under way. " + report()))
        assert model.purposes == ["plan"]
        bodies = agent.bodies()
        assert [body.count(RECITED) for body in bodies[-2:]] == [1, 2]
        assert b"Live plan (0/2 done)" not in bodies[-2] and bodies[-1].count(b"Live plan (0/2 done)") == 1
        tail = agent.fmt.message(agent.fmt.history(orjson.loads(bodies[-1]))[-1]).text
        assert "Live plan (0/2 done)" in tail and "Do not push to main." in tail
        await agent.turn(agent.step("Still splitting. " + report()))
        assert agent.bodies()[-1].count(RECITED) == 2
        agent.assert_prefix_stable()

        # The agent compacts its history: the recitations' places are gone, so the next one goes to the new tail.
        agent.rewrite(keep=2)
        await agent.turn(agent.step("After the compaction. " + report()))
        body = agent.bodies()[-1]
        assert body.count(RECITED) == 1
        tail = agent.fmt.message(agent.fmt.history(orjson.loads(body))[-1]).text
        assert "Goal (fixed)" in tail and "Live plan (0/2 done)" in tail
        await agent.turn(agent.step("Going on. " + report()))
        assert agent.bodies()[-1].count(RECITED) == 1
        agent.assert_prefix_stable()


@pytest.mark.parametrize(("fmt", "stream"), MODES, ids=IDS)
async def test_a_gate_reentry_of_a_turn_that_carried_a_recitation_keeps_the_prefix(tmp_path: Path, fmt: str,
                                                                                   stream: bool) -> None:
    model = Model()
    async with running(Config(), port=0, store=Store(tmp_path / "state"), scripted={"scripted": ScriptedUpstream()},
                       model=model) as proxy:
        agent = Agent(proxy, BY_NAME[fmt], stream)
        await agent.turn(agent.step("Reading. " + report()))
        # This request carries the first recitation at its tail; the model's answer ends the turn, the verifier
        # finds a gap, and the turn is continued upstream (the model then calls a tool).
        await agent.turn({"text": "Done: the parser is split. " + report("done")},
                         agent.step("Checking the split. " + report()))
        assert model.purposes[:1] == ["verify"]
        bodies = agent.bodies()
        assert len(bodies) == 3 and bodies[1].count(RECITED) == 1 and bodies[2].count(RECITED) == 1
        assert b"the split was not checked" in bodies[2]  # the continued request carries the advisory
        # The agent goes on from the tool call it got: the held answer and the advisory go back after the
        # recitation, where the continued request had them.
        await agent.turn(agent.step("Listed. " + report()))
        await agent.turn({"text": "Done, and checked. " + report("done")})
        assert agent.bodies()[3].count(b"the split was not checked") == 1
        agent.assert_prefix_stable()


async def test_an_unchanged_recitation_far_back_is_recited_again_at_the_tail(tmp_path: Path) -> None:
    async with running(Config(), port=0, store=Store(tmp_path / "state"), scripted={"scripted": ScriptedUpstream()},
                       model=Model()) as proxy:
        agent = Agent(proxy, BY_NAME["chat"], False)
        counts = []
        for _ in range(RECITE_AFTER // 2 + 3):  # each turn adds two history items
            await agent.turn(agent.step("Reading. " + report()))
            counts.append(agent.bodies()[-1].count(RECITED))
        first = counts.index(1)
        again = counts.index(2)
        # Recited again once the first lies RECITE_AFTER items back (every turn adds an answer and a result).
        assert 2 * (again - first) == RECITE_AFTER and counts[-1] == 2
        agent.assert_prefix_stable()


def test_the_prompt_puts_the_history_last_and_the_shared_prefix_counts_bytes() -> None:
    chat = BY_NAME["chat"]
    body = chat.request_from_chat([{"role": "system", "content": "S"}, {"role": "user", "content": "hello"}], "m",
                                  False, (BASH,))
    longer = chat.request_from_chat([{"role": "system", "content": "S"}, {"role": "user", "content": "hello"},
                                     {"role": "assistant", "content": "hi"}], "m", False, (BASH,))
    first, later = chat.prompt(body), chat.prompt(longer)
    assert len(first) == 3 and b'"tools"' in first[0] and b'"messages"' not in first[0]
    assert first == later[:3] and shared_prefix(first, later) == sum(map(len, first))
    edited = chat.prompt({**body, "messages": [body["messages"][0], {"role": "user", "content": "help"}]})
    # The pieces agree up to the third one's "hel".
    assert shared_prefix(first, edited) == len(first[0]) + len(first[1]) + len(b'{"role":"user","content":"hel')
    assert shared_prefix(first, chat.prompt({**body, "model": "other"})) < len(first[0])
