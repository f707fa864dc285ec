"""Helpers for the tests (not fixtures): servers on free ports, request bodies, and real-SDK calls.

``ask`` drives the real ``openai`` / ``anthropic`` SDKs and reduces their parsed answer to an :class:`Answer`, so
"direct" and "through proxyvisor" answers compare with ``==``.
"""

from __future__ import annotations

import json
import re
import socket
import ssl
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import orjson
import trio

from proxyvisor.config import Config, GateConfig
from proxyvisor.gate.outcome import naming
from proxyvisor.gate.verdict import Gap
from proxyvisor.proxy.formats import BY_NAME, AssistantTurn, WireFormat
from proxyvisor.proxy.server import (Handler, Limits, Request, Response, bound_port, open_listeners,
                                     serve_listeners)
from proxyvisor.proxy.service import RunningProxy, running
from proxyvisor.proxy.sse import Event, SSEParser
from proxyvisor.scripted.upstream import ScriptedUpstream
from proxyvisor.store import Store

FORMATS = ("chat", "messages", "responses")
MODEL = "scripted-model"
SYSTEM = "You are a terse assistant."
PROMPT = "List the files, please."
_SCHEMA = {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}

TOOL_STEP = {"text": "Let me look — 🔍 first.",
             "tool_calls": [{"name": "Bash", "arguments": {"command": "ls -la", "note": "ünïcode ✓"},
                             "id": "call_fixed_1"}],
             "input_tokens": 120, "output_tokens": 17}
"""An assistant turn with text and one tool call, with a fixed tool call id (so answers compare exactly)."""
TEXT_STEP = {"text": "Done: héllo wörld ✓ 🎉 three files.", "input_tokens": 200, "output_tokens": 9}
TWO_CALLS_STEP = {"tool_calls": [{"name": "Bash", "arguments": {"command": "pwd"}, "id": "call_fixed_a"},
                                 {"name": "Read", "arguments": {"path": "/etc/hostname"}, "id": "call_fixed_b"}]}


def fmt_of(name: str) -> WireFormat:
    return BY_NAME[name]


def path_of(name: str) -> str:
    return BY_NAME[name].path


def request_body(fmt: str, stream: bool = False, **extra: Any) -> dict[str, Any]:
    """A typical agent request in format ``fmt``: system prompt, one user message, a ``Bash`` tool."""
    if fmt == "chat":
        body: dict[str, Any] = {
            "model": MODEL,
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": PROMPT}],
            "tools": [{"type": "function", "function": {"name": "Bash", "description": "Run a command",
                                                        "parameters": _SCHEMA}}]}
    elif fmt == "messages":
        body = {"model": MODEL, "max_tokens": 256, "system": SYSTEM,
                "messages": [{"role": "user", "content": PROMPT}],
                "tools": [{"name": "Bash", "description": "Run a command", "input_schema": _SCHEMA}]}
    else:
        body = {"model": MODEL, "instructions": SYSTEM,
                "input": [{"role": "user", "content": PROMPT}],
                "tools": [{"type": "function", "name": "Bash", "description": "Run a command",
                           "parameters": _SCHEMA, "strict": False}]}
    if stream:
        body["stream"] = True
    body.update(extra)
    return body


def files_under(*roots: Path) -> list[Path]:
    """Every file and folder under ``roots`` (missing roots count as empty)."""
    return sorted(p for root in roots if root.exists() for p in root.rglob("*"))


def closed_port() -> int:
    """A loopback port that nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@asynccontextmanager
async def serve_handler(handler: Handler, limits: Limits | None = None) -> AsyncIterator[str]:
    """Serve any handler on a free loopback port; yields its base URL (``http://127.0.0.1:PORT``)."""
    listeners = await open_listeners("127.0.0.1", 0)
    async with trio.open_nursery() as nursery:
        await nursery.start(serve_listeners, listeners, handler, limits or Limits())
        try:
            yield f"http://127.0.0.1:{bound_port(listeners)}"
        finally:
            nursery.cancel_scope.cancel()


@dataclass
class ProxyRun:
    """A proxy running against a scripted upstream (:func:`scripted_proxy`), its store and the supervisor model
    double it calls (``model``: a gate's verifier, the authorizer's judge...)."""

    proxy: RunningProxy
    store: Store
    upstream: ScriptedUpstream
    model: Any

    def ledger(self) -> list[dict[str, Any]]:
        (session,) = self.store.sessions()
        return self.store.read_ledger(session)

    def last(self, key: str) -> dict[str, Any]:
        """The ``key`` object (``"gate"``, ``"authorizer"``...) of the last ledger line that has one."""
        found: dict[str, Any] = [line[key] for line in self.ledger() if key in line][-1]
        return found

    def upstream_bodies(self) -> list[dict[str, Any]]:
        return [orjson.loads(body) for _target, body, _headers in self.upstream.requests]


async def read_until_cut(response: Response, until: Callable[[], Awaitable[Any]]) -> None:
    """Read ``response``'s stream as a client does until ``until()`` returns, then leave: the reading task is
    cancelled, as the server's is when its client goes away (within 10 s, or the test fails)."""
    body = response.body
    assert not isinstance(body, bytes)

    async def read() -> None:
        async for _piece in body:
            pass

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(read)
            await until()
            nursery.cancel_scope.cancel()


@asynccontextmanager
async def scripted_proxy(tmp_path: Path, config: Config, steps: list[dict[str, Any]],
                         model: Any) -> AsyncIterator[ProxyRun]:
    """A proxy with ``config`` in front of a :class:`ScriptedUpstream` playing ``steps``, its store under
    ``tmp_path / "state"`` and ``model`` as its supervisor model."""
    upstream = ScriptedUpstream(steps)
    store = Store(tmp_path / "state")
    async with running(config, port=0, store=store, scripted={"scripted": upstream}, model=model) as proxy:
        yield ProxyRun(proxy, store, upstream, model)


def sse_events(data: bytes) -> list[Event]:
    """All complete SSE events in ``data``."""
    return SSEParser().feed(data)


def expected_notice(gate: dict[str, Any]) -> str:
    """The default unverified notice of an answer delivered not passed, by its request's ledger ``gate`` object:
    naming the first of its standing ``gaps`` when it has some."""
    notice = GateConfig().unverified_notice
    gaps = gate.get("gaps")
    return naming(notice, Gap(gaps[0], "")) if gaps else notice


def json_events(data: bytes) -> list[tuple[str | None, Any]]:
    """(event name, parsed data) of each SSE event; ``[DONE]`` stays a string."""
    return [(e.event, e.data if e.data == "[DONE]" else json.loads(e.data)) for e in sse_events(data)]


REPORT = ' <sup>{"state": "done", "focus": "f", "next": null, "carry": []}</sup>'


class HugeEventUpstream:
    """Streams a turn whose second word is ``size`` bytes of text ending in a newline, so that one delta event
    (and, in Responses, each event that repeats the whole text) is that big and is rewritten by the stripper (it
    holds the newline back), followed by a self-report. The stream is rendered before any request (it takes a
    while), and goes out 1 MiB at a time, as a network delivers it. ``full`` is the turn's text."""

    def __init__(self, fmt: str, size: int) -> None:
        self.full = "Here: " + "y" * size + "\n" + REPORT
        marker = "BIGWORD"  # (the marker, not the text, is rendered: rendering cuts a text into words)
        events = BY_NAME[fmt].render_stream(AssistantTurn(f"Here: {marker}{REPORT}"), MODEL,
                                            request_body(fmt, stream=True))
        self.data = b"".join(events).replace(marker.encode(), b"y" * size + b"\\n")

    async def __call__(self, request: Request) -> Response:
        async def play():
            for start in range(0, len(self.data), 1024 * 1024):
                yield self.data[start:start + 1024 * 1024]
                await trio.sleep(0)

        return Response(200, [(b"content-type", b"text/event-stream")], play())


_IDS = re.compile(rb'"(chatcmpl|msg|resp|fc)_?-?[0-9a-f]{24}"')
_TIMES = re.compile(rb'"(created|created_at)":\d+')


def without_generated_ids(data: bytes) -> bytes:
    """``data`` with the ids and timestamps the scripted upstream generates per response replaced by placeholders.

    Tool call ids are not replaced: the scripts give them explicitly.
    """
    return _TIMES.sub(rb'"\1":0', _IDS.sub(rb'"\1-ID"', data))


def assert_error_shape(fmt: str, status: int, body: bytes) -> dict[str, Any]:
    """Check ``body`` is ``fmt``'s JSON error shape; returns the inner error object."""
    obj = orjson.loads(body)
    if fmt == "messages":
        assert obj["type"] == "error", obj
        assert isinstance(obj["error"]["type"], str) and obj["error"]["message"], obj
    else:
        assert set(obj) == {"error"}, obj
        assert obj["error"]["message"] and isinstance(obj["error"]["type"], str), obj
        assert "param" in obj["error"] and "code" in obj["error"], obj
    return obj["error"]



def assert_ends_with_error_event(fmt: str, data: bytes) -> None:
    """The stream ``data`` ends with ``fmt``'s error event (for Responses, numbered right after the one before)."""
    events = json_events(data)
    name, last = events[-1]
    if fmt == "chat":
        assert name is None and last["error"]["message"], events[-1]
    elif fmt == "messages":
        assert name == "error" and last["type"] == "error" and last["error"]["type"], events[-1]
    else:
        assert name == "error" and last["type"] == "error" and last["message"], events[-1]
        assert last["sequence_number"] == events[-2][1]["sequence_number"] + 1

# ---- real SDK calls ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Answer:
    """An assistant answer as an SDK parsed it: text, tool calls as (id, name, arguments), and how it ended."""

    text: str
    tool_calls: tuple[tuple[str, str, dict[str, Any]], ...]
    stop: str | None


# Loading the CA bundle costs ~30 ms per client; every call here is plain HTTP on loopback, so share one context.
_TLS = ssl.create_default_context()


def openai_client(base_url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="sk-client-key", max_retries=0, timeout=15,
                              http_client=openai.DefaultAsyncHttpxClient(verify=_TLS))


def anthropic_client(base_url: str) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=base_url, api_key="sk-ant-client-key", max_retries=0, timeout=15,
                                    http_client=anthropic.DefaultAsyncHttpxClient(verify=_TLS))


def http_client(base_url: str = "") -> httpx.AsyncClient:
    """A plain httpx client that ignores proxy variables."""
    return httpx.AsyncClient(base_url=base_url, timeout=15, trust_env=False, verify=_TLS)


async def ask(fmt: str, base_url: str, *, stream: bool, headers: dict[str, str] | None = None) -> Answer:
    """Send :func:`request_body` ``fmt`` to ``base_url`` with the real SDK of that format; the parsed answer.

    Streams go through the SDKs' accumulating helpers, which check the event grammar as they build the answer.
    Raises whatever the SDK raises.
    """
    body = request_body(fmt)
    if fmt == "messages":
        async with anthropic_client(base_url) as client:
            if stream:
                async with client.messages.stream(**body, extra_headers=headers) as s:
                    m = await s.get_final_message()
            else:
                m = await client.messages.create(**body, extra_headers=headers)
        return Answer("".join(b.text for b in m.content if b.type == "text"),
                      tuple((b.id, b.name, b.input) for b in m.content if b.type == "tool_use"), m.stop_reason)
    async with openai_client(base_url) as client:
        if fmt == "chat":
            if stream:
                async with client.chat.completions.stream(**body, extra_headers=headers) as s:
                    async for _ in s:
                        pass
                    c = await s.get_final_completion()
            else:
                c = await client.chat.completions.create(**body, extra_headers=headers)
            m = c.choices[0].message
            return Answer(m.content or "", tuple((t.id, t.function.name, json.loads(t.function.arguments))
                                                 for t in m.tool_calls or ()), c.choices[0].finish_reason)
        if stream:
            async with client.responses.stream(**body, extra_headers=headers) as s:
                async for _ in s:
                    pass
                r = await s.get_final_response()
        else:
            r = await client.responses.create(**body, extra_headers=headers)
        calls = tuple((i.call_id, i.name, json.loads(i.arguments)) for i in r.output if i.type == "function_call")
        return Answer(r.output_text, calls, r.status)


async def raw_stream(base_url: str, fmt: str, body: dict[str, Any] | bytes,
                     headers: dict[str, str] | None = None) -> tuple[httpx.Response, bytes]:
    """POST ``body`` to ``fmt``'s path and read the whole reply (bytes exactly as sent on the wire)."""
    content = body if isinstance(body, bytes) else orjson.dumps(body)
    headers = {"content-type": "application/json", **(headers or {})}
    async with http_client() as client, client.stream("POST", base_url + path_of(fmt), content=content,
                                                      headers=headers) as r:
        data = b"".join([chunk async for chunk in r.aiter_raw()])
    return r, data


def task_count() -> int:
    """Tasks alive in the current trio run."""
    count, stack = 0, [trio.lowlevel.current_root_task()]
    while stack:
        task = stack.pop()
        count += 1
        for nursery in task.child_nurseries:
            stack.extend(nursery.child_tasks)
    return count


LITELLM_PROBE = """
import runpy, sys
sys.argv = ["proxyvisor", *sys.argv[1:]]
try:
    runpy.run_module("proxyvisor", run_name="__main__")
except SystemExit as exc:
    code = exc.code
else:
    code = 0
print("litellm imported" if any(m == "litellm" or m.startswith("litellm.") for m in sys.modules)
      else "litellm not imported", file=sys.stderr)
sys.exit(code)
"""
"""A script running ``proxyvisor ARGS...`` that prints, as its last stderr line, whether litellm was imported."""


def pairing_errors(fmt: str, body: dict[str, Any]) -> list[str]:
    """How the history of request ``body`` breaks its API's rules for tool calls and their results (empty: it
    keeps them), as the providers enforce them: Anthropic, each ``tool_result`` answers a ``tool_use`` of the
    assistant message right before it, which every one of its ``tool_use`` blocks gets, the results first in
    their message; Chat, an assistant message's ``tool_calls`` are all answered by the ``tool`` messages right
    after it, and only those; Responses, every call item has its output after it and no item id or call id
    comes twice."""
    errors: list[str] = []
    if fmt == "messages":
        messages = body["messages"]
        for n, message in enumerate(messages):
            content = message.get("content") if isinstance(message.get("content"), list) else []
            if message.get("role") == "assistant":
                uses = [b["id"] for b in content if b.get("type") == "tool_use"]
                after = messages[n + 1] if n + 1 < len(messages) else None
                given = after.get("content") if after and isinstance(after.get("content"), list) else []
                answered = [b["tool_use_id"] for b in given if b.get("type") == "tool_result"]
                if uses and after is not None and sorted(answered) != sorted(uses):
                    errors.append(f"message {n}: tool_use {uses} answered by {answered}")
            elif message.get("role") == "user":
                kinds = [b.get("type") for b in content]
                first_other = next((i for i, kind in enumerate(kinds) if kind != "tool_result"), len(kinds))
                if "tool_result" in kinds[first_other:]:
                    errors.append(f"message {n}: a tool_result after other content")
                before = messages[n - 1] if n else {}
                uses = [b.get("id") for b in (before.get("content") if isinstance(before.get("content"), list)
                                              else []) if b.get("type") == "tool_use"]
                for b in content:
                    if b.get("type") == "tool_result" and b["tool_use_id"] not in uses:
                        errors.append(f"message {n}: tool_result {b['tool_use_id']} answers no tool_use before it")
    elif fmt == "chat":
        messages = body["messages"]
        for n, message in enumerate(messages):
            if message.get("role") == "assistant" and message.get("tool_calls"):
                ids = [c["id"] for c in message["tool_calls"]]
                end = n + 1
                while end < len(messages) and messages[end].get("role") == "tool":
                    end += 1
                answered = [m["tool_call_id"] for m in messages[n + 1:end]]
                if sorted(answered) != sorted(ids):
                    errors.append(f"message {n}: tool_calls {ids} answered by {answered}")
            elif message.get("role") == "tool" and (n == 0 or messages[n - 1].get("role") not in ("assistant",
                                                                                                  "tool")):
                errors.append(f"message {n}: a tool message after a {messages[n - 1].get('role')} message")
    else:
        items = [i for i in body["input"] if isinstance(i, dict)]
        called: list[str] = []
        seen_ids: set[str] = set()
        for n, item in enumerate(items):
            if item.get("id"):
                if item["id"] in seen_ids:
                    errors.append(f"item {n}: duplicate id {item['id']}")
                seen_ids.add(item["id"])
            kind = str(item.get("type", ""))
            if kind.endswith("_call"):
                if item["call_id"] in called:
                    errors.append(f"item {n}: call {item['call_id']} made twice")
                called.append(item["call_id"])
                if not any(str(o.get("type", "")).endswith("_output") and o.get("call_id") == item["call_id"]
                           for o in items[n + 1:]):
                    errors.append(f"item {n}: call {item['call_id']} has no output after it")
            elif kind.endswith("_output") and item.get("call_id") not in called:
                errors.append(f"item {n}: output {item.get('call_id')} answers no call before it")
    return errors


def alive(pid: int) -> bool:
    """Whether process ``pid`` still runs 10 s from now at the latest: a signal takes effect when the process is
    next scheduled, not when ``kill`` returns. A zombie counts as dead (a container's init may never reap it)."""
    deadline = time.monotonic() + 10
    while True:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, IndexError):
            return False
        if state in ("Z", "X"):
            return False
        if time.monotonic() > deadline:
            return True
        time.sleep(0.01)
