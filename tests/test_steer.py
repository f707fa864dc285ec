"""Steer: when a signal becomes a note, the back-off, the note texts, and where notes go in the upstream body."""

from __future__ import annotations

import copy
import json
from typing import Any

import orjson
import pytest

from proxyvisor.config import SupervisorConfig
from proxyvisor.detectors.detectors import ALTERNATION, LOOP, MONOLOGUE, NO_PROGRESS, RECOVERY, SIGNALS
from proxyvisor.detectors.selfreport import INSTRUCTION
from proxyvisor.detectors.steer import NOTES, SteerPolicy, excused, note_text
from proxyvisor.proxy.formats import BY_NAME, ToolSpec
from proxyvisor.proxy.sessions import Session
from proxyvisor.proxy.supervise import Supervisor

BASH = ToolSpec("Bash", {"type": "object", "properties": {"command": {"type": "string"}}})


@pytest.mark.parametrize("state", ["done", "blocked", "need_input"])
def test_handbacks_and_done_are_never_steered(state: str) -> None:
    assert all(excused(signal, state) for signal in SIGNALS)
    assert SteerPolicy().decide((LOOP,), state) is None


def test_no_progress_is_silent_while_exploring_but_other_signals_are_not() -> None:
    assert excused(NO_PROGRESS, "exploring") and not excused(LOOP, "exploring")
    assert not excused(NO_PROGRESS, "progressing") and not excused(NO_PROGRESS, None)
    assert SteerPolicy().decide((NO_PROGRESS, RECOVERY), "exploring") == RECOVERY
    assert SteerPolicy().decide((NO_PROGRESS,), "exploring") is None
    assert SteerPolicy().decide((RECOVERY, NO_PROGRESS, LOOP), None) == LOOP  # priority, whatever the order


def test_an_ignored_note_comes_back_on_a_doubling_back_off() -> None:
    policy = SteerPolicy()
    sent = [n for n in range(1, 41) if policy.decide((LOOP,), "progressing") == LOOP]
    assert sent == [1, 2, 4, 8, 16, 32]


def test_a_new_signal_a_quiet_round_or_a_user_turn_start_afresh() -> None:
    policy = SteerPolicy()
    assert [policy.decide((LOOP,), None) for _ in range(3)] == [LOOP, LOOP, None]
    assert policy.decide((RECOVERY,), None) == RECOVERY  # a different signal: at once
    assert policy.decide((), None) is None
    assert policy.decide((RECOVERY,), None) == RECOVERY  # after a quiet round: at once
    policy.decide((RECOVERY,), None)
    policy.reset()
    assert policy.decide((RECOVERY,), None) == RECOVERY
    # An excused round neither sends nor advances the back-off.
    assert policy.decide((RECOVERY,), None) == RECOVERY and policy.decide((RECOVERY,), "blocked") is None
    assert policy.decide((RECOVERY,), None) is None and policy.decide((RECOVERY,), None) == RECOVERY


def test_notes_are_fixed_advisory_texts() -> None:
    assert set(NOTES) == set(SIGNALS) == {LOOP, ALTERNATION, MONOLOGUE, NO_PROGRESS, RECOVERY}
    for signal in SIGNALS:
        text = note_text(signal)
        assert text == note_text(signal)
        assert text.startswith(f'<supervisor-note signal="{signal}">') and text.endswith("</supervisor-note>")
        assert "advisory" in text and "<sup>" not in text
    assert "background job" in note_text(LOOP)  # polling: wait or report back, not just "try something else"


# ---- notes in the upstream body (Supervisor, no server) ------------------------------------------------------

def _history(rounds: int, output: str = "running") -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are an agent."},
                                      {"role": "user", "content": "Wait for the build."}]
    for n in range(rounds):
        messages.append({"role": "assistant", "content": f"Checking ({n}).",
                         "tool_calls": [{"id": f"call_{n}", "type": "function",
                                         "function": {"name": "Bash", "arguments": '{"command": "cat status"}'}}]})
        messages.append({"role": "tool", "tool_call_id": f"call_{n}", "content": output})
    return messages


def _upstream(fmt_name: str, supervisor: Supervisor, session: Session, rounds: int) -> dict[str, Any]:
    fmt = BY_NAME[fmt_name]
    body = fmt.request_from_chat(_history(rounds), "m", False, (BASH,))
    exchange = supervisor.begin(session, fmt, body)
    return orjson.loads(exchange.upstream_body())


def _texts(obj: Any) -> str:
    return json.dumps(obj)


@pytest.mark.parametrize("fmt_name", ["chat", "messages", "responses"])
def test_a_note_goes_after_the_latest_tool_results_and_stays_there(fmt_name: str) -> None:
    supervisor, session = Supervisor(SupervisorConfig()), Session("s", 0, 0)
    fmt = BY_NAME[fmt_name]
    bodies = [_upstream(fmt_name, supervisor, session, rounds) for rounds in range(1, 7)]
    history = [fmt.history(b) for b in bodies]
    assert all(note_text(LOOP) not in _texts(h) for h in history[:2])
    assert _texts(history[2]).count(note_text(LOOP).replace('"', '\\"')) == 1  # the third identical round
    # Each upstream history extends the one before it: notes are re-inserted at the same place, byte for byte.
    for before, after in zip(history, history[1:]):
        assert after[:len(before)] == before
    # The note sits right after the third round's tool result.
    client = fmt.history(fmt.request_from_chat(_history(3), "m", False, (BASH,)))
    placed = history[2]
    assert len(placed) in (len(client), len(client) + 1)
    assert note_text(LOOP).replace('"', '\\"') in _texts(placed[-1])
    if len(placed) == len(client):  # Anthropic: a text block after the tool_result blocks of the same message
        assert placed[-1]["content"][0]["type"] == "tool_result" and placed[-1]["content"][-1]["type"] == "text"
    # Back-off: the loop fires at rounds 3 to 6; its 1st, 2nd and 4th firings get a note.
    assert [_texts(h).count("supervisor-note signal") for h in history] == [0, 0, 1, 2, 2, 3]


@pytest.mark.parametrize("fmt_name", ["chat", "messages", "responses"])
def test_the_instruction_ends_the_system_prompt_and_the_agents_messages_are_not_rewritten(fmt_name: str) -> None:
    fmt = BY_NAME[fmt_name]
    client = fmt.request_from_chat(_history(4), "m", False, (BASH,))
    body = _upstream(fmt_name, Supervisor(SupervisorConfig()), Session("s", 0, 0), 4)
    system, _first = fmt.fingerprint_parts(body)
    client_system, _ = fmt.fingerprint_parts(client)
    assert system.startswith(client_system) and system.endswith(INSTRUCTION)
    # Take the notes out again: what is left is the agent's history, unchanged.
    kept = []
    for item in fmt.history(body):
        if note_text(LOOP).replace('"', '\\"') in _texts(item) and "tool_result" not in _texts(item):
            continue
        if isinstance(item.get("content"), list):
            item = {**item, "content": [b for b in item["content"]
                                        if not (isinstance(b, dict) and "supervisor-note" in str(b.get("text")))]}
        kept.append(item)
    original = copy.deepcopy(fmt.history(client))
    if fmt_name == "chat":
        kept, original = kept[1:], original[1:]  # the system message carries the instruction
    assert kept == original


def test_a_self_report_that_excuses_the_signal_adds_no_note() -> None:
    supervisor, session = Supervisor(SupervisorConfig()), Session("s", 0, 0)
    _upstream("chat", supervisor, session, 2)
    next(iter(session.supervision.threads.values())).state = "blocked"
    body = _upstream("chat", supervisor, session, 3)
    assert "supervisor-note signal" not in _texts(body["messages"])
    assert session.supervision.signals[LOOP] == 1 and not session.supervision.notes


def test_a_rewritten_history_drops_notes_whose_place_is_gone() -> None:
    supervisor, session = Supervisor(SupervisorConfig()), Session("s", 0, 0)
    for rounds in range(1, 4):
        _upstream("chat", supervisor, session, rounds)
    thread = next(iter(session.supervision.threads.values()))
    assert len(thread.notes) == 1
    fmt = BY_NAME["chat"]
    compacted = _history(4)
    compacted[7]["content"] = "finished"  # the tool result the note followed was rewritten
    body = fmt.request_from_chat(compacted, "m", False, (BASH,))
    supervisor.begin(session, fmt, body)
    assert thread.notes == [] and "supervisor-note signal" not in _texts(body["messages"])
