"""``proxyvisor wrap``: run an agent command through a private proxy on a free loopback port.

The proxy lives in this process; the agent is a child process whose base-URL variables point at the proxy under
a fresh run prefix (``/r/{run}``, 128 random bits; :mod:`proxyvisor.proxy.sessions`): a request that names its own
session (Claude Code's session id, which ``claude --resume`` keeps) belongs to that session, as under ``serve``, so
a resumed conversation goes on in the session of the runs before; one that names none is session ``{run}``. Every
request is recorded with the run, so the exit summary counts this run's own. ``--session NAME`` forces the session
(``/r/{run}/s/{NAME}``). Agent CLIs that ignore those variables get arguments instead (:mod:`proxyvisor.agents`).
"""

from __future__ import annotations

import math
import os
import secrets
import signal
import sys
import time

import trio

from .agents import agent_command
from .config import Config
from .proxy.info import (authorizer_text, counts_text, delegations_text, memory_text, plural, pools_text, summarize,
                         supervisor_text, upstream_cost)
from .proxy.learning import SessionLearning
from .proxy.service import RunningProxy, running, tune_runtime
from .store import SESSION_ID
from .store import LedgerError
from .serve import start_notices, stop_notices
from .supervisor_model import describe

_FORWARDED = (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)


def agent_env(proxy_url: str, session: str | None, base: dict[str, str] | None = None,
              run: str | None = None) -> dict[str, str]:
    """The environment for the wrapped agent: ``base`` (default: ours) plus the base-URL variables, under the run
    prefix ``/r/{run}`` and the session prefix ``/s/{session}`` (forced), each when given (at least one is), and
    ``PROXYVISOR_SESSION``: the session, else the run (whose id names its latest session to the session endpoints,
    ``proxyvisor.proxy.commands``)."""
    env = dict(os.environ if base is None else base)
    prefix = proxy_url + (f"/r/{run}" if run else "") + (f"/s/{session}" if session else "")
    env.update({"ANTHROPIC_BASE_URL": prefix, "OPENAI_BASE_URL": prefix + "/v1", "OPENAI_API_BASE": prefix + "/v1",
                "PROXYVISOR_URL": prefix, "PROXYVISOR_SESSION": session or run or ""})
    return env


def agent_invocation(proxy_url: str, session: str | None, cmd: list[str], base: dict[str, str] | None = None,
                     run: str | None = None) -> tuple[list[str], dict[str, str]]:
    """The command and environment that run ``cmd`` through the proxy at ``proxy_url`` as session ``session``
    and/or run ``run`` (:func:`agent_env`, over ``base``, default ours), and for a CLI that ignores the base-URL
    variables the arguments and variables of :func:`proxyvisor.agents.agent_command`. Used by ``wrap`` and
    ``batch``."""
    env = agent_env(proxy_url, session, base, run)
    return agent_command(cmd, env["OPENAI_BASE_URL"], env)


def summary(proxy: RunningProxy, run: str, session: str | None = None) -> list[str]:
    """The lines ``wrap`` prints at exit for run ``run`` on ``proxy``: :func:`_session_summary` of each session the
    run's requests went to (one, normally), else a line saying the session (``session``, else the run's own) saw
    no model requests."""
    return [line for sid in proxy.pipeline.sessions.sessions_of(run) or [session or run]
            for line in _session_summary(proxy, sid, run)]


def _session_summary(proxy: RunningProxy, session: str, run: str) -> list[str]:
    """The summary lines of what run ``run`` did in ``session`` on ``proxy``. With supervision on, from the
    session's ledger lines of that run (those of other runs, of a session resumed or a ``--session`` reused, count
    only in a note of the session's total; :func:`proxyvisor.proxy.info.summarize`): model requests, errors
    and tool rounds, upstream tokens and cost, what supervision did (self-reports, detector fires and steer notes by
    signal, gate outcomes, condensed results and tokens saved, supervisor model calls with tokens, cost and time;
    the tool authorizer's counts once it saw a tool-call batch; the upstream pools once one refused, failed or was
    stood in for by a fallback; the delegations once one ran; what learning recalled, stored and asked, from the
    session's live counters, else the ledger) and the proxy overhead; the questions proxyvisor answered itself (``/info``,
    ``/plan``). With it off, the in-memory counts of the byte relay: requests, errors, overhead."""
    head = f"proxyvisor: session {session}:"
    store = proxy.pipeline.store
    if not proxy.pipeline.supervised or store is None or store.ledger_off is not None:
        why = "supervision off: nothing read or written" if not proxy.pipeline.supervised \
            else "the ledger is off: counted in memory"
        s = proxy.pipeline.sessions.get(session)
        if s is None or not s.requests:
            return [f"{head} no model requests seen ({why})"]
        return [f"{head} {plural(s.requests, 'model request')} ({', '.join(sorted(s.formats))}), "
                f"{plural(s.errors, 'error')}; proxy overhead {s.overhead_ms:,.1f} ms in all ({why})"]
    try:
        every = store.read_ledger(session)
    except LedgerError as exc:
        return [f"{head} {exc}"]
    lines = [line for line in every if line.get("run") == run]
    if len(lines) < len(every):
        total = sum(1 for line in every if not isinstance(line.get("local"), str))
        head = f"proxyvisor: session {session}, this run ({plural(total, 'model request')} in the session in all):"
    info = summarize(lines)
    local = info["local"]
    answered = (f"{plural(sum(local.values()), 'question')} answered by proxyvisor itself ({counts_text(local)})"
                if local else "")
    if not info["requests"]:
        return [f"{head} no model requests" + (f"; {answered}" if answered else " seen")]
    formats = sorted({line["format"] for line in lines if isinstance(line.get("format"), str) and
                      not isinstance(line.get("local"), str)})
    up, gate, over = info["upstream"], info["gate"], info["overhead_ms"]
    out = [f"{head} {plural(info['requests'], 'model request')} ({', '.join(formats)}), "
           f"{plural(info['errors'], 'error')}, {plural(info['tool_rounds'], 'tool round')}; upstream "
           f"{up['input_tokens']:,} in / {up['output_tokens']:,} out tokens"
           + (f", {cost}" if (cost := upstream_cost(up)) else "")
           + (f"; {answered}" if answered else "")]
    detectors = info["detectors"]
    gate_text = "did not run" if not gate["runs"] else (
        f"{plural(gate['runs'], 'run')}, outcomes {counts_text(gate['outcomes'])}")
    out.append(f"proxyvisor:   self-reports {counts_text(info['self_report']['by_status'])}; detector fires "
               f"{counts_text(detectors['fires'])}; steer notes {counts_text(detectors['steers'])}")
    out.append(f"proxyvisor:   verify-gate {gate_text}; condensed {plural(info['condense']['results'], 'result')}, "
               f"saved {plural(info['condense']['saved_tokens'], 'token')}; supervisor model "
               f"{supervisor_text(info['supervisor_model'])}")
    authz, breakers = info["authorizer"], info["breakers"]
    if authz["batches"]:
        out.append(f"proxyvisor:   tool authorizer {authorizer_text(authz)}")
    if breakers["fallbacks"] or any(c["refused"] or c["failed"] for c in breakers["pools"].values()):
        out.append(f"proxyvisor:   upstream pools {pools_text(breakers)}")
    if delegations := delegations_text(info["delegations"]):
        out.append(f"proxyvisor:   delegations {delegations}")
    live = proxy.pipeline.sessions.get(session)
    learning = live.learning if live is not None else None
    if memory := memory_text(learning.info() if isinstance(learning, SessionLearning) and learning.scope is not None
                             else info["learning"]):
        out.append(f"proxyvisor:   memory {memory}")
    out.append(f"proxyvisor:   proxy overhead {over['total']:,.1f} ms in all (mean {over['mean']:,.1f}, max "
               f"{over['max']:,.1f} ms a request; upstream and supervisor model time left out)")
    return out


def _say_cooling(pool: str, until: float) -> None:
    """Tell the user, once per pool and cooldown, that the agent's requests wait on a long cooldown (which another
    proxy sharing the state directory may have started), so that the agent does not wait in silence."""
    print(f"proxyvisor: upstream pool {pool} is cooling down until "
          f"{time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime(until))} ({max(0, math.ceil(until - time.time()))} s "
          f"from now): the agent's requests for it get a 429 and are not sent; `proxyvisor health clear {pool}` "
          f"resets it", file=sys.stderr, flush=True)


async def _wrap(config: Config, cmd: list[str], run: str, session: str | None, quiet: bool) -> int:
    async with running(config, port=0) as proxy:
        # The agent runs here: a session whose client names no working directory learns for this folder.
        proxy.pipeline.learning.default_scope = os.getcwd()
        if proxy.pipeline.breakers is not None:
            proxy.pipeline.breakers.on_long_wait = _say_cooling
        for notice in start_notices(config, quiet):
            print(notice, file=sys.stderr, flush=True)
        if not quiet and config.supervisor.enabled:
            print(f"proxyvisor: supervisor model: {describe(config.supervisor.model)}", file=sys.stderr, flush=True)
        cmd, env = agent_invocation(proxy.url, session, cmd, run=run)
        async with trio.open_nursery() as nursery:
            try:
                process: trio.Process = await nursery.start(lambda task_status: trio.run_process(
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
            code = await process.wait()
            nursery.cancel_scope.cancel()
    # Once the proxy stopped: the streams it cut then (a process the agent left behind) are in the ledger.
    if not quiet:
        print("\n".join(summary(proxy, run, session)), file=sys.stderr)
    for notice in stop_notices(proxy):
        print(notice, file=sys.stderr)
    return 128 - code if code < 0 else code


def wrap(config: Config, cmd: list[str], session: str | None = None, quiet: bool = False) -> int:
    """Run ``cmd`` through a private proxy as a fresh run, in ``session`` when given (else in the sessions its
    requests name, or the run's own: module docstring); returns its exit code (128+N when killed by signal N).

    Raises:
        ValueError: ``session`` is not a valid session id.
    """
    if session and not SESSION_ID.match(session):
        raise ValueError(f"invalid session id {session!r}: use 1-128 of [A-Za-z0-9._-]")
    tune_runtime()
    return trio.run(_wrap, config, cmd, secrets.token_hex(16), session or None, quiet)


__all__ = ["agent_env", "agent_invocation", "summary", "wrap"]
