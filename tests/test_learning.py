"""Cross-session learning and recall (``proxyvisor.learning``, ``proxyvisor.proxy.learning``): a rule stated in one
session is recalled in the next session of the same project and not in another; task-local instructions, secrets
and, with learning off, anything at all are never stored; a failed experience is recalled as failed; credit moves
by the gate's label; the recalled note keeps the upstream prefix; ``proxyvisor memory`` lists and forgets."""

from __future__ import annotations

import json
import stat
import time
from pathlib import Path
from typing import Any

import httpx
import msgspec
import orjson
import pytest
import trio

from proxyvisor.cli import main
from proxyvisor.condense.text import count_tokens
from proxyvisor.config import Config, ConfigError, LearningConfig, parse
from proxyvisor.gate.verdict import VERIFIER_INSTRUCTIONS
from proxyvisor.learning import distill
from proxyvisor.learning import memory as memory_module
from proxyvisor.learning.memory import (ARCHIVE_BELOW, EXPERIENCE, FAILED, INITIAL_CREDIT, ORIENTATION, RULE,
                                        UNKNOWN, VERIFIED, Candidate, Memory)
from proxyvisor.learning.pack import assemble
from proxyvisor.proxy.formats import BY_NAME, ToolSpec
from proxyvisor.proxy.formats.base import shared_prefix
from proxyvisor.proxy.learning import FOLDER, MemoryFiles, project_root, scope_of
from proxyvisor.proxy.service import running
from proxyvisor.proxy.sse import SSEParser
from proxyvisor.redact import holds_secret
from proxyvisor.scripted.upstream import ScriptedUpstream
from proxyvisor.store import Store
from proxyvisor.supervisor_model import ModelAnswer

BASH = ToolSpec("Bash", {"type": "object", "properties": {"command": {"type": "string"}}})
RULE_TEXT = "Always use uv, never pip."
MEMORY_NOTE = 'signal="memory"'
CANARY = "sk-canary0123456789abcdefXYZ"


def report(state: str = "progressing", memories: list[str] | None = None) -> str:
    return "<sup>" + json.dumps({"state": state, "focus": "the task", "next": None, "carry": [],
                                 "memories": memories or []}) + "</sup>"


def passing() -> str:
    return json.dumps({"requirements": [{"id": 1, "requirement": "the task", "status": "matched", "basis": None,
                                         "evidence": "x"}], "gaps": [], "handback": None, "verdict": "pass"})


class Model:
    """The supervisor model double: the verifier passes, the distill call answers ``distilled``."""

    def __init__(self, distilled: dict[str, Any] | None = None) -> None:
        self.distilled = distilled or {"rules": [], "orientation": []}
        self.purposes: list[str] = []

    async def __call__(self, messages: list[dict[str, str]]) -> ModelAnswer:
        system = messages[0]["content"]
        if system == VERIFIER_INSTRUCTIONS:
            self.purposes.append("verify")
            return ModelAnswer(passing())
        if system == distill.INSTRUCTIONS:
            self.purposes.append("distill")
            return ModelAnswer(json.dumps(self.distilled))
        self.purposes.append("other")
        return ModelAnswer('{"findings": []}')


class Agent:
    """One conversation in ``fmt`` through the proxy, with a system prompt naming ``cwd`` as Codex does."""

    def __init__(self, proxy: Any, session: str, cwd: Path | None, task: str, fmt: str = "chat",
                 stream: bool = False) -> None:
        self.proxy, self.session, self.fmt, self.stream = proxy, session, BY_NAME[fmt], stream
        self.upstream: ScriptedUpstream = proxy.scripted["scripted"]
        system = "You are a coding agent." + (f"\n<environment_context><cwd>{cwd}</cwd></environment_context>"
                                              if cwd is not None else "")
        self.history: list[dict[str, Any]] = [{"role": "system", "content": system},
                                              {"role": "user", "content": task}]
        self.sent: list[bytes] = []
        self.outputs: dict[str, str] = {}

    def call(self, command: str, output: str, text: str = "Working. ") -> dict[str, Any]:
        cid = f"call_{len(self.outputs)}"
        self.outputs[cid] = output
        return {"text": text + report(), "tool_calls": [{"name": "Bash", "arguments": {"command": command},
                                                           "id": cid}]}

    async def turn(self, *steps: dict[str, Any]) -> str:
        """One request; the upstream answers ``steps``; returns the text the agent got."""
        before = len(self.upstream.requests)
        self.upstream.queue(*steps)
        body = self.fmt.request_from_chat(orjson.loads(orjson.dumps(self.history)), "m", self.stream, (BASH,))
        async with httpx.AsyncClient(timeout=30) as client:
            response = await client.post(f"{self.proxy.url}/s/{self.session}{self.fmt.path}", json=body)
        assert response.status_code == 200, response.text
        self.sent += [b for _t, b, _h in self.upstream.requests[before:]]
        got = self.fmt.assemble([(e.event, e.data) for e in SSEParser().feed(response.content)]) if self.stream \
            else self.fmt.parse_response(response.json())
        calls = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
                 for c in got.tool_calls]
        self.history.append({"role": "assistant", "content": got.text or None, **({"tool_calls": calls} if calls
                                                                                   else {})})
        self.history += [{"role": "tool", "tool_call_id": c["id"], "content": self.outputs.get(c["id"], "ok")}
                         for c in calls]
        return got.text

    def say(self, text: str) -> None:
        self.history.append({"role": "user", "content": text})

    def first_tail(self) -> str:
        """The text of the last history item of the session's first upstream request."""
        body = orjson.loads(self.sent[0])
        return self.fmt.message(self.fmt.history(body)[-1]).text


async def session_one(proxy: Any, cwd: Path, task: str, session: str = "one") -> Agent:
    """A session that states ``task``, runs the tests (passing) and finishes."""
    agent = Agent(proxy, session, cwd, task)
    await agent.turn(agent.call("pytest -q", "3 passed in 0.05s"))
    await agent.turn({"text": "Done. " + report("done")})
    return agent


def memory_of(state: Path, scope: Path) -> Memory | None:
    return MemoryFiles(state / FOLDER).read(MemoryFiles(state / FOLDER).path(project_root(str(scope))))


# --- the sans-IO core ---------------------------------------------------------------------------------------------

def test_durable_instructions_are_rules_and_task_local_or_conditional_ones_are_not() -> None:
    material = distill.Material("s1", ((1, f"{RULE_TEXT} Add a --verbose flag."),
                                       (2, "For this task, always use the staging database. If the build fails, "
                                           "never retry it. Do not touch migrations/ today.")))
    rules = [c for c in distill.free_records(material) if c.kind == RULE]
    assert [(c.text, c.source) for c in rules] == [(RULE_TEXT, "user turn 1 of session s1")]


def test_free_records_cite_the_passing_check_and_label_the_experience() -> None:
    actions = (distill.Action(1, "Bash", "sed -i s/a/b/ app.py", True),
               distill.Action(2, "Bash", "pytest -q", True, True, "3 passed"))
    material = distill.Material("s1", ((1, "Fix the bug"),), "Fix the bug", FAILED, actions, passed_check=2)
    found = {c.kind: c for c in distill.free_records(material)}
    assert found[ORIENTATION].source == "action #2: Bash `pytest -q` (succeeded: 3 passed)"
    assert (found[EXPERIENCE].text, found[EXPERIENCE].label) == ("Fix the bug", FAILED)
    assert distill.label_of("unverified") == UNKNOWN and distill.label_of("verified") == VERIFIED


def test_a_distill_answer_is_kept_only_where_the_transcript_grounds_it() -> None:
    material = distill.Material("s1", ((1, "Use ruff for linting. Fix the bug."),), actions=(
        distill.Action(1, "Bash", "make build", True), distill.Action(2, "Bash", "make deploy", False)))
    answer = json.dumps({"rules": [{"source": "user:1", "quote": "Use ruff for linting."},
                                   {"source": "user:1", "quote": "Use black for formatting."},
                                   {"source": "user:2", "quote": "Use ruff for linting."}],
                         "orientation": [{"fact": "make build builds it", "action": 1},
                                         {"fact": "make deploy deploys", "action": 2},
                                         {"fact": "there is a Makefile", "action": 9}]})
    found = distill.parse(answer, material)
    assert not isinstance(found, distill.Malformed)
    assert [(c.kind, c.text) for c in found] == [(RULE, "Use ruff for linting."), (ORIENTATION, "make build builds it")]
    assert isinstance(distill.parse("no json here", material), distill.Malformed)


def test_the_pre_screen_skips_what_could_teach_nothing_new() -> None:
    memory = Memory("/p")
    quiet = distill.Material("s1", ((1, f"{RULE_TEXT}"),), actions=(distill.Action(1, "Read", "", True),))
    assert distill.worth_asking(quiet, memory) == frozenset()
    hinted = distill.Material("s1", ((1, "Use ruff for linting."),))
    keys = distill.worth_asking(hinted, memory)
    assert keys and distill.worth_asking(hinted, memory, keys) == frozenset()  # asked once per session


def test_credit_moves_by_the_label_and_low_credit_archives_without_deleting() -> None:
    memory = Memory("/p")
    record = memory.add(Candidate(RULE, RULE_TEXT, "user turn 1"), 1.0, "s1")
    assert record is not None and record.credit == INITIAL_CREDIT
    memory.credit([record.id], VERIFIED)
    assert memory.records[record.id].credit == pytest.approx(INITIAL_CREDIT + 0.05)
    memory.credit([record.id], UNKNOWN)
    assert memory.records[record.id].credit == pytest.approx(INITIAL_CREDIT + 0.05)
    memory.credit([record.id], FAILED)
    memory.credit([record.id], FAILED)
    assert not memory.records[record.id].archived  # 0.25: not below the line yet
    memory.credit([record.id], FAILED)
    kept = memory.records[record.id]
    assert kept.credit == pytest.approx(INITIAL_CREDIT + 0.05 - 0.45) and kept.credit < ARCHIVE_BELOW
    assert kept.archived and kept.used == 5 and memory.active() == []
    assert assemble(list(memory.records.values()), "", 1500, count_tokens).records == ()


def test_an_experience_is_never_upgraded() -> None:
    memory = Memory("/p")
    failed = memory.add(Candidate(EXPERIENCE, "Fix the bug", "s1", FAILED), 1.0, "s1")
    verified = memory.add(Candidate(EXPERIENCE, "Fix the bug", "s2", VERIFIED), 2.0, "s2")
    assert failed is not None and verified is not None and failed.id != verified.id
    assert {r.label for r in memory.records.values()} == {FAILED, VERIFIED}


@pytest.mark.parametrize("value", [CANARY, "Bearer abcdef123456789", "api_key=abcdef123456", "password: hunter2222",
                                   "ghp_" + "a" * 36, "AKIA" + "A" * 16, "-----BEGIN RSA PRIVATE KEY-----",
                                   "AWS_SECRET_ACCESS_KEY=wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY",
                                   "postgres://admin:S3cr3tPassw0rd@db.internal/app",
                                   "Authorization: Basic YWRtaW46czNjcjN0cGFzc3dvcmQ=",
                                   "AIzaSyA1b2C3d4E5f6G7h8I9j0KlMnOpQrStUvW", "npm_" + "a1B2c3D4e5" * 4,
                                   "password hunter2hunter2"])
def test_a_secret_looking_value_is_never_stored(value: str) -> None:
    memory = Memory("/p")
    assert holds_secret(f"the deploy uses {value} for now")
    assert memory.add(Candidate(ORIENTATION, f"the deploy uses {value}", "action #1"), 1.0, "s1") is None
    assert memory.add(Candidate(RULE, "Always deploy with make.", f"output {value}"), 1.0, "s1") is None
    assert memory.records == {}


def test_a_secret_at_a_long_candidates_cut_is_never_stored_and_one_past_what_is_read_cannot_be() -> None:
    memory = Memory("/p")
    cut = "Always deploy with make. " + "x" * (memory_module.MAX_TEXT - 30) + " AKIA" + "A" * 16
    assert memory.add(Candidate(RULE, cut, "t"), 1.0, "s") is None, "the stored text would hold the key's head"
    far = "Always deploy with make. " + "y " * memory_module.READ_CHARS + "AKIA" + "A" * 16
    record = memory.add(Candidate(RULE, far, "t"), 1.0, "s")
    assert record is not None and "AKIA" not in record.text


def test_learning_reads_a_bounded_prefix_of_a_huge_user_message() -> None:
    """A 20 MB user message opening with a durable instruction: its rule is learnt, and distilling it (free
    records, storing them, the pre-screen, the call's input) and recalling for it cost milliseconds, not the
    seconds reading it whole did."""
    huge = f"{RULE_TEXT} Here is the log:\n" + "lorem ipsum dolor sit amet, consectetur adipiscing elit " * 370_000
    material = distill.Material("s1", ((1, huge),), huge, VERIFIED)
    memory = Memory("/p")
    started = time.process_time()
    for candidate in distill.free_records(material):
        memory.add(candidate, 1.0, "s1")
    distill.worth_asking(material, memory)
    distill.distill_input(material)
    pack = assemble(memory.active(), huge, 1_500, count_tokens)
    assert time.process_time() - started < 0.5
    assert RULE_TEXT in {r.text for r in memory.records.values()} and pack.records


def test_a_request_credential_is_never_stored() -> None:
    memory = Memory("/p")
    assert memory.add(Candidate(RULE, "Always pass xyz-token-42 to the cli.", "t"), 1.0, "s", ["xyz-token-42"]) is None


def test_the_pack_holds_rules_first_within_budget_and_is_byte_stable() -> None:
    memory = Memory("/p")
    for n in range(400):
        memory.add(Candidate(EXPERIENCE, f"Refactor parser{n}", f"session s{n}", VERIFIED), n, "s")
        memory.add(Candidate(ORIENTATION, f"parser{n} lives in src/parser{n}.py", f"action #{n}"), n, "s")
    memory.add(Candidate(RULE, RULE_TEXT, "user turn 1"), 0.0, "s")
    records = list(memory.records.values())
    pack = assemble(records, "Refactor parser7", 1500, count_tokens)
    assert pack.tokens <= 1500 and count_tokens(pack.text) == pack.tokens
    assert pack.records[0].kind == RULE
    kinds = [r.kind for r in pack.records]
    assert kinds == sorted(kinds, key=[RULE, ORIENTATION, EXPERIENCE].index)
    assert [r.text for r in pack.records if r.kind != RULE][:1] == ["parser7 lives in src/parser7.py"]
    assert "Refactor parser7" in [r.text for r in pack.records if r.kind == EXPERIENCE][:1]  # the relevant first
    assert "a current user instruction beats a recalled rule" in pack.text
    assert assemble(list(reversed(records)), "Refactor parser7", 1500, count_tokens).text == pack.text


def test_bounds_drop_archived_then_lowest_credit_and_retention_ages_out() -> None:
    memory = Memory("/p")
    ids = [memory.add(Candidate(ORIENTATION, f"fact {n}", "a"), float(n), "s") for n in range(5)]
    assert all(ids)
    memory.credit([ids[3].id], FAILED) and memory.credit([ids[3].id], FAILED)  # type: ignore[union-attr]
    assert memory.bound(4, 10**6, 10**6, 5.0) == 1 and ids[3].id not in memory.records  # type: ignore[union-attr]
    assert memory.bound(100, 10**6, 3.5, 5.0) == 2  # seen at 0 and 1: older than 3.5 s
    assert sorted(r.text for r in memory.records.values()) == ["fact 2", "fact 4"]


def test_the_scope_comes_from_the_config_the_client_or_the_default(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    (repo / ".git").mkdir(parents=True)
    (repo / "src").mkdir()
    assert scope_of((f"<environment_context>\n  <cwd>{repo / 'src'}</cwd>", ""), "", None) == str(repo.resolve())
    assert scope_of(("env:\nPrimary working directory: /remote/app\n", ""), "", None) == "/remote/app"
    assert scope_of(("<env>\n - Primary working directory: /remote/app\n - Is a git repository: true\n", ""), "",
                    None) == "/remote/app"
    assert scope_of(("- Working directory persists between calls: /not/this\n", ""), "", None) is None
    assert scope_of(("no env here", "hi"), "", str(tmp_path)) == str(tmp_path.resolve())
    assert scope_of((f"<cwd>{repo}</cwd>", ""), str(tmp_path), None) == str(tmp_path.resolve())
    assert scope_of(("no env here", "hi"), "", None) is None


def test_the_scope_of_a_codex_request_is_its_environment_contexts_cwd() -> None:
    body = json.loads((Path(__file__).parent / "fixtures/requests/codex_environment_context.json").read_text())
    assert scope_of(BY_NAME["responses"].fingerprint_parts(body), "", "/elsewhere") == "/home/user/project"


def test_the_seed_configuration_loads_and_evolution_is_refused() -> None:
    config = parse({"supervisor": {"learning": {"enabled": True, "evolution": {"enabled": False}}}})
    assert config.supervisor.learning == LearningConfig()
    with pytest.raises(ConfigError, match="evolution"):
        parse({"supervisor": {"learning": {"evolution": {"enabled": True}}}})
    with pytest.raises(ConfigError, match=r"\[supervisor.learning\] budget_tokens"):
        parse({"supervisor": {"learning": {"budget_tokens": 10}}})
    with pytest.raises(ConfigError, match="unknown setting"):
        parse({"supervisor": {"learning": {"enable": True}}})


# --- through the proxy --------------------------------------------------------------------------------------------

async def test_a_rule_of_session_one_is_recalled_in_session_two_of_the_same_scope_only(tmp_path: Path) -> None:
    project, other = tmp_path / "project", tmp_path / "other"
    project.mkdir()
    other.mkdir()
    state = tmp_path / "state"
    model = Model()
    async with running(Config(), port=0, store=Store(state), scripted={"scripted": ScriptedUpstream()},
                       model=model) as proxy:
        await session_one(proxy, project, f"{RULE_TEXT} For this task, always use the staging database. Add a flag.")
        assert "verify" in model.purposes
    path = MemoryFiles(state / FOLDER).path(str(project.resolve()))
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    memory = memory_of(state, project)
    assert memory is not None
    kinds = {r.kind: r for r in memory.records.values()}
    assert [r.text for r in memory.records.values() if r.kind == RULE] == [RULE_TEXT]  # the task-local one is not
    assert kinds[ORIENTATION].text.startswith("`pytest -q` runs the project's checks")
    assert kinds[EXPERIENCE].label in (VERIFIED, UNKNOWN)

    async with running(Config(), port=0, store=Store(state), scripted={"scripted": ScriptedUpstream()},
                       model=Model()) as proxy:
        two = Agent(proxy, "two", project, "Add a --quiet flag.")
        await two.turn(two.call("ls", "app.py"))
        await two.turn(two.call("cat app.py", "print()"))
        three = Agent(proxy, "three", other, "Add a --quiet flag.")
        await three.turn(three.call("ls", "app.py"))
        async with httpx.AsyncClient(timeout=30) as client:
            info = (await client.get(f"{proxy.url}/proxyvisor/sessions/two/info")).json()["live"]["learning"]
            text = (await client.post(f"{proxy.url}/s/two/v1/chat/completions", json={
                "model": "m", "messages": [{"role": "user", "content": "/info"}]})).json()
    assert info["scope"] == str(project.resolve()) and info["records"] == len(memory.records)
    assert info["recalls"] == 1 and info["recalled_items"] == len(memory.records) and info["recalled_tokens"] > 0
    assert "| memory " in text["choices"][0]["message"]["content"]
    tail = two.first_tail()
    assert MEMORY_NOTE in tail and RULE_TEXT in tail and kinds[ORIENTATION].id in tail
    assert "a current user instruction beats a recalled rule" in tail
    assert two.sent[1].count(b'signal=\\"memory\\"') == 1  # kept at its place, not recalled again
    assert MEMORY_NOTE.encode() not in three.sent[0].replace(b"\\", b"")


@pytest.mark.parametrize(("fmt", "stream"), [("chat", False), ("messages", True), ("responses", False)])
async def test_the_recalled_note_keeps_the_upstream_prefix_and_returns_after_a_compaction(
        tmp_path: Path, fmt: str, stream: bool) -> None:
    state = tmp_path / "state"
    memory = Memory(str(tmp_path.resolve()))
    memory.add(Candidate(RULE, RULE_TEXT, "user turn 1 of session s0"), 1.0, "s0")
    MemoryFiles(state / FOLDER).save(memory, set())
    async with running(Config(), port=0, store=Store(state), scripted={"scripted": ScriptedUpstream()},
                       model=Model()) as proxy:
        agent = Agent(proxy, "prefix", tmp_path, "Refactor the parser.", fmt, stream)
        for n in range(4):
            await agent.turn(agent.call(f"ls {n}", "x"))
        f = agent.fmt
        prompts = [f.prompt(orjson.loads(b)) for b in agent.sent]
        for before, after in zip(prompts, prompts[1:]):
            assert shared_prefix(before, after) == sum(map(len, before))
        assert all(b.count(RULE_TEXT.encode()) == 1 for b in agent.sent)
        agent.history = agent.history[:2] + agent.history[-2:]  # pruned: the note's place is still there
        await agent.turn(agent.call("ls again", "x"))
        assert agent.sent[-1].count(RULE_TEXT.encode()) == 1
        # Compacted to a summary: the note's place is gone, so it is recalled again, at the new tail.
        agent.history = agent.history[:1] + [{"role": "user", "content": "Summary: the parser refactor is under way."}]
        await agent.turn(agent.call("ls at last", "x"))
        body = orjson.loads(agent.sent[-1])
        assert RULE_TEXT in f.message(f.history(body)[-1]).text


async def test_a_failed_experience_is_recalled_as_failed(tmp_path: Path) -> None:
    state = tmp_path / "state"
    memory = Memory(str(tmp_path.resolve()))
    for candidate in distill.free_records(distill.Material("s0", ((1, "Fix the login redirect"),),
                                                           "Fix the login redirect", FAILED)):
        memory.add(candidate, 1.0, "s0")
    MemoryFiles(state / FOLDER).save(memory, set())
    async with running(Config(), port=0, store=Store(state), scripted={"scripted": ScriptedUpstream()},
                       model=Model()) as proxy:
        agent = Agent(proxy, "again", tmp_path, "Fix the login redirect once more.")
        await agent.turn(agent.call("ls", "x"))
    assert "failed: Fix the login redirect" in agent.first_tail()


async def test_credit_moves_for_the_memories_a_judged_turn_names(tmp_path: Path) -> None:
    state = tmp_path / "state"
    memory = Memory(str(tmp_path.resolve()))
    rule = memory.add(Candidate(RULE, RULE_TEXT, "user turn 1 of session s0"), 1.0, "s0")
    assert rule is not None
    MemoryFiles(state / FOLDER).save(memory, set())
    async with running(Config(), port=0, store=Store(state), scripted={"scripted": ScriptedUpstream()},
                       model=Model()) as proxy:
        agent = Agent(proxy, "credit", tmp_path, "Add uv to the setup docs.")
        await agent.turn(agent.call("sed -i 's/pip/uv/' README.md setup.sh", ""))
        await agent.turn(agent.call("pytest -q", "3 passed in 0.05s"))
        await agent.turn({"text": "Done. " + report("done", [rule.id])})
        gate = [json.loads(line)["gate"] for line in (state / "ledger" / "credit.jsonl").read_text().splitlines()
                if "gate" in json.loads(line)][-1]
    after = memory_of(state, tmp_path)
    assert after is not None
    expected = {VERIFIED: INITIAL_CREDIT + 0.05, FAILED: INITIAL_CREDIT - 0.15}.get(gate["outcome"], INITIAL_CREDIT)
    assert gate["outcome"] == VERIFIED and after.records[rule.id].credit == pytest.approx(expected)
    assert after.records[rule.id].used == 1


async def test_a_secret_in_a_tool_output_is_never_stored(tmp_path: Path) -> None:
    state = tmp_path / "state"
    model = Model({"rules": [], "orientation": [{"fact": f"the deploy key is {CANARY}", "action": 1},
                                                {"fact": "deploy.log records the deploys", "action": 1}]})
    async with running(Config(), port=0, store=Store(state), scripted={"scripted": ScriptedUpstream()},
                       model=model) as proxy:
        agent = Agent(proxy, "canary", tmp_path, f"Check the deploy. Use the smoke tests for it. Always use the key "
                                                  f"{CANARY} for deploys.")
        await agent.turn(agent.call("pytest -q smoke", f"using DEPLOY_KEY={CANARY}\n3 passed in 0.05s"))
        await agent.turn({"text": "Deployed. " + report("done")})
    assert "distill" in model.purposes
    files = [p for p in (state / FOLDER).iterdir()]
    assert files and all(CANARY.encode() not in p.read_bytes() for p in files)
    memory = memory_of(state, tmp_path)
    assert memory is not None and "deploy.log records the deploys" in {r.text for r in memory.records.values()}


async def test_learning_off_reads_and_writes_nothing(tmp_path: Path) -> None:
    state = tmp_path / "state"
    memory = Memory(str(tmp_path.resolve()))
    memory.add(Candidate(RULE, RULE_TEXT, "user turn 1"), 1.0, "s0")
    MemoryFiles(state / FOLDER).save(memory, set())
    before = {p: p.read_bytes() for p in (state / FOLDER).iterdir()}
    config = msgspec.structs.replace(Config(), supervisor=msgspec.structs.replace(
        Config().supervisor, learning=LearningConfig(enabled=False)))
    model = Model()
    async with running(config, port=0, store=Store(state), scripted={"scripted": ScriptedUpstream()},
                       model=model) as proxy:
        agent = await session_one(proxy, tmp_path, f"{RULE_TEXT} Also always run ruff.")
    assert all(b"memory" not in b.replace(b"\\", b"") for b in agent.sent) and "distill" not in model.purposes
    assert {p: p.read_bytes() for p in (state / FOLDER).iterdir()} == before


def test_memory_list_show_and_forget(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    state = tmp_path / "state"
    memory = Memory(str(tmp_path.resolve()))
    rule = memory.add(Candidate(RULE, RULE_TEXT, "user turn 1"), 1.0, "s0")
    fact = memory.add(Candidate(ORIENTATION, "tests run with pytest -q", "action #1"), 1.0, "s0")
    assert rule is not None and fact is not None
    MemoryFiles(state / FOLDER).save(memory, set())
    common = ["--state-dir", str(state), "--scope", str(tmp_path)]
    assert main(["memory", "list", *common]) == 0
    listed = capsys.readouterr().out
    assert rule.id in listed and fact.id in listed and "credit 0.50" in listed
    assert main(["memory", "show", rule.id, "--json", *common]) == 0
    assert json.loads(capsys.readouterr().out)["text"] == RULE_TEXT
    assert main(["memory", "forget", rule.id, *common]) == 0
    capsys.readouterr()
    after = memory_of(state, tmp_path)
    assert after is not None and list(after.records) == [fact.id]
    assert main(["memory", "show", rule.id, *common]) == 1
    assert main(["memory", "forget", "--all", *common]) == 0
    assert memory_of(state, tmp_path) is None
    capsys.readouterr()
    assert main(["memory", "list", *common]) == 0, "a project without memory is not an error"
    assert capsys.readouterr().out.startswith(f"no memory for {tmp_path}")
    assert main(["memory", "list", "--json", *common]) == 0
    assert orjson.loads(capsys.readouterr().out) == {"scope": str(tmp_path), "records": []}
    assert main(["memory", "show", rule.id, *common]) == 1
    assert main(["memory", "forget", *common]) == 2


def test_a_forget_from_the_command_line_stays_forgotten_when_a_proxy_saves(tmp_path: Path) -> None:
    files = MemoryFiles(tmp_path / FOLDER)
    memory = Memory("/p")
    rule = memory.add(Candidate(RULE, RULE_TEXT, "t"), 1.0, "s")
    assert rule is not None
    loaded: set[str] = set()
    files.save(memory, loaded)
    other = files.read(files.path("/p"))
    assert other is not None and other.forget(rule.id)
    files.path("/p").write_bytes(other.encode())
    memory.add(Candidate(ORIENTATION, "a fact", "a"), 2.0, "s")
    files.save(memory, loaded)
    saved = files.read(files.path("/p"))
    assert saved is not None and rule.id not in saved.records and len(saved.records) == 1


async def test_an_idle_session_evicted_mid_turn_keeps_its_rule(tmp_path: Path) -> None:
    """Session end by idle eviction: a session whose turn never ended (no gate outcome) is distilled for free when
    the table drops it."""
    state = tmp_path / "state"
    config = msgspec.structs.replace(Config(), state=msgspec.structs.replace(Config().state, session_idle_s=0.05))
    async with running(config, port=0, store=Store(state), scripted={"scripted": ScriptedUpstream()},
                       model=Model()) as proxy:
        agent = Agent(proxy, "idle", tmp_path, f"{RULE_TEXT} Add a flag.")
        await agent.turn(agent.call("ls", "app.py"))
        assert memory_of(state, tmp_path) is None  # mid-turn: nothing distilled yet
        await trio.sleep(0.2)
        other = Agent(proxy, "other", tmp_path / "elsewhere", "Hello.")
        await other.turn({"text": "Hi. " + report("done")})
        assert proxy.pipeline.sessions.get("idle") is None
        with trio.fail_after(10):  # saved in the background (the eviction happened in the other's request)
            while (memory := memory_of(state, tmp_path)) is None:
                await trio.sleep(0.02)
        assert memory is not None and [r.text for r in memory.records.values() if r.kind == RULE] == [RULE_TEXT]


async def test_a_session_evicted_as_the_proxy_stops_keeps_its_rule(tmp_path: Path) -> None:
    """The save of an evicted session's last distill goes on in the background: a proxy stopping right after
    still makes it."""
    state = tmp_path / "state"
    async with running(Config(), port=0, store=Store(state), scripted={"scripted": ScriptedUpstream()},
                       model=Model()) as proxy:
        agent = Agent(proxy, "idle", tmp_path, f"{RULE_TEXT} Add a flag.")
        await agent.turn(agent.call("ls", "app.py"))
        sessions = proxy.pipeline.sessions
        assert [s.id for s in sessions.evict(proxy.pipeline.clock() + 10 * sessions.idle_s)] == ["idle"]
    memory = memory_of(state, tmp_path)
    assert memory is not None and [r.text for r in memory.records.values() if r.kind == RULE] == [RULE_TEXT]


async def test_a_request_ending_with_a_system_message_gets_the_memory_before_it_and_keeps_it_there(
        tmp_path: Path) -> None:
    """Claude Code's first request ends with a system message of its own (its agent types): the memory goes
    after the user's message, before it, so the model has it before its first action, and the later requests,
    which keep that system message in their history, get it at the same place (the upstream prefix holds)."""
    state = tmp_path / "state"
    memory = Memory(str(tmp_path.resolve()))
    memory.add(Candidate(RULE, RULE_TEXT, "user turn 1 of session s0"), 1.0, "s0")
    MemoryFiles(state / FOLDER).save(memory, set())
    f = BY_NAME["messages"]
    user = {"role": "user", "content": [{"type": "text", "text": "Add the requests package."}]}
    agents = {"role": "system", "content": "Available agent types for the Agent tool:\n- claude: catch-all."}
    body: dict[str, Any] = {"model": "m", "max_tokens": 256, "system": f"Primary working directory: {tmp_path}",
                            "tools": [{"name": "Bash", "description": "Run", "input_schema": BASH.schema}],
                            "messages": [user, agents]}
    upstream = ScriptedUpstream()
    async with running(Config(), port=0, store=Store(state), scripted={"scripted": upstream},
                       model=Model()) as proxy:
        upstream.queue({"text": "Installing.", "tool_calls": [{"name": "Bash", "id": "toolu_1",
                                                               "arguments": {"command": "uv add requests"}}]})
        async with httpx.AsyncClient(timeout=30) as client:
            reply = await client.post(f"{proxy.url}/s/cc{f.path}", json=body)
            assert reply.status_code == 200, reply.text
            body["messages"] += [{"role": "assistant", "content": reply.json()["content"]},
                                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                                               "content": "added"}]}]
            upstream.queue({"text": "Done."})
            assert (await client.post(f"{proxy.url}/s/cc{f.path}", json=body)).status_code == 200
    first, second = (orjson.loads(b) for _t, b, _h in upstream.requests[:2])
    roles = [f.message(item).role for item in f.history(first)]
    texts = [f.message(item).text for item in f.history(first)]
    # The Messages format puts a note into the user message it follows, as a text block of its own.
    assert roles == ["user", "system"] and RULE_TEXT in texts[0] and f.history(first)[1] == agents
    assert shared_prefix(f.prompt(first), f.prompt(second)) == sum(map(len, f.prompt(first)))
    assert orjson.dumps(second).count(RULE_TEXT.encode()) == 1


def seeded(state: Path, scope: Path) -> tuple[Memory, str, str]:
    """The memory of ``scope`` holding a rule and a fact, saved; with their ids."""
    memory = Memory(str(scope.resolve()))
    rule = memory.add(Candidate(RULE, RULE_TEXT, "user turn 1 of session s0"), 1.0, "s0")
    fact = memory.add(Candidate(ORIENTATION, "tests run with pytest -q", "action #1"), 1.0, "s0")
    assert rule is not None and fact is not None
    MemoryFiles(state / FOLDER).save(memory, set())
    return memory, rule.id, fact.id


async def test_a_running_proxy_recalls_no_forgotten_record_to_a_new_session(tmp_path: Path) -> None:
    state = tmp_path / "state"
    _memory, rule, fact = seeded(state, tmp_path)
    common = ["--state-dir", str(state), "--scope", str(tmp_path)]
    async with running(Config(), port=0, store=Store(state), scripted={"scripted": ScriptedUpstream()},
                       model=Model()) as proxy:
        one = await session_one(proxy, tmp_path, "Add a flag.", "one")
        assert rule in one.first_tail() and fact in one.first_tail()
        assert main(["memory", "forget", rule, *common]) == 0
        two = await session_one(proxy, tmp_path, "Add another flag.", "two")  # it ends a turn: the proxy saves
        assert rule not in two.first_tail() and fact in two.first_tail()
        saved = memory_of(state, tmp_path)
        assert saved is not None and rule not in saved.records and fact in saved.records
        assert main(["memory", "forget", "--all", *common]) == 0
        three = Agent(proxy, "three", tmp_path, "Add a third flag.")
        await three.turn(three.call("ls", "app.py"))
        assert MEMORY_NOTE not in three.first_tail()
        ledger = [orjson.loads(line) for line in (state / "ledger" / "two.jsonl").read_bytes().splitlines()]
    recalled = ledger[0]["learning"]["recalled"]
    assert fact in recalled and rule not in recalled


async def test_a_memory_file_of_another_scope_turns_learning_off_and_is_never_written_over(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    state = tmp_path / "state"
    memory, _rule, _fact = seeded(state, tmp_path)
    path = MemoryFiles(state / FOLDER).path(memory.scope)
    path.write_bytes(Memory("/tmp/projX", memory.records.values()).encode())
    before = path.read_bytes()
    async with running(Config(), port=0, store=Store(state), scripted={"scripted": ScriptedUpstream()},
                       model=Model()) as proxy:
        for session in ("one", "two"):
            agent = await session_one(proxy, tmp_path, f"{RULE_TEXT} Also always run ruff. Add a flag.", session)
            assert MEMORY_NOTE not in agent.first_tail()
    assert path.read_bytes() == before
    warned = [r.getMessage() for r in caplog.records if r.name == "proxyvisor.learning"]
    assert len(warned) == 1 and str(path) in warned[0] and "/tmp/projX" in warned[0], warned


@pytest.mark.parametrize("damage", ["truncated", "another scope"])
def test_an_unreadable_memory_file_is_named_with_its_reset_and_forget_all_removes_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], damage: str) -> None:
    state = tmp_path / "state"
    memory, rule, _fact = seeded(state, tmp_path)
    path = MemoryFiles(state / FOLDER).path(memory.scope)
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2] if damage == "truncated"
                     else Memory("/tmp/projX", memory.records.values()).encode())
    common = ["--state-dir", str(state), "--scope", str(tmp_path)]
    for command in (["list"], ["show", rule], ["forget", rule]):
        assert main(["memory", *command, *common]) == 1
        err = capsys.readouterr().err
        assert f"{path} cannot be read" in err and "proxyvisor memory forget --all --scope" in err, err
        assert path.exists()
    assert main(["memory", "forget", "--all", *common]) == 0
    assert f"removed the memory file {path}" in capsys.readouterr().out
    assert not path.exists()
    assert main(["memory", "forget", "--all", *common]) == 1
    assert "no memory for" in capsys.readouterr().err


def test_memory_show_prints_utc_times_and_what_its_counts_count_and_stray_arguments_are_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    state = tmp_path / "state"
    memory, rule, _fact = seeded(state, tmp_path)
    memory.seen([rule], 86_400.0)
    memory.seen([rule], 2 * 86_400.0)
    MemoryFiles(state / FOLDER).save(memory, set(memory.records))
    common = ["--state-dir", str(state), "--scope", str(tmp_path)]
    assert main(["memory", "show", rule, *common]) == 0
    shown = capsys.readouterr().out.splitlines()
    assert "created: 1970-01-01T00:00:01Z" in shown and "seen: 1970-01-03T00:00:00Z" in shown
    assert "recalled: 2 (sessions it was recalled to)" in shown
    assert "used: 0 (times a session's status line named it as used)" in shown
    assert main(["memory", "show", rule, "--json", *common]) == 0
    raw = json.loads(capsys.readouterr().out)
    assert raw["created"] == 1.0 and raw["seen"] == 2 * 86_400.0 and raw["recalled"] == 2
    for stray in (["list", "extra"], ["list", "--all"], ["show", rule, "--all"], ["forget", rule, "--json"]):
        assert main(["memory", *stray, *common]) == 2, stray
        assert "unexpected" in capsys.readouterr().err
    kept = memory_of(state, tmp_path)
    assert kept is not None and rule in kept.records


def test_rules_are_recited_newest_first_with_their_day_and_the_newer_supersedes() -> None:
    memory = Memory("/p")
    day = 86_400.0
    for n, (when, text) in enumerate([(20_000 * day, RULE_TEXT), (20_003 * day, "From now on, always use pip, "
                                                                               "never uv.")]):
        memory.add(Candidate(RULE, text, f"user turn 1 of session s{n}"), when, f"s{n}")
    memory.add(Candidate(ORIENTATION, "tests run with pytest -q", "action #1"), 20_004 * day, "s1")
    pack = assemble(list(memory.records.values()), "Add a flag", 1500, count_tokens)
    assert [r.text for r in pack.records if r.kind == RULE] == ["From now on, always use pip, never uv.", RULE_TEXT]
    lines = pack.text.splitlines()
    assert "a newer rule supersedes an older one on the same subject" in pack.text
    assert "a current user instruction beats a recalled rule" in pack.text
    (newer,) = [line for line in lines if "pip, never uv" in line and "From now on" in line]
    (older,) = [line for line in lines if RULE_TEXT in line]
    assert lines.index(newer) < lines.index(older)
    assert ' 2024-10-07 "From now on' in newer and ' 2024-10-04 "Always use uv' in older
    assert assemble(list(reversed(memory.records.values())), "Add a flag", 1500, count_tokens).text == pack.text


def test_a_marker_opening_a_clause_after_a_colon_makes_a_rule_and_local_ones_still_do_not() -> None:
    assert distill.durable("We switched tooling: always use pip, never uv.")
    assert distill.durable("Tooling; from now on, run ruff before committing.")
    assert not distill.durable("We switched tooling: always use pip for now.")
    assert not distill.durable("Note for this task: never touch the staging database.")
    assert not distill.durable("Changed get_context() to always return a string.")
    assert not distill.durable("Status: the build always fails on a cold cache.")
    assert not distill.durable("- **Explore alternatives** - Always propose 2-3 approaches before settling")


async def settled(state: Path, scope: Path, done: Any) -> Memory:
    """The memory of ``scope`` once ``done(memory)`` holds (the proxy saves after the answer went out)."""
    with trio.fail_after(10):
        while (memory := memory_of(state, scope)) is None or not done(memory):
            await trio.sleep(0.02)
    return memory


async def test_a_running_session_does_not_store_again_a_rule_forgotten_since_it_began(tmp_path: Path) -> None:
    state = tmp_path / "state"
    common = ["--state-dir", str(state), "--scope", str(tmp_path)]
    texts = lambda m: [r.text for r in m.records.values()]  # noqa: E731
    async with running(Config(), port=0, store=Store(state), scripted={"scripted": ScriptedUpstream()},
                       model=Model()) as proxy:
        one = await session_one(proxy, tmp_path, f"{RULE_TEXT} Add a flag.", "one")
        memory = await settled(state, tmp_path, lambda m: RULE_TEXT in texts(m))
        (rule,) = [r.id for r in memory.records.values() if r.kind == RULE]
        assert main(["memory", "forget", rule, *common]) == 0
        for task in ("Now add another flag.", "And a last one."):  # each distill reads turn 1 again
            one.say(task)
            await one.turn(one.call("pytest -q", "4 passed in 0.05s"))
            await one.turn({"text": "Done. " + report("done")})
            memory = await settled(state, tmp_path, lambda m, task=task: task in texts(m))
            assert rule not in memory.records
        await session_one(proxy, tmp_path, f"{RULE_TEXT} Add a third flag.", "two")  # stated anew: learnt anew
        await settled(state, tmp_path, lambda m: rule in m.records)


def test_forgetting_a_rule_forgets_the_records_quoting_it_whatever_their_case_and_spacing() -> None:
    memory = Memory("/p")
    rule = memory.add(Candidate(RULE, RULE_TEXT, "user turn 1"), 1.0, "s0")
    quoting = memory.add(Candidate(EXPERIENCE, "Please list files.  ALWAYS use uv,\n never PIP.", "session s0",
                                   VERIFIED), 1.0, "s0")
    fact = memory.add(Candidate(ORIENTATION, "tests run with pytest -q", "action #1"), 1.0, "s0")
    other = memory.add(Candidate(RULE, "From now on, always use uv, never pip.", "user turn 3"), 1.0, "s0")
    assert rule is not None and quoting is not None and fact is not None and other is not None
    proxy, loaded = Memory("/p", memory.records.values()), set(memory.records)  # a proxy that read it before
    assert memory.forget(rule.id) == [rule.id, quoting.id]
    assert set(memory.records) == {fact.id, other.id}, "another rule is the user's own, forgotten on its own"
    assert memory.forget(rule.id) == []
    # The proxy distils the rule's words into a new experience, then takes in the store's forget.
    new = proxy.add(Candidate(EXPERIENCE, "Again: always use uv, never pip. Add a flag.", "session s1", UNKNOWN),
                    2.0, "s1")
    assert new is not None
    assert sorted(proxy.merge(memory, loaded)) == sorted([rule.id, quoting.id, new.id])
    assert set(proxy.records) == {fact.id, other.id}


async def test_a_forgotten_rule_reaches_no_later_session_through_an_experience_quoting_it(tmp_path: Path) -> None:
    state = tmp_path / "state"
    common = ["--state-dir", str(state), "--scope", str(tmp_path)]

    def spoken(text: str) -> bool:
        return "use uv" in text.lower()

    async with running(Config(), port=0, store=Store(state), scripted={"scripted": ScriptedUpstream()},
                       model=Model()) as proxy:
        await session_one(proxy, tmp_path, f"Please list files. {RULE_TEXT}", "one")
        memory = await settled(state, tmp_path, lambda m: {r.kind for r in m.records.values()} >= {RULE, EXPERIENCE})
        (rule,) = [r.id for r in memory.records.values() if r.kind == RULE]
        (quoting,) = [r.id for r in memory.records.values() if r.kind == EXPERIENCE]
        two = await session_one(proxy, tmp_path, "Add a flag.", "two")  # it reads the memory before the forget
        assert spoken(two.first_tail())
        assert main(["memory", "forget", rule, *common]) == 0
        three = await session_one(proxy, tmp_path, "Add another flag.", "three")  # it ends a turn: the proxy saves
        assert MEMORY_NOTE in three.first_tail() and not spoken(three.first_tail())
        saved = await settled(state, tmp_path, lambda m: any("another flag" in r.text for r in m.records.values()))
        assert rule not in saved.records and quoting not in saved.records
        assert not any(spoken(r.text) for r in saved.records.values()), "the proxy wrote no quote of it back"


def test_tool_output_pasted_into_a_user_turn_makes_no_rule() -> None:
    """A clause after a colon counts only after a few plain words: a test failure or an error line the user pasted
    is not their instruction."""
    assert distill.durable("We switched tooling: always use pip, never uv.")
    assert not distill.durable("FAILED tests/test_x.py::test_y - AssertionError: always returns None")
    assert not distill.durable("Error: always-on feature flag missing; never mind.")


async def test_a_session_going_on_at_another_proxy_keeps_its_memory_note_and_recalls_nothing_again(
        tmp_path: Path) -> None:
    """Two proxies on one state directory (or replicas on Redis) serve one session: the memory note recalled on
    its first request stays where it was on the other proxy, which recalls nothing a second time."""
    state = tmp_path / "state"
    memory = Memory(str(tmp_path.resolve()))
    memory.add(Candidate(RULE, RULE_TEXT, "user turn 1 of session s0"), 1.0, "s0")
    MemoryFiles(state / FOLDER).save(memory, set())
    script = ScriptedUpstream()
    async with running(Config(), port=0, store=Store(state), scripted={"scripted": script}, model=Model()) as a, \
            running(Config(), port=0, store=Store(state), scripted={"scripted": script}, model=Model()) as b:
        agent = Agent(a, "moving", tmp_path, "Refactor the parser.")
        for n in range(4):
            agent.proxy = (a, b)[n // 2]
            await agent.turn(agent.call(f"ls {n}", "x"))
    assert all(body.count(RULE_TEXT.encode()) == 1 for body in agent.sent)
    prompts = [agent.fmt.prompt(orjson.loads(body)) for body in agent.sent]
    for before, after in zip(prompts, prompts[1:]):
        assert shared_prefix(before, after) == sum(map(len, before))
    recalled = [line.get("learning", {}).get("recalled") for line in Store(state).read_ledger("moving")]
    assert sum(bool(r) for r in recalled) == 1, recalled
