"""One project's memory: grounded records, their credit, bounds and retention. Pure: time is passed in, and the
memory is read from and written to bytes (:meth:`Memory.encode`, :meth:`Memory.decode`) by the shell.

Three kinds of :class:`Record` (seed 003, "Cross-session memory"):

- ``rule``: the user's own durable instruction, ``text`` an exact quote, ``source`` its turn
  (``user turn 2 of session 1a2b...``);
- ``orientation``: a fact the session established, ``source`` the action whose result showed it
  (``action #3: pytest -q (succeeded)``);
- ``experience``: a finished task, ``text`` what was asked, ``label`` the gate's label (``verified``, ``failed``,
  ``unknown``), never upgraded: the same task with another label is another record.

A record's ``id`` is ``M`` and 8 hex digits of a hash of its kind, text and label, so the same record distilled
twice (or by two processes) is one record, and the self-report names it (its ``memories`` field) as the note shows
it. **Credit** starts at :data:`INITIAL_CREDIT`; a record the self-report names as used gains
:data:`CREDIT_VERIFIED` on a ``verified`` turn and loses :data:`CREDIT_FAILED` on a ``failed`` one (reference
section 3, outcome table); below :data:`ARCHIVE_BELOW` it is **archived**: kept, listed, never recalled.
**Secrets**: a candidate whose text or source holds a secret-looking value or a credential the request carried
(``proxyvisor.redact.holds_secret``) is never made a record: it is dropped whole.
**Bounds** (:meth:`Memory.bound`): records past retention go; then, past ``max_records`` or ``max_bytes``,
archived records first, then the lowest credit, then the oldest.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass

import msgspec

from ..redact import holds_secret, past_cut

RULE, ORIENTATION, EXPERIENCE = "rule", "orientation", "experience"
KINDS = (RULE, ORIENTATION, EXPERIENCE)
VERIFIED, FAILED, UNKNOWN = "verified", "failed", "unknown"
LABELS = (VERIFIED, FAILED, UNKNOWN)
INITIAL_CREDIT = 0.5
CREDIT_VERIFIED = 0.05
CREDIT_FAILED = -0.15
ARCHIVE_BELOW = 0.25
"""Two failed uses from the start archive a record; a verified use in between keeps it."""
MAX_TEXT = 300
"""Characters of a record's text or source; longer candidates are clipped (a rule's quote is at most 200)."""
READ_CHARS = 8_000
"""Characters of a user's text (a turn, a task, a candidate record) learning reads at all. A human instruction is
not megabytes: past them is a pasted log or file, and reading it whole on every distill and recall would cost
seconds of CPU for nothing learnt. What a record keeps comes from them, so a secret past them cannot reach one."""


def _flat(text: str) -> str:
    return " ".join(text[:READ_CHARS].split())


def clip(text: str) -> str:
    """``text`` (its first :data:`READ_CHARS` characters) on one line, at most :data:`MAX_TEXT` characters."""
    text = _flat(text)
    return text if len(text) <= MAX_TEXT else text[:MAX_TEXT - 1] + "\u2026"


class Record(msgspec.Struct, frozen=True, kw_only=True):
    """One memory record (module docstring). ``created`` / ``seen``: Unix times when it was first stored and
    last stored again or recalled; ``session``: the session that first stored it; ``used``: times the self-report
    named it as used; ``recalled``: sessions it was recalled to."""

    id: str
    kind: str
    text: str
    source: str
    label: str = ""
    credit: float = INITIAL_CREDIT
    archived: bool = False
    created: float = 0.0
    seen: float = 0.0
    session: str = ""
    used: int = 0
    recalled: int = 0


@dataclass(frozen=True)
class Candidate:
    """A record to store: ``kind``, ``text``, ``source`` and, for an experience, its ``label``."""

    kind: str
    text: str
    source: str
    label: str = ""


def _key(text: str) -> str:
    return " ".join(text.lower().split())


def record_id(kind: str, text: str, label: str = "") -> str:
    digest = hashlib.blake2b(f"{kind}\0{_key(text)}\0{label}".encode(), digest_size=4)
    return "M" + digest.hexdigest()


class _File(msgspec.Struct, kw_only=True):
    scope: str
    records: list[Record] = []


class Memory:
    """The records of one ``scope`` (a project folder), by id, in the order they were stored."""

    def __init__(self, scope: str, records: Iterable[Record] = ()) -> None:
        self.scope = scope
        self.records: dict[str, Record] = {r.id: r for r in records}

    @classmethod
    def decode(cls, data: bytes) -> Memory:
        """The memory written by :meth:`encode`.

        Raises:
            msgspec.DecodeError / msgspec.ValidationError: ``data`` is not such a memory (both are ValueErrors).
        """
        file = msgspec.json.decode(data, type=_File)
        return cls(file.scope, (r for r in file.records if r.kind in KINDS))

    def encode(self) -> bytes:
        return msgspec.json.encode(_File(scope=self.scope, records=list(self.records.values())))

    def add(self, candidate: Candidate, now: float, session: str, secrets: Iterable[str] = ()) -> Record | None:
        """Store ``candidate`` (clipped, :func:`clip`) unless it is empty, of an unknown kind or label, or holds a
        secret or one of the request's credentials ``secrets`` (module docstring); the same record again is only
        marked ``seen``. Returns the new record, None when nothing new was stored."""
        text, source = clip(candidate.text), clip(candidate.source)
        label = candidate.label if candidate.kind == EXPERIENCE else ""
        if not text or candidate.kind not in KINDS or (candidate.kind == EXPERIENCE and label not in LABELS):
            return None
        secrets = list(secrets)
        if any(holds_secret(past_cut(_flat(t), MAX_TEXT), secrets) for t in (candidate.text, candidate.source)):
            return None
        key = record_id(candidate.kind, text, label)
        old = self.records.get(key)
        if old is not None:
            self.records[key] = msgspec.structs.replace(old, seen=now)
            return None
        record = Record(id=key, kind=candidate.kind, text=text, source=source, label=label, created=now, seen=now,
                        session=session)
        self.records[key] = record
        return record

    def active(self) -> list[Record]:
        """The records that may be recalled: not archived."""
        return [r for r in self.records.values() if not r.archived]

    def credit(self, ids: Iterable[str], label: str) -> list[tuple[str, float, bool]]:
        """Apply a turn's outcome ``label`` to the records ``ids`` the self-report named as used (module docstring;
        ``unknown`` moves nothing). Returns, per record moved, (id, change, whether it is now archived)."""
        delta = CREDIT_VERIFIED if label == VERIFIED else CREDIT_FAILED if label == FAILED else 0.0
        moved = []
        for rid in dict.fromkeys(ids):
            record = self.records.get(rid)
            if record is None:
                continue
            credit = round(min(1.0, max(0.0, record.credit + delta)), 4)
            archived = record.archived or credit < ARCHIVE_BELOW
            self.records[rid] = msgspec.structs.replace(record, credit=credit, archived=archived,
                                                        used=record.used + 1)
            if delta:
                moved.append((rid, delta, archived))
        return moved

    def seen(self, ids: Iterable[str], now: float) -> None:
        """Mark the records ``ids`` recalled (to one session) at ``now`` (retention counts from it)."""
        for rid in ids:
            if (record := self.records.get(rid)) is not None:
                self.records[rid] = msgspec.structs.replace(record, seen=now, recalled=record.recalled + 1)

    def merge(self, stored: Memory, loaded: Iterable[str]) -> list[str]:
        """Take in what the stored copy of this memory holds now (``stored``: written meanwhile by another process
        or replica): its records that are not among ``loaded`` (the ids the store held when this memory last read
        or wrote it: one of those this memory lacks was dropped here, by the bounds, and stays dropped), and the
        loss of those of ``loaded`` that are gone from it (forgotten there, by :meth:`forget`: with a rule, the records
        here that quote it go too, also those the store never held). Other records of this memory the store never
        held stay. Returns the ids removed here.

        This is the one merge rule: a save applies it to the stored value before writing over it, and a process
        applies it to the memory it holds after reading or writing the store."""
        loaded = set(loaded)
        gone = [removed for rid in loaded if rid not in stored.records for removed in self.forget(rid)]
        for rid, record in stored.records.items():
            if rid not in loaded:
                self.records.setdefault(rid, record)
        return gone

    def forget(self, rid: str) -> list[str]:
        """Remove record ``rid`` and, when it is a rule, every orientation or experience record whose text quotes
        it (compared as :func:`record_id` does: case and whitespace aside), so that the forgotten words reach no
        model through another record (an experience quotes the task, which may have stated the rule). Another
        rule that quotes it stays: it is the user's own instruction, listed and forgotten on its own. Returns the
        ids removed (none: ``rid`` was not there)."""
        record = self.records.pop(rid, None)
        if record is None:
            return []
        gone = [rid]
        if record.kind == RULE:
            words = _key(record.text)
            gone += [r.id for r in self.records.values() if r.kind != RULE and words in _key(r.text)]
            for other in gone[1:]:
                del self.records[other]
        return gone

    def bound(self, max_records: int, max_bytes: int, retention_s: float, now: float) -> int:
        """Apply retention and the bounds (module docstring); returns the records removed."""
        before = len(self.records)
        self.records = {k: r for k, r in self.records.items() if now - max(r.seen, r.created) <= retention_s}
        order = sorted(self.records.values(), key=lambda r: (not r.archived, r.credit, r.seen))
        size = len(self.encode())
        while order and (len(self.records) > max_records or size > max_bytes):
            gone = order.pop(0)
            del self.records[gone.id]
            size -= len(msgspec.json.encode(gone)) + 1
        return before - len(self.records)
