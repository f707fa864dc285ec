"""The scripted upstream as a condenser: a fixed, deterministic answer to proxyvisor's own condenser requests.

With ``[supervisor.model] api_base = "scripted:"`` the condenser call (``proxyvisor.supervisor_model``) goes to the
embedded scripted upstream, which recognises it by its system prompt (``proxyvisor.condense.protocol``) and
answers it without taking a script step. For every result it answers ``extract`` with the first :data:`HEAD` and
last :data:`TAIL` lines it was shown, plus every shown line that mentions a focus term of the round's intent or
of the call's arguments (``proxyvisor.condense.signals.focus_terms``: what the agent was looking for), skipping a
term found on more than max(8, 2%) of the shown lines, which does not discriminate (the numbered view's rule);
the reconstruction then adds every diagnostic line with its context, as it does for any condenser. It stands in for a
model in ``proxyvisor demo``, ``proxyvisor replay --condense`` and the benchmarks, with no key and no network; it
is a plain policy, not a judgement of relevance.
"""

from __future__ import annotations

import re
from typing import Any

import orjson

from ..condense.protocol import SYSTEM_PROMPT
from ..condense.ranges import runs
from ..condense.signals import focus_terms
from ..proxy.formats import WireFormat

HEAD = 10
TAIL = 10
MARKS = (SYSTEM_PROMPT.split(".", 1)[0],)
"""How the system prompt of a condenser call starts (``proxyvisor.scripted.upstream`` dispatches on it)."""
_SHOWN = re.compile(r"^ *(\d+)\| ?(.*)$")


def answer(fmt: WireFormat, body: dict[str, Any]) -> str:
    """The answer text (the protocol's JSON object) to a condenser call (see the module docstring).

    Raises:
        ValueError: (``orjson.JSONDecodeError``, ``KeyError``, ``TypeError``) the user message is not the
            protocol's JSON payload; the scripted upstream turns that into a 400.
    """
    payload = orjson.loads(fmt.fingerprint_parts(body)[1])
    intent = payload.get("tool_round_intent") or ""
    return orjson.dumps({"results": [_verdict(result, intent) for result in payload["results"]]}).decode()


def _verdict(result: dict[str, Any], intent: str) -> dict[str, Any]:
    terms = focus_terms([intent, result.get("arguments") or ""])
    shown: list[int] = []
    matches: dict[str, list[int]] = {term: [] for term in terms}
    for line in str(result["numbered_output"]).split("\n"):
        match = _SHOWN.match(line)
        if match is None:
            continue  # a gap marker
        shown.append(int(match.group(1)))
        text = match.group(2).lower()
        for term in terms:
            if term in text:
                matches[term].append(shown[-1])
    common = max(8, len(shown) // 50)
    kept = {n for found in matches.values() if len(found) <= common for n in found}
    kept.update(shown[:HEAD] + shown[-TAIL:])
    if len(kept) == len(shown) and not result.get("partial_view"):
        return {"id": result["id"], "verdict": "keep"}
    return {"id": result["id"], "verdict": "extract",
            "lines": [f"{a}-{b}" if a != b else str(a) for a, b in runs(kept)]}
