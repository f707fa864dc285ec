"""``proxyvisor wrap``: run an agent command through a private proxy on a free loopback port.

The proxy lives in this process; the agent is a child process whose base-URL variables point at the proxy under
a fresh session prefix (``/s/{session}``, 128 random bits), so its requests are one session however the agent
identifies itself. Agent CLIs that ignore those variables get arguments instead (:mod:`proxyvisor.agents`).
"""

from __future__ import annotations

import os
import secrets
import signal
import sys

import trio

from .agents import agent_command
from .config import Config
from .proxy.service import RunningProxy, running, tune_gc
from .proxy.sessions import SESSION_ID
from .serve import start_notices, stop_notices
from .supervisor_model import describe

_FORWARDED = (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)


def agent_env(proxy_url: str, session: str, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for the wrapped agent: ``base`` (default: ours) plus the base-URL variables."""
    env = dict(os.environ if base is None else base)
    prefix = f"{proxy_url}/s/{session}"
    env.update({"ANTHROPIC_BASE_URL": prefix, "OPENAI_BASE_URL": prefix + "/v1", "OPENAI_API_BASE": prefix + "/v1",
                "PROXYVISOR_URL": prefix, "PROXYVISOR_SESSION": session})
    return env


def agent_invocation(proxy_url: str, session: str, cmd: list[str],
                     base: dict[str, str] | None = None) -> tuple[list[str], dict[str, str]]:
    """The command and environment that run ``cmd`` as session ``session`` of the proxy at ``proxy_url``: the
    base-URL variables of :func:`agent_env` (over ``base``, default ours), and for a CLI that ignores them the
    arguments and variables of :func:`proxyvisor.agents.agent_command`. Used by ``wrap`` and ``batch``."""
    env = agent_env(proxy_url, session, base)
    return agent_command(cmd, env["OPENAI_BASE_URL"], env)


def summary(proxy: RunningProxy, session: str) -> str:
    s = proxy.pipeline.sessions.get(session)
    if s is None:
        return f"proxyvisor: session {session}: no model requests seen"
    return (f"proxyvisor: session {session}: {s.requests} requests ({', '.join(sorted(s.formats))}), "
            f"{s.input_tokens} input / {s.output_tokens} output tokens, {s.errors} errors, "
            f"proxy overhead {s.overhead_ms:.1f} ms in all")


async def _wrap(config: Config, cmd: list[str], session: str, quiet: bool) -> int:
    async with running(config, port=0) as proxy:
        for notice in start_notices(config):
            print(notice, file=sys.stderr, flush=True)
        if not quiet and config.supervisor.enabled:
            print(f"proxyvisor: supervisor model: {describe(config.supervisor.model)}", file=sys.stderr, flush=True)
        cmd, env = agent_invocation(proxy.url, session, cmd)
        async with trio.open_nursery() as nursery:
            try:
                process = await nursery.start(lambda task_status: trio.run_process(
                    cmd, stdin=None, check=False, env=env, task_status=task_status))
            except OSError as exc:
                print(f"proxyvisor: cannot run {cmd[0]!r}: {exc.strerror or exc}", file=sys.stderr)
                nursery.cancel_scope.cancel()
                return 127

            async def forward_signals() -> None:
                with trio.open_signal_receiver(*_FORWARDED, signal.SIGINT) as signals:
                    async for signum in signals:
                        # A terminal's Ctrl-C already reached the agent: it shares our process group.
                        if signum != signal.SIGINT and process.returncode is None:
                            process.send_signal(signum)

            nursery.start_soon(forward_signals)
            await process.wait()
            nursery.cancel_scope.cancel()
        if not quiet and config.supervisor.enabled:
            print(summary(proxy, session), file=sys.stderr)
        for notice in stop_notices(proxy):
            print(notice, file=sys.stderr)
        code = process.returncode
        return 128 - code if code < 0 else code


def wrap(config: Config, cmd: list[str], session: str | None = None, quiet: bool = False) -> int:
    """Run ``cmd`` through a private proxy; returns its exit code (128+N when killed by signal N).

    Raises:
        ValueError: ``session`` is not a valid session id.
    """
    session = session or secrets.token_hex(16)
    if not SESSION_ID.match(session):
        raise ValueError(f"invalid session id {session!r}: use 1-128 of [A-Za-z0-9._-]")
    tune_gc()
    return trio.run(_wrap, config, cmd, session, quiet)


__all__ = ["agent_env", "agent_invocation", "wrap"]
