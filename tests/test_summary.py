"""What proxyvisor says about a session: ``wrap``'s exit summary (supervised, /info only, and with supervision
off, which writes nothing), answers proxyvisor makes itself reporting zero usage, the scripted model never priced,
and the proxy overhead leaving out every supervisor model call."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import orjson
import pytest
import trio

from proxyvisor.adapters.failures import Failure
from proxyvisor.adapters.health import Cooldown
from proxyvisor.adapters.health_store import HealthStore
from proxyvisor.adapters.state import DiskKV
from proxyvisor.scripted.upstream import ScriptedUpstream
from proxyvisor.config import Config, CondenseConfig, GateConfig, ModelConfig
from proxyvisor.gate.verdict import VERIFIER_INSTRUCTIONS
from proxyvisor.proxy.formats import BY_NAME, ToolSpec
from proxyvisor.proxy.service import running
from proxyvisor.store import Store
from proxyvisor.supervisor_model import SCRIPTED_KEY, ModelAnswer, configured_model, litellm_model

from helpers import FORMATS, MODEL, http_client, request_body, sse_events

CHILD = r'''
import json, os, sys, urllib.error, urllib.request

base = os.environ["OPENAI_BASE_URL"]


def post(body, raw=None):
    data = raw if raw is not None else json.dumps(body).encode()
    request = urllib.request.Request(base + "/chat/completions", data, {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request) as reply:
            return reply.read()
    except urllib.error.HTTPError as exc:
        return exc.read()


tools = [{"type": "function", "function": {"name": "Bash", "parameters": {"type": "object"}}}]
history = [{"role": "system", "content": "You poll a build."}, {"role": "user", "content": "Wait for the build."}]
for step in sys.argv[1:]:
    if step == "info":
        post({"model": "claude-sonnet-4-5", "messages": [{"role": "user", "content": "/info"}]})
    elif step == "bad":
        post(None, raw=b"{not json")
    else:
        post({"model": "claude-sonnet-4-5", "messages": history, "tools": tools})
        n = len(history)
        history += [{"role": "assistant", "content": None, "tool_calls": [{"id": f"c{n}", "type": "function",
                     "function": {"name": "Bash", "arguments": "{\"command\": \"cat status\"}"}}]},
                    {"role": "tool", "tool_call_id": f"c{n}", "content": "building: 3 of 7"}]
'''


def wrap(tmp_path: Path, *steps: str, supervision: bool = True, session: str | None = None,
         config: str | None = None) -> tuple[str, Path]:
    """``proxyvisor wrap`` of the child above doing ``steps`` (HOME and the XDG folders are under ``tmp_path``:
    conftest), with the configuration file text ``config`` if given; returns its stderr and the state directory."""
    child = tmp_path / "child.py"
    child.write_text(CHILD)
    state = tmp_path / "state"
    flags = ([] if supervision else ["--no-supervision"]) + (["--session", session] if session else [])
    if config is not None:
        (tmp_path / "config.toml").write_text(config)
        flags += ["--config", str(tmp_path / "config.toml")]
    done = subprocess.run([sys.executable, "-m", "proxyvisor", "wrap", "--state-dir", str(state), *flags, "--",
                           sys.executable, str(child), *steps], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stderr, state


def summary_lines(stderr: str) -> list[str]:
    """The exit summary: the lines from the one naming the session on."""
    lines = stderr.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("proxyvisor: session "))
    return lines[start:]


def test_wraps_summary_shows_what_supervision_did(tmp_path: Path) -> None:
    stderr, state = wrap(tmp_path, "poll", "poll", "poll", "poll", "info")
    head, reports, gate, memory, overhead = summary_lines(stderr)
    assert "4 model requests (chat), 0 errors, 3 tool rounds" in head
    # The scripted model answered: its tokens are counted and never priced under the client's model name.
    assert "4 answers of the built-in scripted model, not priced" in head and "$" not in head
    assert head.endswith("; 1 question answered by proxyvisor itself (/info 1)")
    assert "detector fires loop 1" in reports and "steer notes loop 1" in reports
    # The three answers after a tool round end the turn: each is judged by the scripted verifier.
    (session,) = Store(state).sessions()
    (outcome,) = {line["gate"]["outcome"] for line in Store(state).read_ledger(session) if "gate" in line}
    assert f"verify-gate 3 runs, outcomes {outcome} 3" in gate
    assert "supervisor model 3 calls (verify 3) · " in gate and "condensed 0 results, saved 0 tokens" in gate
    # Learning (on by default; the project is wrap's folder): each judged turn end distils, the first stores the
    # task's experience, and each asks the supervisor route (the scripted one answers nothing more).
    assert memory.startswith("proxyvisor:   memory 1 record (0 archived) for /"), memory
    assert memory.endswith(" · recalled 0 items, 0 tokens · distills 3 (calls 3, pre-screened out 0) · stored 1 · "
                           "credit +0 / -0"), memory
    assert overhead.startswith("proxyvisor:   proxy overhead ") and "supervisor model time left out" in overhead


def test_a_reused_session_summarizes_this_run_and_names_the_sessions_total(tmp_path: Path) -> None:
    first, _ = wrap(tmp_path, "poll", "poll", session="again")
    assert summary_lines(first)[0].startswith("proxyvisor: session again: 2 model requests (chat)"), first
    second, _ = wrap(tmp_path, "info", session="again")
    assert summary_lines(second) == ["proxyvisor: session again, this run (2 model requests in the session in all): "
                                     "no model requests; 1 question answered by proxyvisor itself (/info 1)"]
    third, _ = wrap(tmp_path, "poll", session="again")
    assert summary_lines(third)[0].startswith("proxyvisor: session again, this run (3 model requests in the "
                                              "session in all): 1 model request (chat), 0 errors, 0 tool rounds")


def test_a_session_that_only_asked_info_says_so(tmp_path: Path) -> None:
    stderr, _ = wrap(tmp_path, "info", "info")
    assert summary_lines(stderr)[-1].endswith(": no model requests; 2 questions answered by proxyvisor itself "
                                              "(/info 2)")


def test_wraps_summary_names_an_upstream_pool_that_failed_and_then_refused(tmp_path: Path) -> None:
    # Nothing listens on port 1: the first request fails and cools the pool, the next is refused without a call.
    stderr, _ = wrap(tmp_path, "poll", "poll", config='[upstreams.down]\nurl = "http://127.0.0.1:1"\n'
                                                     'formats = ["chat"]\n')
    (pools,) = [line for line in summary_lines(stderr) if line.startswith("proxyvisor:   upstream pools ")]
    assert pools.endswith(" upstream:down:claude-sonnet-4-5: answered 0 · refused 1 · failed 1"), stderr
    assert not any("tool authorizer" in line for line in summary_lines(stderr))  # it saw no tool-call batch


def test_wrap_says_once_which_pool_holds_the_agents_requests_and_until_when(tmp_path: Path) -> None:
    """A 429 another proxy saw on the same state directory cools the pool for this wrap too: the agent's requests
    get proxyvisor's 429, and wrap says so on one line (not one per request), with the command that resets it."""
    pool = "upstream:scripted:claude-sonnet-4-5"
    store = HealthStore(DiskKV(tmp_path / "state" / "health"), Cooldown())
    until = store.settle_sync(pool, time.time(), Failure("capacity", True, "known_failed", 600)).cooldown_until
    store.close()
    stderr, _ = wrap(tmp_path, "poll", "poll", "poll")
    told = [line for line in stderr.splitlines() if "is cooling down until" in line]
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(until))
    assert len(told) == 1 and told[0].startswith(f"proxyvisor: upstream pool {pool} is cooling down until {when} ("), \
        stderr
    assert told[0].endswith(f" s from now): the agent's requests for it get a 429 and are not sent; `proxyvisor "
                            f"health clear {pool}` resets it")
    (pools,) = [line for line in summary_lines(stderr) if line.startswith("proxyvisor:   upstream pools ")]
    assert pools.endswith(f" {pool}: answered 0 · refused 3 · failed 0"), stderr
    # Each request got proxyvisor's 429: none is an answer of the scripted model.
    head = summary_lines(stderr)[0]
    assert ", 3 errors," in head and "scripted model" not in head, stderr


def test_without_supervision_wrap_counts_requests_errors_and_overhead_and_writes_nothing(tmp_path: Path) -> None:
    stderr, state = wrap(tmp_path, "poll", "bad", supervision=False)
    (line,) = summary_lines(stderr)
    assert ": 2 model requests (chat), 1 error; proxy overhead " in line
    assert "supervision off: nothing read or written" in line
    assert not state.exists()
    # No ledger, no state file, anywhere: not in the state directory, HOME or the XDG folders.
    assert [p.name for p in tmp_path.rglob("*") if not p.is_dir()] == ["child.py"]


# ---- answers proxyvisor makes itself ---------------------------------------------------------------------------

def usages(value: Any) -> list[dict[str, Any]]:
    """Every ``usage`` object anywhere in ``value`` (a parsed response or event)."""
    found: list[dict[str, Any]] = []
    if isinstance(value, dict):
        for key, item in value.items():
            if key == "usage" and isinstance(item, dict):
                found.append(item)
            found += usages(item)
    elif isinstance(value, list):
        for item in value:
            found += usages(item)
    return found


def numbers(value: Any) -> list[float]:
    if isinstance(value, bool):
        return []
    if isinstance(value, (int, float)):
        return [value]
    if isinstance(value, dict):
        return [n for item in value.values() for n in numbers(item)]
    return []


@pytest.mark.parametrize("command", ["/info", "/plan"])
@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("fmt", FORMATS)
async def test_a_local_answer_reports_zero_usage(tmp_path: Path, fmt: str, stream: bool, command: str) -> None:
    f = BY_NAME[fmt]
    body = f.request_from_chat([{"role": "user", "content": command}], MODEL, stream)
    if fmt == "chat" and stream:
        body["stream_options"] = {"include_usage": True}
    async with running(Config(), port=0, store=Store(tmp_path / "state")) as rp, http_client(rp.url) as client:
        reply = await client.post(f"/s/local{f.path}", json=body)
    assert reply.status_code == 200
    objects = [orjson.loads(e.data) for e in sse_events(reply.content) if e.data.startswith("{")] if stream \
        else [reply.json()]
    found = usages(objects)
    assert found, "the answer carries usage"
    assert all(n == 0 for usage in found for n in numbers(usage)), found
    text = f.assemble([(e.event, e.data) for e in sse_events(reply.content)]).text if stream \
        else f.parse_response(reply.json()).text
    assert ("proxyvisor /info" in text) if command == "/info" else ("plan" in text.lower())


async def test_the_scripted_model_as_the_litellm_route_is_never_priced(scripted_server) -> None:
    """``api_base = "scripted:"`` with a model name litellm prices: the scripted answer is not priced (the
    same endpoint reached as that model is priced)."""
    messages = [{"role": "system", "content": "You answer."}, {"role": "user", "content": "hi"}]
    named = ModelConfig(name="openai/gpt-4o-mini", api_base="scripted:")
    scripted = await configured_model(named, scripted_server.url)(messages)
    assert (scripted.input_tokens, scripted.output_tokens, scripted.cost_usd) == (0, 0, None)  # not priced
    as_real = ModelConfig(name="openai/gpt-4o-mini", api_base=scripted_server.url + "/v1")
    scripted_server.script.queue({"text": "hello", "input_tokens": 1000, "output_tokens": 100})
    priced = (await litellm_model(as_real, api_key=SCRIPTED_KEY)(messages)).cost_usd
    assert priced is not None and priced > 0


# ---- proxy overhead ------------------------------------------------------------------------------------------

DELAY_S = 0.5
BIG = "\n".join(f"[{i:05d}] compiling unit_{i}.c -> unit_{i}.o ({i * 7 % 1000} ms)" for i in range(1500)) + "\n"


class SlowModel:
    """A supervisor model double that takes :data:`DELAY_S` per call: a passing verdict for the verifier, an
    extract of lines 1-3 of every result for the condenser."""

    def __init__(self) -> None:
        self.purposes: list[str] = []

    async def __call__(self, messages: list[dict[str, str]]) -> ModelAnswer:
        await trio.sleep(DELAY_S)
        if messages[0]["content"] == VERIFIER_INSTRUCTIONS:
            self.purposes.append("verify")
            requirement = {"id": 1, "requirement": "list the files", "status": "matched", "basis": None,
                           "evidence": "the answer"}
            return ModelAnswer(json.dumps({"requirements": [requirement], "gaps": [], "handback": None,
                                           "verdict": "pass"}))
        self.purposes.append("condense")
        payload = json.loads(messages[1]["content"])
        return ModelAnswer(json.dumps({"results": [{"id": r["id"], "verdict": "extract", "lines": ["1-3"]}
                                                   for r in payload["results"]]}))


def condensed_request(fmt: str, stream: bool) -> dict[str, Any]:
    messages = [{"role": "system", "content": "You build things."}, {"role": "user", "content": "Build it."},
                {"role": "assistant", "content": "Building.", "tool_calls": [
                    {"id": "call_a", "type": "function", "function": {"name": "bash",
                                                                      "arguments": '{"command": "make"}'}}]},
                {"role": "tool", "tool_call_id": "call_a", "content": BIG}]
    bash = ToolSpec("bash", {"type": "object", "properties": {"command": {"type": "string"}}})
    return BY_NAME[fmt].request_from_chat(messages, MODEL, stream, (bash,))


@pytest.mark.parametrize("purpose", ["condense", "verify"])
@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_the_overhead_leaves_out_every_supervisor_model_call(tmp_path: Path, purpose: str,
                                                                    stream: bool) -> None:
    """A condenser call before the request and a verifier call on its answer take :data:`DELAY_S` each: neither
    is proxy overhead, and the ledger has their time as the supervisor model's."""
    config = Config().with_overrides(supervisor={
        "gate": GateConfig(enabled=purpose == "verify", hold="answer"),
        "condense": CondenseConfig(enabled=purpose == "condense", deterministic_kinds=())})  # make asks the model
    body = condensed_request("chat", stream) if purpose == "condense" else request_body("chat", stream)
    model, store = SlowModel(), Store(tmp_path / "state")
    async with running(config, port=0, store=store, scripted={"scripted": ScriptedUpstream([{"text": "Done."}])},
                       model=model) as rp, http_client(rp.url) as client:
        reply = await client.post("/s/timed/v1/chat/completions", json=body)
    assert reply.status_code == 200 and model.purposes == [purpose]
    (line,) = store.read_ledger("timed")
    assert line["supervisor_model"]["time_ms"] >= DELAY_S * 1000
    # The request took the call's time and more; the overhead is what is left without it (and the upstream's).
    assert line["overhead_ms"] <= line["latency_ms"] - DELAY_S * 1000
    assert float(reply.headers["x-proxyvisor-overhead-ms"]) == line["overhead_ms"]
