"""Condense core, part 1: lines and tokens, diagnostics and focus terms, the numbered view (no I/O)."""

from __future__ import annotations

import re

from hypothesis import given, settings
from hypothesis import strategies as st

from proxyvisor.condense.signals import diagnostic_lines, focus_terms, is_diagnostic
from proxyvisor.condense.text import (body_of, clip_chars, clip_tokens, count_tokens, line_count, newline_of,
                                      split_lines, tokens_may_exceed, visible)
from proxyvisor.condense.view import allocate, build_view

_ROW = re.compile(r"^ *(\d+)\| (.*)$")
_GAP = re.compile(r"^\[… original lines? (\d+)(?:-(\d+))? not shown in this view …\]$")


def passing_log(total: int = 1000, *, failure_at: int | None = None, tail_error: bool = False) -> str:
    """A synthetic test-runner log: ``total`` lines of passing tests, optionally one failing test block with a
    focus term in the middle and a tail diagnostic."""
    rows = [f"tests/test_mod_{i:04d}.py::test_case_{i} PASSED   [{i * 100 // total:3d}%]" for i in range(total)]
    if failure_at is not None:
        rows[failure_at] = "tests/test_widget.py::test_frobnicate_quux FAILED"
    if tail_error:
        rows[-3] = "E   AssertionError: expected 3 widgets, got 2"
    return "\n".join(rows) + "\n"


def parse_view(text: str) -> tuple[dict[int, str], list[tuple[int, int]]]:
    """The rows (number -> shown body) and gaps of a rendered view; fails on any other line."""
    rows: dict[int, str] = {}
    gaps: list[tuple[int, int]] = []
    for line in text.split("\n")[:-1]:
        if (m := _ROW.match(line)) is not None:
            rows[int(m.group(1))] = m.group(2)
        elif (g := _GAP.match(line)) is not None:
            gaps.append((int(g.group(1)), int(g.group(2) or g.group(1))))
        else:
            raise AssertionError(f"unexpected view line {line!r}")
    return rows, gaps


# --- lines ---------------------------------------------------------------------------------------------------

@given(st.text(alphabet=st.sampled_from("ab\r\n\x00é"), max_size=60))
def test_split_lines_gives_back_the_text_and_counts_like_wc(text: str) -> None:
    lines = split_lines(text)
    assert "".join(lines) == text
    assert line_count(text) == len(lines) == text.count("\n") + (0 if text.endswith("\n") or not text else 1)
    assert all("\n" not in line[:-1] for line in lines)


def test_crlf_and_stray_carriage_returns_stay_inside_their_line() -> None:
    text = "progress 10%\rprogress 100%\r\nsecond\r\nthird\n"
    lines = split_lines(text)
    assert lines == ["progress 10%\rprogress 100%\r\n", "second\r\n", "third\n"]
    assert body_of(lines[0]) == "progress 10%\rprogress 100%"
    assert newline_of(lines) == "\r\n"
    assert newline_of(["a\n", "b\r\n", "c\n"]) == "\n"
    assert visible(body_of(lines[0])) == "progress 10%␍progress 100%"


def test_binary_ish_bytes_are_shown_visibly_and_counted() -> None:
    raw = b"ok \x00\x01\x1b[31mred\x1b[0m \xff\xfe end"
    text = raw.decode("utf-8", "surrogateescape")
    shown = visible(text)
    assert "␀␁␛[31mred␛[0m" in shown and "\ufffd\ufffd" in shown
    shown.encode("utf-8")  # no lone surrogate left: the view can be sent to a model
    assert count_tokens(text) > 0
    assert count_tokens("<|endoftext|>") > 1  # special-token text in tool output is plain text


def test_clipping_keeps_both_edges() -> None:
    text = "HEAD " + "word " * 5000 + "TAIL"
    clipped = clip_tokens(text, 300)
    assert clipped.startswith("HEAD") and clipped.endswith("TAIL") and "tokens omitted" in clipped
    assert count_tokens(clipped) < 330
    assert clip_tokens("short", 300) == "short"
    args = clip_chars("A" * 1000 + "B" * 1000, 1200)
    assert args.startswith("A" * 800) and args.endswith("B" * 400) and "800 chars omitted" in args


# --- diagnostics and focus terms ------------------------------------------------------------------------------

def test_diagnostic_markers_are_narrow_and_zero_counts_do_not_count() -> None:
    yes = ["src/a.c:12:5: error: unknown type", "error[E0308]: mismatched types", "FAILED tests/t.py::x",
           "BUILD FAILURE", "fatal: not a git repository", "panic: runtime error", "Traceback (most recent call last):",
           "AssertionError: 1 != 2", "ls: foo: not found", "bash: x: command not found", "0 matches",
           "Process completed with exit code 1.", "[ERROR] COMPILATION ERROR :", "Tests run: 9, Failures: 1, Errors: 0"]
    no = ["[INFO] Tests run: 7, Failures: 0, Errors: 0, Skipped: 0", "====== 12 passed, 0 failed ======",
          "Process completed with exit code 0.", "warning: unused variable", "the error handling is fine",
          "exit code 0", "Errors: 0"]
    assert [line for line in yes if not is_diagnostic(line)] == []
    assert [line for line in no if is_diagnostic(line)] == []
    assert diagnostic_lines(["ok\n", "error: x\n", "ok\n"]) == [1]


def test_focus_terms_drop_stop_words_and_keep_paths() -> None:
    terms = focus_terms(["Why did the build of src/app/main.py fail? Check resolve_lookup_value() and it",
                         "the FAIL again"])
    assert terms == ["build", "src/app/main.py", "fail", "check", "resolve_lookup_value", "again"]
    assert len(focus_terms([" ".join(f"term{i}" for i in range(100))])) == 64


# --- the numbered view ----------------------------------------------------------------------------------------

def test_a_result_that_fits_is_shown_whole_with_aligned_numbers() -> None:
    lines = split_lines("".join(f"line {i}\n" for i in range(1, 12)))
    view = build_view(lines, 5000)
    assert not view.partial and view.shown == tuple(range(1, 12)) and view.clipped == ()
    assert view.text.startswith(" 1| line 1\n 2| line 2\n") and "11| line 11\n" in view.text
    assert view.tokens == count_tokens(view.text) <= 5000
    assert view.visible_ranges == [(1, 11)]


def test_a_sampled_view_finds_a_middle_focus_term_and_a_tail_diagnostic() -> None:
    # Seed 003's own case: 1,000 lines, a budget of 500 tokens.
    lines = split_lines(passing_log(1000, failure_at=517, tail_error=True))
    view = build_view(lines, 500, focus_terms(["why does test_frobnicate_quux fail?"]))
    assert view.partial and view.tokens <= 500
    assert 518 in view.shown and 998 in view.shown  # the focus match and the diagnostic, by original number
    assert 1000 in view.shown and 1 in view.shown  # the edges
    rows, gaps = parse_view(view.text)
    assert sorted(rows) == list(view.shown)
    for number, body in rows.items():
        assert body == visible(body_of(lines[number - 1]))
    hidden = {n for a, b in gaps for n in range(a, b + 1)}
    assert hidden == set(range(1, 1001)) - set(view.shown)  # gaps mark exactly the hidden lines
    assert view.visible_ranges[0][0] == 1


def test_distinct_diagnostics_come_before_repeats_of_the_same_shape() -> None:
    noise = [f"step {i}: fetching dependency number {i} from the mirror\n" for i in range(600)]
    for i in range(100, 500, 5):
        noise[i] = f"tests/test_env.py:{i}: OptionError: No such keys(s): 'mode.use_inf_as_null'\n"
    noise[301] = "tests/test_plot.py:652: AssertionError: (-0.05, 2.5) != (-0.5, 2.5)\n"
    view = build_view(noise, 600)
    assert 302 in view.shown and 101 in view.shown  # the distinct one and the first of the repeated shape


def test_a_17000_character_single_line_stays_one_selectable_record() -> None:
    huge = "x" * 16_990 + " THE END"
    lines = split_lines("before\n" + huge + "\nafter\n")
    view = build_view(lines, 400)
    assert view.shown == (1, 2, 3) and view.clipped == (2,) and view.partial
    assert "selecting line 2 keeps all of it" in view.text
    assert view.tokens <= 400
    alone = build_view(split_lines(huge), 300)
    assert alone.total_lines == 1 and alone.shown == (1,) and alone.clipped == (1,)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.sampled_from(["ok line\n", "error: boom\n", "", "a much longer line of ordinary output " * 3 + "\n",
                                 "tab\there\r\n", "FAILED test_x\n", "\x1b[0m\n"]), min_size=1, max_size=400),
       st.integers(min_value=256, max_value=3000))
def test_every_view_fits_its_budget_and_numbers_what_it_shows(pieces: list[str], budget: int) -> None:
    lines = split_lines("".join(pieces) or "x")
    view = build_view(lines, budget)
    assert view.tokens <= budget
    rows, gaps = parse_view(view.text)
    assert sorted(rows) == list(view.shown) and view.shown
    covered = sorted(set(rows) | {n for a, b in gaps for n in range(a, b + 1)})
    assert covered == list(range(1, len(lines) + 1))


def test_the_round_budget_is_shared_by_size_with_a_floor() -> None:
    assert allocate([30_000, 10_000], 32_000) == [24_000, 8_000]
    shares = allocate([100_000] + [600] * 3, 32_000)
    assert shares[1:] == [256, 256, 256] and shares[0] > 31_000  # the floor can push the sum above the budget


@settings(max_examples=200, deadline=None)
@given(st.text(st.characters(codec="utf-8")) | st.text(st.characters(max_codepoint=127)), st.integers(0, 64))
def test_a_text_said_to_stay_within_a_token_limit_does(text: str, limit: int) -> None:
    if not tokens_may_exceed(text, limit):
        assert count_tokens(text) <= limit
    assert not tokens_may_exceed("x" * 600, 600) and tokens_may_exceed("x" * 601, 600)
    assert not tokens_may_exceed("é" * 300, 600) and tokens_may_exceed("é" * 301, 600)  # two bytes each
