"""Typed configuration, parsed and validated once from ``config.toml``.

The rest of the code never reads raw TOML or environment variables: it receives a :class:`Config`.
Every field has a default; the repository's root ``config.toml`` documents each one with its default, and a
test keeps the two in step.

Where the file is found (first match wins): the ``--config`` option, ``$PROXYVISOR_CONFIG``, then
``$XDG_CONFIG_HOME/proxyvisor/config.toml`` (``~/.config/proxyvisor/config.toml``). With none of them, the
built-in defaults apply: the embedded scripted upstream, which needs no API key.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import math
import os
import re
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

FORMATS = ("chat", "messages", "responses")
"""The three wire formats: OpenAI Chat Completions, Anthropic Messages, OpenAI Responses."""

SCRIPTED_URL = "scripted:"
"""The ``url`` of an upstream that proxyvisor plays itself from a script (no network, no key)."""
SCRIPTED_MODEL = "scripted-model"
"""The model name the embedded scripted upstream answers as, whatever model a request names."""


class ConfigError(ValueError):
    """The configuration file is missing, unreadable, not TOML, or holds an invalid or unknown setting.

    The message names the file and the offending key; proxyvisor refuses to start rather than guess.
    """


@dataclass(frozen=True)
class Range:
    """The values a numeric setting accepts. The one rule for every number in the configuration: it is finite
    (``nan`` and ``inf`` are refused everywhere), at least ``low`` (above it when ``low_open``) and at most
    ``high``. A field declares its range with :func:`within` or :func:`positive`; a numeric field that declares
    none takes the default, ``>= 0``."""

    low: float = 0
    high: float = math.inf
    low_open: bool = False

    def admits(self, value: float) -> bool:
        return math.isfinite(value) and (value > self.low if self.low_open else value >= self.low) \
            and value <= self.high

    def __str__(self) -> str:
        low, high = (int(v) if float(v).is_integer() else v for v in (self.low, self.high))
        if math.isinf(self.high):
            return f"{'>' if self.low_open else '>='} {low}"
        return f"in ({low}, {high}]" if self.low_open else f"{low}-{high}"


_RANGE = "range"


def within(default: float, low: float, high: float = math.inf) -> Any:
    """A numeric field with ``default`` that accepts ``low`` to ``high`` (inclusive)."""
    return field(default=default, metadata={_RANGE: Range(low, high)})


def positive(default: float) -> Any:
    """A numeric field with ``default`` that must be above 0 (durations, most of all)."""
    return field(default=default, metadata={_RANGE: Range(0, low_open=True)})


@dataclass(frozen=True)
class ProxyConfig:
    host: str = "127.0.0.1"
    port: int = within(8377, 0, 65535)
    max_body_bytes: int = within(32 * 1024 * 1024, 1024)
    auth_token: str = ""
    admin_token: str = ""
    request_header_timeout_s: float = positive(30.0)
    request_body_timeout_s: float = positive(120.0)
    request_body_deadline_s: float = positive(300.0)
    keepalive_timeout_s: float = positive(75.0)
    max_stream_s: float = within(3600.0, 0)  # 0 = no limit


@dataclass(frozen=True)
class UpstreamConfig:
    """One ``[upstreams.NAME]`` table.

    ``model``: the model name sent upstream on the translation path (a client format the upstream does not speak,
    served through litellm) instead of the one the client asked for; empty keeps the client's.
    """

    name: str
    url: str = SCRIPTED_URL
    formats: tuple[str, ...] = FORMATS
    api_key_env: str = ""
    connect_timeout_s: float = positive(10.0)
    first_byte_timeout_s: float = positive(600.0)
    idle_timeout_s: float = positive(300.0)
    keepalive_timeout_s: float = positive(30.0)
    script: str = ""
    chunk_delay_ms: float = 0.0
    model: str = ""

    @property
    def scripted(self) -> bool:
        return self.url == SCRIPTED_URL


@dataclass(frozen=True)
class StateConfig:
    dir: str = ""
    session_idle_s: float = positive(3600.0)
    max_sessions: int = within(1024, 1)


@dataclass(frozen=True)
class ModelConfig:
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
    max_tokens: int = within(8192, 1)
    temperature: float = within(0.0, 0, 2)
    top_p: float = field(default=1.0, metadata={_RANGE: Range(0, 1, low_open=True)})
    reasoning_effort: str = ""
    max_retries: int = 1
    request_timeout_s: float = positive(300.0)


@dataclass(frozen=True)
class CondenseConfig:
    """``[supervisor.condense]``: narrowing oversized tool results for the model's copy (seed 003, "Condense").

    A plain-text tool result above ``tokens_threshold`` tokens (0 = off; never below 512) is a candidate; the
    candidates of a round share ``view_budget_tokens`` of numbered view; the condenser call may take
    ``timeout_s``, after which the round passes through untouched. ``adaptive`` turns on the per-session 0.5x-2x
    threshold multiplier (``proxyvisor.condense.adaptive``).
    """

    enabled: bool = True
    tokens_threshold: int = 5000
    adaptive: bool = False
    view_budget_tokens: int = within(32000, 256)
    timeout_s: float = positive(60.0)


@dataclass(frozen=True)
class DetectorsConfig:
    """``[supervisor.detectors]``: ``mutating_tools`` names tools whose successful calls always count as changes
    (declared mutations), on top of the built-in rules (``proxyvisor.detectors.receipts``). The detectors'
    thresholds are fixed constants (seed 003)."""

    mutating_tools: tuple[str, ...] = ()


HOLDS = ("answer", "stop")
"""``[supervisor.gate] hold``: what of a streamed final answer waits for the verdict."""


@dataclass(frozen=True)
class GateConfig:
    """``[supervisor.gate]``: the verify-gate (seed 003 "Verify-gate"; ``proxyvisor.gate``).

    Every response that ends a turn without tool calls is checked by one verifier call (``[supervisor.model]``)
    before the agent gets it. ``reentry_budget``: times per turn the turn is continued upstream to close gaps
    (0-8, issue 4). ``failure_policy``: ``fail_closed`` labels a turn whose verifier is unavailable not passed
    (still delivered, labelled ``unverified``); ``fail_open`` passes it. ``headless``: the agent runs with no user
    present (``proxyvisor batch`` sets it), so a turn ending ``exploring``/``progressing`` with no action gets a
    continue nudge (at most 2). ``digest_budget_tokens``: the verifier input's bound (at least 1,024).
    ``timeout_s``: seconds one verifier call may take before it counts as unavailable. ``hold``: what of a
    streamed final answer waits for the verdict: ``answer`` (all of it) or ``stop`` (only its stop event; the text
    streams, and a continued turn goes on in the same message). ``unverified_notice``: the line appended to an
    answer delivered not passed under ``fail_closed`` (empty: none).
    """

    enabled: bool = True
    reentry_budget: int = within(2, 0, 8)
    failure_policy: str = "fail_closed"
    headless: bool = False
    digest_budget_tokens: int = within(16384, 1024)
    timeout_s: float = positive(120.0)
    hold: str = "stop"
    unverified_notice: str = "[proxyvisor] This answer could not be verified: check it before relying on it."


@dataclass(frozen=True)
class PlanConfig:
    """``[supervisor.plan]``: the supervisor-owned plan (seed 003 "Adaptive external planning", "Recite").

    ``enabled``: the self-report's ``plan`` signal calls the planner (``[supervisor.model]``); ``recite``: a block
    near the request tail re-anchors the model on every request that has something to recite: the live plan, the
    user's prohibitions in force (stated in any user turn, not lifted by a later permission) once the turn stating
    them is no longer the last message, and the goal once the agent
    compacted its history (reference section 4, "Recitation"; ``proxyvisor.proxy.planning``).
    ``timeout_s``: seconds one planner call may take (then the plan is left as it was).
    """

    enabled: bool = True
    recite: bool = True
    timeout_s: float = positive(60.0)


@dataclass(frozen=True)
class SupervisorConfig:
    enabled: bool = True
    model: ModelConfig = field(default_factory=ModelConfig)
    condense: CondenseConfig = field(default_factory=CondenseConfig)
    detectors: DetectorsConfig = field(default_factory=DetectorsConfig)
    gate: GateConfig = field(default_factory=GateConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)


COMPLEXITY = ("CLEAR", "COMPLICATED", "COMPLEX", "CHAOTIC")
"""Complexity ranks, lowest first (seed 000). A request with no complexity is below every gate."""
ROUTING_MODES = ("explicit", "adaptive", "suggest")
FALLBACK_POLICIES = ("fail_closed", "same_adapter_default", "next_eligible")
ROLE_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


@dataclass(frozen=True)
class RouteTarget:
    """An adapter, model and effort; an empty field is inherited (see ``proxyvisor.adapters.routing``)."""

    adapter: str = ""
    model: str = ""
    effort: str = ""


@dataclass(frozen=True)
class RoleConfig:
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


@dataclass(frozen=True)
class CooldownConfig:
    default_seconds: float = positive(300.0)
    maximum_seconds: float = positive(3600.0)


@dataclass(frozen=True)
class ChildrenConfig:
    """Clocks and limits of child runs (seed 002)."""

    wall_clock_s: float = within(600.0, 30, 3600)
    idle_warn_s: float = positive(60.0)
    idle_cancel_s: float = positive(300.0)
    stop_grace_s: float = positive(5.0)
    claim_check_chars: int = within(6000, 1000)
    claim_retention_s: float = positive(604800.0)
    budget_tokens: int = 0


@dataclass(frozen=True)
class ModelRoutingConfig:
    """``[model_routing]``: delegation to child runtimes, routing policy and per-pool health (seed 000)."""

    enabled: bool = False
    mode: str = "explicit"
    complexity_threshold: str = "COMPLICATED"
    fallback_policy: str = "fail_closed"
    max_parallel: int = within(8, 1)
    max_depth: int = within(3, 1)
    adapters_dir: str = ""
    cooldown: CooldownConfig = field(default_factory=CooldownConfig)
    orchestrator: RouteTarget = field(default_factory=RouteTarget)
    children: ChildrenConfig = field(default_factory=ChildrenConfig)
    roles: tuple[RoleConfig, ...] = ()
    adapter_options: dict[str, dict[str, Any]] = field(default_factory=dict)

    def role(self, name: str) -> RoleConfig | None:
        return next((r for r in self.roles if r.name == name), None)


@dataclass(frozen=True)
class Config:
    proxy: ProxyConfig = field(default_factory=ProxyConfig)
    upstreams: tuple[UpstreamConfig, ...] = (UpstreamConfig(name="scripted"),)
    state: StateConfig = field(default_factory=StateConfig)
    supervisor: SupervisorConfig = field(default_factory=SupervisorConfig)
    model_routing: ModelRoutingConfig = field(default_factory=ModelRoutingConfig)
    source: str = "built-in defaults"

    def state_dir(self, env: dict[str, str] | None = None) -> Path:
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
        """A copy with some fields of ``proxy``, ``state`` or ``supervisor`` replaced (for CLI flags and tests)."""
        changes = {name: dataclasses.replace(getattr(self, name), **values) for name, values in sections.items()}
        return dataclasses.replace(self, **changes)


def _check_keys(table: dict[str, Any], cls: type, where: str, extra: tuple[str, ...] = ()) -> None:
    known = {f.name for f in dataclasses.fields(cls)} | set(extra)
    unknown = sorted(set(table) - known)
    if unknown:
        raise ConfigError(f"{where}: unknown setting(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")


def _build(cls: type, table: Any, where: str, **fixed: Any) -> Any:
    """Type-check ``table`` into ``cls``; a field whose default is a dataclass is a sub-table (``[where.name]``),
    built the same way. ``fixed`` fields are set as given (e.g. the table's own name)."""
    _check_keys(_table(table, where), cls, where, extra=())
    values: dict[str, Any] = dict(fixed)
    for f in dataclasses.fields(cls):
        if f.name not in table:
            continue
        value = table[f.name]
        default = f.default if f.default is not dataclasses.MISSING else None
        if f.default_factory is not dataclasses.MISSING and dataclasses.is_dataclass(kind := f.default_factory):
            values[f.name] = _build(kind, value, f"{where[:-1]}.{f.name}]")
            continue
        if isinstance(default, bool):
            ok = isinstance(value, bool)
        elif isinstance(default, float):
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
            value = float(value) if ok else value
        elif isinstance(default, int):
            ok = isinstance(value, int) and not isinstance(value, bool)
        elif isinstance(default, tuple):
            ok = isinstance(value, list) and all(isinstance(v, str) for v in value)
            value = tuple(value) if ok else value
        else:
            ok = isinstance(value, str)
        if not ok:
            expected = type(default).__name__ if default is not None else "string"
            raise ConfigError(f"{where}.{f.name}: expected {expected}, got {value!r}")
        values[f.name] = value
    return cls(**values)


def parse(document: dict[str, Any], source: str = "<memory>") -> Config:
    """Validate a parsed TOML document into a :class:`Config`.

    Raises:
        ConfigError: an unknown section or key, a value of the wrong type, or an invalid value; the message
            names ``source`` and the key.
    """
    known_sections = {"proxy", "upstreams", "state", "supervisor", "model_routing"}
    unknown = sorted(set(document) - known_sections)
    if unknown:
        raise ConfigError(f"{source}: unknown section(s) {', '.join(unknown)}")
    proxy = _build(ProxyConfig, document.get("proxy", {}), f"{source}: [proxy]")
    state = _build(StateConfig, document.get("state", {}), f"{source}: [state]")
    supervisor = _build(SupervisorConfig, document.get("supervisor", {}), f"{source}: [supervisor]")
    raw_upstreams = document.get("upstreams", {"scripted": {}})
    if not isinstance(raw_upstreams, dict) or not raw_upstreams:
        raise ConfigError(f"{source}: [upstreams] must hold at least one [upstreams.NAME] table")
    upstreams = []
    for name, table in raw_upstreams.items():
        if not isinstance(table, dict):
            raise ConfigError(f"{source}: [upstreams.{name}] must be a table")
        upstreams.append(_build(UpstreamConfig, table, f"{source}: [upstreams.{name}]", name=name))
    model_routing = parse_model_routing(document.get("model_routing", {}), f"{source}: [model_routing]")
    config = Config(proxy=proxy, upstreams=tuple(upstreams), state=state, supervisor=supervisor,
                    model_routing=model_routing, source=source)
    validate(config)
    return config


def _table(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ConfigError(f"{where} must be a table")
    return value


def validate_supervisor(supervisor: SupervisorConfig, where: str = "[supervisor]") -> None:
    """Check ``[supervisor.*]`` choices (numbers: :func:`validate`). Raises ConfigError naming the key at fault."""
    g = supervisor.gate
    checks = [
        (g.failure_policy in ("fail_open", "fail_closed"), "gate] failure_policy must be \"fail_open\" or "
                                                             "\"fail_closed\""),
        (g.hold in HOLDS, "gate] hold must be \"answer\" or \"stop\""),
        ("\n" not in g.unverified_notice.strip(), "gate] unverified_notice must be one line"),
    ]
    for ok, message in checks:
        if not ok:
            raise ConfigError(f"{where[:-1]}.{message}")


def parse_model_routing(table: Any, where: str = "[model_routing]") -> ModelRoutingConfig:
    """Type-check the ``[model_routing]`` table and its sub-tables into a :class:`ModelRoutingConfig`.

    Raises:
        ConfigError: an unknown key, a wrong type, or a sub-table that is not a table; the message names it.
    """
    table = dict(_table(table, where))
    roles = _table(table.pop("roles", {}), f"{where}.roles")
    adapter_options = _table(table.pop("adapter_options", {}), f"{where}.adapter_options")
    options: dict[str, dict[str, Any]] = {}
    for adapter, values in adapter_options.items():
        values = _table(values, f"{where}.adapter_options.{adapter}")
        for key, value in values.items():
            scalar = isinstance(value, (str, int, float, bool))
            if not scalar and not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
                raise ConfigError(f"{where}.adapter_options.{adapter}.{key}: expected a string, number, boolean "
                                  f"or list of strings, got {value!r}")
        options[adapter] = dict(values)
    return dataclasses.replace(
        _build(ModelRoutingConfig, table, where),
        roles=tuple(_build(RoleConfig, role, f"{where}.roles.{name}", name=name) for name, role in roles.items()),
        adapter_options=options)


def validate_model_routing(routing: ModelRoutingConfig, where: str = "[model_routing]") -> None:
    """Check ``[model_routing]`` values: enums, the order of related numbers (their ranges: :func:`validate`; a
    child's wall clock is 30 to 3,600 s, seed 002) and the supervision graph (known roles, no cycle, one supervisor each, depth; seed 004).

    Adapters, models and efforts are checked against the adapter descriptors when a policy is written and when a
    route is resolved, not here: a saved target whose adapter is gone must still load and show as unavailable.

    Raises:
        ConfigError: naming the key at fault.
    """
    from .adapters.graph import GraphError, check_graph

    for key, allowed in (("mode", ROUTING_MODES), ("complexity_threshold", COMPLEXITY),
                         ("fallback_policy", FALLBACK_POLICIES)):
        value = getattr(routing, key)
        if value not in allowed:
            raise ConfigError(f"{where} {key} must be one of {', '.join(allowed)}, got {value!r}")
    c = routing.cooldown
    if not c.default_seconds <= c.maximum_seconds:
        raise ConfigError(f"{where[:-1]}.cooldown] needs default_seconds <= maximum_seconds, got "
                          f"{c.default_seconds} and {c.maximum_seconds}")
    k = routing.children
    if not k.idle_warn_s <= k.idle_cancel_s:
        raise ConfigError(f"{where[:-1]}.children] needs idle_warn_s <= idle_cancel_s")
    bad = [r.name for r in routing.roles if not ROLE_NAME.match(r.name)]
    if bad:
        raise ConfigError(f"{where}.roles: each role becomes a delegation tool named after it, so a role name is 1-64 "
                          f"of A-Z, a-z, 0-9, _ and - (the tool-name rule of the model APIs); got {', '.join(bad)}")
    try:
        check_graph({r.name: r.supervises for r in routing.roles}, routing.max_depth)
    except GraphError as exc:
        raise ConfigError(f"{where}.roles: {exc}") from None


def numeric_settings(config: Config) -> Iterator[tuple[tuple[str, ...], str, float, Range]]:
    """Every numeric setting of ``config`` (ints and floats, not booleans), as (the path of its table, e.g.
    ``("upstreams", "main")``, its key, its value, its :class:`Range`)."""

    def walk(obj: Any, path: tuple[str, ...]) -> Iterator[tuple[tuple[str, ...], str, float, Range]]:
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if dataclasses.is_dataclass(value):
                yield from walk(value, path + (f.name,))
            elif isinstance(value, tuple) and value and all(dataclasses.is_dataclass(v) for v in value):
                for item in value:
                    yield from walk(item, path + (f.name, item.name))
            elif isinstance(value, (int, float)) and not isinstance(value, bool):
                yield path, f.name, value, f.metadata.get(_RANGE, Range())

    return walk(config, ())


def validate(config: Config) -> None:
    """Check the values that types alone cannot: every number against its :class:`Range`, then formats, choices
    and the bind rule.

    Raises:
        ConfigError: with the source and the key at fault.
    """
    where = config.source
    for path, key, value, allowed in numeric_settings(config):
        if not allowed.admits(value):
            finite = "" if math.isfinite(value) else " (every number in the configuration must be finite)"
            raise ConfigError(f"{where}: [{'.'.join(path)}] {key} must be {allowed}, got {value!r}{finite}")
    p = config.proxy
    if not is_loopback(p.host) and not p.auth_token:
        raise ConfigError(
            f"{where}: [proxy] host = {p.host!r} is not a loopback address; binding elsewhere requires "
            "[proxy] auth_token (clients then send it as 'x-proxyvisor-auth')"
        )
    for u in config.upstreams:
        bad = [f for f in u.formats if f not in FORMATS]
        if bad or not u.formats:
            raise ConfigError(f"{where}: [upstreams.{u.name}] formats must be a non-empty subset of {list(FORMATS)}")
        if not u.scripted and not u.url.startswith(("http://", "https://")):
            raise ConfigError(
                f"{where}: [upstreams.{u.name}] url must be http(s)://... or {SCRIPTED_URL!r}, got {u.url!r}"
            )
    if config.supervisor.model.api_base == SCRIPTED_URL and not any(u.scripted for u in config.upstreams):
        raise ConfigError(f"{where}: [supervisor.model] api_base = {SCRIPTED_URL!r} is the embedded scripted "
                          f"upstream, but no [upstreams.NAME] has url = {SCRIPTED_URL!r}")
    validate_supervisor(config.supervisor, f"{where}: [supervisor]")
    validate_model_routing(config.model_routing, f"{where}: [model_routing]")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def find_config_file(explicit: str | None, env: dict[str, str] | None = None) -> Path | None:
    env = os.environ if env is None else env
    if explicit:
        return Path(explicit).expanduser()
    if env.get("PROXYVISOR_CONFIG"):
        return Path(env["PROXYVISOR_CONFIG"]).expanduser()
    candidate = default_config_path(env)
    return candidate if candidate.exists() else None


def default_config_path(env: dict[str, str] | None = None) -> Path:
    """``$XDG_CONFIG_HOME/proxyvisor/config.toml`` (``~/.config/proxyvisor/config.toml``), existing or not."""
    env = os.environ if env is None else env
    base = env.get("XDG_CONFIG_HOME") or os.path.join(env.get("HOME", "~"), ".config")
    return Path(base).expanduser() / "proxyvisor" / "config.toml"


def load(explicit: str | None = None, env: dict[str, str] | None = None) -> Config:
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
    return dataclasses.replace(config, upstreams=tuple(
        dataclasses.replace(u, script=str(path.parent / Path(u.script).expanduser())) if u.script else u
        for u in config.upstreams))
