"""Receipts and detectors over histories, sans-IO: each detector's edges, incremental updates and rebuilds."""

from __future__ import annotations

import dataclasses
import itertools
import json
import pickle
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxyvisor.detectors.detectors import (ALTERNATION, LOOP, MONOLOGUE, NO_PROGRESS, RECOVERY, HistoryTracker)
from proxyvisor.detectors.receipts import (DECLARED, GUESSED, NONE, Round, UserTurn, failed, is_runner,
                                           mutation_level, read_rounds, result_digest, targets)
from proxyvisor.proxy.formats import CHAT, MESSAGES, RESPONSES, ToolSpec
from proxyvisor.transcript import Message, ToolOutput, fingerprint

BASH = {"type": "object", "properties": {"command": {"type": "string"}}}
_ids = itertools.count()


def call(name: str, **arguments: Any) -> tuple[str, dict[str, Any]]:
    return name, arguments


def tool_round(*calls: tuple[tuple[str, dict[str, Any]], str], text: str | None = None,
               is_error: bool | None = None) -> list[dict[str, Any]]:
    """Chat messages of one assistant turn calling ``calls`` (each ((name, args), output)) and their results."""
    ids = [f"call_{next(_ids)}" for _ in calls]
    messages: list[dict[str, Any]] = [{"role": "assistant", "content": text, "tool_calls": [
        {"id": i, "type": "function", "function": {"name": c[0][0], "arguments": json.dumps(c[0][1])}}
        for i, c in zip(ids, calls)]}]
    for i, c in zip(ids, calls):
        result: dict[str, Any] = {"role": "tool", "tool_call_id": i, "content": c[1]}
        if is_error is not None:
            result["is_error"] = is_error
        messages.append(result)
    return messages


def user(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


def say(text: str) -> list[dict[str, Any]]:
    return [{"role": "assistant", "content": text}]


def start() -> list[dict[str, Any]]:
    return [{"role": "system", "content": "You are an agent."}, {"role": "user", "content": "Fix the bug."}]


def fired(history: list[dict[str, Any]], schemas: dict[str, Any] | None = None,
          mutating: frozenset[str] = frozenset()) -> list[tuple[int, tuple[str, ...]]]:
    """Firings when ``history`` arrives one request at a time (a request after each round, as agents send)."""
    tracker = HistoryTracker(mutating)
    out = []
    for end in range(1, len(history) + 1):
        if end < len(history) and history[end]["role"] != "assistant":
            continue
        out += [(f.index, f.signals) for f in tracker.update(history[:end], CHAT.message, schemas or {}).firings]
    return out


def signals_at(history: list[dict[str, Any]], **kw: Any) -> dict[int, tuple[str, ...]]:
    return dict(fired(history, **kw))


def rounds_of(history: list[dict[str, Any]]) -> list[int]:
    """History positions where rounds start."""
    return [e.index for e in read_rounds([CHAT.message(m) for m in history]) if isinstance(e, Round)]


# ---- loop ---------------------------------------------------------------------------------------------------

def test_loop_fires_on_the_third_identical_round_and_keeps_firing() -> None:
    poll = (call("Bash", command="cat status"), "running\nexit code 0")
    history = start() + tool_round(poll) + tool_round(poll) + tool_round(poll) + tool_round(poll)
    r = rounds_of(history)
    assert signals_at(history) == {r[2]: (LOOP,), r[3]: (LOOP,)}


def test_polling_a_job_that_advances_is_not_a_loop() -> None:
    history = start()
    for done in range(8):
        history += tool_round((call("BashOutput", bash_id="7d3c90"), f"<status>running</status> {done}/8 files"))
    assert fired(history) == []


def test_polling_whose_only_change_is_a_timestamp_or_duration_is_a_loop() -> None:
    history = start()
    for second in range(3):
        history += tool_round((call("BashOutput", bash_id="7d3c90"),
                               f"<status>running</status>\n<timestamp>2025-12-01T04:48:{27 + second}.051Z"
                               f"</timestamp> took {second}.5s"))
    assert signals_at(history) == {rounds_of(history)[2]: (LOOP,)}


def test_identical_outputs_for_different_targets_are_not_a_loop() -> None:
    history = start()
    for name in ("a.py", "b.py", "c.py", "d.py", "e.py", "f.py"):
        history += tool_round((call("Read", file_path=name), "(empty file)"))
    assert fired(history) == []


def test_the_same_output_for_the_same_target_under_reworded_arguments_is_not_new() -> None:
    history = start()
    for limit in range(100, 700, 100):  # a widened window over the same file: nothing new
        history += tool_round((call("Read", file_path="./app.py", limit=limit), "1\timport os\n"))
    r = rounds_of(history)  # the first read was new; the five after it were not
    assert signals_at(history) == {r[5]: (NO_PROGRESS,)}


def test_a_parallel_batch_is_one_round_and_its_order_does_not_matter() -> None:
    a, b = (call("Read", file_path="a.py"), "A"), (call("Read", file_path="b.py"), "B")
    history = start() + tool_round(a, b) + tool_round(b, a) + tool_round(a, b)
    assert len(rounds_of(history)) == 3
    assert signals_at(history) == {rounds_of(history)[2]: (LOOP,)}


def test_a_declared_mutation_never_loops_but_a_guessed_one_does() -> None:
    write = (call("Write", file_path="a.py", content="x = 1\n"), "File written")
    history = start() + tool_round(write) * 1 + tool_round(write) + tool_round(write) + tool_round(write)
    assert fired(history) == []
    sed = (call("Bash", command="sed -i 's/return mmsubsup/return mmsubsup/' mathml.py"),
           "<returncode>0</returncode>\n<output>\n</output>")
    history = start() + tool_round(sed) + tool_round(sed) + tool_round(sed)
    assert signals_at(history, schemas={"Bash": BASH}) == {rounds_of(history)[2]: (LOOP,)}


def test_a_failed_write_earns_no_novelty() -> None:
    bad = (call("Edit", file_path="a.py", old_string="x", new_string="y"), "<tool_use_error>String not found")
    history = start() + tool_round(bad) + tool_round(bad) + tool_round(bad)
    assert LOOP in signals_at(history)[rounds_of(history)[2]]


def test_alternating_between_two_rounds_fires_on_the_sixth() -> None:
    a, b = (call("Bash", command="make"), "error: x"), (call("Read", file_path="x.c"), "int x;")
    history = start()
    for step in range(7):
        history += tool_round(a if step % 2 == 0 else b)
    r = rounds_of(history)
    found = signals_at(history)
    assert ALTERNATION not in found.get(r[4], ()) and ALTERNATION in found[r[5]] and ALTERNATION in found[r[6]]


# ---- monologue and dropped turns ----------------------------------------------------------------------------

NUDGE = "No tool calls found in the response. Every response MUST include at least one tool call."


def test_repeated_prompts_stand_for_turns_the_client_dropped() -> None:
    history = start() + tool_round((call("Bash", command="ls"), "a b")) + user(NUDGE) * 5
    events = read_rounds([CHAT.message(m) for m in history])
    assert [type(e).__name__ for e in events] == ["UserTurn", "Round"] + ["Round"] * 5
    # Each nudge, the first one included, complains about an answer the client did not keep: one dropped turn.
    assert all(e.implied for e in events[2:])
    assert fired(history) == [(6, (MONOLOGUE,)), (7, (MONOLOGUE,)), (8, (MONOLOGUE, NO_PROGRESS))]


def test_the_same_text_three_times_without_a_tool_call_is_a_monologue() -> None:
    history = start() + user("go on")
    for _ in range(4):
        history += say("I will now run the tests.") + user("go on")
    assert fired(history) == [(7, (MONOLOGUE,)), (9, (MONOLOGUE,))]
    history = start() + user("go on")
    for n in range(4):
        history += say(f"I will now run test {n}.") + user("go on")
    assert fired(history) == []


def test_a_user_who_asks_again_after_real_work_is_a_genuine_turn() -> None:
    history = start()
    for count in range(6):  # the user-requested repeat checks of the corpus: same command, growing counts
        history += user("how is our progress") + tool_round((call("Bash", command="./check.sh"), f"done: {count}"))
        history += say(f"{count} done so far.")
    assert fired(history) == []
    events = read_rounds([CHAT.message(m) for m in history])
    assert sum(isinstance(e, UserTurn) for e in events) == 7


def test_a_genuine_user_turn_resets_the_windows() -> None:
    poll = (call("Bash", command="cat status"), "running")
    history = start() + tool_round(poll) + tool_round(poll) + user("keep waiting") + tool_round(poll)
    assert fired(history) == []


# ---- recovery ------------------------------------------------------------------------------------------------

def test_the_same_command_failing_the_same_way_twice_is_recovery() -> None:
    run = call("Bash", command="python test_complex.py")
    history = (start() + tool_round((run, "Exit code 1\nNameError: mmsubsup")) +
               tool_round((call("Bash", command="sed -i 's/a/b/' x.py"), "Exit code 0")) +
               tool_round((run, "Exit code 1\nNameError: mmsubsup")))
    assert signals_at(history) == {rounds_of(history)[2]: (RECOVERY,)}


def test_a_harness_re_prompt_keeps_the_failure_history_and_the_turn() -> None:
    run = call("Bash", command="python test_complex.py")
    reprompt = "Please always provide EXACTLY ONE action in triple backticks, found 2 actions."
    history = (start() + tool_round((run, "Exit code 1\nNameError: mmsubsup")) + say("I will fix it.") +
               user(reprompt) + tool_round((run, "Exit code 1\nNameError: mmsubsup")))
    assert RECOVERY in signals_at(history)[rounds_of(history)[-1]]
    tracker = HistoryTracker()
    tracker.update(history, CHAT.message, {})
    assert tracker.turn_start == 1  # the task, not the re-prompt
    # The same history with a genuine user message instead: a new turn, the failure history starts afresh.
    history = history[:5] + user("Try another approach.") + history[6:]
    assert not signals_at(history)
    tracker = HistoryTracker()
    tracker.update(history, CHAT.message, {})
    assert tracker.turn_start == 5


def test_a_search_that_found_nothing_is_no_failure_for_recovery() -> None:
    search = call("Bash", command="grep -rn mmsubsup src")
    history = start() + tool_round((search, "Exit code 1")) + tool_round((search, "Exit code 1"))
    assert not signals_at(history)
    assert all(not e.receipts[0].error for e in read_rounds([CHAT.message(m) for m in history])
               if isinstance(e, Round))


def test_a_run_piped_through_tail_that_shows_failures_is_a_failure() -> None:
    run = call("Bash", command="pytest -q 2>&1 | tail -3")
    output = "FAILED t.py::test_a\n1 failed, 3 passed in 0.2s\nExit code 0"
    history = start() + tool_round((run, output)) + tool_round((run, output))
    assert signals_at(history) == {rounds_of(history)[1]: (RECOVERY,)}


def test_a_command_failing_with_changing_errors_fires_on_the_fourth_failure() -> None:
    run = call("Bash", command="pytest tests/test_api.py")
    history = start()
    for failures in (3, 5, 4, 1):
        history += tool_round((call("Edit", file_path="api.py", old_string=str(failures), new_string="y"), "ok"))
        history += tool_round((run, f"Exit code 1\n{failures} failed, 2 passed in 1.9{failures}s"))
    r = rounds_of(history)
    assert signals_at(history) == {r[7]: (RECOVERY,)}


def test_a_success_of_the_same_command_clears_it_but_another_command_does_not() -> None:
    run = call("Bash", command="pytest")
    history = (start() + tool_round((run, "Exit code 1\nboom")) + tool_round((run, "Exit code 0\n3 passed")) +
               tool_round((run, "Exit code 1\nboom")))
    assert fired(history) == []
    other = (call("Bash", command="ls"), "Exit code 0\na b")
    history = start() + tool_round((run, "Exit code 1\nboom")) + tool_round(other) + tool_round((run, "Exit code 1\nboom"))
    assert [s for _, s in fired(history)] == [(RECOVERY,)]


def test_another_working_directory_is_another_command() -> None:
    here, there = call("Bash", command="make", workdir="/a"), call("Bash", command="make", workdir="/b")
    history = start() + tool_round((here, "Exit code 2\nerr")) + tool_round((there, "Exit code 2\nerr"))
    assert fired(history) == []


def test_empty_commands_are_not_command_executions_and_changing_output_is_no_loop() -> None:
    history = start()
    for tick in range(6):
        history += tool_round((call("Bash", command=""), f"Exit code 1\nstill compiling {tick}"))
    assert fired(history) == []
    history = start() + tool_round((call("Bash", command="  "), "Exit code 1")) * 1
    history += tool_round((call("Bash", command="  "), "Exit code 1"))
    assert RECOVERY not in [s for _, sig in fired(history) for s in sig]


def test_huge_arguments_are_digested_without_trouble() -> None:
    content = "x = 1\n" * 200_000  # 1.2 MB of arguments
    write = (call("Bash", command=f"cat > big.py <<'EOF'\n{content}EOF"), "Exit code 1\ndisk full")
    history = start() + tool_round(write) + tool_round(write)
    assert [s for _, s in fired(history, schemas={"Bash": BASH})] == [(RECOVERY,)]


# ---- errors, targets, mutations ----------------------------------------------------------------------------

@pytest.mark.parametrize("output, is_error, expected", [
    ("all good", None, False),
    ("all good", True, True),  # Anthropic is_error wins
    ("Exit code 0\nTraceback (most recent call last):", None, False),  # an exit status beats markers
    ("Exit code 1\n3 failed", None, True),
    ("Exit code 1\n3 failed", False, True),
    ("<returncode>2</returncode>\n<output>\n</output>", None, True),
    ("<returncode>0</returncode>\n<output>\nerror: in the data\n</output>", None, False),
    ("Chunk ID: b8ff4d\nProcess exited with code 127\nOutput:\nsh: foo: command not found", None, True),
    ("Traceback (most recent call last):\n  File x\nNameError: y", None, True),
    ("bash: foo: command not found", None, True),
    ("Your proposed edit has introduced new syntax error(s).", None, True),
    ("Traceback (most recent call last):\n  File x\nNameError: y", False, False),  # explicit success
    ("line\n" * 5000 + "Traceback (most recent call last):", None, True),  # the tail is read
    ("Traceback (most recent call last)" .join(["x" * 1000] * 2), None, False),  # the middle is not
    ("\u2713 caf\u00e9 built\nExit code 0\nerror: noted", None, False),  # non-ASCII text: its status is read
    ("\u2713 caf\u00e9 built\nexit code 3", None, True),
    ("\u2713 caf\u00e9 built\nRETURN CODE = 2", None, True),
    ("\u2713 EX\u0130T CODE 6", None, True),  # re.I reads the dotted and the dotless i as an i
    ("caf\u00e9 ex\u0131t code 7", None, True),
    ("caf\u00e9 EX\u0130T CODE 0\nerror: noted", None, False),
    ("\u2713 caf\u00e9 built", None, False),
    ("run<returncode>3</returncode>", None, True),  # a returncode tag anywhere
    ("preexit code 1\nreexited with code 1\nnoreturn code 1", None, False),  # "exit", "return": at a word's start
    ('{"exit_code": 2}', None, True),
    ("EXIT_CODE=0\nerror: noted", None, False),
    ("Exited With Status: 4", None, True),
])
def test_error_status(output: str, is_error: bool | None, expected: bool) -> None:
    assert failed(ToolOutput("c", output, is_error)) is expected
    assert failed(None) is True


def test_targets_are_path_like_arguments() -> None:
    # Any key containing "path" or "file" (so "profile" too: the rule is Octomind's, kept as it is).
    assert targets({"file_path": "./a.py", "paths": ["b", "", 3], "pattern": "x", "profile": "./c"}) == (
        "a.py", "b", "c")


@pytest.mark.parametrize("name, arguments, schema, expected", [
    ("Write", {"file_path": "a"}, None, DECLARED),
    ("NotebookEdit", {}, None, DECLARED),
    ("apply_patch", {"input": "..."}, None, DECLARED),
    ("Read", {"file_path": "a"}, None, NONE),
    ("str_replace_editor", {"command": "view"}, {"properties": {"command": {"enum": ["view", "create"]}}}, DECLARED),
    ("mcp__tracker__setCookie", {}, None, DECLARED),  # camelCase "set": a known false positive, pinned
    ("Bash", {"command": "ls -la"}, BASH, NONE),
    ("Bash", {"command": "sed -i 's/a/b/' f"}, BASH, GUESSED),
    ("Bash", {"command": "python x.py > out.txt"}, BASH, GUESSED),
    ("Bash", {"command": "pytest -q 2>&1 | tail -5"}, BASH, NONE),
    ("Bash", {"command": "make > /dev/null"}, BASH, NONE),
    ("Bash", {"command": "git commit -am wip"}, BASH, GUESSED),
    ("Bash", {"command": "grep -rn update src"}, BASH, GUESSED),  # an intent word in the text: a guess
    ("exec_command", {"cmd": ["bash", "-lc", "rm -rf build"]}, None, GUESSED),
    ("Bash", {"command": "ls"}, BASH, NONE),
])
def test_mutation_classification(name: str, arguments: dict[str, Any], schema: dict[str, Any] | None,
                                 expected: str) -> None:
    assert mutation_level(name, arguments, schema, frozenset()) == expected


def test_the_configured_list_declares_mutations_and_never_loops() -> None:
    assert mutation_level("deploy_preview", {}, None, frozenset()) == DECLARED
    assert mutation_level("Touch", {"command": "x"}, {"properties": {"command": {"enum": ["x"]}}},
                          frozenset({"Touch"})) == DECLARED
    bump = (call("bump", version="1"), "bumped")
    history = start() + tool_round(bump) * 1 + tool_round(bump) + tool_round(bump)
    assert signals_at(history)  # not a mutation by name: a loop
    assert fired(history, mutating=frozenset({"bump"})) == []


@pytest.mark.parametrize("schema, expected", [
    ({"properties": {"command": {"type": "string"}}}, True),
    ({"properties": {"command": {"type": ["string", "null"]}}}, True),
    ({"properties": {"command": {"anyOf": [{"type": "null"}, {"type": "string"}]}}}, True),
    ({"properties": {"command": {"type": "string", "enum": ["view"]}}}, False),
    ({"properties": {"command": {"$ref": "#/defs/Cmd"}}}, False),
    ({"properties": {"path": {"type": "string"}}}, False),
])
def test_runner_is_read_from_the_schema(schema: dict[str, Any], expected: bool) -> None:
    assert is_runner(schema, {"command": "ls"}) is expected


def test_result_digest_masks_volatile_fields_but_not_counts() -> None:
    assert result_digest("at 2025-12-01T04:48:27.051Z took 1.98s id 0x7f3a2b") == \
        result_digest("at 2025-12-02T05:00:01Z took 2.02s id 0x7f9999")
    assert result_digest("Chunk ID: b8ff4d\nWall time: 0.0542 seconds") == \
        result_digest("Chunk ID: 91ac0e\nWall time: 0.0611 seconds")
    assert result_digest("processed 45/100") != result_digest("processed 46/100")


@pytest.mark.parametrize(("one", "other", "same"), [
    ("0x7f3a2b", "0x11", True),  # a field at the very start of the text
    ("12:00:01 5ms 0xab", "13:14:15 7ms 0xcd", True),  # fields one character apart
    ("took 5ms", "took 6ms", True),
    ("a0x7f", "a0x11", False),  # after a letter, a digit or an underscore a field does not start
    ("_12:00:01", "_13:14:15", False),
    ("id9f3a2b1c", "id9f3a2b1d", False),
    ("\u00e90x7f", "\u00e90x11", True),  # any other character may precede one
    ("x\n2025-12-01 04:48", "x\n2025-12-02 05:00", True),
    ("deadbeef-dead-beef-dead-beefdeadbeef", "cafebabe-cafe-babe-cafe-babecafebabe", True),
])
def test_result_digest_masks_fields_where_they_start(one: str, other: str, same: bool) -> None:
    assert (result_digest(one) == result_digest(other)) is same
    assert (result_digest(f"[{one}]") == result_digest(f"[{other}]")) is same


# ---- incremental updates and rebuilds -------------------------------------------------------------------------

def test_incremental_updates_equal_one_batch() -> None:
    poll = (call("Bash", command="cat status"), "running")
    history = (start() + tool_round(poll) * 1 + tool_round(poll) + tool_round(poll) + user(NUDGE) +
               user(NUDGE) + user(NUDGE) + user(NUDGE) + tool_round((call("Bash", command="x"), "Exit code 1")))
    batch = HistoryTracker().update(history, CHAT.message, {})
    assert [(f.index, f.signals) for f in batch.firings] == fired(history)


_STEPS = st.sampled_from(["poll", "poll2", "fail", "user", "nudge", "text", "write"])


@settings(max_examples=150, deadline=None)
@given(st.lists(_STEPS, max_size=25), st.lists(st.integers(min_value=1, max_value=80), max_size=8))
def test_any_request_boundaries_give_the_same_firings(steps: list[str], cuts: list[int]) -> None:
    history = start()
    for step in steps:
        history += {"poll": lambda: tool_round((call("Bash", command="cat s"), "running")),
                    "poll2": lambda: tool_round((call("Read", file_path="s"), "running")),
                    "fail": lambda: tool_round((call("Bash", command="make"), "Exit code 2\nerr")),
                    "user": lambda: user("continue please"),
                    "nudge": lambda: user(NUDGE),
                    "text": lambda: say("thinking"),
                    "write": lambda: tool_round((call("Write", file_path="a", content="1"), "ok"))}[step]()
    expected = [(f.index, f.signals) for f in HistoryTracker().update(history, CHAT.message, {}).firings]
    tracker, got = HistoryTracker(), []
    for end in sorted({min(c, len(history)) for c in cuts}) + [len(history)]:
        got += [(f.index, f.signals) for f in tracker.update(history[:end], CHAT.message, {}).firings]
    assert got == expected


def test_a_rewritten_history_is_rebuilt_from_scratch() -> None:
    poll = (call("Bash", command="cat status"), "running")
    history = start() + tool_round(poll) + tool_round(poll)
    tracker = HistoryTracker()
    assert not tracker.update(history, CHAT.message, {}).rebuilt
    edited = [dict(m) for m in history]
    edited[-1]["content"] = "stopped"  # an edit of the last item seen
    update = tracker.update(edited + tool_round(poll), CHAT.message, {})
    assert update.rebuilt and update.firings == []  # the edited round no longer repeats
    compacted = start()[:1] + user("Summary of the work so far: polling.") + tool_round(poll) * 1
    update = tracker.update(compacted, CHAT.message, {})
    assert update.rebuilt and [r.index for r in update.rounds] == [2]
    assert not tracker.update(compacted + tool_round(poll), CHAT.message, {}).rebuilt


def test_anthropic_and_responses_histories_give_the_same_rounds() -> None:
    poll = (call("Bash", command="cat status"), "running")
    chat = start() + tool_round(poll, text="Checking.") + tool_round(poll) + tool_round(poll)
    spec = (ToolSpec("Bash", BASH),)
    for fmt in (MESSAGES, RESPONSES):
        body = fmt.request_from_chat(chat, "m", False, spec)
        update = HistoryTracker().update(fmt.history(body), fmt.message, {"Bash": BASH})
        assert len(update.rounds) == 3 and [f.signals for f in update.firings] == [(LOOP,)]


def test_anthropic_is_error_and_text_beside_tool_results() -> None:
    message = MESSAGES.message({"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "boom"},
                                                                  {"type": "image", "source": {}}],
         "is_error": True, "cache_control": {"type": "ephemeral"}},
        {"type": "text", "text": "<system-reminder>x</system-reminder>"}]})
    assert message.role == "tool" and message.text == "<system-reminder>x</system-reminder>"
    assert message.tool_outputs == (ToolOutput("t1", "boom", True, True),)


def test_a_fingerprint_is_kept_on_its_message_and_changes_nothing_else() -> None:
    message = Message("tool", "", (), (ToolOutput("c1", "x" * 1000),))
    first = fingerprint(message)
    assert fingerprint(message) is first  # kept on the message, not computed again
    twin = Message("tool", "", (), (ToolOutput("c1", "x" * 1000),))
    assert (twin, hash(twin), repr(twin)) == (message, hash(message), repr(message)) and fingerprint(twin) == first
    loaded = pickle.loads(pickle.dumps(message))
    assert loaded == message and fingerprint(loaded) == first
    edited = dataclasses.replace(message, tool_outputs=(ToolOutput("c1", "x" * 999 + "y"),))
    assert fingerprint(edited) != first
