"""The scripted upstream as a condenser: it is none, so the deterministic condenser decides.

With the session's route on the embedded scripted upstream (``proxyvisor demo``, ``proxyvisor replay --condense``,
the benchmarks) or ``[supervisor.model] api_base = "scripted:"``, the condenser call reaches the scripted upstream,
which recognises it by its system prompt (``proxyvisor.condense.protocol``) and, unless a ``condense`` step is
queued, answers it without taking a script step: with no verdict for any result. The condense engine then
condenses each result without a model (``proxyvisor.condense.select``), exactly as when no model is reachable, so
what the scripted upstream shows is the product's own deterministic condenser, not a stand-in policy.
"""

from __future__ import annotations

from typing import Any

from ..condense.protocol import SYSTEM_PROMPT
from ..proxy.formats import WireFormat

MARKS = (SYSTEM_PROMPT.split(".", 1)[0],)
"""How the system prompt of a condenser call starts (``proxyvisor.scripted.upstream`` dispatches on it)."""
NO_VERDICT = '{"results": []}'


def answer(fmt: WireFormat, body: dict[str, Any]) -> str:
    """The answer text to a condenser call in ``fmt`` (``body``): no verdict for any result."""
    return NO_VERDICT
