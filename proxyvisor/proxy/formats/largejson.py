"""Reading and writing one very large JSON text (a big SSE event's data) in bounded steps.

``orjson.loads`` of a 100 MB text is one C call that holds Python's interpreter lock for its whole length (half a
second or more on a loaded machine): run in a worker thread it still stops the event loop, which serves every
session, for that long. A big event is big because of a few long string values (a delta's text, a tool call's
arguments, an image's base64), so :func:`loads` cuts those out: the rest of the text, with a placeholder in place
of each long string, is parsed at once (it is small), and each long string is decoded in slices of
:data:`SLICE` characters, the lock free for others between them. The result equals ``wirejson.loads`` of the whole
text (the same object, the same errors); each long string's decoded slices are joined a slice at a time too
(:func:`~proxyvisor.bigtext.concat`). :func:`dumps` writes such an object back the same way, as pieces that join
to ``orjson.dumps`` of it. Pure: no I/O, no clock.
"""

from __future__ import annotations

import re
import secrets
from typing import Any

import orjson

from ... import wirejson
from ... import bigtext
from ...bigtext import concat, pause

LONG = 16 * 1024
"""A string literal of at least this many characters is decoded in slices."""
SLICE = bigtext.SLICE
"""Characters of a long string decoded per step: :mod:`proxyvisor.bigtext`'s step."""
MAX_LITERALS = 20_000
"""Past this many string literals the text is parsed whole: a text of many small strings gains nothing from
being cut, and scanning them one by one in Python would cost more than the parse."""
_ESCAPE = 12
"""The longest JSON escape: a UTF-16 surrogate pair, ``\\ud83d\\ude00``."""


def loads(text: str) -> Any:
    """``orjson.loads(text)``, with long string literals decoded in slices (module docstring).

    Raises:
        orjson.JSONDecodeError: ``text`` is not JSON (as ``orjson.loads`` would).
    """
    longs = _long_literals(text)
    if not longs:
        return wirejson.loads(text)
    nonce = "\x00" + secrets.token_hex(8) + ":"
    parts: list[str] = []
    pos = 0
    for n, (start, end) in enumerate(longs):
        parts += [text[pos:start - 1], orjson.dumps(f"{nonce}{n}").decode()]
        pos = end + 1
    parts.append(text[pos:])
    skeleton = wirejson.loads("".join(parts))
    values = [_decode(text, start, end) for start, end in longs]
    return _fill(skeleton, nonce, values)


def _long_literals(text: str) -> list[tuple[int, int]]:
    """(first character, closing quote) of each string literal of :data:`LONG` characters or more in ``text``;
    empty when there is none, or when ``text`` has more than :data:`MAX_LITERALS` literals or is not JSON as far
    as quotes go (the whole parse then decides)."""
    found: list[tuple[int, int]] = []
    pos, count = 0, 0
    while (quote := text.find('"', pos)) >= 0:
        count += 1
        end = _literal_end(text, quote + 1)
        if count > MAX_LITERALS or end < 0:
            return []
        if end - quote - 1 >= LONG:
            found.append((quote + 1, end))
        pos = end + 1
    return found


_DENSE = 32
"""Escaped quotes in one slice after which the rest of it is matched by :data:`_BODY` rather than quote by quote."""
_BODY = re.compile(r'[^"\\]*(?:\\.[^"\\]*)*', re.S)
"""Characters of a string literal's body: anything but a quote or backslash, or an escape."""


def _literal_end(text: str, pos: int) -> int:
    """Where the closing quote is of the string literal whose body starts at ``pos`` (-1: none). A slice at a
    time: the next quote is found at C speed and checked for escaping; a slice dense with escaped quotes is
    matched by :data:`_BODY` instead (slower per character, but not per quote)."""
    n = len(text)
    while pos < n:
        pause()
        stop = min(pos + SLICE, n)
        for _ in range(_DENSE):
            quote = text.find('"', pos, stop)
            if quote < 0:
                pos = stop + _escaped(text, stop)  # an odd run of backslashes at the cut escapes the next one
                break
            if not _escaped(text, quote):
                return quote
            pos = quote + 1
        else:
            body = _BODY.match(text, pos, stop)
            assert body is not None  # _BODY matches the empty string
            pos = body.end()  # stops at a quote, at the slice's end or before a lone "\"
            if pos < n and text[pos] == '"':
                return pos
    return -1


def _escaped(text: str, at: int) -> bool:
    """Whether an odd run of backslashes ends right before ``at`` (in a string literal: ``text[at]`` is escaped)."""
    start = at
    while text[start - 1] == "\\":
        start -= 1
    return (at - start) % 2 == 1


def _decode(text: str, start: int, end: int) -> str:
    """The value of the string literal whose characters are ``text[start:end]``, decoded slice by slice, each cut
    placed where no escape sequence spans it.

    Raises:
        orjson.JSONDecodeError: the literal is not a valid JSON string.
    """
    cuts = [start]
    while cuts[-1] < end:
        pos = cuts[-1]
        cut = min(pos + SLICE, end)
        if cut < end:
            # Back to a backslash with no other within an escape's length before it: an escape starts there and
            # none before it reaches the cut. A run of escapes too dense for that decodes whole.
            while (slash := text.rfind("\\", cut - _ESCAPE, cut)) >= 0:
                cut = slash
                if cut - pos <= SLICE // 2:
                    whole: str = orjson.loads('"' + text[start:end] + '"')
                    return whole
        cuts.append(cut)
    if len(cuts) == 2:
        one: str = orjson.loads('"' + text[start:end] + '"')
        return one
    return concat(orjson.loads('"' + text[pos:cut] + '"') for pos, cut in zip(cuts, cuts[1:]))


def _fill(value: Any, nonce: str, values: list[str]) -> Any:
    """``value`` with each placeholder string (``nonce`` and a number) replaced by that long string."""
    if isinstance(value, str):
        return values[int(value[len(nonce):])] if value.startswith(nonce) else value
    if isinstance(value, dict):
        return {_fill(k, nonce, values): _fill(v, nonce, values) for k, v in value.items()}
    if isinstance(value, list):
        return [_fill(v, nonce, values) for v in value]
    return value


def dumps(value: Any) -> list[bytes]:
    """Pieces that join to ``orjson.dumps(value)``: each string of :data:`LONG` characters or more is encoded a
    slice at a time, and the pieces are not joined.

    Raises:
        orjson.JSONEncodeError: ``value`` is not serializable (as ``orjson.dumps`` would).
    """
    nonce = "\x00" + secrets.token_hex(8) + ":"
    longs: list[str] = []
    encoded = wirejson.dumps(_cut(value, nonce, longs))
    if not longs:
        return [encoded]
    out: list[bytes] = []
    pos = 0
    for n, text in enumerate(longs):
        mark = orjson.dumps(f"{nonce}{n}")
        at = encoded.index(mark, pos)
        out += [encoded[pos:at], b'"']
        for i in range(0, len(text), SLICE):
            out.append(orjson.dumps(text[i:i + SLICE])[1:-1])
            pause()
        out.append(b'"')
        pos = at + len(mark)
    out.append(encoded[pos:])
    return out


def _cut(value: Any, nonce: str, longs: list[str]) -> Any:
    """``value`` with each long string replaced by a placeholder (``nonce`` and its number in ``longs``, which
    collects them in the order ``orjson.dumps`` writes them)."""
    if isinstance(value, str):
        if len(value) < LONG:
            return value
        longs.append(value)
        return f"{nonce}{len(longs) - 1}"
    if isinstance(value, dict):
        return {_cut(k, nonce, longs): _cut(v, nonce, longs) for k, v in value.items()}
    if isinstance(value, list):
        return [_cut(v, nonce, longs) for v in value]
    return value

