"""The per-turn gate: a small state machine, read from one table, that routes a turn's stops to a verdict.

The trio shell feeds events and performs the decisions returned; this module never calls a model, a socket or a
clock. One :class:`TurnGate` lives for one user-owned turn (a genuine user message starts a new one).

States and transitions (:data:`TABLE`; any other event is a :class:`GateProtocolError`)::

    WORKING   --Stop-->         Nudge (WORKING) | Verify (VERIFYING)
    VERIFYING --Answered-->     Refute (REFUTING) | Deliver (DONE)
    VERIFYING --Malformed-->    Verify(format_retry) (VERIFYING), once | as Unavailable
    VERIFYING --Unavailable-->  Deliver (DONE)
    REFUTING  --Refuted-->      Reenter (WORKING) | Deliver (DONE)

Rules and the source of each number (seed 003 "Verify-gate"; ``reference/in-session-supervisor-mechanics.md``
section 3; issue 4):

- **Free pre-check**: in headless runs only, a stop whose self-report state is ``exploring`` or ``progressing``
  gets a continue nudge instead of a verification, at most :data:`NUDGE_BUDGET` (2, the reference's
  ``MAX_ITERATIONS``) times per turn; then the stop is verified like any other.
- **Model pass** on every other stop: a completion, a stop without status, or a hand-back (``blocked`` /
  ``need_input``: the verifier judges whether the remaining work truly needs the user; this machine only routes).
- **Gaps** first go through the refutation pass; the gaps that stand re-enter the turn upstream with an advisory,
  at most ``reentry_budget`` times (default 2, issue 4; at most :data:`MAX_REENTRIES` = 8). Once the budget is
  spent the turn ends ``unverified``. If the ledger moved since the previous pass (new evidence) and the same gaps
  return (:func:`~proxyvisor.gate.verdict.same_gaps`), retrying stops early and the turn ends ``failed``.
- **Format retry**: one per turn for a malformed verifier answer; a second malformed answer counts as the verifier
  being unavailable.
- **Verifier unavailable** (transport failure, or malformed twice): the answer is delivered either way, labelled
  ``unverified``. Policy ``fail_closed`` (the default) marks it not passed, with a notice the shell records and
  shows; ``fail_open`` passes it. Never silently passed under ``fail_closed`` (issue 4).
- **Outcomes**: ``verified`` (pass, state changed and a recognised check ran after it: :class:`~.digest.Evidence`),
  ``unknown`` (pass on reading alone, including a legitimate hand-back and a pass where the user forbade the check),
  ``failed`` (unchanged gaps after new evidence), ``unverified`` (budget spent, verifier unavailable).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .digest import Evidence
from .verdict import GAPS, Gap, Malformed, Verdict, same_gaps

NUDGE_BUDGET = 2
DEFAULT_REENTRIES = 2
MAX_REENTRIES = 8
FAIL_OPEN, FAIL_CLOSED = "fail_open", "fail_closed"
VERIFIED, UNKNOWN, FAILED, UNVERIFIED = "verified", "unknown", "failed", "unverified"
WORKING, VERIFYING, REFUTING, DONE = "working", "verifying", "refuting", "done"
HANDBACKS = ("blocked", "need_input")

NUDGE_NOTE = (
    "You ended the turn while still in progress and did nothing. Continue the work. Report done when it is "
    "finished and checked, or blocked / need_input with the reason if only the user can unblock it."
)
"""The pre-check's continue note (the reference's gist of ``pre_gate_unfinished_handback``)."""


class GateProtocolError(RuntimeError):
    """The shell fed an event the current state does not accept (a bug in the shell, not in the agent)."""


@dataclass(frozen=True, slots=True)
class GatePolicy:
    """Validated gate settings. Raises ValueError for a budget outside 0..:data:`MAX_REENTRIES` or an unknown
    policy."""

    reentry_budget: int = DEFAULT_REENTRIES
    failure_policy: str = FAIL_CLOSED
    headless: bool = False

    def __post_init__(self) -> None:
        if not 0 <= self.reentry_budget <= MAX_REENTRIES:
            raise ValueError(f"reentry_budget must be 0..{MAX_REENTRIES}, got {self.reentry_budget}")
        if self.failure_policy not in (FAIL_OPEN, FAIL_CLOSED):
            raise ValueError(f"failure_policy must be {FAIL_OPEN} or {FAIL_CLOSED}, got {self.failure_policy!r}")


# Events (fed by the shell).
@dataclass(frozen=True, slots=True)
class Stop:
    """A response without tool calls ended the turn. ``state``: its self-report state (None when absent);
    ``evidence``: the turn's evidence so far."""

    state: str | None
    evidence: Evidence


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
    """Continue the turn upstream with ``advisory``; its next stop is fed as a new :class:`Stop`."""

    gaps: tuple[Gap, ...]
    advisory: str


@dataclass(frozen=True, slots=True)
class Deliver:
    """Deliver the latest answer to the agent. ``passed`` is False when the gate did not accept it; ``notice`` is
    the label text the shell records (and attaches) when not passed; ``gaps`` are the standing gaps, if any."""

    outcome: str
    passed: bool
    reason: str
    gaps: tuple[Gap, ...] = ()
    notice: str | None = None


Decision = Nudge | Verify | Refute | Reenter | Deliver


def advisory(gaps: tuple[Gap, ...]) -> str:
    """The re-entry advisory listing ``gaps`` (the reference's gist)."""
    listed = "\n".join(f"{n}. {g.text} (would be settled by: {g.settles})" for n, g in enumerate(gaps, 1))
    return ("A verifier found gaps between your answer and the request:\n" + listed + "\nClose each gap with an "
            "artifact, an observed state or a check, or cite the evidence that it is already satisfied. Then report "
            "your status again, and write your reply as the complete, standalone answer.")


@dataclass
class TurnGate:
    """The gate of one turn. Feed events with :meth:`handle`; each returns the decision to perform."""

    policy: GatePolicy = field(default_factory=GatePolicy)
    state: str = WORKING
    nudges: int = 0
    reentries: int = 0
    format_retried: bool = False
    handback: bool = False
    evidence: Evidence = field(default_factory=lambda: Evidence(False, False, 0))
    previous_gaps: tuple[Gap, ...] = ()
    previous_seq: int | None = None
    outcome: Deliver | None = None

    def handle(self, event: Event) -> Decision:
        """The decision for ``event``. Raises :class:`GateProtocolError` if the state does not accept it."""
        handler = TABLE.get(self.state, {}).get(type(event))
        if handler is None:
            raise GateProtocolError(f"{type(event).__name__} in state {self.state}")
        decision = handler(self, event)
        if isinstance(decision, Deliver):
            self.state, self.outcome = DONE, decision
        return decision

    def _stop(self, event: Stop) -> Decision:
        self.evidence = event.evidence
        if self.policy.headless and event.state in ("exploring", "progressing") and self.nudges < NUDGE_BUDGET:
            self.nudges += 1
            return Nudge()
        self.handback = event.state in HANDBACKS
        self.state = VERIFYING
        return Verify(self.handback, previous_gaps=self.previous_gaps)

    def _answered(self, event: Answered) -> Decision:
        if event.verdict.outcome == GAPS:
            self.state = REFUTING
            return Refute(event.verdict.gaps)
        return self._passed()

    def _passed(self) -> Deliver:
        if self.handback:
            return Deliver(UNKNOWN, True, "hand-back accepted: the remaining work needs the user")
        if self.evidence.changed and self.evidence.checked:
            return Deliver(VERIFIED, True, "completion verified: state changed and a check ran")
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
                       notice="proxyvisor could not verify this answer; it is delivered unverified.")

    def _refuted(self, event: Refuted) -> Decision:
        kept = event.kept
        if not kept:
            return self._passed()
        moved = self.previous_seq is not None and self.evidence.seq != self.previous_seq
        notice = "verification gaps remain: " + "; ".join(g.text for g in kept)
        if moved and same_gaps(self.previous_gaps, kept):
            return Deliver(FAILED, False, "the same gaps returned after new evidence", kept, notice=notice)
        if self.reentries >= self.policy.reentry_budget:
            return Deliver(UNVERIFIED, False, "verification gaps remain: re-entry budget spent", kept, notice=notice)
        self.reentries += 1
        self.previous_gaps, self.previous_seq = kept, self.evidence.seq
        self.state = WORKING
        return Reenter(kept, advisory(kept))


TABLE = {
    WORKING: {Stop: TurnGate._stop},
    VERIFYING: {Answered: TurnGate._answered, Malformed: TurnGate._malformed, Unavailable: TurnGate._unavailable},
    REFUTING: {Refuted: TurnGate._refuted},
    DONE: {},
}
"""State -> event type -> handler: the only place transitions are decided."""


def answer_event(parsed: Verdict | Malformed) -> Answered | Malformed:
    """The event for a parsed verifier answer (:func:`~.verdict.parse`'s result)."""
    return Answered(parsed) if isinstance(parsed, Verdict) else parsed
