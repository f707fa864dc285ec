"""Supervised request bodies, parsed and serialised in proportion to what is new since the session's last request.

An agent resends its whole history with every request, and the history only grows: the next body is the last one
with a few items more, byte for byte. :class:`BodyCache` keeps, for each of a few recent bodies, where its history
ends in its bytes and its parsed items. A body that starts with such a body's bytes up to the end of its last
history item, and ends with the same bytes after the history (the tools, the settings), is parsed from the new
bytes only: the earlier items are the very same objects, and only the new items and the part after the history
are read. Anything else (a first request, a rewritten history, a body in another shape) is parsed whole, as
``wirejson.loads`` does (integers of any size exact), and the same errors come out.

The items are :class:`~proxyvisor.proxy.formats.base.Item`: dicts that are never changed in place once parsed
(whoever edits one puts a copy in its place), so what is derived from an item is kept on it: its
:class:`~proxyvisor.transcript.Message`, its links in the session chain, its serialised bytes. :func:`dumps` writes
the upstream body from those pieces, byte for byte what ``wirejson.dumps`` writes for the same body.
"""

from __future__ import annotations

import hashlib
import operator
import os
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import orjson

from .. import wirejson
from .formats.base import ByIdentity, Item, derived

HEAD = 512
"""Bytes of a body's start that select the cached bodies it is compared with."""
CACHE_BYTES = 64 * 1024 * 1024
"""Bytes of bodies kept, counted by their raw bytes: their parsed items and what is kept on them (serialised pieces
and runs, messages) take about four times as much again, so 64 MiB holds some 300 MiB in all at most."""
BODIES_PER_HEAD = 4
"""Bodies kept per :data:`HEAD` (threads of one agent that share a system prompt)."""
_SPARE_KEY = "\x00" + os.urandom(8).hex()
"""A key no client can guess: the stand-in for the history's key when the bytes after the history are parsed."""
_SPARE = wirejson.dumps(_SPARE_KEY)


def piece(item: Any) -> bytes:
    """``wirejson.dumps(item)`` for a history item, kept on an :class:`Item`. Raises TypeError as ``orjson.dumps``
    does for the whole body (written two levels down, as in a body, so an item nested too deep fails alike)."""
    kept = derived(item)
    out: bytes | None = kept.get("piece") if kept is not None else None
    if out is None:
        out = wirejson.dumps([[item]])[2:-2]
        if kept is not None:
            kept["piece"] = out
    return out


@dataclass
class _Body:
    """A body seen: its bytes, where its history's last item ends (``end``) and where the bytes after the history
    start (``tail``, at the history's closing bracket), its parsed head values (the keys before the history) and
    items; ``checked`` once those places were proved (:func:`_check`)."""

    raw: bytes
    end: int
    tail: int
    head: dict[str, Any]
    items: list[Any]
    field: str
    after: list[str]
    rest: dict[str, Any] | None = None
    """The values after the history (parsed once, by :func:`_check`; shared by the bodies that repeat them, like
    the head's)."""
    checked: bool = False


class BodyCache:
    """Recent request bodies, by the hash of their format and first :data:`HEAD` bytes, at most ``max_bytes``
    of them (least recently used dropped). Not thread-safe: one per event loop."""

    def __init__(self, max_bytes: int = CACHE_BYTES) -> None:
        self.max_bytes = max_bytes
        self._bodies: OrderedDict[bytes, list[_Body]] = OrderedDict()
        self._bytes = 0
        self.reused = 0
        """Requests parsed from their new bytes only (for the benchmarks)."""

    def loads(self, field: str, format_name: str, raw: bytes) -> Any:
        """``wirejson.loads(raw)``, with history items (the list under ``field``) as :class:`Item`, and the body kept
        for the requests that extend it. Raises ``orjson.JSONDecodeError`` as ``orjson.loads`` does."""
        key = hashlib.blake2b(format_name.encode() + b"\x00" + raw[:HEAD], digest_size=16).digest()
        known = self._bodies.get(key, [])
        for seen in list(known):
            if not seen.checked and not _check(seen):
                self._drop(known, seen)
                continue
            extended = _extend(seen, raw)
            if extended is not None:
                self._drop(known, seen)
                self._keep(key, known, extended[1])
                self.reused += 1
                return extended[0]
        body = wirejson.loads(raw)
        if isinstance(body, dict) and isinstance(body.get(field), list):
            items = body[field] = [Item(i) if type(i) is dict else i for i in body[field]]
            located = _locate(raw, body, field, list(items))  # its own list: the body's is edited
            if located is not None:
                self._keep(key, known, located)
        return body

    def _drop(self, known: list[_Body], seen: _Body) -> None:
        known.remove(seen)
        self._bytes -= len(seen.raw)

    def _keep(self, key: bytes, known: list[_Body], new: _Body) -> None:
        known.insert(0, new)
        self._bytes += len(new.raw)
        while len(known) > BODIES_PER_HEAD:
            self._bytes -= len(known.pop().raw)
        self._bodies[key] = known
        self._bodies.move_to_end(key)
        while self._bytes > self.max_bytes and self._bodies:
            _, dropped = self._bodies.popitem(last=False)
            self._bytes -= sum(len(b.raw) for b in dropped)


def _extend(seen: _Body, raw: bytes) -> tuple[dict[str, Any], _Body] | None:
    """``raw`` parsed, when it is ``seen`` with history items added at the end (else None), and what to keep of
    it. With the same bytes up to the end of the last item and from the history's closing bracket on, the bytes
    in between, read as the continuation of an array, are the new items, and the rest of the body is the seen
    body's, the same values (JSON's grammar: the parser is in the same state at both ends)."""
    tail_len = len(seen.raw) - seen.tail
    cut = len(raw) - tail_len
    if cut < seen.end or not raw.startswith(memoryview(seen.raw)[:seen.end]) \
            or not raw.endswith(memoryview(seen.raw)[seen.tail:]):
        return None
    middle = raw[seen.end:cut]
    try:
        added = wirejson.loads(b"[0" + middle + b"]" if seen.items else b"[" + middle + b"]")
    except orjson.JSONDecodeError:
        return None
    if seen.items:
        if not (isinstance(added, list) and added and type(added[0]) is int and added[0] == 0):
            return None
        added = added[1:]
    items = seen.items + [Item(i) if type(i) is dict else i for i in added]
    body = dict(seen.head)
    body[seen.field] = list(items)
    body.update(seen.rest or {})
    end = seen.end + len(middle.rstrip()) if added else seen.end
    return body, _Body(raw, end, cut, seen.head, items, seen.field, seen.after, seen.rest, True)


def _locate(raw: bytes, body: dict[str, Any], field: str, items: list[Any]) -> _Body | None:
    """Where, in ``raw`` (parsed as ``body``), the history ``field`` ends: found by its bytes, proved by
    :func:`_check` when a later body would be read from it (None when it cannot be found)."""
    keys = list(body)
    at = keys.index(field)
    after = keys[at + 1:]
    if after:
        mark = wirejson.dumps(after[0])
        found = len(raw)
        for _ in range(3):  # the key's name may also appear after it, inside the values that follow
            found = raw.rfind(mark, 0, found)
            if found < 0:
                return None
            before = raw[:found].rstrip()
            if before.endswith(b","):
                break
        else:
            return None
        closing = len(before[:-1].rstrip()) - 1
    else:
        closed = raw.rstrip()
        if not closed.endswith(b"}"):
            return None
        closing = len(closed[:-1].rstrip()) - 1
    if closing < 0 or raw[closing:closing + 1] != b"]":
        return None
    end = len(raw[:closing].rstrip())
    return _Body(raw, end, closing, {k: body[k] for k in keys[:at]}, items, field, after)


def _check(seen: _Body) -> bool:
    """Whether ``seen.raw`` holds its history's last item's end at ``seen.end`` and the history's closing bracket
    at ``seen.tail``: the bytes before the bracket, with a stand-in item and the closing brackets added, parse to
    the head keys and a history whose last item is the stand-in (so the array open there is the history, not a
    repeated key's value), and the bytes from the bracket on parse to the keys after the history."""
    raw = seen.raw
    if raw[seen.tail:seen.tail + 1] != b"]" or raw[seen.end:seen.tail].strip():
        return False
    try:
        before = wirejson.loads(raw[:seen.tail] + (b",0]}" if seen.items else b"0]}"))
        rest = wirejson.loads(b"{" + _SPARE + b":[" + raw[seen.tail:])
    except orjson.JSONDecodeError:
        return False
    history = before.get(seen.field) if isinstance(before, dict) else None
    seen.checked = (isinstance(history, list) and len(history) == len(seen.items) + 1
                    and type(history[-1]) is int and history[-1] == 0
                    and list(before) == [*seen.head, seen.field] and list(rest) == [_SPARE_KEY, *seen.after]
                    and rest[_SPARE_KEY] == [])
    rest.pop(_SPARE_KEY, None)
    seen.rest = rest
    return seen.checked


def dumps(body: Any, field: str) -> bytes:
    """``wirejson.dumps(body)``, byte for byte, with the items of the history ``field`` written from their kept pieces
    (:func:`piece`). Raises TypeError as ``orjson.dumps`` does for what it cannot write."""
    return b"".join(chunks(body, field))


def chunks(body: Any, field: str) -> tuple[bytes, ...]:
    """:func:`dumps` as pieces to send one after another: the history's items in runs of :data:`SEGMENT` joined
    once and kept on the run's first item (a later request that repeats the run sends the same bytes object), so
    writing a body costs about what is new in it. Raises TypeError as ``orjson.dumps`` does."""
    history = body.get(field) if type(body) is dict else None
    if type(history) is not list or any(type(key) is not str for key in body):
        return (wirejson.dumps(body),)
    out: list[bytes] = []
    part = [b"{"]
    for index, (key, value) in enumerate(body.items()):
        if index:
            part.append(b",")
        part.append(wirejson.dumps(key))
        if key != field:
            part += (b":", _VALUES.get(value, _value) if type(value) in (list, dict) else _value(value))
            continue
        part.append(b":[")
        out.append(b"".join(part))
        out += _runs(value)
        part = [b"]"]
    part.append(b"}")
    out.append(b"".join(part))
    return tuple(out)


def _value(value: Any) -> bytes:
    return wirejson.dumps([value])[1:-1]  # one level down, as in the body


_VALUES = ByIdentity()
"""The bytes of a body's values beside its history, by the value (the tool declarations, the same object in every
request of a session that repeats them): written once."""


SEGMENT = 64
"""History items per run of :func:`chunks`."""


def _runs(items: list[Any]) -> list[bytes]:
    """The history ``items`` serialised (comma-separated), in runs of :data:`SEGMENT` items: each run after the
    first starts with its comma. A run is kept on its first item when that is an :class:`Item`, with the items it
    was made of, and used again while they are the very same objects (items are never changed in place); a run
    that was the history's last, shorter one and has since grown writes only its new items."""
    out = []
    for start in range(0, len(items), SEGMENT):
        run = items[start:start + SEGMENT]
        kept = derived(run[0])
        joined = kept.get(("run", start > 0)) if kept is not None else None
        if joined is None or len(joined[0]) > len(run) or not all(map(operator.is_, joined[0], run)):
            joined = (run, (b"," if start else b"") + b",".join(map(piece, run)))
        elif len(joined[0]) < len(run):  # the history's last run, grown since: only its new items are written
            joined = (run, joined[1] + b"," + b",".join(map(piece, run[len(joined[0]):])))
        if kept is not None:
            kept[("run", start > 0)] = joined
        out.append(joined[1])
    return out
