"""``proxyvisor replay --gate``: a trajectory replayed with the verify-gate on, its decision shown at every stop.

The sample ``examples/replay/forbidden-then-permitted-tests.jsonl`` (written for this project) is a two-turn
session: the user forbids the tests, the agent edits and stops (the check's absence is compliance); the user then
permits them, the agent runs them (a failure), fixes and stops after a passing run (verified).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from proxyvisor.scripted import verifier as scripted_verifier
from proxyvisor.condense.text import count_tokens
from proxyvisor.config import Config
from proxyvisor.proxy.formats import BY_NAME
from proxyvisor.replay import (NO_VERDICT, final_label, format_stop, gate_stops, load_trajectory, replay_gated,
                               to_the_end)
from proxyvisor.store import Store
from proxyvisor.supervisor_model import ModelAnswer

ROOT = Path(__file__).resolve().parent.parent
SAMPLE = ROOT / "examples" / "replay" / "forbidden-then-permitted-tests.jsonl"
SUBMITTED = Path(__file__).parent / "fixtures" / "trajectories" / "done-while-last-test-run-failed.jsonl"


class Policy:
    """The scripted verifier policy as a model double, keeping each call's digest."""

    def __init__(self) -> None:
        self.digests: list[str] = []

    async def __call__(self, messages: list[dict[str, str]]) -> ModelAnswer:
        self.digests.append(messages[1]["content"])
        return ModelAnswer(scripted_verifier.answer(BY_NAME["chat"], {"messages": messages}))


@pytest.mark.parametrize(("fmt", "stream"), [("chat", False), ("messages", True), ("responses", False)])
async def test_every_stop_shows_the_gates_record(tmp_path: Path, fmt: str, stream: bool) -> None:
    policy = Policy()
    rounds = await replay_gated(Config(), load_trajectory(SAMPLE), BY_NAME[fmt], stream, store=Store(tmp_path),
                                model=policy)
    assert all(r.matches for r in rounds)
    stops = gate_stops(rounds)
    assert [s.message for s in stops] == [6, 14] and all(s.gated for s in stops)
    first, last = stops
    # Turn 1 forbade the tests: their absence is compliance, passed on reading alone.
    assert (first.outcome, first.passed, first.gaps, first.decided_by) == ("unknown", True, [], "model")
    assert "- [turn 1] Do not run the tests, the suite needs a database" in policy.digests[0]
    # Turn 2 permitted them: the prohibition is lifted, and a passing run after the last change verifies.
    assert "<prohibitions" not in policy.digests[1]
    assert (last.outcome, last.passed) == ("verified", True)
    assert [s.digest_tokens for s in stops] == [count_tokens(d) for d in policy.digests]
    assert final_label(stops) == "verified"


async def test_a_stop_with_gaps_ends_unverified_with_them(tmp_path: Path) -> None:
    messages = load_trajectory(SAMPLE)[:7]  # the first turn only
    messages[1] = {**messages[1], "content": "slugify() in text.py keeps leading and trailing dashes; fix it."}
    rounds = await replay_gated(Config(), messages, BY_NAME["chat"], store=Store(tmp_path))
    (stop,) = gate_stops(rounds)
    assert (stop.outcome, stop.passed, stop.verdicts) == ("unverified", False, ["gaps"])
    assert stop.gaps and "check" in stop.gaps[0]
    # The free evidence settled it (an edit and no check after it): no verifier call, so no digest.
    assert (stop.decided_by, stop.digest_tokens, stop.route) == ("evidence", None, None)
    assert rounds[-1].matches  # the answer itself is delivered as recorded
    assert "decided by evidence" in format_stop(stop) and "no digest (no verifier call)" in format_stop(stop)


def test_the_runs_last_tool_call_is_its_final_answer() -> None:
    messages = load_trajectory(SUBMITTED)
    ended = to_the_end(messages)
    assert ended[-1] == {"role": "assistant",
                         "content": "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && git add -A && git diff --cached"}
    assert ended[:-1] == messages[:len(ended) - 1]
    sample = load_trajectory(SAMPLE)
    assert to_the_end(sample) == sample  # already ends with a text answer
    assert final_label([]) == NO_VERDICT


def test_the_command_prints_the_gate_at_every_stop(tmp_path: Path) -> None:
    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "proxyvisor", "replay", "--gate", "--state-dir",
                               str(tmp_path / "state"), *args, str(SAMPLE)], capture_output=True, text=True,
                              timeout=120)

    text = run()
    assert text.returncode == 0, text.stderr
    gate_lines = [line.strip() for line in text.stdout.splitlines() if line.strip().startswith("gate:")]
    assert len(gate_lines) == 2 and "unknown (passed)" in gate_lines[0] and "verified (passed)" in gate_lines[1]
    assert all("decided by model" in line and "tokens" in line for line in gate_lines)
    assert text.stdout.rstrip().endswith("final label: verified")
    as_json = run("--json", "--format", "messages")
    stops = [json.loads(line) for line in as_json.stdout.splitlines()]
    assert [(s["message"], s["outcome"]) for s in stops] == [(6, "unknown"), (14, "verified")]
    assert set(stops[0]) == {"round", "message", "gated", "decided_by", "outcome", "passed", "reason", "gaps",
                             "verdicts", "digest_tokens", "route", "model"}
    assert stops[0]["route"] == "session"  # no [supervisor.model]: the session's own (scripted) upstream judged


def test_a_file_without_messages_is_an_error_not_an_empty_replay(tmp_path: Path) -> None:
    for name, text in (("empty.jsonl", ""), ("blank.jsonl", "\n  \n")):
        path = tmp_path / name
        path.write_text(text)
        for flags in (["--gate"], []):
            done = subprocess.run([sys.executable, "-m", "proxyvisor", "replay", *flags, "--state-dir",
                                   str(tmp_path / "state"), str(path)], capture_output=True, text=True, timeout=120)
            assert done.returncode == 2, (flags, done.stdout, done.stderr)
            assert f"{path} holds no messages" in done.stderr and "Traceback" not in done.stderr
