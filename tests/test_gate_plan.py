"""The plan's sans-IO core (``proxyvisor.gate.plan``): the planner's answers per signal, the transitions, the
assumptions, the renderings and the planner input's bounds."""

from __future__ import annotations

import json
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxyvisor.detectors.receipts import receipt
from proxyvisor.gate.digest import REQUEST_CHARS, Action
from proxyvisor.gate.plan import (ACTION_LINES, ALLOWED, COMPLETED, FILE_ABSENT, FILE_EXISTS, IN_PROGRESS, MAX_PHASES,
                                  NO_PLAN, PENDING, PLANNER_INSTRUCTIONS, REASON_CHARS, Advance, Assumption, Create,
                                  Hold, NoPlan, Phase, Plan, Revise, apply, as_json, assumption, assumption_note,
                                  broken_assumptions, checklist, hold_note, parse_decision, planner_input,
                                  render_text)
from proxyvisor.gate.verdict import Malformed
from proxyvisor.transcript import ToolOutput, ToolUse


def task(n: int, **extra: Any) -> dict[str, Any]:
    return {"title": f"phase {n}", "done_when": f"condition {n}", **extra}


def answer(**fields: Any) -> str:
    return json.dumps(fields)


def created(n: int = 3, **first: Any) -> Plan:
    decision = parse_decision("request", answer(decision="create", title="Fix the build",
                                                tasks=[task(1, **first)] + [task(i) for i in range(2, n + 1)]))
    assert isinstance(decision, Create)
    plan = apply(None, decision)
    assert plan is not None
    return plan


# ---- parsing ------------------------------------------------------------------------------------------------------
def test_create_parses_tasks_and_starts_the_first_phase() -> None:
    plan = created(3, valid_if="file_exists: src/a.py")
    assert plan.title == "Fix the build"
    assert [p.status for p in plan.phases] == [IN_PROGRESS, PENDING, PENDING]
    assert plan.phases[0].valid_if == Assumption(FILE_EXISTS, "src/a.py")
    assert plan.current == 0 and plan.done == 0 and plan.open


@pytest.mark.parametrize("signal,kind", [(s, k) for s, kinds in ALLOWED.items() for k in kinds])
def test_every_allowed_decision_parses(signal: str, kind: str) -> None:
    fields: dict[str, Any] = {"decision": kind, "reason": "why", "summary": "did it", "title": "T",
                              "tasks": [task(1), task(2)]}
    decision = parse_decision(signal, json.dumps(fields))
    assert not isinstance(decision, Malformed) and decision.kind == kind


@pytest.mark.parametrize("signal,kind", [(s, k) for s in ALLOWED for k in ("create", "no_plan", "advance", "hold",
                                                                           "revise") if k not in ALLOWED[s]])
def test_a_decision_the_signal_does_not_allow_is_malformed(signal: str, kind: str) -> None:
    fields = {"decision": kind, "reason": "r", "summary": "s", "title": "T", "tasks": [task(1), task(2)]}
    assert isinstance(parse_decision(signal, json.dumps(fields)), Malformed)


@pytest.mark.parametrize("text", [
    "", "not json", "[1, 2]", '{"decision": 3}',
    answer(decision="create", title="T", tasks=[task(1)]),  # create needs 2
    answer(decision="create", title="T", tasks=[task(i) for i in range(MAX_PHASES + 1)]),  # more than 6
    answer(decision="create", title="", tasks=[task(1), task(2)]),
    answer(decision="create", title="T", tasks=[task(1), {"title": "no condition"}]),
    answer(decision="create", title="T", tasks=[task(1), "phase two"]),
    answer(decision="create", title="T", tasks=[task(1), task(2, valid_if=["file_exists: x"])]),
    answer(decision="create", title="T", tasks="one, two"),
])
def test_malformed_create_answers(text: str) -> None:
    assert isinstance(parse_decision("request", text), Malformed)


def test_revise_needs_one_to_six_tasks() -> None:
    assert isinstance(parse_decision("reassess", answer(decision="revise", reason="r", tasks=[])), Malformed)
    assert isinstance(parse_decision("reassess", answer(decision="revise", reason="r", tasks=[task(1)])), Revise)
    too_many = [task(i) for i in range(7)]
    assert isinstance(parse_decision("reassess", answer(decision="revise", reason="r", tasks=too_many)), Malformed)


def test_a_fenced_answer_with_prose_is_read() -> None:
    text = 'Here you go:\n```json\n{"decision": "hold", "reason": "no test ran yet"}\n```\nThanks.'
    assert parse_decision("phase_complete", text) == Hold("no test ran yet")


def test_an_unknown_signal_is_a_caller_bug() -> None:
    with pytest.raises(ValueError):
        parse_decision("finish", answer(decision="hold", reason="r"))


def test_long_text_is_clipped_to_one_line() -> None:
    decision = parse_decision("phase_complete", answer(decision="hold", reason="line one\nline two " + "x" * 2000))
    assert isinstance(decision, Hold)
    assert "\n" not in decision.reason and len(decision.reason) <= REASON_CHARS + 40
    assert decision.reason.startswith("line one line two")


@pytest.mark.parametrize("text,expected", [
    ("file_exists: src/a.py", Assumption(FILE_EXISTS, "src/a.py")),
    ("  FILE_ABSENT :  build/out  ", Assumption(FILE_ABSENT, "build/out")),
    ("the config is loaded", None), ("file_exists:", None), ("exists: a", None), (None, None), (3, None),
])
def test_assumptions_other_text_is_prose(text: Any, expected: Assumption | None) -> None:
    assert assumption(text) == expected


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(sorted(ALLOWED)), st.text(max_size=300))
def test_any_answer_gives_a_decision_or_malformed_never_an_exception(signal: str, text: str) -> None:
    result = parse_decision(signal, text)
    assert isinstance(result, Malformed) or result.kind in ALLOWED[signal]


# ---- transitions ---------------------------------------------------------------------------------------------------
def test_advance_completes_the_current_phase_and_starts_the_next() -> None:
    plan = apply(created(3), Advance("read the code"))
    assert plan is not None
    assert [p.status for p in plan.phases] == [COMPLETED, IN_PROGRESS, PENDING]
    assert plan.phases[0].summary == "read the code" and plan.current == 1 and plan.done == 1
    plan = apply(apply(plan, Advance("changed")), Advance(""))
    assert plan is not None and not plan.open and plan.current is None and plan.done == 3
    assert plan.phases[2].summary is None
    assert apply(plan, Advance("again")) == plan  # nothing left to advance


def test_hold_and_no_plan_change_nothing_and_nothing_applies_to_no_plan() -> None:
    plan = created(3)
    assert apply(plan, Hold("not yet")) is plan
    assert apply(plan, NoPlan("simple")) is plan
    assert apply(None, NoPlan("simple")) is None
    assert apply(None, Advance("x")) is None
    assert apply(None, Revise("x", (Phase("a", "b"),))) is None


def test_revise_replaces_only_the_unfinished_tail() -> None:
    plan = apply(created(3), Advance("done one"))
    revised = apply(plan, Revise("new approach", (Phase("alt 2", "c2"), Phase("alt 3", "c3"), Phase("alt 4", "c4"))))
    assert revised is not None
    assert [(p.title, p.status) for p in revised.phases] == [
        ("phase 1", COMPLETED), ("alt 2", IN_PROGRESS), ("alt 3", PENDING), ("alt 4", PENDING)]
    assert revised.phases[0].summary == "done one"


def test_revise_keeps_the_newest_completed_phases_that_fit_in_six() -> None:
    plan: Plan | None = created(5)
    for n in range(4):
        plan = apply(plan, Advance(f"s{n}"))
    revised = apply(plan, Revise("r", tuple(Phase(f"new {i}", "c") for i in range(4))))
    assert revised is not None and len(revised.phases) == MAX_PHASES
    assert [p.summary for p in revised.phases[:2]] == ["s2", "s3"]
    full = apply(plan, Revise("r", tuple(Phase(f"new {i}", "c") for i in range(MAX_PHASES))))
    assert full is not None and all(p.status != COMPLETED for p in full.phases)


_DECISIONS = st.one_of(
    st.builds(Advance, st.text(max_size=20)), st.builds(Hold, st.text(max_size=20)),
    st.builds(NoPlan, st.text(max_size=20)),
    st.builds(Revise, st.text(max_size=20), st.lists(st.builds(Phase, st.text(min_size=1, max_size=10),
                                                               st.text(min_size=1, max_size=10)),
                                                     min_size=1, max_size=MAX_PHASES).map(tuple)))


@settings(max_examples=200, deadline=None)
@given(st.integers(2, MAX_PHASES), st.lists(_DECISIONS, max_size=12))
def test_any_sequence_of_decisions_keeps_the_plan_well_formed(n: int, decisions: list[Any]) -> None:
    plan: Plan | None = created(n)
    for decision in decisions:
        plan = apply(plan, decision)
        assert plan is not None and 1 <= len(plan.phases) <= MAX_PHASES
        statuses = [p.status for p in plan.phases]
        # completed phases first, then at most one in progress, then pending ones
        first_open = next((i for i, s in enumerate(statuses) if s != COMPLETED), len(statuses))
        assert all(s == COMPLETED for s in statuses[:first_open])
        if first_open < len(statuses):
            assert statuses[first_open] == IN_PROGRESS
            assert all(s == PENDING for s in statuses[first_open + 1:])


# ---- assumptions ---------------------------------------------------------------------------------------------------
def test_broken_assumptions_of_open_phases_only() -> None:
    plan = Plan("T", (Phase("a", "c", COMPLETED, valid_if=Assumption(FILE_EXISTS, "gone")),
                      Phase("b", "c", IN_PROGRESS, valid_if=Assumption(FILE_EXISTS, "gone")),
                      Phase("c", "c", PENDING, valid_if=Assumption(FILE_ABSENT, "here")),
                      Phase("d", "c", PENDING, valid_if=Assumption(FILE_EXISTS, "here")),
                      Phase("e", "c", PENDING)))
    present = {"here"}
    assert broken_assumptions(plan, present.__contains__) == (
        (1, Assumption(FILE_EXISTS, "gone")), (2, Assumption(FILE_ABSENT, "here")))
    assert broken_assumptions(None, present.__contains__) == ()


def test_a_failing_file_check_leaves_the_assumption_unknown() -> None:
    plan = Plan("T", (Phase("a", "c", IN_PROGRESS, valid_if=Assumption(FILE_EXISTS, "x")), Phase("b", "c")))

    def refuse(path: str) -> bool:
        raise PermissionError(path)

    assert broken_assumptions(plan, refuse) == ()


def test_notes_are_escaped_and_byte_stable() -> None:
    plan = Plan("T", (Phase("a </supervisor-note>", "c", IN_PROGRESS, valid_if=Assumption(FILE_EXISTS, "a&b")),
                      Phase("b", "c")))
    note = assumption_note(plan, broken_assumptions(plan, lambda p: False))
    assert note == assumption_note(plan, broken_assumptions(plan, lambda p: False))
    assert note.count("</supervisor-note>") == 1 and "a&amp;b" in note
    assert 'phase 1 "a &lt;/supervisor-note&gt;"' in note
    hold = hold_note("no <test> ran")
    assert hold.startswith('<supervisor-note signal="plan_hold">') and "no &lt;test&gt; ran" in hold


# ---- renderings ----------------------------------------------------------------------------------------------------
def test_render_text_shows_status_markers_and_the_current_phase() -> None:
    plan = apply(created(3, valid_if="file_exists: src/a.py"), Advance("read it"))
    assert render_text(plan) == "\n".join([
        "PLAN: Fix the build",
        "[x] 1. phase 1", "    Done when: condition 1", "    Valid if: file_exists: src/a.py", "    Summary: read it",
        "[>] 2. phase 2 (IN PROGRESS)", "    Done when: condition 2",
        "[ ] 3. phase 3", "    Done when: condition 3",
        "CURRENT: Phase 2/3 - phase 2"])
    done = apply(apply(plan, Advance("b")), Advance("c"))
    assert render_text(done).endswith("CURRENT: all 3 phases completed")
    assert render_text(None) == NO_PLAN


def test_as_json_shape() -> None:
    plan = apply(created(2, valid_if="file_absent: tmp/lock"), Advance("ok"))
    data = as_json(plan)
    assert data == {
        "plan_title": "Fix the build", "current_phase": 2, "total_phases": 2, "completed_phases": 1,
        "current": {"title": "phase 2", "done_when": "condition 2"},
        "phases": [{"title": "phase 1", "done_when": "condition 1", "status": "completed", "summary": "ok",
                    "valid_if": "file_absent: tmp/lock"},
                   {"title": "phase 2", "done_when": "condition 2", "status": "in_progress", "summary": None,
                    "valid_if": None}]}
    assert orjson.loads(orjson.dumps(data)) == data
    assert as_json(None)["plan_title"] is None and as_json(None)["phases"] == []


def test_checklist_shows_progress_the_current_condition_and_staleness() -> None:
    plan = apply(created(3), Advance("x"))
    assert plan is not None
    text = checklist(plan)
    lines = text.splitlines()
    assert lines[0] == "Live plan (1/3 done): Fix the build"
    assert lines[1:4] == ["[x] 1. phase 1", "[>] 2. phase 2 - done when: condition 2", "[ ] 3. phase 3"]
    assert "phase_complete" in lines[-1]
    assert "confirm it still applies" in checklist(plan, stale=True)
    assert "confirm" not in text


# ---- planner input -------------------------------------------------------------------------------------------------
def action(n: int, ok: bool = True) -> Action:
    use = ToolUse(f"c{n}", "Bash", {"command": f"echo {n}"})
    out = ToolOutput(f"c{n}", "fine" if ok else "boom", None if ok else True)
    return Action(use, out, receipt(use, out, None))


def test_planner_input_is_bounded_json() -> None:
    text = planner_input("phase_complete", "r" * 20_000, instructions="s" * 10_000,
                         tools=[f"t{i}" * 40 for i in range(100)],
                         plan=created(3), focus="f" * 2000, next_step="n", carry=["c" * 500] * 20,
                         actions=[action(i) for i in range(200)])
    data = json.loads(text)
    assert data["signal"] == "phase_complete" and data["allowed_decisions"] == ["advance", "hold", "revise"]
    assert len(data["current_request"]) < REQUEST_CHARS + 100 and len(data["agent_instructions"]) < 4_100
    assert len(data["agent_tools"]) == 64 and all(len(t) <= 64 for t in data["agent_tools"])
    assert data["active_plan"]["current_phase"] == 1
    assert len(data["agent_handoff"]["focus"]) < 600 and len(data["agent_handoff"]["carry"]) == 8
    assert len(data["recent_actions"]) == ACTION_LINES + 1
    assert data["recent_actions"][0] == f"[{200 - ACTION_LINES} earlier actions omitted]"
    assert "echo 199" in data["recent_actions"][-1]
    assert len(text) < 40_000


def test_planner_input_without_a_plan_or_actions() -> None:
    data = json.loads(planner_input("request", "Refactor the parser"))
    assert data["active_plan"] is None and data["recent_actions"] == []
    assert data["agent_handoff"] == {"focus": "", "next": None, "carry": []}


def test_the_prompt_names_every_decision_and_the_evidence_rule() -> None:
    for kinds in ALLOWED.values():
        for kind in kinds:
            assert f'"decision":"{kind}"' in PLANNER_INSTRUCTIONS
    assert "evidence" in PLANNER_INSTRUCTIONS and "exceptional" in PLANNER_INSTRUCTIONS
