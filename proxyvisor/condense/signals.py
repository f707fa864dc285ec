"""What makes a line of tool output matter before any model looks at it: diagnostics and focus terms.

**Diagnostic lines** contain one of seed 003's narrow markers (mechanics reference, section 5): ``error:``,
``error[``, ``failed``, ``failure``, ``fatal``, ``panic:``, ``exception``, ``traceback``, ``not found``,
``no matches``, ``0 matches``, ``exit code``, ``assertion`` (lowercase substring). The list stays narrow on purpose:
pinning every "error"/"warning" kept 20-36% of plain file reads in seed 003's history. Two refinements of ours:
the ``[ERROR]`` log level (Maven and most Java and CI logs put the compiler error there, with no ``error:``), and a
zero count (``Failures: 0``, ``0 failed``, ``exit code 0``) is not a diagnostic, otherwise the ~700 passing
``Tests run: 10, Failures: 0, Errors: 0`` lines of a Maven log are all pinned and nothing can be condensed. And the
runners' own failure marks, each in the form only that runner writes: ``fail:`` and ``[fail]`` (unittest, Go's
``--- FAIL:``, sympy), ``npm err!``, Rust's ``panicked at``, pytest's ``E   `` detail lines, the ``✕``/``✗`` of
JavaScript runners, and a coded error (``error TS2304:``, ``error CS0103:``, ``error MSB3073:``).

**Focus terms** come from the task, the round's intent and the tool arguments: split on characters other than
letters, digits and ``_ - . /``, edge punctuation trimmed, at least 3 characters, a 25-word stop list removed,
deduplicated, at most 64 (the same rule as seed 003). A line matches a term when it contains it, ignoring case.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

DIAGNOSTIC_MARKERS = ("error:", "error[", "[error]", "failed", "failure", "fatal", "panic:", "exception", "traceback",
                      "not found", "no matches", "0 matches", "exit code", "assertion", "fail:", "[fail]", "err!",
                      "panicked at", "✕", "✗")
CONTEXT_LINES = 2
"""Lines of context kept on each side of a diagnostic line, in views and in reconstruction."""

MAX_FOCUS_TERMS = 64
STOP_WORDS = frozenset((
    "the", "and", "for", "with", "that", "this", "from", "what", "which", "where", "when", "why", "how", "did",
    "does", "are", "was", "were", "has", "have", "not", "but", "into", "its", "after",
))

_ZERO_COUNT = re.compile(
    r"\b(?:failures?|errors?|failed|exceptions?)\s*[:=]?\s*0(?!\.?\d)"
    r"|(?<![\d.])0\s+(?:failures?|errors?|failed|exceptions?)\b"
    r"|exit code:?\s*0(?!\.?\d)"
)
_MARKERS = re.compile("|".join(re.escape(m) for m in DIAGNOSTIC_MARKERS) + r"|\berror [a-z]{1,6}\d{2,}\b")
_TERM_SPLIT = re.compile(r"[^\w\-./]+")


def is_diagnostic(line: str) -> bool:
    """Whether ``line`` holds a diagnostic marker once zero counts are set aside (see the module docstring)."""
    if line.startswith("E   ") and line[4:].strip():
        return True
    lower = line.lower()
    if not _MARKERS.search(lower):
        return False
    return bool(_MARKERS.search(_ZERO_COUNT.sub(" ", lower)))


def diagnostic_lines(lines: list[str]) -> list[int]:
    """0-based indexes of the diagnostic lines."""
    return [i for i, line in enumerate(lines) if is_diagnostic(line)]


def with_context(indexes: Iterable[int], total: int, context: int = CONTEXT_LINES) -> set[int]:
    """``indexes`` widened by ``context`` lines on each side, within ``0..total-1``."""
    out: set[int] = set()
    for i in indexes:
        out.update(range(max(0, i - context), min(total, i + context + 1)))
    return out


def focus_terms(texts: Iterable[str]) -> list[str]:
    """Lowercase focus terms from ``texts`` in first-seen order (see the module docstring)."""
    terms: list[str] = []
    seen: set[str] = set()
    for text in texts:
        for raw in _TERM_SPLIT.split(text.lower()):
            term = raw.strip(".-/")
            if len(term) < 3 or term in STOP_WORDS or term in seen:
                continue
            seen.add(term)
            terms.append(term)
            if len(terms) == MAX_FOCUS_TERMS:
                return terms
    return terms
