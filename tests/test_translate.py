"""The translation path: clients on an upstream that does not speak their format, served through litellm.

Every test here runs against a scripted upstream restricted to one format (``formats = ("chat",)``
...), which records what litellm sent it, and with the network refused for anything but loopback.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anthropic
import openai
import orjson
import pytest
import trio

from proxyvisor.adapters.litellm_bridge import import_litellm
from proxyvisor.scripted.upstream import ScriptedUpstream
from proxyvisor.config import BreakersConfig, Config, GateConfig, UpstreamConfig
from proxyvisor.proxy import translate
from proxyvisor.proxy.formats import BY_NAME
from proxyvisor.proxy.relay import UpstreamError
from proxyvisor.proxy.server import Request, Response
from proxyvisor.proxy.service import RunningProxy, running
from proxyvisor.proxy.translate import ToolCallSplitter
from proxyvisor.store import Store

from helpers import (TEXT_STEP, TOOL_STEP, TWO_CALLS_STEP, anthropic_client, ask, assert_error_shape, closed_port,
                     json_events, openai_client, raw_stream, request_body, serve_handler, sse_events)
from test_faults import Observed

DIRECTIONS = [("chat", "messages"), ("chat", "responses"), ("messages", "chat"), ("messages", "responses"),
              ("responses", "chat"), ("responses", "messages")]
BY_CLIENT = {"chat": "messages", "messages": "chat", "responses": "chat"}
"""An upstream format for each client format (the translation Claude Code and Codex need most)."""
STOP = {"chat": ("tool_calls", "stop"), "messages": ("tool_use", "end_turn"), "responses": ("completed", "completed")}
SECRET = "sk-configured-secret-9f8e7d6c"
_LOOPBACK = {None, "127.0.0.1", "localhost", "::1", b"127.0.0.1", b"localhost"}


@pytest.fixture(autouse=True)
def loopback_only(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Any]]:
    """Refuse (and record) any name lookup or connection that is not to this machine, in every thread."""
    attempts: list[Any] = []
    real_lookup, real_connect = socket.getaddrinfo, socket.socket.connect

    def lookup(host: Any, *args: Any, **kwargs: Any) -> Any:
        if host not in _LOOPBACK:
            attempts.append(host)
            raise socket.gaierror(f"network disabled in tests: {host}")
        return real_lookup(host, *args, **kwargs)

    def connect(sock: socket.socket, address: Any) -> Any:
        if isinstance(address, tuple) and address[0] not in _LOOPBACK:
            attempts.append(address)
            raise OSError(f"network disabled in tests: {address}")
        return real_connect(sock, address)

    monkeypatch.setattr(socket, "getaddrinfo", lookup)
    monkeypatch.setattr(socket.socket, "connect", connect)
    yield attempts
    assert attempts == [], f"something reached for the network: {attempts}"


@asynccontextmanager
async def translating(upstream_format: str, tmp_path: Path, **fields: Any) -> AsyncIterator[RunningProxy]:
    """A supervised proxy whose one scripted upstream ``s`` speaks only ``upstream_format`` (recording requests),
    the verify-gate off (tests/test_session_model.py has it on the translator path)."""
    config = Config(upstreams=(UpstreamConfig(name="s", formats=(upstream_format,), **fields),))
    config = config.with_overrides(supervisor={"gate": GateConfig(enabled=False),
                                               "breakers": BreakersConfig(enabled=False)})
    async with running(config, port=0, store=Store(tmp_path / "state"),
                       scripted={"s": ScriptedUpstream()}) as rp:
        yield rp


def last_request(rp: RunningProxy) -> tuple[str, dict[str, Any], dict[str, str]]:
    """(path, parsed body, headers) of the last request the scripted upstream received."""
    target, body, headers = rp.scripted["s"].requests[-1]
    return target, orjson.loads(body), headers


def expected(step: dict[str, Any]) -> tuple[str, tuple[tuple[str, str, dict[str, Any]], ...]]:
    return step.get("text", ""), tuple((c["id"], c["name"], c["arguments"]) for c in step.get("tool_calls", ()))


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize(("client", "upstream"), DIRECTIONS, ids=[f"{c}-on-{u}" for c, u in DIRECTIONS])
async def test_sdk_gets_text_and_tool_calls_through_translation(client: str, upstream: str, stream: bool,
                                                                tmp_path: Path) -> None:
    async with translating(upstream, tmp_path) as rp:
        for step, stop in ((TOOL_STEP, STOP[client][0]), (TWO_CALLS_STEP, STOP[client][0]),
                           (TEXT_STEP, STOP[client][1])):
            rp.scripted["s"].queue(step)
            answer = await ask(client, rp.url, stream=stream)
            assert (answer.text, answer.tool_calls) == expected(step)
            assert answer.stop == stop
            path, sent, _headers = last_request(rp)
            assert path == BY_NAME[upstream].path
            assert sent.get("stream", False) is stream  # a real upstream stream, not one faked from JSON
        ledger = Store(tmp_path / "state")
        [session] = ledger.sessions()
        records = ledger.read_ledger(session)
        assert [r["status"] for r in records] == [200, 200, 200]
        if not (client == "chat" and stream):  # a chat stream reports usage only on stream_options.include_usage
            assert records[0]["output_tokens"] == TOOL_STEP["output_tokens"]
            assert records[-1]["output_tokens"] == TEXT_STEP["output_tokens"]


@pytest.mark.parametrize("client", ["chat", "messages"])
async def test_a_responses_upstream_is_streamed_whatever_the_model_name(client: str, tmp_path: Path) -> None:
    """litellm would fake the stream for a model its map does not list for OpenAI (here: an Anthropic name)."""
    async with translating("responses", tmp_path) as rp:
        rp.scripted["s"].queue(TEXT_STEP)
        reply, data = await raw_stream(rp.url, client, request_body(client, stream=True, model="claude-sonnet-4-5"))
        assert reply.status_code == 200 and TEXT_STEP["text"].split()[-1].encode() in data
        assert last_request(rp)[1]["stream"] is True


@pytest.mark.parametrize(("client", "upstream"), DIRECTIONS, ids=[f"{c}-on-{u}" for c, u in DIRECTIONS])
async def test_streams_use_the_clients_own_event_grammar(client: str, upstream: str, tmp_path: Path) -> None:
    async with translating(upstream, tmp_path) as rp:
        rp.scripted["s"].queue(TOOL_STEP)
        reply, data = await raw_stream(rp.url, client, request_body(client, stream=True))
    assert reply.status_code == 200 and reply.headers["content-type"] == "text/event-stream"
    events = json_events(data)
    names = [name for name, _ in events]
    if client == "chat":
        assert set(names) == {None} and events[-1][1] == "[DONE]"
        assert all(obj["object"] == "chat.completion.chunk" for _, obj in events[:-1])
        assert sum(len(obj["choices"]) for _, obj in events[:-1]) > len(TOOL_STEP["text"].split())
        return
    assert names == [obj["type"] for _, obj in events]
    if client == "messages":
        assert names[0] == "message_start" and names[-1] == "message_stop"
        assert names.count("content_block_start") == names.count("content_block_stop") == 2
    else:
        assert names[0] == "response.created" and names[-1] == "response.completed"
        assert [obj["sequence_number"] for _, obj in events] == list(range(len(events)))


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("client", sorted(BY_CLIENT))
async def test_429_reaches_the_client_with_its_retry_after(client: str, stream: bool, tmp_path: Path) -> None:
    async with translating(BY_CLIENT[client], tmp_path) as rp:
        rp.scripted["s"].queue({"fault": {"status": 429, "retry_after": "3", "message": "slow down"}},
                               {"fault": {"status": 429, "retry_after": "3"}})
        reply, data = await raw_stream(rp.url, client, request_body(client, stream=stream))
        assert reply.status_code == 429
        assert reply.headers["retry-after"] == "3"
        error = assert_error_shape(client, 429, data)
        assert error["message"] == "slow down"
        assert error["type"] == ("rate_limit_error" if client == "messages" else "requests")  # each API's own
        with pytest.raises((openai.RateLimitError, anthropic.RateLimitError)) as raised:
            await ask(client, rp.url, stream=stream)
        assert raised.value.response.headers["retry-after"] == "3"
        assert len(rp.scripted["s"].requests) == 2  # proxyvisor itself never retries


@pytest.mark.parametrize(("client", "upstream"), [("messages", "chat"), ("chat", "messages"),
                                                  ("responses", "chat")])
async def test_upstream_error_statuses_reach_the_client(client: str, upstream: str, tmp_path: Path) -> None:
    statuses = (400, 401, 404, 500, 503, 529) if upstream == "chat" else (400, 401, 404, 500, 529)
    async with translating(upstream, tmp_path) as rp:
        for status in statuses:
            rp.scripted["s"].queue({"fault": {"status": status, "message": f"scripted {status}"}})
            reply, data = await raw_stream(rp.url, client, request_body(client))
            assert reply.status_code == status
            assert assert_error_shape(client, status, data)["message"] == f"scripted {status}"


@pytest.mark.parametrize("client", sorted(BY_CLIENT))
async def test_unreachable_upstream_gives_502(client: str, tmp_path: Path) -> None:
    async with translating(BY_CLIENT[client], tmp_path, url=f"http://127.0.0.1:{closed_port()}") as rp:
        reply, data = await raw_stream(rp.url, client, request_body(client, stream=True))
    assert reply.status_code == 502
    assert "'s'" in assert_error_shape(client, 502, data)["message"]


async def test_no_first_byte_within_the_timeout_gives_504(tmp_path: Path) -> None:
    async with translating("chat", tmp_path, first_byte_timeout_s=0.3) as rp:
        rp.scripted["s"].queue({"fault": {"first_byte_delay_s": 30}})
        with trio.fail_after(10):
            reply, data = await raw_stream(rp.url, "messages", request_body("messages", stream=True))
    assert reply.status_code == 504
    assert_error_shape("messages", 504, data)


def assert_ends_with_error_event(client: str, data: bytes) -> None:
    events = json_events(data)
    name, last = events[-1]
    if client == "chat":
        assert name is None and last["error"]["message"], events[-1]
        assert "[DONE]" not in [obj for _, obj in events]
    elif client == "messages":
        assert name == "error" and last["error"]["message"], events[-1]
        assert [n for n, _ in events].count("error") == 1 and "message_stop" not in [n for n, _ in events]
    else:
        assert name == "error" and last["message"], events[-1]
        assert [obj["sequence_number"] for _, obj in events] == list(range(len(events)))


@pytest.mark.parametrize(("client", "upstream"), DIRECTIONS, ids=[f"{c}-on-{u}" for c, u in DIRECTIONS])
async def test_reset_mid_stream_ends_with_the_clients_error_event(client: str, upstream: str,
                                                                  tmp_path: Path) -> None:
    async with translating(upstream, tmp_path) as rp:
        rp.scripted["s"].queue({"fault": {"reset_after_events": 6}})
        with trio.fail_after(10):
            reply, data = await raw_stream(rp.url, client, request_body(client, stream=True))
    assert reply.status_code == 200
    assert_ends_with_error_event(client, data)


@pytest.mark.parametrize("client", sorted(BY_CLIENT))
async def test_stall_mid_stream_longer_than_idle_timeout_ends_with_error_event(client: str, tmp_path: Path) -> None:
    async with translating(BY_CLIENT[client], tmp_path, idle_timeout_s=0.3) as rp:
        rp.scripted["s"].queue({"fault": {"stall_after_events": 6, "stall_s": 30}})
        with trio.fail_after(10):
            reply, data = await raw_stream(rp.url, client, request_body(client, stream=True))
    assert reply.status_code == 200
    assert_ends_with_error_event(client, data)


@pytest.mark.parametrize("client", sorted(BY_CLIENT))
async def test_a_stalled_translated_stream_ends_with_the_error_event_when_the_proxys_grace_ends(
        client: str, tmp_path: Path) -> None:
    async with translating(BY_CLIENT[client], tmp_path) as rp:
        rp.scripted["s"].queue({"fault": {"stall_after_events": 6, "stall_s": 30}})
        got: list[bytes] = []

        async def read() -> None:
            got.append((await raw_stream(rp.url, client, request_body(client, stream=True)))[1])

        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(read)
                while not rp.scripted["s"].requests:  # the stream is on its way, then stalls for 30 s
                    await trio.sleep(0.01)
                await rp.drain(0.3)
    assert_ends_with_error_event(client, got[0])
    assert "the proxy stopped before the stream ended" in got[0].decode()


async def test_configured_key_replaces_the_clients_and_never_reaches_errors_or_logs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("PV_TEST_UPSTREAM_KEY", SECRET)
    caplog.set_level("DEBUG")
    async with translating("chat", tmp_path, api_key_env="PV_TEST_UPSTREAM_KEY") as rp:
        rp.scripted["s"].queue(TEXT_STEP)
        assert (await ask("messages", rp.url, stream=False)).text == TEXT_STEP["text"]
        _path, _body, headers = last_request(rp)
        assert headers["authorization"] == f"Bearer {SECRET}"
        assert "sk-ant-client-key" not in json.dumps(headers)
        for stream in (False, True):
            # An upstream that quotes the key back in its error message.
            rp.scripted["s"].queue({"fault": {"status": 401, "message": f"Incorrect API key provided: {SECRET}"}})
            reply, data = await raw_stream(rp.url, "messages", request_body("messages", stream=stream))
            assert reply.status_code == 401
            assert SECRET not in data.decode()
            assert "[redacted]" in assert_error_shape("messages", 401, data)["message"]
        rp.scripted["s"].queue({"fault": {"reset_after_events": 4}})
        _reply, data = await raw_stream(rp.url, "responses", request_body("responses", stream=True))
    assert SECRET not in data.decode()
    assert caplog.records and SECRET not in caplog.text


@pytest.mark.parametrize(("client", "upstream", "header", "value"),
                         [("messages", "chat", "authorization", "Bearer sk-ant-client-key"),
                          ("chat", "messages", "x-api-key", "sk-client-key")])
async def test_without_a_configured_key_the_clients_own_is_forwarded(client: str, upstream: str, header: str,
                                                                     value: str, tmp_path: Path) -> None:
    async with translating(upstream, tmp_path) as rp:
        await ask(client, rp.url, stream=True)
        assert last_request(rp)[2][header] == value


async def test_body_fields_cannot_steer_litellm(tmp_path: Path) -> None:
    """Fields litellm would read as its own settings (where to send, which key, a canned answer) are dropped."""
    steering = {"api_base": f"http://127.0.0.1:{closed_port()}/v1", "base_url": "http://127.0.0.1:1",
                "api_key": "sk-from-the-body", "mock_response": "canned", "custom_llm_provider": "openai",
                "num_retries": 5}
    async with translating("chat", tmp_path) as rp:
        rp.scripted["s"].queue(TEXT_STEP)
        async with anthropic_client(rp.url) as sdk:
            message = await sdk.messages.create(**request_body("messages"), extra_body=steering)
        assert message.content[0].text == TEXT_STEP["text"]
        path, body, headers = last_request(rp)
    assert path == "/v1/chat/completions" and len(rp.scripted["s"].requests) == 1
    assert headers["authorization"] == "Bearer sk-ant-client-key"
    assert not set(steering) & set(body)


async def test_configured_model_replaces_the_clients(tmp_path: Path) -> None:
    async with translating("messages", tmp_path, model="upstream-model-7") as rp:
        async with openai_client(rp.url) as sdk:
            completion = await sdk.chat.completions.create(**request_body("chat"))
        assert completion.choices[0].message.tool_calls
        assert last_request(rp)[1]["model"] == "upstream-model-7"


def test_importing_litellm_stays_offline(tmp_path: Path) -> None:
    """Import and first tokenizer use, in a fresh interpreter: no name lookup for any remote host."""
    script = """
import json, socket
attempts = []
real = socket.getaddrinfo
def lookup(host, *args, **kwargs):
    if host not in (None, "127.0.0.1", "localhost", "::1"):
        attempts.append(str(host))
        raise socket.gaierror("network disabled")
    return real(host, *args, **kwargs)
socket.getaddrinfo = lookup
from proxyvisor.adapters.litellm_bridge import import_litellm
litellm = import_litellm()
assert litellm.token_counter(model="gpt-4o", text="hello world") > 0
print(json.dumps(attempts))
"""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LITELLM_", "TIKTOKEN_"))}
    done = subprocess.run([sys.executable, "-c", script], check=False, env=env, cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []


@pytest.mark.parametrize("client", sorted(BY_CLIENT))
async def test_client_disconnect_mid_stream_cancels_the_upstream_request(client: str, tmp_path: Path) -> None:
    """The upstream stalls after 4 events; the client reads the first translated event and hangs up."""
    upstream = Observed(ScriptedUpstream([{"fault": {"stall_after_events": 4, "stall_s": 3600}}]))
    async with serve_handler(upstream) as upstream_url, \
            translating(BY_CLIENT[client], tmp_path, url=upstream_url) as rp:
        body = orjson.dumps(request_body(client, stream=True))
        stream = await trio.open_tcp_stream("127.0.0.1", rp.port)
        await stream.send_all(b"POST %s HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                              b"content-length: %d\r\n\r\n%s" % (BY_NAME[client].path.encode(), len(body), body))
        received = b""
        with trio.fail_after(10):
            while b"data: " not in received:
                received += await stream.receive_some(65536)
        assert received.startswith(b"HTTP/1.1 200")
        await stream.aclose()
        with trio.fail_after(10):
            await upstream.closed.wait()
        assert upstream.cancelled


# ---- upstreams that emit exactly given bytes ------------------------------------------------------------------

class RawUpstream:
    """An upstream answering every request with fixed bytes: ``stream`` (SSE) to a request with ``stream: true``,
    ``json`` otherwise, both with ``status``; records the bodies it got."""

    def __init__(self, json_body: bytes, stream: bytes = b"", status: int = 200) -> None:
        self.json_body, self.stream, self.status = json_body, stream, status
        self.bodies: list[dict[str, Any]] = []

    async def __call__(self, request: Request) -> Response:
        body = orjson.loads(request.body)
        self.bodies.append(body)
        if body.get("stream") and self.stream:
            async def play() -> AsyncIterator[bytes]:
                yield self.stream
            return Response(self.status, [(b"content-type", b"text/event-stream")], play())
        return Response(self.status, [(b"content-type", b"application/json")], self.json_body)


@asynccontextmanager
async def raw_translating(upstream: RawUpstream, upstream_format: str, tmp_path: Path) -> AsyncIterator[RunningProxy]:
    async with serve_handler(upstream) as url, translating(upstream_format, tmp_path, url=url) as rp:
        yield rp


def _chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
    obj = {"id": "chatcmpl-7", "object": "chat.completion.chunk", "created": 1, "model": "m",
           "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def _call_start(call_id: str) -> bytes:
    return _chunk({"tool_calls": [{"index": 0, "id": call_id, "type": "function",
                                   "function": {"name": "read", "arguments": ""}}]})


def _call_args(fragment: str) -> bytes:
    return _chunk({"tool_calls": [{"index": 0, "function": {"arguments": fragment}}]})


# Two parallel calls, both at index 0 (LiteLLM #33678's shape): call_a reads a.rs, call_b b.rs.
SAME_INDEX_STREAM = b"".join([
    _chunk({"role": "assistant", "content": None}),
    _call_start("call_a"), _call_args('{"path":'), _call_args('"a.rs"}'),
    _call_start("call_b"), _call_args('{"path":'), _call_args('"b.rs"}'),
    _chunk({}, "tool_calls"), b"data: [DONE]\n\n"])
SAME_INDEX_JSON = json.dumps({
    "id": "chatcmpl-7", "object": "chat.completion", "created": 1, "model": "m",
    "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {"role": "assistant", "content": None,
                 "tool_calls": [{"id": c, "type": "function", "function": {"name": "read", "arguments": a}}
                                for c, a in (("call_a", '{"path":"a.rs"}'), ("call_b", '{"path":"b.rs"}'))]}}],
    "usage": {"prompt_tokens": 20, "completion_tokens": 12, "total_tokens": 32}}).encode()
READ_TOOL = {"type": "object", "properties": {"path": {"type": "string"}}}


def _read_request(client: str, stream: bool) -> dict[str, Any]:
    body = request_body(client, stream=stream)
    body["tools"] = {"messages": [{"name": "read", "input_schema": READ_TOOL}],
                     "responses": [{"type": "function", "name": "read", "parameters": READ_TOOL}]}[client]
    return body


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("client", ["responses", "messages"])
async def test_parallel_calls_at_one_index_are_split_by_id(client: str, stream: bool, tmp_path: Path) -> None:
    upstream = RawUpstream(SAME_INDEX_JSON, SAME_INDEX_STREAM)
    async with raw_translating(upstream, "chat", tmp_path) as rp:
        reply, data = await raw_stream(rp.url, client, _read_request(client, stream))
    assert reply.status_code == 200 and upstream.bodies[-1].get("stream", False) is stream
    want = [("call_a", {"path": "a.rs"}), ("call_b", {"path": "b.rs"})]
    if not stream:
        final = orjson.loads(data)
    elif client == "messages":
        final = BY_NAME["messages"].stream_response([(e.event, e.data) for e in sse_events(data)])
    else:
        events = json_events(data)
        [completed] = [obj["response"] for name, obj in events if name == "response.completed"]
        final = completed
        added = [obj["item"]["id"] for name, obj in events if name == "response.output_item.added"]
        done = {obj["item"]["id"]: obj["item"] for name, obj in events if name == "response.output_item.done"}
        assert sorted(added) == sorted(done)  # every call announced is completed
        for item_id, item in done.items():
            deltas = "".join(obj["delta"] for name, obj in events
                             if name == "response.function_call_arguments.delta" and obj["item_id"] == item_id)
            assert deltas == item["arguments"]  # each fragment once, in its own call
    turn = BY_NAME[client].parse_response(final)
    assert [(call.id, call.arguments) for call in turn.tool_calls] == want


def test_the_tool_call_splitter_renumbers_only_a_reused_index_at_every_split() -> None:
    out = ToolCallSplitter().feed(SAME_INDEX_STREAM)
    calls = [call for e in sse_events(out) if e.data != "[DONE]"
             for call in json.loads(e.data)["choices"][0]["delta"].get("tool_calls", ())]
    assert [(c.get("id"), c["index"]) for c in calls] == [("call_a", 0), (None, 0), (None, 0),
                                                           ("call_b", 1), (None, 1), (None, 1)]
    distinct = SAME_INDEX_STREAM.replace(b'"index": 0, "id": "call_b"', b'"index": 1, "id": "call_b"')
    assert distinct != SAME_INDEX_STREAM
    assert ToolCallSplitter().feed(distinct) == distinct  # already distinct: byte for byte
    for cut in range(len(SAME_INDEX_STREAM)):
        splitter = ToolCallSplitter()
        pieces = splitter.feed(SAME_INDEX_STREAM[:cut]) + splitter.feed(SAME_INDEX_STREAM[cut:]) + splitter.finish()
        assert pieces == out


ANTHROPIC_BLOCKS = [
    {"role": "user", "content": "Read a.rs."},
    {"role": "assistant", "content": [{"type": "text", "text": "Reading."},
                                      {"type": "tool_use", "id": "toolu_1", "name": "read",
                                       "input": {"path": "a.rs"}}]},
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "fn main() {}"}]}]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_anthropic_blocks_on_chat_completions_are_a_400_without_a_traceback(stream: bool,
                                                                                  tmp_path: Path) -> None:
    upstream = RawUpstream(b'{"type":"message"}')
    async with raw_translating(upstream, "messages", tmp_path) as rp:
        reply, data = await raw_stream(rp.url, "chat", request_body("chat", stream=stream,
                                                                    messages=ANTHROPIC_BLOCKS))
    assert reply.status_code == 400 and reply.headers["content-type"] == "application/json"
    message = assert_error_shape("chat", 400, data)["message"]
    assert "\n" not in message and "Traceback" not in message and ".py" not in message
    assert "assistant message" in message and "'tool_use'" in message
    assert upstream.bodies == []


def test_litellms_own_failure_text_reaches_the_client_as_one_line() -> None:
    litellm = import_litellm()
    text = ("Invalid user message at index 3. Please ensure all user messages are valid.\nTraceback (most recent "
            'call last):\n  File "/venv/lib/python3.11/site-packages/litellm/utils.py", line 9730, in validate\n'
            "    raise Exception(\nException: invalid content type=tool_result\n")
    for exc in (litellm.APIConnectionError(message=text, llm_provider="anthropic", model="m"),
                litellm.BadRequestError(message="failed in /venv/lib/python3.11/site-packages/litellm/main.py",
                                        llm_provider="anthropic", model="m")):
        try:
            reply = translate._failure(BY_NAME["chat"], "s", exc, "sk-key")
            body = reply.body
        except UpstreamError as error:
            body = BY_NAME["chat"].error_body(error.status, error.message)
        message = orjson.loads(body)["error"]["message"]
        assert "\n" not in message and "Traceback" not in message and ".py" not in message and "site-packages" \
            not in message, message


CONTEXT_ERROR = json.dumps({"error": {"message": "This model's maximum context length is 8192 tokens.",
                                      "type": "invalid_request_error", "param": "messages",
                                      "code": "context_length_exceeded"}}).encode()
ANTHROPIC_CONTEXT_ERROR = json.dumps({"type": "error", "error": {
    "type": "invalid_request_error", "message": "prompt is too long: 210000 tokens > 200000 maximum"}}).encode()


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize(("client", "upstream"), DIRECTIONS, ids=[f"{c}-on-{u}" for c, u in DIRECTIONS])
async def test_an_upstream_error_code_reaches_the_client(client: str, upstream: str, stream: bool,
                                                         tmp_path: Path) -> None:
    """OpenAI-format upstreams name the code; Anthropic's error has none, and litellm recognises it."""
    body = ANTHROPIC_CONTEXT_ERROR if upstream == "messages" else CONTEXT_ERROR
    async with raw_translating(RawUpstream(body, status=400), upstream, tmp_path) as rp:
        reply, data = await raw_stream(rp.url, client, request_body(client, stream=stream))
    assert reply.status_code == 400
    error = assert_error_shape(client, 400, data)
    assert error["code"] == "context_length_exceeded"
    assert error["message"] == orjson.loads(body)["error"]["message"]
