"""The check tables: runner summary lines (one real line per runner, passing and failing, piped and not), the
inspection-command table, check commands, searches and harness re-prompts."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxyvisor.detectors.checks import (_COUNT, FAILED, PASSED, Summary, _candidates, _classify, _clean, is_check_command,
                                         is_inspection, is_search, last_line, summary, runner_missing, piped_check)
from proxyvisor.detectors.receipts import failed, is_reprompt, receipt
from proxyvisor.transcript import ToolOutput, ToolUse

SUMMARY_LINES = [
    # TAP (node --test, tap, prove): its closing counts
    ("# fail 1", FAILED),
    ("# fail 0", PASSED),
    # pytest
    ("=================== 1 failed, 2 passed in 0.12s ===================", FAILED),
    ("======================== 6 passed, 2 warnings in 0.82s =========================", PASSED),
    ("1 failed, 1 passed in 0.05s (0:00:00)", FAILED),
    ("============================= no tests ran in 0.01s ==============================", FAILED),
    ("========================= 2 errors in 0.31s =========================", FAILED),
    ("!!!!!!!!!!!!!!!!!!! Interrupted: 1 error during collection !!!!!!!!!!!!!!!!!!!", FAILED),
    ("======= 3 passed, 1 skipped, 1 xfailed in 1.20s =======", PASSED),
    # unittest, Django's runtests.py
    ("FAILED (failures=1, errors=2)", FAILED),
    ("FAILED (errors=1)", FAILED),
    # doctest
    ("***Test Failed*** 1 failures.", FAILED),
    ("Test passed.", PASSED),
    ("1 passed and 0 failed.", PASSED),
    # tox, nox
    ("ERROR:   py37: commands failed", FAILED),
    ("  py311: FAIL code 1 (2.10 seconds)", FAILED),
    ("  evaluation failed :( (2.22 seconds)", FAILED),
    ("  congratulations :) (4.51 seconds)", PASSED),
    ("nox > Session tests-3.11 was successful.", PASSED),
    ("nox > Session lint failed.", FAILED),
    # jest, vitest, mocha
    ("Tests:       1 failed, 3 passed, 4 total", FAILED),
    ("Tests:       4 passed, 4 total", PASSED),
    (" Test Files  1 failed | 2 passed (3)", FAILED),
    ("      Tests  10 passed (10)", PASSED),
    ("  3 passing (12ms)", PASSED),
    ("  1 failing", FAILED),
    # go test
    ("ok  \tgithub.com/acme/calc\t0.012s", PASSED),
    ("FAIL\tgithub.com/acme/calc\t0.015s", FAILED),
    ("--- FAIL: TestParse (0.00s)", FAILED),
    ("FAIL", FAILED),
    ("PASS", PASSED),
    # cargo test, nextest
    ("test result: FAILED. 1 passed; 2 failed; 0 ignored; 0 measured; 0 filtered out; finished in 0.00s", FAILED),
    ("test result: ok. 3 passed; 0 failed; 0 ignored; 0 measured; 0 filtered out; finished in 0.01s", PASSED),
    ("     Summary [   0.005s] 3 tests run: 2 passed, 1 failed, 0 skipped", FAILED),
    ("error: test failed, to rerun pass `--lib`", FAILED),
    # Maven, Gradle
    ("[ERROR] Tests run: 5, Failures: 1, Errors: 0, Skipped: 0", FAILED),
    ("[INFO] Tests run: 5, Failures: 0, Errors: 0, Skipped: 0", PASSED),
    ("[INFO] BUILD SUCCESS", PASSED),
    ("[ERROR] BUILD FAILURE", FAILED),
    ("BUILD FAILED in 2s", FAILED),
    ("BUILD SUCCESSFUL in 3s", PASSED),
    ("3 tests completed, 1 failed", FAILED),
    # ctest
    ("80% tests passed, 1 tests failed out of 5", FAILED),
    ("100% tests passed, 0 tests failed out of 5", PASSED),
    ("Errors while running CTest", FAILED),
    # rspec, minitest
    ("5 examples, 1 failure", FAILED),
    ("5 examples, 0 failures, 2 pending", PASSED),
    ("5 runs, 10 assertions, 0 failures, 0 errors, 0 skips", PASSED),
    # npm, yarn, pnpm, make
    ("npm ERR! Test failed.  See above for more details.", FAILED),
    ("npm error Lifecycle script `test` failed with error:", FAILED),
    ("error Command failed with exit code 1.", FAILED),
    (" ELIFECYCLE  Test failed. See above for more details.", FAILED),
    ("make: *** [Makefile:12: test] Error 1", FAILED),
    # the plain closing line
    ("3 passed, 1 failed", FAILED),
    ("Results: 12 passed, 0 failed", PASSED),
    ("\x1b[32m4 passed\x1b[0m in 0.30s", PASSED),
]


@pytest.mark.parametrize(("line", "outcome"), SUMMARY_LINES)
def test_a_runner_summary_line_says_passed_or_failed(line: str, outcome: str) -> None:
    found = summary(f"collecting ...\nsome output\n{line}\n")
    assert found is not None and found.outcome == outcome
    assert found.line and found.line in line.replace("\x1b[32m", "").replace("\x1b[0m", "")


@pytest.mark.parametrize("line", [
    "Test 1 passed",  # a script's own progress line
    "5 skipped in 0.10s",  # nothing passed nor failed
    "2 pending",
    "Processed 3 passed items",
    "OK",  # unittest's OK only after its "Ran N tests" line
    "All checks passed!",  # a linter's line, from a command that is no linter
    "Found 3 errors.",
    "everything works",
    "3 passed and more", "3 passed band 1 failed", "3 passed, and_ 1 failed",
    "   12  examples of prose", "3 xfailed, 2 xpassed in 0.1s", "4 tests, 2 todo",
])
def test_lines_that_are_no_runner_summary(line: str) -> None:
    assert summary(f"output\n{line}\n") is None


@pytest.mark.parametrize(("line", "outcome"), [
    ("3 passed AND 1 failed", FAILED), ("(3 passed), 1 skipped | 0 failed;", PASSED), ("3 passed, and", PASSED),
    ("3 passed\t\u2003in 0.2s", PASSED), ("and 3 passed", PASSED),
])
def test_a_count_line_is_counts_timings_and_separators_only(line: str, outcome: str) -> None:
    found = summary(f"output\n{line}\n")
    assert found is not None and found.outcome == outcome


@pytest.mark.parametrize(("line", "outcome"), [
    ("All checks passed!", PASSED), ("Found 3 errors.", FAILED), ("Found 0 errors in 2 files", PASSED),
    ("Success: no issues found in 5 source files", PASSED), ("✖ 3 problems (2 errors, 1 warning)", FAILED)])
def test_a_linters_summary_counts_for_a_check_command(line: str, outcome: str) -> None:
    found = summary(f"src/a.py\n{line}\n", check_command=True)
    assert found is not None and found.outcome == outcome


def test_unittest_ok_after_its_ran_line() -> None:
    found = summary("..\n----------------------------------------------------------------------\n"
                    "Ran 2 tests in 0.001s\n\nOK (skipped=1)\nDestroying test database for alias 'default'...\n")
    assert found is not None and (found.outcome, found.line) == (PASSED, "OK (skipped=1)")


def test_the_latest_summary_wins() -> None:
    runs = "1 failed, 2 passed in 0.1s\n...\n3 passed in 0.1s\n"
    assert summary(runs) is not None and summary(runs).outcome == PASSED  # type: ignore[union-attr]
    assert summary("3 passed in 0.1s\n1 failed, 2 passed in 0.1s\n").outcome == FAILED  # type: ignore[union-attr]
    # Mocha prints its failures after the summary lines: the latest summary line is still found.
    found = summary("  3 passing (12ms)\n  1 failing\n\n  1) calc\n       parses:\n     AssertionError: 3 == 4\n"
                    "      at Context.<anonymous> (test/calc.js:5:12)\n")
    assert found is not None and (found.outcome, found.line) == (FAILED, "1 failing")


@pytest.mark.parametrize("output", [
    "ok  \tacme/a\t0.01s\nFAIL\tacme/b\t0.02s\nok  \tacme/c\t0.01s\n",  # one failing package among passing ones
    "test result: FAILED. 1 passed; 1 failed; 0 ignored\ntest result: ok. 3 passed; 0 failed; 0 ignored\n",
    "ERROR:   py38: commands failed\n  py39: commands succeeded\n",
    "nox > * tests-3.11: failed\nnox > * lint: success\n",
])
def test_a_runner_with_a_line_per_unit_fails_when_one_unit_failed(output: str) -> None:
    found = summary(output)
    assert found is not None and found.outcome == FAILED


def test_only_the_tail_is_read() -> None:
    assert summary("1 failed in 0.1s\n" + "x\n" * 1000) is None


@pytest.mark.parametrize(("line", "shown"), [
    ("\x1b[32m===== 3 passed in 0.12s =====\x1b[0m", "3 passed in 0.12s"),
    ("[INFO] BUILD SUCCESS ---", "BUILD SUCCESS"),
    ("  >> done ___", "done"),
    ("\u2003-- ok --\u00a0", "ok"),  # any Unicode whitespace is decoration
    ("a ->", "a ->"),  # ">" leads, "<" trails: neither is decoration on the other side
    ("==<", "<"),  # a trailing run is decoration only after a character that is none
    (">.<", "<"),
    ("<<", ""),
])
def test_a_line_is_shown_without_its_colours_decoration_and_log_level(line: str, shown: str) -> None:
    assert last_line(line) == shown


def test_a_count_glued_to_trailing_decoration_is_read() -> None:
    found = summary("collected 12 items\n12 passed___")
    assert found is not None and (found.outcome, found.line) == (PASSED, "12 passed")


# ---- commands --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("command", [
    "cat calc.py", "nl -ba django/utils/html.py | sed -n 1,40p", "head -n 50 tests/test_x.py", "tail -f log",
    "sed -n '28,35p' django/utils/html.py", "less README", "grep -rn parse src", "rg -n 'def parse'", "ag foo",
    "ls -la", "find . -name '*.py'", "wc -l a.py", "file a.bin", "stat a.py", "tree -L 2", "git diff",
    "git status --short", "git log --oneline -5", "git show HEAD", "git blame calc.py", "echo hi", "pwd",
    "cd repo && ls", "true", "printf '%s\\n' a", "ls -R | grep ':$' | head -n 5", "cat a.py 2>&1 | head",
    "open pydicom/pixel_data_handlers/numpy_handler.py 293", "goto 120", "scroll_down", "search_file parse",
    "cat a && grep x a || echo none; ls\nwc -l a",
])
def test_read_only_inspection_is_never_a_check(command: str) -> None:
    assert is_inspection(command) and not is_check_command(command)


@pytest.mark.parametrize("command", [
    "sed -i 's/a/b/' calc.py", "echo x > calc.py", "cat <<'EOF' > r.py\nprint(1)\nEOF", "git commit -m x",
    "ls && rm a.py", "python reproduce.py", "pytest", "git checkout calc.py", "cat a | tee b"])
def test_a_compound_is_inspection_only_when_every_part_is(command: str) -> None:
    assert not is_inspection(command)


@pytest.mark.parametrize("command", [
    "pytest -q", "py.test tests", "python -m pytest tests/ -v --tb=short 2>&1 | tail -30", "python3 -m unittest -v",
    "./tests/runtests.py utils_tests.test_html", "tests/runtests.py migrations", "python tests/runtests.py x",
    "python manage.py test app", "tox -e py311", "nox -s tests", "npm test", "npm run test:unit", "yarn test",
    "pnpm test", "npx jest", "npx vitest run", "mocha", "go test ./...", "go vet ./...", "cargo test",
    "cargo nextest run", "cargo build", "cargo check", "cargo clippy", "mvn -q test", "mvn verify", "./gradlew build",
    "gradle test", "ctest --output-on-failure", "make test", "make check", "rspec", "bundle exec rspec",
    "bundle exec rake test", "ruff check .", "mypy src", "flake8", "npx eslint .", "npx tsc --noEmit", "bin/test",
    "cd /repo && CI=1 timeout 60 uv run pytest -x", "sed -i 's/3/4/' calc.py && pytest -q", "./run_tests.sh",
    "python3 -m doctest -v calc.py", "node --test", "node --test test/", "deno test", "bun test",
])
def test_recognised_check_commands(command: str) -> None:
    assert is_check_command(command) and not is_inspection(command)


@pytest.mark.parametrize("command", [
    "python reproduce.py", "python3 test_flush.py", "python -c 'print(1)'", "python - <<'PY'\nimport x\nPY",
    "node script.js", "echo TOOL_CALL_OK", "cat <<'EOF' > t.py\npytest\nEOF", "make", "npm install",
    "test -f calc.py && echo yes", "[ -f calc.py ]"])
def test_a_script_run_is_no_check_command(command: str) -> None:
    assert not is_check_command(command)


@pytest.mark.parametrize(("command", "search"), [
    ("grep -rn parse src", True), ("cd src && rg foo", True), ("git grep -n foo", True), ("ag foo", True),
    ("grep foo a | wc -l", False), ("ls", False), ("pytest", False)])
def test_searches(command: str, search: bool) -> None:
    assert is_search(command) is search


@pytest.mark.parametrize(("command", "text", "is_error", "failure"), [
    ("grep -rn nothing_here src", "<returncode>1</returncode>\n<output>\n</output>", None, False),
    ("rg nothing", "Exit code 1", True, False),
    ("git grep -n nothing", "", True, False),
    ("grep -rn x missing_dir", "grep: missing_dir: No such file or directory\nExit code 2", True, True),
    ("grep -c x a", "<returncode>1</returncode>\n<output>\nTraceback (most recent call last):\n</output>", None,
     True),
    ("python a.py", "Exit code 1", True, True),  # not a search
])
def test_a_search_that_found_nothing_is_no_failure(command: str, text: str, is_error: bool | None,
                                                   failure: bool) -> None:
    assert failed(ToolOutput("c", text, is_error), command) is failure


def test_a_receipt_carries_the_check_and_its_summary_line() -> None:
    schema = {"type": "object", "properties": {"command": {"type": "string"}}}
    piped = receipt(ToolUse("c", "Bash", {"command": "pytest 2>&1 | tail -3"}),
                    ToolOutput("c", "FAILED a.py::t\n==== 1 failed, 1 passed in 0.05s ====\nExit code 0"), schema)
    assert (piped.check, piped.summary, piped.error) == (FAILED, "1 failed, 1 passed in 0.05s", True)
    view = receipt(ToolUse("c", "Bash", {"command": "cat pytest.log"}), ToolOutput("c", "1 failed in 0.1s"), schema)
    assert (view.check, view.error) == ("none", False)
    quiet = receipt(ToolUse("c", "Bash", {"command": "pytest -q -q"}), ToolOutput("c", "....  [100%]", False), schema)
    assert (quiet.check, quiet.summary) == (PASSED, "")
    missing = receipt(ToolUse("c", "Bash", {"command": "pytest"}),
                      ToolOutput("c", "<returncode>127</returncode>\n<output>\nbash: pytest: command not found\n"
                                      "</output>"), schema)
    # A runner that could not start checked nothing, for or against the change (the call still failed).
    assert (missing.check, missing.summary, missing.error) == ("none", "", True)


@pytest.mark.parametrize(("output", "missing"), [
    ("bash: pytest: command not found", True),
    ("/bin/sh: 1: tox: not found", True),
    ("/usr/bin/python3: No module named pytest", True),
    ("python: can't open file '/repo/tests/runtests.py': [Errno 2] No such file or directory", True),
    ("bash: ./gradlew: No such file or directory", True),
    ("npm ERR! Missing script: \"test\"", True),
    ("'pytest' is not recognized as an internal or external command,", True),
    ("Exit code 127", True),
    ("E   FileNotFoundError: [Errno 2] No such file or directory: 'data.csv'", False),
    ("ModuleNotFoundError: No module named 'requests'", False),
    ("Exit code 1", False),
])
def test_a_runner_that_could_not_start(output: str, missing: bool) -> None:
    assert runner_missing(output) is missing


def test_last_line_skips_wrapper_tags() -> None:
    assert last_line("<output>\nboom\n</output>\n") == "boom" and last_line("") == ""


# ---- what a turn is --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("text", [
    "Please always provide EXACTLY ONE action in triple backticks, found 3 actions.",
    "Format error:\n\n<error>Expected exactly one code block</error>\nPlease format your response correctly.",
    "Your output was not formatted correctly. You must always include one discussion and one command.",
    "Your last output did not use any tool calls!\nPlease make sure your output includes exactly _ONE_ function "
    "call!",
    "No tool calls found in the response. Every response MUST include at least one tool call.",
    "Your previous response was malformed; resend it in the required format.",
    "We could not parse your last output. Retry your action.",
])
def test_harness_re_prompts(text: str) -> None:
    assert is_reprompt(text, "Fix the parser.")


@pytest.mark.parametrize(("text", "previous"), [
    ("Fix the parser.", None), ("yes", "Fix the parser."), ("test it", "done?"),
    ("Please add a tool call counter to the report formatter.", "Fix the parser."),
    ("Please always provide EXACTLY ONE action in triple backticks. " + "x" * 5000, None),  # too long: a user's
])
def test_genuine_user_turns(text: str, previous: str | None) -> None:
    assert not is_reprompt(text, previous)


def test_a_prompt_repeating_the_previous_one_is_a_re_prompt() -> None:
    assert is_reprompt("Continue.", "Continue.") and not is_reprompt("Continue.", None)


NODE_TAP = ("TAP version 13\n# Subtest: mul\nnot ok 1 - mul\n# tests 2\n# suites 0\n# pass 1\n# fail 1\n"
            "# cancelled 0\n# skipped 0\n# todo 0\n# duration_ms 152.44\n")


def test_node_tests_closing_counts_are_its_summary() -> None:
    assert summary(NODE_TAP, True) is not None and summary(NODE_TAP, True).outcome == FAILED
    fixed = NODE_TAP.replace("# pass 1", "# pass 2").replace("# fail 1", "# fail 0").replace("not ok", "ok")
    assert summary(fixed, True).outcome == PASSED


@pytest.mark.parametrize(("command", "piped"), [
    ("pytest 2>&1 | tail -3", True), ("npm test | tail -3", True), ("cargo test 2>&1 |& tee log", True),
    ("pytest || true", False), ("pytest -q", False), ("cat log | grep FAIL", False), ("pytest >| log", False),
])
def test_a_check_writing_into_a_pipe(command: str, piped: bool) -> None:
    assert piped_check(command) is piped


def test_a_piped_check_without_a_summary_told_nothing() -> None:
    schema = {"type": "object", "properties": {"command": {"type": "string"}}}
    tail = "# skipped 0\n# todo 0\n# duration_ms 154.2\nExit code 0"
    hidden = receipt(ToolUse("c", "Bash", {"command": "npm test | tail -3"}), ToolOutput("c", tail), schema)
    assert (hidden.check, hidden.error) == ("none", False)
    shown = receipt(ToolUse("c", "Bash", {"command": "npm test | tail -12"}), ToolOutput("c", NODE_TAP), schema)
    assert (shown.check, shown.summary, shown.error) == (FAILED, "fail 1", True)
    plain = receipt(ToolUse("c", "Bash", {"command": "npm test"}), ToolOutput("c", tail), schema)
    assert plain.check == PASSED  # its own exit status says it passed


FRAGMENTS = [line for line, _ in SUMMARY_LINES] + [
    "build 3", "passed the check", "ERROR:", "foo: OK", "", "   12  pending items", "5 passed__", "3", "tests run",
    "Ran 2 tests in 0.01s", "OK", "ok  example.com/pkg  0.01s", "--- FAIL: TestX", "\x1b[31m2 failed\x1b[0m", "[INFO] ",
    "== ", " ==", "nox > Session lint was successful"]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(st.sampled_from(FRAGMENTS), min_size=1, max_size=3).map("".join), max_size=8),
       st.booleans())
def test_the_lines_searched_for_a_summary_hold_every_summary_line(lines: list[str], linters: bool) -> None:
    """summary() classifies only the lines its two searches over the joined lines find: those hold every line that
    classifies as a summary line, however the lines run into each other."""
    cleaned = [_clean(line) for line in lines]
    assert {n for n, line in enumerate(cleaned) if _classify(line, linters) is not None} <= set(_candidates(cleaned))


COUNT_WORDS = ("failed failing failures errors errored passed passing passes ok succeeded skipped skips pending xfailed "
               "xpassed deselected warnings todo broken flaky ignored measured filtered_out rerun total examples runs "
               "assertions tests_completed tests_run tests specs suites").split()


@pytest.mark.parametrize("word", [w.replace("_", " ") for w in COUNT_WORDS])
def test_a_count_word_is_read_in_every_case_form_of_its_first_letter(word: str) -> None:
    """Every character re.I equates with a count word's first letter (the long s, the dotted and dotless i, the
    Kelvin sign...) starts that word, and no other character does."""
    for code in [*range(0x250), 0x130, 0x131, 0x17F, 0x212A]:
        first = chr(code)
        found = _COUNT.search(f"3 {first}{word[1:]}")
        same = re.fullmatch(re.escape(word[0]), first, re.I) is not None
        assert (found is not None and found.group(2) == first + word[1:]) == same, (word, hex(code))


def test_a_count_of_thousands_of_digits_is_read() -> None:
    """int() refuses more than 4,300 digits: such a count in an output's tail is read all the same."""
    assert summary("x\n" + "1" * 5000 + " passed\n") == Summary(PASSED, "1" * 299 + "\u2026")
    assert summary("x\n" + "0" * 5000 + " failed, 1 passed\n").outcome == PASSED
    assert summary("x\nFound " + "0" * 5000 + " errors\n", True).outcome == PASSED
    assert summary("x\n\u0660\u0661 failed\n").outcome == FAILED  # digits of any script
    assert summary("x\n\u0660\u0660 failed, 1 passed\n").outcome == PASSED
    use = ToolUse("c", "Bash", {"command": "pytest -q"})
    assert receipt(use, ToolOutput("c", "9" * 5000 + " failed in 1s"), None).check == FAILED


def test_the_candidate_lines_are_numbered_from_the_first() -> None:
    assert _candidates(["3 passed", "a", "", "FAILED (errors=1)", "b 2 failed, 1 passed", "ok"]) == [4, 3, 0]
    assert _candidates(["x"] * 300 + ["BUILD SUCCESS", "1 passed"]) == [301, 300]
    assert _candidates(["nothing", "here"]) == []


def test_a_count_and_a_count_word_on_two_lines_are_no_summary() -> None:
    assert summary("build 3\npassed the check\n") is None
    assert summary("build 3\n5 passed in 0.1s\n").outcome == PASSED


NODE_SPEC_FAIL = """\u25b6 calc
  \u2714 adds (0.5ms)
  \u2716 subtracts (1.1ms)
    AssertionError [ERR_ASSERTION]: Expected values to be strictly equal:

    1 !== 2

\u2139 tests 2
\u2139 suites 1
\u2139 pass 1
\u2139 fail 1
\u2139 duration_ms 48.2
"""


@pytest.mark.parametrize(("command", "output"), [
    ("node --test", NODE_SPEC_FAIL),
    ("dotnet test", "Failed!  - Failed:     1, Passed:     1, Skipped:     0, Total:     2, Duration: 12 ms"),
    ("python -m pytest -q", "Segmentation fault (core dumped)"),
    ("python -m pytest -q", ""),
])
def test_a_check_without_a_summary_whose_success_nothing_told_is_no_passed_check(command: str, output: str) -> None:
    """A client that sends a command's bare output (no exit status, no error flag: opencode's Chat tool results)
    tells nothing about a run whose summary is not recognised, or that printed none: it is no check, not a pass.
    Told by an exit status or the client's flag, the same output is a check."""
    schema = {"type": "object", "properties": {"command": {"type": "string"}}}
    bare = receipt(ToolUse("c", "Bash", {"command": command}), ToolOutput("c", output), schema)
    assert bare.check != PASSED
    told = receipt(ToolUse("c", "Bash", {"command": command}), ToolOutput("c", output + "\nExit code 1"), schema)
    assert told.check == FAILED
    flagged = receipt(ToolUse("c", "Bash", {"command": command}), ToolOutput("c", output, True), schema)
    assert flagged.check == FAILED
