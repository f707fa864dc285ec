"""The per-turn gate: a small state machine, read from one table, that routes a turn's stops to a verdict.

The trio shell feeds events and performs the decisions returned; this module never calls a model, a socket or a
clock. One :class:`TurnGate` lives for one user-owned turn (a genuine user message starts a new one).

States and transitions (:data:`TABLE`; any other event is a :class:`GateProtocolError`)::

    WORKING   --Stop-->         Nudge (WORKING) | Reenter, evidence (WORKING) | Deliver, evidence (DONE)
                                | Verify (VERIFYING)
    VERIFYING --Answered-->     Refute (REFUTING) | Deliver (DONE)
    VERIFYING --Malformed-->    Verify(format_retry) (VERIFYING), once | as Unavailable
    VERIFYING --Unavailable-->  Deliver (DONE)
    REFUTING  --Refuted-->      Reenter (WORKING) | Deliver (DONE)

The next state follows from the decision's type alone (:data:`NEXT`); the table lists, per state and event, the
handler and the states it may lead to.

Rules and the source of each number (seed 003 "Verify-gate"; ``reference/in-session-supervisor-mechanics.md``
section 3; issue 4):

- **Free pre-check**: in headless runs only, a stop whose self-report state is ``exploring`` or ``progressing``
  gets a continue nudge instead of a verification, at most :data:`NUDGE_BUDGET` (2, the reference's
  ``MAX_ITERATIONS``) times per turn; then the stop is verified like any other.
- **Evidence pre-check** (free, no model call): a completion (state ``done`` or no state) after a change whose
  latest check after the last change failed gets a gap quoting that check's summary line; a completion after a
  change with no check after the last change gets a gap asking for the project's checks, unless the user forbade
  running them (:attr:`Stop.checks_forbidden`). These gaps skip the refuter and are charged like the model's
  (below); the decisions carry ``decided_by`` = :data:`EVIDENCE`. The "no check" gap is a request, not a
  finding: it is charged once per last change, and a later stop with no check and no further change (the project
  may have no runnable checks, and the agent may say why) goes to the model pass, which judges the agent's answer
  to it.
- **Model pass** on every other stop: a completion the evidence does not settle, a stop without status, or a
  hand-back (``blocked`` / ``need_input``: the verifier judges whether the remaining work truly needs the user;
  this machine only routes).
- **Gaps** of the model first go through the refutation pass; the gaps that stand re-enter the turn upstream with
  an advisory, at most ``reentry_budget`` times (default 2, at most 8: :data:`~proxyvisor.rules.REENTRY_BUDGET`).
  Once the budget is spent the turn ends ``unverified``. If the ledger moved since the previous pass (new evidence) and the
  same gaps return (:func:`~proxyvisor.gate.verdict.same_gaps`), retrying stops early and the turn ends ``failed``.
- **Format retry**: one per turn for a malformed verifier answer; a second malformed answer counts as the verifier
  being unavailable.
- **Verifier unavailable** (transport failure, or malformed twice): the answer is delivered either way, labelled
  ``unverified``. Policy ``fail_closed`` (the default) marks it not passed; ``fail_open`` passes it. Never
  silently passed under ``fail_closed``.
- **Notice**: under ``fail_closed``, every answer delivered not passed (``unverified`` or ``failed``) carries
  :attr:`GatePolicy.notice`, a line the shell appends to the agent's visible text (:meth:`GatePolicy.notice_for`);
  under ``fail_open`` none does. When gaps stand (found in the evidence or by the model), the notice names the
  first (:func:`naming`), so "could not be verified" is not read as "the verifier was unavailable".
- **Outcomes**: ``verified`` (pass, state changed and the latest recognised check after the last change passed:
  :attr:`.digest.Evidence.checked`; a failed latest check never ends verified),
  ``unknown`` (pass on reading alone, including a legitimate hand-back and a pass where the user forbade the check),
  ``failed`` (unchanged gaps after new evidence), ``unverified`` (budget spent, verifier unavailable).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..condense.text import clip_chars
from ..redact import redact
from ..rules import DEFAULT_REENTRIES, FAIL_CLOSED, FAIL_OPEN, FAILURE_POLICIES, REENTRY_BUDGET, FailurePolicy
from .digest import Evidence
from .verdict import GAPS, Gap, Malformed, Verdict, same_gaps

NUDGE_BUDGET = 2
VERIFIED, UNKNOWN, FAILED, UNVERIFIED = "verified", "unknown", "failed", "unverified"
HANDBACKS = ("blocked", "need_input")
COMPLETIONS = (None, "done")
"""Self-report states of a stop that claims completion (no state at all included)."""
EVIDENCE, MODEL = "evidence", "model"
"""What decided a pass: the free evidence pre-check, or a verifier model call."""


class GateState(enum.StrEnum):
    """The gate's states (the same strings in the ledger)."""

    WORKING = "working"
    VERIFYING = "verifying"
    REFUTING = "refuting"
    DONE = "done"


WORKING, VERIFYING, REFUTING, DONE = GateState.WORKING, GateState.VERIFYING, GateState.REFUTING, GateState.DONE

NUDGE_NOTE = (
    "You ended the turn while still in progress and did nothing. Continue the work. Report done when it is "
    "finished and checked, or blocked / need_input with the reason if only the user can unblock it."
)
"""The pre-check's continue note (the reference's gist of ``pre_gate_unfinished_handback``)."""


class GateProtocolError(RuntimeError):
    """The shell fed an event the current state does not accept (a bug in the shell, not in the agent)."""


@dataclass(frozen=True, slots=True)
class GatePolicy:
    """Validated gate settings, by the rules the configuration states (:mod:`proxyvisor.rules`). Raises ValueError
    for a budget outside :data:`~proxyvisor.rules.REENTRY_BUDGET` or an unknown policy. ``notice``: the line shown with an answer delivered not passed (``[supervisor.gate]
    unverified_notice``; empty: none)."""

    reentry_budget: int = DEFAULT_REENTRIES
    failure_policy: FailurePolicy = FAIL_CLOSED
    headless: bool = False
    notice: str = ""

    def __post_init__(self) -> None:
        if not REENTRY_BUDGET.admits(self.reentry_budget):
            raise ValueError(f"reentry_budget must be {REENTRY_BUDGET}, got {self.reentry_budget}")
        if self.failure_policy not in FAILURE_POLICIES:
            raise ValueError(f"failure_policy must be one of {', '.join(FAILURE_POLICIES)}, got {self.failure_policy!r}")

    def notice_for(self, passed: bool, gaps: tuple[Gap, ...] = ()) -> str | None:
        """The notice an answer delivered ``passed`` or not carries, naming the first of the standing ``gaps``
        (module docstring), None for none."""
        notice = self.notice.strip()
        if passed or not notice or self.failure_policy != FAIL_CLOSED:
            return None
        return naming(notice, gaps[0]) if gaps else notice


NOTICE_GAP_CHARS = 200
"""Longest gap text a notice or a log line names, in characters (longer ones are clipped in the middle)."""


def gap_line(gap: Gap) -> str:
    """``gap``'s text on one line (whitespace runs joined), secret-looking values replaced
    (:func:`~proxyvisor.redact.redact`), at most about :data:`NOTICE_GAP_CHARS` characters
    (:func:`~proxyvisor.condense.text.clip_chars`): what a notice and a log line show of it."""
    return clip_chars(redact(" ".join(gap.text.split())), NOTICE_GAP_CHARS)


def naming(notice: str, gap: Gap) -> str:
    """``notice`` (a configured one-line notice, stripped) naming ``gap`` (:func:`gap_line`, ending as a sentence):
    after the notice's first ``": "``, with what followed it a sentence of its own, or else after the whole notice
    (after a ``": "`` of its own when the notice does not end a sentence). The default notice naming ``"The latest
    check after the last change failed: `pytest -q` reported "1 failed"."`` reads ``"[proxyvisor] This answer could
    not be verified: the latest check after the last change failed: `pytest -q` reported "1 failed". Check it
    before relying on it."``"""
    line = gap_line(gap)
    if not line.endswith((".", "!", "?")):
        line += "."
    head, colon, tail = notice.partition(": ")
    if not colon:
        ended = notice.endswith((".", "!", "?"))
        return f"{notice} {_cased(line, str.upper)}" if ended else f"{notice}: {_cased(line, str.lower)}"
    return f"{head}: {_cased(line, str.lower)} {_cased(tail, str.upper)}".rstrip()


def _cased(text: str, case: Callable[[str], str]) -> str:
    """``text`` with its first letter in ``case``, unless its second is a capital too (an acronym: ``README``)."""
    return case(text[:1]) + text[1:] if not text[1:2].isupper() else text


# Events (fed by the shell).
@dataclass(frozen=True, slots=True)
class Stop:
    """A response without tool calls ended the turn. ``state``: its self-report state (None when absent);
    ``evidence``: the turn's evidence so far; ``checks_forbidden``: the user forbade running the checks
    (:func:`~.prohibitions.forbids_checks`), so their absence is compliance, not a gap."""

    state: str | None
    evidence: Evidence
    checks_forbidden: bool = False


@dataclass(frozen=True, slots=True)
class Answered:
    """The verifier gave a well-formed :class:`~.verdict.Verdict`."""

    verdict: Verdict


@dataclass(frozen=True, slots=True)
class Unavailable:
    """The verifier call failed (transport error, timeout, breaker open); ``reason`` is for the ledger."""

    reason: str


@dataclass(frozen=True, slots=True)
class Refuted:
    """The refutation pass ended; ``kept`` are the findings that stand (all of them when the refuter failed)."""

    kept: tuple[Gap, ...]


Event = Stop | Answered | Malformed | Unavailable | Refuted
"""The events; :class:`~.verdict.Malformed` (the verifier's answer broke the protocol) is fed as it was parsed."""


# Decisions (performed by the shell).
@dataclass(frozen=True, slots=True)
class Nudge:
    """Continue the turn upstream with ``note``; the next stop is fed as a new :class:`Stop`."""

    note: str = NUDGE_NOTE


@dataclass(frozen=True, slots=True)
class Verify:
    """Call the verifier. ``handback``: the stop is a hand-back to judge; ``format_retry``: add
    :data:`~.verdict.FORMAT_RETRY` (the one format-only retry); ``previous_gaps``: for the digest."""

    handback: bool
    format_retry: bool = False
    previous_gaps: tuple[Gap, ...] = ()


@dataclass(frozen=True, slots=True)
class Refute:
    """Run the refutation pass over ``gaps`` and feed :class:`Refuted`."""

    gaps: tuple[Gap, ...]


@dataclass(frozen=True, slots=True)
class Reenter:
    """Continue the turn upstream with ``advisory``; its next stop is fed as a new :class:`Stop`. ``decided_by``:
    :data:`EVIDENCE` or :data:`MODEL`."""

    gaps: tuple[Gap, ...]
    advisory: str
    decided_by: str = MODEL


@dataclass(frozen=True, slots=True)
class Deliver:
    """Deliver the latest answer to the agent. ``passed`` is False when the gate did not accept it; ``notice`` is
    the line the shell appends to the answer (:meth:`GatePolicy.notice_for`), None for none; ``gaps`` are the
    standing gaps, if any; ``decided_by``: :data:`EVIDENCE` or :data:`MODEL`."""

    outcome: str
    passed: bool
    reason: str
    gaps: tuple[Gap, ...] = ()
    notice: str | None = None
    decided_by: str = MODEL


Decision = Nudge | Verify | Refute | Reenter | Deliver


FAILED_CHECK_SETTLES = ("a run of the checks covering the change that passes after the last change (for a failure "
                        "that predates the change, a passing run of the tests the change touches)")
NO_CHECK_SETTLES = "a run of the project's checks (its tests, build or linters covering the change) after the last " \
                   "change, with its result"


def evidence_gaps(evidence: Evidence, checks_forbidden: bool = False) -> tuple[Gap, ...]:
    """The gaps the recorded evidence settles without a model (module docstring, "Evidence pre-check"): one for a
    failed latest check after the last change, one for no check after it (unless ``checks_forbidden``); empty
    otherwise."""
    if evidence.check_failed:
        assert evidence.latest is not None
        return (Gap(f"The latest check after the last change failed: {evidence.latest.quote()}.",
                    FAILED_CHECK_SETTLES),)
    if evidence.unchecked and not checks_forbidden:
        earlier = evidence.before
        return (Gap("State changed but no check ran after the last change"
                    + (f"; the latest check, before it, {earlier.outcome}: {earlier.quote()}" if earlier else "")
                    + ". Run the project's checks on the result.", NO_CHECK_SETTLES),)
    return ()


def advisory(gaps: tuple[Gap, ...], decided_by: str = MODEL) -> str:
    """The re-entry advisory listing ``gaps`` (the reference's gist)."""
    listed = "\n".join(f"{n}. {g.text} (would be settled by: {g.settles})" for n, g in enumerate(gaps, 1))
    found = " (read from the recorded evidence, without a model call)" if decided_by == EVIDENCE else ""
    return ("A verifier found gaps between your answer and the request" + found + ":\n" + listed
            + "\nClose each gap with an artifact, an observed state or a check, or cite the evidence that it is "
            "already satisfied. Then report your status again, and write your reply as the complete, standalone "
            "answer.")


@dataclass
class TurnGate:
    """The gate of one turn. Feed events with :meth:`handle`; each returns the decision to perform."""

    policy: GatePolicy = field(default_factory=GatePolicy)
    state: GateState = WORKING
    nudges: int = 0
    reentries: int = 0
    format_retried: bool = False
    handback: bool = False
    evidence: Evidence = field(default_factory=Evidence)
    previous_gaps: tuple[Gap, ...] = ()
    previous_seq: int | None = None
    checks_asked_at: int | None = None
    """The last change (:attr:`.digest.Evidence.last_change`) after which the evidence pre-check asked for a run of
    the checks, None before it asked."""
    outcome: Deliver | None = None

    def handle(self, event: Event) -> Decision:
        """The decision for ``event``. Raises :class:`GateProtocolError` if the state does not accept it."""
        entry = TABLE.get(self.state, {}).get(type(event))
        if entry is None:
            raise GateProtocolError(f"{type(event).__name__} in state {self.state}")
        handler, targets = entry
        decision = handler(self, event)
        following = NEXT[type(decision)]
        assert following in targets, f"{type(decision).__name__} from {self.state} is not in the table"
        self.state = following
        if isinstance(decision, Deliver):
            self.outcome = decision
        return decision

    def _stop(self, event: Stop) -> Decision:
        self.evidence = event.evidence
        if self.policy.headless and event.state in ("exploring", "progressing") and self.nudges < NUDGE_BUDGET:
            self.nudges += 1
            return Nudge()
        self.handback = event.state in HANDBACKS
        if event.state in COMPLETIONS:
            asked = self.checks_asked_at == event.evidence.last_change
            gaps = evidence_gaps(event.evidence, event.checks_forbidden or asked)
            if gaps:
                if event.evidence.unchecked:
                    self.checks_asked_at = event.evidence.last_change
                return self._charge(gaps, EVIDENCE)
        return Verify(self.handback, previous_gaps=self.previous_gaps)

    def _answered(self, event: Answered) -> Decision:
        if event.verdict.outcome == GAPS:
            return Refute(event.verdict.gaps)
        return self._passed()

    def _passed(self) -> Deliver:
        if self.handback:
            return Deliver(UNKNOWN, True, "hand-back accepted: the remaining work needs the user")
        if self.evidence.changed and self.evidence.checked:
            return Deliver(VERIFIED, True, "completion verified: state changed and the latest check after it passed")
        return Deliver(UNKNOWN, True, "completion passed on reading alone")

    def _malformed(self, event: Malformed) -> Decision:
        if not self.format_retried:
            self.format_retried = True
            return Verify(self.handback, format_retry=True, previous_gaps=self.previous_gaps)
        return self._unavailable(Unavailable(f"malformed verifier answer after a format retry: {event.error}"))

    def _unavailable(self, event: Unavailable) -> Deliver:
        if self.policy.failure_policy == FAIL_OPEN:
            return Deliver(UNVERIFIED, True, f"verifier unavailable (fail_open): {event.reason}")
        return Deliver(UNVERIFIED, False, f"verifier unavailable (fail_closed): {event.reason}",
                       notice=self.policy.notice_for(False))

    def _refuted(self, event: Refuted) -> Decision:
        return self._charge(event.kept, MODEL) if event.kept else self._passed()

    def _charge(self, kept: tuple[Gap, ...], decided_by: str) -> Reenter | Deliver:
        """Gaps that stand: re-enter the turn, or end it when they returned unchanged after new evidence
        (``failed``) or the re-entry budget is spent (``unverified``)."""
        moved = self.previous_seq is not None and self.evidence.seq != self.previous_seq
        notice = self.policy.notice_for(False, kept)
        if moved and same_gaps(self.previous_gaps, kept):
            return Deliver(FAILED, False, "the same gaps returned after new evidence", kept, notice=notice,
                           decided_by=decided_by)
        if self.reentries >= self.policy.reentry_budget:
            return Deliver(UNVERIFIED, False, "verification gaps remain: re-entry budget spent", kept, notice=notice,
                           decided_by=decided_by)
        self.reentries += 1
        self.previous_gaps, self.previous_seq = kept, self.evidence.seq
        return Reenter(kept, advisory(kept, decided_by), decided_by)


Handler = Callable[[TurnGate, Any], "Decision"]

TABLE: dict[GateState, dict[type, tuple[Handler, tuple[GateState, ...]]]] = {
    WORKING: {Stop: (TurnGate._stop, (WORKING, VERIFYING, DONE))},
    VERIFYING: {Answered: (TurnGate._answered, (REFUTING, DONE)),
                Malformed: (TurnGate._malformed, (VERIFYING, DONE)),
                Unavailable: (TurnGate._unavailable, (DONE,))},
    REFUTING: {Refuted: (TurnGate._refuted, (WORKING, DONE))},
    DONE: {},
}
"""State -> event type -> (handler, the states it may lead to): the only place transitions are decided."""

NEXT: dict[type, GateState] = {Nudge: WORKING, Reenter: WORKING, Verify: VERIFYING, Refute: REFUTING, Deliver: DONE}
"""Decision type -> the state it leaves the gate in."""


def answer_event(parsed: Verdict | Malformed) -> Answered | Malformed:
    """The event for a parsed verifier answer (:func:`~.verdict.parse`'s result)."""
    return Answered(parsed) if isinstance(parsed, Verdict) else parsed
