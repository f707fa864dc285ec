"""The user's explicit prohibitions, taken verbatim from a request: they bind the verifier and are recited.

Rules (``reference/in-session-supervisor-mechanics.md`` section 4, "Recitation", the "Constraints from the
request" list; seed 003 "Verify-gate": "a forbidden check's absence is compliance, not a gap"):

- A request is cut into **units**: lines, then sentences (ending in ``.``, ``!`` or ``;``).
- A unit is a prohibition when it contains (case-insensitive) ``do not ``, ``don't ``, ``never ``, ``must not ``,
  ``not allowed`` or ``forbidden``.
- Skipped: lines inside code fences, blockquotes (``>``), box-drawing UI lines (U+2500-U+257F), ``NN:`` excerpts
  (a line number and a colon, as tools print file lines), questions (ending in ``?``) and quote-led units (they
  quote someone else's words).
- At most :data:`MAX_ITEMS` (8) items of at most :data:`MAX_CHARS` (200) characters each, first ones kept,
  duplicates dropped.

Pure functions; no I/O.
"""

from __future__ import annotations

import re

MAX_ITEMS = 8
MAX_CHARS = 200
_MARKERS = ("do not ", "don't ", "don\u2019t ", "never ", "must not ", "not allowed", "forbidden")
_SENTENCE = re.compile(r"(?<=[.!;])\s+")
_BOX = re.compile("[\u2500-\u257f]")
_EXCERPT = re.compile(r"^\s*\d+\s*:")
_QUOTES = "\"'\u201c\u2018`"


def prohibitions(request: str) -> tuple[str, ...]:
    """The prohibitions stated in ``request``, verbatim (trimmed, clipped to :data:`MAX_CHARS` characters)."""
    found: list[str] = []
    fenced = False
    for line in request.splitlines():
        stripped = line.strip()
        if stripped.startswith(("```", "~~~")):
            fenced = not fenced
            continue
        if fenced or stripped.startswith(">") or _BOX.search(stripped) or _EXCERPT.match(stripped):
            continue
        for unit in _SENTENCE.split(stripped):
            unit = unit.strip()
            lowered = unit.lower() + " "
            if (not unit or unit.endswith("?") or unit[0] in _QUOTES
                    or not any(marker in lowered for marker in _MARKERS)):
                continue
            unit = unit if len(unit) <= MAX_CHARS else unit[:MAX_CHARS - 1] + "\u2026"
            if unit not in found:
                found.append(unit)
            if len(found) == MAX_ITEMS:
                return tuple(found)
    return tuple(found)
