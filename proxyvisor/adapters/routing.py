"""Routing policy: whether a request is supervised, and which adapter, model and effort a role's child gets.

Pure functions over the typed ``[model_routing]`` config and the adapter :class:`Registry` (seed 000).

**One predicate.** :func:`is_supervised` is the only definition of "supervised": every call site (offering
delegation tools, running a child, checking capacity) asks it. ``enabled = false`` and ``adaptive`` below its
gate are the only paths that skip the policy and the breaker.

**Resolution order** (first level that sets a field wins, field by field):

1. explicit request override; 2. project role policy; 3. project orchestrator policy; 4. active preset hint;
5. role default; 6. empirical routing history; 7. adapter default.

The adapter is chosen first; a level's model and effort count only if that level names no adapter or the same
adapter, so a model is never borrowed from another runtime. The result is then checked against the adapter's
descriptor (:meth:`Descriptor.check`): an undeclared model or effort, or a missing capability, is a
:class:`TargetError`, never a quiet downgrade.

**Fallbacks** are decided before execution, per ``fallback_policy``: ``fail_closed`` none;
``same_adapter_default`` the adapter's default model; ``next_eligible`` also the targets of every other adapter
the policy names (orchestrator first, then roles in order) that is ready. Fallback never applies after an
unknown outcome or once a child accepted work (the delegation shell enforces that).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..config import ModelRoutingConfig, RouteTarget
from ..rules import COMPLEXITY
from .descriptors import DISPATCH, Registry, TargetError

NO_TARGET = RouteTarget()
"""A level that sets nothing."""

LEVELS = ("request override", "role policy", "orchestrator policy", "preset hint", "role default",
          "routing history", "adapter default")


def is_supervised(routing: ModelRoutingConfig, complexity: str | None = None) -> bool:
    """Whether the policy applies to a request of ``complexity`` (``CLEAR``...``CHAOTIC``, or None).

    False when delegation is disabled (``[model_routing] enabled = false``), and under ``adaptive`` when the
    complexity is below ``complexity_threshold``; a request with no complexity is below every gate. ``explicit``
    and ``suggest`` always apply.

    Raises:
        ValueError: ``complexity`` is not one of the four ranks.
    """
    if complexity is not None and complexity not in COMPLEXITY:
        raise ValueError(f"complexity must be one of {', '.join(COMPLEXITY)}, got {complexity!r}")
    if not routing.enabled:
        return False
    if routing.mode == "adaptive":
        return complexity is not None and COMPLEXITY.index(complexity) >= COMPLEXITY.index(routing.complexity_threshold)
    return True


@dataclass(frozen=True)
class Route:
    """A resolved target: ``pool`` is its health key; ``sources`` names the level each field came from."""

    role: str
    adapter: str
    model: str
    effort: str
    pool: str
    sources: dict[str, str] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {"role": self.role, "adapter": self.adapter, "model": self.model, "effort": self.effort,
                "capacity_scope": self.pool, "sources": dict(self.sources)}


@dataclass(frozen=True)
class RoutePlan:
    """The route to try and, in order, the pre-execution fallbacks the policy allows."""

    route: Route
    fallbacks: tuple[Route, ...] = ()

    @property
    def candidates(self) -> tuple[Route, ...]:
        return (self.route,) + self.fallbacks

    def proposal(self) -> dict[str, Any]:
        """What ``suggest`` returns instead of running: the route and its fallbacks."""
        return {**self.route.as_dict(), "fallbacks": [r.as_dict() for r in self.fallbacks]}


def _finish(registry: Registry, role: str, adapter: str, model: str, effort: str,
            sources: dict[str, str]) -> Route:
    descriptor = registry.get(adapter)
    descriptor.require(DISPATCH, "it cannot run child work")
    descriptor.check(model, effort)
    return Route(role, adapter, model, effort, descriptor.pool(model), sources)


def resolve(routing: ModelRoutingConfig, registry: Registry, role: str, *, override: RouteTarget = NO_TARGET,
            preset: RouteTarget = NO_TARGET, role_default: RouteTarget = NO_TARGET,
            history: RouteTarget = NO_TARGET) -> Route:
    """Resolve ``role``'s target through the seven levels (module docstring).

    Raises:
        TargetError: no level names an adapter, the adapter is unknown or cannot dispatch, or its descriptor
            rejects the model or effort; the message says which.
    """
    policy = routing.role(role)
    levels = list(zip(LEVELS[:-1], (override, policy.target if policy else NO_TARGET, routing.orchestrator,
                                    preset, role_default, history), strict=True))
    adapter_level = next(((name, t.adapter) for name, t in levels if t.adapter), None)
    if adapter_level is None:
        raise TargetError(f"no adapter for role {role!r}: set the role's adapter or [model_routing.orchestrator] "
                          f"adapter (known adapters: {', '.join(registry.ids()) or 'none'})")
    sources = {"adapter": adapter_level[0]}
    adapter = adapter_level[1]
    descriptor = registry.get(adapter)
    same = [(name, t) for name, t in levels if t.adapter in ("", adapter)]
    model_level = next(((name, t.model) for name, t in same if t.model), (LEVELS[-1], descriptor.default_model))
    effort_level = next(((name, t.effort) for name, t in same if t.effort), (LEVELS[-1], descriptor.default_effort))
    sources["model"], sources["effort"] = model_level[0], effort_level[0]
    return _finish(registry, role, adapter, model_level[1], effort_level[1], sources)


def plan(routing: ModelRoutingConfig, registry: Registry, role: str, *, ready: Callable[[str], bool] = lambda _a: True,
         **levels: RouteTarget) -> RoutePlan:
    """:func:`resolve` plus the fallbacks of ``fallback_policy``, skipping adapters ``ready`` says are not ready
    and targets their descriptors reject. ``levels``: ``override``, ``preset``, ``role_default``, ``history``.

    Raises:
        TargetError: as :func:`resolve`, for the primary route.
    """
    route = resolve(routing, registry, role, **levels)
    if routing.fallback_policy == "fail_closed":
        return RoutePlan(route)
    seen = {route.pool}
    fallbacks: list[Route] = []

    def add(adapter: str, model: str, effort: str, source: str) -> None:
        if not adapter or not ready(adapter):
            return
        try:
            candidate = _finish(registry, role, adapter, model, effort,
                                {"adapter": source, "model": source, "effort": source})
        except TargetError:
            return
        if candidate.pool not in seen:
            seen.add(candidate.pool)
            fallbacks.append(candidate)

    descriptor = registry.get(route.adapter)
    add(route.adapter, descriptor.default_model, descriptor.default_effort, "fallback: adapter default")
    if routing.fallback_policy == "next_eligible":
        for target in [routing.orchestrator] + [r.target for r in routing.roles]:
            if target.adapter and target.adapter != route.adapter and target.adapter in registry:
                other = registry.get(target.adapter)
                add(target.adapter, target.model or other.default_model, target.effort or other.default_effort,
                    "fallback: next eligible")
    return RoutePlan(route, tuple(fallbacks))
