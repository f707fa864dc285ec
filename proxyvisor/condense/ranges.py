"""Line ranges as the condenser writes them: ``"A-B"``, ``"A"``, ``"A-"`` (to the end), 1-based, inclusive.

A bare integer is accepted as ``"A"``. Parsing is all-or-nothing (seed 003's rule): one malformed, zero, reversed
or out-of-range entry voids the whole selection of that result, because a model that got one range wrong may
have misread the numbering everywhere.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

_RANGE = re.compile(r"\s*(\d+)\s*(?:([-–])\s*(\d+)?\s*)?")


class RangeError(ValueError):
    """A range entry is malformed or outside ``1..total_lines``; the message quotes it."""


def parse_ranges(entries: object, total_lines: int) -> list[tuple[int, int]]:
    """The inclusive ``(first, last)`` ranges of ``entries`` (a list of strings or ints) for a result of
    ``total_lines`` lines.

    Raises:
        RangeError: ``entries`` is not a list, or any entry is malformed, 0, reversed, or past ``total_lines``.
    """
    if not isinstance(entries, list):
        raise RangeError(f"'lines' must be a list, got {type(entries).__name__}")
    ranges = []
    for entry in entries:
        if isinstance(entry, bool) or not isinstance(entry, (int, str)):
            raise RangeError(f"range {entry!r} is neither a string nor an integer")
        match = _RANGE.fullmatch(str(entry))
        if match is None:
            raise RangeError(f"range {entry!r} is not A-B, A or A-")
        first = int(match.group(1))
        last = first if match.group(2) is None else int(match.group(3) or total_lines)
        if not 1 <= first <= last <= total_lines:
            raise RangeError(f"range {entry!r} is outside 1-{total_lines} or reversed")
        ranges.append((first, last))
    return ranges


def lines_in(ranges: Iterable[tuple[int, int]]) -> set[int]:
    """Every line number covered by ``ranges``."""
    out: set[int] = set()
    for first, last in ranges:
        out.update(range(first, last + 1))
    return out


def runs(numbers: Iterable[int]) -> list[tuple[int, int]]:
    """Sorted distinct ``numbers`` merged into inclusive ``(first, last)`` runs (overlaps and neighbours join)."""
    out: list[tuple[int, int]] = []
    for n in sorted(set(numbers)):
        if out and out[-1][1] == n - 1:
            out[-1] = (out[-1][0], n)
        else:
            out.append((n, n))
    return out
