"""What the routing policy resolves to, which adapters can run, and each pool's breaker, as JSON objects.

One place for these objects: ``proxyvisor routing show --json`` and ``proxyvisor health show --json`` print them,
and the proxy's web view (``proxyvisor.proxy.web``) serves them, so the three never disagree.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import msgspec

from ..config import Config, ModelRoutingConfig
from .descriptors import Registry, TargetError
from .health import PoolHealth, adapter_summary


def owner(pool: str) -> str:
    """What a pool is summarised under: its adapter (``adapter:bucket``), or ``upstream:NAME`` for a pool of the
    agent's own requests (``upstream:NAME:MODEL``, ``proxyvisor.proxy.breakers``)."""
    parts = pool.split(":", 2)
    return ":".join(parts[:2]) if parts[0] == "upstream" and len(parts) == 3 else parts[0]


def health_json(pools: Iterable[PoolHealth], now: float) -> dict[str, Any]:
    """``{"pools": [...], "adapters": {...}}`` for the pools with recorded health at ``now`` (Unix s): each pool's
    effective breaker state (``healthy``, ``cooling_down``, ``half_open``), failures in a row, when it recovers
    (``recovery_at``, Unix s, and ``recovers_in_s``), whether its half-open probe is in flight, and its last
    failure's category; each owner (adapter, or ``upstream:NAME``) with its most restrictive state, soonest
    recovery and limited pools. A pool without recorded health is healthy and not listed."""
    pools = list(pools)
    rows = []
    for p in pools:
        recovery = p.recovery_at(now)
        rows.append({"pool": p.pool, "state": p.effective_state(now), "failure_count": p.failure_count,
                     "recovery_at": recovery, "recovers_in_s": round(recovery - now, 1) if recovery else None,
                     "probe_in_flight": p.state == "half_open" and p.lease_until > now,
                     "last_category": p.last_category or None, "retry_after_s": p.retry_after_s})
    owned: dict[str, list[PoolHealth]] = {}
    for p in pools:
        owned.setdefault(owner(p.pool), []).append(p)
    adapters: dict[str, Any] = {}
    for name in sorted(owned):
        state, soonest, limited = adapter_summary(owned[name], now)
        adapters[name] = {"state": state, "soonest_recovery_at": soonest, "limited_pools": limited}
    return {"pools": rows, "adapters": adapters}


def policy_json(routing: ModelRoutingConfig, registry: Registry) -> dict[str, Any]:
    """``{"policy": [model_routing] as saved, "resolved": {role: route or {"unavailable": why}}}``."""
    from .routing import resolve

    policy = msgspec.to_builtins(routing)
    policy["roles"] = {r["name"]: {k: v for k, v in r.items() if k != "name"} for r in policy["roles"]}
    resolved: dict[str, Any] = {}
    for role in routing.roles:
        try:
            resolved[role.name] = resolve(routing, registry, role.name).as_dict()
        except TargetError as exc:
            resolved[role.name] = {"unavailable": str(exc)}
    return {"policy": policy, "resolved": resolved}


def routing_json(config: Config, registry: Registry, state_dir: Path | None = None) -> dict[str, Any]:
    """What ``proxyvisor routing show --json`` prints: the configuration file, whether delegation is enabled, the
    policy (:func:`policy_json`), each adapter with its readiness now (``ready``, and ``unavailable``: why not),
    capabilities, models and efforts, and the descriptors that could not be read. Readiness is asked afresh (it
    looks for the adapter's program or key; nothing is run); ``state_dir`` overrides the configured one, whose
    stores are opened only if used."""
    from .delegate import Delegator

    delegator = Delegator(config, registry=registry, state_dir=state_dir)
    try:
        adapters: dict[str, Any] = {}
        for d in registry.descriptors.values():
            unavailable = delegator.readiness(d.id)
            adapters[d.id] = {"ready": unavailable is None, "unavailable": unavailable,
                              "capabilities": sorted(d.capabilities), "default_model": d.default_model,
                              "models": [{"id": m.id, "bucket": m.bucket} for m in d.models],
                              "efforts": list(d.efforts), "description": d.description}
    finally:
        delegator.close()
    return {"source": config.source, "enabled": config.model_routing.enabled,
            **policy_json(config.model_routing, registry), "adapters": adapters,
            "descriptor_errors": registry.errors}
