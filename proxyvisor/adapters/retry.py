"""When a delegation hand-off that failed transiently is run again, and when it becomes a dead letter.

Sans-IO, time passed in (any one clock, seconds). A hand-off is run in attempts: each attempt tries the route and
its pre-execution fallbacks in order, as the routing policy has them, each under its pool's breaker. An attempt is
run again only when it ended in a failure that is :attr:`~proxyvisor.adapters.failures.Failure.transient` (a 429
that is no quota, a 529 or other 5xx, a refused connection) before the child produced any output or accepted any
work; anything else (a result, a stopped child, an unknown outcome, a non-transient failure) is final. A retry
waits:

- the backoff: ``backoff_s`` before the second attempt, doubling per retry;
- never less than the provider's ``Retry-After`` nor than the breaker's cooldown: the next attempt starts once the
  soonest of the candidate pools may be tried again (``ready_at``, which the shell reads from the pools' health
  and the Retry-After each failure carried), so a cooling pool is waited for or its fallback taken, never
  hammered;
- inside the wall clock: an attempt that could only start at or after ``deadline`` is not made.

When no retry is left, :func:`next_start` says why in words for a person: the hand-off becomes a dead letter.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class RetryPolicy:
    """``attempts``: the runs of one hand-off, the first included (1: no retry); ``backoff_s``: the wait before
    the second, doubling per retry (seconds)."""

    attempts: int = 3
    backoff_s: float = 1.0

    def backoff(self, attempt: int) -> float:
        """Seconds to wait after the ``attempt``-th attempt (1-based) failed, before the next."""
        return self.backoff_s * 2.0 ** max(0, attempt - 1)


@dataclass(frozen=True)
class NextStart:
    """The answer of :func:`next_start`: ``at`` (the clock's time to start the next attempt) or None, with
    ``reason`` (why not, for a person) when the hand-off is over."""

    at: float | None
    reason: str = ""


def next_start(policy: RetryPolicy, attempt: int, now: float, deadline: float,
               ready_at: Iterable[float]) -> NextStart:
    """When to start the attempt after the ``attempt``-th failed transiently (module docstring).

    ``ready_at``: for each candidate pool, the earliest time it may be tried again (its cooldown's or a probe
    lease's end, and its last failure's Retry-After; ``now`` or earlier when at once). ``deadline``: the end of
    the hand-off's wall clock. An empty ``ready_at`` (no candidate can run) ends the hand-off.
    """
    if attempt >= policy.attempts:
        return NextStart(None, f"{attempt} attempt{'s' if attempt != 1 else ''} failed"
                               + (" (no retry configured)" if policy.attempts == 1 else ""))
    soonest = min(ready_at, default=None)
    if soonest is None:
        return NextStart(None, "no candidate runtime is left to retry on")
    at = max(now + policy.backoff(attempt), soonest)
    if at >= deadline:
        return NextStart(None, f"{attempt} attempt{'s' if attempt != 1 else ''} failed and the next could only "
                               f"start {at - now:.0f} s from now, past the wall clock")
    return NextStart(at)
