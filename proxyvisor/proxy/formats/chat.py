"""OpenAI Chat Completions (``POST /v1/chat/completions``): bare ``data:`` SSE lines ending in ``[DONE]``."""

from __future__ import annotations

import secrets
from typing import Any

import orjson

from .base import (AssistantTurn, ToolCall, ToolSpec, Usage, WireFormat, args_of, chat_text, dumps, error_types,
                   split_json, sse, words)




class ChatFormat(WireFormat):
    name = "chat"
    path = "/v1/chat/completions"
    label = "OpenAI Chat Completions"

    def error_body(self, status: int, message: str) -> bytes:
        kind = error_types(status)[0]
        return dumps({"error": {"message": message, "type": kind, "param": None, "code": kind if status != 429 else "rate_limit_exceeded"}})

    def stream_error(self, status: int, message: str, last_chunk: bytes = b"") -> bytes:
        # The openai SDK raises APIError on a data line whose object has an "error" key.
        return sse(self.error_body(status, message))

    def session_hint(self, body: dict[str, Any]) -> str | None:
        user = body.get("user")
        return user if isinstance(user, str) and user else None

    def fingerprint_parts(self, body: dict[str, Any]) -> tuple[str, str]:
        system, first_user = "", ""
        for message in body.get("messages") or ():
            if not isinstance(message, dict):
                continue
            role = message.get("role")
            if role in ("system", "developer") and not system:
                system = chat_text(message.get("content"))
            elif role == "user":
                first_user = chat_text(message.get("content"))
                break
        return system, first_user

    def tools(self, body: dict[str, Any]) -> list[ToolSpec]:
        out = []
        for tool in body.get("tools") or ():
            fn = tool.get("function") if isinstance(tool, dict) else None
            if isinstance(fn, dict) and isinstance(fn.get("name"), str):
                out.append(ToolSpec(fn["name"], fn.get("parameters") or {}))
        return out

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
        calls = tuple(ToolCall(c["function"]["name"], args_of(c["function"].get("arguments")), c.get("id", ""))
                      for c in message.get("tool_calls") or ())
        return AssistantTurn(chat_text(message.get("content")), calls)

    def assemble(self, events: list[tuple[str | None, str]]) -> AssistantTurn:
        text: list[str] = []
        calls: dict[int, dict[str, Any]] = {}
        for _name, data in events:
            if not data.startswith("{"):
                continue
            for choice in orjson.loads(data).get("choices") or ():
                delta = choice.get("delta") or {}
                if isinstance(delta.get("content"), str):
                    text.append(delta["content"])
                for c in delta.get("tool_calls") or ():
                    slot = calls.setdefault(c.get("index", 0), {"id": "", "name": "", "arguments": ""})
                    slot["id"] = c.get("id") or slot["id"]
                    fn = c.get("function") or {}
                    slot["name"] = fn.get("name") or slot["name"]
                    slot["arguments"] += fn.get("arguments") or ""
        return AssistantTurn("".join(text), tuple(ToolCall(c["name"], args_of(c["arguments"]), c["id"])
                                                  for _, c in sorted(calls.items())))

    def _usage(self, turn: AssistantTurn) -> dict[str, int]:
        i, o = turn.usage
        return {"prompt_tokens": i, "completion_tokens": o, "total_tokens": i + o}

    def render(self, turn: AssistantTurn, model: str) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": turn.text or None}
        if turn.tool_calls:
            message["tool_calls"] = [
                {"id": c.id or _call_id(), "type": "function",
                 "function": {"name": c.name, "arguments": orjson.dumps(c.arguments).decode()}}
                for c in turn.tool_calls
            ]
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
            events.append(chunk({"tool_calls": [{"index": index, "id": call.id or _call_id(), "type": "function",
                                                  "function": {"name": call.name, "arguments": ""}}]}))
            events += [chunk({"tool_calls": [{"index": index, "function": {"arguments": part}}]})
                       for part in split_json(call.arguments)]
        events.append(chunk({}, "tool_calls" if turn.tool_calls else "stop"))
        if (request.get("stream_options") or {}).get("include_usage"):
            events.append(sse(dumps({**base, "choices": [], "usage": self._usage(turn)})))
        events.append(b"data: [DONE]\n\n")
        return events


def _call_id() -> str:
    return "call_" + secrets.token_hex(12)


CHAT = ChatFormat()
