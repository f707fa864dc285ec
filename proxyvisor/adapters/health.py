"""Health of one model pool: the breaker ``healthy -> cooling_down -> half_open -> healthy`` (seed 000).

A pure state machine over :class:`PoolHealth` values, in the manner of h11: :data:`TRANSITIONS` is the whole
table of which event moves which state where; :func:`admit` and :func:`settle` feed it events and the wall clock
(``now``, Unix seconds, passed in) and return the new value. No I/O, no clock, no lock: the shell
(:mod:`proxyvisor.adapters.health_store`) persists values and serialises access.

Events:

- ``capacity``: a failure that opens the breaker (:meth:`Cooldown.opens_on`: for children only a retryable
  capacity failure, 529/5xx being ``provider``; for the agent's own pools 5xx and connection failures too). The
  pool cools down for ``default_s * 2**(trips - 1)`` capped at ``maximum_s``, where the provider's
  ``retry_after_s`` replaces that (children) or is its floor (the agent's pools). A new failure extends the
  cooldown and never shortens it; entering ``cooling_down`` counts one more trip (``failure_count``), so a burst
  of parallel 429s is one trip, not eight.
- ``probe``: the cooldown is over (or an earlier probe's lease ran out unsettled) and one caller takes the
  half-open lease. The lease lasts the probe's own timeout; every other caller is refused meanwhile.
- ``probe_success``: the lease holder succeeded: healthy, ``failure_count`` reset.
- ``probe_other``: the lease holder failed for a non-capacity reason, or crashed: the lease is released at once
  and the pool is settled back to healthy *keeping* ``failure_count``, so an unrelated error cannot reset an
  escalating backoff.
- ``success``: an ordinary call succeeded while healthy: ``failure_count`` reset.
- ``release``: the lease holder was cancelled by its caller (a user's signal, a client that went away): a
  cancel says nothing about the pool, so only the lease is given back and the pool stays ``half_open`` for the
  next caller's probe. A cancelled call that held no lease records nothing (see :func:`release`).

An event with no entry in the table for the current state changes nothing: it is a stale result (a call
admitted before the breaker opened, or a probe whose lease was taken over).
"""

from __future__ import annotations

import dataclasses
import math
import uuid
from collections.abc import Iterable
from dataclasses import dataclass

from .failures import CAPACITY as CAPACITY_FAILURE
from .failures import Failure

HEALTHY, COOLING_DOWN, HALF_OPEN = "healthy", "cooling_down", "half_open"
STATES = (HEALTHY, COOLING_DOWN, HALF_OPEN)
CAPACITY, PROBE, PROBE_SUCCESS, PROBE_OTHER, SUCCESS = "capacity", "probe", "probe_success", "probe_other", "success"
RELEASE = "release"

TRANSITIONS: dict[tuple[str, str], str] = {
    (HEALTHY, CAPACITY): COOLING_DOWN,
    (HEALTHY, SUCCESS): HEALTHY,
    (COOLING_DOWN, CAPACITY): COOLING_DOWN,
    (COOLING_DOWN, PROBE): HALF_OPEN,
    (HALF_OPEN, PROBE): HALF_OPEN,
    (HALF_OPEN, CAPACITY): COOLING_DOWN,
    (HALF_OPEN, PROBE_SUCCESS): HEALTHY,
    (HALF_OPEN, PROBE_OTHER): HEALTHY,
    (HALF_OPEN, RELEASE): HALF_OPEN,
}
"""(state, event) -> next state. Nothing else decides a transition."""

_RANK = {HEALTHY: 0, HALF_OPEN: 1, COOLING_DOWN: 2}


@dataclass(frozen=True)
class Cooldown:
    """How a pool cools down: ``default_s`` and ``maximum_s`` (seconds; ``[model_routing.cooldown]`` for
    children), the failure categories that open the breaker (``opens``, retryable failures only), and whether the
    provider's wait replaces the escalating cooldown (``retry_after_floor`` False: seed 000's rule for children)
    or is its floor (True: the agent's own pools, whose default is short)."""

    default_s: float = 300.0
    maximum_s: float = 3600.0
    opens: frozenset[str] = frozenset({CAPACITY_FAILURE})
    retry_after_floor: bool = False

    def duration(self, trips: int, retry_after_s: int | None) -> float:
        """Seconds to cool down on the ``trips``-th trip: exponential from the default, capped at the maximum;
        the provider's ``retry_after_s``, when given, replaces that or is its floor (``retry_after_floor``)."""
        escalated = min(self.maximum_s, self.default_s * math.pow(2, max(0, trips - 1)))
        if retry_after_s and not self.retry_after_floor:
            return float(retry_after_s)
        return max(float(retry_after_s or 0), escalated)

    def opens_on(self, failure: Failure) -> bool:
        """Whether ``failure`` opens the breaker: a retryable failure of one of the ``opens`` categories."""
        return failure.retryable and failure.category in self.opens


@dataclass(frozen=True)
class PoolHealth:
    """The persisted state of one pool. Times are wall clock (Unix seconds), so they survive a restart.

    ``last_category``/``retry_after_s`` describe the last failure seen (normalised, never a provider payload).
    """

    pool: str
    state: str = HEALTHY
    failure_count: int = 0
    cooldown_until: float = 0.0
    lease_id: str = ""
    lease_until: float = 0.0
    last_category: str = ""
    retry_after_s: int | None = None
    updated_at: float = 0.0

    def effective_state(self, now: float) -> str:
        """``cooling_down`` until the deadline, then ``half_open`` (probe available or in flight)."""
        if self.state == COOLING_DOWN and now >= self.cooldown_until:
            return HALF_OPEN
        return self.state

    def recovery_at(self, now: float) -> float | None:
        """When a caller could next be admitted: the end of the cooldown, or of a probe's lease; None if now."""
        if self.state == COOLING_DOWN and now < self.cooldown_until:
            return self.cooldown_until
        if self.state == HALF_OPEN and now < self.lease_until:
            return self.lease_until
        return None


@dataclass(frozen=True)
class Admission:
    """The answer to "may this call go to the pool now?".

    ``state`` is the breaker state at dispatch (``healthy`` or ``half_open`` when admitted); ``probe`` says the
    call holds the half-open lease ``lease_id``. When refused, ``recovery_at`` is the earliest time to try again.
    ``failure_count``: the healthy pool's count when admitted (0: a success of this call has nothing to settle).
    """

    pool: str
    admitted: bool
    state: str
    probe: bool = False
    lease_id: str = ""
    recovery_at: float | None = None
    reason: str = ""
    failure_count: int = 0


def named(pool: str, name: str) -> bool:
    """Whether ``name`` names ``pool``: the pool itself, or a prefix of its name ending at a ``:`` (an adapter, for
    its ``<adapter>:<bucket>`` pools; ``upstream:NAME`` or ``upstream`` for the agent's ``upstream:NAME:MODEL``).
    An empty or blank ``name`` names no pool."""
    return bool(name.strip()) and (pool == name or pool.startswith(name + ":"))


def _step(health: PoolHealth, event: str) -> str | None:
    return TRANSITIONS.get((health.state, event))


def admit(health: PoolHealth, now: float, lease_s: float, lease_id: str | None = None) -> tuple[Admission, PoolHealth]:
    """Decide one call: healthy admits; a cooling pool refuses until its deadline; then exactly one caller gets
    the probe lease for ``lease_s`` seconds (its own timeout) and the rest are refused until it settles.

    Returns the admission and the new value to persist (unchanged unless a lease was granted).
    """
    if health.state == HEALTHY:
        return Admission(health.pool, True, HEALTHY, failure_count=health.failure_count), health
    recovery = health.recovery_at(now)
    if recovery is not None:
        waiting = "a recovery probe is in flight" if health.state == HALF_OPEN else "cooling down"
        return Admission(health.pool, False, health.effective_state(now), recovery_at=recovery,
                         reason=f"pool {health.pool} is {waiting} after a capacity limit"), health
    nxt = _step(health, PROBE)
    assert nxt == HALF_OPEN, health.state
    lease = lease_id or uuid.uuid4().hex
    new = dataclasses.replace(health, state=nxt, lease_id=lease, lease_until=now + lease_s, updated_at=now)
    return Admission(health.pool, True, HALF_OPEN, probe=True, lease_id=lease), new


def settle(health: PoolHealth, now: float, failure: Failure | None, cooldown: Cooldown,
           lease_id: str = "") -> PoolHealth:
    """Record the result of a call admitted by :func:`admit` (``lease_id``: its probe lease, if any).

    ``failure`` None is a success. A crash is settled as a non-capacity failure, so it releases the lease too.
    """
    holder = bool(lease_id) and lease_id == health.lease_id and health.state == HALF_OPEN
    if failure is not None and cooldown.opens_on(failure):
        event = CAPACITY
    elif holder:
        event = PROBE_OTHER if failure is not None else PROBE_SUCCESS
    else:
        event = SUCCESS if failure is None else ""
    nxt = _step(health, event)
    noted = health if failure is None else dataclasses.replace(
        health, last_category=failure.category, retry_after_s=failure.retry_after_s, updated_at=now)
    if nxt is None:
        return noted
    if event == CAPACITY and failure is not None:
        trips = health.failure_count + (0 if health.state == COOLING_DOWN else 1)
        until = max(health.cooldown_until, now + cooldown.duration(trips, failure.retry_after_s))
        return dataclasses.replace(noted, state=nxt, failure_count=trips, cooldown_until=until, lease_id="",
                                   lease_until=0.0)
    count = health.failure_count if event == PROBE_OTHER else 0
    return dataclasses.replace(noted, state=nxt, failure_count=count, lease_id="", lease_until=0.0, updated_at=now)


def release(health: PoolHealth, now: float, lease_id: str = "") -> PoolHealth:
    """Record a call admitted by :func:`admit` that its caller cancelled (``lease_id``: its probe lease, if any).

    A cancel is neither a success nor a failure of the pool: the value is returned unchanged, except that the
    lease holder gives its lease back (the pool stays ``half_open``, so the next caller may probe at once).
    """
    holder = bool(lease_id) and lease_id == health.lease_id and health.state == HALF_OPEN
    nxt = _step(health, RELEASE) if holder else None
    if nxt is None:
        return health
    return dataclasses.replace(health, state=nxt, lease_id="", lease_until=0.0, updated_at=now)


@dataclass(frozen=True)
class FleetWait:
    """Every eligible pool is refusing: the soonest recovery across all of them and who is waiting."""

    soonest_at: float
    soonest_pool: str
    waiting: tuple[tuple[str, str, float], ...]
    """(pool, effective state, recovery time) of each refusing pool, soonest first."""

    def message(self, now: float) -> str:
        parts = [f"{pool} ({state}, {max(0, round(at - now))} s)" for pool, state, at in self.waiting]
        return (f"every eligible pool is cooling down after capacity limits; soonest recovery in "
                f"{max(0, round(self.soonest_at - now))} s ({self.soonest_pool}); waiting: {', '.join(parts)}")


def fleet_wait(refusals: Iterable[Admission]) -> FleetWait:
    """Summarise refused admissions (all of them, never just the last one checked)."""
    waiting = sorted(((a.pool, a.state, a.recovery_at or 0.0) for a in refusals), key=lambda w: (w[2], w[0]))
    if not waiting:
        raise ValueError("fleet_wait needs at least one refusal")
    return FleetWait(waiting[0][2], waiting[0][0], tuple(waiting))


def adapter_summary(pools: Iterable[PoolHealth], now: float) -> tuple[str, float | None, list[str]]:
    """An adapter across its pools: the most restrictive state, the soonest recovery, the limited pools."""
    pools = list(pools)
    if not pools:
        return HEALTHY, None, []
    state = max((p.effective_state(now) for p in pools), key=_RANK.__getitem__)
    limited = [p.pool for p in pools if p.effective_state(now) != HEALTHY]
    times = [t for p in pools if (t := p.recovery_at(now)) is not None]
    return state, (min(times) if times else None), limited
