"""Line templates: a line with what varies between runs and between repeats masked (sans-IO).

Two lines with the same template say the same thing about different things: the same compiler error in two files,
the same exception in 74 tests, the same ``Tests run: 10, Failures: 0`` line of 700 test classes, the same log line
at two timestamps. The template masks, in this order: timestamps (ISO 8601 dates and times, clock times, the
``2022-05-30T09:11:02.856Z`` prefix of CI runners), UUIDs, hex ids (``0x7f3a...``, and runs of 7 or more hex digits
holding a digit and a letter: commit and object hashes), paths (a token holding a ``/`` or a ``\\`` with something
on each side, or ending in a file extension, plus an optional ``:line:col``, ``(line,col)`` or ``:[line,col]``
suffix), ``::``
test ids (``tests/x.py::TestA::test_b``), quoted durations and sizes, then every remaining run of digits. Whitespace
runs become one space and the line is stripped. The masks are word-like tokens (``<ts>``, ``<id>``, ``<path>``,
``#``) so that the template still reads as the line did.

What is not masked on purpose: words. Test names, identifiers and messages tell failures apart; a condenser that
folded ``test_x_axis`` into ``test_y_axis`` would lose the one failure that differs.
"""

from __future__ import annotations

import re

_RULES: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"\d{4}-\d\d-\d\d(?:[T ]\d\d:\d\d(?::\d\d(?:[.,]\d+)?)?(?:Z|[+-]\d\d:?\d\d)?)?"), "<ts>"),
    (re.compile(r"\b\d\d?:\d\d:\d\d(?:[.,]\d+)?\b"), "<ts>"),
    (re.compile(r"\b[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}\b"), "<id>"),
    (re.compile(r"\b0x[0-9a-fA-F]+\b"), "<id>"),
    (re.compile(r"\b(?=[0-9a-fA-F]*[a-fA-F])(?=[0-9a-fA-F]*\d)[0-9a-fA-F]{7,}\b"), "<id>"),
    (re.compile(r"(?:[\w.~+-]*[/\\])+[\w.~+\-<>$@*\[\]]+(?:::[\w\[\].\-]+)*(?:[:(]\d+(?:[:,]\d+)?\)?|:\[\d+,\d+\])?"
                r"|\b[\w\-]+\.(?:py|java|kt|scala|c|cc|cpp|h|hpp|rs|go|js|jsx|ts|tsx|rb|php|cs|swift|m|o|obj|so"
                r"|jar|class|log|txt|json|xml|yml|yaml|toml|cfg|ini|html|css|md|sh)\b(?:[:(]\d+(?:[:,]\d+)?\)?|:\[\d+,\d+\])?"),
     "<path>"),
    (re.compile(r"\d+(?:\.\d+)?\s?(?:ms|s|sec|seconds|min|[kKMG]i?B|bytes)\b"), "#"),
    (re.compile(r"\d+"), "#"),
    (re.compile(r"\s+"), " "),
)


def template(body: str) -> str:
    """The template of one line's text ``body`` (no terminator): see the module docstring."""
    for pattern, mask in _RULES:
        body = pattern.sub(mask, body)
    return body.strip()
