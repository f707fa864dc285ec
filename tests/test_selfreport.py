"""The self-report token: parsing (JSON and legacy forms), the shape test, and stripping, whole and streamed."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxyvisor.detectors.selfreport import (INSTRUCTION, MAX_BODY, STATES, MalformedReport, SelfReport, Stripper,
                                             looks_like_report, outcome, parse_body, strip)

REPORT = '{"state":"progressing","focus":" read the handlers ","next":"edit","carry":[" a ", "", "b"],"plan":null}'
TOKEN = f"<sup>{REPORT}</sup>"

# Responses as models write them: the token at the end, in the middle, twice, malformed, next to real
# superscripts and to things that look like the start of a tag.
RESPONSES = [
    f"I'll read the route handlers first.\n{TOKEN}",
    f"{TOKEN}",
    "Done: x<sup>2</sup> is now computed.\n<sup>done · tests pass</sup>\n",
    f"a < b and <s>struck</s> <su <sup <sup>th</sup>\n{TOKEN}",
    f"first {TOKEN} middle <sup>blocked | waiting on creds</sup> end",
    'malformed <sup>{"state":"weird","focus":"x","carry":[]}</sup> tail',
    "no token at all, just text with <b>tags</b> and a lone <",
    f"unclosed <sup>{REPORT} and no closing tag",
    f"<sup><sup>{REPORT}</sup>",
    "emoji 🎉 and ümlauts <sup>need-input: which database?</sup>",
    "ends with a partial tag <su",
]


def test_json_report_is_parsed_strictly_and_trimmed() -> None:
    report = parse_body(REPORT)
    assert report == SelfReport("progressing", "read the handlers", "edit", ("a", "b"), None)
    assert parse_body('{"state":"DONE","focus":"f","next":null,"carry":[],"plan":"phase_complete",'
                      '"memories":["M2"]}') == SelfReport("done", "f", None, (), "phase_complete", ("M2",))
    assert parse_body('{"state":" need-input ","focus":"f","carry":[]}').state == "need_input"
    assert parse_body('{"state":"NeedInput","focus":"f","carry":[]}').state == "need_input"


@pytest.mark.parametrize("body, why", [
    ('{"state":"done","focus":"f","carry":[],"extra":1}', "unknown key"),
    ('{"state":"finished","focus":"f","carry":[]}', "'state'"),
    ('{"state":"done","carry":[]}', "'focus'"),
    ('{"state":"done","focus":"f"}', "'carry' is required"),
    ('{"state":"done","focus":"f","carry":"a"}', "list of strings"),
    ('{"state":"done","focus":"f","carry":[],"plan":"maybe"}', "'plan'"),
    ('{"state":"done","focus":"f","carry":[],"next":3}', "'next'"),
    ('{"state": "done", ', "not JSON"),
    ('{"state":["done"],"focus":"f","carry":[]}', "'state'"),
])
def test_invalid_json_reports_are_malformed(body: str, why: str) -> None:
    with pytest.raises(MalformedReport, match=why):
        parse_body(body)


@pytest.mark.parametrize("body, state, focus", [
    ("done", "done", ""),
    (" Blocked ", "blocked", ""),
    ("blocked · waiting on creds", "blocked", "waiting on creds"),
    ("blocked | waiting on creds ", "blocked", "waiting on creds"),
    ("need-input: which database?", "need_input", "which database?"),
    ("needinput - which one", "need_input", "which one"),
    ("progressing\treading the handlers", "progressing", "reading the handlers"),
    ("STATE · done", "done", ""),  # the model echoed the placeholder
    ("state · exploring · the parser", "exploring", "the parser"),
])
def test_legacy_reports(body: str, state: str, focus: str) -> None:
    report = parse_body(body)
    assert (report.state, report.focus, report.legacy) == (state, focus, True)


@pytest.mark.parametrize("body", ["finished", "state", "STATE · nothing", "· just a reason", "doneness"])
def test_legacy_bodies_without_a_state_are_malformed(body: str) -> None:
    with pytest.raises(MalformedReport):
        parse_body(body)


@pytest.mark.parametrize("body, shaped", [
    (REPORT, True), ('  {"state": 1}', True), ("done", True), ("need-input", True), ("STATE · done", True),
    ("x | y", True), ("a · b", True), ("blocked: creds", True),
    ("2", False), ("th", False), ("®", False), ('{"focus":"no state key"}', False), ("", False),
    ("done " + "x" * MAX_BODY, False),
])
def test_shape_test_separates_reports_from_real_superscripts(body: str, shaped: bool) -> None:
    assert looks_like_report(body) is shaped


def test_strip_removes_json_reports_and_only_a_trailing_legacy_one() -> None:
    text = f"before {TOKEN} x<sup>2</sup> <sup>done</sup> after"
    assert strip(text) == ("before x<sup>2</sup> <sup>done</sup> after", [REPORT])
    assert strip("all <sup>done · tests pass</sup>") == ("all", ["done · tests pass"])
    assert strip("a <sup>2</sup> and <sup>{\"focus\":1}</sup> stay") == (
        "a <sup>2</sup> and <sup>{\"focus\":1}</sup> stay", [])
    assert strip(f"unclosed <sup>{REPORT}") == (f"unclosed <sup>{REPORT}", [])
    assert strip("plain") == ("plain", [])


def test_superscripts_in_the_answer_are_content_byte_for_byte() -> None:
    answer = "x<sup>2</sup> is squared, <sup>done</sup> was a label, <sup>a | b</sup> a choice, <sup>blocked · x</sup>."
    assert strip(answer) == (answer, [])
    assert strip(answer + "\n" + TOKEN) == (answer, [REPORT])
    assert strip(answer + " <sup>done</sup>\n") == (answer, ["done"])
    assert strip("<sup>done</sup> <sup>2</sup>") == ("<sup>done</sup> <sup>2</sup>", [])  # the last is content


@pytest.mark.parametrize("text, clean", [
    (f"Done. {TOKEN}", "Done."),
    (f"Done.\n\n{TOKEN}\n", "Done."),
    ("Done. <sup>done</sup>  ", "Done."),
    (f"Done. {TOKEN} <sup>done</sup>", "Done."),  # both removed: nothing of either leaves a space behind
    # A report mid-text: one run of whitespace stays where it stood, the one after it when there is one.
    (f"Done. {TOKEN} and more", "Done. and more"),
    (f"Done thrice. {TOKEN}\n\n[proxyvisor] notice", "Done thrice.\n\n[proxyvisor] notice"),
    (f"Done.\n{TOKEN}\n\nRunning tests", "Done.\n\nRunning tests"),
    (f"Done. {TOKEN}more", "Done. more"),
    (f"Done.{TOKEN} more", "Done. more"),
    (f"Done.{TOKEN}more", "Done.more"),
    (f"Done. {TOKEN} {TOKEN} more", "Done. more"),
    (f"Done.{' ' * (MAX_BODY + 1)}{TOKEN} more", f"Done.{' ' * (MAX_BODY + 1)} more"),  # too long to be held: kept
    ("Done. <sup>done</sup> more", "Done. <sup>done</sup> more"),  # a legacy token mid-text is content
    ("Done. \n", "Done. \n"),  # no report: trailing whitespace is content
    (f"Done.{' ' * (MAX_BODY + 1)}{TOKEN}", f"Done.{' ' * (MAX_BODY + 1)}"),  # too long to be held: kept
])
def test_a_removed_report_leaves_no_dangling_whitespace(text: str, clean: str) -> None:
    assert strip(text)[0] == clean
    assert stream(list(text))[0] == clean


def test_the_last_report_wins_and_bad_ones_are_counted_not_fatal() -> None:
    assert outcome(strip(f"{TOKEN} then <sup>blocked · creds</sup>")[1]).report.state == "blocked"
    assert outcome(strip(f"{TOKEN} then <sup>blocked · creds</sup> and text")[1]).report.state == "progressing"
    bad = outcome(strip('x <sup>{"state":"weird","focus":"f","carry":[]}</sup>')[1])
    assert (bad.status, bad.report) == ("malformed", None) and "state" in bad.error
    assert outcome([]).status == "missing"


HOLD_BOUND = 2 * (len("<sup>") + MAX_BODY + len("</sup>")) + 2 * MAX_BODY
"""The most a Stripper holds: an open token, whitespace before and after a closed report-shaped token, and it."""


def stream(pieces: list[str]) -> tuple[str, list[str], list[int]]:
    """Feed ``pieces`` to a Stripper; (text out, bodies, characters held after each piece)."""
    stripper = Stripper()
    out, held = [], []
    for piece in pieces:
        out.append(stripper.feed(piece))
        held.append(stripper.held)
    out.append(stripper.finish())
    return "".join(out), stripper.bodies, held


@pytest.mark.parametrize("text", RESPONSES)
def test_every_single_split_point_gives_the_whole_text_result(text: str) -> None:
    expected = strip(text)
    for cut in range(len(text) + 1):
        assert stream([text[:cut], text[cut:]])[:2] == expected, cut
    assert stream(list(text))[:2] == expected  # one character at a time


def _splits(text: str, cuts: list[int]) -> list[str]:
    points = sorted({min(c, len(text)) for c in cuts})
    bounds = [0, *points, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(RESPONSES), st.lists(st.integers(min_value=0, max_value=400), max_size=40))
def test_any_split_of_a_real_response_streams_to_the_text_without_its_token(text: str, cuts: list[int]) -> None:
    out, bodies, _held = stream(_splits(text, cuts))
    assert (out, bodies) == strip(text)
    assert TOKEN not in out


_FRAGMENTS = st.sampled_from(["<sup>", "</sup>", "<", "<s", "<su", "<sup", "sup>", "/sup>", REPORT, "done",
                              "blocked | x", "2", "th", " ", "\n", "text", "🎉", '{"state"', "}", "·"])


@settings(max_examples=400, deadline=None)
@given(st.lists(_FRAGMENTS, max_size=30), st.lists(st.integers(min_value=0, max_value=300), max_size=30))
def test_streaming_equals_stripping_for_any_text_and_any_split(fragments: list[str], cuts: list[int]) -> None:
    text = "".join(fragments)
    out, bodies, held = stream(_splits(text, cuts))
    assert (out, bodies) == strip(text)
    assert all(h <= HOLD_BOUND for h in held)


def test_text_flows_without_delay_unless_a_report_could_change_it() -> None:
    stripper = Stripper()
    assert stripper.feed("Reading the handlers now,") == "Reading the handlers now,"
    assert stripper.feed(" then x < y and <b>bold</b> ") == " then x < y and <b>bold</b>"
    assert stripper.held == 1  # the space a trailing report would leave dangling
    assert stripper.feed("and <su") == " and" and stripper.held == 4
    assert stripper.feed("b> is not it") == " <sub> is not it" and stripper.held == 0
    assert stripper.feed("<sup>done</sup>") == "" and stripper.held == len("<sup>done</sup>")
    assert stripper.feed("\n") == "" and stripper.feed(" it goes on") == "<sup>done</sup>\n it goes on"
    assert stripper.feed('<sup>{"state":') == "" and stripper.held > 0
    assert stripper.feed('"done","focus":"f","carry":[]}</sup> after') == " after"
    assert stripper.bodies == ['{"state":"done","focus":"f","carry":[]}']


def test_an_overlong_unclosed_tag_is_released_once_it_cannot_be_a_report() -> None:
    stripper = Stripper()
    long_text = "<sup>" + "x" * (MAX_BODY + 10)
    assert stripper.feed(long_text) == long_text
    assert stripper.held == 0


def test_the_instruction_asks_for_every_state_and_is_fixed() -> None:
    for state in STATES:
        assert state in INSTRUCTION
    assert INSTRUCTION.count("<sup>") == 1 and "<supervisor-note>" in INSTRUCTION
    token = INSTRUCTION[INSTRUCTION.index("<sup>"):INSTRUCTION.index("</sup>") + len("</sup>")]
    assert parse_body(strip(token)[1][0]).state == "progressing"  # the example in the instruction is valid


# Content as answers hold it: prose, whitespace, and superscripts of every kind that is not a JSON report (legacy
# shapes included: only the last thing in a response can be a legacy report), stray tag pieces too.
_CONTENT = st.lists(st.one_of(
    st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="<"), max_size=12),
    st.sampled_from([" ", "\n", "\n\n", "<", "<su", "</sup>", "<sup>", "x<sup>2</sup>", "<sup>th</sup>"]),
    st.builds("<sup>{}</sup>".format, st.sampled_from(["done", "a | b", "blocked · creds", "2", "need-input",
                                                      "STATE", "{\"focus\": 1}", "®"]))), max_size=12)
_REPORTS = st.sampled_from([TOKEN, "<sup>done</sup>", "<sup>blocked | waiting on creds</sup>",
                            "<sup>progressing · reading</sup>"])


@settings(max_examples=500, deadline=None)
@given(_CONTENT, st.sampled_from(["", " ", "\n", "\n\n"]), _REPORTS, st.sampled_from(["", "\n", " \n"]),
       st.lists(st.integers(min_value=0, max_value=400), max_size=30))
def test_content_with_superscripts_loses_exactly_its_trailing_report_at_every_split(
        parts: list[str], before: str, report: str, after: str, cuts: list[int]) -> None:
    content = "".join(parts)
    text = content + before + report + after
    body = report[len("<sup>"):-len("</sup>")]
    expected = (content.rstrip(), [body])
    assert strip(text) == expected
    assert stream(_splits(text, cuts))[:2] == expected
    assert stream(list(text))[:2] == expected
