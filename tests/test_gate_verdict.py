"""The verifier's answer: schema checks, charged versus reported findings, hand-backs, refutation, same gaps."""

from __future__ import annotations

import json
import re

import pytest

from proxyvisor.condense.text import count_tokens
from proxyvisor.gate.digest import readback
from proxyvisor.gate.verdict import (
    FORMAT_RETRY,
    GAPS,
    MAX_READS,
    PASS,
    READBACK_DONE,
    VERIFIER_INSTRUCTIONS,
    Gap,
    Malformed,
    ReadRequest,
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


# ---- read-back ---------------------------------------------------------------------------------------------------
READ = json.dumps({"verdict": "read", "read": [{"action": 2, "lines": "3-4"}]})


def test_a_read_request_is_one_only_while_reading_is_allowed() -> None:
    request = parse(READ, may_read=True)
    assert request == ReadRequest(({"action": 2, "lines": "3-4"},))
    assert parse(json.dumps({"read": [{"action": 1, "lines": "1"}]}), may_read=True) == ReadRequest(
        ({"action": 1, "lines": "1"},))  # without a verdict key
    assert isinstance(parse(READ), Malformed)  # a second read counts as malformed
    assert isinstance(parse(json.dumps({"verdict": "read", "read": []}), may_read=True), Malformed)
    assert "<readback>" in VERIFIER_INSTRUCTIONS and '"verdict":"read"' in VERIFIER_INSTRUCTIONS


def test_readback_gives_the_asked_lines_verbatim_numbered_and_escaped() -> None:
    output = "\n".join(["ok"] * 2 + ["E  assert <b> & 3 == 4", "FAILED test_x"] + ["tail"] * 3)
    block = readback(parse(READ, may_read=True), {2: output}, 1000)
    assert '<lines action="2" range="3-4" of="7">\n3| E  assert &lt;b&gt; &amp; 3 == 4\n4| FAILED test_x\n</lines>' \
        in block
    assert block.startswith('<readback trust="untrusted">') and block.endswith(READBACK_DONE)
    assert "tail" not in block and "2| ok" not in block


def test_readback_answers_a_bad_entry_with_its_reason_and_serves_the_rest() -> None:
    reads = ({"action": 9, "lines": "1"}, {"action": 1, "lines": "5-2"}, {"action": 1, "lines": ["1", "3-"]},
             {"action": 1, "lines": "1"}, {"action": 1, "lines": "2"})
    block = readback(ReadRequest(reads), {1: "a\nb\nc\nd"}, 1000)
    assert "not read: no recorded output for action 9" in block
    assert '<lines action="1">not read: range' in block and "(the output has 4 lines)" in block
    assert '<lines action="1" range="1,3-4" of="4">\n1| a\n3| c\n4| d\n</lines>' in block
    assert f"at most {MAX_READS} entries" in block and "1| a\n</lines>" not in block.split("3| c")[1]


def test_readback_stays_within_its_budget_and_names_what_it_left_out() -> None:
    output = "\n".join(f"line {n} " + "word " * 20 for n in range(1, 501))
    block = readback(ReadRequest(({"action": 1, "lines": "1-"},)), {1: output}, 200)
    shown = re.findall(r"^(\d+)\| ", block, re.MULTILINE)
    assert 0 < len(shown) < 500 and count_tokens("\n".join(l for l in block.split("\n") if "| " in l)) <= 200
    assert f"[... lines {len(shown) + 1}-500 not shown: the read-back budget is spent ...]" in block
