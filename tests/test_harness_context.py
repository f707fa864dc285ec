"""A user message that is only what an agent harness injects (Codex's ``<environment_context>``, a Claude Code
``<system-reminder>`` alone) is not a user turn: the detectors, the verify-gate's turn, the plan's goal, the
prohibitions and the conversation's thread key all skip it, for both harnesses alike."""

from __future__ import annotations

from typing import Any

from proxyvisor.detectors.detectors import RECOVERY, HistoryTracker
from proxyvisor.proxy.condensing import _scanned
from proxyvisor.proxy.formats import CHAT, MESSAGES, RESPONSES
from proxyvisor.transcript import harness_context, own_words

from test_detectors import call, signals_at, start, tool_round

ENVIRONMENT = ("<environment_context>\n  <cwd>/home/dev/project/work</cwd>\n  <shell>bash</shell>\n"
               "  <current_date>2026-11-30</current_date>\n</environment_context>")
REMINDER = "<system-reminder>\nThe user opened the file x.py in the IDE.\n</system-reminder>"


def codex_input(prompt: str) -> list[dict[str, Any]]:
    """The start of a Codex request's ``input`` (reference/client-captures/codex_0.171.0_*): developer messages,
    the environment as a user message of its own, then the user's prompt."""
    def message(role: str, text: str) -> dict[str, Any]:
        return {"type": "message", "role": role, "content": [{"type": "input_text", "text": text}]}
    return [message("developer", "You are a coding agent running in the Codex CLI."),
            message("developer", "<permissions instructions>\nFilesystem sandboxing...</permissions instructions>"),
            message("user", ENVIRONMENT), message("user", prompt)]


def test_own_words_leave_out_both_harnesses_context() -> None:
    assert own_words(ENVIRONMENT) == "" and harness_context(ENVIRONMENT)
    assert own_words(f"  {REMINDER}\n{REMINDER} \n") == "" and harness_context(REMINDER + "\n" + REMINDER)
    assert own_words(f"{REMINDER}\nlist the files here") == "list the files here"
    assert not harness_context(f"{REMINDER}\nlist the files here")
    assert own_words("  plain request \n") == "plain request"
    assert not harness_context("") and not harness_context("<cwd>/x</cwd> is where I am")
    assert not harness_context("<environment_context> never closed")  # the user's words, not a block


def test_codex_environment_is_not_a_user_turn() -> None:
    items = [*codex_input("list the files here"),
             {"type": "function_call", "name": "exec_command", "arguments": '{"cmd": "ls"}', "call_id": "c1"},
             {"type": "function_call_output", "call_id": "c1", "output": "hello.txt\n"}]
    tracker = HistoryTracker()
    tracker.update(items, RESPONSES.message, {})
    assert tracker.user_turns == [3] and tracker.turn_start == 3
    system, first = RESPONSES.fingerprint_parts({"input": items})
    assert (system, first) == ("You are a coding agent running in the Codex CLI.", ENVIRONMENT + "\nlist the files here")
    assert own_words(first) == "list the files here"  # the task the verify-gate is given


def test_conversations_in_one_directory_have_their_own_first_message() -> None:
    first, second = ({"input": codex_input(prompt)} for prompt in ("fix the test", "add a flag"))
    assert RESPONSES.fingerprint_parts(first) != RESPONSES.fingerprint_parts(second)
    for fmt in (CHAT, MESSAGES):
        body = {"messages": [{"role": "user", "content": REMINDER}, {"role": "user", "content": "fix the test"}]}
        assert own_words(fmt.fingerprint_parts(body)[1]) == "fix the test"


def test_a_reminder_alone_neither_starts_a_turn_nor_resets_the_detectors() -> None:
    run = call("Bash", command="python test_complex.py")
    failing = (run, "Exit code 1\nNameError: mmsubsup")
    history = (start() + tool_round(failing) + [{"role": "user", "content": REMINDER}]
               + tool_round((call("Bash", command="sed -i 's/a/b/' x.py"), "Exit code 0")) + tool_round(failing))
    tracker = HistoryTracker()
    tracker.update(history, CHAT.message, {})
    assert tracker.user_turns == [1] and tracker.turn_start == 1
    assert RECOVERY in signals_at(history)[len(history) - 2]  # the failure history was kept across the reminder
    assert _scanned(CHAT, history).request == "Fix the bug."  # the condenser's current request is the user's
    # A message with the user's words beside a reminder is a turn, as before.
    history[4] = {"role": "user", "content": REMINDER + "\nTry another approach."}
    tracker = HistoryTracker()
    tracker.update(history, CHAT.message, {})
    assert tracker.user_turns == [1, 4]
