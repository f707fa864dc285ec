"""Delegation: run one role's child on its resolved runtime, under the breaker, clocks and limits (seeds 000-004).

:meth:`Delegator.delegate` is the trio shell that puts the sans-IO parts together, in this order:

1. :func:`~proxyvisor.adapters.routing.is_supervised` (the one predicate): not supervised -> ``unsupervised``,
   nothing touched;
2. the supervision graph: the caller may delegate to the role only along a configured edge;
3. route resolution and validation against the descriptors (an invalid target is an explicit ``invalid``);
4. ``suggest`` mode stops here and returns the route (``skipped``), with no child, token or state write;
5. the fan-out budget and the parallel cap (refused loudly, never queued);
6. for each candidate (the route, then the policy's fallbacks): readiness, then the pool's breaker; a refused
   pool is skipped, and when every candidate is refused the caller learns the soonest recovery and who waits;
7. the child runs under its clocks; its pool is settled whatever happens (a crash or a cancel releases a probe
   lease at once); a failure moves on to the next candidate only when its outcome is ``known_failed`` and the
   child accepted no work: never after an unknown outcome;
8. an attempt (steps 6-7) that ended in a transient failure before any output is made again after a backoff,
   inside the wall clock, up to ``[model_routing.children] attempts`` (:mod:`.retry`), each run in the evidence's
   ``attempts``; when none is left the hand-off becomes a dead letter (:mod:`.dead_letters`) that the shaped
   error names;
9. the result is claim-checked and shaped, with its evidence attributes.

Nothing here is created or written until a supervised delegation needs it, so ``enabled = false`` costs nothing.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import secrets
import sqlite3
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import diskcache
import msgspec
import trio

from ..config import ChildrenConfig, Config, RouteTarget
from .children import (Budget, BudgetExhausted, ChildHandle, ChildOutcome, ParallelGate, ParallelLimitReached,
                       run_child)
from .dead_letters import DeadLetterStore
from .descriptors import STRUCTURED_OUTPUT, DescriptorError, Registry, TargetError, registry_for
from .failures import CAPACITY, INVALID, KNOWN_FAILED, UNAVAILABLE, Failure
from .graph import ROOT, may_delegate
from .health import Admission, fleet_wait
from .health_store import routing_health
from .state import DiskBackend, StateBackend, backend_of
from .results import ClaimStore, ToolResult, child_traceparent, claim_check, evidence, shape, trace_id_of
from .retry import RetryPolicy, next_start
from .routing import NO_TARGET, Route, is_supervised, plan
from .runtime import ChildJob, Runtime, progress_log

log = logging.getLogger("proxyvisor.adapters.delegate")

OK, FAILED, REFUSED, INVALID_STATUS, SKIPPED, UNSUPERVISED = (
    "ok", "failed", "refused", "invalid", "skipped", "unsupervised")


@dataclass(frozen=True)
class Delegation:
    """The answer to one delegation.

    ``status``: ``ok`` (the child answered, possibly truncated or stopped: see ``result``), ``failed`` (the child
    failed), ``refused`` (capacity, parallel cap or budget; nothing ran), ``invalid`` (the request or policy
    cannot be satisfied), ``skipped`` (``suggest`` mode: ``proposed_route`` holds the route), ``unsupervised``
    (the policy does not apply: run on the session default). ``record_id``: the claim check of a long result.
    """

    status: str
    result: ToolResult
    evidence: dict[str, Any]
    proposed_route: dict[str, Any] | None = None
    record_id: str | None = None
    dead_letter: str | None = None
    """The id of the dead letter a hand-off that failed transiently on every attempt became
    (:mod:`.dead_letters`)."""
    reason: str = ""
    """Why nothing ran (``refused``, ``invalid``), in words for a person; empty otherwise."""

    def as_dict(self) -> dict[str, Any]:
        return {"status": self.status, "result": self.result.content, "is_error": self.result.is_error,
                "evidence": self.evidence, "proposed_route": self.proposed_route, "record_id": self.record_id,
                "dead_letter": self.dead_letter}


class Delegator:
    """Runs delegations for one process. ``runtimes`` replaces the runtime of an adapter id (tests);
    ``clocks`` the configured child clocks; ``now`` the wall clock (Unix seconds) used for health deadlines.
    ``backend`` holds pool health and claim checks (by default a diskcache in ``state_dir`` when it is given, else
    the one ``[state]`` names); dead letters stay in the state directory."""

    def __init__(self, config: Config, *, registry: Registry | None = None,
                 runtimes: Mapping[str, Runtime] | None = None, clocks: ChildrenConfig | None = None,
                 state_dir: Path | None = None, now: Callable[[], float] = time.time,
                 backend: StateBackend | None = None) -> None:
        self.routing = config.model_routing
        self.registry = registry if registry is not None else registry_for(self.routing.adapters_dir)
        self.clocks = clocks or self.routing.children
        root = Path(state_dir) if state_dir is not None else config.state_dir()
        if backend is None:
            backend = DiskBackend(root) if state_dir is not None else backend_of(config)
        self.health = routing_health(backend, self.routing.cooldown)
        self.claims = ClaimStore(backend.kv(ClaimStore.NAMESPACE), self.routing.children.claim_retention_s)
        self.dead_letters = DeadLetterStore(root / "dead_letters", self.clocks.dead_letter_retention_s,
                                            self.clocks.dead_letters_kept)
        self.gate = ParallelGate(self.routing.max_parallel)
        self.now = now
        self._runtimes: dict[str, Runtime] = dict(runtimes or {})
        self._readiness: dict[str, str | None] = {}

    def runtime(self, adapter: str) -> Runtime:
        """The adapter's runtime, built once from its descriptor and options.

        Raises:
            TargetError: unknown adapter or no dispatch capability. DescriptorError: entrypoint not loadable.
        """
        if adapter not in self._runtimes:
            descriptor = self.registry.get(adapter)
            self._runtimes[adapter] = descriptor.load_runtime(self.routing.adapter_options.get(adapter, {}))
        return self._runtimes[adapter]

    def readiness(self, adapter: str) -> str | None:
        """None when the adapter can run now, else why not; cached for the life of the delegator."""
        if adapter not in self._readiness:
            try:
                self._readiness[adapter] = self.runtime(adapter).readiness()
            except (TargetError, DescriptorError) as exc:
                self._readiness[adapter] = str(exc)
        return self._readiness[adapter]

    def close(self) -> None:
        self.health.close()
        self.claims.close()
        self.dead_letters.close()

    def _refuse(self, status: str, role: str, message: str, category: str, route: Route | None = None,
                traceparent: str = "", retry_after_s: int | None = None,
                admission: Admission | None = None) -> Delegation:
        return Delegation(status, ToolResult(f"Tool '{role}' failed: {message}", is_error=True), evidence(
            role, route.adapter if route else "", route.model if route else "", route.pool if route else "",
            admission, None, traceparent, error_category=category, retry_after_s=retry_after_s), reason=message)

    async def delegate(self, role: str, prompt: str, *, caller: str = ROOT, complexity: str | None = None,
                       override: RouteTarget = NO_TARGET, preset: RouteTarget = NO_TARGET,
                       role_default: RouteTarget = NO_TARGET, history: RouteTarget = NO_TARGET,
                       traceparent: str | None = None, budget: Budget | None = None,
                       handle: ChildHandle | None = None, output_schema: dict[str, Any] | None = None,
                       cwd: str | None = None) -> Delegation:
        """Delegate ``prompt`` to ``role`` (module docstring). ``caller``: the delegating role (:data:`ROOT` for
        the conversation's agent). ``traceparent``: the parent's W3C trace context (the child joins its trace).
        ``budget``: the fan-out's shared budget (default: a fresh one of ``budget_tokens``). ``handle``: lets the
        parent cancel the child.

        Never raises for a child's or the policy's failure (see :class:`Delegation`).

        Raises:
            ValueError: ``complexity`` is not a known rank.
            trio.Cancelled: the caller's scope was cancelled (the child was stopped and its pool settled first).
        """
        if not is_supervised(self.routing, complexity):
            return Delegation(UNSUPERVISED, ToolResult("the routing policy does not apply to this request"), {})
        trace = child_traceparent(traceparent)
        edges = {r.name: r.supervises for r in self.routing.roles}
        if role not in edges:
            return self._refuse(INVALID_STATUS, role, f"invalid: role {role!r} is not configured (configured: "
                                f"{', '.join(edges) or 'none'})", INVALID, traceparent=trace)
        if not may_delegate(edges, caller, role):
            who = "the conversation's agent" if caller == ROOT else f"role {caller!r}"
            return self._refuse(INVALID_STATUS, role, f"invalid: {who} may not delegate to {role!r} (no such edge "
                                "in the supervision graph)", INVALID, traceparent=trace)
        try:
            route_plan = plan(self.routing, self.registry, role, ready=lambda a: self.readiness(a) is None,
                              override=override, preset=preset, role_default=role_default, history=history)
            if output_schema is not None:
                self.registry.get(route_plan.route.adapter).require(STRUCTURED_OUTPUT, "a structured answer was asked")
        except TargetError as exc:
            return self._refuse(INVALID_STATUS, role, f"invalid: {exc}", INVALID, traceparent=trace)
        route = route_plan.route
        if self.routing.mode == "suggest":
            proposal = route_plan.proposal()
            return Delegation(SKIPPED, ToolResult({"status": SKIPPED, "proposed_route": proposal}), evidence(
                role, route.adapter, route.model, route.pool, None, None, trace), proposed_route=proposal)
        budget = budget if budget is not None else Budget(self.routing.children.budget_tokens)
        try:
            budget.check()
            with self.gate.slot():
                return await self._dispatch(role, prompt, route_plan.candidates, trace, budget, handle,
                                            output_schema, cwd)
        except (ParallelLimitReached, BudgetExhausted) as exc:
            return self._refuse(REFUSED, role, str(exc), UNAVAILABLE, route, trace)

    async def _dispatch(self, role: str, prompt: str, candidates: tuple[Route, ...], trace: str, budget: Budget,
                        handle: ChildHandle | None, output_schema: dict[str, Any] | None,
                        cwd: str | None) -> Delegation:
        policy = RetryPolicy(self.clocks.attempts, self.clocks.retry_backoff_s)
        deadline = trio.current_time() + self.clocks.wall_clock_s
        attempts: list[dict[str, Any]] = []
        failed: tuple[Route, Admission, ChildOutcome] | None = None
        attempt = 0
        while True:
            attempt += 1
            refusals: list[Admission] = []
            unready: list[str] = []
            last: tuple[Route, Admission, ChildOutcome] | None = None
            waits: dict[str, float] = {}  # per pool, when the Retry-After of its failure ends (trio clock)
            for route in candidates:
                reason = self.readiness(route.adapter)
                if reason is not None:
                    unready.append(f"{route.adapter}: {reason}")
                    continue
                # A retry gets what is left of the hand-off's wall clock; the first attempt's candidates a whole one.
                wall_s = self.clocks.wall_clock_s if attempt == 1 else deadline - trio.current_time()
                if wall_s <= 0:
                    break
                admission = await self.health.admit(route.pool, self.now(), wall_s + self.clocks.stop_grace_s)
                if not admission.admitted:
                    refusals.append(admission)
                    attempts.append(_attempt(attempt, route, admission, None))
                    continue
                job = ChildJob("child_" + secrets.token_hex(6), role, prompt, route.adapter, route.model,
                               route.effort, trace, wall_s, self.clocks.stop_grace_s, output_schema, cwd)
                outcome = await self._run(route, admission, job, handle,
                                          msgspec.structs.replace(self.clocks, wall_clock_s=wall_s))
                budget.spend(outcome.input_tokens + outcome.output_tokens)
                attempts.append(_attempt(attempt, route, admission, outcome))
                last = (route, admission, outcome)
                failure = outcome.failure
                if failure is not None and failure.retry_after_s:
                    waits[route.pool] = trio.current_time() + failure.retry_after_s
                if outcome.finish_reason is None and failure is not None and failure.outcome == KNOWN_FAILED \
                        and not outcome.accepted_work:
                    continue
                break
            if last is not None and not last[2].retryable:
                return self._result(role, trace, *last, attempts)
            if last is None and failed is None:
                return self._refused(role, candidates, trace, refusals, unready)
            failed = last or failed
            assert failed is not None  # one of the two was set above
            now = trio.current_time()
            ready = [max(now + await self._recovery_in(route), waits.get(route.pool, now)) for route in candidates
                     if self.readiness(route.adapter) is None]
            start = next_start(policy, attempt, now, deadline, ready)
            gave_up = start.reason
            if start.at is not None:
                try:
                    budget.check()
                except BudgetExhausted as exc:
                    gave_up = str(exc)
            if gave_up:
                return self._dead_letter(role, prompt, trace, failed, attempts, gave_up)
            assert start.at is not None
            progress_log.warning("%s failed (%s): attempt %d of %d in %.1f s", role, _why(failed[2]), attempt + 1,
                                 policy.attempts, start.at - now)
            with trio.CancelScope() as waiting:
                if handle is not None:
                    handle._attach(waiting)
                await trio.sleep_until(start.at)
            if waiting.cancelled_caught:  # the parent cancelled the hand-off between two attempts
                return self._result(role, trace, *failed, attempts)

    async def _recovery_in(self, route: Route) -> float:
        """Seconds until ``route``'s pool may admit a caller (0: at once)."""
        now = self.now()
        at = await self.health.recovery_at(route.pool, now)
        return 0.0 if at is None else max(0.0, at - now)

    def _refused(self, role: str, candidates: tuple[Route, ...], trace: str, refusals: list[Admission],
                 unready: list[str]) -> Delegation:
        """Nothing could run: every ready candidate's pool refused (the soonest recovery and who waits), or no
        candidate runtime is ready."""
        if refusals:
            wait = fleet_wait(refusals)
            now = self.now()
            return self._refuse(REFUSED, role, wait.message(now), CAPACITY, candidates[0], trace,
                                retry_after_s=max(1, math.ceil(wait.soonest_at - now)),
                                admission=next(a for a in refusals if a.pool == wait.soonest_pool))
        return self._refuse(FAILED, role, "unavailable: no candidate runtime is ready (" + "; ".join(unready) + ")",
                            UNAVAILABLE, candidates[0], trace)

    def _dead_letter(self, role: str, prompt: str, trace: str, failed: tuple[Route, Admission, ChildOutcome],
                     attempts: list[dict[str, Any]], reason: str) -> Delegation:
        """The hand-off's last transient failure, kept as a dead letter (:mod:`.dead_letters`) that the shaped
        error names; a store that cannot be written is logged and said in the error, the result is given all the
        same."""
        route, admission, outcome = failed
        result = self._result(role, trace, route, admission, outcome, attempts)
        failure = outcome.failure
        record = {"reason": reason, "trace_id": trace_id_of(trace), "attempts": attempts,
                  "route": {"adapter": route.adapter, "model": route.model, "effort": route.effort,
                            "capacity_scope": route.pool},
                  "failure": {"category": failure.category if failure else None,
                              "message": failure.message if failure else "",
                              "retry_after_s": failure.retry_after_s if failure else None}}
        try:
            letter: str | None = self.dead_letters.put(role, prompt, record)
            kept = f"; dead letter {letter} (`proxyvisor delegate --dead-letters` lists it)"
        except (OSError, sqlite3.Error, diskcache.Timeout) as exc:
            log.warning("the dead letter of %s could not be stored under %s: %s", role, self.dead_letters.root, exc)
            letter, kept = None, f"; the dead letter could not be stored ({type(exc).__name__})"
        progress_log.warning("%s gave up: %s%s", role, reason, kept)
        text = f"{result.result.as_text()}; gave up: {reason}{kept}"
        return dataclasses.replace(result, result=ToolResult(text, is_error=True), dead_letter=letter,
                                   evidence={**result.evidence, "dead_letter": letter})

    async def _run(self, route: Route, admission: Admission, job: ChildJob, handle: ChildHandle | None,
                   clocks: ChildrenConfig) -> ChildOutcome:
        """Run one child under ``clocks`` and settle its pool in every case (shielded, so a cancel still releases
        a lease); a cancelled child records nothing on the pool but the release of its lease."""
        outcome: ChildOutcome | None = None
        try:
            try:
                runtime = self.runtime(route.adapter)
            except (TargetError, DescriptorError) as exc:
                outcome = ChildOutcome("", None, Failure(INVALID, False, KNOWN_FAILED, None, str(exc)))
                return outcome
            outcome = await run_child(runtime, job, clocks, handle)
            return outcome
        finally:
            with trio.CancelScope(shield=True):
                # No outcome: the caller's scope was cancelled (a user's signal, a client gone), like a parent's
                # cancel no failure of the pool; only a probe lease it held is given back.
                if outcome is None or outcome.cancelled:
                    await self.health.release(route.pool, self.now(), admission.lease_id)
                else:
                    await self.health.settle(route.pool, self.now(), outcome.failure, admission.lease_id)

    def _result(self, role: str, trace: str, route: Route, admission: Admission, outcome: ChildOutcome,
                attempts: list[dict[str, Any]]) -> Delegation:
        record_id = None
        text = outcome.text
        if outcome.finish_reason is not None:
            meta = {"role": role, "adapter": route.adapter, "model": outcome.model or route.model,
                    "trace_id": trace_id_of(trace)}
            text, record_id = claim_check(text, self.routing.children.claim_check_chars, self.claims, meta)
        result = shape(role, outcome, text)
        status = FAILED if result.is_error else OK
        return Delegation(status, result, {**evidence(role, route.adapter, route.model, route.pool, admission, outcome,
                                                      trace), "attempts": attempts, "dead_letter": None},
                          record_id=record_id)


def _attempt(number: int, route: Route, admission: Admission, outcome: ChildOutcome | None) -> dict[str, Any]:
    """The evidence of one child run of a hand-off (``outcome`` None: its pool refused it, nothing ran)."""
    failure = outcome.failure if outcome else None
    out: dict[str, Any] = {"attempt": number, "gen_ai.provider.name": route.adapter,
                           "gen_ai.request.model": (outcome.model if outcome and outcome.model else route.model),
                           "capacity_scope": route.pool, "health_state": admission.state,
                           "health_probe": admission.probe}
    if outcome is None:
        return {**out, "outcome": "refused"}
    out.update(outcome="failed" if outcome.finish_reason is None else "answered",
               finish_reason=outcome.finish_reason, duration_s=round(outcome.duration_s, 3))
    if failure is not None:
        out.update(error_category=failure.category, retry_after_s=failure.retry_after_s)
    return out


def _why(outcome: ChildOutcome) -> str:
    failure = outcome.failure
    return f"{failure.category}: {failure.message}" if failure else "no result"
