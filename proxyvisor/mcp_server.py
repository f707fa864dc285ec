"""``proxyvisor mcp``: proxyvisor's questions and controls as MCP tools, served on stdio with the official MCP SDK.

Each tool is a command's own code path, answered as the command's ``--json`` object (``structuredContent``, and the
same JSON as text for clients that read only text):

- ``session_info`` / ``session_plan``: :func:`proxyvisor.info_cli.session_info` / :func:`~proxyvisor.info_cli.session_plan`
  (the running proxy first; ``info`` falls back to the ledger, ``plan`` to the session's stored state);
- ``routing_config``: :func:`proxyvisor.adapters.overview.routing_json` to show,
  :func:`proxyvisor.routing_cli.write_policy` to enable, disable or set (the descriptors' write-time validation, the
  lock, the atomic write);
- ``pool_health``: :func:`proxyvisor.adapters.overview.health_json` over the state directory's breakers;
- ``delegate``: :meth:`proxyvisor.adapters.delegate.Delegator.delegate`, one delegator per call as one
  ``proxyvisor delegate`` run.

The configuration is loaded again for every call (``routing_config`` may have just changed it). The server runs on
trio through anyio, proxyvisor's own event loop, so ``delegate`` awaits the delegator directly and a call the client
cancels stops its child; the blocking parts of the other tools (HTTP to the proxy, reading files, an adapter's
readiness check) run in a worker thread. A refusal, bad input or a failed child is a tool error whose text says why
(:class:`ToolError`); anything unexpected is the SDK's generic tool error, logged on one line.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

import anyio
import orjson
import trio
from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp_types import CallToolResult, TextContent, ToolAnnotations
from pydantic import Field

from . import __version__
from .config import Config, ConfigError, RouteTarget
from .rules import Complexity, FallbackPolicy, RoutingMode
from .store import SESSION_ID

log = logging.getLogger("proxyvisor.mcp")

T = TypeVar("T")

INSTRUCTIONS = (
    "proxyvisor supervises this agent's model requests (self-report, loop detectors and steer notes, a verify-gate "
    "for turn-ending answers, condensed tool output) and can delegate work to child runtimes by role. "
    "session_info and session_plan answer for the current session (the one proxyvisor wrap runs this agent in) "
    "unless a session is named; routing_config shows or changes the delegation policy; pool_health shows the "
    "model pools' breakers; delegate runs one child for a role.")

_SESSION = Annotated[str | None, Field(
    description="the session id (1-128 of A-Z a-z 0-9 . _ -); default: the current session, the one proxyvisor wrap "
                "runs this agent in ($PROXYVISOR_SESSION), else the most recently active one")]


def _wrapped() -> tuple[str | None, str | None]:
    """``(the proxy's http(s)://HOST:PORT, the session)`` that ``proxyvisor wrap`` and ``batch`` give the agent they
    run in ``PROXYVISOR_URL`` (``http://127.0.0.1:PORT/r/RUN``, ``.../s/SESSION``) and ``PROXYVISOR_SESSION`` (the
    session; under ``wrap`` without ``--session``, the run's id, which names the run's current session to its
    proxy); None for what is unset or malformed (logged)."""
    from .info_cli import proxy_origin

    url, session = os.environ.get("PROXYVISOR_URL", ""), os.environ.get("PROXYVISOR_SESSION", "")
    origin = proxy_origin(url, session_path=True) if url else None
    if url and origin is None:
        log.warning("PROXYVISOR_URL is no http(s)://HOST[:PORT] URL without a user or password: ignored")
    if session and not SESSION_ID.match(session):
        log.warning("PROXYVISOR_SESSION is no session id: ignored")
        session = ""
    return origin, session or None


class Tools:
    """The tools' shared state: how to load the configuration, the file ``routing_config`` writes, the proxy to
    ask (None: the one of the environment or the configuration) and the current session."""

    def __init__(self, load: Callable[[], Config], config_path: Path, url: str | None) -> None:
        self.load = load
        self.config_path = config_path
        env_url, self.current = _wrapped()
        self.url = url or env_url

    def config(self) -> Config:
        try:
            return self.load()
        except ConfigError as exc:
            raise ToolError(f"configuration error: {exc}") from None

    def session(self, named: str | None) -> str | None:
        if named is None or named == "":
            return self.current
        if not SESSION_ID.match(named):
            raise ToolError(f"invalid session id {named!r}: use 1-128 of [A-Za-z0-9._-], starting with a letter or "
                            "digit")
        return named

    async def blocking(self, fn: Callable[[], T]) -> T:
        """``fn()`` in a worker thread, its refusals and I/O errors turned into tool errors."""
        from .adapters.descriptors import TargetError
        from .adapters.settings import SettingsError
        from .info_cli import Refused
        from .store import StoreUnusable

        try:
            return await trio.to_thread.run_sync(fn)
        except (Refused, SettingsError, TargetError, StoreUnusable) as exc:
            raise ToolError(str(exc)) from None
        except OSError as exc:
            raise ToolError(f"{exc.strerror or exc}" + (f": {exc.filename}" if exc.filename else "")) from None

    async def session_info(self, session: _SESSION = None) -> dict[str, Any]:
        from .info_cli import session_info

        config, named = self.config(), self.session(session)
        info, note = await self.blocking(lambda: session_info(config, named, self.url))
        if note:
            log.info("%s", note)
        return info

    async def session_plan(self, session: _SESSION = None) -> dict[str, Any]:
        from .info_cli import session_plan

        config, named = self.config(), self.session(session)
        plan, _, note = await self.blocking(lambda: session_plan(config, named, self.url, "'proxyvisor mcp --url'"))
        if plan is None:
            raise ToolError(note)
        if note:
            log.info("%s", note)
        return plan

    async def routing_config(
            self,
            action: Annotated[Literal["show", "enable", "disable", "set"], Field(
                description="show: the policy, each role's resolved route and the adapters' readiness; enable / "
                            "disable: turn delegation on or off; set: change the fields given (the others stay)")] = "show",
            mode: Annotated[RoutingMode | None, Field(
                description="set: when the policy applies: explicit = always, adaptive = at or above "
                            "complexity_threshold, suggest = return the route, run nothing")] = None,
            complexity_threshold: Annotated[Complexity | None, Field(
                description="set: the lowest complexity adaptive mode delegates")] = None,
            fallback_policy: Annotated[FallbackPolicy | None, Field(
                description="set: when the route's pool is cooling down: fail_closed = refuse, same_adapter_default "
                            "= the adapter's default model, next_eligible = another adapter of the policy")] = None,
            max_parallel: Annotated[int | None, Field(description="set: most child runs alive at once")] = None,
            max_depth: Annotated[int | None, Field(description="set: longest delegation chain in hops")] = None,
            cooldown_default: Annotated[float | None, Field(
                description="set: seconds of a pool's first cooldown without a Retry-After (doubled per trip)")] = None,
            cooldown_maximum: Annotated[float | None, Field(description="set: longest cooldown, seconds")] = None,
            wall_clock: Annotated[float | None, Field(description="set: a child's wall-clock limit, seconds")] = None,
            orchestrator_adapter: Annotated[str | None, Field(
                description="set: the adapter of every role without one of its own (\"\" removes it)")] = None,
            orchestrator_model: Annotated[str | None, Field(
                description="set: the model of every role without one of its own (\"\" removes it)")] = None,
            orchestrator_effort: Annotated[str | None, Field(
                description="set: the effort of every role without one of its own (\"\" removes it)")] = None,
            role: Annotated[str | None, Field(
                description="set: the role the role_* fields change (created if new)")] = None,
            role_adapter: Annotated[str | None, Field(
                description="set: the role's adapter (\"\": the orchestrator's)")] = None,
            role_model: Annotated[str | None, Field(
                description="set: the role's model; alone, it also sets the adapter declaring it (\"\": the "
                            "orchestrator's)")] = None,
            role_effort: Annotated[str | None, Field(
                description="set: the role's effort, one its adapter declares (\"\": the orchestrator's)")] = None,
            role_description: Annotated[str | None, Field(
                description="set: what the role does (the description of its tool, which a model reads)")] = None,
            role_supervises: Annotated[list[str] | None, Field(
                description="set: the roles this role may delegate to (replaces the list; [] = none)")] = None,
            remove_role: Annotated[str | None, Field(description="set: a role to delete")] = None,
    ) -> dict[str, Any]:
        from .adapters.descriptors import registry_for
        from .adapters.overview import routing_json
        from .routing_cli import write_policy

        config = self.config()
        fields = {"mode": mode, "complexity_threshold": complexity_threshold, "fallback_policy": fallback_policy,
                  "max_parallel": max_parallel, "max_depth": max_depth, "cooldown_default": cooldown_default,
                  "cooldown_maximum": cooldown_maximum, "wall_clock": wall_clock,
                  "orchestrator_adapter": orchestrator_adapter, "orchestrator_model": orchestrator_model,
                  "orchestrator_effort": orchestrator_effort, "role": role, "role_adapter": role_adapter,
                  "role_model": role_model, "role_effort": role_effort, "role_description": role_description,
                  "role_supervises": None if role_supervises is None else ",".join(role_supervises),
                  "remove_role": remove_role}
        given = [name for name, value in fields.items() if value is not None]
        if action != "set" and given:
            raise ToolError(f"{', '.join(given)}: fields are for action set, not {action}; nothing written")
        if action == "show":
            return await self.blocking(lambda: routing_json(config, registry_for(config.model_routing.adapters_dir)))
        if action == "set" and not given:
            raise ToolError("set changes the fields given, and none was given; nothing written")
        registry = registry_for(config.model_routing.adapters_dir)
        await self.blocking(lambda: write_policy(self.config_path, action, fields, registry))
        written = self.config()
        shown = await self.blocking(lambda: routing_json(written, registry_for(written.model_routing.adapters_dir)))
        return {"written": str(self.config_path), **shown}

    async def pool_health(self) -> dict[str, Any]:
        from .adapters.health_store import routing_health
        from .adapters.overview import health_json
        from .adapters.state import backend_of

        config = self.config()

        def report() -> dict[str, Any]:
            store = routing_health(backend_of(config), config.model_routing.cooldown)
            try:
                return health_json(store.all(), time.time())
            finally:
                store.close()

        return await self.blocking(report)

    async def delegate(
            self,
            role: Annotated[str, Field(description="the role to run: one of routing_config's roles")],
            prompt: Annotated[str, Field(description="the child's task: all the child receives (no context of yours "
                                                     "passes through)")],
            complexity: Annotated[Complexity | None, Field(
                description="the task's complexity; in adaptive mode a child runs only at or above the policy's "
                            "complexity_threshold (default: none, below every threshold)")] = None,
            adapter: Annotated[str | None, Field(description="run on this adapter instead of the role's")] = None,
            model: Annotated[str | None, Field(description="run on this model instead of the role's")] = None,
            effort: Annotated[str | None, Field(description="run at this effort instead of the role's")] = None,
    ) -> CallToolResult:
        from .adapters.delegate import OK, SKIPPED, Delegator

        config = self.config()
        if not config.model_routing.enabled:
            raise ToolError("delegation is disabled; nothing ran (turn it on: routing_config with action enable, "
                            "or proxyvisor routing enable)")
        if not role or not prompt:
            raise ToolError("delegate needs a role and a prompt")
        delegator = Delegator(config)
        try:
            result = await delegator.delegate(role, prompt, complexity=complexity,
                                              override=RouteTarget(adapter or "", model or "", effort or ""),
                                              traceparent=os.environ.get("TRACEPARENT"))
        finally:
            delegator.close()
        answer = result.as_dict()
        if result.status in (OK, SKIPPED):
            text = orjson.dumps(answer, option=orjson.OPT_INDENT_2).decode()
        elif result.reason:  # nothing ran: why, as the command says it
            text = f"nothing ran: {result.reason.removeprefix('invalid: ')}"
        else:
            text = result.result.as_text()
        return CallToolResult(content=[TextContent(type="text", text=text)], structured_content=answer,
                              is_error=result.status not in (OK, SKIPPED))


def build(tools: Tools) -> MCPServer[Any]:
    """The MCP server with every tool of ``tools`` registered, schemas and descriptions from their signatures."""
    server: MCPServer[Any] = MCPServer("proxyvisor", version=__version__, instructions=INSTRUCTIONS)
    read_only = ToolAnnotations(read_only_hint=True, open_world_hint=False)
    server.add_tool(tools.session_info, "session_info", structured_output=True, annotations=read_only, description=(
        "The /info object of a session: model requests, tool rounds and errors; self-reports by state; detector "
        "fires and steer notes; verify-gate passes, gaps, nudges, re-entries and turn outcomes; condensed tool "
        "results and tokens saved; supervisor model calls; delegations; upstream tokens and cost; proxy overhead. "
        "From the running proxy, else summed from the session's ledger (then live is null)."))
    server.add_tool(tools.session_plan, "session_plan", structured_output=True, annotations=read_only, description=(
        "The /plan object of a session: the supervisor-owned plan with each phase's status and done-when condition "
        "(plan null: no plan yet), the user's prohibitions in force with the turn that stated each, and the "
        "retained critical knowledge (carry); text is the plan as the agent's /plan shows it. From the running proxy, "
        "else from the session's state stored in the state directory."))
    server.add_tool(tools.routing_config, "routing_config", structured_output=True, description=(
        "Show or change the delegation and routing policy ([model_routing] of proxyvisor's configuration file). "
        "show returns source, enabled, policy, resolved (each role's adapter, model, effort and pool, or why it is "
        "unavailable), adapters (readiness, capabilities, models, efforts) and descriptor_errors; enable, disable "
        "and set write the file and return the same with written (the file's path). Every write is checked "
        "against the adapter descriptors first: an unknown adapter, a model the adapter does not declare or an "
        "effort it does not take is refused with the reason, and nothing is written."),
        annotations=ToolAnnotations(destructive_hint=False, idempotent_hint=True, open_world_hint=False))
    server.add_tool(tools.pool_health, "pool_health", structured_output=True, annotations=read_only, description=(
        "Every model pool's breaker: pools (pool, state healthy | cooling_down | half_open, failure_count, "
        "recovers_in_s, probe_in_flight, last_category, retry_after_s) and adapters (summary state, soonest "
        "recovery, limited pools). Pools: delegated children's <adapter>:<bucket> and the agent's own "
        "upstream:<name>:<model>. A pool never seen is healthy and not listed."))
    server.add_tool(tools.delegate, "delegate", description=(
        "Run one child for a role on the runtime the routing policy resolves, under the pool breaker, the child's "
        "clocks and the claim check, and return status (ok, skipped in suggest mode, failed, refused, invalid, "
        "unsupervised), result (the child's text; {text, finish_reason} when stopped or truncated), is_error, "
        "evidence (route, tokens, attempts, trace), proposed_route, record_id (a long result's claim check) and "
        "dead_letter. A child that failed or was refused is a tool error naming why. Delegation must be enabled."),
        annotations=ToolAnnotations(read_only_hint=False, destructive_hint=False, open_world_hint=True))
    return server


def serve(load: Callable[[], Config], config_path: Path, url: str | None) -> int:
    """Serve the tools on stdin/stdout until the client closes them; returns the exit code (0).

    ``load()`` returns the current, validated configuration (raises ConfigError); ``config_path`` is the file
    ``routing_config`` writes; ``url`` the proxy to ask (None: ``$PROXYVISOR_URL``'s, else the configuration's)."""
    server = build(Tools(load, config_path, url))
    anyio.run(server.run_stdio_async, backend="trio")
    return 0
