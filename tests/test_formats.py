"""The three wire formats: what they render, the real SDKs parse; their errors have each API's shape."""

from __future__ import annotations

import anthropic
import openai
import orjson
import pytest

from proxyvisor.gate.verdict import VERIFIER_INSTRUCTIONS
from proxyvisor.scripted.upstream import turn_of
from proxyvisor.proxy import estimate
from proxyvisor.proxy.formats import Usage
from proxyvisor.proxy.formats.base import error_types
from proxyvisor.proxy.server import Request, Response

from helpers import (FORMATS, MODEL, TEXT_STEP, TOOL_STEP, TWO_CALLS_STEP, Answer, ask, assert_error_shape, fmt_of,
                     json_events, raw_stream, request_body, serve_handler, sse_events)

_STOP = {"chat": ("tool_calls", "stop"), "messages": ("tool_use", "end_turn"), "responses": ("completed", "completed")}


def expected_answer(fmt: str, step: dict) -> Answer:
    calls = tuple((c["id"], c["name"], c["arguments"]) for c in step.get("tool_calls", ()))
    return Answer(step.get("text", ""), calls, _STOP[fmt][0 if calls else 1])


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("fmt", FORMATS)
async def test_sdk_parses_rendered_turns(fmt: str, stream: bool, scripted_server) -> None:
    for step in (TOOL_STEP, TEXT_STEP, TWO_CALLS_STEP):
        scripted_server.script.queue(step)
        assert await ask(fmt, scripted_server.url, stream=stream) == expected_answer(fmt, step)


@pytest.mark.parametrize("fmt", FORMATS)
def test_usage_is_read_back_from_json_and_stream(fmt: str) -> None:
    f = fmt_of(fmt)
    turn = turn_of(TOOL_STEP)
    assert f.usage(f.render(turn, MODEL)) == Usage(120, 17)
    request = request_body(fmt, stream=True, stream_options={"include_usage": True})
    seen = Usage()
    for event in sse_events(b"".join(f.render_stream(turn, MODEL, request))):
        if event.data != "[DONE]" and (found := f.stream_usage(event.event, orjson.loads(event.data))):
            seen.add(found)
    assert seen == Usage(120, 17)


def test_stream_grammar_of_each_format() -> None:
    turn = turn_of(TOOL_STEP)
    chat = json_events(b"".join(fmt_of("chat").render_stream(turn, MODEL, {})))
    assert all(name is None for name, _ in chat) and chat[-1][1] == "[DONE]"
    messages = json_events(b"".join(fmt_of("messages").render_stream(turn, MODEL, {})))
    assert [name for name, _ in messages] == [data["type"] for _, data in messages]
    assert messages[0][0] == "message_start" and messages[-1][0] == "message_stop"
    responses = json_events(b"".join(fmt_of("responses").render_stream(turn, MODEL, {})))
    assert [data["sequence_number"] for _, data in responses] == list(range(len(responses)))
    assert responses[0][0] == "response.created" and responses[-1][0] == "response.completed"


_OPENAI_ERRORS = {400: openai.BadRequestError, 401: openai.AuthenticationError, 403: openai.PermissionDeniedError,
                  404: openai.NotFoundError, 413: openai.APIStatusError, 429: openai.RateLimitError,
                  500: openai.InternalServerError, 503: openai.InternalServerError, 529: openai.InternalServerError}
_ANTHROPIC_ERRORS = {400: anthropic.BadRequestError, 401: anthropic.AuthenticationError,
                     403: anthropic.PermissionDeniedError, 404: anthropic.NotFoundError,
                     413: anthropic.RequestTooLargeError, 429: anthropic.RateLimitError,
                     500: anthropic.InternalServerError, 503: anthropic.InternalServerError,
                     529: anthropic.OverloadedError}


@pytest.mark.parametrize("fmt", FORMATS)
async def test_error_bodies_have_each_apis_shape(fmt: str, scripted_server) -> None:
    f = fmt_of(fmt)
    for status, openai_error in _OPENAI_ERRORS.items():
        assert_error_shape(fmt, status, f.error_body(status, "it broke"))
        scripted_server.script.queue({"fault": {"status": status, "message": f"scripted {status} here"}})
        expected = _ANTHROPIC_ERRORS[status] if fmt == "messages" else openai_error
        with pytest.raises(expected) as caught:
            await ask(fmt, scripted_server.url, stream=False)
        err = caught.value
        assert err.status_code == status
        assert f"scripted {status} here" in err.message
        if fmt == "messages":
            assert err.body["error"]["type"] == error_types(status)[1]
        else:  # the SDK's code: a specific one, or None
            assert (err.type, err.code) == (error_types(status)[0], "rate_limit_exceeded" if status == 429 else None)


# Each status proxyvisor answers with itself (its own refusals, a failed upstream, a stream it ends) -> the type
# Anthropic's API sends with that status (its errors page: invalid_request_error for a 4xx it does not name; a 503
# is an api_error, overloaded_error is 529's alone).
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 405: "invalid_request_error", 408: "invalid_request_error",
                    409: "invalid_request_error", 413: "request_too_large", 415: "invalid_request_error",
                    426: "invalid_request_error", 429: "rate_limit_error", 500: "api_error", 501: "api_error",
                    502: "api_error", 503: "api_error", 504: "timeout_error", 529: "overloaded_error"}


@pytest.mark.parametrize("status", _ANTHROPIC_TYPES)
def test_messages_errors_carry_the_type_anthropic_sends_with_their_status(status: int) -> None:
    f = fmt_of("messages")
    assert orjson.loads(f.error_body(status, "x"))["error"]["type"] == _ANTHROPIC_TYPES[status]
    (name, event), = json_events(f.stream_error(status, "x"))
    assert name == "error" and event["error"]["type"] == _ANTHROPIC_TYPES[status]


# The same statuses -> the (type, code) OpenAI's API sends with them: invalid_request_error for any 4xx (a bad key, a
# model not found, a body too large alike), "requests" for a limit on requests (code rate_limit_exceeded),
# server_error for any 5xx; never Anthropic's names (timeout_error, authentication_error...). The code is a specific
# one or null, never the type repeated: proxyvisor knows none but a 429's for its own errors.
_OPENAI_TYPES = {status: ("requests", "rate_limit_exceeded") if status == 429 else
                 ("invalid_request_error", None) if status < 500 else ("server_error", None)
                 for status in _ANTHROPIC_TYPES}


@pytest.mark.parametrize("status", _OPENAI_TYPES)
@pytest.mark.parametrize("fmt", ["chat", "responses"])
def test_openai_errors_carry_the_type_openai_sends_with_their_status(fmt: str, status: int) -> None:
    f = fmt_of(fmt)
    kind, code = _OPENAI_TYPES[status]
    assert orjson.loads(f.error_body(status, "x"))["error"] == {"message": "x", "type": kind, "param": None,
                                                                "code": code}
    (_name, event), = json_events(f.stream_error(status, "x"))
    assert (event["error"]["type"], event["error"]["code"]) == (kind, code)
    if fmt == "responses":  # the documented event's own fields
        assert (event["type"], event["code"]) == ("error", code)


@pytest.mark.parametrize("fmt", FORMATS)
async def test_stream_error_event_makes_the_sdk_raise(fmt: str) -> None:
    f = fmt_of(fmt)
    events = f.render_stream(turn_of(TOOL_STEP), MODEL, {})[:4]

    async def broken(request: Request) -> Response:
        async def body():
            for event in events:
                yield event
            yield f.stream_error(502, "upstream went away mid-stream", events[-1])

        return Response(200, [(b"content-type", b"text/event-stream")], body())

    async with serve_handler(broken) as url:
        with pytest.raises((openai.APIError, anthropic.APIError)) as caught:
            await ask(fmt, url, stream=True)
    assert "upstream went away mid-stream" in str(caught.value)
    if fmt == "responses":
        (name, data), = json_events(f.stream_error(502, "x", events[-1]))
        assert name == "error" and data["sequence_number"] == len(events)  # continues the stream's numbering


@pytest.mark.parametrize("fmt", FORMATS)
def test_rendered_turns_read_back_as_the_same_turn(fmt: str) -> None:
    f = fmt_of(fmt)
    for step in (TOOL_STEP, TEXT_STEP, TWO_CALLS_STEP):
        turn = turn_of(step)
        expected = (turn.text, turn.tool_calls)
        parsed = f.parse_response(f.render(turn, MODEL))
        events = [(e.event, e.data) for e in sse_events(b"".join(f.render_stream(turn, MODEL, {})))]
        assembled = f.assemble(events)
        assert (parsed.text, parsed.tool_calls) == expected
        assert (assembled.text, assembled.tool_calls) == expected


def test_notes_never_change_the_agents_own_messages() -> None:
    from proxyvisor.proxy.formats import MESSAGES

    user = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "ok"}]}
    plain = {"role": "user", "content": "Fix it."}
    body = {"messages": [plain, {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "x",
                                                                   "input": {}}]}, user]}
    agent = [plain, body["messages"][1], user]
    MESSAGES.insert_notes(body, [(0, "note A"), (2, "note B")])
    assert user == {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "ok"}]}
    assert plain == {"role": "user", "content": "Fix it."} and body["messages"][0] is not agent[0]
    assert body["messages"][2]["content"][-1] == {"type": "text", "text": "note B"}


def _reported_usage(fmt: str, stream: bool, data: bytes) -> Usage:
    f = fmt_of(fmt)
    if not stream:
        return f.usage(orjson.loads(data))
    seen = Usage()
    for event in sse_events(data):
        if event.data != "[DONE]" and (found := f.stream_usage(event.event, orjson.loads(event.data))):
            seen.add(found)
    return seen


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("fmt", FORMATS)
async def test_scripted_answers_report_zero_usage_unless_the_step_sets_it(fmt: str, stream: bool,
                                                                         scripted_server) -> None:
    """A client prices the usage it is told at its own model's rate: the scripted model, which spends no tokens,
    reports 0 (usage present and well-formed); a step's ``input_tokens``/``output_tokens`` are reported as set."""
    body = request_body(fmt, stream=stream, **({"stream_options": {"include_usage": True}} if fmt == "chat" else {}))
    scripted_server.script.queue({"text": "no counts"}, {"text": "counted", "input_tokens": 321, "output_tokens": 7})
    seen = []
    for _ in range(3):  # the two steps, then an auto-mode answer
        response, data = await raw_stream(scripted_server.url, fmt, body)
        assert response.status_code == 200, data
        seen.append(_reported_usage(fmt, stream, data))
    assert seen == [Usage(0, 0), Usage(321, 7), Usage(0, 0)]


@pytest.mark.parametrize("fmt", FORMATS)
async def test_scripted_supervisor_answers_report_the_calls_counted_tokens(fmt: str, scripted_server) -> None:
    """proxyvisor's own calls are priced by no client: their usage is the call's tiktoken count, so the
    supervisor model's figures in the ledger are the calls' real sizes."""
    body = request_body(fmt)
    system = VERIFIER_INSTRUCTIONS + "\nverify"
    if fmt == "chat":
        body["messages"][0]["content"] = system
    elif fmt == "messages":
        body["system"] = system
    else:
        body["instructions"] = system
    response, data = await raw_stream(scripted_server.url, fmt, body)
    assert response.status_code == 200, data
    assert scripted_server.script.supervisor_requests, "not taken for a verifier call"
    usage = fmt_of(fmt).usage(orjson.loads(data))
    assert usage.input_tokens == estimate.input_tokens(fmt_of(fmt), body) > 0 and usage.output_tokens > 0


# ---- grafting a part-blocked batch's calls back into the agent's copy of it (WireFormat.graft) -------------------
def _grafted(fmt: str, history: list, response: dict) -> list:
    from proxyvisor.proxy.formats.base import CallResult, interleave_runs

    w = fmt_of(fmt)
    graft = w.graft(history, 0, response, [CallResult("call_b", "[authorizer] Tool not executed: r.", True)])
    out = [graft.replace.get(n, item) for n, item in enumerate(history)]
    return interleave_runs(out, graft.runs)


def test_messages_graft_puts_the_call_into_the_same_message_without_repeating_its_thinking() -> None:
    from helpers import pairing_errors

    thinking = {"type": "thinking", "thinking": "plan", "signature": "sig"}
    use_a = {"type": "tool_use", "id": "call_a", "name": "Bash", "input": {"command": "ls"}}
    use_b = {"type": "tool_use", "id": "call_b", "name": "Bash", "input": {"command": "pytest"}}
    response = {"role": "assistant", "content": [thinking, {"type": "text", "text": "Two."}, use_a, use_b]}
    reminder = {"type": "text", "text": "<system-reminder>x</system-reminder>"}
    history = [{"role": "user", "content": "Go."},
               {"role": "assistant", "content": [thinking, {"type": "text", "text": "Two."}, use_a]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_a", "content": "ok"},
                                            reminder]}]
    out = _grafted("messages", history, response)
    assert out[1]["content"] == response["content"]  # one thinking block, the calls in the model's order
    assert [b.get("tool_use_id") for b in out[2]["content"]] == ["call_a", "call_b", None]  # the text stays last
    assert out[2]["content"][1]["is_error"] is True and len(out) == 3
    assert pairing_errors("messages", {"messages": out}) == []
    assert history[1]["content"] == [thinking, {"type": "text", "text": "Two."}, use_a]  # the agent's item as sent


def test_responses_graft_puts_the_call_beside_its_batch_and_repeats_no_reasoning_item() -> None:
    from helpers import pairing_errors

    reasoning = {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "e"}
    call_a = {"type": "function_call", "id": "fc_a", "call_id": "call_a", "name": "shell", "arguments": "{}"}
    call_b = {"type": "local_shell_call", "id": "lsh_b", "call_id": "call_b", "status": "completed",
              "action": {"type": "exec", "command": ["pytest"]}}
    response = {"output": [reasoning, call_b, call_a]}
    history = [{"role": "user", "content": "Go."}, reasoning, call_a,
               {"type": "function_call_output", "call_id": "call_a", "output": "ok"}]
    out = _grafted("responses", history, response)
    assert [i.get("call_id") or i.get("id") or i.get("role") for i in out] == [
        "user", "rs_1", "call_b", "call_a", "call_b", "call_a"]
    assert out[2] == call_b and out[4]["output"].startswith("[authorizer]")
    assert pairing_errors("responses", {"input": out}) == []


def test_chat_graft_answers_every_call_before_the_next_message() -> None:
    from helpers import pairing_errors

    entry_a = {"id": "call_a", "type": "function", "function": {"name": "Bash", "arguments": "{}"}}
    entry_b = {"id": "call_b", "type": "function", "function": {"name": "Bash", "arguments": '{"command":"pytest"}'}}
    response = {"choices": [{"message": {"role": "assistant", "content": None, "tool_calls": [entry_a, entry_b]}}]}
    history = [{"role": "user", "content": "Go."}, {"role": "assistant", "content": None, "tool_calls": [entry_a]},
               {"role": "tool", "tool_call_id": "call_a", "content": "ok"}]
    out = _grafted("chat", history, response)
    assert out[1]["tool_calls"] == [entry_a, entry_b]
    assert [m.get("tool_call_id") for m in out[2:]] == ["call_a", "call_b"]
    assert pairing_errors("chat", {"messages": out}) == []


@pytest.mark.parametrize("fmt", FORMATS)
def test_no_graft_without_the_batchs_other_calls_and_their_results(fmt: str) -> None:
    """A history that went another way (the batch's other calls or their results are not there) gets nothing:
    a call is never put back without its result."""
    from proxyvisor.proxy.formats import AssistantTurn, ToolCall
    from proxyvisor.proxy.formats.base import CallResult

    w = fmt_of(fmt)
    response = w.render(AssistantTurn("", (ToolCall("Bash", {"command": "ls"}, "call_a"),
                                           ToolCall("Bash", {"command": "pytest"}, "call_b"))), MODEL)
    asked = [w.user_item("Go.")]
    called = asked + w.assistant_items(w.without_calls(response, ["call_b"]), lambda _n: True)
    for history in (asked + [w.user_item("Something else.")], called):
        assert w.graft(history, 0, response, [CallResult("call_b", "no", True)]).replace == {}
        assert w.graft(history, 0, response, [CallResult("call_b", "no", True)]).runs == []
