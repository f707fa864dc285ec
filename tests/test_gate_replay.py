"""The verify-gate on a replayed trajectory: the agent's final answer after a failing run is sent back, quoting it.

The fixture ``fixtures/trajectories/done-while-last-test-run-failed.jsonl`` is a hand-written mini-swe-agent-style
run (tool calls ``bash``, outputs with ``<returncode>``): it edits ``text.py``, runs the tests (1 failed, 3 passed),
re-reads its diff and submits with ``echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT``, a tool call, presented as the
final answer by :func:`proxyvisor.replay.as_final_answer` (bench/gate_corpus.py does the same for the corpus).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from proxyvisor.config import Config
from proxyvisor.proxy.formats import BY_NAME
from proxyvisor.replay import TrajectoryError, as_final_answer, load_trajectory, replay
from proxyvisor.store import Store
from proxyvisor.supervisor_model import ModelAnswer

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

    async def __call__(self, messages: list[dict[str, str]]) -> ModelAnswer:
        self.calls.append((self.request, messages))
        return ModelAnswer(PASS)


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
async def test_the_final_answer_after_a_failing_run_is_sent_back_quoting_it_without_a_model_call(
        tmp_path: Path, fmt: str, stream: bool) -> None:
    messages = as_final_answer(load_trajectory(FIXTURE), SUBMIT)
    recorder = Recorder()
    store = Store(tmp_path)
    rounds = await replay(Config(), messages, BY_NAME[fmt], stream, session="gated", store=store, model=recorder, gate=True,
                          on_round=recorder.next_request)
    assert [r.message for r in rounds] == [2, 4, 6, 8, SUBMIT]
    assert all(r.matches for r in rounds[:-1])  # the tool rounds are not gated
    # The latest check after the edit failed: the free evidence decides, with no verifier call, and the turn goes
    # on upstream (the scripted upstream's own reply, not the recorded one).
    assert not recorder.calls and not rounds[-1].matches
    failing = messages[7]["content"]
    assert "1 failed, 3 passed" in failing[-200:]
    gate = store.read_ledger("gated")[-1]["gate"]
    assert (gate["decided_by"], gate["verdicts"], gate["reentries"]) == (["evidence"], ["gaps"], 1)
    assert "`python -m pytest -q test_text.py` reported" in gate["gaps"][0] and "1 failed, 3 passed" in gate["gaps"][0]
