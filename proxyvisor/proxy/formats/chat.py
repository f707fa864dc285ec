"""OpenAI Chat Completions (``POST /v1/chat/completions``): bare ``data:`` SSE lines ending in ``[DONE]``."""

from __future__ import annotations

import secrets
from collections.abc import Callable, Collection, Iterator
from typing import Any


from ... import bigtext
from .base import (AssistantTurn, ByIdentity, CallResult, Graft, ToolCall, ToolSpec, Usage, WireFormat, beside,
                   chat_text, dumps, edit_parts, arguments_of, as_list, event_object, has_non_text,
                   interleave, interleave_runs, edited, leading_system, notes_after, split_json, sse, sse_json,
                   with_field, words, openai_error_body)
from . import largejson
from .freeform import arguments as freeform_arguments
from .freeform import input_of
from ...transcript import (Message, StreamEditor, StreamSplice, TextEdit, TextFilter, ToolOutput, ToolUse,
                           harness_context)


class ChatFormat(WireFormat):
    name = "chat"
    path = "/v1/chat/completions"
    label = "OpenAI Chat Completions"
    # [DONE], or a choice's finish_reason (the answer is whole even when the usage chunk and [DONE] are lost), as
    # compact JSON writes it and as Python's json.dumps does.
    stream_end = (b"[DONE]", b'"finish_reason":"', b'"finish_reason": "')
    history_field = "messages"
    result_part_type = "text"

    def error_body(self, status: int, message: str, code: str | None = None) -> bytes:
        return openai_error_body(status, message, code)

    def stream_error(self, status: int, message: str, last_chunk: bytes = b"") -> bytes:
        # The openai SDK raises APIError on a data line whose object has an "error" key.
        return sse(self.error_body(status, message))

    def session_hint(self, body: dict[str, Any]) -> str | None:
        user = body.get("user")
        return user if isinstance(user, str) and user else None

    def fingerprint_parts(self, body: dict[str, Any]) -> tuple[str, str]:
        system, users = "", []
        for message in as_list(body.get("messages")):
            if not isinstance(message, dict):
                continue
            role = message.get("role")
            if role in ("system", "developer") and not system:
                system = chat_text(message.get("content"))
            elif role == "user":
                users.append(chat_text(message.get("content")))
                if not harness_context(users[-1]):
                    break
        return system, "\n".join(users)

    def tools(self, body: dict[str, Any]) -> list[ToolSpec]:
        """The ``function`` tools and the ``custom`` (freeform) ones of ``tools``."""
        return list(_TOOLS.get(body.get("tools"), _tools))

    def ends_with_tool_result(self, body: dict[str, Any]) -> bool:
        messages = body.get("messages") or []
        return bool(messages) and isinstance(messages[-1], dict) and messages[-1].get("role") == "tool"

    def usage(self, response: dict[str, Any]) -> Usage:
        u = response.get("usage") or {}
        return Usage(u.get("prompt_tokens"), u.get("completion_tokens"))

    def stream_usage(self, event: str | None, data: dict[str, Any]) -> Usage | None:
        u = data.get("usage")
        return Usage(u.get("prompt_tokens"), u.get("completion_tokens")) if isinstance(u, dict) else None

    def request_from_chat(self, messages: list[dict[str, Any]], model: str, stream: bool,
                          tools: tuple[ToolSpec, ...] = ()) -> dict[str, Any]:
        body: dict[str, Any] = {"model": model, "messages": messages, "stream": stream}
        if stream:
            body["stream_options"] = {"include_usage": True}
        if tools:
            body["tools"] = [{"type": "function", "function": {"name": t.name, "parameters": t.schema}} for t in tools]
        return body

    def parse_response(self, response: dict[str, Any]) -> AssistantTurn:
        message = (response.get("choices") or [{}])[0].get("message") or {}
        calls = tuple(call for call in map(call_of, message.get("tool_calls") or ()) if call is not None)
        return AssistantTurn(chat_text(message.get("content")), calls)

    def _usage(self, turn: AssistantTurn) -> dict[str, int]:
        i, o = turn.usage
        return {"prompt_tokens": i, "completion_tokens": o, "total_tokens": i + o}

    def render(self, turn: AssistantTurn, model: str) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": turn.text or None}
        if turn.tool_calls:
            message["tool_calls"] = [{"id": c.id or _call_id(), **_call_body(c)} for c in turn.tool_calls]
        return {
            "id": "chatcmpl-" + secrets.token_hex(12), "object": "chat.completion", "created": self.now(),
            "model": model,
            "choices": [{"index": 0, "message": message,
                         "finish_reason": "tool_calls" if turn.tool_calls else "stop"}],
            "usage": self._usage(turn),
        }

    def render_stream(self, turn: AssistantTurn, model: str, request: dict[str, Any]) -> list[bytes]:
        base = {"id": "chatcmpl-" + secrets.token_hex(12), "object": "chat.completion.chunk",
                "created": self.now(), "model": model}

        def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
            return sse(dumps({**base, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}))

        events = [chunk({"role": "assistant", "content": ""})]
        events += [chunk({"content": w}) for w in words(turn.text)]
        for index, call in enumerate(turn.tool_calls):
            entry = {"id": call.id or _call_id(), **_call_body(call)}
            fn = entry.get("function")
            if entry.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("arguments"), str):
                # one chunk: the whole call (a freeform input, a call of another type)
                events.append(chunk({"tool_calls": [{"index": index, **entry}]}))
                continue
            events.append(chunk({"tool_calls": [{"index": index, **entry, "function": {**fn, "arguments": ""}}]}))
            events += [chunk({"tool_calls": [{"index": index, "function": {"arguments": part}}]})
                       for part in split_json(fn["arguments"])]
        events.append(chunk({}, "tool_calls" if turn.tool_calls else "stop"))
        if (request.get("stream_options") or {}).get("include_usage"):
            events.append(sse(dumps({**base, "choices": [], "usage": self._usage(turn)})))
        events.append(b"data: [DONE]\n\n")
        return events


    # ---- supervision --------------------------------------------------------------------------------------
    def read_message(self, item: Any) -> Message:
        if not isinstance(item, dict):
            return Message("other")
        role, content = item.get("role"), item.get("content")
        if role in ("system", "developer"):
            return Message("system", chat_text(content))
        if role == "user":
            return Message("user", chat_text(content))
        if role == "assistant":
            uses = [ToolUse(call.id, call.name, call.arguments)
                    for call in map(call_of, as_list(item.get("tool_calls"))) if call is not None]
            legacy = item.get("function_call")  # the pre-tools single call, answered by a role "function" message
            if isinstance(legacy, dict):
                name = str(legacy.get("name") or "")
                uses.append(ToolUse(name, name, arguments_of(legacy.get("arguments"))))
            return Message("assistant", chat_text(content), tuple(uses))
        if role in ("tool", "function"):
            call_id = item.get("tool_call_id") if role == "tool" else item.get("name")
            flag = item.get("is_error")  # not part of the API, but kept by converters of Anthropic transcripts
            return Message("tool", tool_outputs=(ToolOutput(str(call_id or ""), chat_text(content),
                                                            flag if isinstance(flag, bool) else None,
                                                            has_non_text(content)),))
        return Message("other")

    def add_instruction(self, body: dict[str, Any], text: str) -> None:
        messages = body.get("messages")
        if not isinstance(messages, list):
            return
        at = leading_system(messages)
        if at is None:
            messages.insert(0, {"role": "system", "content": text})
            return
        last = messages[at]
        content = last.get("content")
        # A copy in the message's place: the agent's item may be shared with later requests (base.Item).
        if isinstance(content, list):
            messages[at] = edited(last, ("instruction", text),
                                  lambda: {**last, "content": [*content, {"type": "text", "text": text}]})
        elif isinstance(content, str) or content is None:
            messages[at] = edited(last, ("instruction", text),
                                  lambda: {**last, "content": f"{content}\n\n{text}" if content else text})

    def insert_notes(self, body: dict[str, Any], notes: list[tuple[int, str]]) -> None:
        if notes:
            body["messages"] = interleave(body["messages"], notes_after(body["messages"], notes, self.user_item))

    def result_slots(self, item: Any) -> Iterator[tuple[dict[str, Any], str, Any]]:
        if isinstance(item, dict) and item.get("role") in ("tool", "function"):
            yield item, "content", item.get("tool_call_id") if item["role"] == "tool" else item.get("name")

    def edit_response(self, response: dict[str, Any], edit: TextEdit) -> None:
        for choice in as_list(response.get("choices")):
            message = choice.get("message") if isinstance(choice, dict) else None
            if isinstance(message, dict) and message.get("content") is not None:
                message["content"] = edit_parts(message["content"], edit)

    def limit_key(self, completion_tokens: bool) -> str:
        return "max_completion_tokens" if completion_tokens else "max_tokens"

    def ask_effort(self, body: dict[str, Any], effort: str) -> None:
        body["reasoning_effort"] = effort

    def ask_schema(self, body: dict[str, Any], name: str, schema: dict[str, Any]) -> None:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": name, "schema": schema,
                                                                           "strict": False}}

    def append_text(self, response: dict[str, Any], text: str) -> None:
        choice = (as_list(response.get("choices")) or [None])[0]
        message = choice.get("message") if isinstance(choice, dict) else None
        if isinstance(message, dict):
            content = chat_text(message.get("content"))
            message["content"] = f"{content}\n\n{text}" if content else text

    def stream_editor(self, new_filter: Callable[[], TextFilter], edit: TextEdit) -> StreamEditor:
        return _ChatStream(new_filter)


    # ---- continuing a turn --------------------------------------------------------------------------------
    def add_tools(self, body: dict[str, Any], tools: list[ToolSpec]) -> None:
        body["tools"] = as_list(body.get("tools")) + [
            {"type": "function", "function": {"name": t.name, "description": t.description, "parameters": t.schema}}
            for t in tools]

    def stream_response(self, events: list[tuple[str | None, str]]) -> dict[str, Any]:
        head: dict[str, Any] = {}
        text: list[str] = []
        calls: dict[int, dict[str, Any]] = {}
        finish, usage = None, None
        for _name, data in events:
            obj = event_object(data)
            if obj is None:
                continue
            head = head or {k: obj[k] for k in ("id", "created", "model") if k in obj}
            usage = obj["usage"] if isinstance(obj.get("usage"), dict) else usage
            for choice in as_list(obj.get("choices")):
                if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                    continue
                finish = choice.get("finish_reason") or finish
                delta = given if isinstance(given := choice.get("delta"), dict) else {}
                if isinstance(delta.get("content"), str):
                    text.append(delta["content"])
                for c in as_list(delta.get("tool_calls")):
                    if not isinstance(c, dict):
                        continue
                    slot = calls.setdefault(c.get("index", 0) if isinstance(c.get("index", 0), int) else 0,
                                            {"id": "", "type": "function", "function": {"name": "", "arguments": ""}})
                    slot["id"] = c.get("id") or slot["id"]
                    if isinstance(c.get("custom"), dict):  # a freeform call: its input accumulates likewise
                        custom = slot.setdefault("custom", {"name": "", "input": ""})
                        slot["type"] = "custom"
                        slot.pop("function", None)
                        custom["name"] = c["custom"].get("name") or custom["name"]
                        custom["input"] += c["custom"].get("input") or ""
                        continue
                    fn = given if isinstance(given := c.get("function"), dict) else {}
                    slot["function"]["name"] = fn.get("name") or slot["function"]["name"]
                    slot["function"]["arguments"] += fn.get("arguments") or ""
        # Empty parts left out: a lone big delta is taken as it is, not copied.
        message: dict[str, Any] = {"role": "assistant", "content": "".join([t for t in text if t]) or None}
        if calls:
            message["tool_calls"] = [c for _, c in sorted(calls.items())]
        return {**head, "object": "chat.completion",
                "choices": [{"index": 0, "message": message, "finish_reason": finish}], "usage": usage}

    def assistant_items(self, response: dict[str, Any], keep: Callable[[str], bool]) -> list[Any]:
        choice = (as_list(response.get("choices")) or [{}])[0]
        message = given if isinstance(choice, dict) and isinstance(given := choice.get("message"), dict) else {}
        item: dict[str, Any] = {"role": "assistant", "content": message.get("content")}
        calls = [c for c in as_list(message.get("tool_calls"))
                 if isinstance(c, dict) and ((call := call_of(c)) is None or keep(call.name))]
        if calls:
            item["tool_calls"] = calls
        return [item]

    def tool_results(self, results: list[CallResult]) -> list[Any]:
        return [{"role": "tool", "tool_call_id": r.call_id, "content": r.text} for r in results]

    def without_calls(self, response: dict[str, Any], ids: Collection[str], text: bool = True) -> dict[str, Any]:
        out = dict(response)
        choices = as_list(response.get("choices"))
        if not choices or not isinstance(choices[0], dict) or not isinstance(choices[0].get("message"), dict):
            return out
        message = dict(choices[0]["message"])
        calls = [c for c in as_list(message.get("tool_calls")) if (call := call_of(c)) is None or call.id not in ids]
        if calls:
            message["tool_calls"] = calls
        else:
            message.pop("tool_calls", None)
        if not text:
            message["content"] = None
        out["choices"] = [{**choices[0], "message": message}, *choices[1:]]
        return out

    def graft(self, items: list[Any], start: int, response: dict[str, Any], results: list[CallResult]) -> Graft:
        """The blocked ``tool_calls`` entries go into the agent's assistant message holding the batch's other calls,
        their ``tool`` messages among the other calls' ``tool`` messages after it (an assistant message's calls are
        all answered before the next message of another role, as the API requires)."""
        choice = (as_list(response.get("choices")) or [{}])[0]
        message = given if isinstance(choice, dict) and isinstance(given := choice.get("message"), dict) else {}
        entries = [c for c in as_list(message.get("tool_calls")) if isinstance(c, dict)]
        order = [str(c.get("id") or "") for c in entries]
        answered = {r.call_id for r in results}
        calls = {str(c.get("id") or ""): c for c in entries if str(c.get("id") or "") in answered}
        answers = {r.call_id: item for r, item in zip(results, self.tool_results(results))}
        for at in range(start + 1, len(items) - 1):
            used = items[at]
            if not (isinstance(used, dict) and used.get("role") == "assistant"):
                continue
            listed = as_list(used.get("tool_calls"))
            into_calls = beside(listed, _entry_id, order, calls)
            if into_calls is None:
                continue
            end = at + 1
            while end < len(items) and isinstance(items[end], dict) and items[end].get("role") == "tool":
                end += 1
            into_results = beside(items[:end], _answer_id, order, answers, at + 1)
            if into_results is None:
                return Graft()
            key = ("graft", tuple(sorted(answered)))
            return Graft({at: edited(used, key, with_field, used, "tool_calls", interleave_runs(listed, into_calls))},
                         into_results)
        return Graft()

    def stream_splice(self, hold: Callable[[str], bool], stop: bool = False) -> StreamSplice:
        return _ChatSplice(hold, stop)


def _done(data: str) -> bool:
    """Whether an event's data is Chat's ``[DONE]`` (whitespace around it allowed): looked at only when short, so a
    big event is not copied to find out."""
    return len(data) <= 64 and data.strip() == "[DONE]"


class _ChatStream:
    """Chat stream rewriting: ``choices[].delta.content`` of each choice through its filter; what a filter still
    holds at the choice's ``finish_reason`` rides in that same chunk (a chunk may carry content and a finish)."""

    def __init__(self, new_filter: Callable[[], TextFilter]) -> None:
        self.new_filter = new_filter
        self.filters: dict[int, TextFilter] = {}
        self.finished: set[int] = set()
        self.last: dict[str, Any] = {}  # the last chunk's id, object, created, model: close() copies them

    def event(self, name: str | None, data: str) -> list[bytes] | None:
        obj = event_object(data)
        if obj is None:
            if _done(data):
                tail = self.close()
                return tail + [sse(data)] if tail else None
            return None
        changed = False
        for choice in as_list(obj.get("choices")):
            if not isinstance(choice, dict) or not isinstance(choice.get("index", 0), int):
                continue
            index = choice.get("index", 0)
            delta = choice.get("delta")
            content = delta.get("content") if isinstance(delta, dict) else None
            if isinstance(content, str) and index not in self.finished:
                text_filter = self.filters.get(index)
                if text_filter is None:
                    text_filter = self.filters[index] = self.new_filter()
                out = text_filter.feed(content)
                if out != content:
                    delta["content"] = out  # type: ignore[index]
                    changed = True
            if choice.get("finish_reason") is not None and index in self.filters and index not in self.finished:
                self.finished.add(index)
                rest = self.filters[index].finish()
                if rest:
                    if not isinstance(delta, dict):
                        delta = choice["delta"] = {}
                    delta["content"] = (delta.get("content") or "") + rest
                    changed = True
        self.last = {k: obj[k] for k in ("id", "object", "created", "model") if k in obj}  # not a big delta
        return sse_json(obj, large=len(data) >= largejson.SLICE) if changed else None

    def close(self) -> list[bytes]:
        out = []
        base = self.last
        for index, text_filter in self.filters.items():
            if index in self.finished:
                continue
            self.finished.add(index)
            rest = text_filter.finish()
            if rest:
                out.append(sse(dumps({**base, "choices": [
                    {"index": index, "delta": {"content": rest}, "finish_reason": None}]})))
        return out


class _ChatSplice:
    """Chat stream splicing (:class:`~.transcript.StreamSplice`): holds from the chunk that starts a held tool
    call; in a continuation, each tool call's ``index`` is shifted past the calls the client already has (the
    client's accumulator keys calls by index), and its first text starts with a blank line when the client
    already has text (both land in one ``content`` string). Role, finish, usage and ``[DONE]`` chunks of a
    continuation pass as they are: the held stream's own never reached the client. With ``stop``, the first chunk
    with a ``finish_reason`` (or ``[DONE]`` without one) starts the kept-back stop; text it carries is sent in a
    chunk of its own first; added text is one more content delta of choice 0."""

    def __init__(self, hold: Callable[[str], bool], stop: bool = False) -> None:
        self.hold = hold
        self.stop = stop
        self.held = False
        self.stopped = False
        self.calling = False
        self.continuing = False
        self.base = 0  # client-side index of the current stream's call 0
        self.calls = 0  # tool calls the client has: the next stream's base
        self.text = False  # the client has text
        self.join = False  # the next text starts a continuation's text after earlier text
        self.head: dict[str, Any] = {"object": "chat.completion.chunk"}  # id, created, model of the last chunk
        self.final: list[str] | None = None  # the kept-back stop's data, when it differs from what came

    def event(self, name: str | None, data: str) -> list[bytes] | None:
        if self.held:
            return []
        if self.stopped:
            if self.final is not None:
                self.final.append(data)
            return []
        if self.stop and _done(data):
            self.stopped = True
            return []
        obj = event_object(data) if self.stop or bigtext.contains(data, '"tool_calls"') or bigtext.contains(
            data, '"content"') else None
        if obj is None:
            return None
        self.head.update({k: obj[k] for k in ("id", "object", "created", "model") if k in obj})
        changed = False
        for choice in as_list(obj.get("choices")):
            delta = choice.get("delta") if isinstance(choice, dict) else None
            if not isinstance(delta, dict):
                continue
            if isinstance(delta.get("content"), str) and delta["content"]:
                if self.join:
                    delta["content"] = "\n\n" + delta["content"]
                    self.join, changed = False, True
                self.text = True
            for call in as_list(delta.get("tool_calls")):
                if not isinstance(call, dict) or not isinstance(call.get("index", 0), int):
                    continue
                self.calling = True
                fn = call.get("custom") if isinstance(call.get("custom"), dict) else call.get("function")
                if isinstance(fn, dict) and isinstance(fn.get("name"), str) and self.hold(fn["name"]):
                    self.held = True
                    return []
                index = call.get("index", 0) + self.base
                self.calls = max(self.calls, index + 1)
                if self.base:
                    call["index"] = index
                    changed = True
        if self.stop and not self.calling and any(isinstance(c, dict) and c.get("finish_reason") is not None
                                                  for c in as_list(obj.get("choices"))):
            return self._stopping(obj, data, changed)
        return [sse(dumps(obj))] if changed else None

    def _stopping(self, obj: dict[str, Any], data: str, changed: bool) -> list[bytes]:
        self.stopped = True
        choices = [c for c in as_list(obj.get("choices")) if isinstance(c, dict)]
        if not any(c.get("delta") for c in choices) and not changed:
            return []  # the chunk is the stop and nothing else: kept back as it came
        # The chunk carries text as well: the text goes out now, the finish (with the usage) is kept back.
        stop = {**obj, "choices": [{**c, "delta": {}} for c in choices if c.get("finish_reason") is not None]}
        self.final = [dumps(stop).decode()]
        obj.pop("usage", None)
        obj["choices"] = [{**c, "finish_reason": None} for c in choices if c.get("delta")]
        return [sse(dumps(obj))]

    def next_response(self) -> None:
        self.held = self.stopped = self.calling = False
        self.continuing = True
        self.final = None
        self.base = self.calls
        self.join = self.text

    def add_text(self, text: str) -> list[bytes]:
        text = ("\n\n" if self.text else "") + text
        self.text = True
        return [sse(dumps({**self.head, "choices": [{"index": 0, "delta": {"content": text},
                                                     "finish_reason": None}]}))]

    def release(self) -> list[bytes] | None:
        final, self.final = self.final, None
        return None if final is None else [sse(data) for data in final]

    def close(self) -> list[bytes]:
        return []


def call_of(call: Any) -> ToolCall | None:
    """A Chat ``tool_calls`` entry as a :class:`ToolCall`, or None when it holds no call object: the object under
    its ``type`` (``function`` when it has none), with JSON ``arguments``, or for ``custom`` a freeform ``input``
    (:func:`~.freeform.arguments`)."""
    if not isinstance(call, dict):
        return None
    kind = given if isinstance(given := call.get("type"), str) and given else "function"
    body = call.get(kind)
    if not isinstance(body, dict):
        return None
    name, call_id = str(body.get("name") or ""), str(call.get("id") or "")
    if kind == "custom":
        text = body.get("input")
        return ToolCall(name, freeform_arguments(name, text if isinstance(text, str) else ""), call_id, "custom",
                        call)
    return ToolCall(name, arguments_of(body.get("arguments")), call_id, kind, call)


def _entry_id(entry: Any) -> str | None:
    return str(entry.get("id") or "") if isinstance(entry, dict) else None


def _answer_id(item: Any) -> str | None:
    return str(item.get("tool_call_id") or "") if isinstance(item, dict) and item.get("role") == "tool" else None


def _call_body(call: ToolCall) -> dict[str, Any]:
    """A ``tool_calls`` entry's ``type`` and call object for ``call`` (without its id): the entry it was read from,
    as it came, when it was read from one."""
    if isinstance(call.item, dict):
        return {k: v for k, v in call.item.items() if k not in ("id", "index")}
    if call.kind == "custom":
        return {"type": "custom", "custom": {"name": call.name, "input": input_of(call.arguments)}}
    return {"type": "function", "function": {"name": call.name, "arguments": dumps(call.arguments).decode()}}


def _call_id() -> str:
    return "call_" + secrets.token_hex(12)


CHAT = ChatFormat()


_TOOLS = ByIdentity()
""":meth:`ChatFormat.tools` by the ``tools`` list, which the requests of a session repeat."""


def _tools(tools: Any) -> list[ToolSpec]:
    out = []
    for tool in as_list(tools):
        kind = "custom" if isinstance(tool, dict) and tool.get("type") == "custom" else "function"
        fn = tool.get(kind) if isinstance(tool, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            schema = fn.get("parameters") if kind == "function" else None
            about = text if isinstance(text := fn.get("description"), str) else ""
            out.append(ToolSpec(fn["name"], schema if isinstance(schema, dict) else {}, about, kind))
    return out
