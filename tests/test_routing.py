"""Routing policy: the one supervision predicate, the seven-level resolution order, fallbacks, config, graph."""

from __future__ import annotations

from typing import Any

import pytest

from proxyvisor.adapters.descriptors import TargetError, registry_for
from proxyvisor.adapters.graph import ROOT, GraphError, add_edge, check_graph, depth_of, may_delegate
from proxyvisor.adapters.routing import LEVELS, is_supervised, plan, resolve
from proxyvisor.config import ConfigError, ModelRoutingConfig, RouteTarget, parse
from proxyvisor.rules import COMPLEXITY

from routing_support import FIXTURE_ADAPTERS, routing_config

REGISTRY = registry_for(str(FIXTURE_ADAPTERS))


@pytest.mark.parametrize("enabled, mode, threshold, complexity, supervised", [
    (False, "explicit", "COMPLICATED", "CHAOTIC", False),
    (False, "suggest", "COMPLICATED", None, False),
    (True, "explicit", "COMPLICATED", None, True),
    (True, "suggest", "CHAOTIC", "CLEAR", True),
    (True, "adaptive", "COMPLICATED", None, False),  # no complexity is below every gate
    (True, "adaptive", "COMPLICATED", "CLEAR", False),
    (True, "adaptive", "COMPLICATED", "COMPLICATED", True),
    (True, "adaptive", "COMPLICATED", "CHAOTIC", True),
    (True, "adaptive", "CLEAR", None, False),
    (True, "adaptive", "CLEAR", "CLEAR", True),
])
def test_one_predicate_decides_supervised(enabled: bool, mode: str, threshold: str, complexity: str | None,
                                          supervised: bool) -> None:
    routing = ModelRoutingConfig(enabled=enabled, mode=mode, complexity_threshold=threshold)
    assert is_supervised(routing, complexity) is supervised


def test_an_unknown_complexity_is_refused() -> None:
    with pytest.raises(ValueError, match="CLEAR, COMPLICATED, COMPLEX, CHAOTIC"):
        is_supervised(ModelRoutingConfig(enabled=True), "HARD")
    assert COMPLEXITY == ("CLEAR", "COMPLICATED", "COMPLEX", "CHAOTIC")


OVERRIDE = RouteTarget("fixture-cli", "fixture-big", "high")
PRESET = RouteTarget("fixture-cli", "fixture-big-2", "low")
ROLE_DEFAULT = RouteTarget("fixture-cli", "fixture-fast", "high")
HISTORY = RouteTarget("fixture-cli", "fixture-big", "low")
ALL = dict(override=OVERRIDE, preset=PRESET, role_default=ROLE_DEFAULT, history=HISTORY)
BELOW_OVERRIDE = dict(preset=PRESET, role_default=ROLE_DEFAULT, history=HISTORY)
ROLE = {"r": {"adapter": "fixture-cli", "model": "fixture-fast", "effort": "low"}}
ORCHESTRATOR = {"adapter": "fixture-cli", "model": "fixture-big-2", "effort": "high"}


@pytest.mark.parametrize("level, roles, orchestrator, levels, expected", [
    ("request override", ROLE, ORCHESTRATOR, ALL, ("fixture-big", "high")),
    ("role policy", ROLE, ORCHESTRATOR, BELOW_OVERRIDE, ("fixture-fast", "low")),
    ("orchestrator policy", {"r": {}}, ORCHESTRATOR, BELOW_OVERRIDE, ("fixture-big-2", "high")),
    ("preset hint", {"r": {}}, {}, BELOW_OVERRIDE, ("fixture-big-2", "low")),
    ("role default", {"r": {}}, {}, dict(role_default=ROLE_DEFAULT, history=HISTORY), ("fixture-fast", "high")),
    ("routing history", {"r": {}}, {}, dict(history=HISTORY), ("fixture-big", "low")),
    ("adapter default", {"r": {}}, {}, dict(history=RouteTarget("fixture-cli")), ("fixture-fast", "")),
])
def test_resolution_follows_the_seven_levels_in_order(level: str, roles: dict, orchestrator: dict,
                                                      levels: dict[str, RouteTarget], expected: tuple) -> None:
    config = routing_config(roles, orchestrator=orchestrator)
    route = resolve(config.model_routing, REGISTRY, "r", **levels)
    assert (route.model, route.effort) == expected
    assert route.sources["model"] == level
    assert LEVELS == ("request override", "role policy", "orchestrator policy", "preset hint", "role default",
                      "routing history", "adapter default")  # seed 000's order


def test_a_role_entry_overrides_the_orchestrator_field_by_field() -> None:
    config = routing_config({"reviewer": {"model": "fixture-fast"}, "architect": {}},
                            orchestrator={"adapter": "fixture-cli", "model": "fixture-big", "effort": "high"})
    reviewer = resolve(config.model_routing, REGISTRY, "reviewer")
    assert (reviewer.adapter, reviewer.model, reviewer.effort) == ("fixture-cli", "fixture-fast", "high")
    assert reviewer.sources == {"adapter": "orchestrator policy", "model": "role policy",
                                "effort": "orchestrator policy"}
    assert resolve(config.model_routing, REGISTRY, "architect").model == "fixture-big"


def test_a_model_is_never_borrowed_from_a_level_naming_another_adapter() -> None:
    config = routing_config({"r": {"adapter": "scripted"}},
                            orchestrator={"adapter": "fixture-cli", "model": "fixture-big", "effort": "high"})
    route = resolve(config.model_routing, REGISTRY, "r")
    assert (route.adapter, route.model, route.effort, route.pool) == ("scripted", "scripted-model", "",
                                                                      "scripted:scripted")
    assert route.sources["model"] == "adapter default"


@pytest.mark.parametrize("roles, words", [
    ({"r": {}}, "no adapter for role 'r'"),
    ({"r": {"adapter": "ghost"}}, "unknown adapter 'ghost'"),
    ({"r": {"adapter": "no-dispatch"}}, "does not declare dispatch"),
    ({"r": {"adapter": "fixture-cli", "model": "gpt-x"}}, "does not declare model 'gpt-x'"),
    ({"r": {"adapter": "fixture-cli", "effort": "max"}}, "does not accept effort 'max'"),
])
def test_an_unsatisfiable_route_is_an_explicit_error(roles: dict[str, Any], words: str) -> None:
    with pytest.raises(TargetError, match=words):
        resolve(routing_config(roles).model_routing, REGISTRY, "r")


def test_fallbacks_follow_the_policy_and_skip_unready_or_invalid_targets() -> None:
    roles = {"r": {"adapter": "fixture-cli", "model": "fixture-big"}, "s": {"adapter": "scripted"},
             "t": {"adapter": "codex"}, "u": {"adapter": "claude-code", "model": "claude-haiku-4-5"}}
    closed = plan(routing_config(roles).model_routing, REGISTRY, "r")
    assert [c.pool for c in closed.candidates] == ["fixture-cli:big"]
    same = plan(routing_config(roles, fallback_policy="same_adapter_default").model_routing, REGISTRY, "r")
    assert [c.pool for c in same.candidates] == ["fixture-cli:big", "fixture-cli:fast"]
    ready = {"fixture-cli", "scripted", "claude-code"}
    nxt = plan(routing_config(roles, fallback_policy="next_eligible").model_routing, REGISTRY, "r",
               ready=lambda a: a in ready)
    assert [c.pool for c in nxt.candidates] == ["fixture-cli:big", "fixture-cli:fast", "scripted:scripted",
                                                "claude-code:haiku-4-5"]
    assert nxt.proposal()["fallbacks"][1]["sources"]["adapter"] == "fallback: next eligible"


# ---- configuration ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("table, words", [
    ({"mode": "auto"}, ["mode", "explicit, adaptive, suggest"]),
    ({"complexity_threshold": "HARD"}, ["complexity_threshold"]),
    ({"fallback_policy": "retry"}, ["fallback_policy"]),
    ({"max_parallel": 0}, ["max_parallel"]),
    ({"children": {"wall_clock_s": 10}}, ["wall_clock_s", "30-3600"]),
    ({"children": {"wall_clock_s": 7200}}, ["wall_clock_s"]),
    ({"children": {"idle_warn_s": 400}}, ["idle_warn_s"]),
    ({"cooldown": {"default_seconds": 900, "maximum_seconds": 60}}, ["default_seconds"]),
    ({"cooldown": {"minimum_seconds": 1}}, ["cooldown", "minimum_seconds"]),
    ({"roles": {"r": {"model": 5}}}, ["[model_routing.roles.r] model"]),
    ({"roles": {"r": {"supervises": ["x"]}}}, ["'x' is not configured"]),
    ({"roles": "reviewer"}, ["roles must be a table"]),
    ({"adapter_options": {"litellm": {"api_base": {"nested": 1}}}}, ["[model_routing.adapter_options.litellm] api_base"]),
    ({"enabled": "yes"}, ["enabled", "bool"]),
])
def test_routing_settings_are_validated_naming_the_key(table: dict[str, Any], words: list[str]) -> None:
    with pytest.raises(ConfigError) as caught:
        parse({"model_routing": table}, source="my.toml")
    for word in words:
        assert word in str(caught.value), (word, str(caught.value))


def test_routing_defaults_are_off_and_complete() -> None:
    routing = parse({}).model_routing
    assert (routing.enabled, routing.mode, routing.complexity_threshold, routing.fallback_policy,
            routing.max_parallel) == (False, "explicit", "COMPLICATED", "fail_closed", 8)
    assert (routing.cooldown.default_seconds, routing.cooldown.maximum_seconds) == (300, 3600)
    assert (routing.children.wall_clock_s, routing.children.idle_warn_s, routing.children.idle_cancel_s,
            routing.children.stop_grace_s, routing.children.claim_check_chars) == (600, 60, 300, 5, 6000)
    partial = parse({"model_routing": {"roles": {"r": {"adapter": "codex"}}}}).model_routing
    assert partial.role("r").target == RouteTarget("codex") and partial.orchestrator == RouteTarget()


# ---- supervision graph (seed 004) ------------------------------------------------------------------------


def test_a_cycle_is_rejected_with_a_readable_path() -> None:
    with pytest.raises(GraphError, match="this would make a cycle: c -> a -> b -> c"):
        check_graph({"a": ["b"], "b": ["c"], "c": ["a"]}, max_depth=9)
    with pytest.raises(GraphError, match="cannot supervise itself"):
        check_graph({"a": ["a"]}, max_depth=9)


def test_a_subordinate_has_one_supervisor() -> None:
    with pytest.raises(GraphError, match="'c' already has a supervisor \\('a'\\)"):
        check_graph({"a": ["c"], "b": ["c"], "c": []}, max_depth=9)


def test_depth_is_measured_in_both_directions() -> None:
    edges = {"a": ("b",), "b": (), "c": ("d",), "d": ("e",), "e": ()}
    check_graph(edges, max_depth=3)
    assert (depth_of(edges, "b"), depth_of(edges, "e")) == (2, 3)
    # Joining b (2 deep) to c (2 below it) makes a chain of 5: checking either side alone would admit it.
    with pytest.raises(GraphError, match="'b' -> 'c' would make a delegation chain 5 deep"):
        add_edge(edges, "b", "c", max_depth=4)
    assert add_edge(edges, "b", "c", max_depth=5)["b"] == ("c",)


def test_delegation_is_allowed_only_along_edges() -> None:
    edges = {"lead": ("worker",), "worker": (), "solo": ()}
    assert may_delegate(edges, ROOT, "lead") and may_delegate(edges, ROOT, "solo")
    assert not may_delegate(edges, ROOT, "worker"), "the root only reaches roles nobody supervises"
    assert may_delegate(edges, "lead", "worker") and not may_delegate(edges, "worker", "lead")
    assert not may_delegate(edges, ROOT, "ghost")


def test_a_graph_that_is_already_cyclic_still_terminates() -> None:
    assert depth_of({"a": ("b",), "b": ("a",)}, "a") == 2
