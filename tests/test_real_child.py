"""A real child runtime: Claude Code headless runs delegated work under the ``claude-code`` adapter.

The agent (an Anthropic Messages client) asks the proxy; the parent model (the proxy's scripted upstream) calls the
``coder`` delegation tool; proxyvisor runs ``claude -p --output-format stream-json`` as the child, pointed at a
second scripted upstream in auto mode (it calls the child's own shell tool with ``ls``, then answers
:data:`DONE`); the child's answer goes back to the parent model, whose continued answer is all the agent sees. The
CLI comes from ``.ci/install-agents``; a missing CLI skips the test on a developer machine and fails it in CI, as
in ``test_real_clients.py``.
"""

from __future__ import annotations

from pathlib import Path

import msgspec
import orjson
import pytest

from proxyvisor.scripted.upstream import ScriptedUpstream
from proxyvisor.config import UpstreamConfig, parse
from proxyvisor.proxy.service import running
from proxyvisor.store import Store

from helpers import ask
from test_real_clients import DONE, MARKER, find_agent

pytestmark = pytest.mark.real_client

TRACE = "5bf92f3577b34da6a3ce929d0e0e4736"
CALL = {"text": "I will have the coder look.",
        "tool_calls": [{"name": "coder", "arguments": {"prompt": "List the files in the current directory."},
                        "id": "toolu_coder_1"}]}
FINAL = {"text": "The coder listed the folder."}


async def test_claude_code_runs_as_a_child_and_its_evidence_comes_back(tmp_path: Path, scripted_server) -> None:
    work, home, tmp = tmp_path / "work", tmp_path / "claude-home", tmp_path / "tmp"
    for folder in (work, home, tmp):
        folder.mkdir()
    (work / MARKER).write_text("hello\n")
    # TMPDIR: Claude Code keeps scratch files in a claude-UID folder there, and leaves them.
    env = [f"ANTHROPIC_BASE_URL={scripted_server.url}", "ANTHROPIC_API_KEY=dummy", f"CLAUDE_CONFIG_DIR={home}",
           f"TMPDIR={tmp}",
           "DISABLE_TELEMETRY=1", "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1", "DISABLE_AUTOUPDATER=1"]
    config = parse({"model_routing": {
        "enabled": True,
        "roles": {"coder": {"adapter": "claude-code", "model": "claude-haiku-4-5", "description": "Writes code."}},
        "adapter_options": {"claude-code": {"bin": find_agent("claude"), "env": env, "cwd": str(work)}}}})
    config = msgspec.structs.replace(config, upstreams=(UpstreamConfig(name="scripted"),))
    parent = ScriptedUpstream([CALL, FINAL])
    store = Store(tmp_path / "state")
    async with running(config, port=0, store=store, scripted={"scripted": parent}) as rp:
        answer = await ask("messages", rp.url, stream=True,
                           headers={"traceparent": f"00-{TRACE}-00f067aa0ba902b7-01"})
    assert answer.tool_calls == () and answer.text == CALL["text"] + FINAL["text"]
    # The child really ran: Claude Code sent its own requests (a shell call, then its answer) upstream.
    child_requests = [orjson.loads(body) for _, body, _ in scripted_server.script.requests]
    assert len(child_requests) >= 2 and {r["model"] for r in child_requests} == {"claude-haiku-4-5"}
    assert MARKER in orjson.dumps(child_requests[-1]["messages"][-1]).decode(), "the ls output came back to it"
    # Its answer went back to the parent model as the delegation's result.
    continued = orjson.loads(parent.requests[1][1])
    result = continued["messages"][-1]["content"][0]
    assert (result["type"], result["tool_use_id"], result["content"]) == ("tool_result", "toolu_coder_1", DONE)
    # And its evidence is in the parent request's ledger line, in the agent's trace.
    (record,) = [r for s in store.sessions() for r in store.read_ledger(s)]
    (evidence,) = record["delegations"]
    assert {k: evidence[k] for k in ("status", "gen_ai.provider.name", "gen_ai.agent.id", "gen_ai.request.model",
                                     "capacity_scope", "health_state", "error_category", "finish_reason",
                                     "trace_id")} == {
        "status": "ok", "gen_ai.provider.name": "claude-code", "gen_ai.agent.id": "coder",
        "gen_ai.request.model": "claude-haiku-4-5", "capacity_scope": "claude-code:haiku-4-5",
        "health_state": "healthy", "error_category": None, "finish_reason": "stop", "trace_id": TRACE}
    assert evidence["gen_ai.conversation.id"], "Claude Code's own session id, from its init event"
