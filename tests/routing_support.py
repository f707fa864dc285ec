"""Helpers for the delegation, routing and health tests: a routing config with the fixture adapters, fast child
clocks, and a :class:`Delegator` whose ``scripted`` adapter plays a given :class:`ScriptedUpstream`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from proxyvisor.adapters.delegate import Delegator
from proxyvisor.adapters.descriptors import registry_for
from proxyvisor.scripted.upstream import ScriptedUpstream
from proxyvisor.scripted.runtime import ScriptedRuntime
from proxyvisor.config import ChildrenConfig, Config, parse

FIXTURE_ADAPTERS = Path(__file__).resolve().parent / "fixtures" / "adapters"
"""A user adapter folder: the ``fixture-cli`` adapter (a fake agent CLI) and a descriptor without dispatch."""

FAST = ChildrenConfig(wall_clock_s=10.0, idle_warn_s=0.3, idle_cancel_s=1.0, stop_grace_s=0.5, retry_backoff_s=0.05)
"""Child clocks and retry backoff short enough for tests (the config allows a wall clock of 30 s at least)."""


def routing_config(roles: dict[str, dict[str, Any]] | None = None, **routing: Any) -> Config:
    """A validated config with delegation enabled, the fixture adapters discovered, and ``roles``."""
    table: dict[str, Any] = {"enabled": True, "adapters_dir": str(FIXTURE_ADAPTERS), **routing}
    if roles is not None:
        table["roles"] = roles
    return parse({"model_routing": table}, source="test")


def make_delegator(config: Config, state_dir: Path, upstream: ScriptedUpstream | None = None,
                   clocks: ChildrenConfig = FAST, **kw: Any) -> Delegator:
    """A delegator over ``state_dir``; its ``scripted`` adapter plays ``upstream`` (a fresh one by default)."""
    registry = registry_for(config.model_routing.adapters_dir)
    runtime = ScriptedRuntime(registry.get("scripted"), {}, upstream=upstream or ScriptedUpstream())
    return Delegator(config, registry=registry, runtimes={"scripted": runtime}, clocks=clocks,
                     state_dir=state_dir, **kw)
