"""Supervision of one model request: the step before it goes upstream and the step on its reply.

:class:`Supervisor` is called by the pipeline on the supervised path only (with supervision disabled none of
this runs). For each request, :meth:`Supervisor.begin` returns an :class:`Exchange`:

1. **before forwarding**: the session's state is brought up to date from the request's history (only the items
   new since the last request; rebuilt when the history was rewritten), the detectors run, the steer policy may
   add a note, and the upstream body is built: every note of the thread re-inserted at the history position it
   was first added at, and every delegation the upstream saw beyond the agent's history (:class:`Delegated`:
   the model's calls of delegation tools and their results, which the agent never received) put back after
   the item it followed, before any note there (so the upstream prefix stays byte-stable for provider prompt
   caches), then the self-report instruction appended to the end of the system prompt. Steps that need I/O run next, in
   :meth:`Exchange.before_forward`, on the same parsed body, before :meth:`Exchange.upstream_body` serialises it:
   condensing oversized tool results (``proxyvisor.proxy.condensing``; its candidates and context are read in
   ``begin``, from the agent's history as sent), then the planner call for a pending plan signal and the
   recitation of the plan at the request tail when it changed (``proxyvisor.proxy.planning``; kept as a note, so
   re-inserted at its place like the others), and on a thread's first request the recall of the project's memory
   (``proxyvisor.proxy.learning``, a step the pipeline adds; kept as a note too);
2. **on the reply** (:meth:`Exchange.reply`): the self-report token is stripped from the assistant text, in a
   JSON body or a stream, and parsed from the model's output; missing and malformed reports are counted, never
   fatal. Before it, when the request was offered delegation tools (``Exchange.delegation``), the pipeline lets
   the turn be continued upstream after the children ran (``proxyvisor.proxy.continuation``). A later step
   (the gate) plugs in here.

Threads: one agent session can interleave histories (Claude Code's title requests and sub-agents share its
session id), so state is kept per thread, keyed by a hash of the system prompt and first user message, at most
:data:`THREADS` per session (least recently used dropped).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import threading
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import orjson
import trio

from .. import wirejson
from ..config import SupervisorConfig
from ..supervisor_model import ModelAnswer, ModelCall
from ..detectors.detectors import HistoryTracker, Update
from ..detectors.receipts import ReceiptCache, Round, UserTurn
from ..detectors.selfreport import INSTRUCTION, ReportOutcome, Stripper, outcome, strip
from ..detectors.steer import SteerPolicy, note_text
from ..gate.plan import Plan
from . import bodies
from .condensing import CondenseRecord, RequestCondenser
from .continuation import rewritable
from .formats import WireFormat
from .formats.base import CallResult, ToolSpec
from ..transcript import Tail, fingerprint
from .planning import Planner, PlanningState, PlanTurn
from .client import Cut
from .relay import UpstreamReply
from .sessions import Session
from .reply import RUN_S, Edited, blocks

if TYPE_CHECKING:  # the stages that hang on an exchange import this module
    from .continuation import Continuation
    from .delegation import DelegationTurn
    from .gating import GateTurn
    from .session_model import Send

log = logging.getLogger("proxyvisor.supervise")

THREADS = 8
"""Agent threads (distinct histories) tracked per session."""
NOTES = 64
"""Notes (steer, plan and recitation notes) kept per thread; past it the oldest is no longer re-inserted (one
prompt-cache miss)."""
RECORDS = 256
"""Request records kept per session (:attr:`SessionSupervision.records`)."""
DELEGATED = 64
"""Continued turns kept per thread for re-insertion (:class:`Delegated`), and part-blocked batches for grafting
(:class:`Grafted`); past it the oldest is no longer re-inserted (one prompt-cache miss)."""


@dataclass(frozen=True)
class Note:
    """A note (a steer note, a plan note, a recitation): inserted after history item ``index``, whose
    :func:`fingerprint` was ``anchor``; notes at one position go in the order they were added."""

    index: int
    anchor: bytes
    signal: str
    text: str


@dataclass(frozen=True)
class Delegated:
    """History items the upstream saw beyond the agent's history in one turn (a delegation: the model's calls of
    delegation tools and their results, ``proxyvisor.proxy.delegation``), to go back right after history item
    ``index`` (whose :func:`fingerprint` was ``anchor``) in every later request that goes on past it."""

    index: int
    anchor: bytes
    items: list[Any]


@dataclass(frozen=True)
class Grafted:
    """Tool calls of a part-blocked batch the agent never received (the tool authorizer's,
    ``proxyvisor.proxy.authorizing``) and their results, to go back into the agent's own copy of the batch
    (``WireFormat.graft``) in every later request that goes on past history item ``index`` (whose
    :func:`fingerprint` was ``anchor``): ``response``, the model's whole batch; ``results``, the blocked calls'."""

    index: int
    anchor: bytes
    response: dict[str, Any]
    results: list[CallResult]


@dataclass
class ModelCallTime:
    """One supervisor model call's wall times (ns since the epoch), its answer (None: it failed, ``error`` the
    exception's type name) and the purpose it was recorded for (empty until :meth:`ModelUse.record`)."""

    start_ns: int
    end_ns: int
    answer: ModelAnswer | None
    error: str | None = None
    purpose: str = ""


@dataclass
class ModelUse:
    """The supervisor model's calls for one request: ``calls`` by purpose (``condense``, ``verify``, ``refute``,
    ``plan``), their tokens and cost in USD (each :class:`~proxyvisor.supervisor_model.ModelAnswer`'s) over the
    priced answers, and how many answers were not priced (the scripted upstream, a model the map lacks)."""

    calls: Counter[str] = field(default_factory=Counter)
    input_tokens: int = 0
    output_tokens: int = 0
    cost_usd: float = 0.0
    unpriced: int = 0
    time_s: float = 0.0
    """Wall time (s) during which a call was under way (``proxyvisor.proxy.pipeline`` times them)."""
    route: dict[str, str] = field(default_factory=dict)
    """Which route and model the calls take: ``{"route": "session"|"litellm"|"supplied", "model": name}``."""
    timeline: list[ModelCallTime] = field(default_factory=list)
    """Each call made, in the order they ended (``proxyvisor.proxy.pipeline`` times them), for the trace."""
    late: Callable[[ModelCallTime], None] | None = None
    """Set once the request's spans were made: takes each call that ends after that (learning's distill call,
    made once the answer went out), which has its span of its own."""

    def record(self, purpose: str, answer: ModelAnswer | None) -> None:
        """Count one call for ``purpose``; ``answer`` is its answer (None when the call failed). The earliest timed
        call not yet recorded with that answer (a failed one for None) is labelled with ``purpose``."""
        timed = next((t for t in self.timeline if not t.purpose and t.answer is answer), None)
        if timed is not None:
            timed.purpose = purpose
        self.calls[purpose] += 1
        if answer is not None:
            self.input_tokens += answer.input_tokens
            self.output_tokens += answer.output_tokens
            if answer.cost_usd is None:
                self.unpriced += 1
            else:
                self.cost_usd += answer.cost_usd


@dataclass
class RequestRecord:
    """What supervision did for one request: the detector ``firings`` its history completed, as
    (history position of the round, signals); the ``note`` added (its signal), where, and its text; whether the thread was
    ``rebuilt``; what condensing did (``condense``; None when it had nothing to do); the supervisor ``model``
    calls made for it; what the verify-gate did (``gate``, a ledger object, ``proxyvisor.proxy.gating``; None
    when it did not run); and, once the reply is through, the self-report ``report`` (None until then, or when
    the reply was an error or cut short)."""

    firings: list[tuple[int, tuple[str, ...]]] = field(default_factory=list)
    note: str | None = None
    note_index: int | None = None
    note_text: str | None = None
    rebuilt: bool = False
    report: ReportOutcome | None = None
    condense: CondenseRecord | None = None
    model: ModelUse = field(default_factory=ModelUse)
    gate: dict[str, Any] | None = None
    authorizer: dict[str, Any] | None = None
    """What the tool authorizer did (a ledger object, ``proxyvisor.proxy.authorizing``); None when it did not run."""
    upstream: dict[str, Any] | None = None
    """Which upstream answered and why, under the breakers (``proxyvisor.proxy.breakers.Dispatch.evidence``)."""
    learning: dict[str, Any] | None = None
    """What learning did at the request (``proxyvisor.proxy.learning``; the ledger's ``learning``,
    ``proxyvisor.proxy.info``); None when nothing."""


@dataclass
class Thread:
    """One agent history's supervision state.

    :attr:`changes` counts what may have changed it since it was made or loaded: each of its fields set, by
    whatever code sets it (``__setattr__`` counts it), each request taking it (``Supervisor.begin``, and
    ``Supervisor.catch_up`` once its tracker read a history from the start) and each request's hold on it ending
    (:attr:`holders`). A save (``proxyvisor.proxy.session_state``) pickles a thread again when its count moved
    since its last pickle, or while a request holds it, whatever that request changes deep inside it (the
    verify-gate's state machine across its verdict's wait): no code that changes a thread has to say so."""

    tracker: HistoryTracker
    policy: SteerPolicy = field(default_factory=SteerPolicy)
    notes: list[Note] = field(default_factory=list)
    delegated: list[Delegated] = field(default_factory=list)
    grafted: list[Grafted] = field(default_factory=list)
    state: str | None = None
    """The state of the latest self-report (None: the last response had no valid report)."""
    carry: tuple[str, ...] = ()
    """The ``carry`` items of the latest valid self-report: what /plan shows as retained critical knowledge
    (a response without a valid report keeps them)."""
    gate_turn: GateTurn | None = None
    """The current turn's verify-gate, once one of its stops was judged."""
    plan: Plan | None = None
    """The supervisor-owned plan (``proxyvisor.gate.plan``; ``proxyvisor.proxy.planning``), None without one."""
    plan_signal: str | None = None
    """The self-report's plan signal waiting for the planner (``request``, ``phase_complete``, ``reassess``)."""
    planning: PlanningState = field(default_factory=PlanningState)
    """The rest of the plan's bookkeeping: the goal, the request latch, the phase's evidence window."""
    changes: int = field(default=0, init=False, repr=False, compare=False)
    """What may have changed the thread, counted (class docstring); this process's own (not stored)."""
    holders: int = field(default=0, init=False, repr=False, compare=False)
    """Requests holding the thread (their exchanges, until ``Exchange.close``); this process's own (not stored)."""

    def __setattr__(self, name: str, value: Any) -> None:
        # Every field set counts (class docstring), in the instance's dict directly (a thread has neither slots nor
        # properties): a request sets a few of its fields, and object.__setattr__ cost three times as much.
        fields = self.__dict__
        fields[name] = value
        fields["changes"] = fields.get("changes", 0) + 1

    def __getstate__(self) -> dict[str, Any]:
        """What a stored state holds of the thread: its fields but :attr:`changes` and :attr:`holders`."""
        state = self.__dict__.copy()
        for name in _LOCAL:
            state.pop(name, None)
        return state

_LOCAL = frozenset({"changes", "holders"})
"""The fields of :class:`Thread` that are this process's own."""


@dataclass
class SessionSupervision:
    """Supervision state of one session (``Session.supervision``): its threads, recent request records and
    counters: ``reports`` by outcome status (``ok``, ``missing``, ``malformed``), ``signals`` fired and ``notes``
    added, by signal. (What /info shows is summed from the ledger, ``proxyvisor.proxy.info``.)"""

    threads: OrderedDict[bytes, Thread] = field(default_factory=OrderedDict)
    records: deque[RequestRecord] = field(default_factory=lambda: deque(maxlen=RECORDS))
    reports: Counter[str] = field(default_factory=Counter)
    signals: Counter[str] = field(default_factory=Counter)
    notes: Counter[str] = field(default_factory=Counter)
    receipts: ReceiptCache | None = None
    """The receipts of the session's calls by content, shared by its threads: a compacted history whose first user
    message is now a summary is another thread, whose first reading still finds the receipts of the calls it kept
    (this process's only: it pickles empty)."""

    def __getstate__(self) -> dict[str, Any]:
        """What a stored session state holds (``proxyvisor.proxy.session_state``): everything but the request
        records, which are this process's own."""
        return {**self.__dict__, "records": deque(maxlen=RECORDS)}

    def thread(self, key: bytes, mutating_tools: frozenset[str]) -> Thread:
        """The thread ``key`` (made when new), now the most recently used; its tracker takes receipts from
        :attr:`receipts`."""
        if self.receipts is None or self.receipts.mutating_tools != mutating_tools:
            self.receipts = ReceiptCache(mutating_tools)
        thread = self.threads.pop(key, None) or Thread(HistoryTracker(mutating_tools, self.receipts))
        self.threads[key] = thread
        while len(self.threads) > THREADS:
            self.threads.popitem(last=False)
        return thread


@dataclass
class Reading:
    """What :meth:`Supervisor.catch_up` found of one request for :meth:`Supervisor.begin`, each found once per
    request: the session's ``state``, the request's ``thread``, its fingerprint ``parts`` (system prompt and first
    user message, ``WireFormat.fingerprint_parts``), its history ``items`` (the body's own list), its ``tools``
    and their argument ``schemas`` by name; ``update``, the history as read from the start (None: it goes on from
    what the thread read, and :meth:`Supervisor.begin` feeds its new items)."""

    state: SessionSupervision
    thread: Thread
    parts: tuple[str, str]
    items: list[Any]
    tools: list[ToolSpec]
    schemas: dict[str, Any]
    update: Update | None = None


def thread_key(fmt: WireFormat, parts: tuple[str, str]) -> bytes:
    """The key of the :class:`Thread` a request in ``fmt`` belongs to in :attr:`SessionSupervision.threads`;
    ``parts`` is ``fmt.fingerprint_parts(body)`` (its system prompt and first user message)."""
    return _thread_key(fmt.name, *parts)


@functools.lru_cache(maxsize=32)
def _thread_key(format_name: str, system: str, first: str) -> bytes:
    """:func:`thread_key`, kept for the threads seen last: a thread's requests repeat the same strings, most often
    the very same objects (whose hashes Python keeps), so finding them costs far less than hashing them again.
    The strings are kept alive with it: at most 32 pairs (a first user message may be a big paste)."""
    return hashlib.blake2b(orjson.dumps([format_name, system, first]), digest_size=16).digest()


def _anchored(fmt: WireFormat, items: list[Any], index: int, anchor: bytes) -> bool:
    """Whether history item ``index`` of ``items`` is still the one whose :func:`fingerprint` was ``anchor``."""
    return fingerprint(fmt.message(items[index])) == anchor


class Supervisor:
    """The supervised path's per-request steps (module docstring); holds no I/O."""

    def __init__(self, config: SupervisorConfig, condenser: RequestCondenser | None = None,
                 model: ModelCall | None = None) -> None:
        self.config = config
        self.mutating_tools = frozenset(config.detectors.mutating_tools)
        self.condenser = condenser
        self.model = model
        """The supervisor model call of a request :meth:`begin` is given none for (None: no model calls)."""
        self.planner = Planner(config.plan, self.mutating_tools)

    def _thread(self, session: Session, fmt: WireFormat, parts: tuple[str, str]) -> tuple[SessionSupervision, Thread]:
        """The session's supervision state (made on its first request) and the thread of a request whose
        ``fmt.fingerprint_parts`` are ``parts``, now its most recently used."""
        if session.supervision is None:
            session.supervision = SessionSupervision()
        state: SessionSupervision = session.supervision
        return state, state.thread(thread_key(fmt, parts), self.mutating_tools)

    def _reading(self, session: Session, fmt: WireFormat, body: dict[str, Any]) -> Reading:
        """``body``'s :class:`Reading`, its history not read yet."""
        parts = fmt.fingerprint_parts(body)
        state, thread = self._thread(session, fmt, parts)
        tools = fmt.tools(body)
        return Reading(state, thread, parts, fmt.history(body), tools, {t.name: t.schema for t in tools})

    async def catch_up(self, session: Session, fmt: WireFormat, body: dict[str, Any]) -> Reading:
        """What :meth:`begin` needs of ``body`` (a parsed request in ``fmt``), found once (:class:`Reading`), for
        :meth:`begin` to take with no checkpoint in between. When the thread reads the history from the start
        (its first request here, or a rewritten history: compaction, an edit), it is read here, in steps on the
        event loop, which runs other tasks after each :data:`~.reply.RUN_S` of work
        (``HistoryTracker.updating``); a history that goes on from what the thread read is left to :meth:`begin`
        (its new items, at once). A thread replaced meanwhile (a load of the session's state another process stored,
        for another request of the session: ``SessionStates.load``; or dropped, the least recently used) is read
        again, in steps, as it now is: what was read is the replaced one's, whose firings the session must not
        count again (the loaded thread may have read the same history). Cancelled part way, the thread's state is
        as before."""
        reading = self._reading(session, fmt, body)
        while True:
            tracker = reading.thread.tracker
            if not tracker.from_start(reading.items, fmt.message):
                return reading
            update = Update()
            since = time.perf_counter()
            for _step in tracker.updating(reading.items, fmt.message, reading.schemas, update):
                if time.perf_counter() - since >= RUN_S:
                    await trio.lowlevel.checkpoint()
                    since = time.perf_counter()
            # The most recently used again, after the steps. A loaded state keeps the threads whose stored pickle is
            # this process's own (session_state.decode): the same thread, whose reading holds.
            reading.state, thread = self._thread(session, fmt, reading.parts)
            if thread is reading.thread:
                thread.changes += 1  # its tracker now holds what was read
                reading.update = update
                return reading
            reading.thread = thread

    def begin(self, session: Session, fmt: WireFormat, body: dict[str, Any], model: ModelCall | None = None,
              route: dict[str, str] | None = None, reading: Reading | None = None) -> Exchange:
        """Update the session from ``body`` (a parsed request in ``fmt``) and rewrite ``body`` in place into
        the upstream body (notes, then the instruction). ``model`` is the request's supervisor model call (else
        the supervisor's own) and ``route`` its label (``{"route", "model"}``, ``proxyvisor.proxy.session_model``);
        ``reading``, what :meth:`catch_up` found of the same body just before (else it is found here, and the
        history read at once).
        Never raises on odd histories: unknown items are ignored."""
        caught_up, reading = reading is not None, reading or self._reading(session, fmt, body)
        # Taken: whatever is changed here before the exchange holds the thread is counted, should this fail.
        reading.thread.changes += 1
        if reading.update is not None:
            update = reading.update
        elif caught_up:  # catch_up found the history going on, with nothing run since
            update = reading.thread.tracker.go_on(reading.items, fmt.message, reading.schemas)
        else:
            update = reading.thread.tracker.update(reading.items, fmt.message, reading.schemas)
        state, thread, parts, items, tools, schemas = (reading.state, reading.thread, reading.parts, reading.items,
                                                       reading.tools, reading.schemas)
        sent = list(items)  # the agent's history: the insertions below go into this same list
        record = RequestRecord([(f.index, f.signals) for f in update.firings], rebuilt=update.rebuilt)
        for firing in update.firings:
            state.signals.update(firing.signals)
        if update.rebuilt:
            thread.notes = [n for n in thread.notes
                            if n.index < len(items) and _anchored(fmt, items, n.index, n.anchor)]
        last = fmt.message(items[-1]) if items else None
        tail = Tail(len(items) - 1, fingerprint(last), last.role) if last is not None else None
        anchor = note_anchor(fmt, items, tail)
        if isinstance(update.last, UserTurn):
            thread.policy.reset()
        elif isinstance(update.last, Round):
            signal = thread.policy.decide(update.signals, thread.state)
            # The safe point: after the latest tool results (or the harness's latest prompt), never inside
            # the model's own turn.
            if signal and anchor is not None and anchor.role in ("tool", "user"):
                note = Note(anchor.position, anchor.fingerprint, signal, note_text(signal))
                thread.notes = (thread.notes + [note])[-NOTES:]
                record.note, record.note_index, record.note_text = signal, note.index, note.text
                state.notes[signal] += 1
                log.info("session %s: %s fired at history item %d; steer note added", session.id, signal,
                         update.last.index)
        steps: list[Step] = []
        pending = self.condenser.collect(fmt, items, tools, parts) if self.condenser is not None else None
        if pending is not None:
            condenser = self.condenser
            assert condenser is not None  # pending was collected by it

            async def condense(exchange: Exchange) -> None:
                record = exchange.record.condense = await condenser.apply(session.id, exchange.fmt, exchange.body,
                                                                          pending, exchange.model)
                if record is not None and record.condenser_called:
                    exchange.record.model.record("condense", record.answer)

            steps.append(condense)
        steps += self.planner.begin(fmt, items, update, thread, state, anchor)
        thread.delegated, runs = _live(fmt, sent, thread.delegated)
        thread.grafted, live = _live(fmt, sent, thread.grafted)
        grafts = [fmt.graft(sent, g.index, g.response, g.results) for g in live]
        for graft in grafts:
            for index, item in graft.replace.items():
                items[index] = item
        grafted = [run for graft in grafts for run in graft.runs]
        fmt.insert_items(body, _merged([(d.index, d.items) for d in runs] + grafted))
        # A note at a delegation's position was added before it: it stays right after the agent's item. A grafted
        # item belongs to the agent's turn (a result among its results): a note there goes after it.
        fmt.insert_notes(body, [(note.index + sum(len(d.items) for d in runs if d.index < note.index)
                                 + sum(len(run) for index, run in grafted if index <= note.index), note.text)
                                for note in thread.notes])
        fmt.add_instruction(body, INSTRUCTION)
        state.records.append(record)
        exchange = Exchange(fmt, body, state, thread, record, steps, tail, frozenset(t.name for t in tools), anchor)
        exchange.model = model or self.model
        if exchange.model is not None:
            record.model.route = route or {}
        exchange.items, exchange.parts = sent, parts
        exchange.schemas = schemas
        exchange.planning = self.planner.turn()
        return exchange


_Anchored = TypeVar("_Anchored", Delegated, Grafted)


def _live(fmt: WireFormat, items: list[Any], anchored: list[_Anchored]) -> tuple[list[_Anchored], list[_Anchored]]:
    """(the delegations or grafts of ``anchored`` to keep, those that go back into a request with history
    ``items``, by position). Kept: those whose anchor is still in place (one whose anchor was replaced, the history
    being rewritten, is forgotten); going back: those the history goes on past (a retry of the same request gets
    none)."""
    kept, live = [], []
    for d in anchored:
        if d.index < len(items) and not _anchored(fmt, items, d.index, d.anchor):
            continue
        kept.append(d)
        if d.index + 1 < len(items):
            live.append(d)
    return kept, sorted(live, key=lambda d: d.index)


def _merged(runs: list[tuple[int, list[Any]]]) -> list[tuple[int, list[Any]]]:
    """``runs`` ascending by position, one per position (those at one position joined in the order given)."""
    by: dict[int, list[Any]] = {}
    for index, run in runs:
        by.setdefault(index, []).extend(run)
    return sorted(by.items())


Step = Callable[["Exchange"], Awaitable[None]]
"""A request-side step that needs I/O, run by :meth:`Exchange.before_forward` on the exchange's body."""


def note_anchor(fmt: WireFormat, items: list[Any], tail: Tail | None) -> Tail | None:
    """The history item notes go after: ``tail`` (the agent's last item), or, when the history ends with system
    messages, the item before them. A harness that ends a request with its own system message (Claude Code's
    first request ends with one listing its agent types) then gets notes after the user's message, where its
    later requests keep them; a note after such a message would never be a safe point."""
    if tail is None or tail.role != "system":
        return tail
    position = tail.position
    while position > 0:
        position -= 1
        message = fmt.message(items[position])
        if message.role != "system":
            return Tail(position, fingerprint(message), message.role)
    return tail


_FREED: dict[int, deque[Thread]] = {}
"""By the ident of the thread their exchanges were made on (the event loop's): the threads whose hold an exchange
freed on another thread left to end (:meth:`Exchange.__del__`)."""


def _end_freed_holds(owner: int) -> None:
    """End the holds exchanges made on thread ``owner`` (this one) left to it when freed on another thread."""
    freed = _FREED.get(owner)
    while freed:
        try:
            thread = freed.popleft()
        except IndexError:
            return
        thread.holders -= 1


class Exchange:
    """One supervised request: ``body`` is the upstream body (parsed; :meth:`before_forward` may still change it),
    and :meth:`reply` rewrites the upstream's reply for the agent."""

    def __init__(self, fmt: WireFormat, body: dict[str, Any], state: SessionSupervision, thread: Thread,
                 record: RequestRecord, steps: list[Step] | None = None,
                 tail: Tail | None = None, tools: frozenset[str] = frozenset(),
                 anchor: Tail | None = None) -> None:
        self.fmt = fmt
        self.body = body
        self.state = state
        self.thread = thread
        self.record = record
        self.steps = steps or []
        self.tail = tail
        """The agent's last history item: (position, :func:`fingerprint`, role); None for an empty history."""
        self.anchor = anchor if anchor is not None else tail
        """Where notes go (:func:`note_anchor`): the tail, or the item before the system messages ending the
        history."""
        self.tools = tools
        """The names of the agent's own tools in the request."""
        self.delegation: DelegationTurn | None = None
        """The request's delegation turn, when delegation tools were offered."""
        self.continuation: Continuation | None = None
        """The turn's :class:`~proxyvisor.proxy.continuation.Continuation` once one was made (delegation's first;
        the verify-gate continues through the same one, so what the upstream saw accumulates in one place)."""
        self.items: list[Any] = []
        """The agent's history as sent (before notes and re-inserted items)."""
        self.parts: tuple[str, str] = ("", "")
        """The agent's system prompt and first user message (``WireFormat.fingerprint_parts``)."""
        self.schemas: dict[str, Any] = {}
        """The agent's tools' argument schemas, by name."""
        self.planning: PlanTurn | None = None
        """The plan's part in the request (``proxyvisor.proxy.planning``); None when signals call no planner."""
        self.model: ModelCall | None = None
        """The request's supervisor model call (condenser, verifier, refuter, planner; None: none is made). On the
        session's route it holds the request's credentials: it lives as long as the exchange, never longer."""
        self.send: Send | None = None
        """Sends a body the way the request went: continued turns."""
        self.cut = Cut()
        """Ends the waits of the reply's stream held while proxyvisor works (a verdict, a child, a check) when the
        proxy stops: the pipeline's own, which its stop cuts."""
        self.trace: str | None = None
        """The W3C ``traceparent`` of the request's own span (a child of the client's), which its delegated
        children and its trace share; None when neither tracing nor delegation is on."""
        self.secrets: list[str] = []
        """The credentials the request carries (``proxyvisor.proxy.session_model.secrets_of``): what learning
        never stores. Never written anywhere."""
        self.owner = threading.get_ident()
        """The thread the exchange was made on, the event loop's, where its thread's holders are counted."""
        _end_freed_holds(self.owner)
        thread.holders += 1
        self.held = True

    held = False
    """Whether the exchange holds its thread (``Thread.holders``: every save pickles it again meanwhile)."""

    def close(self) -> None:
        """The request is over: its hold on the thread ends (the first call only), so that saves keep the thread's
        next pickle until it changes."""
        if self.held:
            self.held = False
            self.thread.holders -= 1

    def __del__(self) -> None:
        # An exchange never closed (a path that forgot to) ends its hold once freed: a forgotten close costs saves
        # pickling the thread meanwhile, never a save missing a change. Freed on another thread (the cyclic garbage
        # collector runs in whichever thread allocates: a worker's), the count would race the loop's: the next
        # exchange made on the loop's thread ends the hold there.
        if threading.get_ident() == self.owner:
            self.close()
        elif self.held:
            self.held = False
            _FREED.setdefault(self.owner, deque()).append(self.thread)

    def remember(self, items: list[Any]) -> None:
        """Record ``items`` (everything the upstream has seen so far beyond the agent's history in this turn, e.g.
        :attr:`Continuation.items <proxyvisor.proxy.continuation.Continuation.items>`) for re-insertion right
        after the agent's last item in the thread's later requests (:class:`Delegated`); replaces what an earlier
        round of the same turn recorded."""
        if self.tail is None:
            return
        index, anchor, _role = self.tail
        self.thread.delegated = ([d for d in self.thread.delegated if d.index != index]
                                 + [Delegated(index, anchor, items)])[-DELEGATED:]

    def graft(self, response: dict[str, Any], results: list[CallResult]) -> None:
        """Record the calls of ``response`` that ``results`` answer (a batch's calls the agent never received) for
        the thread's later requests, which get them back in the agent's own copy of the batch, with their results
        (:class:`Grafted`); replaces what an earlier request ending at the same item recorded (a retry)."""
        if self.tail is None:
            return
        index, anchor, _role = self.tail
        self.thread.grafted = ([g for g in self.thread.grafted if g.index != index]
                               + [Grafted(index, anchor, response, results)])[-DELEGATED:]

    async def before_forward(self) -> None:
        """Run the request-side steps that need I/O (condensing), in order, on ``body``. A step that fails is
        logged and skipped (the request goes up without that step's change); cancellation propagates."""
        for step in self.steps:
            try:
                await step(self)
            except Exception:  # noqa: BLE001 - supervision must never cost the agent its request
                log.exception("a supervision step failed; forwarding the request without it")

    def upstream_body(self) -> bytes:
        """The upstream request body as JSON bytes, as ``wirejson.dumps`` writes it (the history's items written once
        and kept, ``proxyvisor.proxy.bodies``).

        Raises:
            TypeError: (``orjson.JSONEncodeError``) the body nests deeper than ``wirejson.dumps`` writes (about 990
                levels; it reads 1,024); the pipeline then forwards the client's own bytes, unsupervised.
        """
        return b"".join(self.upstream_chunks())

    def upstream_chunks(self) -> tuple[bytes, ...]:
        """:meth:`upstream_body` as pieces to send one after another, unjoined (``proxyvisor.proxy.bodies.chunks``:
        the runs of history items an earlier request sent are the same bytes objects). Raises as
        :meth:`upstream_body`."""
        return bodies.chunks(self.body, self.fmt.history_field)

    def _finish(self, bodies: list[str]) -> None:
        result = outcome(bodies)
        self.record.report = result
        self.state.reports[result.status] += 1
        self.thread.state = result.report.state if result.report is not None else None
        if result.report is not None:
            self.thread.carry = result.report.carry
        if self.planning is not None:
            self.planning.observe(self.thread, result.report)

    def reply(self, reply: UpstreamReply) -> UpstreamReply:
        """``reply`` with the self-report stripped from its assistant text (an error reply, or one in an
        encoding proxyvisor did not ask for, passes unchanged). The report is recorded once the JSON body is
        read, or when the stream ends."""
        if not rewritable(reply):
            return reply
        if reply.streaming:
            strippers: list[Stripper] = []

            def new_filter() -> Stripper:
                strippers.append(Stripper())
                return strippers[-1]

            def on_end(complete: bool) -> None:
                if complete:
                    self._finish([b for s in strippers for b in s.bodies])

            editor = self.fmt.stream_editor(new_filter, lambda text: strip(text)[0])
            return reply.with_body(Edited(blocks(reply.body), editor, on_end))
        try:
            response = reply.json()
        except orjson.JSONDecodeError as exc:
            # Delivered as it came: the agent's answer is never lost to supervision, but its self-report (if it
            # has one) reaches the agent, and the operator should know why.
            log.warning("an answer in %s is not JSON proxyvisor reads (%s): delivered as it came, unsupervised",
                        self.fmt.name, exc)
            return reply
        if not isinstance(response, dict):
            return reply
        bodies: list[str] = []

        def edit(text: str) -> str:
            clean, removed = strip(text)
            bodies.extend(removed)
            return clean

        self.fmt.edit_response(response, edit)
        self._finish(bodies)
        if not bodies:
            return reply
        return reply.with_body(wirejson.dumps(response), response)
