"""The verify-gate on a replayed trajectory: asked at the agent's final answer, with the failing run in its digest.

The fixture ``fixtures/trajectories/done-while-last-test-run-failed.jsonl`` is a hand-written mini-swe-agent-style
run (tool calls ``bash``, outputs with ``<returncode>``): it edits ``text.py``, runs the tests (1 failed, 3 passed),
re-reads its diff and submits with ``echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT``, a tool call, presented as the
final answer by :func:`proxyvisor.replay.as_final_answer` (bench/gate_corpus.py does the same for the corpus).
"""

from __future__ import annotations

import json
from pathlib import Path
from xml.sax.saxutils import escape

import pytest

from proxyvisor.config import Config
from proxyvisor.gate.verdict import VERIFIER_INSTRUCTIONS
from proxyvisor.proxy.formats import BY_NAME
from proxyvisor.replay import TrajectoryError, as_final_answer, load_trajectory, replay
from proxyvisor.store import Store

from helpers import FORMATS

FIXTURE = Path(__file__).parent / "fixtures" / "trajectories" / "done-while-last-test-run-failed.jsonl"
SUBMIT = 10
"""The line of the submit tool call."""
PASS = json.dumps({"requirements": [{"id": 1, "requirement": "strip dashes", "status": "matched", "basis": None,
                                     "evidence": "e"}], "gaps": [], "handback": None, "verdict": "pass"})


class Recorder:
    """A supervisor model double: answers every call "pass" and keeps (request number, messages) of each."""

    def __init__(self) -> None:
        self.request = 1
        self.calls: list[tuple[int, list[dict[str, str]]]] = []

    def next_request(self, _round: object) -> None:
        self.request += 1

    async def __call__(self, messages: list[dict[str, str]]) -> str:
        self.calls.append((self.request, messages))
        return PASS


def test_a_submit_tool_call_becomes_the_final_text_answer() -> None:
    messages = load_trajectory(FIXTURE)
    presented = as_final_answer(messages, SUBMIT)
    assert presented[:SUBMIT] == messages[:SUBMIT]
    assert presented[-1] == {"role": "assistant",
                             "content": "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && git add -A && git diff --cached"}
    assert as_final_answer(messages, 8)[-1] == {"role": "assistant", "content": messages[8]["content"]}
    with pytest.raises(TrajectoryError):
        as_final_answer(messages, 9)  # a tool result


@pytest.mark.parametrize(("fmt", "stream"), [(f, s) for f in FORMATS for s in (False, True)])
async def test_the_gate_is_asked_at_the_final_answer_with_the_failing_run_in_its_digest(
        tmp_path: Path, fmt: str, stream: bool) -> None:
    messages = as_final_answer(load_trajectory(FIXTURE), SUBMIT)
    recorder = Recorder()
    store = Store(tmp_path)
    rounds = await replay(Config(), messages, BY_NAME[fmt], stream, session="gated", store=store, model=recorder, gate=True,
                          on_round=recorder.next_request)
    assert all(r.matches for r in rounds) and [r.message for r in rounds] == [2, 4, 6, 8, SUBMIT]
    # One verifier call, on the last request: the tool rounds are not gated.
    ((request, call),) = recorder.calls
    assert request == len(rounds) and call[0]["content"] == VERIFIER_INSTRUCTIONS
    digest = call[1]["content"]
    failing = messages[7]["content"]
    assert escape(failing[-200:]) in digest  # the failing run's tail, its summary line included
    assert "1 failed, 3 passed" in failing[-200:]
    assert escape(messages[1]["content"]) in digest  # the task is the turn's request
    assert "No check succeeded since the last change" in digest
    assert "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT" in digest  # the final answer
    # Passed on reading alone: the only check after the edit failed.
    gate = store.read_ledger("gated")[-1]["gate"]
    assert (gate["verdicts"], gate["outcome"]) == (["pass"], "unknown")
