"""Sticky condense decisions, kept in the state backend (``proxyvisor.adapters.state``) by session, tool call id and content hash.

Agents re-send their whole history on every request. The decision for a tool result is made once, on the first
request that carries it, and every later request gets the identical bytes: the narrowed text, or the original
when the decision was to leave it. That keeps the upstream prefix stable for provider prompt caches (DESIGN.md,
principle 5; mechanics reference, section 11.6). A result that went upstream whole once is never condensed later,
so failures (timeout, unusable answer) are sticky too. The agent's own copy is never touched.

The key is ``sha256(CONDENSE_VERSION, session, call id, text)``; the version changes whenever the rules would
narrow the same text differently. The first writer wins (:meth:`DecisionCache.settle`), so two concurrent requests
of one session end up with one decision. Entries expire after :data:`EXPIRE_S`, long after any provider cache.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from dataclasses import dataclass

from ..adapters.state import KV, Outage, StateUnavailable

log = logging.getLogger("proxyvisor.condense")

CONDENSE_VERSION = "2"
EXPIRE_S = 7 * 24 * 3600.0
SIZE_LIMIT = 256 * 1024 * 1024


@dataclass(frozen=True)
class Decision:
    """What the model's copy of one tool result is.

    ``text``: the narrowed text, or None for the original unchanged. ``reason``: why, in a few words
    (``condensed``, ``replaced``, or why the original stays). ``tokens_before`` / ``tokens_after``: the
    original's tokens and the model's copy's. ``kept_lines`` of ``total_lines``. ``spill_path``: where the full
    original is (empty when it stays inline).
    """

    text: str | None
    reason: str
    tokens_before: int
    tokens_after: int
    kept_lines: int
    total_lines: int
    spill_path: str = ""
    condenser: str = ""
    kept_ranges: tuple[tuple[int, int], ...] = ()
    baseline: str = ""


def decision_key(session: str, call_id: str, text: str) -> str:
    """The cache key of a tool result (hex sha256; lone surrogates in ``text`` are hashed as-is)."""
    digest = hashlib.sha256()
    for part in (CONDENSE_VERSION, session, call_id, text):
        data = part.encode("utf-8", "surrogatepass")
        digest.update(len(data).to_bytes(8, "big") + data)
    return digest.hexdigest()


class DecisionCache:
    """Decisions in ``kv`` (the ``condense`` namespace of the state backend; a diskcache folder is made on first
    use, so a proxy that never condenses writes nothing). Thread-safe and process-safe; the calls block (SQLite,
    Redis), so trio code runs them in a worker thread. While the backend fails (Redis down), decisions are neither
    found nor kept (results are decided again, and go upstream whole when the decision is to leave them), with
    one warning per outage."""

    NAMESPACE = "condense"
    SETTINGS = {"size_limit": SIZE_LIMIT}
    """The diskcache settings of the namespace: its size bound (Redis bounds it by :data:`EXPIRE_S` alone)."""

    def __init__(self, kv: KV, expire_s: float = EXPIRE_S) -> None:
        self.kv = kv
        self.expire_s = expire_s
        self._outage = Outage(log, "condense decisions", "results are decided again until it answers")

    def get(self, key: str) -> Decision | None:
        try:
            raw = self.kv.get(key)
        except StateUnavailable as exc:
            self._outage.failed(exc)
            return None
        self._outage.up()
        if raw is None:
            return None
        fields = json.loads(raw)
        fields["kept_ranges"] = tuple(tuple(pair) for pair in fields.get("kept_ranges", ()))
        return Decision(**fields)

    def settle(self, key: str, decision: Decision) -> Decision:
        """Store ``decision`` unless one is already stored; return the stored one (first writer wins)."""
        # The stdlib's ASCII JSON, not orjson: a tool result may hold lone surrogates, which it escapes.
        try:
            stored = self.kv.add(key, json.dumps(dataclasses.asdict(decision)).encode(), self.expire_s)
        except StateUnavailable as exc:
            self._outage.failed(exc)
            return decision
        if stored:  # the first writer: what is stored is ``decision`` (no second round trip to read it back)
            self._outage.up()
            return decision
        return self.get(key) or decision

    def close(self) -> None:
        self.kv.close()
