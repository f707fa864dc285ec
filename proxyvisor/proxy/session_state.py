"""Sessions' supervision state in the state backend, so that a restarted proxy, or another replica, goes on with a
session exactly where it was: the same detector state, the same notes at the same places (the upstream prefix stays
byte-stable for provider prompt caches), the same gate turn, the same plan.

What is kept: a session's :class:`~proxyvisor.proxy.supervise.SessionSupervision` (its threads: detector state,
steer policy, notes and recitations, re-inserted delegations and grafts, the gate turn, the plan and its
bookkeeping; and its counters), not its request records, which are each process's own. Keys per session in the
``sessions`` namespace (``proxyvisor.adapters.state``), each with a time to live of ``[state] session_ttl_s``
after it was last written:

- ``<session>``: 16 random bytes (the version), the state's format (below), then the state, pickled, each of its
  threads pickled on its own inside it. A request changes one thread (a sub-agent's history is a thread of its
  own): a save pickles again only the threads changed since this process last pickled them (their
  ``Thread.changes`` counts moved, or a request holds them: ``Thread.holders``) and reuses the others' pickles, so it
  costs what changed, not the whole state. A load
  of a newer state another process stored unpickles only the threads whose pickle is not the one this process
  holds for them, and keeps the pickles it read (:func:`decode`, :func:`restore`);
- ``<session>:v``: the version alone;
- ``<session>:r:<digest>``: a chunk of :data:`CHUNK` receipts of a thread's current turn
  (``RoundReader.turn_receipts``, which the verify-gate, the planner and learning read instead of computing them
  again: about 0.5 ms each), named by a digest of its content. A turn's receipts grow with the turn (hundreds in a
  long agent turn, most of a state's size): each full chunk is written once, with the save that filled it, and the
  state holds the digests of its chunks and the receipts past the last full one. What a save needs of the chunks
  (their digests, classes, which are not stored yet) is kept as they are cut: a save reads the receipts added
  since the last, not the turn's. A save removes the chunks the state this process last saved or loaded referred
  to and the new one does not (a turn that ended, a history rewritten); those another process wrote and no state
  of this process referred to expire. A chunk that expired
  before the state referring to it (a turn longer than the time to live) or cannot be read leaves its receipts out
  of the restored turn: they are computed again when read, from the same history.

:meth:`SessionStates.load`, before a request is supervised, reads the version (a few bytes) and reads the state (and
its chunks) only when another process wrote a newer one since this process last saw it; :meth:`SessionStates.save`
writes the state, its version and the chunks this process has not stored yet in one step (a Redis transaction in
a worker thread, a SQLite transaction on the event loop) once the request's answer is through (notes, plan,
self-report, gate turn). On Redis that is before the client has all of the answer, so its next request, on any
replica, finds the state. On the local store it is right after the client has it (the response's ``after`` step,
``proxyvisor.proxy.pipeline``; off the client's latency): this process holds the state in memory and reads the store
only for a session it does not hold, after storing every state still waiting. So a process killed in that instant (a
fraction of a millisecond) restarts the session from its state before the last answer, and a second process on the
same state directory serving the session's very next request in that instant goes on from that state too. Two
replicas serving one session's requests at the same moment: the later save wins (the chunks are named by their
content: either's are the same or both kept).

Pickle, because the state is a graph of the cores' own objects (trackers, policies, state machines), but read
back only through :class:`_Unpickler`, which builds nothing but proxyvisor's own classes and a few containers: a
state someone else wrote into the store cannot name any other callable. The state's format is the list of
proxyvisor classes it holds and a digest of their source: a state written by a proxyvisor whose classes differ (a
replica not yet upgraded, a restart onto new code) is not used, and the session starts its supervision afresh
(one prompt-cache miss) rather than meeting objects its code does not know. The store must still be trusted with the
sessions' content (it holds notes and tool results): a Redis with a password, on a private network.

Failures of the backend (Redis down) never cost a request: the session goes on with the state this process holds
(or a fresh one), one warning per outage.
"""

from __future__ import annotations

import copyreg
import dataclasses
import functools
import hashlib
import inspect
import io
import itertools
import logging
import operator
import os
import pickle
import sys
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import orjson

import trio

from ..adapters.state import KV, Outage, StateUnavailable
from ..detectors.detectors import HistoryTracker
from ..detectors.receipts import Receipt, RoundReader
from .sessions import Session
from .supervise import SessionSupervision, Thread

log = logging.getLogger("proxyvisor.sessions")

NAMESPACE = "sessions"
SETTINGS = {"disk_min_file_size": 1 << 28}
"""The diskcache settings of the namespace: each state a row of its SQLite database, whatever its size. By default
diskcache writes a value over 32 KB (the state of a turn of a few hundred tool calls) to a file of its own,
making a file and removing the last one on every save: about ten times the CPU of the row. (Redis ignores it.)"""
_VERSION = 16
_CONTAINERS = {("collections", "OrderedDict"), ("collections", "deque"), ("collections", "Counter"),
               ("builtins", "set"), ("builtins", "frozenset"), ("builtins", "bytearray")}
CHUNK = 16
"""Receipts per stored chunk (module docstring): a state carries fewer inline, a turn's chunks are written once."""
_WRITERS = 4
"""Worker threads writing or reading session states at once (one per session would open a diskcache connection
per thread under a burst)."""


class _Unpickler(pickle.Unpickler):
    """Builds only proxyvisor's own classes and the containers of :data:`_CONTAINERS`, noting the proxyvisor
    classes it built (:attr:`classes`, named as :class:`_Reductions` names them)."""

    def __init__(self, data: bytes) -> None:
        super().__init__(io.BytesIO(data))
        self.classes: set[str] = set()

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _CONTAINERS or module.startswith("proxyvisor."):
            found = super().find_class(module, name)
            if isinstance(found, type):
                if module.startswith("proxyvisor."):
                    self.classes.add(_name(found))
                return found
        raise pickle.UnpicklingError(f"a session state may not hold {module}.{name}")


class _Reductions(dict[type, Callable[[Any], Any]]):
    """A pickler's dispatch table: each class's reduction, looked up on the class's first object (builtin
    containers and atoms never come here), noting the proxyvisor classes met (:attr:`classes`). It starts with the
    reductions of the other classes this process met (:data:`_PLAIN`: ``deque``, ``Counter``...), which have
    nothing to note: a state is pickled in pieces (:meth:`_supervision`), each with a table of its own.

    A dataclass with slots is reduced to its fields' values read by one ``attrgetter``, which its own
    ``__setstate__`` takes on loading as ever; ``dataclasses``' ``__getstate__`` reads them field by field in
    Python, which cost most of a large state's pickling (hundreds of receipts in a long turn). A round reader's
    turn receipts are replaced by their chunks (module docstring; :meth:`_reader`). Any other class is reduced as
    the default pickler would (``copyreg``'s table, then ``__reduce_ex__``)."""

    def __init__(self) -> None:
        super().__init__(_PLAIN)
        self.classes: set[str] = set()
        self.chunks: list[_Run] = []
        """The receipt chunks the pickled object refers to, each reader's."""
        self[RoundReader] = self._reader
        self[SessionSupervision] = self._supervision

    def _reader(self, reader: RoundReader) -> tuple[Any, ...]:
        """A thread's round reader as the default pickler reduces it, its turn's receipts replaced by
        :class:`_StoredReceipts`."""
        self.classes.add(_name(RoundReader))
        run, rest = _chunked(reader)
        self.classes.update(run.classes)
        self.chunks.append(run)
        stored = _StoredReceipts(run.digests, rest)
        state = {**vars(reader), "turn_receipts": stored}
        return copyreg.__newobj__, (RoundReader,), state  # type: ignore[attr-defined]

    def _supervision(self, state: SessionSupervision) -> tuple[Any, ...]:
        """A session's state as its ``__getstate__`` has it, its threads replaced by :class:`_StoredThreads`: each
        pickled on its own (:func:`_thread_pickled`), so that a save pickles again only the threads that changed."""
        self.classes.add(_name(SessionSupervision))
        threads = [_thread_pickled(thread) for thread in state.threads.values()]
        for thread in threads:
            self.classes.update(thread.classes)
            self.chunks += thread.chunks
        stored = _StoredThreads(tuple(state.threads), tuple(t.value for t in threads))
        fields = {**state.__getstate__(), "threads": stored}
        return copyreg.__newobj__, (SessionSupervision,), fields  # type: ignore[attr-defined]

    def __missing__(self, kind: type) -> Callable[[Any], Any]:
        found = _FOUND.get(kind)
        if found is None:
            if issubclass(kind, type):
                raise KeyError(kind)  # a class (of a metaclass: an enum's): the pickler names it, as without a table
            reduction = copyreg.dispatch_table.get(kind) or _fields_reduction(kind) \
                or operator.methodcaller("__reduce_ex__", pickle.HIGHEST_PROTOCOL)
            found = _FOUND[kind] = reduction, _name(kind) if kind.__module__.startswith("proxyvisor.") else None
            if found[1] is None:
                _PLAIN[kind] = reduction
        reduction, name = found
        if name is not None:
            self.classes.add(name)
        self[kind] = reduction
        return reduction


_FOUND: dict[type, tuple[Callable[[Any], Any], str | None]] = {}
"""The reduction of each class :class:`_Reductions` met, found once per process, and its name when it is
proxyvisor's (:func:`_name`)."""
_PLAIN: dict[type, Callable[[Any], Any]] = {}
"""The reductions of :data:`_FOUND` of classes not proxyvisor's."""


def _name(kind: type) -> str:
    """How a stored state's format names proxyvisor class ``kind`` (:func:`_source_digest`)."""
    return f"{kind.__module__}:{kind.__qualname__}"


def _fields_reduction(kind: type) -> Callable[[Any], Any] | None:
    """The reduction of a dataclass with slots whose state is ``dataclasses``' own (its fields' values in order);
    None for any other class."""
    getstate, setstate = (getattr(kind, name, None) for name in ("__getstate__", "__setstate__"))
    if not dataclasses.is_dataclass(kind) or "__slots__" not in vars(kind) \
            or getattr(getstate, "__module__", None) != "dataclasses" \
            or getattr(setstate, "__module__", None) != "dataclasses":
        return None
    names = [f.name for f in dataclasses.fields(kind)]
    if not names:
        return None
    read = operator.attrgetter(*names)
    if len(names) == 1:
        return lambda obj: (copyreg.__newobj__, (kind,), (read(obj),))  # type: ignore[attr-defined]
    return lambda obj: (copyreg.__newobj__, (kind,), read(obj))  # type: ignore[attr-defined]


@dataclasses.dataclass(frozen=True, slots=True)
class _StoredReceipts:
    """A turn's receipts in a stored state (module docstring): the digests of its full chunks, in order, end to end
    (:data:`DIGEST` bytes each), then the receipts past them, by call id."""

    chunks: bytes
    rest: tuple[tuple[str, Receipt], ...]


@dataclasses.dataclass(frozen=True, slots=True)
class _StoredThreads:
    """A session's threads in a stored state: their keys and each one's pickle, in order."""

    keys: tuple[bytes, ...]
    values: tuple[bytes, ...]


@dataclasses.dataclass(frozen=True, slots=True)
class _Pickled:
    """A thread as a save pickled it (or a load read it), when its ``Thread.changes`` was ``changes``: the
    pickle, the proxyvisor classes it holds and the receipt chunks it refers to."""

    value: bytes
    classes: frozenset[str]
    chunks: tuple[_Run, ...]
    changes: int


_PICKLED: weakref.WeakKeyDictionary[HistoryTracker, _Pickled] = weakref.WeakKeyDictionary()
"""Each thread's pickle as this process's last save made it (or a load read it), by the thread's tracker (one per
thread, never replaced; a thread, a dataclass, has no hash)."""


def _kept(thread: Thread) -> _Pickled | None:
    """The pickle of ``thread`` this process keeps, while it is the thread as it is: not changed since
    (``Thread.changes``), nor held by a request (``Thread.holders``); else None."""
    found = _PICKLED.get(thread.tracker)
    return found if found is not None and found.changes == thread.changes and not thread.holders else None


def _thread_pickled(thread: Thread) -> _Pickled:
    """``thread`` pickled (:func:`_pickled`), or the pickle :func:`_kept` for it."""
    found = _kept(thread)
    if found is None:
        reductions = _Reductions()
        value, classes = _pickled(thread, reductions)
        found = _PICKLED[thread.tracker] = _Pickled(value, frozenset(classes), tuple(reductions.chunks),
                                                    thread.changes)
    return found


@dataclasses.dataclass(slots=True)
class _Chunk:
    """:data:`CHUNK` receipts of a turn (``receipts`` of the calls ``ids``), the digest naming their key, their
    pickle (None once stored, or read from the store) and the proxyvisor classes it holds."""

    ids: tuple[str, ...]
    receipts: tuple[Receipt, ...]
    digest: bytes
    value: bytes | None
    classes: frozenset[str]


DIGEST = 16
"""Bytes of a chunk's digest."""


@dataclasses.dataclass(frozen=True, slots=True)
class _Run:
    """A reader's full chunks as a pickle of its thread refers to them: their digests end to end, the proxyvisor
    classes they hold, and those of them not stored when it was made (each one's ``value`` None once stored)."""

    digests: bytes
    classes: frozenset[str]
    unstored: tuple[_Chunk, ...]


@dataclasses.dataclass(slots=True)
class _Chunks:
    """The full chunks of a reader's current turn (``receipts``, the dict they were cut from), in order, with what
    a save reads of them kept up to date as they are cut (:meth:`add`): their digests end to end, the proxyvisor
    classes they hold and those not stored yet. A save reads the chunks it cuts, not the turn's."""

    receipts: dict[str, Receipt]
    chunks: list[_Chunk] = dataclasses.field(default_factory=list)
    digests: bytes = b""
    classes: frozenset[str] = frozenset()
    unstored: list[_Chunk] = dataclasses.field(default_factory=list)

    def add(self, chunk: _Chunk) -> None:
        """Append ``chunk``, the next of the turn."""
        self.chunks.append(chunk)
        self.digests += chunk.digest
        if not chunk.classes <= self.classes:
            self.classes |= chunk.classes
        if chunk.value is not None:
            self.unstored.append(chunk)

    def run(self) -> _Run:
        """The chunks as a pickle refers to them (those stored since :meth:`add` dropped from :attr:`unstored`)."""
        self.unstored = [c for c in self.unstored if c.value is not None]
        return _Run(self.digests, self.classes, tuple(self.unstored))


_CHUNKS: weakref.WeakKeyDictionary[RoundReader, _Chunks] = weakref.WeakKeyDictionary()
"""Each round reader's chunks this process cut, pickled, stored or read, so a save pickles only its new receipts."""
_RECEIPT_CLASSES = frozenset({_name(Receipt)})
"""The proxyvisor classes of a chunk read from the store: its receipts."""


def _chunk_key(session_id: str, digest: bytes) -> str:
    return f"{session_id}:r:{digest.hex()}"


def _chunked(reader: RoundReader) -> tuple[_Run, tuple[tuple[str, Receipt], ...]]:
    """The full chunks of ``reader``'s turn receipts and the receipts past them. The chunks already cut from the
    same dict are kept: it only gains calls, at its end (``RoundReader.turn_receipts``), so only the receipts past
    them are read (from the end: a turn's hundreds of receipts are not touched again, nor are its chunks: what a
    save needs of them is kept as they are cut, :class:`_Chunks`). A new dict is cut afresh; its chunks the same as
    stored ones of the dict it replaced (a call id used again past them) are not written again."""
    receipts = reader.turn_receipts
    known = _CHUNKS.get(reader)
    stored: set[bytes] = set()
    if known is None or known.receipts is not receipts or len(receipts) < len(known.chunks) * CHUNK:
        stored = {c.digest for c in known.chunks if c.value is None} if known is not None else stored
        known = _CHUNKS[reader] = _Chunks(receipts)
    rest = tuple(itertools.islice(reversed(receipts.items()), len(receipts) - len(known.chunks) * CHUNK))[::-1]
    full = len(rest) // CHUNK
    for n in range(full):
        ids, values = zip(*rest[n * CHUNK:(n + 1) * CHUNK])
        value, classes = _pickled((ids, values))
        digest = hashlib.blake2b(value, digest_size=16).digest()
        known.add(_Chunk(ids, values, digest, None if digest in stored else value, frozenset(classes)))
    return known.run(), rest[full * CHUNK:]


def _pickled(obj: Any, reductions: _Reductions | None = None) -> tuple[bytes, set[str]]:
    """``obj`` pickled with ``reductions`` (by default a table of its own), and the proxyvisor classes it
    holds."""
    reductions = reductions if reductions is not None else _Reductions()
    out = io.BytesIO()
    pickler = pickle.Pickler(out, protocol=pickle.HIGHEST_PROTOCOL)
    pickler.dispatch_table = reductions
    pickler.dump(obj)
    return out.getvalue(), reductions.classes


@functools.cache
def _source_digest(names: tuple[str, ...]) -> bytes:
    """A digest of the source of the classes ``names`` (``module:qualname``) as this proxyvisor has them: of the
    files of the modules that define them (:func:`_module_digest`, read once per process), so any change to such a
    module makes an older state unused.

    Raises:
        ValueError: a class is not in this proxyvisor.
    """
    digest = hashlib.blake2b(digest_size=16)
    for name in names:
        module, _, qualname = name.partition(":")
        found: Any = _Unpickler(b"").find_class(module, qualname.split(".")[0])
        for part in qualname.split(".")[1:]:
            found = getattr(found, part)
        digest.update(name.encode() + b"\0" + _module_digest(found.__module__))
    return digest.digest()


@functools.cache
def _module_digest(module: str) -> bytes:
    """The digest of module ``module``'s source file. (``inspect.getsource`` of each class took some 250 ms on a
    process's first save, in its first request.)

    Raises:
        ValueError: the module has no source file.
    """
    try:
        path = inspect.getsourcefile(sys.modules[module])
        if path is None:
            raise OSError("no source file")
        return hashlib.blake2b(Path(path).read_bytes(), digest_size=16).digest()
    except (KeyError, OSError, TypeError) as exc:
        raise ValueError(f"no source for {module}: {exc}") from None


@dataclasses.dataclass(frozen=True, slots=True)
class Encoded:
    """A state as :func:`encode` writes it: the ``value`` of the session's key, the receipt chunks it refers to
    that this process has not stored yet (``unstored``, each to go under ``<session>:r:<digest>``, its ``value``;
    :func:`mark_stored` once written) and the digests of all it refers to (``chunks``: each thread's end to end,
    as :func:`_dropped` reads them)."""

    value: bytes
    unstored: list[_Chunk]
    chunks: frozenset[bytes]


def encode(state: SessionSupervision, version: bytes) -> Encoded:
    """``version``, the state's format and ``state`` as a session's key and its receipt chunks. The format names
    the classes of the chunks too.

    Raises:
        pickle.PicklingError, TypeError, AttributeError: ``state`` holds an object pickle cannot write.
        ValueError: a class it holds has no source here to name the format by (:func:`_source_digest`).
    """
    reductions = _Reductions()
    pickled, classes = _pickled(state, reductions)
    names = tuple(sorted(classes))
    header = orjson.dumps({"classes": names, "digest": _source_digest(names).hex()})
    return Encoded(version + len(header).to_bytes(4, "big") + header + pickled,
                   [c for run in reductions.chunks for c in run.unstored if c.value is not None],
                   frozenset(run.digests for run in reductions.chunks))


def mark_stored(chunks: list[_Chunk]) -> None:
    """Note that ``chunks`` (from :func:`encode`) are in the store: later saves do not write them again."""
    for chunk in chunks:
        chunk.value = None


@dataclasses.dataclass(frozen=True, slots=True)
class Decoded:
    """A session key's value as :func:`decode` reads it: the ``state``, its ``version``, for each thread it
    unpickled the pickle and the proxyvisor classes it holds (``unpickled``, by the thread's tracker:
    :func:`restore` keeps them for the next save), and the pickles of the threads taken as held (``kept``)."""

    state: SessionSupervision
    version: bytes
    unpickled: dict[HistoryTracker, tuple[bytes, frozenset[str]]]
    kept: list[_Pickled]


def decode(value: bytes, held: SessionSupervision | None = None) -> Decoded:
    """The state of a session key's ``value``. A thread whose pickle is the one this process keeps for the thread
    of the same key in ``held`` (the session's state it replaces; :func:`_kept` for it) is that thread, not
    unpickled again: a session going back and forth between replicas unpickles the threads the other one changed.
    The turn receipts of the threads unpickled are still :class:`_StoredReceipts` (:func:`restore` reads them).

    Raises:
        ValueError: ``value`` is not a session state, or one whose classes differ from this proxyvisor's.
    """
    unpickled: dict[HistoryTracker, tuple[bytes, frozenset[str]]] = {}
    held_pickles: list[_Pickled] = []
    threads: OrderedDict[bytes, Thread] = OrderedDict()
    try:
        size = int.from_bytes(value[_VERSION:_VERSION + 4], "big")
        header = orjson.loads(value[_VERSION + 4:_VERSION + 4 + size])
        names = tuple(header["classes"])
        if _source_digest(names).hex() != header["digest"]:
            raise ValueError("written by a proxyvisor whose classes differ")
        state = _Unpickler(value[_VERSION + 4 + size:]).load()
        stored = state.threads if isinstance(state, SessionSupervision) else None
        if not isinstance(stored, _StoredThreads) or len(stored.keys) != len(stored.values):
            raise ValueError("not a session state")
        for key, pickled in zip(stored.keys, stored.values):
            thread = held.threads.get(key) if held is not None else None
            kept = _kept(thread) if thread is not None else None
            if kept is None or kept.value != pickled:
                unpickler = _Unpickler(pickled)
                thread = unpickler.load()
                if not isinstance(thread, Thread) or not isinstance(key, bytes):
                    raise ValueError("a thread that is not one")
                unpickled[thread.tracker] = pickled, frozenset(unpickler.classes)
            else:
                held_pickles.append(kept)
            threads[key] = thread
        _share_receipts(state, threads.values(), held)
    except Exception as exc:  # noqa: BLE001 - pickle raises anything a bad stream makes it build
        raise ValueError(f"not a session state of this proxyvisor ({type(exc).__name__}: {exc})") from None
    state.threads = threads
    return Decoded(state, value[:_VERSION], unpickled, held_pickles)


def _share_receipts(state: SessionSupervision, threads: Iterable[Thread], held: SessionSupervision | None) -> None:
    """Give ``threads`` (``state``'s) one receipt cache, ``state``'s, as they had in memory: each was pickled on
    its own, with a copy of it (empty: ``ReceiptCache`` pickles its mutating tools alone). That cache is ``held``'s
    (the session's state this process replaces) when it has one of the same mutating tools: the receipts this
    process computed stay of use."""
    cache = state.receipts
    if held is not None and held.receipts is not None \
            and (cache is None or cache.mutating_tools == held.receipts.mutating_tools):
        cache = state.receipts = held.receipts
    if cache is None:
        return
    for thread in threads:
        tracker = thread.tracker
        if tracker.mutating_tools == cache.mutating_tools:
            tracker.cache = tracker.reader.cache = cache


def restore(decoded: Decoded, session_id: str, read: Callable[[list[str]], list[bytes | None]],
            held: SessionSupervision | None = None) -> frozenset[bytes]:
    """Put back the turn receipts of the threads :func:`decode` unpickled (session ``session_id``'s): their
    chunks' values read by ``read`` (the values of keys, in order, None: absent), decoded as the state was, but
    for the chunks this process already has in ``held`` (the session's state it replaces: chunks are named by their
    content, so a session going back and forth between replicas reads only the chunks the other one added); the
    digests of the chunks the state refers to (each thread's end to end, as :attr:`Encoded.chunks`). A chunk absent or unreadable leaves its receipts out (module
    docstring). A thread whose chunks are all back keeps the pickle it was read from: the next save pickles it
    again only if it changed.

    Raises:
        ValueError: the state is not as :func:`encode` writes one (its threads, their receipts).
    """
    try:
        threads = list(decoded.state.threads.values())
        found: list[Any] = [t.tracker.reader.turn_receipts for t in threads]
    except AttributeError:
        raise ValueError("not a session state: a thread without a round reader") from None
    runs = [h.chunks for h in found if isinstance(h, _StoredReceipts)]
    if not all(isinstance(run, bytes) and len(run) % DIGEST == 0 for run in runs):
        raise ValueError("not a session state: a turn's chunks not named by their digests")
    digests = [d for run in runs for d in _digests(run)]
    known = _known(held) if digests and held is not None else {}
    missing = [d for d in digests if d not in known]
    values = dict(zip(missing, read([_chunk_key(session_id, d) for d in missing]))) if missing else {}
    runs += [run.digests for kept in decoded.kept for run in kept.chunks]
    for thread, stored in zip(threads, found):
        tracker = thread.tracker
        if tracker not in decoded.unpickled:  # a thread held (decode): its receipts are there
            continue
        if not isinstance(stored, _StoredReceipts):
            raise ValueError("not a session state: a turn's receipts not as stored")
        chunks = [known.get(d) or _chunk(d, values.get(d)) for d in _digests(stored.chunks)]
        receipts: dict[str, Receipt] = {}
        for chunk in chunks:
            if chunk is not None:
                receipts.update(zip(chunk.ids, chunk.receipts))
        try:
            receipts.update(stored.rest)
        except (TypeError, ValueError):
            raise ValueError("not a session state: its receipts are not by call id") from None
        tracker.reader.turn_receipts = receipts
        if None not in chunks:  # whole: a later save writes only its new chunks, and pickles it only if changed
            whole = _CHUNKS[tracker.reader] = _Chunks(receipts)
            for chunk in chunks:
                if chunk is not None:
                    whole.add(chunk)
            value, classes = decoded.unpickled[tracker]
            _PICKLED[tracker] = _Pickled(value, classes | whole.classes, (whole.run(),), thread.changes)
    return frozenset(runs)


def _digests(run: bytes) -> list[bytes]:
    """The chunk digests of ``run`` (end to end)."""
    return [run[at:at + DIGEST] for at in range(0, len(run), DIGEST)]


def _dropped(before: frozenset[bytes], now: frozenset[bytes]) -> list[bytes]:
    """The digests of chunks ``before`` refers to and ``now`` does not (both as :attr:`Encoded.chunks`). A
    thread's chunks only gain at the end while its turn goes on: a run of ``before`` that one of ``now`` starts
    with drops nothing, found without reading its digests one by one."""
    gone = [run for run in before - now if not any(later.startswith(run) for later in now)]
    if not gone:
        return []
    kept = {d for run in now for d in _digests(run)}
    return [d for run in gone for d in _digests(run) if d not in kept]


def _known(state: SessionSupervision) -> dict[bytes, _Chunk]:
    """The chunks this process cut or read for the threads of ``state``, by digest."""
    known: dict[bytes, _Chunk] = {}
    for thread in list(state.threads.values()):
        chunks = _CHUNKS.get(thread.tracker.reader)
        if chunks is not None:
            known.update((c.digest, c) for c in list(chunks.chunks))
    return known


def _chunk(digest: bytes, value: bytes | None) -> _Chunk | None:
    """The stored chunk named ``digest``, read as ``value``; None when absent or not a chunk of receipts."""
    if value is None or hashlib.blake2b(value, digest_size=16).digest() != digest:
        return None
    try:
        ids, receipts = _Unpickler(value).load()
    except Exception:  # noqa: BLE001 - pickle raises anything a bad stream makes it build
        return None
    if not (isinstance(ids, tuple) and isinstance(receipts, tuple) and len(ids) == len(receipts) == CHUNK
            and all(isinstance(i, str) for i in ids) and all(isinstance(r, Receipt) for r in receipts)):
        return None
    return _Chunk(ids, receipts, digest, None, _RECEIPT_CLASSES)


class SessionStates:
    """Session states in ``kv`` (module docstring), each kept ``ttl_s`` seconds after its last save."""

    def __init__(self, kv: KV, ttl_s: float) -> None:
        self.kv = kv
        self.ttl_s = ttl_s
        self._limiter = trio.CapacityLimiter(_WRITERS)
        self._saving: dict[str, trio.Lock] = {}
        """The lock of each session whose state is being saved in a worker thread (:meth:`save`), by id."""
        self._outage = Outage(log, "session states",
                              "sessions go on with the state this process holds until it answers")

    async def load(self, session: Session) -> None:
        """Replace ``session.supervision`` with the stored state when one newer than the session's own is stored
        (another process saved it, or this process has none yet). A state that cannot be read is logged and left
        alone; the backend failing changes nothing (warned once per outage), and so does a state read while another
        request of the session loaded or saved one (what it read is then no newer). Cancellation propagates.

        On a local store (:attr:`~proxyvisor.adapters.state.KV.local`) that this process already read or wrote
        for the session, the version is read on the event loop, and a worker thread reads the state only when
        another process stored a newer one: most requests find their own last save and cost one small read."""
        known = session.state_version
        try:
            if known and self.kv.local:
                found = await trio.to_thread.run_sync(self._read, session.id, session.supervision,
                                                      limiter=self._limiter) if self._newer(session.id, known) else None
            else:
                found = await trio.to_thread.run_sync(self._load, session.id, known, session.supervision,
                                                      limiter=self._limiter)
        except StateUnavailable as exc:
            self._outage.failed(exc)
            return
        self._outage.up()
        # Another request of the session loaded or saved its state meanwhile: the one in memory is the newer.
        if found is not None and session.state_version == known:
            session.supervision, session.state_version, session.state_chunks = found

    async def stored(self, session_id: str) -> SessionSupervision | None:
        """The stored supervision state of session ``session_id``, for a reader of a session this process does not
        hold (its ``/plan`` on a replica that did not serve it); None when none is stored, none this proxyvisor can
        use (logged) or the backend fails (warned once per outage)."""
        try:
            found = await trio.to_thread.run_sync(self._read, session_id, limiter=self._limiter)
        except StateUnavailable as exc:
            self._outage.failed(exc)
            return None
        self._outage.up()
        return found[0] if found is not None else None

    def _load(self, session_id: str, known: bytes,
              held: SessionSupervision | None) -> tuple[SessionSupervision, bytes, frozenset[bytes]] | None:
        return self._read(session_id, held) if self._newer(session_id, known) else None

    def _newer(self, session_id: str, known: bytes) -> bool:
        """Whether the store holds a version of the session's state other than ``known`` (this process's own)."""
        version = self.kv.get(session_id + ":v")
        return version is not None and version != known

    def _read(self, session_id: str,
              held: SessionSupervision | None = None) -> tuple[SessionSupervision, bytes, frozenset[bytes]] | None:
        """The stored state of the session, its version and the digests of its chunks (those of ``held``, the
        session's state this process holds, not read again: :func:`restore`); None when there is none, or none this
        proxyvisor can use (logged)."""
        value = self.kv.get(session_id)
        if value is None:
            return None
        try:
            decoded = decode(value, held)
            chunks = restore(decoded, session_id, self.kv.get_many, held)
        except ValueError as exc:
            log.warning("session %s: its stored supervision state is not used (%s)", session_id, exc)
            return None
        return decoded.state, decoded.version, chunks

    async def save(self, session: Session) -> None:
        """Store ``session.supervision`` (nothing when it has none) under a new version. Pickled on the event loop,
        where the state changes, and written there too when the store is local (one SQLite transaction of two
        rows, about 60 us of CPU, where handing it to a worker thread cost the loop 0.15-0.2 ms besides the write;
        the loop also waits while another process on the same folder holds SQLite's write lock, which its
        transactions take for as long), else in a worker thread (Redis: a network round trip). A state that
        cannot be pickled or stored is logged (the session goes on from memory). A session's saves in worker
        threads are made one after another, each pickled once the one before is written: two requests of a session
        at once, the earlier state is never written over the later (the store would hold it under a version this
        process does not know, and its next load would put it in place of the later). Cancellation propagates (a
        worker thread's write may still complete)."""
        if self.kv.local:  # written on the event loop: in order
            await self._store(session)
            return
        lock = self._saving.setdefault(session.id, trio.Lock())
        try:
            async with lock:
                await self._store(session)
        finally:
            if not lock.locked() and self._saving.get(session.id) is lock:
                del self._saving[session.id]

    async def _store(self, session: Session) -> None:
        """:meth:`save`'s pickling and write."""
        state = session.supervision
        if state is None:
            return
        version = os.urandom(_VERSION)
        try:
            encoded = encode(state, version)
        except (pickle.PicklingError, TypeError, AttributeError, ValueError) as exc:
            log.warning("session %s: its supervision state cannot be stored (%s: %s)", session.id,
                        type(exc).__name__, exc)
            return
        known, session.state_version = session.state_version, version
        try:
            if self.kv.local:
                self._save(session.id, encoded, version, session.state_chunks)
            else:
                await trio.to_thread.run_sync(self._save, session.id, encoded, version, session.state_chunks,
                                              limiter=self._limiter)
        except StateUnavailable as exc:
            # Not stored: keep the version the store holds, lest the next load take it for another process's newer
            # state and replace this process's with it.
            if session.state_version == version:
                session.state_version = known
            self._outage.failed(exc)
            return
        mark_stored(encoded.unstored)
        if session.state_version == version:
            session.state_chunks = encoded.chunks
        self._outage.up()

    def _save(self, session_id: str, encoded: Encoded, version: bytes, before: frozenset[bytes]) -> None:
        """Write ``encoded`` under a new ``version``, removing the chunks of ``before`` (what the state this process
        last saved or loaded referred to) that it does not refer to."""
        items = {_chunk_key(session_id, c.digest): c.value for c in encoded.unstored if c.value is not None}
        self.kv.set_many({**items, session_id: encoded.value, session_id + ":v": version}, self.ttl_s,
                         delete=[_chunk_key(session_id, d) for d in _dropped(before, encoded.chunks)])

    def close(self) -> None:
        self.kv.close()
