"""Anthropic Messages (``POST /v1/messages``): named SSE events from ``message_start`` to ``message_stop``."""

from __future__ import annotations

import secrets
from typing import Any

import orjson

from .base import (AssistantTurn, ToolCall, ToolSpec, Usage, WireFormat, args_of, chat_text, dumps, error_types,
                   split_json, sse, words)




class MessagesFormat(WireFormat):
    name = "messages"
    path = "/v1/messages"
    label = "Anthropic Messages"

    def error_body(self, status: int, message: str) -> bytes:
        return dumps({"type": "error", "error": {"type": error_types(status)[1], "message": message}})

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
            if isinstance(inner, dict) and isinstance(inner.get("session_id"), str) and inner["session_id"]:
                return inner["session_id"]
        return user_id

    def fingerprint_parts(self, body: dict[str, Any]) -> tuple[str, str]:
        first_user = ""
        for message in body.get("messages") or ():
            if isinstance(message, dict) and message.get("role") == "user":
                first_user = chat_text(message.get("content"))
                break
        return chat_text(body.get("system")), first_user

    def tools(self, body: dict[str, Any]) -> list[ToolSpec]:
        return [ToolSpec(t["name"], t.get("input_schema") or {}) for t in body.get("tools") or ()
                if isinstance(t, dict) and isinstance(t.get("name"), str)]

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
        calls = tuple(ToolCall(b["name"], args_of(b.get("input")), b.get("id", ""))
                      for b in blocks if b.get("type") == "tool_use")
        return AssistantTurn(text, calls)

    def assemble(self, events: list[tuple[str | None, str]]) -> AssistantTurn:
        blocks: dict[int, dict[str, Any]] = {}
        for _name, data in events:
            obj = orjson.loads(data) if data.startswith("{") else {}
            kind, index = obj.get("type"), obj.get("index", 0)
            if kind == "content_block_start":
                blocks[index] = {**obj.get("content_block", {}), "partial": ""}
            elif kind == "content_block_delta" and index in blocks:
                delta = obj.get("delta") or {}
                if delta.get("type") == "text_delta":
                    blocks[index]["text"] = blocks[index].get("text", "") + delta.get("text", "")
                elif delta.get("type") == "input_json_delta":
                    blocks[index]["partial"] += delta.get("partial_json", "")
        content = []
        for _, b in sorted(blocks.items()):
            if b.get("type") == "tool_use" and b["partial"]:
                b["input"] = args_of(b["partial"])
            content.append(b)
        return self.parse_response({"content": content})

    def render(self, turn: AssistantTurn, model: str) -> dict[str, Any]:
        content: list[dict[str, Any]] = []
        if turn.text:
            content.append({"type": "text", "text": turn.text})
        for call in turn.tool_calls:
            content.append({"type": "tool_use", "id": call.id or _tool_id(), "name": call.name, "input": call.arguments})
        i, o = turn.usage
        return {"id": "msg_" + secrets.token_hex(12), "type": "message", "role": "assistant", "model": model,
                "content": content, "stop_reason": "tool_use" if turn.tool_calls else "end_turn",
                "stop_sequence": None, "usage": {"input_tokens": i, "output_tokens": o}}

    def render_stream(self, turn: AssistantTurn, model: str, request: dict[str, Any]) -> list[bytes]:
        i, o = turn.usage
        message = {"id": "msg_" + secrets.token_hex(12), "type": "message", "role": "assistant", "model": model,
                   "content": [], "stop_reason": None, "stop_sequence": None,
                   "usage": {"input_tokens": i, "output_tokens": 1}}
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
            events.append(sse(dumps({"type": "content_block_start", "index": index,
                                     "content_block": {"type": "tool_use", "id": call.id or _tool_id(),
                                                       "name": call.name, "input": {}}}), "content_block_start"))
            events += [sse(dumps({"type": "content_block_delta", "index": index,
                                  "delta": {"type": "input_json_delta", "partial_json": part}}), "content_block_delta")
                       for part in split_json(call.arguments)]
            events.append(sse(dumps({"type": "content_block_stop", "index": index}), "content_block_stop"))
            index += 1
        events.append(sse(dumps({"type": "message_delta",
                                 "delta": {"stop_reason": "tool_use" if turn.tool_calls else "end_turn",
                                           "stop_sequence": None},
                                 "usage": {"output_tokens": o}}), "message_delta"))
        events.append(sse(b'{"type":"message_stop"}', "message_stop"))
        return events


def _input(u: dict[str, Any]) -> int | None:
    if u.get("input_tokens") is None:
        return None
    return int(u["input_tokens"]) + int(u.get("cache_read_input_tokens") or 0) + int(u.get("cache_creation_input_tokens") or 0)


def _tool_id() -> str:
    return "toolu_" + secrets.token_hex(12)


MESSAGES = MessagesFormat()
