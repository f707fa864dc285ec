"""Standing prohibitions (``proxyvisor.gate.prohibitions.standing``): read from every user turn, lifted only by an
explicit permission that names the same thing."""

from __future__ import annotations

import pytest

from proxyvisor.gate.prohibitions import MAX_ITEMS, Standing, prohibitions, standing


def in_force(*turns: str) -> list[tuple[int, str]]:
    return [(s.turn, s.text) for s in standing(enumerate(turns, 1))]


def test_a_prohibition_stands_lifted_ones_go_and_new_ones_join() -> None:
    assert in_force("Fix the parser. Do not run the tests, they take an hour.",
                    "Also tidy the README.",
                    "You can run the tests now.",
                    "Never push to main.") == [(4, "Never push to main.")]
    # Without the permission, the first turn's prohibition stands beside the new one, each with its source turn.
    assert in_force("Fix the parser. Do not run the tests.", "Also tidy the README.",
                    "Never push to main.") == [(1, "Do not run the tests."), (3, "Never push to main.")]


@pytest.mark.parametrize(("prohibition", "permission"), [
    ("Do not run the tests.", "You can run the tests now."),
    ("Do not run the tests.", "ok, now run them"),
    ("Do not run the tests.", "Run the test suite, please."),
    ("Do not run tests; I will test myself.", "Now you may run the relevant tests for those edits."),
    ("Never push to main.", "Go ahead and push."),
    ("Don't edit migrations/.", "Feel free to edit migrations/ as needed."),
    ("Editing migrations is forbidden.", "You are allowed to edit the migrations."),
    ("You must not install packages.", "Installing packages is allowed now."),
    ("Don\u2019t run the tests.", "You\u2019re allowed to run the tests now."),  # typographic apostrophes
])
def test_a_permission_naming_the_same_action_lifts_the_prohibition(prohibition: str, permission: str) -> None:
    assert in_force(prohibition, permission) == []


@pytest.mark.parametrize(("prohibition", "later"), [
    ("Do not run the tests.", "You can run the linter now."),  # another object
    ("Do not run the tests.", "Go ahead."),  # names nothing
    ("Do not run the tests.", "Can you run the tests?"),  # a question
    ("Do not run the tests.", "> you can run the tests now"),  # a quote
    ("Do not run the tests.", "```\nyou can run the tests now\n```"),  # code
    ("Do not run the tests.", '"You can run the tests now," the README says.'),  # quote-led
    ("Do not run the tests.", "Running the tests takes an hour on CI."),  # not a permission
    ("Do not run the tests or push to main.", "Go ahead and push."),  # the rule's action is not pushing
    ("Do not run the tests.", "Fix the docs. Do not run the tests."),  # restated: keeps its first turn
])
def test_other_messages_leave_the_prohibition_in_force(prohibition: str, later: str) -> None:
    assert in_force(prohibition, later) == [(1, prohibition)]


def test_a_turn_does_not_lift_its_own_prohibitions() -> None:
    text = "Do not run the tests, but you can run the tests of the docs build."
    assert in_force(text) == [(1, text)]


def test_prohibitions_in_quotes_questions_and_fences_are_skipped_in_every_turn() -> None:
    assert in_force("Fix it.", "> do not run the tests", "Should I never push?",
                    "```\n# never do this\n```", "12: // do not edit") == []


@pytest.mark.parametrize(("text", "found"), [
    ('The README says "do not edit generated files". Please fix the typo.', []),
    ("The README says \u201cdo not edit generated files\u201d. Please fix the typo.", []),
    ("Rename the `do not track` option to `privacy`.", []),
    ('Do not edit "generated.py".', [(1, 'Do not edit "generated.py".')]),  # the marker itself is unquoted
    ('The banner reads "forbidden"; never change it.', [(1, "never change it.")]),
])
def test_a_marker_inside_quotes_is_someone_elses_words(text: str, found: list[tuple[int, str]]) -> None:
    assert in_force(text) == found


def test_a_quoted_object_still_names_the_prohibition() -> None:
    assert in_force("Do not edit `config.py`.", "Feel free to edit config.py now.") == []


def test_a_lifted_prohibition_stated_again_stands_from_its_new_turn() -> None:
    assert in_force("Do not run the tests.", "You can run the tests now.",
                    "Do not run the tests.") == [(3, "Do not run the tests.")]


def test_prior_prohibitions_carry_on_and_at_most_eight_stay_in_force() -> None:
    prior = (Standing("Never push to main.", 1),)
    assert standing([(2, "You can run the tests.")], prior) == prior
    many = standing((n, f"Do not touch file{n}.py.") for n in range(1, 12))
    assert len(many) == MAX_ITEMS and [s.turn for s in many] == list(range(4, 12))  # the most recent kept


@pytest.mark.parametrize("text", [
    "Read-only: no edits.",
    "This task is read-only.",
    "Treat the repo as read only.",
    "Don't modify anything.",
    "Do not change any files.",
    "Don't write to docs/.",
    "Dont touch the lockfile.",
    "Leave the migrations alone.",
    "Leave setup.cfg as is.",
    "Keep the public API unchanged.",
    "Never commit or push.",
    "No commits, no pushes.",
    "Make no changes to setup.cfg.",
    "Fix the parser without modifying the tests.",
    "Fix it without running the full suite.",
    "Avoid touching the CI config.",
    "Make sure not to install anything.",
    "Please refrain from deleting files.",
    "Hands off the vendor/ folder.",
    "Stay out of the legacy module.",
    "Pushing to main is not permitted.",
])
def test_a_prohibition_on_changing_running_touching_or_an_action_is_read_in_any_shape(text: str) -> None:
    assert in_force(text) == [(1, text)]


@pytest.mark.parametrize("text", [
    "I read only the first file.",
    "There were no changes in the diff.",
    "It ran, but no changes were made.",
    "The hook found nothing (no writes to progress.md).",
    "Use a generator to avoid running out of memory.",
    "Keep going until the tests pass.",
    "Leave it to me.",
    "Open the read-only file and tell me what it says?",
    'The docs say "leave the defaults alone".',
])
def test_a_fact_a_question_or_a_quote_is_no_prohibition(text: str) -> None:
    assert in_force(text) == []


@pytest.mark.parametrize(("prohibition", "permission"), [
    ("Read-only: no edits.", "ok, edit it now"),
    ("Treat src/ as read-only.", "You can edit src/ now."),
    ("Leave the migrations alone.", "Feel free to edit the migrations."),
    ("Fix it without modifying the tests.", "You may modify the tests now."),
    ("Make no changes to setup.cfg.", "You can change setup.cfg now."),
])
def test_a_permission_lifts_a_prohibition_of_any_shape(prohibition: str, permission: str) -> None:
    assert in_force(prohibition, permission) == []


@pytest.mark.parametrize(("prohibition", "later"), [
    ("Read-only: no edits.", "Thanks. Now summarise the parser."),
    ("Read-only: no edits.", "You can run the tests now."),  # another action
    ("Leave the migrations alone.", "You can edit the docs."),  # another object
])
def test_a_change_mode_stays_until_a_permission_names_a_change(prohibition: str, later: str) -> None:
    assert in_force(prohibition, later) == [(1, prohibition)]


def test_a_change_mode_forbids_changes_and_names_no_reading() -> None:
    from proxyvisor.gate.prohibitions import content_words, forbidden_words

    words = forbidden_words("Read-only: no edits.")
    assert content_words("edit modify change write") <= words
    assert not words & content_words("read only")
    assert forbidden_words("Do not run the tests.") == content_words("run the tests")


def test_a_long_request_is_read_at_its_start_and_end_in_bounded_time() -> None:
    """A person's rule opens or closes what they typed; a megabyte paste in between is data, and is not read."""
    import time

    paste = "\n".join(f"2026-12-04 12:00:{n % 60:02d} INFO worker {n} done" for n in range(400_000))  # ~20 MB
    rule, buried = "Do not touch migrations/.", "Never edit the lockfile."
    middle = paste[:len(paste) // 2] + "\n" + buried + "\n" + paste[len(paste) // 2:]
    started = time.process_time()
    assert prohibitions(f"{rule}\nHere is the log:\n{middle}") == (rule,)
    assert prohibitions(f"Here is the log:\n{middle}\n{rule}") == (rule,)
    assert time.process_time() - started < 1
    # A fence opened at the start and closed in the part left out does not hide the closing rule.
    assert prohibitions(f"```\n{paste}\n```\n{rule}") == (rule,)


@pytest.mark.parametrize("line", [
    "WARNING: do not retry the request with the same idempotency key",
    "[ERROR] never call close() twice",
    "error: do not use --force on a protected branch",
    "DEBUG do not cache this response",
    "2026-12-04 20:06:45 worker-3: do not retry, giving up",
    "[20:06:45] never mind, reconnected",
    "Dec  4 20:06:45 host app[12]: do not retry",
    "src/app.py:12: do not edit generated code",
    'File "x.py", line 3, in main: never reached',
])
def test_a_log_line_is_no_prohibition_in_a_short_or_a_long_message(line: str) -> None:
    assert in_force(line) == []
    assert in_force(f"Here is what it printed:\n{line}\nWhat happened?") == []
    assert in_force(f"{line}\nDo not push.") == [(1, "Do not push.")]  # the user's own line still counts


@pytest.mark.parametrize("text", ["Information: do not push.", "INFOrmally, do not push.", "Errors aside, never push.",
                                  "May the tests pass; never push."])
def test_words_that_only_look_like_a_log_prefix_keep_their_rule(text: str) -> None:
    assert len(in_force(text)) == 1
