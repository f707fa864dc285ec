"""The scripted upstream: a model endpoint that proxyvisor plays itself, in all three formats, with faults.

It is the built-in default upstream (no network, no API key), and the test double for everything else. Each
model request takes the next **step** of the script; when the script is used up it answers in *auto* mode, like a
tiny agent model: if the latest turn holds a tool result it answers with text, otherwise it calls one tool from
the request's own tool list, wherever it declares them (``WireFormat.tools``), and with no tools it answers with
text. It runs ``ls`` with a shell-like tool first (one named like a shell, or a freeform script tool that calls a
nested shell tool, such as Codex's ``exec``), called the way the tool is declared: a function tool with JSON
arguments from its schema, a freeform (``custom``) tool with a free-form input (for a script tool, a script
running the command).

A step is a JSON object, one of:

- ``{"text": "...", "tool_calls": [{"name": "Bash", "arguments": {"command": "ls"}, "id": "optional"}]}``: an
  assistant turn (either key may be omitted; a tool call to a name the request does not offer is sent anyway, but
  only to a request that offers some tool: one offering none gets an auto-mode answer, the step staying queued); a
  call with ``"input": "..."`` instead of ``arguments`` is a freeform (``custom``) tool call with that input, and a
  name ``NS.NAME`` calls tool NAME of namespace NS;
- ``{"text": ..., "tool_calls": [...], "until": "some text"}``: an assistant turn played again for every request
  until a request body contains ``until`` (matched against the raw JSON body, so use text without quotes or
  backslashes); that request gets the next step instead. It stands for a model that repeats itself until
  something in its input changes (the demo's looping agent, answering a steer note);
- ``{"fault": {...}}`` with one of ``"status": 429`` (plus optional ``"retry_after": "3"`` and
  ``"retry_after_ms": "1500"``, sent as they are; any 4xx/5xx works, 529 included), ``"first_byte_delay_s": 2.5``
  (then the next turn), ``"reset_after_events": 3`` (send 3 SSE events, then drop the connection without ending
  the chunked body), ``"stall_after_events": 3`` (send 3 events, then nothing for ``stall_s``, default 3600 s),
  ``"truncate_body": true`` (a non-streaming JSON body cut in half), ``"garbage": true`` (an SSE stream of
  undecodable events);
- ``{"condense": {"results": [...]}}``: the answer to the next condenser call (below), queued apart from the
  turns, so it never answers an agent's request.

Any turn or fault step may carry ``"marker": "[task:fix-calc]"``: it then belongs to the script of the
conversations whose requests contain that text (matched against the raw JSON body like ``until``, so ASCII text
without quotes or backslashes), played in order apart from the unmarked steps. A request containing a marker
(the first one queued that it contains) takes that marker's next step, or, once they are used up, an auto-mode
answer, never an unmarked step. So conversations running in parallel (``proxyvisor batch`` tasks, each prompt
carrying its own marker) each follow their own script.

A request carrying proxyvisor's own condenser prompt (``proxyvisor.condense.protocol``) takes no turn: it gets
the next ``condense`` step, or, with none queued, no verdict (:mod:`.condenser`: the deterministic condenser
decides). The verify-gate's verifier and refuter calls, the planner's, the tool authorizer's and learning's distill
call likewise get a fixed policy's answer (:mod:`.verifier`, :mod:`.planner`, :mod:`.authorizer`: the last a word
rule, blocking a call whose arguments name what a standing prohibition forbids; :mod:`.distiller`: nothing to
learn), in the call's own format: a call that forces a tool
(Anthropic's ``tool_choice: {"type": "tool"}``) gets that tool's call with the answer as its input, as a provider
answers it. So the supervisor model on the session's route, or ``[supervisor.model] api_base = "scripted:"``, is a
supervisor model with no key and no network.

A script file holds a JSON list of steps, or JSON lines. ``POST /_scripted/queue`` with a list of steps appends
them while the server runs (used by tests that drive real agent CLIs).
"""

from __future__ import annotations

import json
import logging
from collections import deque
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import orjson
import trio

from ..schema import json_kind
from ..config import SCRIPTED_MODEL
from ..proxy import estimate, tokenizers
from ..proxy.formats import BY_PATH, MESSAGES, AssistantTurn, ToolCall, ToolSpec, WireFormat
from ..proxy.formats.base import args_of
from ..proxy.formats.freeform import SHELL_TOOLS, command_input, runs_commands, split
from ..proxy.formats.freeform import arguments as freeform_arguments
from ..proxy.server import AbortConnection, Request, Response
from ..gate.verdict import json_object
from . import authorizer as scripted_authorizer
from . import distiller as scripted_distiller
from . import condenser as scripted_condenser
from . import planner as scripted_planner
from . import verifier as scripted_verifier

log = logging.getLogger("proxyvisor.scripted")

MODEL = SCRIPTED_MODEL
_JSON = [(b"content-type", b"application/json")]
_SSE = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]


class ScriptError(ValueError):
    """A script file or step is not valid; the message says which step and why."""


def parse_step(step: Any, where: str = "step") -> dict[str, Any]:
    """Validate one script step (see the module docstring). Raises ScriptError."""
    if not isinstance(step, dict):
        raise ScriptError(f"{where}: a step must be a JSON object, got {json_kind(step)}")
    unknown = set(step) - {"text", "tool_calls", "fault", "input_tokens", "output_tokens", "until", "condense",
                           "marker"}
    if unknown:
        raise ScriptError(f"{where}: unknown key(s) {sorted(unknown)}")
    if "condense" in step and (len(step) > 1 or not isinstance(step["condense"], dict)):
        raise ScriptError(f"{where}: a 'condense' step is one answer object and nothing else")
    if "fault" in step and not isinstance(step["fault"], dict):
        raise ScriptError(f"{where}: 'fault' must be an object")
    for key in ("until", "marker"):
        if key in step and (not isinstance(step[key], str) or not step[key]):
            raise ScriptError(f"{where}: '{key}' must be a non-empty string")
    for call in step.get("tool_calls") or ():
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            raise ScriptError(f"{where}: each tool call needs a 'name'")
        if not isinstance(call.get("arguments", {}), (dict, str)):
            raise ScriptError(f"{where}: tool call 'arguments' must be an object or a JSON string")
        if "input" in call and ("arguments" in call or not isinstance(call["input"], str)):
            raise ScriptError(f"{where}: a freeform tool call's 'input' is a string, given instead of 'arguments'")
    return step


def load_script(path: str | Path) -> list[dict[str, Any]]:
    """Read a script file: a JSON list of steps, or one step per line. Raises ScriptError or OSError."""
    text = Path(path).read_text(encoding="utf-8")
    stripped = text.lstrip()
    try:
        steps = json.loads(text) if stripped.startswith("[") else [json.loads(l) for l in text.splitlines() if l.strip()]
    except json.JSONDecodeError as exc:
        raise ScriptError(f"{path}: not JSON: {exc}") from None
    return [parse_step(s, f"{path}: step {i}") for i, s in enumerate(steps)]


def turn_of(step: dict[str, Any]) -> AssistantTurn:
    calls = [ToolCall(c["name"], freeform_arguments(c["name"], c["input"]), c.get("id", ""), "custom") if "input" in c
             else ToolCall(c["name"], args_of(c.get("arguments")), c.get("id", "")) for c in step.get("tool_calls") or ()]
    tokens_in, tokens_out = step.get("input_tokens"), step.get("output_tokens")
    return AssistantTurn(step.get("text", ""), tuple(calls), None if tokens_in is None else int(tokens_in),
                         None if tokens_out is None else int(tokens_out))


def _arguments_for(schema: dict[str, Any]) -> dict[str, Any]:
    props = schema.get("properties") if isinstance(schema, dict) else None
    props = props if isinstance(props, dict) else {}
    args: dict[str, Any] = {}
    for key in ("command", "cmd"):
        if key in props:
            args[key] = ["bash", "-lc", "ls"] if (props[key] or {}).get("type") == "array" else "ls"
            break
    if "description" in props:
        args["description"] = "List files in the current directory"
    for key in schema.get("required", ()) if isinstance(schema, dict) else ():
        if key not in args and key in props:
            kind = (props[key] or {}).get("type", "")
            args[key] = {"string": ".", "integer": 1, "number": 1, "boolean": False, "array": [], "object": {}}.get(kind, ".")
    return args


def _answers_a_tool_result(fmt: WireFormat, body: dict[str, Any]) -> bool:
    """Whether the latest turn holds a tool result, reading past proxyvisor's own notes after it (a steer note or a
    recitation sent as a user message of its own), which a model reads as context, not as a new request."""
    if fmt.ends_with_tool_result(body):
        return True
    for item in reversed(fmt.history(body)):
        message = fmt.message(item)
        if message.role == "user" and message.text.lstrip().startswith("<supervisor-note"):
            continue
        return message.role == "tool"
    return False


def auto_turn(fmt: WireFormat, body: dict[str, Any]) -> AssistantTurn:
    """What the scripted model says with no script step left (see the module docstring)."""
    if _answers_a_tool_result(fmt, body):
        return AssistantTurn("Done: I ran the tool and read its output.")
    tools: list[ToolSpec] = fmt.tools(body)
    if not tools:
        return AssistantTurn("Hello from the scripted upstream.")
    chosen = next((t for t in tools if split(t.name)[1].lower() in SHELL_TOOLS or runs_commands(t)), None)
    if chosen is None:
        chosen = next((t for t in tools if "command" in ((t.schema or {}).get("properties") or {})), None) \
            or next((t for t in tools if t.kind in ("function", "custom")), tools[0])
    if chosen.kind == "custom":
        text = command_input(chosen, "ls")
        call = ToolCall(chosen.name, freeform_arguments(chosen.name, text), kind="custom")
    else:
        call = ToolCall(chosen.name, _arguments_for(chosen.schema))
    return AssistantTurn("I will look around first.", (call,))


class ScriptedUpstream:
    """An HTTP handler that plays a script; serve it with :func:`proxyvisor.proxy.server.serve_listeners`.

    ``chunk_delay_ms`` spaces SSE events (ms) for realistic streaming. ``requests`` records each model request
    body as received (bytes), for tests, ``condenser_requests`` each condenser call's body and
    ``supervisor_requests`` each other supervisor model call's (verifier, refuter, planner).
    """

    def __init__(self, steps: list[dict[str, Any]] | None = None, chunk_delay_ms: float = 0.0,
                 record: bool = True) -> None:
        self.steps: deque[dict[str, Any]] = deque()
        self.condense_steps: deque[dict[str, Any]] = deque()
        self.marked: dict[str, deque[dict[str, Any]]] = {}
        """Each marker's own script (module docstring), in the order the markers were first queued."""
        self.queue(*steps or ())
        self.chunk_delay_s = chunk_delay_ms / 1000
        self.record = record
        self.requests: list[tuple[str, bytes, dict[str, str]]] = []
        self.condenser_requests: list[bytes] = []
        self.supervisor_requests: list[bytes] = []
        self.responses: list[bytes] = []

    def queue(self, *steps: dict[str, Any]) -> None:
        for step in map(parse_step, steps):
            if "condense" in step:
                self.condense_steps.append(step)
            elif "marker" in step:
                self.marked.setdefault(step["marker"], deque()).append(step)
            else:
                self.steps.append(step)

    async def __call__(self, request: Request) -> Response:
        path = request.path
        if request.method == "HEAD":
            return Response(200)
        if path == "/_scripted/queue" and request.method == "POST":
            try:
                steps = orjson.loads(request.body)
                self.queue(*(steps if isinstance(steps, list) else [steps]))
            except (orjson.JSONDecodeError, ScriptError) as exc:
                return Response(400, _JSON, orjson.dumps({"error": {"message": str(exc)}}))
            return Response(200, _JSON, orjson.dumps({"queued": len(self.steps)}))
        if path == "/v1/models":
            return Response(200, _JSON, orjson.dumps({"object": "list", "data": [
                {"id": MODEL, "object": "model", "created": 0, "owned_by": "proxyvisor", "type": "model",
                 "display_name": "Scripted model"}]}))
        counting = path == "/v1/messages/count_tokens"
        fmt = MESSAGES if counting else BY_PATH.get(path)
        if fmt is None:
            return Response(404, _JSON, orjson.dumps({"error": {"message": f"no route {path}", "type": "not_found_error"}}))
        try:
            body = orjson.loads(request.body)
            if not isinstance(body, dict):
                raise ValueError(f"the body must be a JSON object, got {json_kind(body)}")
        except ValueError as exc:
            return Response(400, _JSON, fmt.error_body(400, f"invalid JSON body: {exc}"))
        if counting:
            # 0 like its answers' usage: Claude Code prices this count when an answer reports no tokens.
            return Response(200, _JSON, orjson.dumps({"input_tokens": 0}))
        answer = policy(fmt, body)
        if answer is not None:  # counted below: the encoding is loaded off the event loop, which this shares
            await tokenizers.loaded(estimate.encoding)
        if answer is scripted_condenser.answer:  # a queued ``condense`` step comes first
            return self._supervisor_answer(fmt, body, self._condense, self.condenser_requests, request.body)
        if answer is not None:
            return self._supervisor_answer(fmt, body, answer, self.supervisor_requests, request.body)
        if self.record:
            self.requests.append((request.target, request.body,
                                  {k.decode(): v.decode("latin-1") for k, v in request.headers}))
        offers_tools = bool(fmt.tools(body))
        step = self._next_step(request.body, offers_tools)
        fault = (step or {}).get("fault") or {}
        if fault.get("first_byte_delay_s"):
            await trio.sleep(float(fault["first_byte_delay_s"]))
            step = self._next_step(request.body, offers_tools)
            fault = (step or {}).get("fault") or {}
        if "status" in fault:
            status = int(fault["status"])
            headers = list(_JSON)
            for key, header in (("retry_after", b"retry-after"), ("retry_after_ms", b"retry-after-ms")):
                if key in fault:
                    headers.append((header, str(fault[key]).encode()))
            return Response(status, headers, fmt.error_body(status, fault.get("message", f"scripted {status}")))
        try:
            turn = turn_of(step) if step and not fault else auto_turn(fmt, body)
        except _UNREADABLE as exc:
            return _refuse(fmt, exc)
        model = _model(body)
        if fault.get("truncate_body"):
            data = orjson.dumps(fmt.render(turn, model))
            return Response(200, _JSON + [(b"content-length", str(len(data)).encode())],
                            _abort_after([data[: len(data) // 2]]))
        if not body.get("stream"):
            data = orjson.dumps(fmt.render(turn, model))
            if self.record:
                self.responses.append(data)
            return Response(200, _JSON, data)
        try:
            events = fmt.render_stream(turn, model, body)
        except _UNREADABLE as exc:
            return _refuse(fmt, exc)
        if fault.get("garbage"):
            return Response(200, _SSE, self._play([b"event: ???\ndata: {not json\xff\xfe\n\n", b"data: \x00\x01\n\n"]))
        if "reset_after_events" in fault:
            return Response(200, _SSE, _abort_after(events[: int(fault["reset_after_events"])], self.chunk_delay_s))
        if "stall_after_events" in fault:
            n = int(fault["stall_after_events"])
            return Response(200, _SSE, self._play(events[:n] + events[n:], stall_at=n,
                                                  stall_s=float(fault.get("stall_s", 3600))))
        if self.record:
            self.responses.append(b"".join(events))
        return Response(200, _SSE, self._play(events))

    def _condense(self, fmt: WireFormat, body: dict[str, Any]) -> str:
        """The answer to a condenser call: the next queued ``condense`` step, else no verdict."""
        return (orjson.dumps(self.condense_steps.popleft()["condense"]).decode() if self.condense_steps
                else scripted_condenser.answer(fmt, body))

    def _supervisor_answer(self, fmt: WireFormat, body: dict[str, Any],
                           answer: Callable[[WireFormat, dict[str, Any]], str], record: list[bytes],
                           raw: bytes) -> Response:
        """A JSON answer to one of proxyvisor's own supervisor model calls; ``raw`` is recorded in ``record``."""
        if self.record:
            record.append(raw)
        try:
            text = answer(fmt, body)
        except _UNREADABLE as exc:
            return _refuse(fmt, exc)
        # No client prices these calls (proxyvisor makes them): their usage is counted with tiktoken, so that the
        # supervisor model's figures in the ledger and summaries are the calls' real sizes.
        tokens_in, tokens_out = estimate.input_tokens(fmt, body), estimate.count(text)
        forced = _forced_tool(body)
        try:
            # A forced tool is answered as a provider does: with that tool's call, the answer as its input.
            turn = AssistantTurn("", (ToolCall(forced, json_object(text)),), tokens_in, tokens_out) if forced \
                else AssistantTurn(text, (), tokens_in, tokens_out)
        except ValueError:  # a policy answer that is not a JSON object stays text
            turn = AssistantTurn(text, (), tokens_in, tokens_out)
        return Response(200, _JSON, orjson.dumps(fmt.render(turn, _model(body))))

    def _next_step(self, body: bytes, offers_tools: bool) -> dict[str, Any] | None:
        """The step for a request with ``body``: the first one queued on the script it plays (that of the first
        marker it contains, else the unmarked steps), which an ``until`` step stays until ``body`` contains its
        text. A step that calls tools waits for a request that ``offers_tools`` (None meanwhile: an auto-mode
        answer), as no model calls a tool it was not offered: an agent's side request (opencode's session title,
        sent beside the turn's first request with the same prompt) does not take the turn's step."""
        steps = next((s for marker, s in self.marked.items() if marker.encode() in body), self.steps)
        while steps and "until" in steps[0]:
            if steps[0]["until"].encode() not in body:
                break
            steps.popleft()
        if not steps or (steps[0].get("tool_calls") and not offers_tools):
            return None
        return steps[0] if "until" in steps[0] else steps.popleft()

    async def _play(self, events: list[bytes], stall_at: int = -1, stall_s: float = 0.0) -> AsyncIterator[bytes]:
        for i, event in enumerate(events):
            if i == stall_at:
                await trio.sleep(stall_s)
            if self.chunk_delay_s and i:
                await trio.sleep(self.chunk_delay_s)
            yield event


_POLICIES = (scripted_condenser, scripted_verifier, scripted_planner, scripted_authorizer, scripted_distiller)
"""Fixed answers to proxyvisor's own supervisor model calls (each module has ``MARKS``, the prefixes its calls'
system prompts start with, and ``answer(fmt, body)``)."""


def policy(fmt: WireFormat, body: dict[str, Any]) -> Callable[[WireFormat, dict[str, Any]], str] | None:
    """The ``answer`` function of the fixed policy whose call ``body`` (a request in ``fmt``) is, recognised by its
    system prompt (:data:`_POLICIES`); None for any other request."""
    system = fmt.fingerprint_parts(body)[0]
    return next((p.answer for p in _POLICIES if system.startswith(p.MARKS)), None)


def _forced_tool(body: dict[str, Any]) -> str | None:
    """The tool a request forces the model to call: Anthropic's ``tool_choice: {"type": "tool", "name"}``, chat's
    ``{"type": "function", "function": {"name"}}``, Responses' ``{"type": "function", "name"}``."""
    choice = body.get("tool_choice")
    if not isinstance(choice, dict) or choice.get("type") not in ("tool", "function"):
        return None
    named = given if isinstance(given := choice.get("function"), dict) else choice
    return name if isinstance(name := named.get("name"), str) else None


def _model(body: dict[str, Any]) -> str:
    """The model a response names: the request's, else :data:`MODEL`."""
    return body["model"] if isinstance(body.get("model"), str) else MODEL


_UNREADABLE = (AttributeError, IndexError, KeyError, TypeError, ValueError)
"""What reading a request of unexpected shape raises; a real API answers such a request with a 400."""


def _refuse(fmt: WireFormat, exc: Exception) -> Response:
    return Response(400, _JSON, fmt.error_body(400, f"the scripted upstream cannot read this request "
                                                    f"({type(exc).__name__}: {exc})"))


async def _abort_after(chunks: list[bytes], delay_s: float = 0.0) -> AsyncIterator[bytes]:
    for chunk in chunks:
        if delay_s:
            await trio.sleep(delay_s)
        yield chunk
    raise AbortConnection("scripted reset")

