"""The plan on the supervised path: the trio shell around ``proxyvisor.gate.plan`` and ``proxyvisor.gate.recite``.

Per agent thread (``proxyvisor.proxy.supervise.Thread``): ``plan`` (the plan, or None), ``plan_signal`` (a signal
waiting for the planner, or None) and ``planning`` (:class:`PlanningState`). What happens, and when (seed 003
"Adaptive external planning", "Recite"; ``reference/in-session-supervisor-mechanics.md`` section 4):

1. **A signal is recorded** when a response's self-report is (``Exchange._finish``, or :func:`reconcile`): its
   ``plan`` field becomes the pending signal. ``request`` counts only without an open plan and once per user turn
   (a latch, reset by a new genuine user message); ``phase_complete`` and ``reassess`` only with an open plan.
2. **Before each request** (:meth:`Planner.begin`, from ``Supervisor.begin`` before the notes are inserted): the
   goal is updated (the latest genuine user message, ``HistoryTracker.turn_start``; Claude Code's
   ``<system-reminder>`` blocks are harness text, not the user's, and are left out); a new user turn resets the
   latch and drops a pending ``request`` (it was about the previous turn). When the agent rewrote its history
   (``Update.rebuilt``) and its latest request is still the goal, or no request is left (compaction, pruning),
   the goal stays, *fixed*, and is recited from then on (the reference recites its compression anchor's goal
   only while it matches the live request); a rewritten history with another request starts a new turn. The open
   phases' ``valid_if`` assumptions are checked with ``os.path.exists`` (relative paths from the proxy's working
   directory); a newly broken set adds a note once (a steer-like note, re-inserted at its position like the
   others) and makes the pending signal ``reassess``.
3. **The planner call** (a step of ``Exchange.before_forward``, when a signal is pending): one call to the
   supervisor model, at most ``[supervisor.plan] timeout_s``, with the planner input (``gate.plan.planner_input``:
   the goal, the agent's system prompt and tool names, the plan, the self-report's focus/next/carry and the tool
   calls since the phase started, or since the user turn for ``request``). It is counted as ``plan`` in
   ``RequestRecord.model``. The decision is applied (``gate.plan.apply``); a ``hold`` adds a note with the
   planner's reason. A call that fails, times out or answers malformed changes nothing (logged); the signal is
   consumed either way, so a planner outage never holds every later request for ``timeout_s``.
4. **Recitation** (the last step, ``[supervisor.plan] recite``): ``gate.recite.recite`` of the goal, the live
   plan and the standing prohibitions, inserted after the end of the upstream body's history when it says
   something the thread's latest recitation does not, and kept as a note (``Thread.notes``, signal
   :data:`RECITE`): every later request gets it back at the same place, byte for byte, like a steer note, so the
   upstream prefix stays byte-stable for provider prompt caches (a gate re-entry continues after it, and the
   continued items go back after it too). A recitation whose text is unchanged is not recited again, unless the
   latest lies more than :data:`RECITE_AFTER` history items back (then it is recited at the tail once more, the
   older one staying where it was); a recitation that would now be empty adds nothing, and the older one stays
   (it is history the upstream has seen). A rewritten history keeps it only where its anchor still is (as steer
   notes), so after a compaction the next recitation goes to the new tail. Only after a tool result or a user
   message (never after an assistant prefill). What is
   recited follows the reference (section 4, "Recitation"; seed 003 "Recite": "plans, explicit prohibitions ...
   can be recited before the first compaction. An archived goal is recited only when ..."): the plan whenever
   there is one; every prohibition in force but those of the latest user turn while that turn is the last item
   (then they are in plain view); the goal only once the history was rewritten since it was taken (before that
   the request itself is still in the context, and reciting it on every request would cost its tokens each
   time).

**Standing prohibitions** (``PlanningState.rules``, ``gate.prohibitions.standing``): each genuine user turn
(``HistoryTracker.user_turns``; harness re-prompts and tool results are none) is read once, when it first appears,
and numbered by the thread's count of user turns (``turns``): its permissions lift earlier prohibitions, its own
are added. A rewritten history keeps them (a compaction does not lift a prohibition); only its latest turn, when
it is another request, is read. ``/plan`` shows them, the verify-gate's digest gives them to the verifier with
their source turn, and the recitation re-states them.

For the verify-gate (``proxyvisor.proxy.gating``): :func:`reconcile` runs a pending signal at once (on a
turn-ending response, before verifying), :func:`clear` drops the plan on a PASS.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import trio

from ..config import PlanConfig
from ..detectors.detectors import Update
from ..detectors.selfreport import SelfReport
from ..gate.digest import turn_actions
from ..gate.plan import (PLANNER_INSTRUCTIONS, REQUEST, Assumption, Hold, apply, assumption_note, broken_assumptions,
                         hold_note, parse_decision, planner_input)
from ..gate.prohibitions import Standing, standing
from ..gate.recite import recite
from ..gate.verdict import Malformed
from ..supervisor_model import ModelAnswer, ModelCall, ReportedFailure
from ..transcript import Tail, own_words
from .formats import WireFormat

if TYPE_CHECKING:
    from .supervise import Exchange, SessionSupervision, Step, Thread

log = logging.getLogger("proxyvisor.plan")

RECITE = "recite"
"""The ``signal`` of a recitation among a thread's notes (``proxyvisor.proxy.supervise.Note``)."""
RECITE_AFTER = 32
"""History items after its place past which an unchanged recitation is recited again at the tail: it stays near
the end of long sessions for one recitation's tokens every 16 or so tool rounds (a fixed internal threshold, like
the detectors'; reference section 9)."""
_SAFE_ROLES = ("tool", "user")
"""Roles of a last history item after which proxyvisor may add a user-side note (never after an assistant item,
which may be a prefill)."""


@dataclass
class PlanningState:
    """A thread's plan bookkeeping besides ``Thread.plan`` and ``Thread.plan_signal``.

    ``goal``: the latest genuine user request (the text recited and given to the planner); ``rules``: the
    prohibitions in force (module docstring, "Standing prohibitions"), each with the ordinal of its source turn;
    ``folded``: how many of ``HistoryTracker.user_turns`` were read for them; ``turn``: the goal's history
    position (``HistoryTracker.turn_start``); ``turns``: genuine user turns seen; ``touched``: ``turns`` when the
    plan last changed (a plan older than the latest turn is recited as possibly stale); ``latched``: a ``request``
    signal was taken this turn; ``handoff``: the self-report that raised the pending signal; ``phase_start``: the
    history position after which the current phase's tool calls count as its evidence (None: since the user
    turn); ``broken``: the assumption set last found broken (a note is added once per set); ``compacted``: the
    history was rewritten since the goal was taken, so the goal is recited."""

    goal: str = ""
    rules: tuple[Standing, ...] = ()
    folded: int = 0
    turn: int | None = None
    turns: int = 0
    touched: int = 0
    latched: bool = False
    handoff: SelfReport | None = None
    phase_start: int | None = None
    broken: frozenset[tuple[int, Assumption]] = frozenset()
    compacted: bool = False


class PlanTurn:
    """The plan's part in one supervised request (``Exchange.planning``): records the reply's signal once."""

    def __init__(self, planner: Planner) -> None:
        self.planner = planner
        self.reconciled: list[SelfReport | None] = []
        """The turn-ending responses' reports :func:`reconcile` took, so the delivered reply's is not taken twice
        (a reply continued past them after a gate re-entry has its own, which is taken)."""

    def observe(self, thread: Thread, report: SelfReport | None) -> None:
        """Record ``report`` (the reply's self-report; None: none) as the thread's pending signal (module
        docstring, 1), unless :func:`reconcile` took that same report already."""
        if not (self.reconciled and report in self.reconciled):
            self.planner.observe(thread, report)


class Planner:
    """The plan for every session of a proxy: ``settings`` (``[supervisor.plan]``), the ``mutating_tools`` of
    ``[supervisor.detectors]``, and ``exists``, the file check for assumptions (``os.path.exists``; tests pass
    their own). The planner is each request's supervisor model (``Exchange.model``; a request without one makes no
    planner call; recitation still runs)."""

    def __init__(self, settings: PlanConfig, mutating_tools: frozenset[str] = frozenset(),
                 exists: Callable[[str], bool] = os.path.exists) -> None:
        self.settings = settings
        self.mutating_tools = mutating_tools
        self.exists = exists

    @property
    def planning(self) -> bool:
        """Whether signals call the planner: ``[supervisor.plan] enabled``."""
        return self.settings.enabled

    def turn(self) -> PlanTurn | None:
        """The :class:`PlanTurn` of a new request; None when signals do not call the planner."""
        return PlanTurn(self) if self.planning else None

    def observe(self, thread: Thread, report: SelfReport | None) -> None:
        """Make ``report``'s plan signal the thread's pending one, if it counts (module docstring, 1)."""
        if report is None or report.plan is None:
            return
        state = thread.planning
        active = thread.plan is not None and thread.plan.open
        if report.plan == REQUEST:
            if active or state.latched:
                return
            state.latched = True
        elif not active:
            return
        thread.plan_signal = report.plan
        state.handoff = report

    def begin(self, fmt: WireFormat, items: list[Any], update: Update, thread: Thread, state: SessionSupervision,
              tail: Tail | None) -> list[Step]:
        """Bring the thread's plan state up to date for a request with history ``items`` (the agent's, before
        anything is inserted) and return the steps to run before forwarding (module docstring, 2-4). A note for
        broken assumptions goes into ``thread.notes`` (so it is inserted with the others)."""
        self._track_goal(fmt, items, update, thread)
        if self.planning:
            self._check_assumptions(thread, state, tail)
        steps: list[Step] = []
        if self.planning and thread.plan_signal is not None:
            async def plan(exchange: Exchange) -> None:
                await self.run(exchange, final=False)

            steps.append(plan)
        if self.settings.recite:
            async def recitation(exchange: Exchange) -> None:
                _recite(exchange)

            steps.append(recitation)
        return steps

    def _track_goal(self, fmt: WireFormat, items: list[Any], update: Update, thread: Thread) -> None:
        planning = thread.planning
        start = thread.tracker.turn_start
        if start == planning.turn and not update.rebuilt:
            return
        text = own_words(fmt.message(items[start]).text) if start is not None and start < len(items) else None
        turns = thread.tracker.user_turns
        if update.rebuilt:
            planning.phase_start = None  # positions in the rewritten history mean something else
            planning.folded = max(len(turns) - 1, 0)  # its earlier turns were read before it was rewritten
            if planning.goal and text in (None, planning.goal):
                # The same request, or none left: the agent compacted or pruned its history; the goal stays.
                planning.turn, planning.compacted = start, True
                planning.folded = len(turns)
                return
        if start is None or text is None:
            return
        new = [(n, own_words(fmt.message(items[i]).text)) for n, i in
               enumerate(turns[planning.folded:], planning.turns + 1) if i < len(items)]
        planning.folded = len(turns)
        planning.rules = standing(new, planning.rules)
        planning.turn = start
        planning.turns += len(new) or 1
        planning.latched = planning.compacted = False
        if thread.plan_signal == REQUEST:
            thread.plan_signal = None
        if text:
            planning.goal = text

    def _check_assumptions(self, thread: Thread, state: SessionSupervision,
                           tail: Tail | None) -> None:
        plan, planning = thread.plan, thread.planning
        if plan is None or all(p.valid_if is None for p in plan.phases):
            return
        broken = broken_assumptions(plan, self.exists)
        found = frozenset(broken)
        previous, planning.broken = planning.broken, found
        if not found or found == previous:
            return
        thread.plan_signal = "reassess"
        log.info("plan assumption broken: %s; reassessing", ", ".join(str(a) for _, a in broken))
        if tail is not None and tail.role in _SAFE_ROLES:
            add_note(thread, state, tail, "plan_assumption", assumption_note(plan, broken))

    async def run(self, exchange: Exchange, final: bool) -> None:
        """Call the planner for the thread's pending signal and apply its decision (module docstring, 3).
        ``final``: the request already went upstream (:func:`reconcile`), so a hold's note is not added (it would
        sit before the answer it is about). Never raises for a planner fault; cancellation propagates."""
        thread = exchange.thread
        signal, thread.plan_signal = thread.plan_signal, None
        if signal is None or exchange.model is None:
            return
        planning = thread.planning
        report = planning.handoff
        start = planning.phase_start if signal != REQUEST and planning.phase_start is not None \
            else thread.tracker.turn_start
        items = exchange.items[start + 1:] if start is not None else exchange.items
        actions = turn_actions([exchange.fmt.message(i) for i in items], exchange.schemas, self.mutating_tools,
                               thread.tracker.reader.turn_receipts)
        document = planner_input(signal, planning.goal, instructions=exchange.parts[0], tools=sorted(exchange.tools),
                                 plan=thread.plan, focus=report.focus if report else "",
                                 next_step=report.next if report else None, carry=report.carry if report else (),
                                 actions=actions)
        answer = await self._ask(exchange.model, document)
        exchange.record.model.record("plan", answer)
        if answer is None:
            return
        decision = parse_decision(signal, answer.text)
        if isinstance(decision, Malformed):
            log.warning("the planner's answer to %s is malformed (%s); the plan is unchanged", signal, decision.error)
            return
        before = thread.plan
        thread.plan = apply(before, decision)
        log.info("planner: %s -> %s", signal, decision.kind)
        if thread.plan != before:
            planning.touched = planning.turns
            planning.phase_start = len(exchange.items) - 1
            planning.broken = frozenset()
        if isinstance(decision, Hold) and not final and exchange.anchor is not None \
                and exchange.anchor.role in _SAFE_ROLES:
            text = hold_note(decision.reason)
            append_note(exchange, text)
            add_note(thread, exchange.state, exchange.anchor, "plan_hold", text)

    async def _ask(self, model: ModelCall, document: str) -> ModelAnswer | None:
        """The planner's answer from ``model``, or None when the call failed or took longer than ``timeout_s``
        (logged)."""
        messages = [{"role": "system", "content": PLANNER_INSTRUCTIONS}, {"role": "user", "content": document}]
        with trio.move_on_after(self.settings.timeout_s):
            try:
                return await model(messages)
            except Exception as exc:  # noqa: BLE001 - a planner outage leaves the plan as it was
                # A route's refusal was reported once already (proxyvisor.proxy.session_model).
                (log.debug if isinstance(exc, ReportedFailure) else log.warning)(
                    "the planner call failed (%s: %s); the plan is unchanged", type(exc).__name__, exc)
                return None
        log.warning("the planner call timed out after %g s; the plan is unchanged", self.settings.timeout_s)
        return None


def add_note(thread: Thread, state: SessionSupervision | None, tail: Tail, signal: str,
              text: str) -> None:
    """Keep ``text`` as a note after the agent's last history item ``tail``, re-inserted there in the thread's later
    requests; counted by ``signal`` in ``state.notes`` (what /info shows as steers) unless ``state`` is None."""
    from .supervise import NOTES, Note  # supervise imports this module

    thread.notes = (thread.notes + [Note(tail.position, tail.fingerprint, signal, text)])[-NOTES:]
    if state is not None:
        state.notes[signal] += 1


def _recite(exchange: Exchange) -> None:
    """Recite at the end of the upstream body's history when the thread's latest recitation says something else
    or lies more than :data:`RECITE_AFTER` history items back (module docstring, 4)."""
    tail, thread = exchange.anchor, exchange.thread
    if tail is None or tail.role not in _SAFE_ROLES:
        return
    planning = thread.planning
    in_view = thread.tracker.turn_start == tail.position
    text = recite(planning.goal if planning.compacted else "", thread.plan,
                  [r.text for r in planning.rules if not (in_view and r.turn == planning.turns)],
                  stale=thread.plan is not None and planning.touched < planning.turns)
    if text is None:
        return
    latest = next((n for n in reversed(thread.notes) if n.signal == RECITE), None)
    if latest is not None and latest.text == text and tail.position - latest.index < RECITE_AFTER:
        return  # it is in the body already, re-inserted where it was first recited
    append_note(exchange, text)
    add_note(thread, None, tail, RECITE, text)


def append_note(exchange: Exchange, text: str) -> None:
    """Insert ``text`` as a note after the last item of the upstream body's history before the system messages
    that end it (``Exchange.anchor``)."""
    after = exchange.tail.position - exchange.anchor.position if exchange.tail and exchange.anchor else 0
    exchange.fmt.insert_notes(exchange.body, [(len(exchange.fmt.history(exchange.body)) - 1 - after, text)])


async def reconcile(exchange: Exchange, report: SelfReport | None = None) -> None:
    """Take ``report`` (the self-report of a turn-ending response the gate holds; None: it had none) and run the
    thread's pending plan signal now, so the verifier sees the plan as the turn's evidence leaves it (reference
    section 4: "reconciled ... after the final response before the gate"). The reply's report is then not taken
    again when the exchange finishes. Does nothing when the request's signals do not call the planner. Never
    raises for a planner fault; cancellation propagates."""
    turn: PlanTurn | None = exchange.planning
    if turn is None:
        return
    turn.planner.observe(exchange.thread, report)
    turn.reconciled.append(report)
    await turn.planner.run(exchange, final=True)


def clear(thread: Thread) -> None:
    """Drop the thread's plan and pending signal: the gate passed the turn, which closes the plan (reference
    section 4, "Completion": a PASS closes the remaining tasks and clears the plan)."""
    thread.plan = None
    thread.plan_signal = None
    thread.planning = dataclasses.replace(thread.planning, phase_start=None, broken=frozenset(), handoff=None)
