"""The ``claude-code`` adapter: Claude Code headless, ``claude -p --output-format stream-json --verbose``.

Output is one JSON object per line (observed with Claude Code 2.1.197):

- ``{"type": "system", "subtype": "init", "session_id": ..., "model": ...}``: the native session id;
- ``{"type": "assistant", "message": {"content": [text / tool_use blocks], "model": ...}, "error": ...}``: a turn
  (a ``tool_use`` block means the child started work); on an API failure the message is synthetic and ``error``
  names it (``rate_limit``, ``authentication_failed``, ...);
- ``{"type": "user", ...}``: tool results;
- ``{"type": "result", "is_error": bool, "result": "final text", "api_error_status": 429 | null, "subtype":
  "success" | "error_max_turns" | ..., "usage": {...}}``: the end.

Failures are normalised from ``api_error_status`` first, then the wording of ``result`` (e.g. "API Error:
Request rejected (429) · rate limit exceeded", "Claude AI usage limit reached|<reset epoch>"). Claude Code
retries provider errors itself (up to 10 times by default); set ``CLAUDE_CODE_MAX_RETRIES`` through the ``env``
option to let the breaker see a limit sooner.
"""

from __future__ import annotations

import time
from typing import Any

from .process import CliRuntime, json_event
from .runtime import ChildProgress, NativeError

_FINISH = {"success": "stop", "error_max_turns": "length"}


class ClaudeCodeRuntime(CliRuntime):
    default_bin = "claude"

    command = ("-p", "--output-format", "stream-json", "--verbose")

    def effort_args(self, effort: str) -> list[str]:
        return ["--effort", effort]

    def on_line(self, line: bytes, progress: ChildProgress, state: dict[str, Any]) -> None:
        event = json_event(line, progress)
        if event is None:
            return
        kind = event.get("type")
        if kind == "system" and event.get("subtype") == "init":
            progress.native_id = str(event.get("session_id") or "")
            progress.model = str(event.get("model") or "")
            progress.event()
        elif kind == "assistant":
            message = given if isinstance(given := event.get("message"), dict) else {}
            if message.get("model") and message.get("model") != "<synthetic>":
                progress.model = str(message["model"])
            for block in message.get("content") or ():
                if not isinstance(block, dict):
                    continue
                if block.get("type") == "tool_use":
                    progress.work()
                elif block.get("type") == "text" and not event.get("error"):
                    progress.add_text(str(block.get("text", "")))
            progress.event()
        elif kind == "result":
            usage = given if isinstance(given := event.get("usage"), dict) else {}
            progress.usage(int(usage.get("input_tokens") or 0) + int(usage.get("cache_read_input_tokens") or 0)
                           + int(usage.get("cache_creation_input_tokens") or 0), int(usage.get("output_tokens") or 0))
            text = str(event.get("result") or "")
            if event.get("is_error"):
                status = event.get("api_error_status")
                progress.fail(self.normalise(NativeError(text or str(event.get("subtype") or "error"),
                                                         status=status if isinstance(status, int) else None),
                                             time.time()))
            else:
                reason = _FINISH.get(event.get("subtype", ""), "stop")
                if event.get("stop_reason") == "max_tokens":
                    reason = "length"
                progress.finish(text, reason)
        else:
            progress.event()
