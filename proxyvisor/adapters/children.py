"""Child runs: three clocks, a staged stop, a parallel cap and one budget per fan-out (seed 002).

- **Wall clock**: every child has a deadline (``wall_clock_s``; 30 to 3,600 s in the config).
- **Heartbeat**: every event a runtime reports counts. ``idle_warn_s`` without one logs the child as idle;
  ``idle_cancel_s`` without one cancels it.
- **The parent**: :meth:`ChildHandle.cancel` stops the child (idempotent); cancelling the caller's own scope
  stops it too.

A stop is soft first: the child's cancel scope is cancelled, so an in-process runtime stops at its next
checkpoint and a subprocess gets SIGTERM, then SIGKILL after ``stop_grace_s`` (:mod:`.process`). What the child
reported before the stop (its text so far) comes back with the stop as its finish reason.

:class:`ChildClock` is the sans-IO part (time passed in); :func:`run_child` is the trio shell around it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import trio

from ..config import ChildrenConfig
from .failures import TIMEOUT, UNAVAILABLE, UNKNOWN, Failure, unclassified
from .runtime import ChildJob, ChildProgress, Runtime, progress_log

log = logging.getLogger("proxyvisor.adapters.children")

WALL_CLOCK, IDLE, CANCELLED, IDLE_WARNING = "timeout", "idle_timeout", "cancelled", "idle_warning"
"""Why the kernel stopped a child; the first three become the child's finish reason."""


class ChildClock:
    """The wall clock and heartbeat of one child, fed the current time (any monotonic clock, seconds)."""

    def __init__(self, clocks: ChildrenConfig, started: float) -> None:
        self.clocks = clocks
        self.wall_deadline = started + clocks.wall_clock_s
        self.last_event = started
        self.warned = False
        self.idle_warnings = 0

    def beat(self, now: float) -> None:
        self.last_event = now
        self.warned = False

    def next_deadline(self) -> float:
        """When :meth:`check` may next have something to say."""
        idle = self.clocks.idle_cancel_s if self.warned else self.clocks.idle_warn_s
        return min(self.wall_deadline, self.last_event + idle)

    def check(self, now: float) -> str | None:
        """:data:`WALL_CLOCK` or :data:`IDLE` when the child must stop, :data:`IDLE_WARNING` once per quiet
        spell, else None."""
        if now >= self.wall_deadline:
            return WALL_CLOCK
        if now >= self.last_event + self.clocks.idle_cancel_s:
            return IDLE
        if not self.warned and now >= self.last_event + self.clocks.idle_warn_s:
            self.warned = True
            self.idle_warnings += 1
            return IDLE_WARNING
        return None


class ChildHandle:
    """Lets the parent cancel one child (idempotent; before the child starts, it never starts running)."""

    def __init__(self) -> None:
        self.cancelled = False
        self._scope: trio.CancelScope | None = None

    def cancel(self) -> None:
        self.cancelled = True
        if self._scope is not None:
            self._scope.cancel()

    def _attach(self, scope: trio.CancelScope) -> None:
        self._scope = scope
        if self.cancelled:
            scope.cancel()


@dataclass(frozen=True)
class ChildOutcome:
    """How a child ended. ``finish_reason``: ``stop`` (complete), the runtime's other reasons (``length``...),
    or a kernel stop (``timeout``, ``idle_timeout``, ``cancelled``); None when it failed. ``failure`` is the
    normalised failure (a kernel timeout is ``timeout`` with an unknown outcome)."""

    text: str
    finish_reason: str | None
    failure: Failure | None
    model: str = ""
    native_id: str = ""
    input_tokens: int = 0
    output_tokens: int = 0
    accepted_work: bool = False
    events: int = 0
    idle_warnings: int = 0
    duration_s: float = 0.0

    @property
    def retryable(self) -> bool:
        """Failed transiently (:attr:`~proxyvisor.adapters.failures.Failure.transient`) before producing anything:
        no text, no work accepted, so the hand-off may be run again."""
        return self.finish_reason is None and self.failure is not None and self.failure.transient \
            and not self.text and not self.accepted_work

    @property
    def cancelled(self) -> bool:
        """The parent cancelled the child before it failed: the outcome says nothing about the pool."""
        return self.finish_reason == CANCELLED and self.failure is None


async def _watch(clock: ChildClock, scope: trio.CancelScope, job: ChildJob, stopped: list[str]) -> None:
    while True:
        await trio.sleep_until(clock.next_deadline())
        action = clock.check(trio.current_time())
        if action == IDLE_WARNING:
            progress_log.warning("%s idle: no output for %g s (stopped after %g s without any)", job.role,
                                 clock.clocks.idle_warn_s, clock.clocks.idle_cancel_s)
        elif action is not None:
            why = (f"no output for {clock.clocks.idle_cancel_s:g} s" if action == IDLE
                   else f"past its wall clock of {clock.clocks.wall_clock_s:g} s")
            progress_log.warning("%s stopped: %s", job.role, why)
            stopped.append(action)
            scope.cancel()
            return


async def run_child(runtime: Runtime, job: ChildJob, clocks: ChildrenConfig,
                    handle: ChildHandle | None = None) -> ChildOutcome:
    """Run ``job`` on ``runtime`` under ``clocks``; returns its outcome (never raises for a child's failure).

    A runtime that raises is a crash, reported as an ``unavailable`` failure with an unknown outcome; one that
    returns neither an answer nor a failure is logged at warning level naming the adapter and reported as an
    unclassified failure, so a runtime that skipped the contract is visible, not silently unprotected.

    Raises:
        trio.Cancelled: the caller's own scope was cancelled (the child was stopped first).
    """
    started = trio.current_time()
    clock = ChildClock(clocks, started)
    progress = ChildProgress(on_event=lambda: clock.beat(trio.current_time()))
    stopped: list[str] = []
    crash: Exception | None = None
    handle = handle or ChildHandle()
    progress_log.info("%s started on %s%s", job.role, job.adapter, f" (model {job.model})" if job.model else "")
    log.debug("child %s of %s started, trace %s", job.job_id, job.role, job.traceparent)
    with trio.CancelScope() as scope:
        handle._attach(scope)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_watch, clock, scope, job, stopped)
            try:
                await runtime.run(job, progress)
            except Exception as exc:  # noqa: BLE001 - a crashing adapter must still settle its pool and answer
                crash = exc
            nursery.cancel_scope.cancel()
    stop = stopped[0] if stopped else (CANCELLED if handle.cancelled else None)
    failure, reason = progress.failure, progress.finish_reason
    if crash is not None:
        log.warning("adapter %s raised %s instead of returning a result", job.adapter, type(crash).__name__,
                    exc_info=crash)
        failure, reason = Failure(UNAVAILABLE, False, UNKNOWN, None,
                                  f"adapter {job.adapter} raised {type(crash).__name__}: {crash}"), None
    elif failure is None and reason is None and stop is not None:
        reason = stop
        if stop != CANCELLED:
            failure = Failure(TIMEOUT, True, UNKNOWN, None, f"stopped by the kernel: {stop}")
    elif failure is None and reason is None:
        log.warning("adapter %s returned neither an answer nor a classified failure", job.adapter)
        failure = unclassified(f"adapter {job.adapter} returned no result")
    if failure is not None and stop is None:
        reason = None
    return ChildOutcome(progress.text, reason, failure, progress.model or job.model, progress.native_id,
                        progress.input_tokens, progress.output_tokens, progress.accepted_work, progress.events,
                        clock.idle_warnings, trio.current_time() - started)


class ParallelLimitReached(RuntimeError):
    """``max_parallel`` children are already running: refused at once, never queued (seed 002)."""


class ParallelGate:
    """At most ``max_parallel`` live children in this process; one more is refused loudly."""

    def __init__(self, max_parallel: int) -> None:
        self.max_parallel = max_parallel
        self._limiter = trio.CapacityLimiter(max_parallel)

    @property
    def live(self) -> int:
        return self._limiter.borrowed_tokens

    @contextmanager
    def slot(self) -> Iterator[None]:
        """Hold one slot for the block.

        Raises:
            ParallelLimitReached: every slot is taken; the message tells the model not to retry at once.
        """
        token = object()
        try:
            self._limiter.acquire_on_behalf_of_nowait(token)
        except trio.WouldBlock:
            raise ParallelLimitReached(
                f"refused: {self.max_parallel} child runs are already live (max_parallel = {self.max_parallel}); "
                "wait for one to finish instead of retrying at once") from None
        try:
            yield
        finally:
            self._limiter.release_on_behalf_of(token)


class BudgetExhausted(RuntimeError):
    """The fan-out's token budget is spent: no further child starts."""


class Budget:
    """One token budget (input + output) for a whole fan-out; ``tokens`` 0 = unlimited.

    A child that started within the budget runs to its end; what it spent counts, and the next child is refused.
    """

    def __init__(self, tokens: int = 0) -> None:
        self.limit = tokens
        self.spent = 0

    def check(self) -> None:
        """Raises :class:`BudgetExhausted` when nothing is left."""
        if self.limit and self.spent >= self.limit:
            raise BudgetExhausted(f"refused: the fan-out's token budget is spent ({self.spent} of {self.limit})")

    def spend(self, tokens: int) -> None:
        self.spent += max(0, tokens)
