"""Anthropic Messages (``POST /v1/messages``): named SSE events from ``message_start`` to ``message_stop``."""

from __future__ import annotations

import secrets
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from typing import Any

import orjson

from ... import bigtext
from .base import (AssistantTurn, ByIdentity, CallResult, Graft, ToolCall, ToolSpec, Usage, WireFormat, args_of,
                   arguments_of, as_list, beside, chat_text, dumps, edited, error_types, event_object, has_non_text,
                   interleave, interleave_runs, notes_after, split_json, sse, sse_json, sse_pieces, with_field,
                   words)
from . import largejson
from ...transcript import (Message, StreamEditor, StreamSplice, TextEdit, TextFilter, ToolOutput, ToolUse,
                           harness_context)


EMPTIED = "…"
"""The text left when filtering emptied every block of a response: the API refuses an assistant message without
content when the agent sends it back."""


class MessagesFormat(WireFormat):
    name = "messages"
    path = "/v1/messages"
    label = "Anthropic Messages"
    stream_end = (b"message_stop", b"event: error", b"event:error")
    history_field = "messages"
    keepalive = b'event: ping\ndata: {"type": "ping"}\n\n'
    """Anthropic's own keep-alive event (its API sends it; the SDKs skip it anywhere in a stream)."""
    result_part_type = "text"

    def error_body(self, status: int, message: str, code: str | None = None) -> bytes:
        error = {"type": error_types(status)[1], "message": message}
        if code:
            error["code"] = code  # not in Anthropic's shape, which has none; its SDK keeps unknown fields
        return dumps({"type": "error", "error": error})

    def stream_error(self, status: int, message: str, last_chunk: bytes = b"") -> bytes:
        return sse(self.error_body(status, message), event="error")

    def session_hint(self, body: dict[str, Any]) -> str | None:
        user_id = (body.get("metadata") or {}).get("user_id") if isinstance(body.get("metadata"), dict) else None
        if not isinstance(user_id, str) or not user_id:
            return None
        # Claude Code sends a JSON string {"device_id", "account_uuid", "session_id"}: the session is the part
        # that changes per conversation.
        if user_id.startswith("{"):
            try:
                inner = orjson.loads(user_id)
            except orjson.JSONDecodeError:
                return user_id
            if isinstance(inner, dict) and isinstance(session := inner.get("session_id"), str) and session:
                return session
        return user_id

    def fingerprint_parts(self, body: dict[str, Any]) -> tuple[str, str]:
        users = []
        for message in as_list(body.get("messages")):
            if isinstance(message, dict) and message.get("role") == "user":
                users.append(chat_text(message.get("content")))
                if not harness_context(users[-1]):
                    break
        return chat_text(body.get("system")), "\n".join(users)

    def tools(self, body: dict[str, Any]) -> list[ToolSpec]:
        """Every named tool of ``tools``: a client tool (``input_schema``; Anthropic's ``custom`` type) is a
        ``function``, any other (``bash_20250124``, ``text_editor_*``, the server tools ``web_search_*``...) has
        its declared type as its kind."""
        return list(_TOOLS.get(body.get("tools"), _tools))

    def ends_with_tool_result(self, body: dict[str, Any]) -> bool:
        messages = body.get("messages") or []
        if not messages or not isinstance(messages[-1], dict) or messages[-1].get("role") != "user":
            return False
        content = messages[-1].get("content")
        return isinstance(content, list) and any(isinstance(b, dict) and b.get("type") == "tool_result" for b in content)

    def usage(self, response: dict[str, Any]) -> Usage:
        u = response.get("usage") or {}
        return Usage(_input(u), u.get("output_tokens"))

    def stream_usage(self, event: str | None, data: dict[str, Any]) -> Usage | None:
        kind = data.get("type")
        if kind == "message_start":
            u = (data.get("message") or {}).get("usage") or {}
            return Usage(_input(u), u.get("output_tokens"))
        if kind == "message_delta" and isinstance(data.get("usage"), dict):
            return Usage(_input(data["usage"]), data["usage"].get("output_tokens"))
        return None

    def request_from_chat(self, messages: list[dict[str, Any]], model: str, stream: bool,
                          tools: tuple[ToolSpec, ...] = ()) -> dict[str, Any]:
        system = "\n\n".join(chat_text(m.get("content")) for m in messages if m.get("role") == "system")
        out: list[dict[str, Any]] = []

        def push(role: str, block: dict[str, Any]) -> None:
            if out and out[-1]["role"] == role:
                out[-1]["content"].append(block)
            else:
                out.append({"role": role, "content": [block]})

        for m in messages:
            role = m.get("role")
            if role == "user":
                push("user", {"type": "text", "text": chat_text(m.get("content")) or "(empty)"})
            elif role == "tool":
                block = {"type": "tool_result", "tool_use_id": m.get("tool_call_id", ""),
                         "content": chat_text(m.get("content"))}
                if m.get("is_error"):
                    block["is_error"] = True
                push("user", block)
            elif role == "assistant":
                if chat_text(m.get("content")):
                    push("assistant", {"type": "text", "text": chat_text(m.get("content"))})
                for c in m.get("tool_calls") or ():
                    push("assistant", {"type": "tool_use", "id": c.get("id", ""), "name": c["function"]["name"],
                                       "input": args_of(c["function"].get("arguments"))})
        body: dict[str, Any] = {"model": model, "max_tokens": 4096, "messages": out, "stream": stream}
        if system:
            body["system"] = system
        if tools:
            body["tools"] = [{"name": t.name, "input_schema": t.schema} for t in tools]
        return body

    def parse_response(self, response: dict[str, Any]) -> AssistantTurn:
        blocks = [b for b in response.get("content") or () if isinstance(b, dict)]
        text = "".join(b.get("text", "") for b in blocks if b.get("type") == "text")
        calls = tuple(ToolCall(b["name"], args_of(b.get("input")), b.get("id", ""), item=b)
                      for b in blocks if b.get("type") == "tool_use")
        return AssistantTurn(text, calls)

    def render(self, turn: AssistantTurn, model: str) -> dict[str, Any]:
        content: list[dict[str, Any]] = []
        if turn.text:
            content.append({"type": "text", "text": turn.text})
        for call in turn.tool_calls:
            content.append(_use(call))
        i, o = turn.usage
        return {"id": "msg_" + secrets.token_hex(12), "type": "message", "role": "assistant", "model": model,
                "content": content, "stop_reason": "tool_use" if turn.tool_calls else "end_turn",
                "stop_sequence": None, "usage": {"input_tokens": i, "output_tokens": o}}

    def render_stream(self, turn: AssistantTurn, model: str, request: dict[str, Any]) -> list[bytes]:
        i, o = turn.usage
        message: dict[str, Any] = {"id": "msg_" + secrets.token_hex(12), "type": "message", "role": "assistant",
                                   "model": model, "content": [], "stop_reason": None, "stop_sequence": None,
                                   "usage": {"input_tokens": i, "output_tokens": min(o, 1)}}
        events = [sse(dumps({"type": "message_start", "message": message}), "message_start"),
                  sse(b'{"type":"ping"}', "ping")]
        index = 0
        if turn.text:
            events.append(sse(dumps({"type": "content_block_start", "index": 0,
                                     "content_block": {"type": "text", "text": ""}}), "content_block_start"))
            events += [sse(dumps({"type": "content_block_delta", "index": 0,
                                  "delta": {"type": "text_delta", "text": w}}), "content_block_delta")
                       for w in words(turn.text)]
            events.append(sse(b'{"type":"content_block_stop","index":0}', "content_block_stop"))
            index = 1
        for call in turn.tool_calls:
            block = _use(call)
            events.append(sse(dumps({"type": "content_block_start", "index": index,
                                     "content_block": {**block, "input": {}}}), "content_block_start"))
            events += [sse(dumps({"type": "content_block_delta", "index": index,
                                  "delta": {"type": "input_json_delta", "partial_json": part}}), "content_block_delta")
                       for part in split_json(arguments_of(block.get("input")))]
            events.append(sse(dumps({"type": "content_block_stop", "index": index}), "content_block_stop"))
            index += 1
        events.append(sse(dumps({"type": "message_delta",
                                 "delta": {"stop_reason": "tool_use" if turn.tool_calls else "end_turn",
                                           "stop_sequence": None},
                                 "usage": {"output_tokens": o}}), "message_delta"))
        events.append(sse(b'{"type":"message_stop"}', "message_stop"))
        return events


    # ---- supervision --------------------------------------------------------------------------------------
    def read_message(self, item: Any) -> Message:
        if not isinstance(item, dict):
            return Message("other")
        role, content = item.get("role"), item.get("content")
        if role == "system":  # Claude Code sends system messages inside the history too
            return Message("system", chat_text(content))
        blocks = [b for b in content if isinstance(b, dict)] if isinstance(content, list) else []
        if role == "user":
            if isinstance(content, str):
                return Message("user", content)
            text = "\n".join(b["text"] for b in blocks if b.get("type") == "text" and isinstance(b.get("text"), str))
            outputs = tuple(
                ToolOutput(str(b.get("tool_use_id") or ""), chat_text(b.get("content")),
                           b["is_error"] if isinstance(b.get("is_error"), bool) else None,
                           has_non_text(b.get("content")))
                for b in blocks if b.get("type") == "tool_result")
            # Text sent along with tool results (Claude Code's reminders) belongs to the results, not a new turn.
            return Message("tool", text, tool_outputs=outputs) if outputs else Message("user", text)
        if role == "assistant":
            if isinstance(content, str):
                return Message("assistant", content)
            text = "".join(b["text"] for b in blocks if b.get("type") == "text" and isinstance(b.get("text"), str))
            uses = tuple(ToolUse(str(b.get("id") or ""), str(b.get("name") or ""), arguments_of(b.get("input")))
                         for b in blocks if b.get("type") == "tool_use")
            return Message("assistant", text, uses)
        return Message("other")

    def add_instruction(self, body: dict[str, Any], text: str) -> None:
        system = body.get("system")
        if isinstance(system, list):  # a new list: the agent's may be shared with later requests (base.Item)
            body["system"] = [*system, {"type": "text", "text": text}]
        elif isinstance(system, str) or system is None:
            body["system"] = f"{system}\n\n{text}" if system else text

    def insert_notes(self, body: dict[str, Any], notes: list[tuple[int, str]]) -> None:
        if not notes:
            return
        messages = body["messages"]
        separate = []
        for index, text in notes:
            item = messages[index]
            if isinstance(item, dict) and item.get("role") == "user":
                # Appended to the user message itself: text after tool_result blocks is allowed, and a second
                # user message in a row would be merged into it by the API anyway. A copy: the agent's own message
                # (which supervision reads as "the history as sent") stays as the agent sent it.
                messages[index] = edited(item, ("noted", text), _noted, item, text)
            else:
                separate.append((index, text))
        if separate:
            body["messages"] = interleave(messages, notes_after(messages, separate, _note))

    def result_slots(self, item: Any) -> Iterator[tuple[dict[str, Any], str, Any]]:
        if isinstance(item, dict) and item.get("role") == "user":
            for block in as_list(item.get("content")):
                if isinstance(block, dict) and block.get("type") == "tool_result":
                    yield block, "content", block.get("tool_use_id")

    def copy_results(self, item: dict[str, Any]) -> dict[str, Any]:
        return {**item, "content": [dict(b) if isinstance(b, dict) else b for b in as_list(item.get("content"))]}

    def edit_response(self, response: dict[str, Any], edit: TextEdit) -> None:
        content = response.get("content")
        if not isinstance(content, list):
            return
        kept = []
        for block in content:
            if isinstance(block, dict) and block.get("type") == "text" and isinstance(block.get("text"), str):
                new = edit(block["text"])
                if new != block["text"] and not new.strip():
                    continue  # the API refuses an empty text block when the agent sends it back
                block["text"] = new
            kept.append(block)
        content[:] = kept or ([{"type": "text", "text": EMPTIED}] if content else [])

    def limit_key(self, completion_tokens: bool) -> str:
        return "max_tokens"

    def ask_schema(self, body: dict[str, Any], name: str, schema: dict[str, Any]) -> None:
        # No JSON mode on Messages: a tool the model must call, whose input is the answer.
        body["tools"] = [{"name": name, "description": "Record your answer.", "input_schema": schema}]
        body["tool_choice"] = {"type": "tool", "name": name}

    def schema_answer(self, response: dict[str, Any], name: str) -> str:
        turn = self.parse_response(response)
        call = next((c for c in turn.tool_calls if c.name == name), None)
        return dumps(call.arguments).decode() if call is not None else turn.text

    def append_text(self, response: dict[str, Any], text: str) -> None:
        content = response.get("content")
        if not isinstance(content, list):
            return
        last = content[-1] if content else None
        if isinstance(last, dict) and last.get("type") == "text" and isinstance(last.get("text"), str):
            last["text"] += "\n\n" + text
        else:
            content.append({"type": "text", "text": text})

    def stream_editor(self, new_filter: Callable[[], TextFilter], edit: TextEdit) -> StreamEditor:
        return _MessagesStream(new_filter)


    # ---- continuing a turn --------------------------------------------------------------------------------
    def add_tools(self, body: dict[str, Any], tools: list[ToolSpec]) -> None:
        body["tools"] = as_list(body.get("tools")) + [
            {"name": t.name, "description": t.description, "input_schema": t.schema} for t in tools]

    def stream_response(self, events: list[tuple[str | None, str]]) -> dict[str, Any]:
        message: dict[str, Any] = {}
        blocks: dict[int, dict[str, Any]] = {}
        partial: dict[int, str] = {}
        for _name, data in events:
            obj = event_object(data)
            if obj is None:
                continue
            kind, index = obj.get("type"), obj.get("index")
            if kind == "message_start" and isinstance(obj.get("message"), dict):
                message = dict(obj["message"])
            elif kind == "message_delta":
                message.update(delta if isinstance(delta := obj.get("delta"), dict) else {})
                if isinstance(obj.get("usage"), dict):
                    message["usage"] = {**(message.get("usage") or {}), **obj["usage"]}
            elif kind == "content_block_start" and isinstance(index, int):
                blocks[index] = dict(obj["content_block"]) if isinstance(obj.get("content_block"), dict) else {}
            elif kind == "content_block_delta" and index in blocks and isinstance(obj.get("delta"), dict):
                block, delta = blocks[index], obj["delta"]
                if delta.get("type") == "input_json_delta":
                    partial[index] = partial.get(index, "") + str(delta.get("partial_json") or "")
                elif delta.get("type") == "citations_delta":
                    block["citations"] = as_list(block.get("citations")) + [delta.get("citation")]
                else:  # text_delta, thinking_delta, signature_delta: the block field the delta is named after
                    for key in ("text", "thinking", "signature"):
                        if isinstance(delta.get(key), str):
                            block[key] = (block.get(key) or "") + delta[key] if key != "signature" else delta[key]
        for index, text in partial.items():
            blocks[index]["input"] = args_of(text)
        return {**message, "content": [b for _, b in sorted(blocks.items())]}

    def assistant_items(self, response: dict[str, Any], keep: Callable[[str], bool]) -> list[Any]:
        content = [b for b in as_list(response.get("content")) if isinstance(b, dict)
                   and not (b.get("type") == "tool_use" and not keep(str(b.get("name") or "")))]
        return [{"role": "assistant", "content": content}]

    def tool_results(self, results: list[CallResult]) -> list[Any]:
        blocks: list[dict[str, Any]] = []
        for r in results:
            blocks.append({"type": "tool_result", "tool_use_id": r.call_id, "content": r.text})
            if r.is_error:
                blocks[-1]["is_error"] = True
        return [{"role": "user", "content": blocks}]

    def without_calls(self, response: dict[str, Any], ids: Collection[str], text: bool = True) -> dict[str, Any]:
        content = [b for b in as_list(response.get("content"))
                   if not (isinstance(b, dict) and (b.get("type") == "tool_use" and str(b.get("id", "")) in ids
                                                    or not text and b.get("type") == "text"))]
        return {**response, "content": content}

    def graft(self, items: list[Any], start: int, response: dict[str, Any], results: list[CallResult]) -> Graft:
        """The blocked ``tool_use`` blocks go into the agent's assistant message holding the batch's other calls,
        their ``tool_result`` blocks into the user message right after it (among the other results, which come
        first in it: text after them stays after them): each ``tool_result`` answers a ``tool_use`` of the
        message right before it, as the API requires."""
        blocks = [b for b in as_list(response.get("content")) if isinstance(b, dict) and b.get("type") == "tool_use"]
        order = [str(b.get("id") or "") for b in blocks]
        answered = {r.call_id for r in results}
        calls = {str(b.get("id") or ""): b for b in blocks if str(b.get("id") or "") in answered}
        answers = {str(b["tool_use_id"]): b for item in self.tool_results(results) for b in item["content"]}
        for at in range(start + 1, len(items) - 1):
            used, answering = items[at], items[at + 1]
            if not (isinstance(used, dict) and used.get("role") == "assistant" and isinstance(answering, dict)
                    and answering.get("role") == "user"):
                continue
            content, given = as_list(used.get("content")), as_list(answering.get("content"))
            into_calls = beside(content, _use_id, order, calls)
            into_results = beside(given, _result_id, order, answers)
            if into_calls is None or into_results is None:
                continue
            key = ("graft", tuple(sorted(answered)))
            return Graft({at: edited(used, key, with_field, used, "content", interleave_runs(content, into_calls)),
                          at + 1: edited(answering, key, with_field, answering, "content",
                                         interleave_runs(given, into_results))})
        return Graft()

    def stream_splice(self, hold: Callable[[str], bool], stop: bool = False) -> StreamSplice:
        return _MessagesSplice(hold, stop)


def _note(text: str) -> dict[str, Any]:
    """A user-side note as a message of its own."""
    return {"role": "user", "content": [{"type": "text", "text": text}]}


def _noted(item: dict[str, Any], text: str) -> dict[str, Any]:
    """A copy of user message ``item`` with a note appended as a text block."""
    content, block = item.get("content"), {"type": "text", "text": text}
    if isinstance(content, list):
        return {**item, "content": [*content, block]}
    return {**item, "content": [{"type": "text", "text": content}, block] if isinstance(content, str) and content
            else [block]}


def _use(call: ToolCall) -> dict[str, Any]:
    """The ``tool_use`` block of ``call``: the block it was read from, as it came, when it was read from one."""
    if isinstance(call.item, dict):
        return dict(call.item)
    return {"type": "tool_use", "id": call.id or _tool_id(), "name": call.name, "input": call.arguments}


def _use_id(block: Any) -> str | None:
    return str(block.get("id") or "") if isinstance(block, dict) and block.get("type") == "tool_use" else None


def _result_id(block: Any) -> str | None:
    return str(block.get("tool_use_id") or "") if isinstance(block, dict) and block.get("type") == "tool_result" \
        else None


def _indexed(data: str) -> dict[str, Any] | None:
    """A stream event's data as a JSON object with an integer ``index`` (a content block event), else None."""
    obj = event_object(data)
    return obj if obj is not None and isinstance(obj.get("index"), int) else None


@dataclass
class _TextBlock:
    index: int  # as the upstream numbered it
    start: dict[str, Any]  # its content_block_start event, held until it shows something
    filter: TextFilter
    came: tuple[str | None, str] | None  # that event as it came (name, data), when it goes out unchanged but held
    pending: str = ""  # filtered whitespace not sent yet
    sent: bool = False  # the start event went out
    visible: bool = False  # the upstream's own text had something besides whitespace


class _MessagesStream:
    """Messages stream rewriting: each text block's ``text_delta`` through its own filter.

    A text block is announced (``content_block_start``) only once it has something besides whitespace to show;
    a block the filter emptied (a response whose text was only the report) is dropped whole and the blocks after
    it are renumbered, because the API refuses an empty text block when the agent sends it back; when that leaves
    the response with no block at all, one :data:`EMPTIED` text block goes out before ``message_delta``. Anthropic
    streams blocks one after another, so holding one block's start holds nothing else.
    """

    def __init__(self, new_filter: Callable[[], TextFilter]) -> None:
        self.new_filter = new_filter
        self.shift = 0
        self.sent = 0  # blocks announced to the client
        self.block: _TextBlock | None = None

    def _send(self, obj: dict[str, Any]) -> bytes:
        return sse(dumps(obj), obj.get("type"))

    def _text(self, block: _TextBlock, out: str, force: bool = False,
              delta_event: dict[str, Any] | None = None,
              came: tuple[str | None, str, str] | None = None) -> list[bytes]:
        """The events that show ``out`` of ``block``; ``delta_event`` is the upstream's ``text_delta`` event that
        ``out`` came from, written again with ``out`` as its text so that its other fields reach the client, or
        as it came (``came``: its name, its data and its text) when nothing of it changed."""
        index = block.index - self.shift
        if not block.sent:
            block.pending = bigtext.concat([block.pending, out]) if block.pending else out
            if not (force or bigtext.has_text(out)):  # what was pending is whitespace: only ``out`` is new
                return []
            block.sent = True
            self.sent += 1
            block.start["index"] = index
            if block.came is not None and not self.shift:
                events = sse_pieces([block.came[1].encode()], block.came[0])
            else:
                events = [self._send(block.start)]
            out, block.pending = block.pending, ""
        else:
            events = []
        if out:
            if came is not None and not self.shift and out == came[2]:
                return events + sse_pieces([came[1].encode()], came[0])
            if delta_event is None:
                delta_event = {"type": "content_block_delta", "index": index,
                               "delta": {"type": "text_delta", "text": out}}
            else:
                delta_event["index"] = index
                delta_event["delta"]["text"] = out
            events += sse_json(delta_event, "content_block_delta", large=len(out) >= largejson.SLICE)
        return events

    def event(self, name: str | None, data: str) -> list[bytes] | None:
        if not bigtext.contains(data, '"index"'):
            if self.shift and not self.sent and '"message_delta"' in data:
                self.sent = 1
                return [self._send({"type": "content_block_start", "index": 0,
                                    "content_block": {"type": "text", "text": ""}}),
                        self._send({"type": "content_block_delta", "index": 0,
                                    "delta": {"type": "text_delta", "text": EMPTIED}}),
                        self._send({"type": "content_block_stop", "index": 0}), sse(data, name)]
            return None  # message_start, message_delta, message_stop, ping, error
        obj = _indexed(data)
        if obj is None:
            return None
        kind, index, block = obj.get("type"), obj["index"], self.block
        start = obj.get("content_block")
        if kind == "content_block_start" and isinstance(start, dict) and start.get("type") == "text":
            initial = text if isinstance(text := start.get("text"), str) else ""
            obj["content_block"]["text"] = ""
            self.block = block = _TextBlock(index, obj, self.new_filter(), None if initial else (name, data))
            block.visible = bigtext.has_text(initial)
            return self._text(block, block.filter.feed(initial))
        if block is not None and index == block.index:
            delta = obj.get("delta")
            if (kind == "content_block_delta" and isinstance(delta, dict) and delta.get("type") == "text_delta"
                    and isinstance(delta.get("text"), str)):
                text = delta["text"]
                block.visible = block.visible or bigtext.has_text(text)
                out = block.filter.feed(text)
                if block.sent and out == text and not self.shift:
                    return None
                return self._text(block, out, delta_event=obj, came=(name, data, text))
            if kind == "content_block_stop":
                self.block = None
                events = self._text(block, block.filter.finish())
                if not block.sent:
                    if block.visible:
                        self.shift += 1  # emptied by the filter: drop the whole block
                        return []
                    events = self._text(block, "", force=True)
            else:
                events = self._text(block, "", force=True)  # any other delta (citations): announce the block first
            if not self.shift:
                return events + sse_pieces([data.encode()], name) if events else None
            obj["index"] = index - self.shift
            return events + [self._send(obj)]
        if kind == "content_block_start":
            self.sent += 1
        if not self.shift:
            return None
        obj["index"] = index - self.shift
        return [self._send(obj)]

    def close(self) -> list[bytes]:
        return []


class _MessagesSplice:
    """Messages stream splicing (:class:`~.transcript.StreamSplice`): holds from the ``content_block_start`` of a
    held ``tool_use`` block; a continuation loses its ``message_start`` (the client has one) and its block
    indexes are shifted past the blocks the client already has, so its blocks, ``message_delta`` (stop reason,
    usage) and ``message_stop`` end the one message the client is reading. With ``stop``, ``message_delta`` (or a
    ``message_stop`` without one) starts the kept-back stop, and a text block's ``content_block_stop`` waits for
    the next event: when that is the stop, it is kept back with it, so added text ends that block (clients that
    read the last text block as the answer, such as ``claude -p``, then show the answer and the text together)."""

    def __init__(self, hold: Callable[[str], bool], stop: bool = False) -> None:
        self.hold = hold
        self.stop = stop
        self.held = False
        self.stopped = False
        self.calling = False
        self.continuing = False
        self.base = 0  # client-side index of the current stream's block 0
        self.blocks = 0  # blocks the client has: the next stream's base
        self.text_blocks: set[int] = set()  # client-side indexes of text blocks
        self.closing: tuple[str | None, dict[str, Any], str] | None = None  # a text block's stop, not sent yet
        self.final: list[tuple[str | None, str]] = []  # the kept-back stop

    def event(self, name: str | None, data: str) -> list[bytes] | None:
        if self.held:
            return []
        if self.stopped:
            self.final.append((name, data))
            return []
        if not bigtext.contains(data, '"index"'):  # message_start, message_delta, message_stop, ping, error
            if self.stop and not self.calling and ('"message_delta"' in data or '"message_stop"' in data):
                self.stopped = True
                self.final.append((name, data))
                return []
            if self.continuing and '"message_start"' in data:
                return self._closed()
            return self._after_closing(name, data, None)
        obj = _indexed(data)
        if obj is None:
            return self._after_closing(name, data, None)
        block = obj.get("content_block")
        if obj.get("type") == "content_block_start" and isinstance(block, dict):
            if block.get("type") == "tool_use":
                self.calling = True
                if self.hold(str(block.get("name") or "")):
                    self.held = True
                    return self._closed()
            self.blocks = max(self.blocks, obj["index"] + self.base + 1)
            if block.get("type") == "text":
                self.text_blocks.add(obj["index"] + self.base)
        obj["index"] += self.base
        if self.stop and obj.get("type") == "content_block_stop" and obj["index"] in self.text_blocks:
            closed, self.closing = self._closed(), (name, obj, data)
            return closed
        return self._after_closing(name, data, [sse(dumps(obj), name)] if self.base else None)

    def _closed(self) -> list[bytes]:
        """The kept-back close of a text block, as the client must get it (empty without one). Clears it."""
        closing, self.closing = self.closing, None
        if closing is None:
            return []
        name, obj, data = closing
        return [sse(dumps(obj), name or "content_block_stop") if self.base else sse(data, name)]

    def _after_closing(self, name: str | None, data: str, out: list[bytes] | None) -> list[bytes] | None:
        """``out`` (None: the event's own bytes) after the kept-back close of a text block, if any."""
        if self.closing is None:
            return out
        return self._closed() + (out if out is not None else [sse(data, name)])

    def next_response(self) -> None:
        self.held = self.stopped = self.calling = False
        self.continuing = True
        self.base = self.blocks
        self.final = []

    def add_text(self, text: str) -> list[bytes]:
        if self.closing is not None:  # the answer's last text block is still open for the client: text ends it
            index = self.closing[1]["index"]
            delta = {"type": "content_block_delta", "index": index, "delta": {"type": "text_delta",
                                                                              "text": "\n\n" + text}}
            return [sse(dumps(delta), "content_block_delta")] + self._closed()
        index = self.blocks
        self.blocks += 1
        return [sse(dumps(obj), str(obj["type"])) for obj in (
            {"type": "content_block_start", "index": index, "content_block": {"type": "text", "text": ""}},
            {"type": "content_block_delta", "index": index, "delta": {"type": "text_delta", "text": text}},
            {"type": "content_block_stop", "index": index})]

    def release(self) -> list[bytes] | None:
        if self.closing is None:
            self.final = []
            return None  # message_delta and message_stop carry no position: the client gets them as they came
        final, self.final = self.final, []
        return self._closed() + [sse(data, name) for name, data in final]

    def close(self) -> list[bytes]:
        return self._closed()


def _input(u: dict[str, Any]) -> int | None:
    if u.get("input_tokens") is None:
        return None
    return int(u["input_tokens"]) + int(u.get("cache_read_input_tokens") or 0) + int(u.get("cache_creation_input_tokens") or 0)


def _tool_id() -> str:
    return "toolu_" + secrets.token_hex(12)


MESSAGES = MessagesFormat()


_TOOLS = ByIdentity()
""":meth:`MessagesFormat.tools` by the ``tools`` list, which the requests of a session repeat."""


def _tools(tools: Any) -> list[ToolSpec]:
    out = []
    for tool in as_list(tools):
        if isinstance(tool, dict) and isinstance(tool.get("name"), str):
            kind = declared if isinstance(declared := tool.get("type"), str) and "input_schema" not in tool else ""
            schema = tool.get("input_schema")
            about = text if isinstance(text := tool.get("description"), str) else ""
            out.append(ToolSpec(tool["name"], schema if isinstance(schema, dict) else {}, about,
                                "function" if kind in ("", "custom") else kind))
    return out
