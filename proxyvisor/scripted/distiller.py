"""The scripted upstream as a distiller: a fixed answer to learning's distill call (``proxyvisor.proxy.learning``).

On the session's own route (or ``[supervisor.model] api_base = "scripted:"``) the distill call reaches the scripted
upstream, which recognises it by its system prompt (``proxyvisor.learning.distill.INSTRUCTIONS``) and answers it
without taking a script step: no rules and no orientation, so what a session keeps is its free records alone (the
durable rules, the passing check, the experience), the same on every run. A plain policy, not a judgement.
"""

from __future__ import annotations

from typing import Any

from ..learning.distill import INSTRUCTIONS
from ..proxy.formats import WireFormat

MARKS = (INSTRUCTIONS[:60],)
"""How the system prompt of a distill call starts (``proxyvisor.scripted.upstream`` dispatches on it)."""


def answer(fmt: WireFormat, body: dict[str, Any]) -> str:
    """The answer text to a distill call: nothing more to learn."""
    return '{"rules": [], "orientation": []}'
