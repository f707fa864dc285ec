"""What a parent gets back from a child: a shaped result, a claim check for long ones, evidence and a trace.

**Shapes** (seed 001): a child that finished (``stop``) gives its text as a bare string; one that ended otherwise
(``length``, ``tool_calls``, ``suspended``, or stopped: ``timeout``, ``idle_timeout``, ``cancelled``) gives
``{"text": ..., "finish_reason": ...}`` so a truncated answer never reads as complete; a failing one gives an
error tool result (``Tool 'reviewer' failed: ...``) so the parent's model replans.

**Claim check** (seed 002): a text over the limit (6,000 characters by default) is stored as a record before the
reference is handed out; the parent gets the head, the tail and the record id. Records expire after the
retention time.

**Evidence** (seed 000): OpenTelemetry GenAI attribute names where they exist (``gen_ai.provider.name`` the
adapter, ``gen_ai.agent.id`` the role, ``gen_ai.request.model`` the model actually used,
``gen_ai.conversation.id`` the runtime's native session), plus ``capacity_scope``, ``health_state``,
``health_probe``, ``error_category``, ``retry_after_s``, the W3C ``trace_id`` shared with the parent and the
``span_id`` of the delegation (the parent span of the child's own work: the span id of the ``traceparent`` it is
handed).
"""

from __future__ import annotations

import json
import re
import secrets
import time
from dataclasses import dataclass
from typing import Any

import orjson

from .children import ChildOutcome
from .health import Admission
from .runtime import FINISHED
from .state import KV

TRACEPARENT = re.compile(r"^00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$")
"""A W3C ``traceparent`` (version 00): trace id, span id, flags (also parsed by ``proxyvisor.proxy.telemetry``)."""


def child_traceparent(parent: str | None) -> str:
    """A W3C ``traceparent`` for a child: the parent's trace id and flags with a fresh span id; a new trace when
    ``parent`` is absent or invalid (an all-zero id is invalid), so a child never produces broken spans."""
    match = TRACEPARENT.match((parent or "").strip().lower())
    if match and set(match.group(1)) != {"0"} and set(match.group(2)) != {"0"}:
        return f"00-{match.group(1)}-{secrets.token_hex(8)}-{match.group(3)}"
    return f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-01"


def trace_id_of(traceparent: str) -> str:
    match = TRACEPARENT.match(traceparent)
    return match.group(1) if match else ""


def span_id_of(traceparent: str) -> str:
    match = TRACEPARENT.match(traceparent)
    return match.group(2) if match else ""


class ClaimStore:
    """Long child results, kept in ``kv`` (the ``claims`` namespace of the state backend) for ``retention_s``
    seconds, as JSON."""

    NAMESPACE = "claims"

    def __init__(self, kv: KV, retention_s: float) -> None:
        self.kv = kv
        self.retention_s = retention_s

    def put(self, text: str, meta: dict[str, Any]) -> str:
        """Store ``text`` with ``meta``; returns the record id (``clm_`` + 20 hex digits).

        Raises:
            StateUnavailable: the state backend cannot be written.
        """
        record_id = "clm_" + secrets.token_hex(10)
        # The stdlib's ASCII JSON, not orjson: a child's text may hold lone surrogates, which it escapes.
        record = json.dumps({"text": text, "meta": meta, "stored_at": time.time()}).encode()
        self.kv.set(record_id, record, self.retention_s)
        return record_id

    def get(self, record_id: str) -> dict[str, Any] | None:
        """The record (``text``, ``meta``, ``stored_at``) or None if unknown or expired; creates nothing."""
        raw = self.kv.get(record_id)
        try:
            value = json.loads(raw) if raw is not None else None
        except ValueError:
            return None
        return value if isinstance(value, dict) else None

    def close(self) -> None:
        self.kv.close()


def claim_check(text: str, limit: int, store: ClaimStore, meta: dict[str, Any]) -> tuple[str, str | None]:
    """``text`` itself when it fits in ``limit`` characters; otherwise store it and return its head (a third of
    the limit), a note with the record id and the omitted length, and its tail (a third), plus the record id."""
    if len(text) <= limit:
        return text, None
    record_id = store.put(text, meta)
    keep = limit // 3
    omitted = len(text) - 2 * keep
    note = (f"\n\n[... {omitted:,} characters omitted: the whole result ({len(text):,} characters) is stored as "
            f"record {record_id}; print it with `proxyvisor delegate --record {record_id}` ...]\n\n")
    return text[:keep] + note + text[-keep:], record_id


@dataclass(frozen=True)
class ToolResult:
    """A shaped result: ``content`` is a string or ``{"text", "finish_reason"}``; ``is_error`` marks a failure."""

    content: str | dict[str, Any]
    is_error: bool = False

    def as_text(self) -> str:
        """The content as a tool result's text (a shaped object as JSON)."""
        return self.content if isinstance(self.content, str) else orjson.dumps(self.content).decode()


def shape(role: str, outcome: ChildOutcome, text: str) -> ToolResult:
    """Shape ``outcome`` for the parent (module docstring); ``text`` is the (claim-checked) text to hand over."""
    if outcome.finish_reason is None:
        failure = outcome.failure
        detail = f"{failure.category}: {failure.message}" if failure else "no result"
        if failure and failure.retry_after_s:
            detail += f" (retry after {failure.retry_after_s} s)"
        return ToolResult(f"Tool '{role}' failed: {detail}", is_error=True)
    if outcome.finish_reason == FINISHED:
        return ToolResult(text)
    return ToolResult({"text": text, "finish_reason": outcome.finish_reason})


def evidence(role: str, adapter: str, model: str, pool: str, admission: Admission | None,
             outcome: ChildOutcome | None, traceparent: str, error_category: str | None = None,
             retry_after_s: int | None = None) -> dict[str, Any]:
    """The evidence attributes of one delegation (module docstring). ``error_category``/``retry_after_s``
    override the outcome's (for a delegation refused before any child ran)."""
    failure = outcome.failure if outcome else None
    attributes: dict[str, Any] = {
        "gen_ai.provider.name": adapter,
        "gen_ai.agent.id": role,
        "gen_ai.request.model": (outcome.model if outcome and outcome.model else model),
        "capacity_scope": pool,
        "health_state": admission.state if admission else None,
        "health_probe": bool(admission and admission.probe),
        "error_category": error_category or (failure.category if failure else None),
        "retry_after_s": retry_after_s or (failure.retry_after_s if failure else None),
        "trace_id": trace_id_of(traceparent),
        "span_id": span_id_of(traceparent),
    }
    if outcome is not None:
        attributes.update({
            "gen_ai.conversation.id": outcome.native_id or None,
            "gen_ai.usage.input_tokens": outcome.input_tokens,
            "gen_ai.usage.output_tokens": outcome.output_tokens,
            "finish_reason": outcome.finish_reason,
            "duration_s": round(outcome.duration_s, 3),
        })
    return attributes
