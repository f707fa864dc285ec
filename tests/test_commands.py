"""/plan and /info answered by proxyvisor itself (``proxyvisor.proxy.commands``), through the real SDKs, and the
session endpoints that give the same as JSON."""

from __future__ import annotations

import json
import re
from typing import Any

import orjson
import pytest
from hypothesis import given, settings, strategies as st

from proxyvisor.detectors.selfreport import INSTRUCTION
from proxyvisor.gate import plan as plans
from proxyvisor.proxy.bodies import BodyCache
from proxyvisor.proxy.commands import command_of, strip_exchanges
from proxyvisor.proxy.formats import BY_NAME, CHAT, MESSAGES, RESPONSES

from helpers import FORMATS, MODEL, anthropic_client, assert_error_shape, http_client, openai_client

SYSTEM = "You are an agent."
REPORT = ('<sup>{"state":"progressing","focus":"parser","next":"run tests","carry":["tests: pytest -q tests/parser",'
          '"the bug is in src/parse.c:88"],"plan":null}</sup>')


async def sdk_ask(fmt: str, url: str, messages: list[dict[str, str]], stream: bool) -> str:
    """Send a Chat-shaped text history with the real SDK of ``fmt``; the answer's text."""
    if fmt == "messages":
        async with anthropic_client(url) as client:
            body: dict[str, Any] = {"model": MODEL, "max_tokens": 256, "system": SYSTEM, "messages": messages}
            if stream:
                async with client.messages.stream(**body) as s:
                    m = await s.get_final_message()
            else:
                m = await client.messages.create(**body)
            assert m.stop_reason == "end_turn"
            return "".join(b.text for b in m.content if b.type == "text")
    async with openai_client(url) as client:
        if fmt == "chat":
            chat = [{"role": "system", "content": SYSTEM}, *messages]
            if stream:
                async with client.chat.completions.stream(model=MODEL, messages=chat) as s:
                    async for _ in s:
                        pass
                    c = await s.get_final_completion()
            else:
                c = await client.chat.completions.create(model=MODEL, messages=chat)
            assert c.choices[0].finish_reason == "stop"
            return c.choices[0].message.content or ""
        if stream:
            async with client.responses.stream(model=MODEL, instructions=SYSTEM, input=messages) as s:
                async for _ in s:
                    pass
                r = await s.get_final_response()
        else:
            r = await client.responses.create(model=MODEL, instructions=SYSTEM, input=messages)
        assert r.status == "completed"
        return r.output_text


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("fmt", FORMATS)
async def test_plan_and_info_are_answered_locally_and_kept_from_the_model(fmt: str, stream: bool, start_proxy,
                                                                          state_dir) -> None:
    work = {"text": f"I read the parser.\n{REPORT}", "input_tokens": 300, "output_tokens": 30}
    async with start_proxy([work, {"text": "Continuing."}]) as rp:
        upstream = rp.scripted["scripted"]
        url = f"{rp.url}/s/cmd"
        history = [{"role": "user", "content": "Fix the parser."}]
        answer = await sdk_ask(fmt, url, history, stream)
        assert answer == "I read the parser."
        history.append({"role": "assistant", "content": answer})
        for command in ("/info", " /plan\n"):
            history.append({"role": "user", "content": command})
            text = await sdk_ask(fmt, url, history, stream)
            history.append({"role": "assistant", "content": text})
            assert len(upstream.requests) == 1  # answered by proxyvisor: the model got nothing
            if command == "/info":
                rows = {row[1].strip(): row[2].strip() for row in (line.split("|") for line in text.splitlines()[4:])}
                assert text.startswith("**proxyvisor /info · session cmd**")
                assert rows["model requests"] == "1 (tool rounds 0, errors 0)"
                assert rows["self-reports"] == "ok 1"
                assert rows["reported states"] == "progressing 1"
                # A Chat stream reports usage only when asked (stream_options.include_usage); the SDK does not ask,
                # so proxyvisor counts the tokens itself and says so.
                if (fmt, stream) == ("chat", True):
                    assert re.match(r"[1-9]\d* in / [1-9]\d* out tokens \(estimated for 1 request\)", rows["upstream"])
                else:
                    assert rows["upstream"].startswith("300 in / 30 out tokens ·")
            else:
                assert text == (f"{plans.NO_PLAN}\n\nRetained critical knowledge (from the latest self-report):\n"
                                "- tests: pytest -q tests/parser\n- the bug is in src/parse.c:88")
        # The next model request carries neither command exchange; the agent's history still has them.
        history.append({"role": "user", "content": "Go on."})
        assert await sdk_ask(fmt, url, history, stream) == "Continuing."
        sent = orjson.loads(upstream.requests[-1][1])
        messages = [BY_NAME[fmt].message(item) for item in BY_NAME[fmt].history(sent)]
        assert [m.text for m in messages if m.role != "system"] == ["Fix the parser.", "I read the parser.", "Go on."]
    lines = [json.loads(line) for line in (state_dir / "ledger" / "cmd.jsonl").read_text().splitlines()]
    assert [line.get("local") for line in lines] == [None, "/info", "/plan", None]
    assert [(line["status"], line["input_tokens"], line["output_tokens"]) for line in lines[1:3]] == [(200, 0, 0)] * 2
    assert not any("report" in line for line in lines[1:3])
    assert rp.pipeline.sessions.get("cmd").requests == 2  # local answers are not model requests


def test_the_command_is_the_last_user_message_exactly() -> None:
    def chat(*messages: dict[str, Any]) -> dict[str, Any]:
        return {"messages": list(messages)}

    user = {"role": "user", "content": "/info"}
    assert command_of(CHAT, chat({"role": "system", "content": "s"}, user)) == "/info"
    assert command_of(CHAT, chat({"role": "user", "content": [{"type": "text", "text": "\n /plan \t"}]})) == "/plan"
    assert command_of(CHAT, chat({"role": "user", "content": "/info please"})) is None
    assert command_of(CHAT, chat({"role": "user", "content": "/INFO"})) is None
    assert command_of(CHAT, chat(user, {"role": "assistant", "content": "x"})) is None
    assert command_of(CHAT, chat(user, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "Bash", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c", "content": "/info"})) is None
    assert command_of(RESPONSES, {"input": " /plan"}) == "/plan"
    assert command_of(RESPONSES, {"input": [{"type": "message", "role": "user",
                                             "content": [{"type": "input_text", "text": "/info"}]}]}) == "/info"
    assert command_of(MESSAGES, {"messages": []}) is None


AIDER_REMINDER = ("\n\nTo suggest changes to a file you MUST return the entire content of the updated file.\n"
                  "You MUST use this *file listing* format:\n\npath/to/filename.js\n```\n// entire file\n```\n")


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_command_alone_on_the_first_line_is_asked_whatever_follows(fmt: str) -> None:
    """aider appends its format reminder to the user's message; the command still stands alone on line one."""
    wire = BY_NAME[fmt]

    def asked(text: str) -> str | None:
        return command_of(wire, wire.request_from_chat([{"role": "system", "content": SYSTEM},
                                                         {"role": "user", "content": text}], MODEL, False))

    assert asked("/info" + AIDER_REMINDER) == "/info"
    assert asked(" /plan \r\n" + AIDER_REMINDER) == "/plan"
    assert asked("/info please" + AIDER_REMINDER) is None
    assert asked("Fix the bug.\n/info") is None
    assert asked("/info") == "/info"


@pytest.mark.parametrize("fmt", FORMATS)
async def test_a_command_with_a_harness_reminder_is_answered_locally(fmt: str, start_proxy) -> None:
    async with start_proxy([{"text": "should not be used"}]) as rp:
        text = await sdk_ask(fmt, f"{rp.url}/s/aider-like", [{"role": "user", "content": "/info" + AIDER_REMINDER}],
                             stream=False)
        assert text.startswith("**proxyvisor /info · session aider-like**")
        assert rp.scripted["scripted"].requests == []


def test_claude_codes_request_shape_is_a_command() -> None:
    """Claude Code sends its context as a ``<system-reminder>`` block in the prompt's message and puts a system
    message after it (../shared/reference/client-captures/claude-code_2.1.197_turn1.json)."""
    body = {"messages": [
        {"role": "user", "content": [
            {"type": "text", "text": "<system-reminder>\nAs you answer the user's questions, you can use the "
                                     "following context:\n# currentDate\nToday's date is 2026-11-30.\n"
                                     "</system-reminder>\n\n"},
            {"type": "text", "text": " /info", "cache_control": {"type": "ephemeral"}}]},
        {"role": "system", "content": "Available agent types for the Agent tool: ..."}]}
    assert command_of(MESSAGES, body) == "/info"
    body["messages"][0]["content"][1]["text"] = "list the files /info"
    assert command_of(MESSAGES, body) is None


def test_a_prompt_after_a_command_claude_code_ran_itself_is_no_command() -> None:
    """Claude Code resumed (``--resume``) after ``claude -p "/info"``, which it answered itself ("Unknown command"),
    merges that command, its output and the next prompt into one user message: the prompt is what was asked, and
    it reaches the model (observed with Claude Code 2.1.197)."""
    merged = {"role": "user", "content": [
        {"type": "text", "text": "/info\n"},
        {"type": "text", "text": "<local-command-stdout>Unknown command: /info. Did you mean /init?"
                                 "</local-command-stdout>\n"},
        {"type": "text", "text": "/plan\n"},
        {"type": "text", "text": "<local-command-stdout>/plan isn't available in this environment."
                                 "</local-command-stdout>\n"},
        {"type": "text", "text": "and again"}]}
    body = {"messages": [{"role": "user", "content": "list the files"},
                         {"role": "assistant", "content": [{"type": "text", "text": "Done."}]}, merged]}
    assert command_of(MESSAGES, body) is None
    assert strip_exchanges(MESSAGES, body) == 0 and body["messages"][-1] is merged
    merged["content"][-1]["text"] = " /info"
    merged["content"].append({"type": "text", "text": "<system-reminder>todo list empty</system-reminder>"})
    assert command_of(MESSAGES, body) == "/info"


def test_strip_exchanges_removes_each_command_and_its_answer_only() -> None:
    body = {"messages": [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "/plan"}, {"role": "assistant", "content": "No plan."},
        {"role": "user", "content": "Fix it."},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "Bash", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c", "content": "ok"},
        {"role": "assistant", "content": "Fixed."},
        {"role": "user", "content": "/info"}, {"role": "system", "content": "mid"},
        {"role": "assistant", "content": "| counter | value |"},
        {"role": "user", "content": "/info"},  # no answer came back for this one: it goes alone
        {"role": "user", "content": "Thanks, now test it."}]}
    assert strip_exchanges(CHAT, body) == 5
    assert [m["content"] for m in body["messages"]] == ["s", "Fix it.", None, "ok", "Fixed.", "mid",
                                                        "Thanks, now test it."]
    # Anthropic: a tool result is a user message too; one whose text is a command is data, not a command.
    claude = {"messages": [
        {"role": "user", "content": [{"type": "text", "text": "<system-reminder>ctx</system-reminder>"},
                                     {"type": "text", "text": " /info"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "| counter | value |"}]},
        {"role": "user", "content": "List the files."},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "Bash", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "/info"}]}]}
    assert strip_exchanges(MESSAGES, claude) == 2 and len(claude["messages"]) == 3
    assert claude["messages"][0]["content"] == "List the files."
    untouched = {"messages": [{"role": "user", "content": "Fix it."}]}
    assert strip_exchanges(CHAT, untouched) == 0 and untouched == {"messages": [{"role": "user", "content": "Fix it."}]}


_TURNS = {
    "command": {"role": "user", "content": "/info"},
    "prompt": {"role": "user", "content": "Fix it."},
    "system": {"role": "system", "content": "mid"},
    "answer": {"role": "assistant", "content": "| counter | value |"},
    "call": {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "Bash", "arguments": "{}"}}]},
    "result": {"role": "tool", "tool_call_id": "c", "content": "ok"},
}


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.sampled_from(sorted(_TURNS)), max_size=4), min_size=1, max_size=8))
def test_strip_exchanges_of_a_growing_history_reads_only_new_items_and_drops_the_same(
        growth: list[list[str]]) -> None:
    """A history that grows request by request (parsed from its new bytes, its items kept) is stripped as if it
    were read whole each time, whichever split of commands, system messages and answers the growth makes."""
    cache, history = BodyCache(), [{"role": "system", "content": "s"}]
    for added in growth:
        history += [_TURNS[name] for name in added]
        raw = orjson.dumps({"model": MODEL, "messages": history, "stream": False})
        kept, whole = cache.loads("messages", "chat", raw), orjson.loads(raw)
        assert strip_exchanges(CHAT, kept) == strip_exchanges(CHAT, whole)
        assert kept == whole


async def test_plan_shows_the_live_plan_of_the_thread(start_proxy) -> None:
    async with start_proxy([{"text": f"Reading.\n{REPORT}"}]) as rp:
        url = f"{rp.url}/s/planned"
        await sdk_ask("chat", url, [{"role": "user", "content": "Refactor the parser."}], False)
        (thread,) = rp.pipeline.sessions.get("planned").supervision.threads.values()
        plan = plans.Plan("Refactor the parser", (
            plans.Phase("Map the grammar", "every rule is listed", plans.COMPLETED, "12 rules"),
            plans.Phase("Rewrite the lexer", "tests/lexer pass", plans.IN_PROGRESS),
            plans.Phase("Rewrite the parser", "tests/parser pass")))
        thread.plan = plan
        # A new conversation in the same session asks: the session's latest thread answers.
        text = await sdk_ask("chat", url, [{"role": "user", "content": "/plan"}], True)
        assert text.startswith(plans.render_text(plan) + "\n\nRetained critical knowledge")
        async with http_client(rp.url) as client:
            got = (await client.get("/proxyvisor/sessions/planned/plan")).json()
        assert got["plan"] == orjson.loads(orjson.dumps(plans.as_json(plan)))
        assert got["carry"] == ["tests: pytest -q tests/parser", "the bug is in src/parse.c:88"]
        assert got["text"] == text and got["session"] == "planned"
        assert len(rp.scripted["scripted"].requests) == 1


async def test_without_supervision_commands_go_to_the_model(start_proxy) -> None:
    async with start_proxy([{"text": "The model's own answer."}], supervised=False) as rp:
        assert await sdk_ask("responses", rp.url, [{"role": "user", "content": "/info"}], False) == \
            "The model's own answer."
        assert len(rp.scripted["scripted"].requests) == 1


async def test_the_upstream_never_gets_the_instruction_for_a_command(start_proxy) -> None:
    """A command request is answered before supervision touches it: no report instruction, nothing stripped."""
    async with start_proxy() as rp:
        text = await sdk_ask("messages", rp.url, [{"role": "user", "content": "/plan"}], False)
        assert INSTRUCTION not in text and text.startswith(plans.NO_PLAN)
        assert rp.scripted["scripted"].requests == []


# ---- endpoints --------------------------------------------------------------------------------------------------

async def test_session_endpoints(start_proxy, state_dir) -> None:
    async with start_proxy([{"text": "one"}, {"text": "two"}], proxy={"admin_token": "adm"}) as rp:
        await sdk_ask("chat", f"{rp.url}/s/first", [{"role": "user", "content": "hi"}], False)
        await sdk_ask("chat", f"{rp.url}/s/second", [{"role": "user", "content": "hi"}], False)
        rp.pipeline.sessions._sessions.pop("first")  # evicted: only its ledger is left
        async with http_client(rp.url) as client:
            client.headers["x-proxyvisor-admin"] = "adm"
            listing = (await client.get("/proxyvisor/sessions")).json()["sessions"]
            assert [(s["id"], s["in_memory"]) for s in listing] == [("second", True), ("first", False)]
            assert all(s["last_activity"].endswith("+00:00") for s in listing)
            first = (await client.get("/proxyvisor/sessions/first/info")).json()
            assert (first["session"], first["requests"], first["live"]) == ("first", 1, None)
            assert (await client.get("/proxyvisor/sessions/first/plan")).json()["plan"] is None
            for path, status in (("/proxyvisor/sessions/nobody/info", 404), ("/proxyvisor/sessions/nobody/plan", 404),
                                 ("/proxyvisor/sessions/..%2Fetc/info", 400), ("/proxyvisor/sessions/first/x", 404)):
                reply = await client.get(path)
                assert reply.status_code == status, path
                assert_error_shape("chat", status, reply.content)
            assert (await client.post("/proxyvisor/sessions", json={})).status_code == 405
            # The session prefix is ignored here, like everywhere.
            assert (await client.get("/s/x/proxyvisor/sessions")).json()["sessions"] == listing


async def test_session_endpoints_need_the_auth_token(start_proxy) -> None:
    async with start_proxy(proxy={"auth_token": "sekret", "admin_token": "adm"}) as rp, http_client(rp.url) as client:
        assert (await client.get("/proxyvisor/sessions", headers={"x-proxyvisor-admin": "adm"})).status_code == 401
        reply = await client.get("/proxyvisor/sessions", headers={"x-proxyvisor-auth": "sekret",
                                                                  "x-proxyvisor-admin": "adm"})
        assert reply.json() == {"sessions": []}
