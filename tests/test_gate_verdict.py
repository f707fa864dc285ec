"""The verifier's answer: schema checks, charged versus reported findings, hand-backs, refutation, same gaps."""

from __future__ import annotations

import json

import pytest

from proxyvisor.gate.verdict import (
    FORMAT_RETRY,
    GAPS,
    PASS,
    VERIFIER_INSTRUCTIONS,
    Gap,
    Malformed,
    Verdict,
    parse,
    refutation_input,
    refute,
    same_gaps,
)


def answer(requirements=None, gaps=(), verdict="pass", handback=None, fenced=False) -> str:
    data = {"requirements": requirements if requirements is not None else [
        {"id": 1, "requirement": "parse returns 4", "status": "matched", "basis": None, "evidence": "#3"}],
        "gaps": list(gaps), "handback": handback, "verdict": verdict}
    text = json.dumps(data)
    return f"Here is my judgement:\n```json\n{text}\n```" if fenced else text


UNMATCHED = {"id": 1, "requirement": "tests pass", "status": "unmatched", "basis": "recorded_output"}
GAP = {"requirement": 1, "gap": "pytest still fails", "settles": "a passing pytest run after the last edit"}


def test_pass() -> None:
    assert parse(answer()) == Verdict(PASS)
    assert parse(answer(fenced=True)) == Verdict(PASS)


def test_charged_gap() -> None:
    verdict = parse(answer([UNMATCHED], [GAP], "gaps"))
    assert verdict == Verdict(GAPS, (Gap("pytest still fails", "a passing pytest run after the last edit", 1),))


def test_model_verdict_is_not_trusted_a_charged_gap_wins_over_pass() -> None:
    assert parse(answer([UNMATCHED], [GAP], "pass")).outcome == GAPS


def test_uncharged_findings_are_reported_not_charged() -> None:
    requirements = [{"id": 1, "requirement": "fast", "status": "unmatched", "basis": "inference"},
                    {"id": 2, "requirement": "documented", "status": "unknown", "basis": None}]
    verdict = parse(answer(requirements, [{"gap": "maybe slow", "settles": ""}], "pass"))
    assert isinstance(verdict, Verdict) and verdict.outcome == PASS and not verdict.gaps
    assert verdict.notes == ("unmatched (inference): fast", "unknown (no basis): documented",
                             "gap without settles: maybe slow")


@pytest.mark.parametrize("text", [
    "I think it is fine.",
    "[1, 2]",
    "{not json}",
    answer([]),
    answer([{"id": 2, "status": "matched"}]),
    answer([{"id": 1, "status": "matched"}, {"id": 1, "status": "matched"}]),
    answer([{"id": True, "status": "matched"}]),
    answer([{"id": 1, "status": "done"}]),
    answer([{"id": 1, "status": "unmatched", "basis": "vibes"}]),
    answer(verdict="maybe"),
    answer(gaps=[{"gap": "", "settles": "x"}]),
    answer(gaps=[{"gap": "vague", "settles": ""}], verdict="gaps"),  # gaps claimed, none charged
])
def test_protocol_violations_are_repairable(text: str) -> None:
    assert isinstance(parse(text), Malformed)


def test_malformed_then_repaired() -> None:
    assert isinstance(parse("PASS, looks good"), Malformed)
    assert parse(answer()) == Verdict(PASS)
    assert "format" in FORMAT_RETRY and "not JSON" not in FORMAT_RETRY  # the parser error is not echoed


def test_handback_must_be_judged_when_asked() -> None:
    assert isinstance(parse(answer(), handback=True), Malformed)
    legit = parse(answer(handback={"needs_user": True, "reason": "needs the production password"}), handback=True)
    assert legit == Verdict(PASS, needs_user=True)


def test_illegitimate_handback_becomes_a_charged_gap() -> None:
    verdict = parse(answer(handback={"needs_user": False, "reason": "the missing package can be installed"}),
                    handback=True)
    assert isinstance(verdict, Verdict) and verdict.outcome == GAPS and verdict.needs_user is False
    assert verdict.gaps[0].text == "hand-back not needed: the missing package can be installed"


def test_prohibition_rule_is_in_the_verifier_instructions() -> None:
    assert "absence is compliance, not a gap" in VERIFIER_INSTRUCTIONS


GAPS_TWO = (Gap("tests fail", "passing run", 1), Gap("README not updated", "README diff", 2))


def test_refutation_drops_only_cited_refuted_findings() -> None:
    reply = json.dumps({"findings": [{"id": 1, "status": "stands", "citation": ""},
                                     {"id": 2, "status": "refuted", "citation": "#5 edited README.md"}]})
    result = refute(GAPS_TWO, reply)
    assert result.kept == (GAPS_TWO[0],) and result.refuted == ((GAPS_TWO[1], "#5 edited README.md"),)


@pytest.mark.parametrize("reply", [
    None,
    "garbage",
    json.dumps({"findings": [{"id": 2, "status": "refuted", "citation": ""}]}),  # no citation: doubt stands
    json.dumps({"findings": [{"id": 9, "status": "refuted", "citation": "#1"}]}),  # unknown finding
    json.dumps({"findings": [{"id": True, "status": "refuted", "citation": "#1"}]}),
    json.dumps({"findings": "all refuted"}),
])
def test_failed_or_off_protocol_refuter_refutes_nothing(reply: str | None) -> None:
    assert refute(GAPS_TWO, reply).kept == GAPS_TWO


def test_refutation_input_numbers_and_escapes_findings() -> None:
    text = refutation_input("<verification_request/>", (Gap("a <b> & c", "d"),))
    assert text.endswith("<charged_findings>\n1. a &lt;b&gt; &amp; c (settles: d)\n</charged_findings>")


def test_same_gaps_ignores_order_case_and_whitespace() -> None:
    again = (Gap("  readme NOT   updated", "other"), Gap("Tests fail", "x"))
    assert same_gaps(GAPS_TWO, again)
    assert not same_gaps(GAPS_TWO, again[:1])
    assert not same_gaps(GAPS_TWO, (Gap("tests fail", ""), Gap("tests fail", "")))
    assert not same_gaps((), ())
