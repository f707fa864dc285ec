"""The one way the shell closes a stream: shielded from the cancellation that usually prompts it, within a
deadline."""

from __future__ import annotations

import types
from typing import Any

import trio

CLOSE_S = 5.0
"""Seconds a close may take before it is given up (it is cancelled then, as a close on a dead peer would hang)."""


async def close(resource: Any, timeout: float = CLOSE_S) -> None:
    """Call ``resource.aclose()`` (nothing when it has none) inside a scope that the caller's cancellation does not
    reach, so that a client going away or a deadline firing still returns upstream connections to their pool and
    runs the stages' own clean-up; that scope is cancelled after ``timeout`` seconds. An async generator that ran
    to its end has nothing left to close: it costs no scope (a stream that completed closes every stage it ran
    through this way)."""
    if isinstance(resource, types.AsyncGeneratorType) and resource.ag_frame is None:
        return
    aclose = getattr(resource, "aclose", None)
    if aclose is None:
        return
    with trio.CancelScope(shield=True, deadline=trio.current_time() + timeout):
        await aclose()
