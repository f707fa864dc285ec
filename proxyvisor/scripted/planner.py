"""The scripted upstream as a planner: a fixed, deterministic answer to proxyvisor's own planner requests.

With ``[supervisor.model] api_base = "scripted:"`` the planner call (``proxyvisor.proxy.planning``) goes to the
embedded scripted upstream, which recognises it by its system prompt (``proxyvisor.gate.plan.PLANNER_INSTRUCTIONS``)
and answers it without taking a script step:

- ``request``: ``create`` a plan of three phases derived from the request's first line (the *subject*):
  understand it, change it, verify it, each with a done-when condition;
- ``phase_complete``: ``advance`` when the recent recorded actions hold a successful one (its line is the
  summary), else ``hold``;
- ``reassess``: ``hold`` (the plan stays as it is).

It stands in for a model in the demo and the tests, with no key and no network; it is a plain policy, not a
judgement of the work.
"""

from __future__ import annotations

from typing import Any

import orjson

from ..gate.plan import PHASE_COMPLETE, PLANNER_INSTRUCTIONS, REQUEST
from ..proxy.formats import WireFormat

SUBJECT_CHARS = 80
MARKS = (PLANNER_INSTRUCTIONS.split(".", 1)[0],)
"""How the system prompt of a planner call starts (``proxyvisor.scripted.upstream`` dispatches on it)."""
_OK = "\u2192 ok"
"""How a successful action's line reads (``proxyvisor.gate.digest.action_lines``)."""


def answer(fmt: WireFormat, body: dict[str, Any]) -> str:
    """The answer text (one decision as JSON) to a planner call (see the module docstring).

    Raises:
        ValueError: (``orjson.JSONDecodeError``, ``KeyError``, ``TypeError``, ``AttributeError``) the user message
            is not the planner input; the scripted upstream turns that into a 400.
    """
    payload = orjson.loads(fmt.fingerprint_parts(body)[1])
    signal = payload["signal"]
    if signal == REQUEST:
        first = next((line.strip() for line in str(payload["current_request"]).splitlines() if line.strip()),
                     "the request")
        subject = first if len(first) <= SUBJECT_CHARS else first[:SUBJECT_CHARS - 1] + "\u2026"
        return _dumps({"decision": "create", "title": subject, "tasks": [
            {"title": f"Understand: {subject}", "done_when": "the code and files involved have been read",
             "valid_if": None},
            {"title": f"Change: {subject}", "done_when": "the change has been made", "valid_if": None},
            {"title": f"Verify: {subject}", "done_when": "a check of the change (a test or a run) succeeded",
             "valid_if": None}]})
    if signal == PHASE_COMPLETE:
        done = [line for line in payload["recent_actions"] if _OK in line]
        if done:
            return _dumps({"decision": "advance", "summary": f"evidenced by {done[-1]}"})
        return _dumps({"decision": "hold", "reason": "no successful action is recorded since the phase started"})
    return _dumps({"decision": "hold", "reason": "the plan still fits the work"})


def _dumps(obj: dict[str, Any]) -> str:
    return orjson.dumps(obj).decode()
