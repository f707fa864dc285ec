"""The ``codex`` adapter: OpenAI Codex CLI, ``codex exec --json``.

Output is one JSON event per line (observed with Codex 0.171.0):

- ``{"type": "thread.started", "thread_id": ...}``: the native thread id;
- ``{"type": "item.started" | "item.completed", "item": {"type": "agent_message", "text": ...}}``; an item of type
  ``command_execution``, ``file_change`` or ``mcp_tool_call`` means the child started work; an item of type
  ``error`` is a warning;
- ``{"type": "error", "message": ...}``: a transient error (Codex may be reconnecting);
- ``{"type": "turn.completed", "usage": {...}}`` or ``{"type": "turn.failed", "error": {"message": ...}}``: the end.

The answer is the last agent message. Failures are normalised from the wording, e.g. "exceeded retry limit, last
status: 429 Too Many Requests" (capacity) or "unexpected status 401 Unauthorized" (auth).
"""

from __future__ import annotations

import time
from typing import Any

from .process import CliRuntime, json_event
from .runtime import ChildProgress, NativeError

_WORK_ITEMS = {"command_execution", "file_change", "mcp_tool_call", "web_search"}


class CodexRuntime(CliRuntime):
    default_bin = "codex"

    command = ("exec", "--json", "--skip-git-repo-check")

    def effort_args(self, effort: str) -> list[str]:
        return ["--config", f'model_reasoning_effort="{effort}"']

    def on_line(self, line: bytes, progress: ChildProgress, state: dict[str, Any]) -> None:
        event = json_event(line, progress)
        if event is None:
            return
        kind = event.get("type")
        item = event.get("item") if kind else None
        item = item if isinstance(item, dict) else {}
        if kind == "thread.started":
            progress.native_id = str(event.get("thread_id") or "")
            progress.event()
        elif kind in ("item.started", "item.completed") and item.get("type") in _WORK_ITEMS:
            progress.work()
        elif kind == "item.completed" and item.get("type") == "agent_message":
            text = str(item.get("text") or "")
            state["answer"] = text
            progress.add_text(("\n\n" if progress.text else "") + text)
        elif kind == "turn.completed":
            usage = event.get("usage") or {}
            progress.usage(int(usage.get("input_tokens") or 0), int(usage.get("output_tokens") or 0))
            progress.finish(state.get("answer", progress.text))
        elif kind == "turn.failed":
            message = str((event.get("error") or {}).get("message") or "the turn failed")
            progress.fail(self.normalise(NativeError(message), time.time()))
        else:
            progress.event()
