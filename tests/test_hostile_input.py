"""Hostile input (issue 7, item 5): random and mutated requests in the three formats, deep nesting, 10,000 tool
calls, huge headers, and upstream streams split at every byte. Whatever arrives, proxyvisor answers (a 4xx in
the client's format, or what the upstream said), never with a failure of its own code, never hangs, and keeps
serving.

"A failure of its own code" is an answer of 500 or any ERROR record of a ``proxyvisor`` logger: the pipeline's
last line of defence, a supervision step that raised, or a connection handler that died all log one.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import h11
import orjson
import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxyvisor.scripted.upstream import ScriptedUpstream
from proxyvisor.config import Config, GateConfig, UpstreamConfig
from proxyvisor.proxy.formats import BY_NAME, AssistantTurn, ToolCall
from proxyvisor.proxy.pipeline import Pipeline
from proxyvisor.proxy.relay import UpstreamReply
from proxyvisor.proxy.server import Request, Response
from proxyvisor.proxy.service import running
from proxyvisor.store import Store

from helpers import (FORMATS, MODEL, assert_error_shape, http_client, path_of, raw_stream, request_body,
                     serve_handler, sse_events)

MODES = pytest.mark.parametrize("supervised", [True, False], ids=["supervised", "disabled"])
ALL_FORMATS = pytest.mark.parametrize("fmt", FORMATS)


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@contextmanager
def own_failures() -> Iterator[list[logging.LogRecord]]:
    """Collects ERROR records of the ``proxyvisor`` loggers for the block (no pytest fixture: hypothesis runs
    many examples per test)."""
    handler = _Records()
    logger = logging.getLogger("proxyvisor")
    logger.addHandler(handler)
    try:
        yield handler.records
    finally:
        logger.removeHandler(handler)


def describe(records: list[logging.LogRecord]) -> str:
    return "\n".join(f"{r.name}: {r.getMessage()} {r.exc_info[1]!r}" if r.exc_info else r.getMessage()
                     for r in records)


def agent_history(fmt: str, stream: bool) -> dict[str, Any]:
    """A request with a finished tool round, a reply and a new prompt, in ``fmt``: every kind of history item."""
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "List the files, then read one."},
        {"role": "assistant", "content": "Looking.", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "Bash", "arguments": '{"command": "ls"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "a.txt\nb.txt ✓\n"},
        {"role": "assistant", "content": "Two files."},
        {"role": "user", "content": "Read a.txt"},
    ]
    tools = tuple(BY_NAME["chat"].tools(request_body("chat")))
    return orjson.loads(orjson.dumps(BY_NAME[fmt].request_from_chat(messages, MODEL, stream, tools)))  # a copy: mutated


# ---- random and mutated requests (hypothesis) ---------------------------------------------------------------

_KEYS = st.sampled_from(["role", "content", "type", "text", "tool_calls", "tool_call_id", "tool_use_id", "id",
                         "name", "input", "arguments", "function", "messages", "system", "instructions", "tools",
                         "stream", "model", "metadata", "user_id", "user", "prompt_cache_key", "call_id",
                         "output", "parameters", "input_schema", "stream_options", "max_tokens", "tool_choice"])
_SCALARS = (st.none() | st.booleans() | st.integers(-(2 ** 63), 2 ** 64 - 1) | st.floats(allow_nan=False,
            allow_infinity=False) | st.text(max_size=12) | st.sampled_from(
            ["user", "assistant", "tool", "system", "developer", "text", "tool_use", "tool_result", "function",
             "function_call", "function_call_output", "message", "input_text", "output_text", "image", "Bash",
             "", "{", '{"command": 1}']))
JSON = st.recursive(_SCALARS, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_KEYS | st.text(max_size=6),
                                                                                        inner, max_size=4),
                    max_leaves=12)


def _paths(value: Any, path: tuple = ()) -> list[tuple]:
    out = [path]
    if isinstance(value, dict):
        for key, item in value.items():
            out += _paths(item, path + (key,))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            out += _paths(item, path + (i,))
    return out


@st.composite
def mutated(draw: st.DrawFn, fmt: str) -> dict[str, Any] | list | Any:
    """A well-formed agent request in ``fmt`` with a few parts replaced, removed or added."""
    body: Any = agent_history(fmt, draw(st.booleans()))
    for _ in range(draw(st.integers(1, 4))):
        path = draw(st.sampled_from(_paths(body)))
        if not path:
            body = draw(JSON) if draw(st.integers(0, 9)) == 0 else body
            continue
        parent = body
        for key in path[:-1]:
            parent = parent[key]
        action = draw(st.sampled_from(["replace", "replace", "delete", "add"]))
        if action == "delete":
            del parent[path[-1]]
        elif action == "add" and isinstance(parent, dict):
            parent[draw(_KEYS)] = draw(JSON)
        elif action == "add":
            parent.insert(path[-1], draw(JSON))
        else:
            parent[path[-1]] = draw(JSON)
    return body


_HEADER_VALUE = st.text(st.characters(min_codepoint=0x20, max_codepoint=0xFF, blacklist_characters="\x7f"),
                        max_size=40).map(str.strip)


@st.composite
def hostile_requests(draw: st.DrawFn) -> tuple[str, bytes, list[tuple[str, str]]]:
    """(format, body bytes, extra headers): mostly mutated requests, sometimes random JSON or random bytes, with
    session and Anthropic headers holding anything a header can hold."""
    fmt = draw(st.sampled_from(FORMATS))
    kind = draw(st.integers(0, 9))
    if kind < 7:
        body = orjson.dumps(draw(mutated(fmt)), option=orjson.OPT_NON_STR_KEYS)
    elif kind < 9:
        body = orjson.dumps(draw(JSON), option=orjson.OPT_NON_STR_KEYS)
    else:
        body = draw(st.binary(max_size=200))
    names = st.sampled_from(["x-proxyvisor-session", "session-id", "x-claude-code-session-id", "x-session-id",
                             "anthropic-version", "anthropic-beta", "authorization", "x-api-key", "accept-encoding",
                             "x-forwarded-host", "host"])
    headers = dict(draw(st.lists(st.tuples(names, _HEADER_VALUE), max_size=3)))
    return fmt, body, [(k, v) for k, v in headers.items() if k != "host" or v]


async def _send_all(requests: list[tuple[str, bytes, list[tuple[str, str]]]], state: Path) -> list[str]:
    """Each request to a supervised proxy (writing under ``state``) and a disabled one; the problems seen."""
    problems = []
    async with running(Config().with_overrides(supervisor={"enabled": True}), port=0,
                       store=Store(state), scripted={"scripted": ScriptedUpstream(record=False)}) as on, \
            running(Config().with_overrides(supervisor={"enabled": False}), port=0,
                    scripted={"scripted": ScriptedUpstream(record=False)}) as off:
        for proxy in (on, off):
            for fmt, body, headers in requests:
                with trio.fail_after(10):
                    status, data = await _raw_post(proxy.port, path_of(fmt), body, headers)
                if status == 500 or status == 0:
                    problems.append(f"{status} for {fmt} {body[:300]!r}: {data[:300]!r}")
            # and it keeps serving
            reply, _ = await raw_stream(proxy.url, "messages", request_body("messages", stream=True))
            if reply.status_code != 200:
                problems.append(f"no longer serving: {reply.status_code}")
    return problems


async def _raw_post(port: int, target: str, body: bytes, headers: list[tuple[str, str]]) -> tuple[int, bytes]:
    """POST with h11 and ``headers`` as given (one replaces the default Host); (status, body), status 0 when
    the connection closed without an answer."""
    conn = h11.Connection(h11.CLIENT)
    host = [] if any(k == "host" for k, _ in headers) else [(b"host", b"127.0.0.1")]
    all_headers = [*host, (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   *((k.encode(), v.encode("latin-1")) for k, v in headers)]
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        await stream.send_all(conn.send(h11.Request(method="POST", target=target, headers=all_headers))
                              + conn.send(h11.Data(data=body)) + conn.send(h11.EndOfMessage()))
        status, parts = 0, []
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                data = await stream.receive_some(1 << 16)
                conn.receive_data(data)
                if not data and conn.their_state is not h11.DONE:
                    return 0, b"".join(parts)
            elif isinstance(event, h11.Response):
                status = event.status_code
            elif isinstance(event, h11.Data):
                parts.append(bytes(event.data))
            elif isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)):
                return status, b"".join(parts)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.lists(hostile_requests(), min_size=1, max_size=12))
def test_random_and_mutated_requests_never_meet_a_failure_of_proxyvisors_own(tmp_path_factory, requests) -> None:
    with own_failures() as records:
        problems = trio.run(_send_all, requests, tmp_path_factory.mktemp("state"))
    assert problems == [] and records == [], "\n".join(problems) + describe(records)


# ---- hand-made cases ----------------------------------------------------------------------------------------


def nested(body: dict[str, Any], where: list[Any], depth: int) -> bytes:
    """``body`` with the value at ``where`` replaced by ``depth`` nested lists (built as text: the JSON
    libraries refuse to write that deep)."""
    parent = body
    for key in where[:-1]:
        parent = parent[key]
    parent[where[-1]] = "@@nest@@"
    return orjson.dumps(body).replace(b'"@@nest@@"', b"[" * depth + b'"deep"' + b"]" * depth)


@MODES
@ALL_FORMATS
async def test_deeply_nested_json_is_answered_never_a_500(fmt: str, supervised: bool, start_proxy,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    """orjson reads 1,024 levels but writes 255: a body between the two is written by the standard library (or goes
    up as received, unsupervised, past its recursion limit), a deeper one gets a 400 in the client's format."""
    content = {"chat": ["messages", 1, "content"], "messages": ["messages", 0, "content"],
               "responses": ["input", 0, "content"]}[fmt]
    async with start_proxy(supervised=supervised) as rp:
        for where in (["metadata_extra"], content):
            for depth in (200, 256, 600, 1000, 1100, 100_000):
                raw = nested(request_body(fmt, stream=depth % 2 == 0), where, depth)
                with trio.fail_after(10):
                    reply, data = await raw_stream(rp.url + "/s/deep", fmt, raw)
                if depth > 1024:
                    assert reply.status_code == 400, depth
                    assert "depth" in assert_error_shape(fmt, 400, data)["message"]
                else:
                    assert reply.status_code == 200, (depth, data[:300])
                    assert rp.scripted["scripted"].requests[-1][1].count(b"[[[") > 0
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


class DeepReplyUpstream:
    """Answers in the request's format with text ending in a self-report (supervision must rewrite the answer) and
    a field nested ``depth`` lists deep beside it, in the JSON answer or in every stream event."""

    REPORT = '<sup>{"state": "done", "focus": "answered", "carry": []}</sup>'

    def __init__(self, fmt: str, depth: int) -> None:
        self.fmt, self.depth = BY_NAME[fmt], depth

    def _deepened(self, data: str) -> str:
        deep = "[" * self.depth + '"deep"' + "]" * self.depth
        return data[:-1] + f', "x_deep": {deep}}}' if data.startswith("{") else data

    async def __call__(self, request: Request) -> Response:
        body = orjson.loads(request.body)
        turn = AssistantTurn("All done. " + self.REPORT)
        if not body.get("stream"):
            answer = self._deepened(orjson.dumps(self.fmt.render(turn, MODEL)).decode())
            return Response(200, [(b"content-type", b"application/json")], answer.encode())
        events = [(f"event: {e.event}\n" if e.event else "") + f"data: {self._deepened(e.data)}\n\n"
                  for e in sse_events(b"".join(self.fmt.render_stream(turn, MODEL, body)))]
        return Response(200, [(b"content-type", b"text/event-stream")], "".join(events).encode())


async def deep_answer(fmt: str, depth: int, stream: bool, gate: bool, tmp_path: Path) -> tuple[int, bytes]:
    """The status and body a supervised agent gets when its model answers with a field ``depth`` lists deep."""
    async with serve_handler(DeepReplyUpstream(fmt, depth)) as url:
        config = Config(upstreams=(UpstreamConfig(name="deep", url=url),)).with_overrides(
            supervisor={"gate": GateConfig(enabled=gate)})
        async with running(config, port=0, store=Store(tmp_path / "state")) as rp:
            with trio.fail_after(20):
                reply, data = await raw_stream(rp.url + "/s/deep", fmt, orjson.dumps(request_body(fmt, stream=stream)))
    return reply.status_code, data


@ALL_FORMATS
@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("gate", [False, True], ids=["ungated", "gated"])
async def test_a_deeply_nested_answer_reaches_the_agent_whole(fmt: str, stream: bool, gate: bool,
                                                              tmp_path: Path) -> None:
    """orjson reads an answer nested up to 1,024 levels but writes only 255: an answer supervision rewrote (its
    self-report stripped) is written again at any depth it could read, never a 500 or an empty stream."""
    status, data = await deep_answer(fmt, 600, stream, gate, tmp_path)
    assert status == 200
    assert b"<sup>" not in data and b"done." in data
    assert data.count(b"[" * 600 + b'"deep"') >= 1


def many_tool_calls(fmt: str, n: int) -> dict[str, Any]:
    calls = [{"id": f"call_{i}", "type": "function",
              "function": {"name": "Bash", "arguments": orjson.dumps({"command": f"echo {i}"}).decode()}}
             for i in range(n)]
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Echo a lot."},
                {"role": "assistant", "content": "", "tool_calls": calls}]
    messages += [{"role": "tool", "tool_call_id": f"call_{i}", "content": str(i)} for i in range(n)]
    return BY_NAME[fmt].request_from_chat(messages, MODEL, False)


@MODES
@ALL_FORMATS
async def test_ten_thousand_tool_calls_in_one_message(fmt: str, supervised: bool, start_proxy,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    """A round of 10,000 calls and their 10,000 results (about 1.6 MB) is read in linear time: the bound below
    is a hang guard with room to spare (a quadratic pairing took 5-10 s here; linear takes about 0.3 s)."""
    body = many_tool_calls(fmt, 10_000)
    async with start_proxy(supervised=supervised) as rp:
        for _ in range(2):  # the second time, the session already holds the history
            with trio.fail_after(8):
                reply, data = await raw_stream(rp.url + "/s/many", fmt, body)
            assert reply.status_code == 200, data[:300]
        if supervised:
            assert [r["status"] for r in rp.pipeline.store.read_ledger("many")] == [200, 200]
            _first, second = rp.pipeline.sessions.get("many").supervision.records
            assert not second.rebuilt  # the same history again: read incrementally, not from scratch
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


async def test_huge_and_many_headers(proxy) -> None:
    """A request head up to 16 KiB always passes (h11's bound on a head still arriving); one far past it is
    refused with a 4xx, and the server goes on."""
    async with http_client(proxy.url) as client:
        for headers, status in (({"x-big": "a" * 12_000}, 200), ({f"x-h{i}": "v" for i in range(1_000)}, 200),
                                ({"x-big": "a" * 200_000}, 400), ({"authorization": "Bearer " + "k" * 500_000}, 400)):
            with trio.fail_after(10):
                reply = await client.post("/v1/chat/completions", json=request_body("chat"), headers=headers)
            assert reply.status_code == status, len(str(headers))
            assert orjson.loads(reply.content)
    reply, _ = await raw_stream(proxy.url, "chat", request_body("chat"))
    assert reply.status_code == 200


@pytest.mark.parametrize("raw, status", [
    (b'{"model": "m", "messages": [{"role": "user", "content": "\\ud800"}]}', 400),  # a lone surrogate
    (b'\xef\xbb\xbf{"model": "m", "messages": []}', 400),  # a byte order mark
    (b'{"model": "m", "max_tokens": 1e999, "messages": []}', 400),
    (b'{"model": "m", "messages": [{"role": "user", "content": "a\\u0000b"}]}', 200),
    (b'{"model": "m", "model": {"x": 1}, "messages": "hello", "stream": "yes"}', 200),
    (b'{"model": "m", "messages": [], "tools": 5, "metadata": [1], "user": 7}', 200),
    (b'{"messages": [{"role": "tool", "tool_call_id": null, "content": {"a": 1}}], "tool_choice": []}', 200),
    (b'{}', 200),
    (b'', 400),
    (b'   ', 400),
    (b'{"model": "m"} trailing', 400),
], ids=["lone-surrogate", "bom", "infinity", "nul", "wrong-types", "wrong-types-2", "odd-tool", "empty-object",
        "empty", "blank", "trailing"])
async def test_hand_made_bodies(raw: bytes, status: int, proxy, caplog: pytest.LogCaptureFixture) -> None:
    for fmt in FORMATS:
        with trio.fail_after(10):
            reply, data = await raw_stream(proxy.url + "/s/hand", fmt, raw)
        assert reply.status_code == status, (fmt, data[:300])
        if status >= 400:
            assert_error_shape(fmt, status, data)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


# ---- upstream SSE split at every byte -----------------------------------------------------------------------

TURN = AssistantTurn("Héllo wörld ✓ 🎉 — 日本語 and more text", (
    ToolCall("Bash", {"command": "grep -r 'ünïcode ✓' .", "note": "🔍"}, "call_u"),), 77, 13)


class OneByteRelay:
    """Stands in for :class:`~proxyvisor.proxy.relay.HttpRelay`: answers with ``payload`` as an SSE stream cut
    into pieces at ``cuts`` (every byte by default)."""

    api_key = None

    def __init__(self, payload: bytes, size: int = 1) -> None:
        self.payload = payload
        self.size = size

    async def send(self, method: str, target: str, headers: Any, body: bytes) -> UpstreamReply:
        return UpstreamReply(200, [(b"content-type", b"text/event-stream")], _Pieces(self.payload, self.size))


class _Pieces:
    error = None

    def __init__(self, payload: bytes, size: int) -> None:
        self.payload, self.size, self.last_chunk = payload, size, b""

    async def __aiter__(self):
        for i in range(0, len(self.payload), self.size):
            self.last_chunk = self.payload[i:i + self.size]
            yield self.last_chunk


async def through_pipeline(fmt: str, supervised: bool, payload: bytes, size: int, store: Store) -> bytes:
    config = Config(upstreams=(UpstreamConfig(name="up"),)).with_overrides(supervisor={"enabled": supervised})
    pipeline = Pipeline(config, {"up": OneByteRelay(payload, size)}, store if supervised else None)
    body = orjson.dumps(request_body(fmt, stream=True))
    request = Request("POST", path_of(fmt), [(b"content-type", b"application/json"),
                                             (b"x-proxyvisor-session", b"split-%d" % size)], body,
                      received_at=time.perf_counter())
    response = await pipeline(request)
    assert response.status == 200
    return b"".join([chunk async for chunk in response.body])


@MODES
@ALL_FORMATS
async def test_upstream_sse_split_at_every_byte_gives_the_same_answer(fmt: str, supervised: bool,
                                                                      tmp_path) -> None:
    """Inside multi-byte UTF-8 characters and CRLF pairs included: the relay passes the bytes through unchanged
    and the supervised path gives the same events and counts the same usage as for an unsplit stream."""
    payload = b"".join(BY_NAME[fmt].render_stream(TURN, MODEL, request_body(fmt, stream=True,
                                                                             stream_options={"include_usage": True})))
    payload = payload.replace(b"\n\n", b"\r\n\r\n", 2)  # CRLF endings too, for the first two events
    assert any(b >= 0xF0 for b in payload)  # four-byte characters are in there
    store = Store(tmp_path)
    whole = await through_pipeline(fmt, supervised, payload, len(payload), store)
    split = await through_pipeline(fmt, supervised, payload, 1, store)
    if supervised:
        assert [(e.event, e.data) for e in sse_events(split)] == [(e.event, e.data) for e in sse_events(whole)]
        (a,), (b,) = store.read_ledger(f"split-{len(payload)}"), store.read_ledger("split-1")
        assert (a["input_tokens"], a["output_tokens"]) == (b["input_tokens"], b["output_tokens"]) != (None, None)
        assert BY_NAME[fmt].assemble([(e.event, e.data) for e in sse_events(split)]).tool_calls == TURN.tool_calls
    else:
        assert split == whole == payload


@ALL_FORMATS
async def test_upstream_sse_split_at_random_points_over_real_sockets(fmt: str, start_proxy,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    """The same through real connections: the upstream writes 1-7 bytes at a time."""
    rng = random.Random(fmt)

    async def upstream(request: Request) -> Response:
        payload = b"".join(BY_NAME[fmt].render_stream(TURN, MODEL, orjson.loads(request.body)))

        async def dribble():
            i = 0
            while i < len(payload):
                n = rng.randint(1, 7)
                yield payload[i:i + n]
                i += n
                await trio.lowlevel.checkpoint()

        return Response(200, [(b"content-type", b"text/event-stream")], dribble())

    async with serve_handler(upstream) as url, start_proxy(upstream_url=url) as rp:
        with trio.fail_after(10):
            reply, data = await raw_stream(rp.url, fmt, request_body(fmt, stream=True))
    assert reply.status_code == 200
    turn = BY_NAME[fmt].assemble([(e.event, e.data) for e in sse_events(data)])
    assert (turn.text, turn.tool_calls) == (TURN.text, TURN.tool_calls)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


@ALL_FORMATS
async def test_an_answer_supervision_cannot_read_is_delivered_as_it_came_with_a_warning(
        fmt: str, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    status, data = await deep_answer(fmt, 2000, False, False, tmp_path)  # orjson reads 1,024 levels
    assert status == 200
    assert data.count(b"[" * 2000 + b'"deep"') == 1 and b"<sup>" in data
    assert any("not JSON proxyvisor reads" in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records)
