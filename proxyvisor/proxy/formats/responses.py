"""OpenAI Responses (``POST /v1/responses``): named SSE events with an increasing ``sequence_number``."""

from __future__ import annotations

import re
import secrets
from collections.abc import Callable, Collection, Iterator
from typing import Any


from .base import (AssistantTurn, ByIdentity, CallResult, Graft, ToolCall, ToolSpec, Usage, WireFormat, beside, chat_text,
                   dumps, edit_parts, arguments_of, as_list, error_types, event_object, has_non_text, interleave,
                   edited, keep_scan, leading_system, notes_after, resumed, split_json, sse, sse_json, words,
                   openai_error_body, openai_error_code)
from . import largejson
from .freeform import arguments as freeform_arguments
from .freeform import DEFAULT_NAMESPACE, input_of, qualified, result_text, split
from ...transcript import (Message, StreamEditor, StreamSplice, TextEdit, TextFilter, ToolOutput, ToolUse,
                           harness_context)

_SEQ = re.compile(rb'"sequence_number"\s*:\s*(\d+)')
_HEAD_EVENTS = frozenset({"response.created", "response.queued", "response.in_progress"})
_FINAL_EVENTS = frozenset({"response.completed", "response.incomplete", "response.failed"})
_RESPONSE_EVENTS = _HEAD_EVENTS | _FINAL_EVENTS
HOSTED_CALLS = frozenset({"web_search_call", "file_search_call", "code_interpreter_call", "image_generation_call",
                          "mcp_call", "mcp_list_tools"})
"""Call items of tools the API runs itself: their results come with the response, so the client runs nothing and
a reply holding only these (and text) ends the turn. In a history they are no action of the agent's."""


def call_of(item: Any) -> ToolCall | None:
    """The call a Responses output or input item makes for the client to run, or None (a message, a reasoning
    item, a result, a hosted call: :data:`HOSTED_CALLS`).

    ``function_call`` (JSON ``arguments``) and ``custom_tool_call`` (a freeform ``input``,
    :func:`~.freeform.arguments`) are named with their ``namespace`` (:func:`~.freeform.qualified`). Any other
    ``*_call`` item (``local_shell_call``, ``computer_call``, ``shell_call``, ``apply_patch_call``, types still to
    come) is named after its type without ``_call`` (or its ``name``), and its arguments are its ``action`` and
    ``operation`` objects' fields, its ``arguments`` and its ``input``, with a ``commands`` list also read as one
    ``command`` (one per line)."""
    if not isinstance(item, dict):
        return None
    kind = item.get("type")
    if not isinstance(kind, str) or not kind.endswith("_call") or kind in HOSTED_CALLS:
        return None
    call_id = str(item.get("call_id") or item.get("id") or "")
    if kind in ("function_call", "custom_tool_call"):
        name = qualified(item.get("namespace"), str(item.get("name") or ""))
        if kind == "function_call":
            return ToolCall(name, arguments_of(item.get("arguments")), call_id, item=item)
        text = item.get("input")
        return ToolCall(name, freeform_arguments(name, text if isinstance(text, str) else ""), call_id, "custom",
                        item)
    base = kind[:-len("_call")]
    args: dict[str, Any] = {}
    for key in ("action", "operation"):
        if isinstance(item.get(key), dict):
            args.update(item[key])
    args.update(arguments_of(item.get("arguments")))
    if isinstance(item.get("input"), str):
        args["input"] = item["input"]
    commands = args.get("commands")
    if "command" not in args and isinstance(commands, list) and all(isinstance(c, str) for c in commands):
        args["command"] = "\n".join(commands)
    given = item.get("name")
    return ToolCall(given if isinstance(given, str) and given else base, args, call_id, base, item)


def _call_id(item: Any) -> str:
    return str(item.get("call_id") or item.get("id") or "") if isinstance(item, dict) else ""


def _note(text: str) -> dict[str, Any]:
    """A user-side note as an input item."""
    return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}


def _is_result(item: Any) -> bool:
    """Whether a Responses input item is the result of a call (``function_call_output``,
    ``custom_tool_call_output``, ``local_shell_call_output``, any ``*_output`` with a ``call_id``)."""
    return isinstance(item, dict) and str(item.get("type", "")).endswith("_output") \
        and isinstance(item.get("call_id"), str)


def _result_text(output: Any) -> str:
    """A result's ``output`` as text: a string, or the text parts of a list (Codex's
    ``custom_tool_call_output``, each read by :func:`.freeform.result_text`); other shapes (a ``shell_call_output``'s list of outcomes, a computer screenshot)
    as JSON, so the exit codes in them stay readable."""
    if isinstance(output, str):
        return output
    if isinstance(output, list) and any(isinstance(p, dict) and isinstance(p.get("text"), str) for p in output):
        return "\n".join(result_text(p["text"]) for p in output
                         if isinstance(p, dict) and isinstance(p.get("text"), str))
    return "" if output is None else dumps(output).decode()


def _into_default_namespace(declared: list[Any], new: list[dict[str, Any]]) -> list[Any]:
    """``declared`` (a ``tools`` list) with ``new`` added to its default namespace, or at its end without one."""
    for index, tool in enumerate(declared):
        if isinstance(tool, dict) and tool.get("type") == "namespace" and tool.get("name") == DEFAULT_NAMESPACE \
                and isinstance(tool.get("tools"), list):
            return [*declared[:index], {**tool, "tools": tool["tools"] + new}, *declared[index + 1:]]
    return declared + new


def _specs(declared: list[Any], namespace: str | None) -> list[ToolSpec]:
    """The tools of a ``tools`` list, namespaces opened (their tools named :func:`~.freeform.qualified`)."""
    out: list[ToolSpec] = []
    for tool in declared:
        if not isinstance(tool, dict) or not isinstance(tool.get("type"), str):
            continue
        kind, name = tool["type"], tool.get("name")
        about = text if isinstance(text := tool.get("description"), str) else ""
        if kind == "namespace":
            if isinstance(name, str) and name:
                out += _specs(as_list(tool.get("tools")), name)
        elif kind in ("function", "custom"):
            if isinstance(name, str) and name:
                schema = tool.get("parameters") if kind == "function" else None
                out.append(ToolSpec(qualified(namespace, name), schema if isinstance(schema, dict) else {}, about,
                                    kind))
        else:  # a built-in tool type: web_search, local_shell, computer_use_preview, mcp...
            out.append(ToolSpec(name if isinstance(name, str) and name else kind, {}, about, kind))
    return out


_TOOLS = ByIdentity()
""":func:`_declared` by the ``tools`` list, which the requests of a session repeat."""


def _declared(tools: Any) -> list[ToolSpec]:
    """The tools of a request's top-level ``tools`` (:func:`_specs`)."""
    return _specs(as_list(tools), None)


def _additional_tools(items: list[Any]) -> list[Any]:
    """The tools declared by the ``additional_tools`` items of history ``items``, in order; a history that only grew
    since the last request is read from its new items on (:func:`~.base.resumed`)."""
    start, found = resumed(items, "additional_tools")
    tools: list[Any] = found if found is not None else []
    for item in items[start:]:
        if isinstance(item, dict) and item.get("type") == "additional_tools":
            tools += as_list(item.get("tools"))
    keep_scan(items, "additional_tools", tools)
    return tools


class ResponsesFormat(WireFormat):
    name = "responses"
    path = "/v1/responses"
    label = "OpenAI Responses"
    stream_end = (b"response.completed", b"response.failed", b"response.incomplete", b"event: error", b"event:error",
                  b'"type":"error"', b'"type": "error"')
    history_field = "input"
    result_part_type = "input_text"

    def error_body(self, status: int, message: str, code: str | None = None) -> bytes:
        return openai_error_body(status, message, code)

    def stream_error(self, status: int, message: str, last_chunk: bytes = b"") -> bytes:
        found = _SEQ.findall(last_chunk)
        seq = int(found[-1]) + 1 if found else 0
        kind, code = error_types(status)[0], openai_error_code(status)
        # The documented ``error`` event has code and message at the top level, but the openai SDK raises only on
        # an event whose data holds an ``error`` object, so the details are repeated there.
        return sse(dumps({"type": "error", "code": code, "message": message, "param": None, "sequence_number": seq,
                          "error": {"type": kind, "code": code, "message": message}}), "error")

    def session_hint(self, body: dict[str, Any]) -> str | None:
        for key in ("prompt_cache_key", "user"):
            value = body.get(key)
            if isinstance(value, str) and value:
                return value
        return None

    def fingerprint_parts(self, body: dict[str, Any]) -> tuple[str, str]:
        system = instructions if isinstance(instructions := body.get("instructions"), str) else ""
        items = body.get("input")
        if isinstance(items, str):
            return system, items
        users = []
        for item in as_list(items):
            if not isinstance(item, dict):
                continue
            role = item.get("role")
            if role in ("system", "developer") and not system:
                system = chat_text(item.get("content"))
            elif role == "user":
                users.append(chat_text(item.get("content")))
                if not harness_context(users[-1]):
                    break
        return system, "\n".join(users)

    def tools(self, body: dict[str, Any]) -> list[ToolSpec]:
        """The top-level ``tools`` and those of every ``additional_tools`` input item (Codex with its default
        model declares its tools there), namespaces opened (:func:`_specs`)."""
        items = body.get("input")
        extra = _additional_tools(items) if isinstance(items, list) else []
        declared: list[ToolSpec] = _TOOLS.get(body.get("tools"), _declared)
        return declared + _specs(extra, None)

    def ends_with_tool_result(self, body: dict[str, Any]) -> bool:
        items = body.get("input")
        if not isinstance(items, list):
            return False
        for item in reversed(items):
            if not isinstance(item, dict):
                continue
            if str(item.get("type", "")).endswith("_output"):
                return True
            if item.get("role") == "user":
                return False
        return False

    def usage(self, response: dict[str, Any]) -> Usage:
        u = response.get("usage") or {}
        return Usage(u.get("input_tokens"), u.get("output_tokens"))

    def stream_usage(self, event: str | None, data: dict[str, Any]) -> Usage | None:
        if data.get("type") in ("response.completed", "response.incomplete", "response.failed"):
            return self.usage(data.get("response") or {})
        return None

    def request_from_chat(self, messages: list[dict[str, Any]], model: str, stream: bool,
                          tools: tuple[ToolSpec, ...] = ()) -> dict[str, Any]:
        items: list[dict[str, Any]] = []
        for m in messages:
            role, text = m.get("role"), chat_text(m.get("content"))
            if role in ("system", "user"):
                items.append({"type": "message", "role": "developer" if role == "system" else "user",
                              "content": [{"type": "input_text", "text": text}]})
            elif role == "tool":
                items.append({"type": "function_call_output", "call_id": m.get("tool_call_id", ""), "output": text})
            elif role == "assistant":
                if text:
                    items.append({"type": "message", "role": "assistant",
                                  "content": [{"type": "output_text", "text": text}]})
                for c in m.get("tool_calls") or ():
                    items.append({"type": "function_call", "call_id": c.get("id", ""), "name": c["function"]["name"],
                                  "arguments": c["function"].get("arguments") or "{}"})
        body: dict[str, Any] = {"model": model, "input": items, "stream": stream, "store": False}
        if tools:
            body["tools"] = [{"type": "function", "name": t.name, "parameters": t.schema} for t in tools]
        return body

    def parse_response(self, response: dict[str, Any]) -> AssistantTurn:
        text, calls = [], []
        for item in response.get("output") or ():
            if item.get("type") == "message":
                text += [p.get("text", "") for p in item.get("content") or () if p.get("type") == "output_text"]
            elif (call := call_of(item)) is not None:
                calls.append(call)
        return AssistantTurn("".join(text), tuple(calls))

    def _output(self, turn: AssistantTurn) -> list[dict[str, Any]]:
        output: list[dict[str, Any]] = []
        if turn.text:
            output.append({"id": "msg_" + secrets.token_hex(12), "type": "message", "status": "completed",
                           "role": "assistant",
                           "content": [{"type": "output_text", "text": turn.text, "annotations": []}]})
        for call in turn.tool_calls:
            if isinstance(call.item, dict):  # read from a response: written back as it came
                output.append(dict(call.item))
                continue
            namespace, name = split(call.name)
            custom = call.kind == "custom"
            item = {"id": ("ctc_" if custom else "fc_") + secrets.token_hex(12),
                    "type": "custom_tool_call" if custom else "function_call", "status": "completed",
                    "call_id": call.id or "call_" + secrets.token_hex(12), "name": name}
            if namespace is not None:
                item["namespace"] = namespace
            if custom:
                item["input"] = input_of(call.arguments)
            else:
                item["arguments"] = dumps(call.arguments).decode()
            output.append(item)
        return output

    def _response(self, turn: AssistantTurn, model: str, output: list[dict[str, Any]], status: str,
                  rid: str, created: int) -> dict[str, Any]:
        i, o = turn.usage
        return {"id": rid, "object": "response", "created_at": created, "status": status, "model": model,
                "output": output, "parallel_tool_calls": True, "tool_choice": "auto", "tools": [],
                "usage": {"input_tokens": i, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": o,
                          "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": i + o}
                if status == "completed" else None}

    def render(self, turn: AssistantTurn, model: str) -> dict[str, Any]:
        return self._response(turn, model, self._output(turn), "completed", "resp_" + secrets.token_hex(12), self.now())

    def render_stream(self, turn: AssistantTurn, model: str, request: dict[str, Any]) -> list[bytes]:
        rid, created = "resp_" + secrets.token_hex(12), self.now()
        output = self._output(turn)
        events: list[bytes] = []

        def emit(kind: str, **fields: Any) -> None:
            events.append(sse(dumps({"type": kind, "sequence_number": len(events), **fields}), kind))

        emit("response.created", response=self._response(turn, model, [], "in_progress", rid, created))
        emit("response.in_progress", response=self._response(turn, model, [], "in_progress", rid, created))
        for index, item in enumerate(output):
            if item["type"] == "message":
                text = item["content"][0]["text"]
                emit("response.output_item.added", output_index=index,
                     item={**item, "status": "in_progress", "content": []})
                emit("response.content_part.added", item_id=item["id"], output_index=index, content_index=0,
                     part={"type": "output_text", "text": "", "annotations": []})
                for w in words(text):
                    emit("response.output_text.delta", item_id=item["id"], output_index=index, content_index=0,
                         delta=w, logprobs=[])
                emit("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                     text=text, logprobs=[])
                emit("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                     part=item["content"][0])
            elif item["type"] == "custom_tool_call" and isinstance(item.get("input"), str):
                emit("response.output_item.added", output_index=index,
                     item={**item, "status": "in_progress", "input": ""})
                emit("response.custom_tool_call_input.delta", item_id=item.get("id"), output_index=index,
                     delta=item["input"])
                emit("response.custom_tool_call_input.done", item_id=item.get("id"), output_index=index,
                     input=item["input"])
            elif item["type"] == "function_call" and isinstance(item.get("arguments"), str):
                emit("response.output_item.added", output_index=index,
                     item={**item, "status": "in_progress", "arguments": ""})
                for part in split_json(item["arguments"]):
                    emit("response.function_call_arguments.delta", item_id=item.get("id"), output_index=index,
                         delta=part)
                emit("response.function_call_arguments.done", item_id=item.get("id"), output_index=index,
                     arguments=item["arguments"])
            else:  # a call of a built-in type (local_shell_call, computer_call...): the item whole, added then done
                emit("response.output_item.added", output_index=index, item={**item, "status": "in_progress"})
            emit("response.output_item.done", output_index=index, item=item)
        emit("response.completed", response=self._response(turn, model, output, "completed", rid, created))
        return events


    # ---- supervision --------------------------------------------------------------------------------------
    def history(self, body: dict[str, Any]) -> list[Any]:
        items = body.get("input")
        if isinstance(items, str):  # a bare prompt: one user message (insert_notes makes it a list)
            return [{"type": "message", "role": "user", "content": items}]
        return items if isinstance(items, list) else []

    def read_message(self, item: Any) -> Message:
        if not isinstance(item, dict):
            return Message("other")
        kind, role = item.get("type"), item.get("role")
        if kind in (None, "message"):
            text = chat_text(item.get("content"))
            if role in ("system", "developer"):
                return Message("system", text)
            return Message(role, text) if role in ("user", "assistant") else Message("other")
        call = call_of(item)
        if call is not None:
            return Message("assistant", tool_uses=(ToolUse(call.id, call.name, call.arguments),))
        if _is_result(item):
            output = item.get("output")
            return Message("tool", tool_outputs=(ToolOutput(item["call_id"], _result_text(output), None,
                                                            has_non_text(output) or isinstance(output, dict)),))
        return Message("other")

    def add_instruction(self, body: dict[str, Any], text: str) -> None:
        instructions = body.get("instructions")
        if isinstance(instructions, str) and instructions:
            body["instructions"] = f"{instructions}\n\n{text}"
            return
        # Codex sends no instructions but developer messages first in its input: their end is the prompt's end.
        items = body.get("input")
        at = leading_system(items) if isinstance(items, list) else None
        if at is None or not isinstance(items, list):
            body["instructions"] = text
            return
        last = items[at]
        # A copy in the item's place: the agent's item may be shared with later requests (base.Item).
        content = last.get("content")
        if isinstance(content, list):
            items[at] = edited(last, ("instruction", text),
                               lambda: {**last, "content": [*content, {"type": "input_text", "text": text}]})
        elif isinstance(content, str) or content is None:
            items[at] = edited(last, ("instruction", text),
                               lambda: {**last, "content": f"{content}\n\n{text}" if content else text})

    def insert_notes(self, body: dict[str, Any], notes: list[tuple[int, str]]) -> None:
        if notes:
            items = self.history(body)
            body["input"] = interleave(items, notes_after(items, notes, _note))

    def result_slots(self, item: Any) -> Iterator[tuple[dict[str, Any], str, Any]]:
        if _is_result(item):
            yield item, "output", item.get("call_id")

    def edit_response(self, response: dict[str, Any], edit: TextEdit) -> None:
        for item in as_list(response.get("output")):
            if isinstance(item, dict) and item.get("type") == "message":
                _edit_message(item, edit)

    def limit_key(self, completion_tokens: bool) -> str:
        return "max_output_tokens"

    def ask_effort(self, body: dict[str, Any], effort: str) -> None:
        body["reasoning"] = {"effort": effort}

    def ask_schema(self, body: dict[str, Any], name: str, schema: dict[str, Any]) -> None:
        body["text"] = {"format": {"type": "json_schema", "name": name, "schema": schema, "strict": False}}

    def append_text(self, response: dict[str, Any], text: str) -> None:
        output = response.get("output")
        if not isinstance(output, list):
            return
        if (part := _last_text_part(output)) is not None:
            part["text"] += "\n\n" + text
        else:
            output.append(self._output(AssistantTurn(text))[0])

    def stream_editor(self, new_filter: Callable[[], TextFilter], edit: TextEdit) -> StreamEditor:
        return _ResponsesStream(new_filter, edit)


    # ---- continuing a turn --------------------------------------------------------------------------------
    def add_tools(self, body: dict[str, Any], tools: list[ToolSpec]) -> None:
        """Where the client declares its own: the top-level ``tools``, or, when it has none, its first
        ``additional_tools`` input item, inside the default namespace when it has one (so calls name the tools
        alone, :mod:`.freeform`). That item is replaced by a copy: the agent's own history stays as sent."""
        new = [{"type": "function", "name": t.name, "description": t.description, "parameters": t.schema,
                "strict": False} for t in tools]
        items = body.get("input")
        if "tools" not in body and isinstance(items, list):
            for index, item in enumerate(items):
                if isinstance(item, dict) and item.get("type") == "additional_tools" \
                        and isinstance(item.get("tools"), list):
                    items[index] = {**item, "tools": _into_default_namespace(item["tools"], new)}
                    return
        body["tools"] = as_list(body.get("tools")) + new

    def stream_response(self, events: list[tuple[str | None, str]]) -> dict[str, Any]:
        """The response object of the stream's last ``response.completed`` / ``incomplete`` / ``failed`` event;
        without one (a stream cut short), the items of its ``response.output_item.done`` events."""
        done: list[Any] = []
        for _name, data in reversed(events):
            obj = event_object(data)
            if obj is None:
                continue
            if obj.get("type") in _FINAL_EVENTS and isinstance(response := obj.get("response"), dict):
                return response
            if obj.get("type") == "response.output_item.done":
                done.insert(0, obj.get("item"))
        return {"output": done}

    def assistant_items(self, response: dict[str, Any], keep: Callable[[str], bool]) -> list[Any]:
        return [item for item in as_list(response.get("output")) if isinstance(item, dict)
                and ((call := call_of(item)) is None or keep(call.name))]

    def tool_results(self, results: list[CallResult]) -> list[Any]:
        return [{"type": "function_call_output", "call_id": r.call_id, "output": r.text} for r in results]

    def without_calls(self, response: dict[str, Any], ids: Collection[str], text: bool = True) -> dict[str, Any]:
        output = [item for item in as_list(response.get("output"))
                  if not ((call := call_of(item)) is not None and call.id in ids
                          or not text and isinstance(item, dict) and item.get("type") == "message")]
        return {**response, "output": output}

    def graft(self, items: list[Any], start: int, response: dict[str, Any], results: list[CallResult]) -> Graft:
        """The blocked call items (of any call type, as the response held them) go beside the batch's other call
        items, their ``function_call_output`` items beside the other calls' results."""
        output = [item for item in as_list(response.get("output")) if call_of(item) is not None]
        order = [_call_id(item) for item in output]
        answered = {r.call_id for r in results}
        calls = {_call_id(item): item for item in output if _call_id(item) in answered}
        answers = {r.call_id: item for r, item in zip(results, self.tool_results(results))}
        into_calls = beside(items, lambda item: _call_id(item) if call_of(item) is not None else None, order, calls,
                            start + 1)
        into_results = beside(items, lambda item: item["call_id"] if _is_result(item) else None, order, answers,
                              start + 1)
        if into_calls is None or into_results is None:
            return Graft()
        runs: dict[int, list[Any]] = {}
        for at, run in into_calls + into_results:  # a call's run comes before a result's at the same place
            runs.setdefault(at, []).extend(run)
        return Graft(runs=sorted(runs.items()))

    def stream_splice(self, hold: Callable[[str], bool], stop: bool = False) -> StreamSplice:
        return _ResponsesSplice(hold, stop)


def _edit_message(item: dict[str, Any], edit: TextEdit) -> None:
    for part in as_list(item.get("content")):
        if isinstance(part, dict) and part.get("type") == "output_text" and isinstance(part.get("text"), str):
            part["text"] = edit(part["text"])


class _ResponsesStream:
    """Responses stream rewriting: each ``response.output_text.delta`` through the filter of its
    (output_index, content_index); the full-text copies (``output_text.done``, ``content_part.done``,
    ``output_item.done`` and the response objects) through ``edit``. Text a filter still holds at its part's
    ``done`` goes out as one more delta, and the events after it are renumbered to keep ``sequence_number``
    increasing by one."""

    def __init__(self, new_filter: Callable[[], TextFilter], edit: TextEdit) -> None:
        self.new_filter = new_filter
        self.edit = edit
        self.filters: dict[tuple[Any, Any], TextFilter] = {}
        self.offset = 0

    def _renumber(self, obj: dict[str, Any]) -> None:
        if self.offset and isinstance(obj.get("sequence_number"), int):
            obj["sequence_number"] += self.offset

    def event(self, name: str | None, data: str) -> list[bytes] | None:
        obj = event_object(data)
        if obj is None:
            return None
        kind = obj.get("type")
        changed = bool(self.offset)
        events: list[bytes] = []

        def edit(text: str) -> str:
            nonlocal changed
            new = self.edit(text)
            changed = changed or new != text
            return new

        key = (obj.get("output_index"), obj.get("content_index"))
        if not all(k is None or isinstance(k, int) for k in key):
            return None  # not an event this editor understands: pass it on
        if kind == "response.output_text.delta" and isinstance(obj.get("delta"), str):
            text_filter = self.filters.get(key)
            if text_filter is None:
                text_filter = self.filters[key] = self.new_filter()
            out = text_filter.feed(obj["delta"])
            changed = changed or out != obj["delta"]
            obj["delta"] = out
        elif kind == "response.output_text.done":
            text_filter = self.filters.pop(key, None)
            rest = text_filter.finish() if text_filter is not None else ""
            if rest:
                extra = {"type": "response.output_text.delta", "sequence_number": obj.get("sequence_number", 0),
                         "item_id": obj.get("item_id"), "output_index": obj.get("output_index"),
                         "content_index": obj.get("content_index"), "delta": rest, "logprobs": []}
                self._renumber(extra)
                events.append(sse(dumps(extra), extra["type"]))
                self.offset += 1
                changed = True
            if isinstance(obj.get("text"), str):
                obj["text"] = edit(obj["text"])
        elif kind == "response.content_part.done" and isinstance(obj.get("part"), dict):
            edit_parts([obj["part"]], edit)
        elif kind == "response.output_item.done" and isinstance(obj.get("item"), dict):
            if obj["item"].get("type") == "message":
                _edit_message(obj["item"], edit)
        elif kind in _RESPONSE_EVENTS and isinstance(obj.get("response"), dict):
            RESPONSES.edit_response(obj["response"], edit)
        if not changed:
            return None  # keep the upstream's bytes
        self._renumber(obj)
        return events + sse_json(obj, name or kind, large=len(data) >= largejson.SLICE)

    def close(self) -> list[bytes]:
        return []


class _ResponsesSplice:
    """Responses stream splicing (:class:`~.transcript.StreamSplice`): holds from the ``output_item.added`` of a
    held ``function_call``; a continuation loses its ``response.created`` / ``queued`` / ``in_progress`` (the
    client has them), its ``output_index`` values are shifted past the items the client already has, its
    ``sequence_number`` values go on from the last one sent, and its final response object carries the first
    response's id and lists the items sent before it followed by its own, which is what the client's snapshot
    holds (the openai SDK checks both). With ``stop``, the final response event starts the kept-back stop, and the
    ``done`` events of a message's text (``output_text.done``, ``content_part.done``, ``output_item.done``) wait
    for the next event: when that is the stop, they are kept back with it, so added text ends that message (its
    ``done`` events and the final response object carry the whole text; clients that read the last message as
    the answer, such as ``codex exec``, then show the answer and the text together); without such a message,
    added text is one more message output item, listed in the final response object too."""

    def __init__(self, hold: Callable[[str], bool], stop: bool = False) -> None:
        self.hold = hold
        self.stop = stop
        self.held = False
        self.stopped = False
        self.calling = False
        self.continuing = False
        self.base = 0  # client-side output_index of the current stream's item 0
        self.sent: dict[int, Any] = {}  # client-side output_index -> the item as done
        self.before: list[Any] = []  # items sent by earlier streams, in order
        self.added: list[Any] = []  # items proxyvisor added to the current stream (add_text)
        self.final: list[tuple[str | None, str]] = []  # the kept-back stop
        self.seq = 0  # the next sequence_number the client expects
        self.id: Any = None  # the response id the client has (SDKs check that it never changes)
        self.closing: list[tuple[str | None, dict[str, Any], str]] = []  # a message text's done events, unsent
        self.flushed: list[bytes] = []  # those of a finished stream, rewritten, to go before the next event
        self.appended: tuple[Any, Any, str] | None = None  # (item id, content index, text) added to a message

    def event(self, name: str | None, data: str) -> list[bytes] | None:
        if self.held:
            return []
        if self.stopped:
            self.final.append((name, data))
            return []
        obj = event_object(data)
        if obj is None:
            return None
        kind, item = obj.get("type"), obj.get("item")
        if kind == "response.output_item.added" and (call := call_of(item)) is not None:
            self.calling = True
            if self.hold(call.name):
                self.held = True
                return []
        if self.stop and not self.calling and kind in _FINAL_EVENTS:
            self.stopped = True
            self.final.append((name, data))
            return []
        if self.stop and not self.calling and _closes_text(obj):
            self.closing.append((name, obj, data))
            return []
        closed = self._closed()
        out = self._rewritten(name, obj)
        return closed + (out if out is not None else [sse(data, name)]) if closed else out

    def _closed(self) -> list[bytes]:
        """The kept-back ``done`` events of a message's text, as the client must get them. Clears them."""
        closing, self.closing = self.closing, []
        out, self.flushed = self.flushed, []
        for name, obj, data in closing:
            rewritten = self._rewritten(name, obj)
            out += rewritten if rewritten is not None else [sse(data, name)]
        return out

    def _rewritten(self, name: str | None, obj: dict[str, Any]) -> list[bytes] | None:
        kind, item = obj.get("type"), obj.get("item")
        rewrite = self.continuing or bool(self.added) or self.appended is not None
        if self.continuing and kind in _HEAD_EVENTS:
            return []
        if kind in _HEAD_EVENTS and isinstance(obj.get("response"), dict) and self.id is None:
            self.id = obj["response"].get("id")
        if isinstance(obj.get("output_index"), int):
            obj["output_index"] += self.base
            if kind in ("response.output_item.added", "response.output_item.done"):
                self.sent[obj["output_index"]] = item
        if rewrite and kind in _FINAL_EVENTS and isinstance(obj.get("response"), dict):
            if self.appended is not None:
                _append_to(as_list(obj["response"].get("output")), *self.appended)
            obj["response"]["output"] = self.before + as_list(obj["response"].get("output")) + self.added
            if self.id is not None:
                obj["response"]["id"] = self.id
        if isinstance(obj.get("sequence_number"), int):
            if rewrite:
                obj["sequence_number"] = self.seq
            self.seq = obj["sequence_number"] + 1
        return [sse(dumps(obj), name or kind)] if rewrite else None

    def next_response(self) -> None:
        self.flushed = self._closed()  # at the positions of the stream they belong to, sent before the next event
        self.held = self.stopped = self.calling = False
        self.continuing = True
        self.final = []
        self.base = max(self.sent, default=-1) + 1
        self.before = [self.sent[i] for i in sorted(self.sent)]

    def add_text(self, text: str) -> list[bytes]:
        done = next((obj for _name, obj, _data in self.closing if obj.get("type") == "response.output_text.done"),
                    None)
        if done is not None:  # the answer's last message is still open for the client: text ends it
            added = "\n\n" + text
            self.appended = (done.get("item_id"), done.get("content_index"), added)
            delta: dict[str, Any] = {"type": "response.output_text.delta", "sequence_number": 0,
                                     **{k: done.get(k) for k in ("item_id", "output_index", "content_index")},
                                     "delta": added, "logprobs": []}
            for _name, obj, _data in self.closing:
                if obj.get("type") == "response.output_text.done" and isinstance(obj.get("text"), str):
                    obj["text"] += added
                elif isinstance(part := obj.get("part"), dict) and isinstance(part.get("text"), str):
                    part["text"] += added
                elif isinstance(item := obj.get("item"), dict):
                    _append_to([item], *self.appended)
            return (self._rewritten("response.output_text.delta", delta) or []) + self._closed()
        index = max(self.sent, default=-1) + 1
        part = {"type": "output_text", "text": text, "annotations": []}
        item = {"id": "msg_" + secrets.token_hex(12), "type": "message", "status": "completed", "role": "assistant",
                "content": [part]}
        where = {"item_id": item["id"], "output_index": index, "content_index": 0}
        self.sent[index] = item
        self.added.append(item)
        events = []
        for obj in ({"type": "response.output_item.added", "output_index": index,
                     "item": {**item, "status": "in_progress", "content": []}},
                    {"type": "response.content_part.added", **where, "part": {**part, "text": ""}},
                    {"type": "response.output_text.delta", **where, "delta": text, "logprobs": []},
                    {"type": "response.output_text.done", **where, "text": text, "logprobs": []},
                    {"type": "response.content_part.done", **where, "part": part},
                    {"type": "response.output_item.done", "output_index": index, "item": item}):
            events.append(sse(dumps({"type": obj["type"], "sequence_number": self.seq, **obj}), str(obj["type"])))
            self.seq += 1
        return events

    def release(self) -> list[bytes] | None:
        final, self.final = self.final, []
        if not (self.continuing or self.added or self.appended is not None or self.closing or self.flushed):
            return None
        out = self._closed()
        for name, data in final:
            obj = event_object(data)
            rewritten = self._rewritten(name, obj) if obj is not None else None
            out += rewritten if rewritten is not None else [sse(data, name)]
        return out

    def close(self) -> list[bytes]:
        return self._closed()


def _closes_text(obj: dict[str, Any]) -> bool:
    """Whether a stream event is one of the ``done`` events that close a message's output text."""
    kind = obj.get("type")
    if kind == "response.output_text.done":
        return True
    if kind == "response.content_part.done":
        return isinstance(part := obj.get("part"), dict) and part.get("type") == "output_text"
    return kind == "response.output_item.done" and isinstance(item := obj.get("item"), dict) \
        and item.get("type") == "message"


def _last_text_part(output: list[Any]) -> dict[str, Any] | None:
    """The last ``output_text`` part of the last message item of a response's ``output``, None without one."""
    for item in reversed(output):
        if isinstance(item, dict) and item.get("type") == "message":
            parts = [p for p in as_list(item.get("content"))
                     if isinstance(p, dict) and p.get("type") == "output_text" and isinstance(p.get("text"), str)]
            return parts[-1] if parts else None
    return None


def _append_to(output: list[Any], item_id: Any, content_index: Any, text: str) -> None:
    """Append ``text`` to part ``content_index`` of the message ``item_id`` in ``output``, in place."""
    for item in output:
        if isinstance(item, dict) and item.get("id") == item_id:
            parts = as_list(item.get("content"))
            if isinstance(content_index, int) and 0 <= content_index < len(parts) \
                    and isinstance(parts[content_index], dict) and isinstance(parts[content_index].get("text"), str):
                parts[content_index]["text"] += text


RESPONSES = ResponsesFormat()
