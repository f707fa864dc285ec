"""Typed configuration, parsed and validated once from ``config.toml``.

The rest of the code never reads raw TOML or environment variables: it receives a :class:`Config`.
Every field has a default; the repository's root ``config.toml`` documents each one with its default, and a
test keeps the two in step.

The tables are msgspec structs (frozen; change one with ``msgspec.structs.replace``), and their annotations are the
schema :func:`parse` validates a document against (:mod:`proxyvisor.schema`): types, unknown keys, and each
number's range and each choice's values from :mod:`proxyvisor.rules`, the module the cores check the same rules
with. What a type cannot say (the bind rule, the order of related numbers, the supervision graph) is checked after.

Where the file is found (first match wins): the ``--config`` option, ``$PROXYVISOR_CONFIG``, then
``$XDG_CONFIG_HOME/proxyvisor/config.toml`` (``~/.config/proxyvisor/config.toml``). With none of them, the
built-in defaults apply: the embedded scripted upstream, which needs no API key.
"""

from __future__ import annotations

import ipaddress
import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta
from msgspec.structs import replace

from .rules import (AUTHORIZER_BUDGET, BLOCK, DEFAULT_AUTHORIZER_BUDGET, DEFAULT_AUTHORIZER_TIMEOUT_S,
                    AuthorizerMode, CHILD_WALL_CLOCK, DEFAULT_LEARNING_BUDGET, LEARNING_BUDGET, CONDENSE_KINDS, DEFAULT_DIGEST_BUDGET, DEFAULT_REENTRIES, DEFAULT_RESULT_BUDGET,
                    DEFAULT_VIEW_BUDGET, DIGEST_BUDGET, RESULT_BUDGET,
                    FAIL_CLOSED, FORMATS, HOLD_STOP, NON_NEGATIVE, REENTRY_BUDGET, ROLE_NAME, VIEW_BUDGET,
                    Complexity, CondenseKind, FailurePolicy, FallbackPolicy, Format, Hold, Range, RoutingMode)
from .schema import Invalid, Problem, convert, integer, real

SCRIPTED_URL = "scripted:"
"""The ``url`` of an upstream that proxyvisor plays itself from a script (no network, no key)."""
SCRIPTED_MODEL = "scripted-model"
"""The model name the embedded scripted upstream answers as, whatever model a request names."""


class ConfigError(ValueError):
    """The configuration file is missing, unreadable, not TOML, or holds an invalid or unknown setting.

    The message names the file and the offending key; proxyvisor refuses to start rather than guess.
    """


LONGEST_S = 10 * 365 * 86_400
"""The longest duration a setting takes: 10 years, in seconds. Longer is no choice anyone makes, and a huge value
breaks what it reaches: 1e308 s is infinite in milliseconds (a Redis expiry, ``retention_days`` in seconds), Redis
refuses an expiry past 2**63 ms, a thread's timed wait one past about 292 years."""

Count = Annotated[int, integer(NON_NEGATIVE)]
Seconds = Annotated[float, real(Range(0, LONGEST_S, low_open=True))]
"""A duration, above 0 and at most :data:`LONGEST_S`."""
SecondsOrZero = Annotated[float, real(Range(0, LONGEST_S))]
"""A duration that may be 0 (what 0 means is the field's), at most :data:`LONGEST_S`."""


class Table(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A table of the configuration: an unknown key in it is an error. A subclass repeats ``frozen=True``: msgspec
    inherits it, but mypy would take the subclass for a mutable one."""


class ProxyConfig(Table, frozen=True):
    host: str = "127.0.0.1"
    port: Annotated[int, integer(Range(0, 65535))] = 8377
    max_body_bytes: Annotated[int, integer(Range(1024))] = 32 * 1024 * 1024
    auth_token: str = ""
    admin_token: str = ""
    request_header_timeout_s: Seconds = 30.0
    request_body_timeout_s: Seconds = 120.0
    request_body_deadline_s: Seconds = 300.0
    keepalive_timeout_s: Seconds = 75.0
    max_stream_s: SecondsOrZero = 3600.0  # 0 = no limit
    shutdown_grace_s: SecondsOrZero = 10.0  # 0 = end streams at once


class UpstreamConfig(Table, frozen=True):
    """One ``[upstreams.NAME]`` table.

    ``model``: the model name sent upstream on the translation path (a client format the upstream does not speak,
    served through litellm) instead of the one the client asked for; empty keeps the client's. ``fallback``: the
    upstreams a supervised request for this one is sent to, in order, while its pool cools down or when it fails
    before any byte reached the agent (``proxyvisor.proxy.breakers``; not transitive).
    """

    name: str
    url: Annotated[str, Meta(pattern=r"\A(?:https?://|scripted:\Z)",
                             description=f"http(s)://... or {SCRIPTED_URL!r}")] = SCRIPTED_URL
    formats: Annotated[tuple[Format, ...], Meta(min_length=1, description="a non-empty list of "
                                                + ", ".join(FORMATS))] = FORMATS
    api_key_env: str = ""
    connect_timeout_s: Seconds = 10.0
    first_byte_timeout_s: Seconds = 600.0
    idle_timeout_s: Seconds = 300.0
    keepalive_timeout_s: Seconds = 30.0
    script: str = ""
    chunk_delay_ms: Annotated[float, real(Range(0, 60_000))] = 0.0  # a scripted stream's pace: a minute at most
    model: str = ""
    fallback: tuple[str, ...] = ()

    @property
    def scripted(self) -> bool:
        return self.url == SCRIPTED_URL


class StateConfig(Table, frozen=True):
    """``[state]``: the state directory, the in-memory session table's bounds, and where shared state lives
    (``backend``: ``diskcache`` in the state directory, or ``redis`` at ``url``, shared by several replicas;
    ``proxyvisor.adapters.state``). ``session_ttl_s``: seconds a session's supervision state is kept after its
    last request (what a restart or another replica picks up)."""

    dir: str = ""
    session_idle_s: Seconds = 3600.0
    max_sessions: Annotated[int, integer(Range(1))] = 1024
    backend: Literal["diskcache", "redis"] = "diskcache"
    url: str = ""
    session_ttl_s: Seconds = 86400.0


class TelemetryConfig(Table, frozen=True):
    """``[telemetry]``: OpenTelemetry traces (``proxyvisor.proxy.telemetry``). ``otlp_endpoint``: the OTLP/HTTP
    base URL (``http://host:4318``; ``/v1/traces`` is appended unless the URL names that path already); empty = off,
    and the OpenTelemetry SDK is never imported. ``service_name``: the resource's ``service.name``."""

    otlp_endpoint: str = ""
    service_name: str = "proxyvisor"


class ModelConfig(Table, frozen=True):
    """``[supervisor.model]``: the model proxyvisor calls itself (verifier, refuter, planner, condenser).

    With ``api_base`` and ``api_key_env`` empty, the session's own route (``proxyvisor.supervisor_model.route_of``):
    each call goes the way the supervised request went, to ``name``, or the request's own model when ``name`` is
    empty. Setting ``api_base`` or ``api_key_env`` picks the litellm route: ``name`` is then a litellm model id
    (``"anthropic/claude-haiku-4-5"``), ``api_key_env`` the environment variable holding its key, and ``api_base =
    "scripted:"`` the first embedded scripted upstream (fixed policies, no key, no network). Empty
    ``reasoning_effort`` sends none; ``top_p`` is sent only when below 1. The defaults follow seed 003's profile.
    """

    name: str = ""
    api_base: str = ""
    api_key_env: str = ""
    max_tokens: Annotated[int, integer(Range(1))] = 8192
    temperature: Annotated[float, real(Range(0, 2))] = 0.0
    top_p: Annotated[float, real(Range(0, 1, low_open=True))] = 1.0
    reasoning_effort: str = ""
    max_retries: Count = 1
    request_timeout_s: Seconds = 300.0


class CondenseConfig(Table, frozen=True):
    """``[supervisor.condense]``: narrowing oversized tool results for the model's copy (seed 003, "Condense").

    A plain-text tool result above ``tokens_threshold`` tokens (0 = off; never below 512) is a candidate; the
    candidates of a round share ``view_budget_tokens`` of numbered view; the condenser call may take
    ``timeout_s``; each condensed result is at most ``budget_tokens``. Results of the ``deterministic_kinds`` of
    tool run (``test``, ``build``, ``install``), and every result when no model answers, are condensed without a
    model (``proxyvisor.condense.select``). ``adaptive`` turns on the per-session 0.5x-2x threshold multiplier
    (``proxyvisor.condense.adaptive``).
    """

    enabled: bool = True
    tokens_threshold: Count = 5000
    adaptive: bool = False
    view_budget_tokens: Annotated[int, integer(VIEW_BUDGET)] = DEFAULT_VIEW_BUDGET
    budget_tokens: Annotated[int, integer(RESULT_BUDGET)] = DEFAULT_RESULT_BUDGET
    deterministic_kinds: tuple[CondenseKind, ...] = CONDENSE_KINDS
    timeout_s: Seconds = 60.0


class DetectorsConfig(Table, frozen=True):
    """``[supervisor.detectors]``: ``mutating_tools`` names tools whose successful calls always count as changes
    (declared mutations), on top of the built-in rules (``proxyvisor.detectors.receipts``). The detectors'
    thresholds are fixed constants (seed 003)."""

    mutating_tools: tuple[str, ...] = ()


class GateConfig(Table, frozen=True):
    """``[supervisor.gate]``: the verify-gate (seed 003 "Verify-gate"; ``proxyvisor.gate``).

    Every response that ends a turn without tool calls is checked by one verifier call (``[supervisor.model]``)
    before the agent gets it. ``reentry_budget``: times per turn the turn is continued upstream to close gaps
    (:data:`~proxyvisor.rules.REENTRY_BUDGET`). ``failure_policy``: ``fail_closed`` labels a turn whose verifier
    is unavailable not passed (still delivered, labelled ``unverified``); ``fail_open`` passes it. ``headless``:
    the agent runs with no user present (``proxyvisor batch`` sets it), so a turn ending
    ``exploring``/``progressing`` with no action gets a continue nudge (at most 2). ``digest_budget_tokens``: the
    verifier input's bound (:data:`~proxyvisor.rules.DIGEST_BUDGET`). ``timeout_s``: seconds one verifier call may
    take before it counts as unavailable. ``hold``: what of a streamed final answer waits for the verdict:
    ``answer`` (all of it) or ``stop`` (only its stop event; the text streams, and a continued turn goes on in the
    same message). ``unverified_notice``: the line appended to an answer delivered not passed under
    ``fail_closed``, naming the first standing gap when there is one (:func:`~proxyvisor.gate.outcome.naming`;
    empty: none).
    """

    enabled: bool = True
    reentry_budget: Annotated[int, integer(REENTRY_BUDGET)] = DEFAULT_REENTRIES
    failure_policy: FailurePolicy = FAIL_CLOSED
    headless: bool = False
    digest_budget_tokens: Annotated[int, integer(DIGEST_BUDGET)] = DEFAULT_DIGEST_BUDGET
    timeout_s: Seconds = 120.0
    hold: Hold = HOLD_STOP
    unverified_notice: Annotated[str, Meta(pattern=r"\A\s*[^\n]*\s*\Z", description="one line")] = \
        "[proxyvisor] This answer could not be verified: check it before relying on it."


class PlanConfig(Table, frozen=True):
    """``[supervisor.plan]``: the supervisor-owned plan (seed 003 "Adaptive external planning", "Recite").

    ``enabled``: the self-report's ``plan`` signal calls the planner (``[supervisor.model]``); ``recite``: a block
    near the request tail re-anchors the model when what it recites changes: the live plan, the user's prohibitions
    in force (stated in any user turn, not lifted by a later permission) once the turn stating them is no longer
    the last message, and the goal once the agent compacted its history; it is kept at its place in later requests
    (reference section 4, "Recitation"; ``proxyvisor.proxy.planning``).
    ``timeout_s``: seconds one planner call may take (then the plan is left as it was).
    """

    enabled: bool = True
    recite: bool = True
    timeout_s: Seconds = 60.0


class AuthorizerConfig(Table, frozen=True):
    """``[supervisor.authorizer]``: the user-intent check of tool calls before the agent receives them (seed 003
    "Tool authorization"; ``proxyvisor.gate.authorize``, ``proxyvisor.proxy.authorizing``).

    Off by default. A batch of tool calls is admitted for free when no prohibition the user stated is in force or
    none could concern its calls; otherwise one judge call on the supervisor route (``[supervisor.model]``) decides,
    and a proposed block needs a second, independent confirmation. ``mode``: ``block`` keeps a confirmed call
    from the agent and continues the turn upstream with a tool error quoting the user; ``advise`` delivers it,
    records the conflict and adds a note for the model. ``timeout_s``: seconds the whole judgment (both calls) may
    take; ``budget_tokens``: the judge input's bound (:data:`~proxyvisor.rules.AUTHORIZER_BUDGET`). A judgment that
    fails, times out, is malformed or over budget allows.
    """

    enabled: bool = False
    mode: AuthorizerMode = BLOCK
    timeout_s: Seconds = DEFAULT_AUTHORIZER_TIMEOUT_S
    budget_tokens: Annotated[int, integer(AUTHORIZER_BUDGET)] = DEFAULT_AUTHORIZER_BUDGET


class EvolutionConfig(Table, frozen=True):
    """``[supervisor.learning.evolution]``: evolved skills (seed 003). Not built: ``enabled`` is accepted as
    ``false`` only, so the seed's configuration loads and a request for evolution is refused, never ignored."""

    enabled: bool = False


class LearningConfig(Table, frozen=True):
    """``[supervisor.learning]``: cross-session learning and recall (seed 003 "The closed loop", "Cross-session
    memory"; ``proxyvisor.learning``, ``proxyvisor.proxy.learning``).

    ``enabled``: distill grounded records (the user's durable rules, orientation facts, task experience) at a turn
    end the gate judged, at a compaction and at session end, and recall them on a session's first request (off:
    nothing is read or written). ``scope``: the project folder whose memory every session shares (empty: each
    session's own, from the working directory its client reports, else ``wrap``'s). ``budget_tokens``: the Active
    Memory Pack's bound (:data:`~proxyvisor.rules.LEARNING_BUDGET`). ``max_records`` / ``max_bytes``: one scope's
    bounds, past which archived, then lowest-credit, then oldest records go; ``retention_days``: records neither
    stored again nor recalled for that long go. ``timeout_s``: seconds one distill call may take.
    """

    enabled: bool = True
    scope: str = ""
    budget_tokens: Annotated[int, integer(LEARNING_BUDGET)] = DEFAULT_LEARNING_BUDGET
    max_records: Annotated[int, integer(Range(1, 100_000))] = 1000
    max_bytes: Annotated[int, integer(Range(4096))] = 2 * 1024 * 1024
    retention_days: Annotated[float, real(Range(0, LONGEST_S // 86_400, low_open=True))] = 180.0
    timeout_s: Seconds = 60.0
    evolution: EvolutionConfig = msgspec.field(default_factory=EvolutionConfig)


class BreakersConfig(Table, frozen=True):
    """``[supervisor.breakers]``: per-pool health of the agent's own requests (a pool: an upstream and a model;
    ``proxyvisor.proxy.breakers``). A pool's first trip cools it for ``cooldown_s``, doubling on each trip in a
    row up to ``maximum_cooldown_s``; an upstream's ``Retry-After`` is the floor."""

    enabled: bool = True
    cooldown_s: Seconds = 1.0
    maximum_cooldown_s: Seconds = 60.0


class SupervisorConfig(Table, frozen=True):
    enabled: bool = True
    breakers: BreakersConfig = msgspec.field(default_factory=BreakersConfig)
    model: ModelConfig = msgspec.field(default_factory=ModelConfig)
    condense: CondenseConfig = msgspec.field(default_factory=CondenseConfig)
    detectors: DetectorsConfig = msgspec.field(default_factory=DetectorsConfig)
    gate: GateConfig = msgspec.field(default_factory=GateConfig)
    plan: PlanConfig = msgspec.field(default_factory=PlanConfig)
    authorizer: AuthorizerConfig = msgspec.field(default_factory=AuthorizerConfig)
    learning: LearningConfig = msgspec.field(default_factory=LearningConfig)


class RouteTarget(Table, frozen=True):
    """An adapter, model and effort; an empty field is inherited (see ``proxyvisor.adapters.routing``)."""

    adapter: str = ""
    model: str = ""
    effort: str = ""


class RoleConfig(Table, frozen=True):
    """One ``[model_routing.roles.NAME]`` table: the role's target, its description for the delegation tool,
    and the roles it may delegate to (edges of the supervision graph, seed 004)."""

    name: str
    adapter: str = ""
    model: str = ""
    effort: str = ""
    description: str = ""
    supervises: tuple[str, ...] = ()

    @property
    def target(self) -> RouteTarget:
        return RouteTarget(self.adapter, self.model, self.effort)


class CooldownConfig(Table, frozen=True):
    default_seconds: Seconds = 300.0
    maximum_seconds: Seconds = 3600.0


class ChildrenConfig(Table, frozen=True):
    """Clocks and limits of child runs (seed 002), and the retries and dead letters of a hand-off that fails
    transiently (``proxyvisor.adapters.retry``)."""

    wall_clock_s: Annotated[float, real(CHILD_WALL_CLOCK)] = 600.0
    idle_warn_s: Seconds = 60.0
    idle_cancel_s: Seconds = 300.0
    stop_grace_s: Seconds = 5.0
    claim_check_chars: Annotated[int, integer(Range(1000))] = 6000
    claim_retention_s: Seconds = 604800.0
    budget_tokens: Count = 0
    attempts: Annotated[int, integer(Range(1, 10))] = 3
    retry_backoff_s: Seconds = 1.0
    dead_letter_retention_s: Seconds = 604800.0
    dead_letters_kept: Annotated[int, integer(Range(1))] = 1000


AdapterOption = Annotated[str | int | float | bool | list[str],
                          Meta(description="a string, number, boolean or list of strings")]
"""A value of ``[model_routing.adapter_options.ID]``: the adapter reads its own options."""


class ModelRoutingConfig(Table, frozen=True):
    """``[model_routing]``: delegation to child runtimes, routing policy and per-pool health (seed 000)."""

    enabled: bool = False
    mode: RoutingMode = "explicit"
    complexity_threshold: Complexity = "COMPLICATED"
    fallback_policy: FallbackPolicy = "fail_closed"
    max_parallel: Annotated[int, integer(Range(1))] = 8
    max_depth: Annotated[int, integer(Range(1))] = 3
    adapters_dir: str = ""
    cooldown: CooldownConfig = msgspec.field(default_factory=CooldownConfig)
    orchestrator: RouteTarget = msgspec.field(default_factory=RouteTarget)
    children: ChildrenConfig = msgspec.field(default_factory=ChildrenConfig)
    roles: tuple[RoleConfig, ...] = ()
    adapter_options: dict[str, dict[str, AdapterOption]] = {}

    def role(self, name: str) -> RoleConfig | None:
        return next((r for r in self.roles if r.name == name), None)


class Config(Table, frozen=True):
    proxy: ProxyConfig = msgspec.field(default_factory=ProxyConfig)
    upstreams: tuple[UpstreamConfig, ...] = (UpstreamConfig(name="scripted"),)
    state: StateConfig = msgspec.field(default_factory=StateConfig)
    supervisor: SupervisorConfig = msgspec.field(default_factory=SupervisorConfig)
    model_routing: ModelRoutingConfig = msgspec.field(default_factory=ModelRoutingConfig)
    telemetry: TelemetryConfig = msgspec.field(default_factory=TelemetryConfig)
    source: str = "built-in defaults"

    def state_dir(self, env: Mapping[str, str] | None = None) -> Path:
        """The state directory: ``[state] dir``, else ``$PROXYVISOR_STATE_DIR``, else
        ``$XDG_STATE_HOME/proxyvisor`` (``~/.local/state/proxyvisor``)."""
        env = os.environ if env is None else env
        if self.state.dir:
            return Path(self.state.dir).expanduser()
        if env.get("PROXYVISOR_STATE_DIR"):
            return Path(env["PROXYVISOR_STATE_DIR"]).expanduser()
        base = env.get("XDG_STATE_HOME") or os.path.join(env.get("HOME", "~"), ".local", "state")
        return Path(base).expanduser() / "proxyvisor"

    def upstream_for(self, fmt: str) -> tuple[UpstreamConfig, bool]:
        """The upstream that serves client format ``fmt`` and whether it speaks it natively.

        The first upstream listing ``fmt`` in its ``formats`` is used as a byte relay; when none does, the
        first upstream is used through litellm's translation (``native`` is False).
        """
        for upstream in self.upstreams:
            if fmt in upstream.formats:
                return upstream, True
        return self.upstreams[0], False

    def with_overrides(self, **sections: dict[str, Any]) -> Config:
        """A copy with some fields of ``proxy``, ``state`` or ``supervisor`` replaced (for CLI flags and tests;
        not validated: :func:`validate` checks the result)."""
        return replace(self, **{name: replace(getattr(self, name), **values) for name, values in sections.items()})


class _Document(Table, frozen=True):
    """A configuration file's top level. The named tables are validated one by one (:func:`parse`), so that an
    error names its table."""

    proxy: ProxyConfig = msgspec.field(default_factory=ProxyConfig)
    upstreams: Annotated[dict[str, Any], Meta(min_length=1, description="at least one [upstreams.NAME] table")] = \
        msgspec.field(default_factory=lambda: {"scripted": {}})
    state: StateConfig = msgspec.field(default_factory=StateConfig)
    supervisor: SupervisorConfig = msgspec.field(default_factory=SupervisorConfig)
    model_routing: dict[str, Any] = {}
    telemetry: TelemetryConfig = msgspec.field(default_factory=TelemetryConfig)


def _error(source: str, tables: tuple[str, ...], problem: Problem, key: str = "") -> ConfigError:
    """The :class:`ConfigError` of ``problem`` found in the table ``tables`` of ``source`` (``key``: the key whose
    value was converted, when the problem is the whole value)."""
    tables += problem.tables
    if problem.unknown:
        kind = "setting(s)" if tables else "section(s)"
        text = f"unknown {kind} {', '.join(problem.unknown)}; known: {', '.join(problem.known)}"
        return ConfigError(f"{source}: [{'.'.join(tables)}] {text}" if tables else f"{source}: {text}")
    key = problem.key or key
    if not tables:  # a section itself
        tables, key = (key,), ""
    return ConfigError(f"{source}: [{'.'.join(tables)}]{f' {key}' if key else ''} {problem.message}")


def _convert(source: str, tables: tuple[str, ...], value: Any, schema: Any, key: str = "") -> Any:
    try:
        return convert(value, schema)
    except Invalid as exc:
        raise _error(source, tables, exc.problem, key) from None


def _named(source: str, tables: tuple[str, ...], table: Any) -> Any:
    """The ``[SECTION.NAME]`` table ``tables`` with its name, for a schema whose ``name`` field is the table's
    name; a ``name`` key in the table itself is unknown (the table's name is its name)."""
    if not isinstance(table, dict):
        return table
    if "name" in table:
        raise ConfigError(f"{source}: [{'.'.join(tables)}] unknown setting(s) name: the table's name is "
                          f"{tables[-1]!r}")
    return {**table, "name": tables[-1]}


def parse(document: dict[str, Any], source: str = "<memory>") -> Config:
    """Validate a parsed TOML document into a :class:`Config`.

    Raises:
        ConfigError: an unknown section or key, a value of the wrong type, or an invalid value; the message
            names ``source`` and the key.
    """
    doc = _convert(source, (), document, _Document)
    upstreams = tuple(_convert(source, ("upstreams", name), _named(source, ("upstreams", name), table),
                               UpstreamConfig) for name, table in doc.upstreams.items())
    config = Config(proxy=doc.proxy, upstreams=upstreams, state=doc.state, supervisor=doc.supervisor,
                    model_routing=parse_model_routing(doc.model_routing, source), telemetry=doc.telemetry,
                    source=source)
    _check(config)
    return config


def parse_model_routing(table: dict[str, Any], source: str) -> ModelRoutingConfig:
    """Validate the ``[model_routing]`` table of ``source`` (its sub-tables, roles and adapter options too).

    Raises:
        ConfigError: an unknown key, a wrong type, or a sub-table that is not a table; the message names it.
    """
    where = ("model_routing",)
    rest = {k: v for k, v in table.items() if k not in ("roles", "adapter_options")}
    routing: ModelRoutingConfig = _convert(source, where, rest, ModelRoutingConfig)
    roles = _convert(source, where, table.get("roles", {}), dict[str, Any], key="roles")
    options = _convert(source, where, table.get("adapter_options", {}), dict[str, Any], key="adapter_options")
    for adapter, values in options.items():
        for key, value in _convert(source, (*where, "adapter_options", adapter), values, dict[str, Any]).items():
            _convert(source, (*where, "adapter_options", adapter), value, AdapterOption, key=key)
    return replace(routing, adapter_options=options, roles=tuple(
        _convert(source, (*where, "roles", name), _named(source, (*where, "roles", name), role), RoleConfig)
        for name, role in roles.items()))


def _check(config: Config) -> None:
    """The rules that no single value's type states: the bind rule, the scripted supervisor's upstream, the order
    of related numbers, role names and the supervision graph (known roles, no cycle, one supervisor each, depth;
    seed 004).

    Adapters, models and efforts are checked against the adapter descriptors when a policy is written and when a
    route is resolved, not here: a saved target whose adapter is gone must still load and show as unavailable.

    Raises:
        ConfigError: with the source and the key at fault.
    """
    from .adapters.graph import GraphError, check_graph

    where = config.source
    p = config.proxy
    endpoint = config.telemetry.otlp_endpoint
    if endpoint and not (endpoint.startswith(("http://", "https://")) and endpoint.partition("://")[2].strip("/")):
        raise ConfigError(f"{where}: [telemetry] otlp_endpoint must be an http:// or https:// URL (an OTLP/HTTP "
                          f"receiver, e.g. http://localhost:4318), got {endpoint!r}")
    if endpoint and not config.telemetry.service_name.strip():
        raise ConfigError(f"{where}: [telemetry] service_name must not be empty")
    if not is_loopback(p.host) and not p.auth_token:
        raise ConfigError(
            f"{where}: [proxy] host = {p.host!r} is not a loopback address; binding elsewhere requires "
            "[proxy] auth_token (clients then send it as 'x-proxyvisor-auth')"
        )
    if config.supervisor.model.api_base == SCRIPTED_URL and not any(u.scripted for u in config.upstreams):
        raise ConfigError(f"{where}: [supervisor.model] api_base = {SCRIPTED_URL!r} is the embedded scripted "
                          f"upstream, but no [upstreams.NAME] has url = {SCRIPTED_URL!r}")
    if config.state.backend == "redis" and not config.state.url:
        raise ConfigError(f"{where}: [state] backend = \"redis\" needs url (e.g. \"redis://127.0.0.1:6379/0\")")
    b = config.supervisor.breakers
    if not b.cooldown_s <= b.maximum_cooldown_s:
        raise ConfigError(f"{where}: [supervisor.breakers] needs cooldown_s <= maximum_cooldown_s, got "
                          f"{b.cooldown_s} and {b.maximum_cooldown_s}")
    if config.supervisor.learning.evolution.enabled:
        raise ConfigError(f"{where}: [supervisor.learning.evolution] enabled = true: evolved skills are not built "
                          "in proxyvisor; set it to false or leave it out")
    names = [u.name for u in config.upstreams]
    for upstream in config.upstreams:
        for other in upstream.fallback:
            if other not in names or other == upstream.name:
                raise ConfigError(f"{where}: [upstreams.{upstream.name}] fallback names {other!r}, which is not "
                                  f"another configured upstream (configured: {', '.join(names)})")
        if len(set(upstream.fallback)) != len(upstream.fallback):
            raise ConfigError(f"{where}: [upstreams.{upstream.name}] fallback names an upstream twice")
        if not upstream.scripted and (upstream.script or upstream.chunk_delay_ms):
            raise ConfigError(f"{where}: [upstreams.{upstream.name}] script and chunk_delay_ms are for the scripted "
                              f"upstream (url = {SCRIPTED_URL!r}); this one's url is {upstream.url!r}")
    routing = config.model_routing
    c = routing.cooldown
    if not c.default_seconds <= c.maximum_seconds:
        raise ConfigError(f"{where}: [model_routing.cooldown] needs default_seconds <= maximum_seconds, got "
                          f"{c.default_seconds} and {c.maximum_seconds}")
    k = routing.children
    if not k.idle_warn_s <= k.idle_cancel_s:
        raise ConfigError(f"{where}: [model_routing.children] needs idle_warn_s <= idle_cancel_s")
    bad = [r.name for r in routing.roles if not ROLE_NAME.match(r.name)]
    if bad:
        raise ConfigError(f"{where}: [model_routing].roles: each role becomes a delegation tool named after it, so a "
                          "role name is 1-64 of A-Z, a-z, 0-9, _ and - (the tool-name rule of the model APIs); got "
                          f"{', '.join(bad)}")
    try:
        check_graph({r.name: r.supervises for r in routing.roles}, routing.max_depth)
    except GraphError as exc:
        raise ConfigError(f"{where}: [model_routing].roles: {exc}") from None


def as_document(config: Config) -> dict[str, Any]:
    """``config`` as the TOML document that :func:`parse` reads back into it (its ``source`` aside)."""
    doc: dict[str, Any] = msgspec.to_builtins(config)
    del doc["source"]
    doc["upstreams"] = {u.pop("name"): u for u in doc["upstreams"]}
    doc["model_routing"]["roles"] = {r.pop("name"): r for r in doc["model_routing"]["roles"]}
    return doc


def validate(config: Config) -> None:
    """Check a :class:`Config` built in code (defaults with overrides from flags) by the rules :func:`parse`
    applies to a file.

    Raises:
        ConfigError: with the source and the key at fault.
    """
    parse(as_document(config), config.source)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def find_config_file(explicit: str | None, env: Mapping[str, str] | None = None) -> Path | None:
    env = os.environ if env is None else env
    if explicit:
        return Path(explicit).expanduser()
    if env.get("PROXYVISOR_CONFIG"):
        return Path(env["PROXYVISOR_CONFIG"]).expanduser()
    candidate = default_config_path(env)
    return candidate if candidate.exists() else None


def default_config_path(env: Mapping[str, str] | None = None) -> Path:
    """``$XDG_CONFIG_HOME/proxyvisor/config.toml`` (``~/.config/proxyvisor/config.toml``), existing or not."""
    env = os.environ if env is None else env
    base = env.get("XDG_CONFIG_HOME") or os.path.join(env.get("HOME", "~"), ".config")
    return Path(base).expanduser() / "proxyvisor" / "config.toml"


def load(explicit: str | None = None, env: Mapping[str, str] | None = None) -> Config:
    """Find, read and validate the configuration (see the module docstring for the search order). A relative
    ``[upstreams.NAME] script`` path is taken relative to the file's folder (``~`` is expanded).

    Raises:
        ConfigError: the named file is missing or unreadable, is not valid TOML, or fails validation.
    """
    path = find_config_file(explicit, env)
    if path is None:
        return Config()
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the configuration file: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: the configuration file is not UTF-8 text") from None
    try:
        document = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    config = parse(document, source=str(path))
    # A script named in a file belongs with that file: relative to its folder, not to wherever proxyvisor runs.
    return replace(config, upstreams=tuple(
        replace(u, script=str(path.parent / Path(u.script).expanduser())) if u.script else u
        for u in config.upstreams))
