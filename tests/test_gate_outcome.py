"""The per-turn gate state machine: every path of its table, driven with evidence and parsed verifier answers."""

from __future__ import annotations

import json

import pytest

from proxyvisor.config import GateConfig
from proxyvisor.detectors.checks import FAILED as CHECK_FAILED
from proxyvisor.detectors.checks import PASSED as CHECK_PASSED
from proxyvisor.gate.digest import Check, Evidence, build, evidence, turn_actions
from proxyvisor.gate.outcome import (
    DONE,
    EVIDENCE,
    MODEL,
    NEXT,
    TABLE,
    FAILED,
    NUDGE_BUDGET,
    UNKNOWN,
    UNVERIFIED,
    VERIFIED,
    Answered,
    Deliver,
    GatePolicy,
    GateProtocolError,
    Malformed,
    Nudge,
    Reenter,
    Refute,
    Refuted,
    Stop,
    TurnGate,
    Unavailable,
    Verify,
    NOTICE_GAP_CHARS,
    answer_event,
    gap_line,
    naming,
)
from proxyvisor.gate.verdict import Gap, parse, refute
from proxyvisor.rules import FAIL_CLOSED, FAIL_OPEN, REENTRY_BUDGET
from proxyvisor.transcript import Message, ToolOutput, ToolUse

PASSED_RUN = Check(3, "pytest -q", CHECK_PASSED, "3 passed in 0.12s")
FAILED_RUN = Check(3, "pytest -q 2>&1 | tail -3", CHECK_FAILED, "1 failed, 2 passed in 0.12s")


def checked(seq: int = 4) -> Evidence:
    """A change, then a check that passed: evidence that leaves the judgment to the model."""
    return Evidence(changed=True, latest=PASSED_RUN, seq=seq)


CHANGED_AND_CHECKED = checked()
UNCHECKED = Evidence(changed=True, seq=2)
GAP = {"requirement": 1, "gap": "pytest still fails", "settles": "a passing pytest run"}


def verifier(gaps=(), verdict=None, handback=None, handback_judged=False) -> Answered | Malformed:
    status = "unmatched" if gaps else "matched"
    data = {"requirements": [{"id": 1, "requirement": "tests pass", "status": status, "basis": "recorded_output"}],
            "gaps": list(gaps), "handback": handback, "verdict": verdict or ("gaps" if gaps else "pass")}
    return answer_event(parse(json.dumps(data), handback=handback_judged))


NOTICE = "[proxyvisor] not verified"


def gaps_round(gate: TurnGate, gaps=(GAP,), evidence=CHANGED_AND_CHECKED, refuter: str | None = None):
    """One stop -> verify -> gaps -> refutation, returning the decision after refutation."""
    assert isinstance(gate.handle(Stop("done", evidence)), Verify)
    refute_decision = gate.handle(verifier(gaps))
    assert isinstance(refute_decision, Refute)
    return gate.handle(Refuted(refute(refute_decision.gaps, refuter).kept))


def test_pass_with_change_and_check_is_verified() -> None:
    gate = TurnGate()
    assert gate.handle(Stop("done", CHANGED_AND_CHECKED)) == Verify(handback=False)
    decision = gate.handle(verifier())
    assert decision == gate.outcome and isinstance(decision, Deliver)
    assert (decision.outcome, decision.passed, gate.state) == (VERIFIED, True, DONE)


@pytest.mark.parametrize(("state", "evidence"), [
    (None, Evidence()),  # a stop without a status is gated too
    ("done", Evidence(latest=PASSED_RUN, seq=1)),  # a check passed, but nothing changed
    ("exploring", UNCHECKED),  # not a completion: the evidence pre-check stands aside
    ("exploring", Evidence(True, FAILED_RUN, None, 3)),  # a failed latest check never ends verified
])
def test_pass_on_reading_alone_is_unknown(state: str | None, evidence: Evidence) -> None:
    gate = TurnGate()
    assert isinstance(gate.handle(Stop(state, evidence)), Verify)
    assert gate.handle(verifier()) == Deliver(UNKNOWN, True, "completion passed on reading alone")


def test_gaps_then_pass() -> None:
    gate = TurnGate()
    decision = gaps_round(gate)
    assert isinstance(decision, Reenter) and decision.gaps == (Gap("pytest still fails", "a passing pytest run", 1),)
    assert "pytest still fails" in decision.advisory and "a passing pytest run" in decision.advisory
    assert gate.handle(Stop("done", CHANGED_AND_CHECKED)) == Verify(False, previous_gaps=decision.gaps)
    final = gate.handle(verifier())
    assert isinstance(final, Deliver) and final.outcome == VERIFIED and gate.reentries == 1


def test_same_gaps_after_new_evidence_stop_early_as_failed() -> None:
    gate = TurnGate(GatePolicy(notice=NOTICE))
    assert isinstance(gaps_round(gate, evidence=checked(2)), Reenter)
    moved = checked(5)
    reworded = {**GAP, "gap": "  PYTEST still   fails"}
    decision = gaps_round(gate, gaps=(reworded,), evidence=moved)
    assert isinstance(decision, Deliver) and (decision.outcome, decision.passed) == (FAILED, False)
    assert decision.notice == NOTICE + ": PYTEST still fails." and "PYTEST still   fails" in decision.gaps[0].text


def test_same_gaps_without_new_evidence_re_enter_until_the_budget() -> None:
    gate = TurnGate()
    assert isinstance(gaps_round(gate), Reenter)
    assert isinstance(gaps_round(gate), Reenter)  # nothing new was done: not a stall, spend the budget
    decision = gaps_round(gate)
    assert isinstance(decision, Deliver) and (decision.outcome, decision.passed) == (UNVERIFIED, False)
    assert "budget spent" in decision.reason and gate.reentries == 2


MAX_REENTRIES = int(REENTRY_BUDGET.high)


@pytest.mark.parametrize("budget", [0, 1, 3, MAX_REENTRIES])
def test_budget_spent_after_the_configured_reentries(budget: int) -> None:
    gate = TurnGate(GatePolicy(reentry_budget=budget))
    for n in range(budget):
        gap = {**GAP, "gap": f"gap {n}"}  # different gaps each time, with new evidence: never a stall
        assert isinstance(gaps_round(gate, gaps=(gap,), evidence=checked(n)), Reenter)
    decision = gaps_round(gate, gaps=({**GAP, "gap": "last"},), evidence=checked(99))
    assert isinstance(decision, Deliver) and decision.outcome == UNVERIFIED and gate.reentries == budget


@pytest.mark.parametrize("policy", [
    {"reentry_budget": -1}, {"reentry_budget": MAX_REENTRIES + 1}, {"failure_policy": "ignore"}])
def test_invalid_policy_is_refused(policy: dict) -> None:
    with pytest.raises(ValueError):
        GatePolicy(**policy)


def test_refutation_drops_a_finding_and_the_rest_re_enter() -> None:
    gate = TurnGate()
    second = {"requirement": 1, "gap": "README not updated", "settles": "a README diff"}
    reply = json.dumps({"findings": [{"id": 2, "status": "refuted", "citation": "#5 edited README.md"}]})
    decision = gaps_round(gate, gaps=(GAP, second), refuter=reply)
    assert isinstance(decision, Reenter) and [g.text for g in decision.gaps] == ["pytest still fails"]
    assert "README" not in decision.advisory


def test_refutation_dropping_every_finding_passes() -> None:
    gate = TurnGate()
    reply = json.dumps({"findings": [{"id": 1, "status": "refuted", "citation": "#4 pytest: 13 passed"}]})
    decision = gaps_round(gate, evidence=CHANGED_AND_CHECKED, refuter=reply)
    assert isinstance(decision, Deliver) and (decision.outcome, decision.passed) == (VERIFIED, True)


def test_failed_refuter_leaves_gaps_standing() -> None:
    assert isinstance(gaps_round(TurnGate(), refuter=None), Reenter)


def test_malformed_then_repaired() -> None:
    gate = TurnGate()
    gate.handle(Stop("done", CHANGED_AND_CHECKED))
    bad = answer_event(parse("Looks complete to me. PASS"))
    assert isinstance(bad, Malformed)
    assert gate.handle(bad) == Verify(handback=False, format_retry=True)
    decision = gate.handle(verifier())
    assert isinstance(decision, Deliver) and decision.outcome == VERIFIED


@pytest.mark.parametrize(("policy", "passed"), [(GatePolicy(), False), (GatePolicy(failure_policy=FAIL_OPEN), True)])
def test_malformed_twice_counts_as_verifier_down(policy: GatePolicy, passed: bool) -> None:
    gate = TurnGate(policy)
    gate.handle(Stop("done", CHANGED_AND_CHECKED))
    gate.handle(Malformed("not JSON"))
    decision = gate.handle(Malformed("not JSON"))
    assert isinstance(decision, Deliver) and (decision.outcome, decision.passed) == (UNVERIFIED, passed)
    assert "format retry" in decision.reason


def test_verifier_down_fail_closed_is_labelled_and_never_silently_passed() -> None:
    gate = TurnGate(GatePolicy(notice=NOTICE))  # fail_closed is the default
    gate.handle(Stop("done", CHANGED_AND_CHECKED))
    decision = gate.handle(Unavailable("connect timeout"))
    assert isinstance(decision, Deliver)
    assert (decision.outcome, decision.passed) == (UNVERIFIED, False) and decision.notice
    assert "fail_closed" in decision.reason and "connect timeout" in decision.reason


def test_verifier_down_fail_open_passes_but_stays_unverified() -> None:
    gate = TurnGate(GatePolicy(failure_policy=FAIL_OPEN))
    gate.handle(Stop("done", CHANGED_AND_CHECKED))
    decision = gate.handle(Unavailable("HTTP 503"))
    assert isinstance(decision, Deliver) and (decision.outcome, decision.passed, decision.notice) == (
        UNVERIFIED, True, None)


@pytest.mark.parametrize("state", ["blocked", "need_input"])
def test_legitimate_handback_passes(state: str) -> None:
    gate = TurnGate(GatePolicy(headless=True))
    assert gate.handle(Stop(state, UNCHECKED)) == Verify(handback=True)
    decision = gate.handle(verifier(handback={"needs_user": True, "reason": "needs the deploy key"},
                                    handback_judged=True))
    assert isinstance(decision, Deliver) and (decision.outcome, decision.passed) == (UNKNOWN, True)
    assert "hand-back accepted" in decision.reason


def test_illegitimate_handback_is_sent_back_to_work() -> None:
    gate = TurnGate()
    gate.handle(Stop("blocked", UNCHECKED))
    refute_decision = gate.handle(verifier(handback={"needs_user": False, "reason": "pip install works here"},
                                           handback_judged=True))
    assert isinstance(refute_decision, Refute)
    decision = gate.handle(Refuted(refute_decision.gaps))
    assert isinstance(decision, Reenter) and "hand-back not needed: pip install works here" in decision.advisory
    assert gate.handle(Stop("done", CHANGED_AND_CHECKED)) == Verify(False, previous_gaps=decision.gaps)


def test_prohibition_honoured_a_missing_test_run_is_not_charged() -> None:
    # "Do not run tests": the verifier marks the test requirement matched (compliance), so the turn passes; with no
    # check run the label is unknown, never verified and never failed.
    actions = turn_actions([
        Message("assistant", tool_uses=(ToolUse("c1", "Edit", {"file_path": "README.md"}),)),
        Message("tool", tool_outputs=(ToolOutput("c1", "The file README.md has been updated."),))])
    doc = build("Make the documentation edits. Do not run tests; I will test myself.", ["Edited README.md."], actions)
    assert '<prohibitions authority="user">\n- [turn 1] Do not run tests;\n</prohibitions>' in doc
    gate = TurnGate()
    gate.handle(Stop("done", evidence(actions)))
    decision = gate.handle(verifier())
    assert isinstance(decision, Deliver) and (decision.outcome, decision.passed) == (UNKNOWN, True)


@pytest.mark.parametrize("state", ["exploring", "progressing"])
def test_headless_in_progress_stop_is_nudged_twice_then_verified(state: str) -> None:
    gate = TurnGate(GatePolicy(headless=True))
    for _ in range(NUDGE_BUDGET):
        assert isinstance(gate.handle(Stop(state, UNCHECKED)), Nudge)
    assert gate.handle(Stop(state, UNCHECKED)) == Verify(handback=False)
    assert gate.nudges == NUDGE_BUDGET


@pytest.mark.parametrize(("headless", "state"), [(False, "exploring"), (False, "progressing"), (True, "done"),
                                                 (True, None), (True, "blocked")])
def test_no_nudge_when_interactive_or_not_in_progress(headless: bool, state: str | None) -> None:
    assert isinstance(TurnGate(GatePolicy(headless=headless)).handle(Stop(state, CHANGED_AND_CHECKED)), Verify)


def test_events_out_of_order_are_protocol_errors() -> None:
    gate = TurnGate()
    with pytest.raises(GateProtocolError):
        gate.handle(Answered(parse(json.dumps({}))))  # type: ignore[arg-type]
    gate.handle(Stop("done", CHANGED_AND_CHECKED))
    with pytest.raises(GateProtocolError):
        gate.handle(Stop("done", CHANGED_AND_CHECKED))
    gate.handle(Unavailable("down"))
    with pytest.raises(GateProtocolError):
        gate.handle(Stop("done", CHANGED_AND_CHECKED))


# ---- the evidence pre-check ------------------------------------------------------------------------------------

@pytest.mark.parametrize("state", ["done", None])
def test_a_completion_whose_latest_check_failed_gets_a_gap_quoting_it_without_a_model(state: str | None) -> None:
    gate = TurnGate()
    decision = gate.handle(Stop(state, Evidence(True, FAILED_RUN, None, 3)))
    assert isinstance(decision, Reenter) and decision.decided_by == EVIDENCE and gate.state == "working"
    assert len(decision.gaps) == 1 and '"1 failed, 2 passed in 0.12s"' in decision.gaps[0].text
    assert "pytest -q 2>&1 | tail -3" in decision.gaps[0].text and decision.gaps[0].settles
    assert "recorded evidence, without a model call" in decision.advisory and "1 failed, 2 passed" in decision.advisory
    # The agent fixes it and the check passes: now the model judges, and its pass is verified.
    assert gate.handle(Stop("done", checked(6))) == Verify(False, previous_gaps=decision.gaps)
    final = gate.handle(verifier())
    assert isinstance(final, Deliver) and (final.outcome, final.decided_by) == (VERIFIED, MODEL)


def test_the_same_failing_check_after_new_evidence_ends_failed_and_without_any_budget_unverified() -> None:
    gate = TurnGate()
    assert isinstance(gate.handle(Stop("done", Evidence(True, FAILED_RUN, None, 3))), Reenter)
    decision = gate.handle(Stop("done", Evidence(True, FAILED_RUN, None, 5)))  # new actions, the same failure
    assert isinstance(decision, Deliver) and (decision.outcome, decision.passed) == (FAILED, False)
    assert decision.decided_by == EVIDENCE and "1 failed" in decision.gaps[0].text
    decision = TurnGate(GatePolicy(reentry_budget=0)).handle(Stop("done", Evidence(True, FAILED_RUN, None, 3)))
    assert isinstance(decision, Deliver) and (decision.outcome, decision.decided_by) == (UNVERIFIED, EVIDENCE)


def test_a_completion_without_a_check_after_the_last_change_is_asked_for_the_checks() -> None:
    decision = TurnGate().handle(Stop("done", UNCHECKED))
    assert isinstance(decision, Reenter) and decision.decided_by == EVIDENCE
    assert "no check ran after the last change" in decision.gaps[0].text and "checks" in decision.gaps[0].settles
    # An earlier check, before the last change, is quoted (here it failed).
    decision = TurnGate().handle(Stop(None, Evidence(True, None, FAILED_RUN, 4)))
    assert isinstance(decision, Reenter) and "failed" in decision.gaps[0].text
    assert "1 failed, 2 passed in 0.12s" in decision.gaps[0].text


def test_the_checks_are_asked_for_once_then_the_model_judges_the_answer() -> None:
    # The project may have no runnable checks; the agent's answer to the request is the model's to judge.
    gate = TurnGate()
    assert isinstance(gate.handle(Stop("done", Evidence(True, None, None, 2, last_change=2))), Reenter)
    assert gate.handle(Stop("done", Evidence(True, None, None, 3, last_change=2))) == Verify(
        handback=False, previous_gaps=gate.previous_gaps)
    assert gate.handle(verifier()) == Deliver(UNKNOWN, True, "completion passed on reading alone")
    # Another change since and still no check: the evidence charges the same gap again (here: failed, the same gap
    # after new evidence).
    gate = TurnGate()
    assert isinstance(gate.handle(Stop("done", Evidence(True, None, None, 2, last_change=2))), Reenter)
    decision = gate.handle(Stop("done", Evidence(True, None, None, 5, last_change=4)))
    assert isinstance(decision, Deliver) and (decision.outcome, decision.decided_by) == (FAILED, EVIDENCE)
    # A failed check is a finding, not a request: it is charged by the evidence every time.
    gate = TurnGate()
    assert isinstance(gate.handle(Stop("done", UNCHECKED)), Reenter)
    decision = gate.handle(Stop("done", Evidence(True, FAILED_RUN, None, 3)))
    assert isinstance(decision, Reenter) and decision.decided_by == EVIDENCE


CONFIGURED = GateConfig().unverified_notice


@pytest.mark.parametrize("evidence", [Evidence(True, FAILED_RUN, None, 3), Evidence(True, None, FAILED_RUN, 3)])
def test_an_answer_delivered_on_the_evidences_gap_names_it_in_the_notice(evidence: Evidence) -> None:
    gate = TurnGate(GatePolicy(reentry_budget=0, notice=CONFIGURED))
    decision = gate.handle(Stop("done", evidence))
    assert isinstance(decision, Deliver) and (decision.outcome, decision.decided_by) == (UNVERIFIED, EVIDENCE)
    assert decision.notice == naming(CONFIGURED, decision.gaps[0])
    if evidence.latest is not None:
        assert decision.notice == (
            "[proxyvisor] This answer could not be verified: the latest check after the last change failed: "
            '`pytest -q 2>&1 | tail -3` reported "1 failed, 2 passed in 0.12s". Check it before relying on it.')
    else:
        assert decision.notice.startswith(
            "[proxyvisor] This answer could not be verified: state changed but no check ran after the last change; "
            "the latest check, before it, failed: ")
        assert decision.notice.endswith(". Run the project's checks on the result. Check it before relying on it.")
    # The same failure after new evidence ends the turn failed, naming it alike.
    gate = TurnGate(GatePolicy(notice=CONFIGURED))
    assert isinstance(gate.handle(Stop("done", Evidence(True, FAILED_RUN, None, 3))), Reenter)
    failed = gate.handle(Stop("done", Evidence(True, FAILED_RUN, None, 5)))
    assert isinstance(failed, Deliver) and failed.outcome == FAILED
    assert failed.notice is not None and '"1 failed, 2 passed in 0.12s". Check it' in failed.notice
    # No gap stands (the verifier was unavailable): the configured notice as it is.
    gate = TurnGate(GatePolicy(notice=CONFIGURED))
    gate.handle(Stop("done", CHANGED_AND_CHECKED))
    assert gate.handle(Unavailable("down")).notice == CONFIGURED


@pytest.mark.parametrize(("notice", "gap", "shown"), [
    ("Unverified: check it.", "The tests were not run", "Unverified: the tests were not run. Check it."),
    ("Unverified: check it.", "README is stale!", "Unverified: README is stale! Check it."),  # an acronym keeps its case
    ("Not verified.", "the tests were not run.", "Not verified. The tests were not run."),
    ("Not verified", "The tests\n  were not run.", "Not verified: the tests were not run."),
    ("Unverified: check it.", "API_KEY=abc123def456 leaked", "Unverified: API_KEY=[redacted] leaked. Check it."),
])
def test_a_notice_names_a_gap_on_one_line_as_a_sentence_of_its_own(notice: str, gap: str, shown: str) -> None:
    assert naming(notice, Gap(gap, "")) == shown


def test_a_long_gap_is_clipped_to_one_line_in_the_notice() -> None:
    named = naming(CONFIGURED, Gap("The check failed: " + "x" * 5000 + " at the end.", ""))
    assert "\n" not in named and len(named) < len(CONFIGURED) + NOTICE_GAP_CHARS + 60
    assert gap_line(Gap("a\n\n  b", "")) == "a b" and named.endswith(" at the end. Check it before relying on it.")


def test_forbidden_checks_leave_a_missing_run_to_the_model() -> None:
    gate = TurnGate()
    assert gate.handle(Stop("done", UNCHECKED, checks_forbidden=True)) == Verify(handback=False)
    assert gate.handle(verifier()) == Deliver(UNKNOWN, True, "completion passed on reading alone")


@pytest.mark.parametrize("state", ["blocked", "need_input", "exploring", "progressing"])
def test_the_evidence_pre_check_judges_completions_only(state: str) -> None:
    for ev in (UNCHECKED, Evidence(True, FAILED_RUN, None, 3)):
        assert isinstance(TurnGate().handle(Stop(state, ev)), Verify)


def test_every_transition_is_in_the_table() -> None:
    # Drive every path above once more through a recorder of (state, event, next state) and compare with TABLE.
    seen: set[tuple[str, type, str]] = set()
    original = TurnGate.handle

    def recording(self: TurnGate, event):  # type: ignore[no-untyped-def]
        before = self.state
        decision = original(self, event)
        seen.add((before, type(event), self.state))
        assert self.state == NEXT[type(decision)]
        return decision

    TurnGate.handle = recording  # type: ignore[method-assign]
    try:
        test_a_completion_whose_latest_check_failed_gets_a_gap_quoting_it_without_a_model("done")
        test_the_same_failing_check_after_new_evidence_ends_failed_and_without_any_budget_unverified()
        test_gaps_then_pass()
        test_malformed_then_repaired()
        test_verifier_down_fail_open_passes_but_stays_unverified()
        test_headless_in_progress_stop_is_nudged_twice_then_verified("exploring")
    finally:
        TurnGate.handle = original  # type: ignore[method-assign]
    for before, event, after in seen:
        assert after in TABLE[before][event][1]
    assert {(b, e) for b, e, _ in seen} == {(s, e) for s, events in TABLE.items() for e in events}



@pytest.mark.parametrize(("policy", "notice", "shown"), [
    (FAIL_CLOSED, NOTICE, NOTICE + ": pytest still fails."), (FAIL_CLOSED, "  ", None), (FAIL_OPEN, NOTICE, None)])
def test_an_answer_delivered_not_passed_carries_the_notice_only_under_fail_closed(
        policy: str, notice: str, shown: str | None) -> None:
    gate = TurnGate(GatePolicy(reentry_budget=0, failure_policy=policy, notice=notice))
    decision = gaps_round(gate)  # gaps with no re-entry left: unverified, not passed, whatever the policy
    assert isinstance(decision, Deliver) and (decision.outcome, decision.passed) == (UNVERIFIED, False)
    assert decision.notice == shown
    passed = TurnGate(GatePolicy(failure_policy=policy, notice=notice))
    passed.handle(Stop("done", CHANGED_AND_CHECKED))
    assert passed.handle(verifier()).notice is None  # a passed answer never carries it
