"""The supervisor model on the session's own route (``proxyvisor.proxy.session_model``), with no ``[supervisor.model]``.

The upstream here is a :class:`Recording` scripted upstream: it answers as the embedded one does (the agent's turns
from the script, the verifier's calls with the scripted policy) and keeps every request it got, headers included,
so a test can see where the verifier's call went, how, and with which credentials.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import orjson
import trio
import pytest

from proxyvisor.scripted.upstream import ScriptedUpstream, policy
from proxyvisor.config import Config, GateConfig, ModelConfig, UpstreamConfig
from proxyvisor.gate.verdict import VERIFIER_INSTRUCTIONS
from proxyvisor.proxy.formats import BY_NAME, BY_PATH, ToolSpec
from proxyvisor.proxy.server import Request, Response
from proxyvisor.proxy.service import running
from proxyvisor.store import Store
from proxyvisor.supervisor_model import describe, route_of, schema_of

from helpers import http_client, serve_handler, sse_events

FORMATS = ("chat", "messages", "responses")
MODES = [(f, s) for f in FORMATS for s in (False, True)]
IDS = [f"{f}-{'sse' if s else 'json'}" for f, s in MODES]
AGENT_MODEL = "agent-model-7"
CLIENT_KEY = "sk-client-canary-0123456789abcdef"
DONE = "Fixed add() in app.py; the tests pass."
BASH = ToolSpec("Bash", {"type": "object", "properties": {"command": {"type": "string"}}}, "Run a command")


class Recording(ScriptedUpstream):
    """A scripted upstream that keeps every model request as (path, headers, body, response body); supervisor calls
    (recognised as the scripted upstream recognises them) answer ``refuse`` (a status) when it is set."""

    def __init__(self, steps: list[dict[str, Any]] | None = None, refuse: int | None = None,
                 refuse_if: str | None = None) -> None:
        super().__init__(steps)
        self.seen: list[tuple[str, dict[str, str], dict[str, Any], bytes]] = []
        self.refuse = refuse
        self.refuse_if = refuse_if
        """Refuse only the supervisor calls whose body holds this text (400 for an unsupported field)."""

    async def __call__(self, request: Request) -> Response:
        fmt = BY_PATH.get(request.path)
        body = orjson.loads(request.body) if fmt is not None else {}
        headers = {k.decode(): v.decode("latin-1") for k, v in request.headers}
        if fmt is not None and policy(fmt, body) is not None and self.refuse is not None \
                and (self.refuse_if is None or self.refuse_if.encode() in request.body):
            quoted = "; ".join(f"{k}={v}" for k, v in headers.items())
            message = (f"Unsupported parameter: {self.refuse_if}" if self.refuse_if else
                       f"This credential is only authorized for the agent itself. You sent: {quoted}")
            response = Response(self.refuse, [(b"content-type", b"application/json")],
                                fmt.error_body(self.refuse, message))
        else:
            response = await super().__call__(request)
        if fmt is not None:
            data = response.body if isinstance(response.body, bytes) else b""
            self.seen.append((request.path, headers, body, data))
        return response

    def supervisor_calls(self) -> list[tuple[str, dict[str, str], dict[str, Any], bytes]]:
        return [s for s in self.seen if policy(BY_PATH[s[0]], s[2]) is not None]


@asynccontextmanager
async def proxied(tmp_path: Path, upstream: Recording, model: ModelConfig | None = None,
                  formats: tuple[str, ...] = FORMATS, upstream_model: str = "") -> AsyncIterator[Any]:
    """A proxy over ``upstream`` (served on its own port, so its route is a real HTTP relay)."""
    async with serve_handler(upstream) as url:
        config = Config(upstreams=(UpstreamConfig(name="up", url=url, formats=formats, model=upstream_model),))
        if model is not None:
            config = config.with_overrides(supervisor={"model": model})
        store = Store(tmp_path / "state")
        async with running(config, port=0, store=store) as proxy:
            proxy.store = store
            yield proxy


def edited_and_checked(fmt: str, stream: bool) -> dict[str, Any]:
    """An agent request whose turn edited app.py and ran a passing check."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are a coding agent."},
                                      {"role": "user", "content": "Fix the bug in app.py."}]
    for call_id, command, result in (("c1", "sed -i 's/a - b/a + b/' app.py", ""), ("c2", "pytest -q", "3 passed")):
        messages.append({"role": "assistant", "content": None, "tool_calls": [
            {"id": call_id, "type": "function",
             "function": {"name": "Bash", "arguments": orjson.dumps({"command": command}).decode()}}]})
        messages.append({"role": "tool", "tool_call_id": call_id, "content": result})
    return BY_NAME[fmt].request_from_chat(messages, AGENT_MODEL, stream, (BASH,))


def credentials(fmt: str) -> dict[str, str]:
    return {"x-api-key": CLIENT_KEY} if fmt == "messages" else {"authorization": f"Bearer {CLIENT_KEY}"}


async def send(proxy: Any, fmt: str, body: dict[str, Any], session: str = "route-test") -> str:
    """One agent request with the client's credentials; the answer's text."""
    async with http_client() as client:
        response = await client.post(proxy.url + BY_NAME[fmt].path, content=orjson.dumps(body), headers={
            "content-type": "application/json", "x-proxyvisor-session": session, **credentials(fmt)})
    assert response.status_code == 200, response.text
    w = BY_NAME[fmt]
    if body.get("stream"):
        return w.assemble([(e.event, e.data) for e in sse_events(response.content)]).text.rstrip("\n")
    return w.parse_response(response.json()).text.rstrip("\n")


def gates(proxy: Any, session: str = "route-test") -> list[dict[str, Any]]:
    return [line["gate"] for line in proxy.store.read_ledger(session) if "gate" in line]


# ---- the session's route --------------------------------------------------------------------------------------
@pytest.mark.parametrize(("fmt", "stream"), MODES, ids=IDS)
async def test_the_verifier_call_goes_the_way_the_agents_request_went(tmp_path: Path, fmt: str, stream: bool) -> None:
    upstream = Recording([{"text": DONE}])
    async with proxied(tmp_path, upstream) as proxy:
        assert await send(proxy, fmt, edited_and_checked(fmt, stream)) == DONE
    ((path, headers, body, answer),) = upstream.supervisor_calls()
    assert path == BY_NAME[fmt].path and body["model"] == AGENT_MODEL and body["stream"] is False
    key = "x-api-key" if fmt == "messages" else "authorization"
    assert CLIENT_KEY in headers[key]  # the agent's own credentials, as the relay forwards them
    assert BY_NAME[fmt].fingerprint_parts(body)[0] == VERIFIER_INSTRUCTIONS
    assert body["temperature"] == 0.0
    limit = {"chat": "max_tokens", "messages": "max_tokens", "responses": "max_output_tokens"}[fmt]
    assert body[limit] == ModelConfig().max_tokens
    name, schema = schema_of([{"role": "system", "content": VERIFIER_INSTRUCTIONS}])  # type: ignore[misc]
    if fmt == "chat":
        assert body["response_format"]["json_schema"] == {"name": name, "schema": schema, "strict": False}
    elif fmt == "responses":
        assert body["text"]["format"] == {"type": "json_schema", "name": name, "schema": schema, "strict": False}
    else:  # a forced tool, answered with that tool's call, whose input is the verdict
        assert body["tool_choice"] == {"type": "tool", "name": name}
        assert body["tools"][0]["input_schema"] == schema
        blocks = orjson.loads(answer)["content"]
        assert [b["type"] for b in blocks] == ["tool_use"] and blocks[0]["input"]["verdict"] == "pass"
    (gate,) = gates(proxy)
    assert (gate["verdicts"], gate["outcome"], gate["route"], gate["model"]) == (["pass"], "verified", "session",
                                                                                 AGENT_MODEL)
    line = proxy.store.read_ledger("route-test")[-1]
    assert line["supervisor_model"]["calls"] == {"verify": 1} and line["supervisor_model"]["input_tokens"] > 0
    assert line["supervisor_model"]["cost_usd"] == 0.0  # a model litellm's cost map does not know


async def test_a_premature_done_is_held_and_reworked_on_the_sessions_route(tmp_path: Path) -> None:
    """The check passed, so the free evidence leaves the turn to the model, and the scripted policy's marker makes
    it a gap: the gate continues the turn, and the reworked answer (the check run) goes on in the message the agent
    is reading (``hold = "stop"``, the default: its two text blocks read back joined); the verifier call took the
    agent's route."""
    body = orjson.loads(orjson.dumps(edited_and_checked("messages", True)).replace(
        b"Fix the bug in app.py.", b"Fix the bug in app.py. VERIFY-NEVER-PASSES"))
    rework = {"text": "Running the tests.", "tool_calls": [{"name": "Bash", "arguments": {"command": "pytest -q"}}]}
    upstream = Recording([{"text": "Done."}, rework])
    async with proxied(tmp_path, upstream) as proxy:
        assert await send(proxy, "messages", body) == "Done.Running the tests."
    (gate,) = gates(proxy)
    assert gate["reentries"] == 1 and gate["verdicts"] == ["gaps"] and gate["route"] == "session"
    assert gate["decided_by"] == ["model"]
    assert {p for p, *_ in upstream.supervisor_calls()} == {"/v1/messages"}


async def test_a_model_name_alone_picks_another_model_on_the_same_route(tmp_path: Path) -> None:
    upstream = Recording([{"text": DONE}])
    async with proxied(tmp_path, upstream, ModelConfig(name="claude-haiku-4-5", max_tokens=333)) as proxy:
        await send(proxy, "messages", edited_and_checked("messages", False))
    ((path, headers, body, _),) = upstream.supervisor_calls()
    assert (path, body["model"], body["max_tokens"]) == ("/v1/messages", "claude-haiku-4-5", 333)
    assert headers["x-api-key"] == CLIENT_KEY
    assert [b["model"] for p, _h, b, _a in upstream.seen if (p, _h, b, _a) not in upstream.supervisor_calls()] \
        == [AGENT_MODEL]  # the agent's own request keeps its model
    assert (gates(proxy)[0]["route"], gates(proxy)[0]["model"]) == ("session", "claude-haiku-4-5")
    use = proxy.store.read_ledger("route-test")[-1]["supervisor_model"]
    assert use["cost_usd"] > 0 and use["input_tokens"] > 0  # a model litellm's cost map prices


async def test_the_translator_path_takes_the_verifier_call_through_the_same_translation(tmp_path: Path) -> None:
    """An Anthropic client on a chat-only upstream: the verifier call is made in the client's format and translated
    like the request, so it reaches the chat endpoint (naming the upstream's configured model, as the translation
    of the agent's request does)."""
    upstream = Recording([{"text": DONE}])
    async with proxied(tmp_path, upstream, formats=("chat",), upstream_model="upstream-model-9") as proxy:
        assert await send(proxy, "messages", edited_and_checked("messages", False)) == DONE
    ((path, headers, body, _),) = upstream.supervisor_calls()
    assert path == "/v1/chat/completions" and CLIENT_KEY in headers["authorization"]
    assert [b["model"] for _p, _h, b, _a in upstream.seen] == ["upstream-model-9"] * 2
    (gate,) = gates(proxy)
    assert (gate["outcome"], gate["route"], gate["model"]) == ("verified", "session", "upstream-model-9")


async def test_the_litellm_route_still_serves_an_explicit_endpoint(tmp_path: Path) -> None:
    """``api_base`` picks the litellm route: the scripted upstream's chat endpoint, asked by response_format,
    without the agent's credentials."""
    model = ModelConfig(name="scripted-model", api_base="scripted:")
    assert route_of(model) == "litellm" and describe(model).startswith("litellm: scripted-model")
    upstream = ScriptedUpstream([{"text": DONE}])
    config = Config().with_overrides(supervisor={"model": model})
    store = Store(tmp_path / "state")
    async with running(config, port=0, store=store, scripted={"scripted": upstream}) as proxy:
        proxy.store = store
        assert await send(proxy, "messages", edited_and_checked("messages", False)) == DONE
    (call,) = [orjson.loads(b) for b in upstream.supervisor_requests]
    assert call["model"] == "scripted-model" and call["response_format"]["type"] == "json_schema"
    (gate,) = gates(proxy)
    assert (gate["outcome"], gate["route"], gate["model"]) == ("verified", "litellm", "scripted-model")


def test_serve_and_wrap_say_which_route_and_model_judge() -> None:
    assert describe(ModelConfig()) == "the session's own (each request's upstream and model)"
    assert describe(ModelConfig(name="claude-haiku-4-5")) == "claude-haiku-4-5 on the session's route"
    assert describe(ModelConfig(name="openai/gpt-4.1-mini", api_key_env="K")) == "litellm: openai/gpt-4.1-mini"


# ---- a route that refuses ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("status", [401, 403, 400])
async def test_a_refused_verifier_call_labels_the_turn_unverified_delivers_the_answer_and_warns_once(
        tmp_path: Path, status: int, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    upstream = Recording([{"text": DONE}, {"text": DONE}], refuse=status)
    async with proxied(tmp_path, upstream) as proxy:
        for fmt in ("messages", "chat"):
            # Delivered, with the unverified notice (fail_closed, the default) as its last line.
            text = await send(proxy, fmt, edited_and_checked(fmt, fmt == "chat"), session=f"s-{fmt}")
            assert text.removesuffix(GateConfig().unverified_notice).rstrip() == DONE != text
        assert proxy.pipeline.routes.warned == {("up", status)}
    for fmt in ("messages", "chat"):
        (gate,) = gates(proxy, f"s-{fmt}")
        assert (gate["verdicts"], gate["outcome"], gate["passed"]) == (["unavailable"], "unverified", False)
        assert f"refused the supervisor call ({status})" in gate["reason"] and "[redacted]" in gate["reason"]
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING and "supervisor call" in r.getMessage()]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    written = b"".join(p.read_bytes() for p in (tmp_path / "state").rglob("*") if p.is_file())  # health: sqlite
    assert CLIENT_KEY not in caplog.text and CLIENT_KEY.encode() not in written


async def test_an_upstream_that_refuses_the_extras_gets_the_plain_request_from_then_on(tmp_path: Path) -> None:
    upstream = Recording([{"text": DONE}, {"text": DONE}], refuse=400, refuse_if='"temperature"')
    async with proxied(tmp_path, upstream) as proxy:
        for session in ("a", "b"):
            assert await send(proxy, "chat", edited_and_checked("chat", False), session=session) == DONE
    calls = [b for _p, _h, b, _a in upstream.supervisor_calls()]
    assert ["temperature" in b for b in calls] == [True, False, False]
    assert all("response_format" not in b for b in calls[1:])
    assert [g["outcome"] for s in ("a", "b") for g in gates(proxy, s)] == ["verified", "verified"]


def test_the_verifier_refuter_and_planner_calls_name_their_schemas_and_the_condenser_none() -> None:
    from proxyvisor.condense.protocol import SYSTEM_PROMPT
    from proxyvisor.gate.plan import DECISION_SCHEMA, PLANNER_INSTRUCTIONS
    from proxyvisor.gate.verdict import REFUTATION_SCHEMA, REFUTER_INSTRUCTIONS, VERDICT_SCHEMA

    def ask(system: str) -> Any:
        return schema_of([{"role": "system", "content": system}, {"role": "user", "content": "x"}])

    assert ask(VERIFIER_INSTRUCTIONS) == ("verdict", VERDICT_SCHEMA)
    assert ask(REFUTER_INSTRUCTIONS) == ("refutation", REFUTATION_SCHEMA)
    assert ask(PLANNER_INSTRUCTIONS) == ("plan_decision", DECISION_SCHEMA)
    assert ask(SYSTEM_PROMPT) is None and schema_of([{"role": "user", "content": VERIFIER_INSTRUCTIONS}]) is None


async def test_serve_names_the_supervisor_route_and_warns_once_when_it_refuses(tmp_path: Path) -> None:
    """The real command: its start line names the route and model; a route refusing every verifier call costs one
    warning in its log however many turns it refuses, and the agent gets every answer."""
    from test_reliability_crash import start_serve

    upstream = Recording([{"text": DONE}] * 3, refuse=401)
    async with serve_handler(upstream) as url:
        config = tmp_path / "config.toml"
        config.write_text(f'[state]\ndir = "{tmp_path / "state"}"\n[upstreams.up]\nurl = "{url}"\n'
                          '[supervisor.model]\nname = "claude-haiku-4-5"\n')
        log = tmp_path / "serve.log"
        proc, proxy_url = await trio.to_thread.run_sync(start_serve, config, log)
        try:
            async with http_client() as client:
                for n in range(3):
                    response = await client.post(proxy_url + "/v1/messages", headers={
                        "content-type": "application/json", "x-proxyvisor-session": f"s{n}", **credentials("messages")},
                        content=orjson.dumps(edited_and_checked("messages", False)))
                    text = response.json()["content"][-1]["text"]  # the answer, with the unverified notice after it
                    assert response.status_code == 200 and text.startswith(DONE + "\n\n[proxyvisor] ")
        finally:
            proc.terminate()
            await trio.to_thread.run_sync(proc.wait, 10)
    text = log.read_text()
    assert "verify-gate on (fail_closed); supervisor model: claude-haiku-4-5 on the session's route" in text, text
    assert len(upstream.supervisor_calls()) == 3 and text.count("refused the supervisor call (401)") == 1, text
    assert CLIENT_KEY not in text


async def test_a_refused_condenser_call_leaves_the_round_to_the_deterministic_condenser_warned_once(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The condenser takes the session's route too; a refusing route leaves the tool output to the deterministic
    condenser, and is warned once."""
    caplog.set_level(logging.INFO)
    log_lines = "\n".join(f"line {n}: FAILED test_{n} assertion error in module_{n % 7}" for n in range(3000))
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are a coding agent."},
                                      {"role": "user", "content": "Why do the tests fail?"}]
    upstream = Recording([{"text": DONE}] * 2, refuse=401)
    async with proxied(tmp_path, upstream) as proxy:
        for n in range(2):
            # Reading a saved log, not running a test: the condenser model is asked (test runs never are).
            messages += [{"role": "assistant", "content": None, "tool_calls": [{"id": f"c{n}", "type": "function",
                          "function": {"name": "Bash", "arguments": '{"command": "cat tests.log"}'}}]},
                         {"role": "tool", "tool_call_id": f"c{n}", "content": log_lines + f"\nrun {n}"}]
            body = BY_NAME["chat"].request_from_chat(messages, AGENT_MODEL, False, (BASH,))
            text = await send(proxy, "chat", body)  # the refused verifier call adds the unverified notice
            assert text.removesuffix(GateConfig().unverified_notice).rstrip() == DONE
    sent = [orjson.dumps(b).decode() for _p, _h, b, _a in upstream.seen if policy(BY_NAME["chat"], b) is None]
    assert len(sent) == 2 and all(f"run {n}" in b and "CONDENSED by proxyvisor" in b and "line 1500:" not in b
                                  for n, b in enumerate(sent))
    condenser_calls = [b for _p, _h, b, _a in upstream.supervisor_calls() if schema_of(
        [{"role": "system", "content": BY_NAME["chat"].fingerprint_parts(b)[0]}]) is None]
    assert len(condenser_calls) == 2
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len([w for w in warnings if "refused the supervisor call" in w]) == 1, warnings
    assert not [w for w in warnings if "condenser gave nothing usable" in w], warnings


async def test_the_requests_credentials_live_no_longer_than_the_request(tmp_path: Path) -> None:
    """The session's route holds the agent's credentials in the request's own model call: once the answer is
    through, no model call of it is left in memory (nothing of the request is kept to reach them)."""
    import gc

    from proxyvisor.proxy.session_model import SessionModel

    upstream = Recording([{"text": DONE}] * 2)
    async with proxied(tmp_path, upstream) as proxy:
        for stream in (False, True):
            assert await send(proxy, "chat", edited_and_checked("chat", stream), session=f"s{stream}") == DONE
        gc.collect()
        assert [o for o in gc.get_objects() if isinstance(o, SessionModel)] == []
        assert len(upstream.supervisor_calls()) == 2


# ---- the agent's pool breaker -----------------------------------------------------------------------------------
class FrozenClock:
    """The breakers' wall clock, stopped: a cooldown lasts as long as the test."""

    def __init__(self) -> None:
        self.now = 1_800_000_000.0

    def __call__(self) -> float:
        return self.now


async def test_a_verifier_calls_429_cools_the_agents_pool(tmp_path: Path) -> None:
    """The verifier's call goes the agent's route under the agent's pool breaker: its 429 cools the pool, and the
    agent's next request is answered 429 at once, with no upstream call."""
    upstream = Recording([{"text": DONE}], refuse=429)
    async with proxied(tmp_path, upstream) as proxy:
        assert proxy.pipeline.breakers is not None
        proxy.pipeline.breakers.now = FrozenClock()
        text = await send(proxy, "chat", edited_and_checked("chat", False))
        assert text.removesuffix(GateConfig().unverified_notice).rstrip() == DONE
        assert len(upstream.seen) == 2  # the agent's request and the verifier's call
        async with http_client() as client:
            response = await client.post(proxy.url + BY_NAME["chat"].path, headers={
                "content-type": "application/json", "x-proxyvisor-session": "route-test", **credentials("chat")},
                content=orjson.dumps(edited_and_checked("chat", False)))
        assert (response.status_code, response.headers.get("x-proxyvisor-breaker")) == (429, "open")
        assert len(upstream.seen) == 2
    (gate,) = gates(proxy)
    assert gate["outcome"] == "unverified" and "(429)" in gate["reason"]


async def test_no_verifier_call_goes_to_a_cooling_pool(tmp_path: Path) -> None:
    """A turn answered before its pool tripped (another session's request was rate-limited meanwhile) is judged
    without a call to the cooling upstream: the turn is labelled unverified, saying why, and delivered."""
    upstream = Recording([{"fault": {"first_byte_delay_s": 0.5}}, {"fault": {"status": 429, "retry_after": "30"}},
                          {"text": DONE}])
    async with proxied(tmp_path, upstream) as proxy:
        assert proxy.pipeline.breakers is not None
        proxy.pipeline.breakers.now = FrozenClock()
        texts: dict[str, str] = {}

        async def slow() -> None:
            texts["slow"] = await send(proxy, "chat", edited_and_checked("chat", False), session="slow")

        async with trio.open_nursery() as nursery:
            nursery.start_soon(slow)
            await trio.sleep(0.1)  # the slow request is upstream: the next one trips the pool
            async with http_client() as client:
                response = await client.post(proxy.url + BY_NAME["chat"].path, headers={
                    "content-type": "application/json", "x-proxyvisor-session": "limited", **credentials("chat")},
                    content=orjson.dumps(edited_and_checked("chat", False)))
            assert (response.status_code, response.headers["retry-after"]) == (429, "30")
        assert texts["slow"].removesuffix(GateConfig().unverified_notice).rstrip() == DONE
        assert upstream.supervisor_calls() == []
    (gate,) = gates(proxy, "slow")
    assert gate["outcome"] == "unverified" and "cooling down" in gate["reason"]
