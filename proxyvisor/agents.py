"""Agent CLIs that ``proxyvisor wrap`` must point at the proxy by argument, because they ignore the variables.

``wrap`` gives every command ``ANTHROPIC_BASE_URL``, ``OPENAI_BASE_URL`` and ``OPENAI_API_BASE``
(:func:`proxyvisor.wrap.agent_env`); Claude Code, opencode, aider and the OpenAI and Anthropic SDKs follow them
(opencode's providers append ``/messages`` or ``/chat/completions`` to them: the proxy takes either with or
without ``/v1``). :data:`KNOWN`
lists the CLIs that do not, by executable name, each with a function giving the arguments that redirect it (and
the environment variables it needs besides, if any). A
command is recognised by the file name of its first word (``codex``, ``/usr/local/bin/codex``), not behind
``env``, ``npx`` or a shell; those can use the variables by hand, e.g. ``sh -c 'codex -c
openai_base_url="$OPENAI_BASE_URL" exec ...'``.
"""

from __future__ import annotations

import json
import logging
import re
import tomllib
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

log = logging.getLogger("proxyvisor.agents")

Redirect = Callable[[str, Mapping[str, str], Sequence[str]], tuple[list[str], dict[str, str]]]
"""``(openai_base_url, agent env, the user's arguments) -> (arguments to insert right after the executable,
variables to set in the agent's environment)``."""

CODEX_QUIET_WEBSOCKET = "codex_api::endpoint::responses_websocket=off"
"""The ``RUST_LOG`` directive that silences Codex's log of a refused Responses WebSocket. The built-in ``openai``
provider asks for a WebSocket first (a provider setting ``-c`` cannot change); the proxy answers 426, on which
Codex falls back to HTTP at once, once per session, and costs one loopback round trip, but ``codex exec`` first
logs ``ERROR codex_api::endpoint::responses_websocket: failed to connect to Responses WebSocket`` on stderr (its
log filter is ``RUST_LOG``, default ``error``). Nothing else is logged from that module through the proxy, which
never serves a WebSocket."""

# Codex splits a `-c` key on dots, so only a bare TOML key can name a provider in one.
_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+\Z")


def codex(openai_base_url: str, env: Mapping[str, str], args: Sequence[str]) -> tuple[list[str], dict[str, str]]:
    """``-c`` overrides pointing OpenAI Codex's providers at ``openai_base_url`` (observed with Codex 0.171.0).

    Codex ignores ``OPENAI_BASE_URL``: its built-in ``openai`` provider takes the ``openai_base_url`` key, and a
    provider of the user's own, ``[model_providers.NAME]`` in ``$CODEX_HOME/config.toml`` (default
    ``~/.codex``), takes ``model_providers.NAME.base_url``. Codex rejects that key for a provider it has not
    loaded, so only the providers defined in that file are redirected, and none under ``--ignore-user-config``;
    providers defined only in a ``--profile`` file keep their URL. The overrides go before the user's
    arguments, so the user's own ``-c`` options, which Codex applies later, still win.

    For ``codex exec`` (or ``e``), ``RUST_LOG`` gets :data:`CODEX_QUIET_WEBSOCKET` after the user's own value
    (default ``error``, as ``codex exec``'s); the interactive TUI logs to a file, so its ``RUST_LOG`` is left alone.
    """
    overrides = [f"openai_base_url={_toml_string(openai_base_url)}"]
    if "--ignore-user-config" not in args:
        home = Path(env["CODEX_HOME"]) if env.get("CODEX_HOME") else Path(env.get("HOME") or Path.home(), ".codex")
        overrides += [f"model_providers.{name}.base_url={_toml_string(openai_base_url)}"
                      for name in _defined_providers(home / "config.toml")]
    variables = {}
    if "exec" in args or "e" in args:
        variables["RUST_LOG"] = f"{env.get('RUST_LOG') or 'error'},{CODEX_QUIET_WEBSOCKET}"
    return [arg for override in overrides for arg in ("-c", override)], variables


KNOWN: dict[str, Redirect] = {"codex": codex}


def agent_command(cmd: Sequence[str], openai_base_url: str,
                  env: Mapping[str, str]) -> tuple[list[str], dict[str, str]]:
    """``cmd`` and ``env`` with the arguments and variables that point it at the proxy if it is a :data:`KNOWN`
    CLI, else both as they are (``env`` copied).

    ``openai_base_url`` is the OpenAI-style base URL (ending in ``/v1``); ``env`` is the agent's environment.
    """
    redirect = KNOWN.get(Path(cmd[0]).name) if cmd else None
    if redirect is None:
        return list(cmd), dict(env)
    extra, variables = redirect(openai_base_url, env, cmd[1:])
    log.info("%s: added %s", cmd[0], " ".join([*extra, *(f"{k}={v}" for k, v in variables.items())]))
    return [cmd[0], *extra, *cmd[1:]], {**env, **variables}


def _defined_providers(config: Path) -> list[str]:
    """Names under ``[model_providers]`` in Codex's ``config``; none when it is missing or invalid (Codex then
    reports the file itself)."""
    try:
        providers = tomllib.loads(config.read_text(encoding="utf-8")).get("model_providers")
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        return []
    if not isinstance(providers, dict):
        return []
    bare = [name for name in providers if _BARE_KEY.match(name)]
    for name in providers.keys() - set(bare):
        log.warning("Codex's provider %r (%s) cannot be pointed at proxyvisor: a -c option names only a provider "
                    "whose name is letters, digits, '_' and '-'; its requests go to its own base_url, past "
                    "proxyvisor (rename it, or set its base_url to the proxy's URL yourself)", name, config)
    return bare


def _toml_string(value: str) -> str:
    # For ASCII text (a URL) a JSON string is a valid TOML basic string; Codex parses a `-c` value as TOML.
    return json.dumps(value)


__all__ = ["CODEX_QUIET_WEBSOCKET", "KNOWN", "agent_command", "codex"]
