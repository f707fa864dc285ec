"""Anthropic Messages (``POST /v1/messages``): named SSE events from ``message_start`` to ``message_stop``."""

from __future__ import annotations

import secrets
from typing import Any

import orjson

from .base import AssistantTurn, ToolSpec, Usage, WireFormat, dumps, error_types, split_json, sse, words


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(b.get("text", "") for b in content
                         if isinstance(b, dict) and b.get("type") == "text" and isinstance(b.get("text"), str))
    return ""


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
                first_user = _text(message.get("content"))
                break
        return _text(body.get("system")), first_user

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
