"""The tools a request offers and the calls a reply makes, wherever a client declares and makes them.

The fixtures are shaped like Codex 0.171.0 with its default model (``../shared/reference/real-clients.md`` section
9): no top-level ``tools``, an ``additional_tools`` input item holding namespaces, a freeform (``custom``) ``exec``
tool whose input is JavaScript calling nested tools, ``custom_tool_call`` items and their outputs as lists of text
parts. Written for these tests, not copied from a capture.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import orjson
import pytest

from proxyvisor.scripted.upstream import auto_turn, parse_step, turn_of
from proxyvisor.detectors.receipts import DECLARED, GUESSED, NONE, receipt
from proxyvisor.proxy.condensing import can_read_back
from proxyvisor.proxy.formats import CHAT, MESSAGES, RESPONSES, AssistantTurn, ToolCall, ToolSpec
from proxyvisor.proxy.formats.freeform import arguments, command_input, qualified, runs_commands, split

from helpers import MODEL, http_client, sse_events
from test_delegation_proxy import CALL, CHILD, FINAL, delegating
from test_gate_proxy import DONE, Verifier, gated, verdict

EXEC_ABOUT = ("Run JavaScript code to orchestrate tool calls.\n- All nested tools are available on the global "
              "`tools` object, for example `await tools.exec_command(...)`.")
RUN_SCHEMA = {"type": "object", "properties": {"cell_id": {"type": "string"}}, "required": ["cell_id"]}


def codex_request(*history: dict[str, Any], stream: bool = False, prompt: str = "Fix the bug in app.py.") \
        -> dict[str, Any]:
    """A request shaped like Codex's with its default model: tools only in an ``additional_tools`` item."""
    tools = {"type": "additional_tools", "id": "at_1", "role": "developer", "tools": [
        {"type": "namespace", "name": "functions", "description": "", "tools": [
            {"type": "custom", "name": "exec", "description": EXEC_ABOUT,
             "format": {"type": "grammar", "syntax": "lark", "definition": "start: /[\\s\\S]+/"}},
            {"type": "function", "name": "wait", "description": "Waits on a cell.", "strict": False,
             "parameters": RUN_SCHEMA}]},
        {"type": "namespace", "name": "clock", "description": "Time.", "tools": [
            {"type": "function", "name": "sleep", "description": "Sleep.", "strict": False,
             "parameters": {"type": "object", "properties": {"duration_ms": {"type": "number"}}}}]}]}
    return {"model": MODEL, "stream": stream, "tool_choice": "auto", "parallel_tool_calls": False, "store": False,
            "input": [tools,
                      {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Be Codex."}]},
                      {"type": "message", "role": "user", "content": [{"type": "input_text", "text": prompt}]},
                      *history]}


def exec_call(call_id: str, script: str) -> dict[str, Any]:
    return {"type": "custom_tool_call", "id": "ctc_" + call_id, "status": "completed", "call_id": call_id,
            "name": "exec", "input": script}


def exec_output(call_id: str, exit_code: int, output: str) -> dict[str, Any]:
    result = orjson.dumps({"chunk_id": "ab12cd", "wall_time_seconds": 0.4, "exit_code": exit_code,
                           "output": output}).decode()
    return {"type": "custom_tool_call_output", "id": "ctco_" + call_id, "call_id": call_id, "output": [
        {"type": "input_text", "text": "Script completed\nWall time 0.5 seconds\nOutput:\n"},
        {"type": "input_text", "text": result}]}


def run(command: str) -> str:
    return f"const r = await tools.exec_command({{cmd: {orjson.dumps(command).decode()}}});\ntext(r);"


# ---- the tools a request offers ----------------------------------------------------------------------------------
def test_tools_declared_in_additional_tools_and_namespaces_are_read() -> None:
    specs = RESPONSES.tools(codex_request())
    assert [(t.name, t.kind) for t in specs] == [("exec", "custom"), ("wait", "function"), ("clock.sleep", "function")]
    assert specs[0].schema == {} and specs[0].description == EXEC_ABOUT and specs[1].schema == RUN_SCHEMA


def test_top_level_tools_namespaces_and_built_in_types_are_read_together() -> None:
    body = {"input": "hi", "tools": [
        {"type": "function", "name": "exec_command", "parameters": {"type": "object"}},
        {"type": "namespace", "name": "multi_agent_v1", "tools": [{"type": "function", "name": "spawn_agent"}]},
        {"type": "web_search", "external_web_access": False}, "junk", {"type": "function"}]}
    assert [(t.name, t.kind) for t in RESPONSES.tools(body)] == [
        ("exec_command", "function"), ("multi_agent_v1.spawn_agent", "function"), ("web_search", "web_search")]


def test_a_repeated_tools_list_reads_as_a_fresh_one_with_the_additional_tools_after_it() -> None:
    """The requests of a session repeat the very same ``tools`` list (``proxyvisor.proxy.bodies``): what is read of
    it once serves them, each with its own list, the tools of its ``additional_tools`` items after it."""
    tools = [{"type": "function", "name": "exec_command"},
             {"type": "namespace", "name": "ns", "tools": [{"type": "function", "name": "spawn_agent"}]}]
    extra = {"type": "additional_tools", "tools": [{"type": "function", "name": "late"}]}
    names = [t.name for t in RESPONSES.tools({"input": [], "tools": tools})]
    assert names == ["exec_command", "ns.spawn_agent"]
    again = RESPONSES.tools({"input": [extra], "tools": tools})
    assert [t.name for t in again] == names + ["late"]
    again.clear()
    assert [t.name for t in RESPONSES.tools({"input": [], "tools": tools})] == names


def test_chat_custom_tools_and_anthropic_tool_types_are_read() -> None:
    chat = {"tools": [{"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}},
                      {"type": "custom", "custom": {"name": "shell", "description": "Runs a command line."}}]}
    assert [(t.name, t.kind) for t in CHAT.tools(chat)] == [("bash", "function"), ("shell", "custom")]
    messages = {"tools": [{"name": "Read", "input_schema": {"type": "object"}},
                          {"type": "custom", "name": "Edit", "input_schema": {"type": "object"}},
                          {"type": "bash_20250124", "name": "bash"},
                          {"type": "web_search_20250305", "name": "web_search", "max_uses": 3}]}
    assert [(t.name, t.kind) for t in MESSAGES.tools(messages)] == [
        ("Read", "function"), ("Edit", "function"), ("bash", "bash_20250124"), ("web_search", "web_search_20250305")]


def test_qualified_names_split_back_and_the_default_namespace_is_the_bare_name() -> None:
    assert [qualified(n, "x") for n in (None, "", "functions", "clock")] == ["x", "x", "x", "clock.x"]
    assert [split(n) for n in ("x", "clock.x", ".x")] == [(None, "x"), ("clock", "x"), (None, ".x")]


# ---- the calls a reply makes ---------------------------------------------------------------------------------------
def test_every_call_type_a_reply_makes_is_read_and_hosted_calls_are_not_the_clients() -> None:
    output = [
        {"type": "reasoning", "id": "rs_1", "summary": []},
        exec_call("c1", run("pytest -q")),
        {"type": "function_call", "call_id": "c2", "name": "sleep", "namespace": "clock", "arguments": '{"duration_ms": 5}'},
        {"type": "function_call", "call_id": "c3", "name": "wait", "namespace": "functions", "arguments": "{}"},
        {"type": "local_shell_call", "id": "ls_1", "call_id": "c4",
         "action": {"type": "exec", "command": ["bash", "-lc", "ls"], "env": {}}},
        {"type": "shell_call", "call_id": "c5", "action": {"commands": ["make", "make test"]}},
        {"type": "apply_patch_call", "call_id": "c6", "operation": {"type": "update_file", "path": "app.py",
                                                                    "diff": "@@"}},
        {"type": "brand_new_call", "call_id": "c7", "arguments": '{"x": 1}'},
        {"type": "web_search_call", "id": "ws_1", "status": "completed", "action": {"query": "q"}},
        {"type": "mcp_call", "id": "mcp_1", "name": "lookup", "server_label": "docs", "output": "found"},
    ]
    calls = RESPONSES.parse_response({"output": output}).tool_calls
    assert [(c.id, c.name, c.kind) for c in calls] == [
        ("c1", "exec", "custom"), ("c2", "clock.sleep", "function"), ("c3", "wait", "function"),
        ("c4", "local_shell", "local_shell"), ("c5", "shell", "shell"), ("c6", "apply_patch", "apply_patch"),
        ("c7", "brand_new", "brand_new")]
    assert calls[0].arguments == {"input": run("pytest -q"), "cmd": "pytest -q"}
    assert calls[3].arguments["command"] == ["bash", "-lc", "ls"]
    assert calls[4].arguments["command"] == "make\nmake test"
    assert calls[5].arguments["path"] == "app.py" and calls[6].arguments == {"x": 1}
    hosted = {"output": output[-2:] + [{"type": "message", "role": "assistant",
                                        "content": [{"type": "output_text", "text": "Found it."}]}]}
    assert RESPONSES.parse_response(hosted) == AssistantTurn("Found it.")


def test_chat_custom_calls_are_read_in_replies_and_history() -> None:
    message = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "custom", "custom": {"name": "shell", "input": "pytest -q"}},
        {"id": "c2", "type": "function", "function": {"name": "bash", "arguments": '{"command": "ls"}'}}]}
    calls = CHAT.parse_response({"choices": [{"message": message}]}).tool_calls
    assert [(c.name, c.kind, c.arguments) for c in calls] == [
        ("shell", "custom", {"input": "pytest -q", "cmd": "pytest -q"}), ("bash", "function", {"command": "ls"})]
    assert [u.name for u in CHAT.message(message).tool_uses] == ["shell", "bash"]


@pytest.mark.parametrize("fmt", [RESPONSES, CHAT], ids=["responses", "chat"])
@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_a_rendered_custom_call_reads_back_as_the_same_call(fmt: Any, stream: bool) -> None:
    turn = AssistantTurn("Running it.", (ToolCall("exec", arguments("exec", run("ls")), "call_x", "custom"),
                                         ToolCall("clock.sleep", {"duration_ms": 5}, "call_y")))
    if stream:
        got = fmt.assemble([(e.event, e.data) for e in sse_events(b"".join(fmt.render_stream(turn, MODEL, {})))])
    else:
        got = fmt.parse_response(orjson.loads(orjson.dumps(fmt.render(turn, MODEL))))
    if fmt is RESPONSES:  # the namespace travels apart from the name, as the client sends it
        items = fmt.render(turn, MODEL)["output"][1:]
        assert [(i["type"], i["name"], i.get("namespace")) for i in items] == [
            ("custom_tool_call", "exec", None), ("function_call", "sleep", "clock")]
        assert items[0]["input"] == run("ls")
    assert got == turn


def test_the_stream_splice_holds_from_a_custom_call_start() -> None:
    turn = AssistantTurn("Let me run it.", (ToolCall("exec", arguments("exec", run("ls")), "c1", "custom"),))
    events = [(e.event, e.data) for e in sse_events(b"".join(RESPONSES.render_stream(turn, MODEL, {})))]
    splice = RESPONSES.stream_splice(lambda name: name == "exec")
    passed = 0
    for name, data in events:
        if splice.held:
            break
        splice.event(name, data)
        passed += 1
    kinds = [orjson.loads(d)["type"] for _, d in events]
    assert splice.held and kinds[passed - 1] == "response.output_item.added"
    assert orjson.loads(events[passed - 1][1])["item"]["type"] == "custom_tool_call"


# ---- freeform inputs as arguments, and what the receipts make of them ----------------------------------------------
@pytest.mark.parametrize(("name", "text", "expected"), [
    ("exec", run("pytest -q"), {"cmd": "pytest -q"}),
    ("exec", "text(await tools.exec_command('ls -la'))", {"cmd": "ls -la"}),
    ("exec", "await tools['exec_command']({ workdir: '/w', cmd: `make test` })", {"cmd": "make test"}),
    ("exec", 'await tools.exec_command({cmd: "printf \'a\\\\n\' > f.txt"});', {"cmd": "printf 'a\\n' > f.txt"}),
    ("exec", 'await tools.exec_command({cmd: "a"}); await tools.exec_command({cmd: "b \\"q\\""});',
     {"cmd": 'a\nb "q"'}),
    ("exec", "const c = 'ls'; await tools.exec_command({cmd: c});", {}),
    ("exec", 'await tools.apply_patch("*** Begin Patch\\n*** End Patch"); text("ok")', {"action": "apply_patch"}),
    ("exec", "text(1 + 1)", {}),
    ("shell", "rm -rf build", {"cmd": "rm -rf build"}),
    ("apply_patch", "*** Begin Patch\n*** End Patch", {}),
], ids=["object", "string", "bracket-template", "escapes", "two-commands", "dynamic", "nested-tool", "no-tools",
        "shell-named", "patch"])
def test_a_freeform_input_is_read_as_the_commands_and_tools_it_runs(name: str, text: str,
                                                                    expected: dict[str, Any]) -> None:
    assert arguments(name, text) == {"input": text, **expected}


def test_a_script_with_many_nested_calls_is_read_up_to_a_bound() -> None:
    script = "".join(f"await tools.exec_command({{cmd: 'echo {n}'}});\n" for n in range(1000))
    assert arguments("exec", script)["cmd"].splitlines() == [f"echo {n}" for n in range(64)]
    unclosed = "await tools.exec_command({ x: [" + "[" * 100_000 + " cmd: 'late'"
    assert arguments("exec", unclosed) == {"input": unclosed}  # a command past the object's span is not read


@pytest.mark.parametrize(("name", "text", "mutation", "command"), [
    ("exec", run("pytest -q"), NONE, "pytest -q"),
    ("exec", run("sed -i 's/a/b/' app.py"), GUESSED, "sed -i 's/a/b/' app.py"),
    ("exec", 'await tools.apply_patch("*** Begin Patch");', DECLARED, None),
    ("apply_patch", "*** Begin Patch\n*** Update File: app.py\n*** End Patch", DECLARED, None),
    ("exec", "text(ALL_TOOLS.length)", NONE, None),
], ids=["check", "shell-write", "nested-patch", "patch-tool", "no-command"])
def test_the_receipts_rules_apply_to_freeform_calls(name: str, text: str, mutation: str, command: str | None) -> None:
    r = receipt(RESPONSES.message(exec_call("c1", text) | {"name": name}).tool_uses[0], None, {})
    assert (r.mutation, r.command) == (mutation, command)


def test_history_reads_custom_calls_and_their_text_part_outputs() -> None:
    call, output = exec_call("c1", run("pytest -q")), exec_output("c1", 1, "1 failed, 2 passed\n")
    use = RESPONSES.message(call).tool_uses[0]
    (result,) = RESPONSES.message(output).tool_outputs
    assert (use.id, use.name, result.call_id, result.structured) == ("c1", "exec", "c1", False)
    assert "1 failed, 2 passed" in result.text
    r = receipt(use, result, RESPONSES.tools(codex_request())[0].schema)
    assert (r.command, r.error) == ("pytest -q", True)  # the exit code in the JSON part decides
    assert not receipt(use, RESPONSES.message(exec_output("c1", 0, "3 passed\n")).tool_outputs[0], {}).error
    assert RESPONSES.ends_with_tool_result(codex_request(call, output))


def test_a_nested_shell_calls_json_answer_is_read_as_the_commands_output_and_exit_status() -> None:
    # Codex's exec answers the command's output inside a JSON object: read unwrapped, a piped failing run (exit
    # status 0) shows its runner summary and fails, and the failure is quoted as the runner printed it.
    call = exec_call("c1", run("cargo test 2>&1 | tail -3"))
    output = exec_output("c1", 0, "failures:\n    tests::mul\n\ntest result: FAILED. 0 passed; 1 failed; 0 ignored\n")
    (result,) = RESPONSES.message(output).tool_outputs
    assert result.text.endswith("test result: FAILED. 0 passed; 1 failed; 0 ignored\n\nProcess exited with code 0")
    assert '"chunk_id"' not in result.text
    r = receipt(RESPONSES.message(call).tool_uses[0], result, RESPONSES.tools(codex_request())[0].schema)
    assert (r.check, r.error, r.summary) == ("failed", True, "test result: FAILED. 0 passed; 1 failed; 0 ignored")


def test_local_shell_and_other_outputs_pair_with_their_calls() -> None:
    local = {"type": "local_shell_call", "id": "ls_1", "call_id": "c9",
             "action": {"type": "exec", "command": ["pytest", "-q"]}}
    out = {"type": "local_shell_call_output", "call_id": "c9", "output": "3 passed"}
    shell_out = {"type": "shell_call_output", "call_id": "c8",
                 "output": [{"stdout": "", "stderr": "boom", "outcome": {"type": "exit", "exit_code": 2}}]}
    r = receipt(RESPONSES.message(local).tool_uses[0], RESPONSES.message(out).tool_outputs[0], None)
    assert (r.tool, r.command, r.error) == ("local_shell", "pytest -q", False)
    (shell,) = RESPONSES.message(shell_out).tool_outputs
    assert '"exit_code":2' in shell.text and shell.structured
    assert RESPONSES.message({"type": "web_search_call", "id": "ws", "status": "completed"}).role == "other"


# ---- users: condense, the scripted model, delegation's offer -------------------------------------------------------
def test_a_freeform_tool_that_runs_commands_can_read_a_spill_file_back() -> None:
    specs = RESPONSES.tools(codex_request())
    assert runs_commands(specs[0]) and can_read_back(specs)
    assert not can_read_back(specs[1:])  # wait and clock.sleep read nothing
    assert not can_read_back([ToolSpec("exec", {}, "Evaluates arithmetic.", "custom")])
    assert can_read_back([ToolSpec("shell", {}, "", "custom")]) and can_read_back([ToolSpec("tools.Bash")])


def test_the_scripted_auto_mode_calls_the_declared_shell_tool_the_way_it_is_declared() -> None:
    (call,) = auto_turn(RESPONSES, codex_request()).tool_calls
    assert (call.name, call.kind, call.arguments["cmd"]) == ("exec", "custom", "ls")
    assert call.arguments["input"] == command_input(RESPONSES.tools(codex_request())[0], "ls")
    item = RESPONSES.render(AssistantTurn("", (call,)), MODEL)["output"][0]
    assert (item["type"], item["name"]) == ("custom_tool_call", "exec") and "tools.exec_command" in item["input"]
    shell = {"input": "hi", "tools": [{"type": "custom", "name": "shell", "description": "A command line."},
                                      {"type": "function", "name": "Bash",
                                       "parameters": {"type": "object", "properties": {"command": {"type": "string"}}}}]}
    (first,) = auto_turn(RESPONSES, shell).tool_calls
    assert (first.name, first.kind, first.arguments) == ("shell", "custom", {"input": "ls", "cmd": "ls"})
    shell["tools"] = shell["tools"][1:]
    assert auto_turn(RESPONSES, shell).tool_calls == (ToolCall("Bash", {"command": "ls"}),)


def test_a_script_step_with_input_is_a_freeform_call() -> None:
    step = parse_step({"tool_calls": [{"name": "exec", "input": run("ls"), "id": "c1"}]})
    assert turn_of(step).tool_calls == (ToolCall("exec", arguments("exec", run("ls")), "c1", "custom"),)
    with pytest.raises(ValueError, match="freeform"):
        parse_step({"tool_calls": [{"name": "exec", "input": {"x": 1}}]})


def test_offered_tools_go_into_the_clients_default_namespace_and_its_own_item_is_left_alone() -> None:
    body = codex_request()
    original = copy.deepcopy(body["input"][0])
    agents_item = body["input"][0]
    RESPONSES.add_tools(body, [ToolSpec("reviewer", {"type": "object"}, "Reviews code.")])
    assert "tools" not in body and agents_item == original  # a copy was changed, not the agent's item
    assert [t.name for t in RESPONSES.tools(body)] == ["exec", "wait", "reviewer", "clock.sleep"]
    without = {"input": [{"type": "additional_tools", "tools": [{"type": "function", "name": "a"}]}]}
    RESPONSES.add_tools(without, [ToolSpec("reviewer")])
    assert [t.name for t in RESPONSES.tools(without)] == ["a", "reviewer"] and "tools" not in without
    top = {"input": [{"type": "additional_tools", "tools": []}], "tools": [{"type": "function", "name": "a"}]}
    RESPONSES.add_tools(top, [ToolSpec("reviewer")])
    assert [t["name"] for t in top["tools"]] == ["a", "reviewer"] and top["input"][0]["tools"] == []


def test_tools_of_additional_tools_items_read_from_a_grown_historys_new_items_are_those_of_a_whole_read() -> None:
    """A history that only grew is read from its new items on (what was read is kept on its last item); a random
    run of growing, rewritten, retried and edited histories, parsed as the proxy parses them (the earlier items the
    very same objects), gives at every step the tools of a whole read of a plain copy."""
    import random

    from proxyvisor.proxy.bodies import BodyCache

    rng, cache = random.Random(12), BodyCache()
    history: list[dict[str, Any]] = list(codex_request()["input"])
    for step in range(600):
        roll = rng.random()
        if roll < 0.1 and len(history) > 4:  # compaction: the middle dropped
            history = history[:1] + history[len(history) // 2:]
        elif roll < 0.15 and len(history) > 2:  # an item edited in place
            at = rng.randrange(len(history))
            history[at] = {**history[at], "id": f"edited_{step}"}
        elif roll < 0.2:  # a retry: nothing new
            pass
        elif roll < 0.3:  # more tools declared
            history.append({"type": "additional_tools", "id": f"at_{step}",
                            "tools": [{"type": "function", "name": f"t{step}_{n}"} for n in range(rng.randrange(3))]})
        else:
            history += [{"type": "function_call", "call_id": f"c{step}", "name": "exec", "arguments": "{}"},
                        {"type": "function_call_output", "call_id": f"c{step}", "output": "ok"}]
        body = {"model": "m", "input": history}
        parsed = cache.loads("input", "responses", orjson.dumps(body))
        if rng.random() < 0.1:
            RESPONSES.add_tools(parsed, [ToolSpec(f"added_{step}")])
        for _ in range(rng.randrange(1, 3)):  # asked once or twice per request
            assert RESPONSES.tools(parsed) == RESPONSES.tools(orjson.loads(orjson.dumps(parsed)))
    assert cache.reused > 300


# ---- through the proxy -----------------------------------------------------------------------------------------------
async def post(url: str, body: dict[str, Any]) -> tuple[AssistantTurn, bytes]:
    async with http_client() as client:
        response = await client.post(url + RESPONSES.path, content=orjson.dumps(body),
                                     headers={"content-type": "application/json", "x-proxyvisor-session": "codex"})
    assert response.status_code == 200, response.content
    if body.get("stream"):
        return RESPONSES.assemble([(e.event, e.data) for e in sse_events(response.content)]), response.content
    return RESPONSES.parse_response(orjson.loads(response.content)), response.content


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_a_codex_shaped_turn_end_is_gated(tmp_path: Path, stream: bool) -> None:
    async with gated(tmp_path, [DONE], Verifier([verdict()])) as g:
        turn, _ = await post(g.proxy.url, codex_request(stream=stream))
    assert turn.text.rstrip("\n") == DONE["text"] and g.model.purposes() == ["verify"]
    assert g.last("gate")["outcome"] == "unknown"


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_a_custom_tool_call_reply_passes_as_a_tool_round(tmp_path: Path, stream: bool) -> None:
    step = {"text": "Let me run it.", "tool_calls": [{"name": "exec", "input": run("ls"), "id": "c1"}]}
    async with gated(tmp_path, [step], Verifier()) as g:
        turn, raw = await post(g.proxy.url, codex_request(stream=stream))
    assert [(c.name, c.kind, c.arguments["cmd"]) for c in turn.tool_calls] == [("exec", "custom", "ls")]
    assert g.model.calls == [] and all("gate" not in line for line in g.ledger())
    if stream:  # streamed through as the upstream sent it, not held to the end
        assert raw == g.upstream.responses[-1]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_the_gate_reads_custom_calls_and_their_outputs_as_evidence(tmp_path: Path, stream: bool) -> None:
    history = [exec_call("c1", run("sed -i 's/a/b/' app.py")), exec_output("c1", 0, ""),
               exec_call("c2", run("python -m pytest -q")), exec_output("c2", 0, "3 passed in 0.02s\n")]
    async with gated(tmp_path, [DONE], Verifier([verdict()])) as g:
        await post(g.proxy.url, codex_request(*history, stream=stream))
    assert g.last("gate")["outcome"] == "verified"
    digest = g.model.calls[0][1][1]["content"]
    assert "python -m pytest -q" in digest and "3 passed" in digest


async def test_delegation_tools_offered_to_a_codex_shaped_request_keep_its_shape(tmp_path: Path) -> None:
    async with delegating(tmp_path / "state", [CALL, FINAL], [CHILD]) as s:
        turn, _ = await post(s.proxy.url, codex_request())
    assert (turn.text, turn.tool_calls) == (FINAL["text"], ())
    first = orjson.loads(s.parent.requests[0][1])
    assert "tools" not in first and first["input"][0]["type"] == "additional_tools"
    assert [t.name for t in RESPONSES.tools(first)] == ["exec", "wait", "reviewer", "clock.sleep"]
    assert s.child.requests  # the child ran: the model's call reached the delegation
