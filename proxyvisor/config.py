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
import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

FORMATS = ("chat", "messages", "responses")
"""The three wire formats: OpenAI Chat Completions, Anthropic Messages, OpenAI Responses."""

SCRIPTED_URL = "scripted:"
"""The ``url`` of an upstream that proxyvisor plays itself from a script (no network, no key)."""


class ConfigError(ValueError):
    """The configuration file is missing, unreadable, not TOML, or holds an invalid or unknown setting.

    The message names the file and the offending key; proxyvisor refuses to start rather than guess.
    """


@dataclass(frozen=True)
class ProxyConfig:
    host: str = "127.0.0.1"
    port: int = 8377
    max_body_bytes: int = 32 * 1024 * 1024
    auth_token: str = ""
    request_header_timeout_s: float = 30.0
    keepalive_timeout_s: float = 75.0


@dataclass(frozen=True)
class UpstreamConfig:
    name: str
    url: str = SCRIPTED_URL
    formats: tuple[str, ...] = FORMATS
    api_key_env: str = ""
    connect_timeout_s: float = 10.0
    first_byte_timeout_s: float = 600.0
    idle_timeout_s: float = 300.0
    script: str = ""
    chunk_delay_ms: float = 0.0

    @property
    def scripted(self) -> bool:
        return self.url == SCRIPTED_URL


@dataclass(frozen=True)
class StateConfig:
    dir: str = ""
    session_idle_s: float = 3600.0
    max_sessions: int = 1024


@dataclass(frozen=True)
class SupervisorConfig:
    enabled: bool = True


@dataclass(frozen=True)
class Config:
    proxy: ProxyConfig = field(default_factory=ProxyConfig)
    upstreams: tuple[UpstreamConfig, ...] = (UpstreamConfig(name="scripted"),)
    state: StateConfig = field(default_factory=StateConfig)
    supervisor: SupervisorConfig = field(default_factory=SupervisorConfig)
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


def _build(cls: type, table: dict[str, Any], where: str, **fixed: Any) -> Any:
    _check_keys(table, cls, where, extra=())
    values: dict[str, Any] = dict(fixed)
    for f in dataclasses.fields(cls):
        if f.name not in table:
            continue
        value = table[f.name]
        default = f.default if f.default is not dataclasses.MISSING else None
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
    known_sections = {"proxy", "upstreams", "state", "supervisor"}
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
    config = Config(proxy=proxy, upstreams=tuple(upstreams), state=state, supervisor=supervisor, source=source)
    validate(config)
    return config


def validate(config: Config) -> None:
    """Check the values that types alone cannot (ranges, formats, the bind rule).

    Raises:
        ConfigError: with the source and the key at fault.
    """
    where = config.source
    p = config.proxy
    if not 0 <= p.port <= 65535:
        raise ConfigError(f"{where}: [proxy] port must be 0-65535, got {p.port}")
    if p.max_body_bytes < 1024:
        raise ConfigError(f"{where}: [proxy] max_body_bytes must be at least 1024, got {p.max_body_bytes}")
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
        for key in ("connect_timeout_s", "first_byte_timeout_s", "idle_timeout_s"):
            if getattr(u, key) <= 0:
                raise ConfigError(f"{where}: [upstreams.{u.name}] {key} must be > 0")
    if config.state.session_idle_s <= 0 or config.state.max_sessions < 1:
        raise ConfigError(f"{where}: [state] session_idle_s must be > 0 and max_sessions >= 1")


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
    base = env.get("XDG_CONFIG_HOME") or os.path.join(env.get("HOME", "~"), ".config")
    candidate = Path(base).expanduser() / "proxyvisor" / "config.toml"
    return candidate if candidate.exists() else None


def load(explicit: str | None = None, env: dict[str, str] | None = None) -> Config:
    """Find, read and validate the configuration (see the module docstring for the search order).

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
    return parse(document, source=str(path))
