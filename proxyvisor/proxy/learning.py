"""Cross-session learning on the supervised path: the trio shell around ``proxyvisor.learning``.

- **Scope** (:func:`scope_of`): one memory per project folder: ``[supervisor.learning] scope`` when set, else the
  working directory the client's environment context names (Codex's ``<cwd>``, Claude Code's ``Primary working
  directory:``), else :attr:`Learning.default_scope` (``proxyvisor wrap`` sets its own working directory); a
  folder inside a git repository counts as the repository's root. A session without a scope learns nothing.
- **Store** (:class:`MemoryStore`, :func:`memory_store`): one value per scope, the bytes of
  :meth:`~proxyvisor.learning.memory.Memory.encode`. By default a file ``STATE/memory/<hash of the scope>.json``
  (:class:`MemoryFiles`: the folder 0700, each file 0600, written atomically under a lock of the folder, which
  ``proxyvisor memory`` takes too); with ``[state] backend = "redis"`` the key ``proxyvisor:memory:<hash of the
  scope>`` (:class:`MemoryKV`), shared by every replica, expiring ``retention_days`` after its last write. Every
  write is one atomic read-modify-write (:func:`save`) that merges what another process or replica stored meanwhile
  and keeps records forgotten from the command line forgotten (:meth:`~proxyvisor.learning.memory.Memory.merge`,
  the one merge rule). A running proxy looks at the stored value again, off the event loop, at a session's first
  request, and takes it in when it changed since it last read or wrote it (:meth:`Learning._current`), so a
  ``proxyvisor memory forget`` holds for every session that starts after it, on every replica. A value that cannot
  be read, or that holds another scope's memory, is left alone: learning is off for its scope (one warning naming
  it and how to reset it) and nothing is written over it. A Redis that does not answer turns sharing off (warned
  once per outage): learning goes on with the memories the process holds, merged in at the next write that works.
- **Recall** (a step of ``Exchange.before_forward``): on a thread's first request that offers tools, after a tool
  result or a user message, and again when a compaction dropped the note's place: the session's Active Memory
  Pack (``proxyvisor.learning.pack``), assembled once per session and re-inserted byte for byte like the steer
  notes and the recitation (``Thread.notes``, signal ``memory``), so the upstream prefix holds.
- **Distill**: at a turn end the gate judged (:meth:`Learning.ended`, from ``Pipeline._account``), at a detected
  compaction (a rewritten history, :meth:`Learning.begin`) and at session end (:meth:`Learning.end`: ``wrap``'s
  exit, idle eviction, the proxy's shutdown). The free records are stored at once; when the pre-screen finds
  something more to learn and a supervisor model call is at hand (a request's: turn ends and compactions), one
  call runs in the proxy's background nursery, after the answer went out, within ``timeout_s``. Session end has
  no request, so it stores the free records only.
- **Credit**: at a judged turn end, the records the self-report names in ``memories`` move by the gate's label.

With ``[supervisor.learning] enabled = false`` or supervision off, nothing here runs: no memory is read or written.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import re
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import trio

from ..adapters.state import KV, REDIS, Outage, StateBackend, StateUnavailable, Step
from ..condense.text import count_tokens
from ..config import LearningConfig
from ..detectors import checks
from ..gate import digest
from ..gate.verdict import Malformed
from ..learning import distill
from ..learning.memory import Candidate, Memory
from ..learning.pack import SIGNAL, Pack, assemble
from ..store import atomic_write, private_dir
from ..supervisor_model import ModelCall, ReportedFailure
from ..transcript import own_words
from .planning import add_note, append_note

if TYPE_CHECKING:
    from .sessions import Session
    from .supervise import Exchange, RequestRecord

log = logging.getLogger("proxyvisor.learning")

FOLDER = "memory"
NAMESPACE = "memory"
"""The state backend's namespace of the memories (:class:`MemoryKV`)."""
Stamp = tuple[int, int, int] | bytes
"""A stored memory's identity: a file's (:meth:`MemoryFiles.stamp`), a digest of a value (:class:`MemoryKV`). A
write or a removal changes it."""
Fetched = tuple[Stamp | None, Memory | None] | Exception | None
"""What :meth:`Learning._fetch` found: a stored memory with its stamp, nothing new (None), or why it failed."""
_CWD = re.compile(r"<cwd>\s*([^<\n]+?)\s*</cwd>|^[ \t]*(?:[-*][ \t]+)?(?:Primary working directory|Working directory):"
                  r"[ \t]*(/[^\n]*?)[ \t]*$", re.MULTILINE)
"""Where a harness names the folder it works in: Codex's ``<cwd>``, a line of Claude Code's environment section
(a list item, `` - Primary working directory: /path``, in its recent versions)."""
_SAFE_ROLES = ("tool", "user")


def project_root(path: str) -> str:
    """``path`` as a scope: normalised, and the root of the git repository it is in when it is in one (a folder
    that does not exist here, such as a remote client's, is taken as written)."""
    path = os.path.normpath(os.path.expanduser(path))
    if not os.path.isdir(path):
        return path
    real = os.path.realpath(path)
    for folder in (real, *map(str, Path(real).parents)):
        if os.path.exists(os.path.join(folder, ".git")):
            return folder
    return real


def scope_key(scope: str) -> str:
    """The name of ``scope``'s memory in a store: a hash of the scope."""
    return hashlib.blake2b(scope.encode(), digest_size=12).hexdigest()


def scope_of(texts: tuple[str, str], configured: str, default: str | None) -> str | None:
    """The scope of a session whose system prompt and first user message are ``texts`` (module docstring)."""
    if configured:
        return project_root(configured)
    for text in texts:
        if ("cwd>" in text or "orking directory:" in text) and (match := _CWD.search(text)):
            return project_root(match.group(1) or match.group(2))
    return project_root(default) if default else None


class MemoryStore(Protocol):
    """Where the scopes' memories are kept, one value per scope (the bytes of :meth:`Memory.encode`): files in the
    state directory (:class:`MemoryFiles`, the default) or a namespace of the shared state backend
    (:class:`MemoryKV`, with ``[state] backend = "redis"``). Every call blocks: take it off the event loop."""

    def where(self, scope: str) -> str:
        """Where ``scope``'s memory is, for a message (never a password)."""
        ...

    def look(self, scope: str, known: Stamp | None | tuple[()]) -> tuple[Stamp | None, bytes | None] | None:
        """(the stored value's stamp, the value; both None when there is none), or None when the stamp is still
        ``known`` (what the caller last read or wrote; ``()``: nothing yet).

        Raises:
            OSError, StateUnavailable: the store cannot be read.
        """
        ...

    def update(self, scope: str, step: Step) -> tuple[Stamp | None, bytes | None]:
        """Apply ``step`` to ``scope``'s value atomically (no other writer in between, in any process or replica;
        ``step`` may run more than once, so it must be a pure function of its argument) and return the stamp and
        value it made (None: removed, or there was none).

        Raises:
            OSError, StateUnavailable: the store cannot be read or written; whatever ``step`` raises.
        """
        ...


def decoded(data: bytes | None, scope: str) -> Memory | None:
    """The memory of ``scope`` in a stored value ``data`` (None: no value).

    Raises:
        ValueError: it is not a memory, or it holds the memory of another scope (a file edited or copied by hand:
            never taken for, nor written over by, this one's).
    """
    if data is None:
        return None
    memory = Memory.decode(data)
    if memory.scope != scope:
        raise ValueError(f"it holds the memory of {memory.scope!r}, not of {scope!r}")
    return memory


def save(store: MemoryStore, memory: Memory, loaded: set[str]) -> Stamp | None:
    """Write ``memory`` to ``store``, first merging into it what is stored there now (:meth:`Memory.merge`:
    records stored meanwhile taken in, those of ``loaded``, the ids read before, that are gone forgotten). Returns
    the written value's stamp and sets ``loaded`` to the ids written; None when it was not written (logged: among
    others, a value that cannot be read or holds another scope's memory is never written over).

    Raises:
        StateUnavailable: the shared state backend does not answer (nothing written).
    """
    records = dict(memory.records)
    merged = memory

    def step(current: bytes | None) -> bytes:
        nonlocal merged
        merged = Memory(memory.scope, records.values())
        # Nothing stored (a `forget --all` meanwhile) is an empty memory: the records read before are gone.
        merged.merge(decoded(current, memory.scope) or Memory(memory.scope), loaded)
        return merged.encode()

    try:
        stamp, _ = store.update(memory.scope, step)
    except (OSError, ValueError) as exc:
        log.warning("cannot write %s: %s", store.where(memory.scope), exc)
        return None
    memory.records = merged.records
    loaded.clear()
    loaded.update(memory.records)
    return stamp


class MemoryFiles:
    """The memories as files under ``root`` (``STATE/memory``), one per scope, written atomically (a new file
    renamed into place) under the folder's lock (:meth:`locked`)."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def path(self, scope: str) -> Path:
        return self.root / (scope_key(scope) + ".json")

    def where(self, scope: str) -> str:
        return f"the memory file {self.path(scope)}"

    def read(self, path: Path, scope: str | None = None) -> Memory | None:
        """The memory in ``path``; None when it does not exist.

        Raises:
            OSError: it cannot be read; ValueError: it is not a memory file, or (``scope`` given) it holds the
                memory of another scope.
        """
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        return Memory.decode(data) if scope is None else decoded(data, scope)

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Hold the memory folder's lock (made when missing), so that one process at a time reads and rewrites a
        memory file: a record forgotten from the command line cannot be written back by a save that read the file
        before.

        Raises:
            OSError: the folder cannot be made or locked.
        """
        private_dir(self.root)
        fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    @staticmethod
    def stamp(path: Path) -> Stamp | None:
        """``path``'s identity (inode, modification time in ns, size: a write, always a new file renamed into
        place, or a removal changes it); None when it does not exist.

        Raises:
            OSError: it cannot be examined.
        """
        try:
            st = path.stat()
        except FileNotFoundError:
            return None
        return st.st_ino, st.st_mtime_ns, st.st_size

    def look(self, scope: str, known: Stamp | None | tuple[()]) -> tuple[Stamp | None, bytes | None] | None:
        path = self.path(scope)
        stamp = self.stamp(path)
        if stamp == known:
            return None
        try:
            return stamp, path.read_bytes()
        except FileNotFoundError:
            return None, None

    def update(self, scope: str, step: Step) -> tuple[Stamp | None, bytes | None]:
        path = self.path(scope)
        with self.locked():
            try:
                current: bytes | None = path.read_bytes()
            except FileNotFoundError:
                current = None
            new = step(current)
            if new is None:
                path.unlink(missing_ok=True)
            elif new != current:
                atomic_write(path, new)
            return self.stamp(path), new

    def save(self, memory: Memory, loaded: set[str]) -> Stamp | None:
        """:func:`save` to these files."""
        return save(self, memory, loaded)


class MemoryKV:
    """The memories in a namespace of the state backend (``memory``; on Redis the keys
    ``proxyvisor:memory:<hash of the scope>``, shared by every replica), each kept ``ttl_s`` after its last write.
    A value's stamp is a digest of it."""

    def __init__(self, kv: KV, ttl_s: float, where: str) -> None:
        self.kv = kv
        self.ttl_s = ttl_s
        self._where = where

    def where(self, scope: str) -> str:
        return f"the memory {scope_key(scope)} in {self._where}"

    @staticmethod
    def _stamp(value: bytes | None) -> Stamp | None:
        return None if value is None else hashlib.blake2b(value, digest_size=16).digest()

    def look(self, scope: str, known: Stamp | None | tuple[()]) -> tuple[Stamp | None, bytes | None] | None:
        value = self.kv.get(scope_key(scope))
        stamp = self._stamp(value)
        return None if stamp == known else (stamp, value)

    def update(self, scope: str, step: Step) -> tuple[Stamp | None, bytes | None]:
        value = self.kv.update(scope_key(scope), step, self.ttl_s)
        return self._stamp(value), value


def memory_store(settings: LearningConfig, root: Path | None, backend: StateBackend | None) -> MemoryStore | None:
    """Where learning keeps the memories: in ``backend`` when it is Redis (shared by the replicas), else in files
    under the state directory ``root``; None when there is no state directory. (Whether learning is on is
    :class:`Learning`'s business: ``proxyvisor memory`` reads the store either way.)"""
    if root is None:
        return None
    if backend is not None and backend.name == REDIS:
        return MemoryKV(backend.kv(NAMESPACE), settings.retention_days * 86_400, backend.describe())
    return MemoryFiles(root / FOLDER)


@dataclass
class SessionLearning:
    """A session's learning state (``Session.learning``): its ``scope``, its pack once assembled, what earlier
    distill calls were shown (``asked``), the last request's material for a later distill (``pending``) and the
    counters /info shows."""

    scope: str | None
    started: float = 0.0
    """When the session began (the proxy's clock)."""
    opened: bool = False
    """Whether the session's first request looked at the scope's stored memory (:meth:`Learning._open`)."""
    memory: Memory | None = None
    """The scope's memory, once read."""
    pack: Pack | None = None
    asked: set[str] = field(default_factory=set)
    pending: Callable[[], distill.Material] | None = None
    pending_thread: Any = None
    """The thread ``pending`` is of: a request of another thread (a compaction to a summary starts one) distils it."""
    counts: Counter[str] = field(default_factory=Counter)

    def info(self) -> dict[str, Any]:
        """The /info object: the scope, its records (active and archived), what was recalled and distilled."""
        records = list(self.memory.records.values()) if self.memory is not None else []
        pack = self.pack
        return {"scope": self.scope, "records": sum(not r.archived for r in records),
                "archived": sum(r.archived for r in records),
                "recalled_items": len(pack.records) if pack else 0, "recalled_tokens": pack.tokens if pack else 0,
                **{k: self.counts[k] for k in ("recalls", "distills", "distill_calls", "distill_skipped",
                                               "stored", "credit_positive", "credit_negative", "archived_now")}}


@dataclass(frozen=True)
class _Turn:
    """What :func:`material_of` reads of an exchange, without the exchange (whose model call holds the request's
    credentials, and must not outlive it)."""

    fmt: Any
    items: list[Any]
    extra: list[Any]
    thread: Any
    schemas: dict[str, Any]
    record: Any


def _turn(exchange: Exchange) -> _Turn:
    extra = exchange.continuation.items if exchange.continuation is not None else []
    return _Turn(exchange.fmt, exchange.items, list(extra), exchange.thread, exchange.schemas, exchange.record)


def material_of(turn: _Turn, session: str, mutating_tools: frozenset[str]) -> distill.Material:
    """What a distill reads of a request's ``turn`` (the agent's history, the continued turn's items, its report)."""
    fmt, thread, items = turn.fmt, turn.thread, turn.items
    turns = tuple((n, own_words(fmt.message(items[i]).text))
                  for n, i in enumerate(thread.tracker.user_turns, 1) if i < len(items))
    start = thread.tracker.turn_start
    turn_items = (items[start + 1:] if start is not None else items) + turn.extra
    actions = digest.turn_actions([fmt.message(i) for i in turn_items], turn.schemas, mutating_tools,
                                  thread.tracker.reader.turn_receipts)
    ev = digest.evidence(actions)
    steps = tuple(distill.Action(n, a.use.name, a.receipt.command or "", not a.receipt.error,
                                 a.receipt.check != checks.NONE, a.receipt.summary,
                                 a.output.text[:distill.OUTPUT_CHARS] if a.output is not None else "")
                  for n, a in enumerate(actions, 1))
    gate = turn.record.gate or {}
    report = turn.record.report.report if turn.record.report is not None else None
    passed = ev.latest.number if ev.latest is not None and ev.latest.passed else 0
    return distill.Material(session, turns, turns[-1][1] if turns else "", distill.label_of(gate.get("outcome")),
                            steps, passed, report.memories if report is not None else ())


class Learning:
    """Learning for every session of a proxy (module docstring): ``settings`` (``[supervisor.learning]``), where
    the memories are kept (``store``, :func:`memory_store`; None: nothing learnt), ``clock`` (Unix time)."""

    def __init__(self, settings: LearningConfig, store: MemoryStore | None,
                 mutating_tools: frozenset[str] = frozenset(), clock: Callable[[], float] = time.time) -> None:
        self.settings = settings
        self.store = store if settings.enabled else None
        self.mutating_tools = mutating_tools
        self.clock = clock
        self.default_scope: str | None = None
        """The scope of a session whose client names no working directory (``wrap`` sets its own)."""
        self.memories: dict[str, Memory | None] = {}
        """Each scope's memory as read (None: its stored value cannot be read, or holds another scope's memory)."""
        self.loaded: dict[str, set[str]] = {}
        """Each scope's record ids the store held when last read or written."""
        self.stamps: dict[str, Stamp | None] = {}
        """Each scope's stored stamp when last read or written (absent: never looked at)."""
        self.forgotten: dict[str, dict[str, float]] = {}
        """Each scope's records found forgotten in the store, with when: a session that began before may not
        store them again (its transcript still holds what they were distilled from); a later one may."""
        self._outage = Outage(log, "memories", "learning goes on with the memories this process holds",
                              "the memories are shared again")

    @property
    def on(self) -> bool:
        return self.store is not None

    def memory(self, scope: str) -> Memory | None:
        """The memory of ``scope`` as read so far, read here when it was not yet (None: it cannot be read)."""
        if scope not in self.memories:
            self._settle(scope, (), self._fetch(scope, ()))
        return self.memories[scope]

    async def _current(self, scope: str) -> Memory | None:
        """The memory of ``scope`` as the store now holds it, read off the event loop when it changed since this
        proxy last read or wrote it (a ``proxyvisor memory forget``, another process's save) and taken in on the
        loop (:meth:`_settle`): records gone from it are forgotten here too, records another process added are
        taken in. None: it cannot be read (learning is off for the scope until it can)."""
        before = self.stamps.get(scope, ())
        self._settle(scope, before, await trio.to_thread.run_sync(self._fetch, scope, before))
        return self.memories.get(scope)

    def _fetch(self, scope: str, before: Stamp | None | tuple[()]) -> Fetched:
        """``scope``'s stored stamp and memory, or None when its stamp is still ``before``, or why it cannot be
        read. Blocks; touches nothing of this object but the store (it runs in a worker thread)."""
        assert self.store is not None
        try:
            found = self.store.look(scope, before)
            return None if found is None else (found[0], decoded(found[1], scope))
        except (OSError, ValueError, StateUnavailable) as exc:
            return exc

    def _settle(self, scope: str, before: Stamp | None | tuple[()], fetched: Fetched) -> None:
        """Take in what :meth:`_fetch` found for ``scope`` when its stamp was ``before``, unless a save or another
        read took the store in meanwhile. The backend unavailable: the memory held goes on (warned once)."""
        if isinstance(fetched, StateUnavailable):
            self._outage.failed(fetched)
            self.memories.setdefault(scope, Memory(scope))
            return
        if isinstance(fetched, Exception):
            if self.stamps.get(scope, ()) == before:
                self._unreadable(scope, fetched)
            return
        self._outage.up()
        if fetched is not None and self.stamps.get(scope, ()) == before:
            self._take(scope, *fetched)

    def _take(self, scope: str, stamp: Stamp | None, disk: Memory | None) -> None:
        """Take in ``disk``, the memory read from the store whose stamp was ``stamp`` (None: none stored)."""
        self.stamps[scope] = stamp
        memory = self.memories.get(scope)
        if memory is None:
            memory = self.memories[scope] = disk or Memory(scope)
            self.loaded[scope] = set(memory.records)
        else:
            self._merge(memory, disk or Memory(scope))

    def _unreadable(self, scope: str, exc: Exception) -> None:
        """Turn learning off for ``scope``, whose stored memory cannot be read; warned once, until it can be."""
        assert self.store is not None
        if self.memories.get(scope, Memory(scope)) is not None:
            log.warning("%s cannot be read (%s); learning is off for %s and it is left as it is (`proxyvisor memory "
                        "forget --all --scope %s` removes it)", self.store.where(scope), exc, scope, scope)
        self.memories[scope] = None
        self.stamps.pop(scope, None)

    def _state(self, session: Session, exchange: Exchange) -> SessionLearning:
        state = session.learning
        if not isinstance(state, SessionLearning):
            state = session.learning = SessionLearning(scope_of(exchange.parts, self.settings.scope,
                                                                self.default_scope), started=self.clock())
        return state

    def begin(self, session: Session, exchange: Exchange, background: trio.Nursery | None) -> None:
        """Before ``exchange`` goes upstream: on the session's first, add the step that looks at the scope's stored
        memory and recalls (:meth:`_open`); later, distill the pending material when its history was rewritten or
        another thread began (a compaction; the distill call, when one is worth it, in ``background``), and add the
        recall step when the thread has no memory note in place."""
        if not self.on or not exchange.tools:
            return
        state = self._state(session, exchange)
        if state.scope is None:
            return
        if not state.opened:
            state.opened = True
            exchange.steps.append(functools.partial(self._open, state))
            return
        if (memory := self.memories.get(state.scope)) is None:
            return
        state.memory = memory
        if state.pending is not None and (exchange.record.rebuilt or state.pending_thread is not exchange.thread):
            pending, state.pending = state.pending, None
            self._distill(session.id, state, memory, pending(), exchange.model, exchange.secrets, background,
                          exchange.record)
        if any(n.signal == SIGNAL for n in exchange.thread.notes):
            return

        exchange.steps.append(functools.partial(self._recall, state, memory))

    async def _open(self, state: SessionLearning, exchange: Exchange) -> None:
        """A session's first request here: its scope's memory as the store now holds it (:meth:`_current`),
        recalled unless the thread already carries the memory note (the session began on another replica, or
        before a restart: its note stays where it was, not recalled a second time)."""
        assert state.scope is not None
        if (memory := await self._current(state.scope)) is not None:
            state.memory = memory
            if not any(n.signal == SIGNAL for n in exchange.thread.notes):
                await self._recall(state, memory, exchange)

    async def _recall(self, state: SessionLearning, memory: Memory, exchange: Exchange) -> None:
        tail = exchange.anchor
        if tail is None or tail.role not in _SAFE_ROLES:
            return
        if state.pack is None:
            # Once per session, off the event loop: ranking and counting a full memory takes some 100 ms.
            state.pack = await trio.to_thread.run_sync(assemble, memory.active(), exchange.thread.planning.goal,
                                                       self.settings.budget_tokens, count_tokens)
            memory.seen((r.id for r in state.pack.records), self.clock())
        if not state.pack.records:
            return
        append_note(exchange, state.pack.text)
        add_note(exchange.thread, None, tail, SIGNAL, state.pack.text)
        exchange.record.learning = {**(exchange.record.learning or {}), "recalled": [r.id for r in state.pack.records],
                                    "tokens": state.pack.tokens}
        state.counts["recalls"] += 1
        log.info("recalled %d memories (%d tokens) for %s", len(state.pack.records), state.pack.tokens, state.scope)

    def ended(self, session: Session, exchange: Exchange, secrets: list[str],
              background: trio.Nursery | None) -> None:
        """After ``exchange``'s answer went out: at a turn end the gate judged, credit and distill (the model call,
        when one is worth it, in ``background``); otherwise keep the material for a later distill."""
        state = session.learning
        if not self.on or not isinstance(state, SessionLearning) or state.scope is None:
            return
        memory = self.memory(state.scope)
        if memory is None:
            return
        gate = exchange.record.gate
        if gate is None or "outcome" not in gate:
            turn, mutating, sid = _turn(exchange), self.mutating_tools, session.id
            state.pending = lambda: material_of(turn, sid, mutating)
            state.pending_thread = exchange.thread
            return
        state.pending = None
        material = material_of(_turn(exchange), session.id, self.mutating_tools)
        if material.label is not None:
            for _rid, delta, archived in memory.credit(material.memories, material.label):
                state.counts["credit_positive" if delta > 0 else "credit_negative"] += 1
                state.counts["archived_now"] += archived
        self._distill(session.id, state, memory, material, exchange.model if background is not None else None,
                      secrets, background, exchange.record)

    def end(self, session: Session, background: trio.Nursery | None = None) -> None:
        """At session end: the free records of the material not yet distilled (no model call: no request), saved
        in ``background`` (None: here, blocking; when the proxy stops)."""
        state = session.learning
        if not self.on or not isinstance(state, SessionLearning) or state.scope is None or state.pending is None:
            return
        memory = self.memory(state.scope)
        pending, state.pending = state.pending, None
        if memory is not None:
            self._distill(session.id, state, memory, pending(), None, [], background)

    def _distill(self, sid: str, state: SessionLearning, memory: Memory, material: distill.Material,
                 model: ModelCall | None, secrets: list[str], background: trio.Nursery | None = None,
                 record: RequestRecord | None = None) -> None:
        """Store ``material``'s free records and start the distill call when one is worth it; what was stored and
        whether a call started go to the ledger ``record`` of the request it happened at (the records the call
        adds later are counted in /info's live counters only)."""
        state.counts["distills"] += 1
        stored = self._store(state, memory, distill.free_records(material), sid, secrets)
        keys = distill.worth_asking(material, memory, state.asked)
        asking = model is not None and bool(keys) and background is not None
        if record is not None and (stored or asking):
            record.learning = {**(record.learning or {}), **({"stored": stored} if stored else {}),
                               **({"distill_calls": 1} if asking else {})}
        if model is None or not keys or background is None:
            state.counts["distill_skipped"] += model is not None
            if background is not None:
                background.start_soon(self._saved, memory)
            else:
                self._save(memory)
            return
        state.asked |= keys
        background.start_soon(self._ask, sid, state, memory, material, model, list(secrets))

    async def _ask(self, sid: str, state: SessionLearning, memory: Memory, material: distill.Material,
                   model: ModelCall, secrets: list[str]) -> None:
        """One distill call (``proxyvisor.learning.distill``); a failure, a timeout or a malformed answer stores
        nothing more (logged). The memory is saved either way."""
        messages = [{"role": "system", "content": distill.INSTRUCTIONS},
                    {"role": "user", "content": distill.distill_input(material)}]
        state.counts["distill_calls"] += 1
        with trio.move_on_after(self.settings.timeout_s):
            try:
                answer = await model(messages)
            except Exception as exc:  # noqa: BLE001 - a distill outage loses only what it would have learnt
                (log.debug if isinstance(exc, ReportedFailure) else log.warning)(
                    "the distill call failed (%s: %s)", type(exc).__name__, exc)
            else:
                found = distill.parse(answer.text, material)
                if isinstance(found, Malformed):
                    log.warning("the distill answer is malformed (%s); nothing more stored", found.error)
                else:
                    self._store(state, memory, found, sid, secrets)
        await self._saved(memory)

    def _store(self, state: SessionLearning, memory: Memory, candidates: list[Candidate], sid: str,
               secrets: list[str]) -> int:
        """Add ``candidates`` to ``memory``, but none forgotten since the session began; returns how many were new
        records."""
        now, stored = self.clock(), 0
        forgotten = self.forgotten.get(memory.scope, {})
        for candidate in candidates:
            if (record := memory.add(candidate, now, sid, secrets)) is None:
                continue
            if forgotten.get(record.id, -1.0) >= state.started:
                memory.forget(record.id)
            else:
                stored += 1
        state.counts["stored"] += stored
        return stored

    def _snapshot(self, memory: Memory) -> tuple[Memory, set[str]]:
        """``memory`` bounded, and a copy of it to save with the ids read from the store (:func:`save` changes
        both), so the event loop may go on changing ``memory`` while the copy is written."""
        s = self.settings
        memory.bound(s.max_records, s.max_bytes, s.retention_days * 86_400, self.clock())
        return Memory(memory.scope, memory.records.values()), set(self.loaded.setdefault(memory.scope, set()))

    def _merge(self, memory: Memory, stored: Memory) -> None:
        """Take into ``memory`` what the store holds (``stored``: read, or the copy as saved) by
        :meth:`Memory.merge`; the records it finds forgotten are noted with when (:attr:`forgotten`)."""
        loaded = self.loaded.setdefault(memory.scope, set())
        forgotten = self.forgotten.setdefault(memory.scope, {})
        for rid in memory.merge(stored, loaded):  # (one the bounds dropped here is gone already: not forgotten)
            forgotten[rid] = self.clock()
        loaded.clear()
        loaded.update(stored.records)

    def _save(self, memory: Memory) -> None:
        assert self.store is not None
        copy, loaded = self._snapshot(memory)
        self._written(memory, copy, self._stored(self.store, copy, loaded))

    async def _saved(self, memory: Memory) -> None:
        """:meth:`_save` with the store's work off the event loop; made even when the proxy stops meanwhile (its
        background work cancelled): it takes at most the store's timeouts."""
        assert self.store is not None
        copy, loaded = self._snapshot(memory)
        with trio.CancelScope(shield=True):
            self._written(memory, copy, await trio.to_thread.run_sync(self._stored, self.store, copy, loaded))

    @staticmethod
    def _stored(store: MemoryStore, copy: Memory, loaded: set[str]) -> Stamp | StateUnavailable | None:
        """:func:`save` of ``copy`` (it may run in a worker thread: it touches only its arguments); the backend
        being unavailable is returned."""
        try:
            return save(store, copy, loaded)
        except StateUnavailable as exc:
            return exc

    def _written(self, memory: Memory, copy: Memory, stamp: Stamp | StateUnavailable | None) -> None:
        """After ``copy`` of ``memory`` was saved as ``stamp`` (None: it was not written; the backend unavailable:
        warned once per outage)."""
        if isinstance(stamp, StateUnavailable):
            self._outage.failed(stamp)
            return
        if stamp is not None:
            self._outage.up()
        if stamp is not None and self.memories.get(memory.scope) is memory:
            self.stamps[memory.scope] = stamp
            self._merge(memory, copy)
