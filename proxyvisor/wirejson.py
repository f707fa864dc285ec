"""JSON for what passes between the agent and its model: orjson, with integers of any size kept exactly.

orjson reads an integer outside the 64-bit range as a float (``12345678901234567890123`` becomes
``1.2345678901234568e+22``) and refuses to write one. A body, reply or event that is read and written again would
reach the other side changed. :func:`loads` reads text that may hold such an integer with the standard library's
``json``, which keeps integers exact, and :func:`dumps` writes with it when orjson refuses one; everything else is
orjson's, so the fast path costs one byte-translation scan more. A number past a double's range (over 309 digits)
is refused as orjson refuses it, so the standard library never reads one that long. Pure: no I/O, no clock.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

import orjson

_DIGITS = bytes(0x30 if 0x30 <= b <= 0x39 else 0x20 for b in range(256))
"""Every digit to ``0``, every other byte to a space: a run of digits becomes a run of ``0`` for a plain search."""
_RUN = b"0" * 19
"""The shortest run of digits that can be an integer orjson cannot hold (below -2**63 has 19 digits)."""
_WIDE = re.compile(rb"[\[:,][ \t\n\r]*-?[0-9]{19}")
"""A number of 19 digits or more where a JSON value starts (the run may also be text inside a string: the slow path
is then taken for nothing, but it reads the same values)."""
_LOW, _HIGH = -(2**63), 2**64 - 1
"""The integers orjson reads and writes."""
_TOO_DEEP = "Recursion limit reached"
"""orjson's refusal of a value nested over 255 levels, which it reads up to 1024."""


def loads(data: bytes | str) -> Any:
    """``orjson.loads(data)``, except that an integer beyond 64 bits is the exact ``int``, not a float.

    Raises:
        orjson.JSONDecodeError: ``data`` is not JSON, exactly as ``orjson.loads`` raises it.
    """
    value = orjson.loads(data)
    raw = data.encode() if isinstance(data, str) else data
    if _RUN not in raw.translate(_DIGITS) or _WIDE.search(raw) is None:
        return value
    try:  # orjson accepted it, so it is JSON the standard library reads alike, only with exact integers
        return json.loads(raw)
    except RecursionError:  # nesting deeper than the standard library goes (orjson allows 1024 levels)
        return value


def dumps(value: Any, option: int = 0, default: Callable[[Any], Any] | None = None) -> bytes:
    """``orjson.dumps(value, default, option)``; a value orjson refuses because it holds an integer beyond 64 bits
    or is nested deeper than orjson writes (it reads deeper than it writes) is written compact by the standard
    library (keys sorted with ``orjson.OPT_SORT_KEYS``), the integer exact.

    Raises:
        orjson.JSONEncodeError: ``value`` cannot be written, as ``orjson.dumps`` raises it.
    """
    try:
        return orjson.dumps(value, default, option)
    except orjson.JSONEncodeError as exc:
        if str(exc) != _TOO_DEEP and not _wide(value):
            raise
        try:
            return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False, default=default,
                              sort_keys=bool(option & orjson.OPT_SORT_KEYS)).encode()
        except (TypeError, ValueError, RecursionError):  # something else orjson refused, as it said
            raise exc from None


def _wide(value: Any) -> bool:
    """Whether ``value`` holds an int orjson cannot write. Walked with a stack, not recursion: orjson writes 1024
    levels of nesting, more than Python's recursion limit allows a recursive walk."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, int) and not isinstance(item, bool):
            if not _LOW <= item <= _HIGH:
                return True
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return False
