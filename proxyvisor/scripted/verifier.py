"""The scripted upstream as a verifier: a fixed, deterministic answer to the verify-gate's own calls.

With ``[supervisor.model] api_base = "scripted:"`` the gate's verifier and refuter calls (``proxyvisor.gate``) go
to the embedded scripted upstream, which recognises them by their system prompts
(:data:`~proxyvisor.gate.verdict.VERIFIER_INSTRUCTIONS`, :data:`~proxyvisor.gate.verdict.REFUTER_INSTRUCTIONS`)
and answers from the digest alone, with this policy (a plain rule, not a judgement):

- the turn changed state and its last command after the change failed: one gap, "the last check failed";
- the turn changed state and no check ran after the last change (the digest's provenance sentence), and
  the user did not forbid checks (no ``<prohibitions>`` block naming tests or checks): one gap, "no check ran";
- a hand-back (state ``blocked`` / ``need_input``) needs the user only when the final answer asks a question;
- the request text ``VERIFY-NEVER-PASSES`` (a test marker) always gives a gap; otherwise ``pass``;
- before any of that, once: when a failed action's output in ``<tool_outputs>`` is clipped (the digest's
  ``[... N chars omitted: lines A-B of T ...]`` marker) and the input holds no ``<readback>`` yet, it asks to read
  back the last :data:`READ_LINES` omitted lines (the read-back protocol, :mod:`proxyvisor.gate.verdict`), where a
  failing run's summary usually sits; the verdict that follows is the same rule's.

The refuter lets every finding stand. ``proxyvisor demo``, ``proxyvisor batch`` examples and the tests use it.
"""

from __future__ import annotations

import re
from typing import Any

import orjson

from ..gate.verdict import REFUTER_INSTRUCTIONS, VERIFIER_INSTRUCTIONS
from ..proxy.formats import WireFormat

NEVER = "VERIFY-NEVER-PASSES"
"""A request containing this text never passes (for tests of a spent re-entry budget)."""
_BLOCK = re.compile(r"<(?!verification_request\b)(\w+)[^>]*>\n?(.*?)\n?</\1>", re.DOTALL)
"""A block of the digest; the enclosing ``<verification_request>`` is skipped, or it would be the only match."""
_ACTION = re.compile(r"^#\d+ \[(mut|read)\] .* → (ok|ERROR) ")
_FORBIDS_CHECKS = re.compile(r"\b(test|tests|check|checks|verify|build)\b", re.IGNORECASE)
_CLIPPED_FAILURE = re.compile(r'<output action="(\d+)" [^>]*status="ERROR">\n(?:(?!</output>).)*?'
                              r"chars omitted: lines (\d+)-(\d+) of \d+ \.\.\.\]", re.DOTALL)
READ_LINES = 40
"""Lines the policy reads back from the end of a failed output's omitted part."""


MARKS = (VERIFIER_INSTRUCTIONS[:60], REFUTER_INSTRUCTIONS[:60])
"""How the system prompt of a verifier or refuter call starts (``proxyvisor.scripted.upstream`` dispatches on it)."""


def answer(fmt: WireFormat, body: dict[str, Any]) -> str:
    """The answer text (one JSON object) to a verifier or refuter call (module docstring)."""
    system, document = fmt.fingerprint_parts(body)
    if system.startswith(MARKS[1]):
        ids = [int(n) for n in re.findall(r"^(\d+)\. ", document, re.MULTILINE)] or [1]
        return orjson.dumps({"findings": [{"id": n, "status": "stands", "citation": ""} for n in ids]}).decode()
    clipped = _CLIPPED_FAILURE.search(document) if "<readback" not in document else None
    if clipped is not None:
        action, first, last = (int(g) for g in clipped.groups())
        return orjson.dumps({"verdict": "read",
                             "read": [{"action": action, "lines": f"{max(first, last - READ_LINES + 1)}-{last}"}]}
                            ).decode()
    blocks = {name: text for name, text in _BLOCK.findall(document)}
    request = blocks.get("current_user_turn", "")
    state = blocks.get("agent_state", "")
    final = blocks.get("agent_final_result", "")
    gaps = _gaps(request, blocks)
    handback = None
    if "state: blocked" in state or "state: need_input" in state:
        handback = {"needs_user": "?" in final, "reason": "the answer asks the user a question" if "?" in final
                    else "nothing in the answer needs the user"}
    requirement = {"id": 1, "requirement": "what the user asked", "status": "unmatched" if gaps else "matched",
                   "basis": "recorded_output" if gaps else None, "evidence": gaps[0][0] if gaps else "the answer"}
    return orjson.dumps({"requirements": [requirement],
                         "gaps": [{"requirement": 1, "gap": g, "settles": s} for g, s in gaps],
                         "handback": handback, "verdict": "gaps" if gaps else "pass"}).decode()


def _gaps(request: str, blocks: dict[str, str]) -> list[tuple[str, str]]:
    if NEVER in request:
        return [("the request's marker says it can never be verified", "nothing: this is a test marker")]
    lines = [m for m in (_ACTION.match(line) for line in blocks.get("recorded_actions", "").split("\n")) if m]
    last_change = max((i for i, m in enumerate(lines) if m.group(1) == "mut" and m.group(2) == "ok"), default=-1)
    if last_change < 0:
        return []
    after = lines[last_change + 1:]
    if after and after[-1].group(2) == "ERROR":
        return [("the last check after the change failed", "a passing run of the same check")]
    forbidden = "prohibitions" in blocks and _FORBIDS_CHECKS.search(blocks["prohibitions"])
    if "No check ran after the last change" in blocks.get("provenance", "") and not forbidden:
        return [("no check ran after the last change", "run the tests (or another check of the behaviour) and "
                                                      "show that they pass")]
    return []
