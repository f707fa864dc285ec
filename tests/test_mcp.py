"""``proxyvisor mcp``: the MCP SDK's own client starts the server (the venv's interpreter, stdio) and lists and calls
every tool against a session a running proxy served, and cancels a delegation; real Claude Code lists the server as
connected, and under ``proxyvisor wrap`` gets its own session from ``session_info``."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import trio
from mcp import Client
from mcp.client.stdio import StdioServerParameters

from proxyvisor.cli import main
from proxyvisor.config import load

from helpers import alive, http_client, request_body
from routing_support import FIXTURE_ADAPTERS
from test_real_clients import MODEL, Workspace, claude_env, find_agent, json_lines, wrap

TOOLS = {"session_info", "session_plan", "routing_config", "pool_health", "delegate"}
REPORT = '<sup>{"state":"exploring","focus":"look","next":null,"carry":["config in etc/app.toml"],"plan":null}</sup>'
SESSION = "mcp-session"
CONFIG = f'''# the operator's notes: kept by every write
[model_routing]
enabled = true
adapters_dir = "{FIXTURE_ADAPTERS}"

[model_routing.children]
retry_backoff_s = 0.05

[model_routing.adapter_options.scripted]
script = "SCRIPT"

[model_routing.roles.helper]
adapter = "scripted"
description = "Answers a question."
'''


def server(config: Path, state: Path, *args: str, env: dict[str, str] | None = None) -> Client:
    """A client of ``python -m proxyvisor mcp`` run by this venv's interpreter (the SDK passes the server only a
    few variables of its own, so the state directory is named)."""
    return Client(StdioServerParameters(
        command=sys.executable, args=["-m", "proxyvisor", "mcp", "--config", str(config), "--state-dir", str(state),
                                      *args], env=env), read_timeout_seconds=60)


async def call(client: Client, tool: str, **arguments: Any) -> tuple[bool, Any, str]:
    """``(is_error, structuredContent, text)`` of one call."""
    result = await client.call_tool(tool, arguments)
    text = "".join(block.text for block in result.content if block.type == "text")
    return bool(result.is_error), result.structured_content, text


def cli_json(*argv: str) -> Any:
    """What ``proxyvisor ARGV --json`` prints, parsed, in a fresh process (as a user runs it)."""
    run = subprocess.run([sys.executable, "-m", "proxyvisor", *argv, "--json"], capture_output=True, text=True,
                         timeout=60, check=True)
    return json.loads(run.stdout)


async def test_every_tool_answers_for_a_scripted_session(start_proxy, tmp_path: Path, state_dir: Path) -> None:
    script = tmp_path / "child.json"
    script.write_text(json.dumps([{"text": "The answer is 42."}]))
    config = tmp_path / "config.toml"
    config.write_text(CONFIG.replace("SCRIPT", str(script)))
    steps = [{"text": f"Looking.\n{REPORT}", "input_tokens": 50, "output_tokens": 5}] * 3
    async with start_proxy(steps) as rp:
        async with http_client(rp.url) as http:
            for session in (SESSION, SESSION, "other-session"):
                assert (await http.post(f"/s/{session}/v1/messages", json=request_body("messages"))).status_code == 200
        # As under `proxyvisor wrap`: the agent, and so the server it starts, has its session in the environment.
        wrapped = {"PROXYVISOR_URL": f"{rp.url}/s/{SESSION}", "PROXYVISOR_SESSION": SESSION}
        async with server(config, state_dir, env=wrapped) as client:
            tools = {t.name: t for t in (await client.list_tools()).tools}
            assert set(tools) == TOOLS
            for tool in tools.values():
                assert tool.description and len(tool.description) > 100, tool.name
                for name, field in tool.input_schema.get("properties", {}).items():
                    assert field.get("description"), f"{tool.name}.{name} has no description"
            assert tools["delegate"].input_schema["required"] == ["role", "prompt"]
            assert tools["routing_config"].input_schema["properties"]["mode"]["anyOf"][0]["enum"] == [
                "explicit", "adaptive", "suggest"]

            error, info, _ = await call(client, "session_info")  # the current session: the wrapped agent's
            assert not error and (info["session"], info["requests"], info["live"]["requests"]) == (SESSION, 2, 2)
            assert info["self_report"]["by_state"] == {"exploring": 2}
            assert info["upstream"]["input_tokens"] == 100
            error, info, _ = await call(client, "session_info", session="other-session")
            assert not error and (info["session"], info["requests"]) == ("other-session", 1)
            error, _, text = await call(client, "session_info", session="nobody")
            assert error and "no session 'nobody'" in text
            error, _, text = await call(client, "session_info", session="../etc")
            assert error and "invalid session id '../etc'" in text and "Traceback" not in text

            error, plan, text = await call(client, "session_plan")
            assert not error and plan["session"] == SESSION and plan["plan"] is None
            assert plan["carry"] == ["config in etc/app.toml"] and json.loads(text) == plan

    # The proxy is gone: info is summed from the ledger, and the plan read from the session's stored state.
    async with server(config, state_dir, env=wrapped) as client:
        error, info, _ = await call(client, "session_info")
        assert not error and (info["session"], info["requests"], info["live"]) == (SESSION, 2, None)
        error, plan, _ = await call(client, "session_plan")
        assert not error and (plan["session"], plan["plan"], plan["carry"]) == (SESSION, None, ["config in etc/app.toml"])
        error, _, text = await call(client, "session_plan", session="nobody")
        assert error and "no supervision state of session nobody is stored" in text
        assert "give its address with 'proxyvisor mcp --url'" in text

    async with server(config, state_dir) as client:  # no wrap: the most recently active session
        error, info, _ = await call(client, "session_info")
        assert not error and info["session"] == "other-session"

        error, shown, _ = await call(client, "routing_config")
        assert not error and shown == cli_json("routing", "show", "--config", str(config), "--state-dir",
                                                str(state_dir))
        assert shown["enabled"] and shown["resolved"]["helper"]["adapter"] == "scripted"

        error, answer, text = await call(client, "delegate", role="helper", prompt="What is the answer?")
        assert not error and (answer["status"], answer["result"]) == ("ok", "The answer is 42.")
        assert answer["evidence"]["gen_ai.agent.id"] == "helper" and json.loads(text) == answer
        error, _, text = await call(client, "delegate", role="nobody", prompt="x")
        assert error and text == "nothing ran: role 'nobody' is not configured (configured: helper)"
        script.write_text(json.dumps([{"fault": {"status": 503, "message": "unavailable"}}] * 3))
        error, answer, text = await call(client, "delegate", role="helper", prompt="And now?")
        assert error and answer["status"] == "failed" and answer["dead_letter"].startswith("dl_")
        assert f"gave up: 3 attempts failed; dead letter {answer['dead_letter']}" in text

        error, health, _ = await call(client, "pool_health")
        assert not error and health["pools"] == cli_json("health", "show", "--state-dir", str(state_dir))["pools"]
        assert [(p["pool"], p["state"]) for p in health["pools"]] == [("scripted:scripted", "healthy")]

        # A policy the descriptors cannot satisfy: refused with the command's reason, the file untouched.
        before = config.read_bytes()
        assert main(["routing", "set", "--config", str(config), "--role", "r", "--role-adapter", "fixture-cli",
                     "--role-model", "gpt-x"]) == 2
        error, _, text = await call(client, "routing_config", action="set", role="r", role_adapter="fixture-cli",
                                    role_model="gpt-x")
        assert error and "adapter 'fixture-cli' does not declare model 'gpt-x'" in text and "nothing written" in text
        assert config.read_bytes() == before
        error, _, text = await call(client, "routing_config", action="set", role_model="claude-haiku-4-5")
        assert error and "role_model given without role" in text and config.read_bytes() == before
        error, _, text = await call(client, "routing_config", action="enable", role="r")
        assert error and "role: fields are for action set, not enable; nothing written" in text
        error, _, text = await call(client, "routing_config", action="set", mode="sometimes")
        assert error and "mode" in text and config.read_bytes() == before

        error, written, _ = await call(client, "routing_config", action="set", role="reviewer",
                                       role_model="claude-haiku-4-5", role_effort="low", max_parallel=3,
                                       role_supervises=["helper"])
        assert not error and written["written"] == str(config)
        assert written["resolved"]["reviewer"]["adapter"] == "claude-code"  # named by the catalog declaring it
        routing = load(str(config)).model_routing
        reviewer = routing.role("reviewer")
        assert (reviewer.adapter, reviewer.model, reviewer.effort, reviewer.supervises) == (
            "claude-code", "claude-haiku-4-5", "low", ("helper",))
        assert routing.max_parallel == 3 and config.read_text().startswith("# the operator's notes")

        error, written, _ = await call(client, "routing_config", action="disable")
        assert not error and written["enabled"] is False and not load(str(config)).model_routing.enabled
        error, _, text = await call(client, "delegate", role="helper", prompt="x")
        assert error and "delegation is disabled; nothing ran" in text

        config.write_text("[model_routing]\nmax_parallel = 0\n")  # broken while the server runs: read per call
        error, _, text = await call(client, "pool_health")
        assert error and "configuration error" in text and "max_parallel" in text and "Traceback" not in text



async def test_pool_health_on_a_store_that_cannot_be_used_is_a_tool_error_naming_it(tmp_path: Path) -> None:
    config, state = tmp_path / "config.toml", tmp_path / "state"
    config.write_text(CONFIG)
    (state / "health").mkdir(parents=True)
    (state / "health" / "cache.db").write_text("garbage\n")
    async with server(config, state) as client:
        error, _, text = await call(client, "pool_health")
    assert error and f"the health store cannot be used: {state / 'health' / 'cache.db'} cannot be read as a " \
        "database" in text and "Traceback" not in text, text


async def test_a_delegation_the_client_cancels_stops_its_child(tmp_path: Path, state_dir: Path) -> None:
    config, runs = tmp_path / "config.toml", tmp_path / "runs.log"
    config.write_text(f'[model_routing]\nenabled = true\nadapters_dir = "{FIXTURE_ADAPTERS}"\n'
                      '[model_routing.roles.worker]\nadapter = "fixture-cli"\n'
                      '[model_routing.children]\nstop_grace_s = 1.0\nidle_cancel_s = 60.0\n')
    async with server(config, state_dir, env={"FIXTURE_LOG": str(runs)}) as client:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(functools.partial(call, client, "delegate", role="worker", prompt="mode:hang"))
            with trio.fail_after(20):
                while not (runs.exists() and runs.read_text().endswith("\n")):
                    await trio.sleep(0.05)
            child = int(runs.read_text().split()[0])
            assert alive(child)
            nursery.cancel_scope.cancel()
        # SIGTERM at once, SIGKILL after the grace; waited for in a thread: the loop sends the cancellation.
        assert not await trio.to_thread.run_sync(alive, child)
        error, health, _ = await call(client, "pool_health")  # the server goes on serving
        assert not error and "pools" in health


def test_the_help_documents_the_tools_the_sources_and_the_current_session() -> None:
    from proxyvisor.cli import build_parser

    text = build_parser()._subparsers._group_actions[0].choices["mcp"].format_help()  # noqa: SLF001
    for name in sorted(TOOLS):
        assert f"\n  {name} " in text
    for words in ("$PROXYVISOR_URL", "$PROXYVISOR_SESSION", "env_vars", "claude mcp add", "exit status:",
                  "session_plan reads the session's stored supervision state"):
        assert words in text


@pytest.mark.real_client
def test_claude_code_lists_the_server_connected(tmp_path: Path) -> None:
    claude = find_agent("claude")
    ws = Workspace.make(tmp_path)
    own = {k: v for k, v in os.environ.items() if not k.startswith(("ANTHROPIC_", "CLAUDE_"))}
    env = own | claude_env(ws) | {"TMPDIR": str(ws.home)}
    add = [claude, "mcp", "add", "proxyvisor", "--", sys.executable, "-m", "proxyvisor", "mcp", "--state-dir",
           str(ws.state)]
    run = subprocess.run(add, cwd=ws.work, env=env, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run
    run = subprocess.run([claude, "mcp", "list"], cwd=ws.work, env=env, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run
    line = next((x for x in run.stdout.splitlines() if x.startswith("proxyvisor: ")), "")
    assert line.endswith("✔ Connected") and f"{sys.executable} -m proxyvisor mcp" in line, run.stdout


@pytest.mark.real_client
def test_claude_code_under_wrap_gets_its_own_session_from_the_tool(tmp_path: Path) -> None:
    """What "current" means, with a real client: Claude Code run by ``proxyvisor wrap`` starts the server, which
    inherits the wrap's ``PROXYVISOR_URL`` and ``PROXYVISOR_SESSION``, and the scripted model's call of
    ``session_info`` without a session answers for that run, from the wrap's own proxy (the server's state directory
    is empty: nothing else could name the session)."""
    claude = find_agent("claude")
    ws = Workspace.make(tmp_path)
    # Claude Code connects MCP servers while its first request is on the way: the model waits (Claude Code's own
    # tool for it, which it sometimes refuses) until a request offers the tool, whose description it recognises.
    steps = [{"tool_calls": [{"name": "WaitForMcpServers", "arguments": {}}], "until": "The /info object of a session"},
             {"tool_calls": [{"name": "mcp__proxyvisor__session_info", "arguments": {}}]}, {"text": "Done."}]
    script, config, servers = tmp_path / "script.json", tmp_path / "config.toml", tmp_path / "mcp.json"
    script.write_text(json.dumps(steps))
    config.write_text(f'[upstreams.scripted]\nscript = "{script}"\n')
    servers.write_text(json.dumps({"mcpServers": {"proxyvisor": {"command": sys.executable, "args": [
        "-m", "proxyvisor", "mcp", "--state-dir", str(tmp_path / "empty-state")]}}}))
    cmd = [claude, "-p", "What does proxyvisor say about this session?", "--model", MODEL, "--mcp-config",
           str(servers), "--allowedTools", "mcp__proxyvisor__session_info", "--output-format", "stream-json",
           "--verbose"]
    run = wrap(ws, cmd, claude_env(ws), "--config", str(config), "--session", "claude-mcp", "--quiet")
    assert run.returncode == 0, run
    blocks = [b for e in json_lines(run.stdout) if e.get("type") in ("assistant", "user")
              for b in e["message"]["content"]]
    calls = [b["id"] for b in blocks if b["type"] == "tool_use" and b["name"] == "mcp__proxyvisor__session_info"]
    results = [b for b in blocks if b["type"] == "tool_result" and b["tool_use_id"] in calls]
    assert len(calls) == len(results) == 1 and not results[0].get("is_error"), blocks
    content = results[0]["content"]
    text = content if isinstance(content, str) else "".join(c.get("text", "") for c in content)
    info = json.loads(text)
    assert info["session"] == "claude-mcp" and info["requests"] >= 1 and info["live"] is not None, info
