"""OpenTelemetry traces: off, the SDK is never imported; on, a scripted session with a delegation and a gated turn
lands in a real OTLP receiver (Arize Phoenix, from PyPI) as one trace under the client's ``traceparent``: the
request spans with the GenAI attributes, the supervision events, the supervisor model call and delegated child
spans, and the child's own request back through proxyvisor under its delegation span. A receiver that is down
costs the requests nothing.

Phoenix is heavy, so it lives in its own virtual environment, made by ``.ci/run`` (``.venv-phoenix`` at the
repository root, or the interpreter named by ``$PROXYVISOR_PHOENIX_PYTHON``). A missing Phoenix skips the receiver
test on a developer machine and fails it in CI.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import trio

from proxyvisor.config import Config, TelemetryConfig, UpstreamConfig, parse
from proxyvisor.proxy import telemetry
from proxyvisor.proxy.pipeline import _timed
from proxyvisor.proxy.supervise import ModelUse
from proxyvisor.supervisor_model import ModelAnswer
from proxyvisor.proxy.service import running
from proxyvisor.scripted.upstream import ScriptedUpstream
from proxyvisor.store import Store

from helpers import ask

ROOT = Path(__file__).resolve().parent.parent
_IN_CI = os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")
TRACE = "6bf92f3577b34da6a3ce929d0e0e4736"
OTHER_TRACE = "7bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
CALL = {"text": "Let me ask the reviewer.",
        "tool_calls": [{"name": "reviewer", "arguments": {"prompt": "Review app.py for bugs."}, "id": "call_rev_1"}]}
CHILD = {"text": "app.py looks correct to me."}
FINAL = {"text": "The reviewer found nothing wrong with app.py."}
STARTUP_S = 180
"""Phoenix's first start migrates its database: about 30 s here; a hang must fail rather than block CI."""
# Phoenix binds its OTLP/gRPC receiver on every interface, with no setting for it; the tests use its OTLP/HTTP
# receiver only, and bind the gRPC one to loopback like everything else a test binds.
_LAUNCH = """
import sys
import grpc.aio._server as server
add = server.Server.add_insecure_port
server.Server.add_insecure_port = lambda self, address: add(self, address.replace("[::]", "127.0.0.1"))
from phoenix.server.main import main
sys.argv = ["phoenix", "serve"]
sys.exit(main())
"""


def test_off_the_sdk_is_not_imported() -> None:
    # A fresh interpreter: the CLI, a supervised proxy's pipeline and litellm, and nothing of OpenTelemetry.
    code = ("import sys; from proxyvisor import cli, serve; from proxyvisor.config import Config; "
            "from proxyvisor.proxy.pipeline import Pipeline; p = Pipeline(Config(), {}, None); "
            "assert p.telemetry is None; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'opentelemetry'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"


def test_on_the_sdk_is_imported_and_the_endpoint_checked() -> None:
    code = ("import sys; from proxyvisor.config import parse; from proxyvisor.proxy.pipeline import Pipeline; "
            "p = Pipeline(parse({'telemetry': {'otlp_endpoint': 'http://127.0.0.1:9'}}), {}, None); "
            "print(p.telemetry.url, 'opentelemetry.sdk.trace' in sys.modules); p.close()")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["http://127.0.0.1:9/v1/traces", "True"]
    for bad in ("localhost:4318", "grpc://localhost:4317", "http://"):
        with pytest.raises(ValueError, match=r"\[telemetry\] otlp_endpoint must be an http:// or https:// URL"):
            parse({"telemetry": {"otlp_endpoint": bad}})


def test_traceparent_and_attribute_rules() -> None:
    assert telemetry.parse_traceparent(f"00-{TRACE}-{CLIENT_SPAN}-01") == telemetry.SpanContext(
        int(TRACE, 16), int(CLIENT_SPAN, 16), True)
    assert telemetry.parse_traceparent(f"00-{TRACE}-{CLIENT_SPAN}-00").sampled is False  # type: ignore[union-attr]
    for bad in (None, "", "garbage", f"00-{'0' * 32}-{CLIENT_SPAN}-01", f"00-{TRACE}-{'0' * 16}-01",
                f"01-{TRACE}-{CLIENT_SPAN}-01"):
        assert telemetry.parse_traceparent(bad) is None
    assert telemetry.endpoint_url("http://h:4318/") == telemetry.endpoint_url("http://h:4318/v1/traces") == \
        "http://h:4318/v1/traces"
    url = telemetry.endpoint_url("https://user:hunter2@h:4318/otel?token=abc123secret")
    assert url == "https://user:hunter2@h:4318/otel/v1/traces?token=abc123secret"  # the path grows, not the query
    assert telemetry.shown_url(url) == "https://h:4318/otel/v1/traces?token=[redacted]"
    assert telemetry.attributes("gate", {"outcome": "passed", "gaps": [], "route": {"model": "m"}, "x": None,
                                         "calls": ["a", "b"], "mixed": [1, "a"], "items": [{"k": 1}]}) == {
        "gate.outcome": "passed", "gate.gaps": "[]", "gate.route.model": "m", "gate.calls": ["a", "b"],
        "gate.mixed": '[1,"a"]', "gate.items": '[{"k":1}]'}
    assert [telemetry.response_model(a) for a in ({"model": "a"}, {"message": {"model": "b"}},
                                                  {"response": {"model": "c"}}, {"model": ""}, [])] == \
        ["a", "b", "c", None, None]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_a_receiver_that_is_down_costs_the_requests_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    # Exports every 50 ms, each given up after 0.5 s: several fail while the requests go on.
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "0.5")
    config = Config().with_overrides(telemetry={"otlp_endpoint": f"http://127.0.0.1:{_free_port()}"})
    caplog.set_level(logging.INFO, logger="proxyvisor.telemetry")
    upstream = ScriptedUpstream([{"text": f"answer {n}"} for n in range(4)])
    async with running(config, port=0, store=Store(tmp_path / "state"), scripted={"scripted": upstream}) as rp:
        answers, took = [], []
        for _ in range(4):
            started = time.perf_counter()
            answers.append((await ask("chat", rp.url, stream=False)).text)
            took.append(time.perf_counter() - started)
            await trio.sleep(0.6)
    assert answers == [f"answer {n}" for n in range(4)]
    # No request waits for an export (each failed one took 0.5 s); the first one pays for the client's setup.
    assert max(took[1:]) < 0.5, took
    failures = [r for r in caplog.records if "exporting spans" in r.getMessage()]
    assert len(failures) == 1 and failures[0].levelno == logging.WARNING, [r.getMessage() for r in failures]


def test_closing_with_the_receiver_down_takes_about_a_second_not_its_retries() -> None:
    """The exporter retries a refused export after 1, 2 and 4 s: the shutdown stops waiting for it after CLOSE_S."""
    tracing = telemetry.Tracing(TelemetryConfig(otlp_endpoint=f"http://127.0.0.1:{_free_port()}"))
    tracing.tracer.start_span("queued").end()
    started = time.perf_counter()
    tracing.close()
    took = time.perf_counter() - started
    assert telemetry.CLOSE_S - 0.2 < took < telemetry.CLOSE_S + 1.5, took


# ---- a real OTLP receiver ----------------------------------------------------------------------------------


def _phoenix_python() -> str | None:
    candidates = [os.environ.get("PROXYVISOR_PHOENIX_PYTHON", ""), str(ROOT / ".venv-phoenix" / "bin" / "python")]
    for candidate in filter(None, candidates):
        if Path(candidate).exists() and subprocess.run([candidate, "-c", "import phoenix.server.main"],
                                                       capture_output=True, timeout=120).returncode == 0:
            return candidate
    return None


class Phoenix:
    def __init__(self, url: str) -> None:
        self.url = url

    def spans(self, trace_id: str, at_least: int, timeout_s: float = 60.0) -> list[dict[str, Any]]:
        """The spans of ``trace_id`` in the default project, once at least ``at_least`` are stored (Phoenix
        inserts what it received in batches)."""
        deadline = time.monotonic() + timeout_s
        found: list[dict[str, Any]] = []
        while time.monotonic() < deadline:
            response = httpx.get(f"{self.url}/v1/projects/default/spans", params={"limit": 1000}, timeout=10)
            response.raise_for_status()
            found = [s for s in response.json()["data"] if s["context"]["trace_id"] == trace_id]
            if len(found) >= at_least:
                return found
            time.sleep(0.5)
        raise AssertionError(f"Phoenix holds {len(found)} spans of trace {trace_id} after {timeout_s} s")


@pytest.fixture(scope="module")
def phoenix(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Phoenix]:
    python = _phoenix_python()
    if python is None:
        message = "Arize Phoenix is not installed (.ci/run makes .venv-phoenix; or set PROXYVISOR_PHOENIX_PYTHON)"
        if _IN_CI:
            pytest.fail(message)
        pytest.skip(message)
    work = tmp_path_factory.mktemp("phoenix")
    (work / "tmp").mkdir()
    port = _free_port()
    # TMPDIR: Phoenix keeps files of its own there.
    env = {**os.environ, "TMPDIR": str(work / "tmp"), "PHOENIX_WORKING_DIR": str(work), "PHOENIX_HOST": "127.0.0.1", "PHOENIX_PORT": str(port),
           "PHOENIX_GRPC_PORT": str(_free_port()), "PHOENIX_TELEMETRY_ENABLED": "false"}
    log = (work / "phoenix.log").open("wb")
    process = subprocess.Popen([python, "-c", _LAUNCH], env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_S
        while True:
            if process.poll() is not None:
                raise AssertionError(f"Phoenix exited with {process.returncode}: "
                                     f"{(work / 'phoenix.log').read_text(errors='replace')[-2000:]}")
            try:
                if httpx.get(url + "/healthz", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"Phoenix did not answer on {url} within {STARTUP_S} s")
            time.sleep(0.5)
        yield Phoenix(url)
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=30)
        log.close()


def _delegating_config(port: int, endpoint: str) -> Config:
    """Supervision with the gate on, the ``reviewer`` role on the litellm adapter whose requests come back through
    this proxy (its own address), and tracing to ``endpoint``."""
    config = parse({
        "proxy": {"port": port},
        "model_routing": {
            "enabled": True,
            "roles": {"reviewer": {"adapter": "litellm", "model": "openai/scripted-model",
                                   "description": "Reviews code and says what is wrong."}},
            "children": {"attempts": 1},
            "adapter_options": {"litellm": {"api_base": f"http://127.0.0.1:{port}/v1",
                                            "api_key_env": "PROXYVISOR_TEST_CHILD_KEY"}}},
        "telemetry": {"otlp_endpoint": endpoint, "service_name": "proxyvisor-test"}})
    return msgspec.structs.replace(config, upstreams=(UpstreamConfig(name="scripted"),))


async def test_a_delegation_tree_is_one_trace_in_a_real_receiver(
        phoenix: Phoenix, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PROXYVISOR_TEST_CHILD_KEY", "sk-test")
    port = _free_port()
    # The parent model calls the reviewer; the child's litellm request comes back through the proxy and gets the
    # child's answer; the parent's turn is continued, and its end is gated (the scripted verifier passes it).
    # Then a caller asks for a delegation on its own (POST /proxyvisor/delegate) in a trace of its own.
    upstream = ScriptedUpstream([CALL, CHILD, FINAL, CHILD])
    store = Store(tmp_path / "state")
    async with running(_delegating_config(port, phoenix.url), port=port, store=store,
                       scripted={"scripted": upstream}) as rp:
        answer = await ask("chat", rp.url, stream=True, headers={"traceparent": f"00-{TRACE}-{CLIENT_SPAN}-01"})
        async with httpx.AsyncClient(timeout=60) as client:
            asked = await client.post(rp.url + "/proxyvisor/delegate",
                                      json={"role": "reviewer", "prompt": "Review util.py."},
                                      headers={"traceparent": f"00-{OTHER_TRACE}-{CLIENT_SPAN}-01"})
    assert answer.text.endswith(FINAL["text"]) and answer.tool_calls == ()
    assert asked.status_code == 200 and asked.json()["result"] == CHILD["text"]
    ledger = [r for s in store.sessions() for r in store.read_ledger(s)]
    (parent_line,) = [r for r in ledger if r.get("delegations")]
    assert parent_line["gate"]["outcome"] and parent_line["delegations"][0]["status"] == "ok"

    spans = phoenix.spans(TRACE, at_least=4)
    by_id = {s["context"]["span_id"]: s for s in spans}
    # One tree: the client's span is the only parent outside it, of exactly one span, the agent's request.
    (request,) = [s for s in spans if s["parent_id"] == CLIENT_SPAN]
    assert all(s["parent_id"] in by_id for s in spans if s is not request)
    attrs = request["attributes"]
    assert request["name"] == f"chat {attrs['gen_ai.request.model']}"
    assert {k: attrs[k] for k in ("gen_ai.operation.name", "gen_ai.provider.name", "gen_ai.response.model",
                                  "http.response.status_code")} == {
        "gen_ai.operation.name": "chat", "gen_ai.provider.name": "openai",
        "gen_ai.response.model": attrs["gen_ai.request.model"], "http.response.status_code": 200}
    assert attrs["gen_ai.usage.input_tokens"] > 0 and attrs["gen_ai.usage.output_tokens"] > 0
    assert attrs["gen_ai.conversation.id"] and attrs["proxyvisor.stream"] is True
    events = {e["name"]: e["attributes"] for e in request["events"]}
    assert events["proxyvisor.gate"]["outcome"] == parent_line["gate"]["outcome"]
    assert events["proxyvisor.upstream.attempt"]["outcome"] == "answered"
    assert "proxyvisor.self_report" in events
    # The supervisor model's calls (the verifier) and the delegated child are the request's child spans.
    children = [s for s in spans if s["parent_id"] == request["context"]["span_id"]]
    purposes = {s["attributes"].get("proxyvisor.purpose") for s in children if s["name"].startswith("chat")}
    assert "verify" in purposes, [s["name"] for s in children]
    (delegation,) = [s for s in children if s["name"] == "invoke_agent reviewer"]
    d = delegation["attributes"]
    assert {k: d[k] for k in ("gen_ai.operation.name", "gen_ai.agent.name", "gen_ai.provider.name",
                              "gen_ai.request.model", "proxyvisor.delegation.status")} == {
        "gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": "reviewer", "gen_ai.provider.name": "litellm",
        "gen_ai.request.model": "openai/scripted-model", "proxyvisor.delegation.status": "ok"}
    assert [e["name"] for e in delegation["events"]] == ["proxyvisor.delegation.attempt"]
    # The child's own request came back through proxyvisor with the delegation's context: a span under it.
    (child_request,) = [s for s in spans if s["parent_id"] == delegation["context"]["span_id"]]
    assert child_request["name"] == "chat scripted-model"
    assert child_request["attributes"]["gen_ai.usage.output_tokens"] > 0
    assert delegation["context"]["span_id"] == parent_line["delegations"][0]["span_id"]

    # The endpoint's delegation: its span under the caller's, the child's request under it.
    endpoint, child = sorted(phoenix.spans(OTHER_TRACE, at_least=2), key=lambda s: s["start_time"])
    assert (endpoint["name"], endpoint["parent_id"]) == ("invoke_agent reviewer", CLIENT_SPAN)
    assert endpoint["context"]["span_id"] == asked.json()["evidence"]["span_id"]
    assert (child["name"], child["parent_id"]) == ("chat scripted-model", endpoint["context"]["span_id"])


async def test_a_supervisor_call_ending_after_the_request_spans_is_handed_on() -> None:
    # Learning's distill call ends after the answer went out, when the request's spans were made already.
    use, late = ModelUse(), []
    answer = ModelAnswer("{}", 3, 4)

    async def call(_messages: list[dict[str, str]]) -> ModelAnswer:
        return answer

    timed = _timed(call, use)
    await timed([])
    use.late = late.append
    await timed([])
    assert [t.answer for t in use.timeline] == [answer, answer] and late == use.timeline[1:]
