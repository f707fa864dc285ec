"""Recitation: the goal, the live plan and the user's prohibitions, re-stated near the end of every request.

Long sessions push the user's request far back in the context; reciting it near the tail keeps it in the model's
view (seed 003 "Recite"; ``reference/in-session-supervisor-mechanics.md`` section 4, "Recitation near the request
tail"). :func:`recite` builds the block; the proxy inserts it after the agent's last history item when its text
changed, and puts it back at that place in later requests (``proxyvisor.proxy.planning``). The block::

    <supervisor-note signal="recite"><pay-attention>
    Re-anchor on your task:
    Goal (fixed): <intent>the latest genuine user request</intent>
    Live plan (1/3 done): ...                        (gate.plan.checklist)
    Constraints from the user's requests - verbatim, still binding:
    - Do not run the tests.
    </pay-attention></supervisor-note>

- the goal is clipped to :data:`GOAL_CHARS` (2,000) characters, head 2/3 and tail 1/3 (proxyvisor's bound: the
  reference recites its compression anchor's goal, itself bounded);
- the constraints are the user's prohibitions in force (``proxyvisor.gate.prohibitions.standing``: stated in any
  user turn of the thread and not lifted since; at most 8, of at most 200 characters each);
- every inserted text is XML-escaped, so no text can close the block;
- the ``<supervisor-note>`` wrapper tells the model the block comes from the supervisor, not the user (the
  self-report instruction says so), and that it is advisory.

Pure; the same inputs give the same bytes, so an unchanged block is known to be unchanged and is not recited again
(a recitation stays in the upstream's history, inside the prompt-cache prefix of later requests).
"""

from __future__ import annotations

from collections.abc import Sequence
from xml.sax.saxutils import escape

from ..condense.text import clip_chars
from ..detectors.steer import note
from .plan import Plan, checklist
from .prohibitions import MAX_CHARS, MAX_ITEMS

GOAL_CHARS = 2_000
HEADER = "Re-anchor on your task:"
CONSTRAINTS = "Constraints from the user's requests - verbatim, still binding:"


def recite(goal: str, plan: Plan | None, prohibitions: Sequence[str], *, stale: bool = False) -> str | None:
    """The recitation block (module docstring) for ``goal`` (the latest genuine user request; empty: none), the
    live ``plan`` (None: none; ``stale`` marks it as made before the latest user message) and the user's
    ``prohibitions`` to re-state, verbatim (``proxyvisor.gate.prohibitions.standing``'s texts; the first 8 are
    kept, each clipped to 200 characters). None when all three are empty."""
    parts = []
    if goal.strip():
        parts.append(f"Goal (fixed): <intent>{escape(clip_chars(goal.strip(), GOAL_CHARS))}</intent>")
    if plan is not None:
        parts.append(checklist(plan, stale))
    constraints = [clip_chars(p, MAX_CHARS) for p in prohibitions[:MAX_ITEMS] if p.strip()]
    if constraints:
        parts.append("\n".join([CONSTRAINTS, *(f"- {escape(c)}" for c in constraints)]))
    if not parts:
        return None
    body = "\n".join([HEADER, *parts])
    return note("recite", f"<pay-attention>\n{body}\n</pay-attention>")
