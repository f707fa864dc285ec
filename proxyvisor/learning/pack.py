"""The Active Memory Pack: a project's records recited to a new session, bounded in tokens. Pure.

:func:`assemble` picks the records, :func:`render` writes the note::

    <supervisor-note signal="memory"><pay-attention>
    Recalled from earlier sessions in this project (advisory: a current user instruction beats a recalled rule):
    Rules (the user's own words, newest first; a newer rule supersedes an older one on the same subject):
    - [M5e6f7a8b] 2026-03-02 "From now on, always use pip, never uv." (user turn 1 of session 9c1d...)
    - [M1a2b3c4d] 2026-02-27 "Always use uv, never pip." (user turn 2 of session 3f2a...)
    Orientation:
    - [M...] `pytest -q` runs the project's tests and passed (action #4: Bash `pytest -q` (succeeded: 3 passed))
    Experience:
    - [M...] failed: Fix the login redirect (session 3f2a..., gate: failed)
    Name the id of a memory that materially shaped your answer in your status line's "memories".
    </pay-attention></supervisor-note>

Which records: the rules first (they bind), newest first, each with the UTC day it was first stored, so that of two
contradicting rules the model follows the newer; then the orientation and experience records sharing most content
words with the task, then orientation before experience, higher credit, newer; the note shows them grouped in the order
rules, orientation, experience (seed 003). Archived records are never recalled. Records are added while
the rendered note stays within ``budget`` tokens; one that does not fit is skipped for smaller ones after it. Every
inserted text is XML-escaped, so no record can close the note. The same records and budget give the same bytes:
the shell renders a session's pack once and re-inserts it unchanged (the prompt-cache prefix holds).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from xml.sax.saxutils import escape

from ..detectors.steer import note
from ..gate.prohibitions import content_words
from .memory import EXPERIENCE, KINDS, ORIENTATION, READ_CHARS, RULE, Record

SIGNAL = "memory"
HEADER = ("Recalled from earlier sessions in this project (advisory: a current user instruction beats a recalled "
          "rule):")
TITLES = {RULE: "Rules (the user's own words, newest first; a newer rule supersedes an older one on the same "
                "subject):", ORIENTATION: "Orientation:", EXPERIENCE: "Experience:"}
_SMALLEST = 12
"""Tokens below which no record's line fits (its id, brackets and a word or two): the search stops there."""
FOOTER = "Name the id of a memory that materially shaped your answer in your status line's \"memories\"."


@dataclass(frozen=True)
class Pack:
    """The recalled ``records`` (in note order), the note's ``text`` and its size in ``tokens``."""

    records: tuple[Record, ...]
    text: str
    tokens: int


def _line(record: Record) -> str:
    if record.kind == RULE:
        day = datetime.fromtimestamp(record.created, timezone.utc).date().isoformat()
        return f"- [{record.id}] {day} \"{escape(record.text)}\" ({escape(record.source)})"
    if record.kind == EXPERIENCE:
        return f"- [{record.id}] {record.label}: {escape(record.text)} ({escape(record.source)})"
    return f"- [{record.id}] {escape(record.text)} ({escape(record.source)})"


def render(records: Sequence[Record]) -> str | None:
    """The note of ``records`` (module docstring), grouped by kind in :data:`KINDS` order; None for none."""
    if not records:
        return None
    parts = [HEADER]
    for kind in KINDS:
        lines = [_line(r) for r in records if r.kind == kind]
        if lines:
            parts += [TITLES[kind], *lines]
    parts.append(FOOTER)
    return note(SIGNAL, "<pay-attention>\n" + "\n".join(parts) + "\n</pay-attention>")


def assemble(records: Sequence[Record], task: str, budget: int, count: Callable[[str], int]) -> Pack:
    """The pack of ``records`` for ``task`` (the session's first request) within ``budget`` tokens as ``count``
    counts them (module docstring); the first :data:`READ_CHARS` characters of ``task`` are read."""
    words = content_words(task[:READ_CHARS])

    def rank(r: Record) -> tuple[bool, float, int, int, float, float, str]:
        if r.kind == RULE:  # newest first, and so kept first when the budget is short
            return False, -r.created, 0, 0, 0.0, 0.0, r.id
        return True, 0.0, -len(words & content_words(r.text)), KINDS.index(r.kind), -r.credit, -r.created, r.id

    chosen: list[Record] = []
    used = count(note(SIGNAL, "<pay-attention>\n" + "\n".join([HEADER, FOOTER]) + "\n</pay-attention>"))
    seen_kinds: set[str] = set()
    for record in sorted((r for r in records if not r.archived), key=rank):
        if budget - used < _SMALLEST:
            break
        cost = count(_line(record)) + 1 + (0 if record.kind in seen_kinds else count(TITLES[record.kind]) + 1)
        if used + cost > budget:
            continue
        chosen.append(record)
        seen_kinds.add(record.kind)
        used += cost
    # The estimate above adds line by line; the rendered note is counted exactly, and trimmed if it ran over.
    chosen.sort(key=lambda r: KINDS.index(r.kind))  # note order (a stable sort keeps the rank within a kind)
    while chosen:
        text = render(chosen)
        assert text is not None
        tokens = count(text)
        if tokens <= budget:
            return Pack(tuple(chosen), text, tokens)
        chosen.pop()
    return Pack((), "", 0)
