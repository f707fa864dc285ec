"""Load and soak: many concurrent agent sessions through proxyvisor (supervision on) for minutes, against the
direct upstream and the LiteLLM proxy in the same run.

Usage (from the repository root, in the project's environment)::

    python bench/load.py                     # 200 sessions: 60 s direct, 300 s proxyvisor, 60 s LiteLLM
    python bench/load.py --quick             # a CI-size run of about 30 s (no LiteLLM arm unless --litellm)
    python bench/load.py --sessions 50 --duration 120 --compare-duration 30 --no-litellm
    python bench/load.py --replicas 2 --redis    # and an arm of 2 replicas on one Redis, sessions alternating
    python bench/load.py --replicas 2 --redis --no-session-id    # the same, clients sending no session id

Processes: the scripted upstream (auto mode: it calls a tool after a prompt and answers text after a tool
result, streaming with ``--chunk-delay-ms`` between events) runs in its own process; ``python -m proxyvisor
serve`` with supervision enabled in another; the LiteLLM proxy (``litellm[proxy]``, installed and started by
``bench/overhead.py``'s helpers, pass-through ``openai/scripted-model``) in a third; this process is the load
generator. Its concurrency is trio tasks, one per session, as is proxyvisor's: no thread per stream.

Each session is an agent loop in one wire format (the three formats in turn, every other session streaming):
send the history, read the reply, and when the model called a tool, append the call and a tool result of a few KB
after a think time (the tool running), else append the answer and a new prompt. The history grows to
``--max-messages`` messages, then the agent compacts it (a new thread of the same session). Every reply is
checked: status 200, a complete stream (the format's last event), and the turn the scripted model must give.

The arms run one after another against the same upstream: ``direct`` (the baseline), ``proxyvisor``, ``litellm``;
with ``--replicas N --redis`` also ``proxyvisor-redis``: N ``serve`` replicas with ``[state] backend = "redis"`` on
one ``redis-server`` (Debian package, started here on a free loopback port without persistence), each session's
requests going round-robin over the replicas (no stickiness), its added p50 put against the one replica on
diskcache of the ``proxyvisor`` arm (the ratio is printed); such a run writes the "Replicas on Redis (issue 15)"
section of ``bench/RESULTS.md``.
Figures per arm, after a warm-up: errors (target 0), p50/p99 latency and time to first byte, and the *added*
latency (the arm's percentile minus direct's), requests per second; for the proxy processes: peak RSS and its
growth from the end of the warm-up to the end of the run (target < 10 %), open file descriptors before the load
and after it (clients gone), and threads; for proxyvisor also its own ``x-proxyvisor-overhead-ms`` and whether
every request has its ledger line. The figures and the command go into the "Load and soak (issue 7)" section of
``bench/RESULTS.md``.

The big-event case (``--big-event-mb``; 100 MB, 10 MB with ``--quick``, 0 leaves it out): one SSE event of that
size (a Chat stream whose one content delta holds it) is relayed alone through proxyvisor with supervision on
(``GET /healthz`` sent every 20 ms meanwhile: its latency is how long the event loop is held) and off before the
arms, then once more in the middle of the proxyvisor arm, among the load. It reports the relay
times and the other sessions' added p90 while it relays: the p90 of the requests that started during the relay
minus that of the arm's other requests (target < 50 ms): one stream must never hold the loop that serves all.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import random
import re
import shutil
import ssl
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from typing import Any

import httpx
import orjson
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (API_KEY, MODEL, ROOT, BenchError, add_arm_options, command_line, cpu_time, exit_on_stdin_eof,
                          exit_status,
                          litellm_venv, loadavg, parse_sized, pct, prose, sized_parser, spawn_role, start_litellm, start_redis,
                          wait_litellm, workspace)
from bench.results import write_section
from proxyvisor.scripted.upstream import ScriptedUpstream
from proxyvisor.proxy.formats import BY_NAME, ToolSpec
from proxyvisor.proxy.formats.base import sse
from proxyvisor.proxy.server import Limits, Response, bound_port, open_listeners, serve_listeners
from proxyvisor.proxy.sse import SSEParser

SECTION = "Load and soak (issue 7)"
REDIS_SECTION = "Replicas on Redis (issue 15)"
"""Where a run with ``--redis`` writes its figures (its arms are not the plain run's)."""
ANONYMOUS_SECTION = "Replicas on Redis, clients without a session id (issue 15)"
"""Where a run with ``--redis --no-session-id`` writes its figures."""
FORMATS = ("chat", "messages", "responses")
TARGET_RSS_GROWTH = 0.10
SOAK_S = 120.0
"""Shortest proxyvisor arm whose RSS growth is judged: in a shorter run the histories are still growing towards
``--max-messages`` (an agent adds two messages per request, one every 2-3 s), so growth there is not a leak."""
TARGET_BIG_EVENT_P90_MS = 50.0
BIG = re.compile(rb"\(big event (\d+) bytes\)")
"""Asks the upstream for a Chat stream whose one content delta is that many bytes (the big-event case)."""
_TERMINAL = {"chat": "[DONE]", "messages": "message_stop", "responses": "response.completed"}
"""What the last event of a complete stream is: chat's data, or the others' event name."""
_LISTENING = re.compile(rb"listening on http://127\.0\.0\.1:(\d+)")
DELAY = re.compile(rb"\(model delay (\d+) ms\)")
"""How long the upstream waits before answering (the model's time to first token), chosen by the agent and written
at the end of its newest message: plain text survives every proxy and translation unchanged, and the agent knows
what it asked for. The upstream obeys the last one in the request."""


# ---- the agent's requests ----------------------------------------------------------------------------------
def agent_tools(rng: random.Random) -> tuple[ToolSpec, ...]:
    """A coding agent's tool set (about 20 KB of schemas), :data:`AGENT_TOOL` first so the scripted model calls
    it."""
    names = [AGENT_TOOL, "Read", "Edit", "Write", "Grep", "Glob", "TodoWrite", "WebFetch", "NotebookEdit", "Task"]
    tools = []
    for name in names:
        props = {"command" if name == "Bash" else "path": {"type": "string", "description": prose(rng, 30)},
                 "description": {"type": "string", "description": prose(rng, 20)}}
        props.update({f"option_{j}": {"type": rng.choice(["string", "integer", "boolean"]),
                                      "description": prose(rng, 25)} for j in range(4)})
        tools.append(ToolSpec(name, {"type": "object", "description": prose(rng, 60), "properties": props,
                                     "required": [next(iter(props))]}))
    return tuple(tools)


def tool_output(rng: random.Random, kb: float) -> str:
    lines, size = [], 0
    while size < kb * 1024:
        line = f"{rng.randint(1, 9999):>5}  {prose(rng, rng.randint(3, 14))}"
        lines.append(line)
        size += len(line) + 1
    return "\n".join(lines)


# ---- one request ---------------------------------------------------------------------------------------------
@dataclass
class Sample:
    arm: str
    fmt: str
    stream: bool
    started: float
    """Seconds since the arm started."""
    total_ms: float
    ttfb_ms: float
    """Time to the whole reply and to its first byte, both less the model delay the agent asked for (ms): what
    the path to the model costs, without the model's own think time, which varies from request to request."""
    overhead_ms: float | None
    error: str | None = None


def complete(fmt: str, events: list[tuple[str | None, str]]) -> bool:
    """Whether a stream ends as a whole one does: chat with ``[DONE]``, the others with their last event, named by
    its ``event:`` line or only by its ``type`` (LiteLLM's Responses stream), perhaps followed by ``[DONE]``."""
    terminal = _TERMINAL[fmt]
    for name, data in events[-2:]:
        if name == terminal or data == terminal:
            return True
        if fmt != "chat" and data.startswith("{"):
            try:
                if orjson.loads(data).get("type") == terminal:
                    return True
            except orjson.JSONDecodeError:
                pass
    return False


async def exchange(client: httpx.AsyncClient, fmt: str, body: dict[str, Any], headers: dict[str, str],
                   expect_tool_call: bool, model_s: float, arm: str, t0: float) -> tuple[Sample, Any]:
    """Send one request (whose newest message asks for ``model_s`` of model delay) and check the reply; (the
    sample, the assistant turn or None on error)."""
    spec = BY_NAME[fmt]
    stream = bool(body.get("stream"))
    content = orjson.dumps(body)
    started = time.perf_counter()
    ttfb = 0.0
    overhead = None
    turn = None
    error = None
    try:
        with trio.fail_after(120):
            async with client.stream("POST", spec.path, content=content, headers=headers) as reply:
                parts = []
                async for chunk in reply.aiter_raw():
                    if not ttfb:
                        ttfb = time.perf_counter() - started
                    parts.append(chunk)
                header = reply.headers.get("x-proxyvisor-overhead-ms")
                overhead = float(header) if header else None
                status = reply.status_code
        data = b"".join(parts)
        if status != 200:
            error = f"HTTP {status}"
        elif stream:
            events = [(e.event, e.data) for e in SSEParser().feed(data)]
            if not complete(fmt, events):
                error = "stream ended without its last event"
            else:
                turn = spec.assemble(events)
        else:
            turn = spec.parse_response(orjson.loads(data))
        if turn is not None and bool(turn.tool_calls) != expect_tool_call:
            error, turn = ("no tool call" if expect_tool_call else "unexpected tool call"), None
    except trio.TooSlowError:
        error = "timeout (120 s)"
    except (httpx.HTTPError, OSError, ValueError) as exc:
        error = f"{type(exc).__name__}: {exc}"[:200]
    total = time.perf_counter() - started
    model_s = model_s if error is None else 0.0
    sample = Sample(arm, fmt, stream, started - t0, (total - model_s) * 1000, ((ttfb or total) - model_s) * 1000,
                    overhead, error)
    return sample, turn


# ---- an agent session ------------------------------------------------------------------------------------------
@dataclass
class Settings:
    sessions: int
    think_s: tuple[float, float]
    model_delay_s: tuple[float, float]
    max_messages: int
    tool_output_kb: float
    system: str
    tools: tuple[ToolSpec, ...]
    named: bool = True
    """Whether the sessions send their id (``x-proxyvisor-session``); else proxyvisor knows them by their history."""


async def agent(index: int, base_urls: list[str], arm: str, settings: Settings, deadline: float, t0: float,
                samples: list[Sample], tls: ssl.SSLContext) -> None:
    """One agent session until ``deadline`` (perf_counter): prompt, tool round, answer, prompt..., its requests
    going round-robin over ``base_urls`` (one connection to each), starting at the session's index."""
    rng = random.Random(index)
    fmt = FORMATS[index % 3]
    stream = (index // 3) % 2 == 0
    session = f"load-{index:04d}"
    headers = {"content-type": "application/json", "authorization": "Bearer " + API_KEY.decode(),
               "x-api-key": API_KEY.decode(), "anthropic-version": "2023-06-01"}
    if settings.named:
        headers["x-proxyvisor-session"] = session
    task = 0

    def fresh() -> list[dict[str, Any]]:
        nonlocal task
        task += 1
        return [{"role": "system", "content": settings.system},
                {"role": "user", "content": f"Task {task} of {session}: {prose(rng, 30)}"}]

    def delay() -> tuple[str, float]:
        seconds = round(rng.uniform(*settings.model_delay_s), 3)
        return f"\n(model delay {int(seconds * 1000)} ms)", int(seconds * 1000) / 1000

    messages = fresh()
    await trio.sleep(rng.uniform(0, settings.think_s[1]))  # the sessions do not start in lockstep
    async with AsyncExitStack() as stack:
        clients = [await stack.enter_async_context(httpx.AsyncClient(
            base_url=url, timeout=None, trust_env=False, verify=tls,
            limits=httpx.Limits(max_connections=1, max_keepalive_connections=1))) for url in base_urls]
        sent = index
        while time.perf_counter() < deadline:
            client = clients[sent % len(clients)]
            sent += 1
            expect_tool_call = messages[-1]["role"] == "user"
            marker, model_s = delay()
            messages[-1]["content"] += marker  # kept: a history only grows at its end, as an agent's does
            body = BY_NAME[fmt].request_from_chat(messages, MODEL, stream, settings.tools)
            sample, turn = await exchange(client, fmt, body, headers, expect_tool_call, model_s, arm, t0)
            samples.append(sample)
            if turn is None:  # an error: the agent starts the task over, as a real one retries
                messages = fresh()
                await trio.sleep(rng.uniform(*settings.think_s))
                continue
            if turn.tool_calls:
                messages.append({"role": "assistant", "content": turn.text or None, "tool_calls": [
                    {"id": c.id, "type": "function",
                     "function": {"name": c.name, "arguments": orjson.dumps(c.arguments).decode()}}
                    for c in turn.tool_calls]})
                await trio.sleep(rng.uniform(*settings.think_s))  # the tool runs
                messages += [{"role": "tool", "tool_call_id": c.id,
                              "content": tool_output(rng, rng.uniform(0.2, 2) * settings.tool_output_kb)}
                             for c in turn.tool_calls]
            else:
                messages.append({"role": "assistant", "content": turn.text})
                await trio.sleep(rng.uniform(*settings.think_s))  # the human, or the harness, types
                if len(messages) >= settings.max_messages:
                    messages = fresh()  # compaction: a new thread of the same session
                else:
                    messages.append({"role": "user", "content": prose(rng, rng.randint(5, 40))})


# ---- process figures -----------------------------------------------------------------------------------------
@dataclass
class Usage:
    t: float
    rss_kb: int
    hwm_kb: int
    threads: int
    fds: int
    cpu_s: float


def usage_of(proc: subprocess.Popen[bytes], t: float) -> Usage | None:
    """RSS, peak RSS (VmHWM), threads, open descriptors and CPU time of ``proc`` from /proc; None when it is
    gone."""
    try:
        status = Path(f"/proc/{proc.pid}/status").read_text()
        fds = len(os.listdir(f"/proc/{proc.pid}/fd"))
    except OSError:
        return None
    values = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    rss, hwm = (int(values.get(key, "0 kB").split()[0]) for key in ("VmRSS", "VmHWM"))
    return Usage(t, rss, hwm, int(values.get("Threads", "0")), fds, cpu_time(proc))


async def sample_usage(proc: subprocess.Popen[bytes], t0: float, out: list[Usage], every_s: float = 1.0) -> None:
    while (u := usage_of(proc, time.perf_counter() - t0)) is not None:
        out.append(u)
        await trio.sleep(every_s)


# ---- one arm ----------------------------------------------------------------------------------------------------
@dataclass
class Arm:
    name: str
    port: int
    proc: subprocess.Popen[bytes] | None
    duration_s: float
    warmup_s: float
    samples: list[Sample] = field(default_factory=list)
    usage: list[Usage] = field(default_factory=list)
    fds_before: int | None = None
    fds_after: int | None = None
    ledger_lines: int | None = None
    machine: dict[str, float] = field(default_factory=dict)
    """CPU used over the arm, as a share of one core: ``load generator``, ``upstream`` (and the proxy's in
    :func:`process_of`). On a small machine the three compete, and latency shows it."""
    big: BigEvent | None = None
    """The big event relayed among this arm's load (the big-event case), if it ran."""
    replicas: list[int] = field(default_factory=list)
    """The ports of all the arm's replicas when it has several (``port`` is the first's); empty: ``port`` alone."""


async def run_arm(arm: Arm, settings: Settings, tls: ssl.SSLContext, upstream: subprocess.Popen[bytes],
                  big_event: int = 0) -> None:
    t0 = time.perf_counter()
    deadline = t0 + arm.duration_s
    cpu = time.process_time(), cpu_time(upstream)
    if arm.proc is not None:
        first = usage_of(arm.proc, 0.0)
        arm.fds_before = first.fds if first else None
    async with trio.open_nursery() as nursery:
        if arm.proc is not None:
            nursery.start_soon(sample_usage, arm.proc, t0, arm.usage)
        async with trio.open_nursery() as agents:
            if big_event:
                agents.start_soon(big_event_among_load, arm, arm.port, big_event, t0)
            for i in range(settings.sessions):
                agents.start_soon(agent, i, [f"http://127.0.0.1:{p}" for p in arm.replicas or [arm.port]],
                                  arm.name, settings, deadline, t0, arm.samples, tls)
        elapsed = time.perf_counter() - t0
        arm.machine = {"load generator": (time.process_time() - cpu[0]) / elapsed,
                       "upstream": (cpu_time(upstream) - cpu[1]) / elapsed}
        await trio.sleep(1.0)  # the clients are gone: give the proxy a moment to close its ends
        if arm.proc is not None:
            last = usage_of(arm.proc, time.perf_counter() - t0)
            arm.fds_after = last.fds if last else None
            if last:
                arm.usage.append(last)
        nursery.cancel_scope.cancel()


# ---- reporting -----------------------------------------------------------------------------------------------
@dataclass
class Row:
    arm: str
    kind: str
    n: int
    errors: int
    rps: float
    p50: float
    p99: float
    add_p50: float | None
    add_p99: float | None
    ttfb_p50: float
    add_ttfb_p50: float | None
    add_ttfb_p99: float | None
    header_p50: float | None
    header_p99: float | None


def rows_of(arms: list[Arm]) -> list[Row]:
    base = {kind: [s for s in arms[0].samples if s.started >= arms[0].warmup_s and not s.error
                   and s.stream == (kind == "stream")] for kind in ("json", "stream")}
    rows = []
    for arm in arms:
        for kind in ("json", "stream"):
            chosen = [s for s in arm.samples if s.started >= arm.warmup_s and s.stream == (kind == "stream")]
            ok = [s for s in chosen if not s.error]
            if not ok:
                rows.append(Row(arm.name, kind, len(chosen), len(chosen), 0, *(float("nan"),) * 2, None, None,
                                float("nan"), None, None, None, None))
                continue
            total, ttfb = [s.total_ms for s in ok], [s.ttfb_ms for s in ok]
            b_total, b_ttfb = [s.total_ms for s in base[kind]], [s.ttfb_ms for s in base[kind]]
            heads = [s.overhead_ms for s in ok if s.overhead_ms is not None]

            def diff(mine: list[float], theirs: list[float], q: float) -> float | None:
                return pct(mine, q) - pct(theirs, q) if theirs else None

            rows.append(Row(arm.name, kind, len(chosen), len(chosen) - len(ok),
                            len(chosen) / (arm.duration_s - arm.warmup_s), pct(total, 50), pct(total, 99),
                            diff(total, b_total, 50), diff(total, b_total, 99), pct(ttfb, 50),
                            diff(ttfb, b_ttfb, 50), diff(ttfb, b_ttfb, 99),
                            pct(heads, 50) if heads else None, pct(heads, 99) if heads else None))
    return rows


@dataclass
class Process:
    peak_mb: float
    start_mb: float
    end_mb: float
    growth: float
    cpu_ms: float
    cpu_share: float
    threads_max: int
    fds_before: int | None
    fds_peak: int
    fds_after: int | None


def process_of(arm: Arm) -> Process | None:
    """A proxy process's figures after the warm-up. RSS growth compares the medians of the first and last 10 %
    of the samples (at least 3 each), so one sample's noise does not count as growth; CPU is per request made in
    that span, and as a share of one core."""
    steady = [u for u in arm.usage if u.t >= arm.warmup_s]
    if len(steady) < 6:
        return None
    k = max(3, len(steady) // 10)
    start = statistics.median(u.rss_kb for u in steady[:k])
    end = statistics.median(u.rss_kb for u in steady[-k:])
    requests = sum(1 for s in arm.samples if s.started >= steady[0].t) or 1
    cpu = steady[-1].cpu_s - steady[0].cpu_s
    return Process(max(u.hwm_kb for u in arm.usage) / 1024, start / 1024, end / 1024, (end - start) / start,
                   cpu * 1000 / requests, cpu / (steady[-1].t - steady[0].t), max(u.threads for u in arm.usage),
                   arm.fds_before, max(u.fds for u in arm.usage), arm.fds_after)


def _f(value: float | None, fmt: str = "{:.1f}") -> str:
    return "-" if value is None or math.isnan(value) else fmt.format(value)


def big_event_text(arms: list[Arm], alone: dict[str, BigEvent], size: int, peak_mb: float | None,
                   pings: list[float]) -> list[str]:
    """The big-event case's paragraph (module docstring); empty when it did not run."""
    if not size:
        return []

    def relay(big: BigEvent | None) -> str:
        return "-" if big is None else f"failed ({big.error})" if big.error else f"{big.seconds:.2f} s"

    pv = next((a for a in arms if a.name == "proxyvisor"), None)
    text = (f"**Big event**: one SSE event of {size / 1e6:g} MB (a Chat content delta) relayed alone: supervision "
            f"on {relay(alone.get('on'))}, off {relay(alone.get('off'))}"
            + (f" (proxyvisor's peak RSS after it: {peak_mb:.0f} MB)" if peak_mb is not None else "")
            + (f"; `GET /healthz` every 20 ms meanwhile: p50 {pct(pings, 50):.1f}, p90 {pct(pings, 90):.1f}, max "
               f"{max(pings):.1f} ms over {len(pings)} pings (how long the event loop was held)" if pings else "")
            + f"; among the load: {relay(pv.big if pv else None)}.")
    figures = big_event_p90(pv) if pv else None
    if figures is not None:
        during, other, n = figures
        text += (f" Other sessions while it relayed: p90 {during:.1f} ms over {n} requests against {other:.1f} ms "
                 f"for those that started before it: added p90 {during - other:+.1f} ms (target < "
                 f"{TARGET_BIG_EVENT_P90_MS:g} ms).")
    return ["", text]


def markdown(arms: list[Arm], rows: list[Row], command: str, setup: str, notes: list[str],
             errors: dict[str, dict[str, int]], big: list[str] | None = None) -> str:
    cols = ["arm", "kind", "requests", "errors", "req/s", "p50", "p99", "+p50", "+p99", "TTFB p50", "+TTFB p50",
            "+TTFB p99", "overhead header p50 / p99"]
    lines = [f"Command: `{command}`", "", setup, "",
             ("**Latency** (ms, after the warm-up, less the upstream's model delay; *+* = added: the arm's "
              "percentile minus direct's, same run)"), "",
             "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join([
            r.arm, r.kind, str(r.n), str(r.errors), _f(r.rps), _f(r.p50), _f(r.p99), _f(r.add_p50, "{:+.1f}"),
            _f(r.add_p99, "{:+.1f}"), _f(r.ttfb_p50), _f(r.add_ttfb_p50, "{:+.1f}"), _f(r.add_ttfb_p99, "{:+.1f}"),
            f"{_f(r.header_p50, '{:.2f}')} / {_f(r.header_p99, '{:.2f}')}" if r.header_p50 is not None else "-"])
            + " |")
    lines += big or []
    lines += ["", "**Proxy process** (from /proc; growth: end of warm-up to end of run; CPU after the warm-up)", "",
              ("| arm | peak RSS MB | RSS after warm-up MB | RSS at end MB | growth | CPU ms/request | CPU (one core) "
               "| threads (max) | fds before load | fds peak | fds after load |"), "|" + "---|" * 11]
    for arm in arms:
        m = process_of(arm)
        if m is not None:
            lines.append(f"| {arm.name} | {m.peak_mb:.1f} | {m.start_mb:.1f} | {m.end_mb:.1f} | {m.growth:+.1%} | "
                         f"{m.cpu_ms:.2f} | {m.cpu_share:.0%} | {m.threads_max} | {m.fds_before} | {m.fds_peak} | "
                         f"{m.fds_after} |")
    lines += ["", "CPU of the other processes, as a share of one core: " + "; ".join(
        f"{arm.name} arm: " + ", ".join(f"{k} {v:.0%}" for k, v in arm.machine.items()) for arm in arms) + "."]
    lines += ["", "Targets:", ""] + [f"- {'PASS' if ok else 'FAIL'}: {text}" for ok, text, _ in verdicts(arms, errors)]
    notes = notes + [("The arms run one after another (a soak cannot be interleaved): other work on the machine "
                      "during one arm shows as added latency, or as negative added latency; the overhead header is "
                      "proxyvisor's own time, measured inside the process."),
                     ("fds after load: the clients are gone; what stays is mostly idle upstream connections kept "
                      "for reuse (at most 256 per upstream).")]
    if any(a.name == "proxyvisor" and a.duration_s < SOAK_S for a in arms):
        notes.append(f"RSS growth not judged: the proxyvisor arm is shorter than {SOAK_S:g} s, so the histories "
                     "are still growing (not a leak).")
    lines += ["", "Notes:", ""] + [f"- {n}" for n in notes]
    return "\n".join(lines)


def error_kinds(arm: Arm) -> dict[str, int]:
    kinds: dict[str, int] = {}
    for s in arm.samples:
        if s.error:
            kind = f"{s.fmt}{' stream' if s.stream else ''}: {s.error}"
            kinds[kind] = kinds.get(kind, 0) + 1
    return kinds


def verdicts(arms: list[Arm], errors: dict[str, dict[str, int]]) -> list[tuple[bool, str, bool]]:
    """(met, what, whether it is a timing or memory target rather than the results being right) per target."""
    out = []
    for arm in arms:
        if not arm.name.startswith("proxyvisor"):
            continue
        n = len(arm.samples)
        failed = sum(errors[arm.name].values())
        detail = ", ".join(f"{count}x {kind}" for kind, count in sorted(errors[arm.name].items())) or "none"
        out.append((failed == 0, f"{arm.name}: {failed} errors in {n} requests (target 0; {detail})", False))
        m = process_of(arm)
        if m is not None and arm.duration_s >= SOAK_S:
            out.append((m.growth < TARGET_RSS_GROWTH, (f"{arm.name}: RSS growth after warm-up {m.growth:+.1%} "
                                                       f"(target < {TARGET_RSS_GROWTH:.0%})"), True))
        if arm.big is not None:
            figures = big_event_p90(arm)
            if arm.big.error:
                out.append((False, f"proxyvisor: the big event failed: {arm.big.error}", False))
            elif figures is not None:
                added = figures[0] - figures[1]
                out.append((added < TARGET_BIG_EVENT_P90_MS,
                            f"proxyvisor: other sessions' added p90 while the big event relayed {added:+.1f} ms "
                            f"(target < {TARGET_BIG_EVENT_P90_MS:g} ms)", True))
        if arm.ledger_lines is not None:
            out.append((arm.ledger_lines == n, (f"{arm.name}: {arm.ledger_lines} ledger lines for {n} requests "
                                                "(every request accounted for)"), False))
    return out


def print_report(text: str) -> None:
    from rich.console import Console
    from rich.markdown import Markdown

    Console(width=max(shutil.get_terminal_size().columns, 140)).print(Markdown(text))


# ---- the processes -------------------------------------------------------------------------------------------
class ThinkingModel:
    """The scripted upstream with a model's time to first token: an agent's request waits as long as the last
    :data:`DELAY` marker in it asks before the scripted answer starts. Only the agent's requests (those offering
    its :data:`AGENT_TOOL`) wait: proxyvisor's supervisor calls (the verifier's, whose digest quotes the agent's
    messages, markers included) offer no agent tool and are answered at once, so a gated turn's latency does not
    carry a second, random model delay that the agent cannot take out of its figures. A request with the
    :data:`BIG_HEADER` header gets :func:`big_event_stream` instead."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    async def __call__(self, request: Any) -> Any:
        size = request.header(BIG_HEADER.decode())
        if size is not None:
            return Response(200, [(b"content-type", b"text/event-stream")], big_event_stream(int(size)))
        found = DELAY.findall(request.body)
        if found and offers_agent_tool(request.path, request.body):
            await trio.sleep(int(found[-1]) / 1000)
        return await self.inner(request)


AGENT_TOOL = "Bash"
"""The first of :func:`agent_tools`: every agent request offers it, no supervisor call does."""


def offers_agent_tool(path: str, body: bytes) -> bool:
    """Whether the request to ``path`` (a format's path) with JSON ``body`` offers :data:`AGENT_TOOL`."""
    fmt = next((f for f in BY_NAME.values() if path.endswith(f.path)), None)
    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError:
        return False
    return fmt is not None and isinstance(parsed, dict) and any(t.name == AGENT_TOOL for t in fmt.tools(parsed))


BIG_HEADER = b"x-bench-big-event"
_PIECE = 1024 * 1024


async def big_event_stream(size: int) -> AsyncIterator[bytes]:
    """A Chat stream whose one content delta is ``size`` bytes of prose, sent in 1 MiB pieces as a network
    would deliver them: the role chunk, the big event, the finish chunk, ``[DONE]``."""
    def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
        return sse(orjson.dumps({"id": "chatcmpl-big", "object": "chat.completion.chunk", "created": 0,
                                 "model": MODEL, "choices": [{"index": 0, "delta": delta,
                                                              "finish_reason": finish}]}))
    yield chunk({"role": "assistant", "content": ""})
    head, tail = chunk({"content": "@"}).split(b"@")
    words = b"the quick brown fox jumps over the lazy dog. "
    piece = words * (_PIECE // len(words))
    yield head
    sent = 0
    while sent < size:
        part = piece[:size - sent]
        sent += len(part)
        yield part
        await trio.sleep(0)
    yield tail + chunk({}, "stop") + sse(b"[DONE]")


@dataclass
class BigEvent:
    """One big-event relay: when it started and ended (seconds since its arm started) and what came back."""

    started: float
    ended: float
    received: int
    error: str | None = None

    @property
    def seconds(self) -> float:
        return self.ended - self.started


async def relay_big_event(port: int, size: int, t0: float) -> BigEvent:
    """Ask through the proxy on ``port`` for a stream with one ``size``-byte event and read it all."""
    body = {"model": MODEL, "stream": True, "messages": [{"role": "user", "content": "Write at length."}]}
    headers = {"content-type": "application/json", "authorization": "Bearer " + API_KEY.decode(),
               "x-proxyvisor-session": "load-big-event", BIG_HEADER.decode(): str(size)}
    started = time.perf_counter()
    received, tail, error = 0, b"", None
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=None, trust_env=False) as client:
            with trio.fail_after(600):
                async with client.stream("POST", "/v1/chat/completions", content=orjson.dumps(body),
                                         headers=headers) as reply:
                    async for part in reply.aiter_raw():
                        received += len(part)
                        tail = (tail + part)[-256:]
                    if reply.status_code != 200:
                        error = f"HTTP {reply.status_code}"
    except (trio.TooSlowError, httpx.HTTPError, OSError) as exc:
        error = f"{type(exc).__name__}: {exc}"[:200]
    if error is None and (received < size or b"[DONE]" not in tail):
        error = f"incomplete stream ({received} bytes)"
    return BigEvent(started - t0, time.perf_counter() - t0, received, error)


async def big_event_with_pings(port: int, size: int) -> tuple[BigEvent, list[float]]:
    """:func:`relay_big_event` alone, while ``GET /healthz`` goes to the same proxy every 20 ms: how long the
    proxy's event loop, which serves every session, is held (the pings' latencies during the relay, ms)."""
    pings: list[float] = []
    done = trio.Event()

    async def ping() -> None:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", trust_env=False) as client:
            while not done.is_set():
                started = time.perf_counter()
                await client.get("/healthz")
                pings.append((time.perf_counter() - started) * 1000)
                await trio.sleep(0.02)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(ping)
        await trio.sleep(0.5)
        before = len(pings)
        big = await relay_big_event(port, size, time.perf_counter())
        done.set()
    return big, pings[before:]


async def big_event_among_load(arm: Arm, port: int, size: int, t0: float) -> None:
    """The big event once, in the middle of the arm's measured span."""
    await trio.sleep(arm.warmup_s + (arm.duration_s - arm.warmup_s) / 3)
    arm.big = await relay_big_event(port, size, t0)


def big_event_p90(arm: Arm) -> tuple[float, float, int] | None:
    """(p90 of the requests that started while the big event relayed, p90 of those that started after the
    warm-up and before it, how many started during it), in ms; None without a big event or the requests to
    compare. The baseline is the same arm before the event, so the difference is what the event added."""
    big = arm.big
    if big is None:
        return None
    ok = [s for s in arm.samples if not s.error]
    during = [s.total_ms for s in ok if big.started <= s.started <= big.ended]
    before = [s.total_ms for s in ok if arm.warmup_s <= s.started < big.started]
    if not during or not before:
        return None
    return pct(during, 90), pct(before, 90), len(during)


async def serve_upstream(chunk_delay_ms: float) -> None:
    handler = ThinkingModel(ScriptedUpstream(chunk_delay_ms=chunk_delay_ms, record=False))
    listeners = await open_listeners("127.0.0.1", 0)
    async with trio.open_nursery() as nursery:
        await nursery.start(serve_listeners, listeners, handler, Limits())
        print(f"PORT {bound_port(listeners)}", flush=True)


def start_proxyvisor(upstream_port: int, work: Path, supervision: bool = True,
                     name: str = "proxyvisor", redis_url: str = "") -> tuple[subprocess.Popen[bytes], int]:
    """``python -m proxyvisor serve`` (supervision on unless told), on a free port, relaying to the upstream,
    its shared state in the Redis at ``redis_url`` when given; its config, state and log are ``work/name*``."""
    config = work / f"{name}.toml"
    shared = f'backend = "redis"\nurl = "{redis_url}"\n' if redis_url else ""
    config.write_text(f'[proxy]\nport = 0\n\n[state]\ndir = "{work / (name + "-state")}"\n{shared}\n[supervisor]\n'
                      f'enabled = {"true" if supervision else "false"}\n\n'
                      f'[upstreams.bench]\nurl = "http://127.0.0.1:{upstream_port}"\n')
    log = work / f"{name}.log"
    proc = subprocess.Popen([sys.executable, "-m", "proxyvisor", "serve", "--config", str(config)],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log.open("wb"), cwd=ROOT,
                            env=dict(os.environ, NO_PROXY="*"))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        found = _LISTENING.search(log.read_bytes())
        if found:
            return proc, int(found.group(1))
        time.sleep(0.05)
    proc.kill()
    raise BenchError(f"proxyvisor serve did not start: {log.read_text(errors='replace')[-2000:]}")


def redis_figures(url: str) -> str:
    """Redis's memory and keys at the end of the arm, and its version, in words."""
    import redis

    client = redis.Redis.from_url(url)
    try:
        info = client.info()
        sessions = sum(1 for _ in client.scan_iter(match="proxyvisor:sessions:*:v", count=1000))
        shared = sum(client.xlen(key) for key in client.scan_iter(match="proxyvisor:ledger:*", count=1000,
                                                                   _type="stream"))
        links = sum(1 for _ in client.scan_iter(match="proxyvisor:links:*", count=1000))
        return (f"Redis {info.get('redis_version')}: {info.get('used_memory', 0) / 1e6:.1f} MB used "
                f"({info.get('used_memory_dataset', 0) / 1e6:.1f} MB of data) with {client.dbsize()} keys, "
                f"{sessions} sessions' states, {shared} shared ledger lines, {links} conversation links, at the "
                f"end of the arm")
    finally:
        client.close()


def ledger_lines(state: Path) -> int:
    return sum(p.read_bytes().count(b"\n") for p in (state / "ledger").glob("*.jsonl"))


# ---- main --------------------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = sized_parser(__doc__.split("\n\n")[0],
                     "CI-size run of about 30 s: --duration 18 --compare-duration 8 --big-event-mb 10, no LiteLLM "
                     "arm unless --litellm (flags given explicitly still win)")
    p.add_argument("--sessions", type=int, default=200, help="concurrent agent sessions (default 200)")
    p.add_argument("--duration", type=float, help="seconds of the proxyvisor arm (default 300; quick 18)")
    p.add_argument("--compare-duration", type=float,
                   help="seconds of the direct and LiteLLM arms (default 60; quick 8)")
    p.add_argument("--chunk-delay-ms", type=float, default=20.0, help="upstream delay between SSE events (20)")
    p.add_argument("--model-delay-ms", default="500,2500",
                   help="min,max of the model's time to first token, drawn per request by the agent and played "
                        "by the upstream; taken out of the latency figures (default 500,2500)")
    p.add_argument("--think-ms", default="200,2000",
                   help="min,max of the pause between an answer and the agent's next request: the tool running or "
                        "the next prompt (default 200,2000)")
    p.add_argument("--max-messages", type=int, default=60, help="history length at which an agent compacts (60)")
    p.add_argument("--tool-output-kb", type=float, default=2.0, help="mean tool result size in KB (default 2)")
    p.add_argument("--big-event-mb", type=float,
                   help="size of the big-event case's one SSE event in MB, 0 to leave it out (default 100; quick 10)")
    p.add_argument("--litellm", action="store_true", help="include the LiteLLM arm in a --quick run")
    p.add_argument("--replicas", type=int, default=1,
                   help="with --redis: replicas of the proxyvisor-redis arm, sessions round-robin over them (1)")
    p.add_argument("--no-session-id", dest="session_id", action="store_false",
                   help="the sessions send no session id: proxyvisor knows each by its history (with --redis: the "
                        "replicas share the conversation links); written to its own section")
    p.add_argument("--redis", action="store_true",
                   help="add the proxyvisor-redis arm: --replicas serve processes on one redis-server")
    add_arm_options(p)
    p.add_argument("--role", choices=("upstream",), help=argparse.SUPPRESS)
    args = parse_sized(p, argv, quick={"duration": 18.0, "compare_duration": 8.0, "big_event_mb": 10.0},
                       full={"duration": 300.0, "compare_duration": 60.0, "big_event_mb": 100.0})
    args.big_event = int(args.big_event_mb * 1e6)
    args.think_s = tuple(float(v) / 1000 for v in args.think_ms.split(","))
    args.model_delay_s = tuple(float(v) / 1000 for v in args.model_delay_ms.split(","))
    args.with_litellm = not args.no_litellm and (args.litellm or not args.quick)
    if args.replicas < 1 or args.replicas > 1 and not args.redis:
        p.error("--replicas N (N >= 1) shares state through --redis")
    return args


def setup_text(args: argparse.Namespace, settings: Settings, arms: list[Arm], litellm_version: str,
               started: float, load_before: str) -> str:
    base = BY_NAME["chat"].request_from_chat([{"role": "system", "content": settings.system}], MODEL, False,
                                             settings.tools)
    arms_text = ", ".join(f"{a.name} {a.duration_s:g} s (warm-up {a.warmup_s:g} s)" for a in arms)
    return (f"Setup: {args.sessions} concurrent agent sessions (the three formats in turn, every other one "
            f"streaming; {'each sending its session id' if settings.named else 'sending no session id'}; tool rounds with {args.tool_output_kb:g} KB results on average; think time "
            f"{args.think_ms} ms; histories growing to {args.max_messages} messages, then compacted; "
            f"{len(orjson.dumps(base)) // 1024} KB of system prompt and tool schemas in every request). Scripted "
            f"upstream in its own process: a model delay of {args.model_delay_ms} ms before each answer (taken "
            f"out of the latencies), {args.chunk_delay_ms:g} ms between SSE events. `proxyvisor serve` "
            f"(supervision on) in its own process; load generator (trio, httpx, one task and connection per "
            f"session) in another. Arms in sequence: {arms_text}"
            + (f"; {litellm_version} (pass-through `openai/{MODEL}`, 1 worker)" if litellm_version else "")
            + f". {os.cpu_count()} CPUs, Python {platform.python_version()}, {platform.system()} "
              f"{platform.release()}; {time.strftime('%Y-%m-%d')}; run took {time.monotonic() - started:.0f} s; "
              f"1-minute load average {load_before} before, {loadavg()} after.")


def replica_ratio(rows: list[Row], replicas: int) -> str:
    """The replicated arm's added p50 against the one replica on diskcache, per kind, with the ratio."""
    parts = []
    for kind in ("json", "stream"):
        one = next((r.add_p50 for r in rows if r.arm == "proxyvisor" and r.kind == kind), None)
        many = next((r.add_p50 for r in rows if r.arm == "proxyvisor-redis" and r.kind == kind), None)
        if one is None or many is None:
            continue
        ratio = f"ratio {many / one:.2f}" if one > 0 else "ratio - (one replica added nothing measurable)"
        parts.append(f"{kind}: {many:+.1f} ms against {one:+.1f} ms ({ratio})")
    text = (f"Added p50 of {replicas} replicas on Redis, each session's requests alternating between them, against "
            f"one replica on diskcache: " + ("; ".join(parts) or "-") + ".")
    print(text, flush=True)
    return text


def warmup_of(duration_s: float) -> float:
    return min(60.0, max(3.0, 0.2 * duration_s))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.role == "upstream":
        exit_on_stdin_eof()
        trio.run(serve_upstream, args.chunk_delay_ms)
        return 0
    command = command_line("bench/load.py", argv)
    started = time.monotonic()
    load_before = loadavg()
    rng = random.Random(7)
    settings = Settings(args.sessions, args.think_s, args.model_delay_s, args.max_messages, args.tool_output_kb,
                        "You are a coding agent. " + prose(rng, 1200), agent_tools(rng), named=args.session_id)
    tls = ssl.create_default_context()  # one for all the clients: the URLs are plain HTTP anyway
    notes: list[str] = []
    with workspace("proxyvisor-load-") as (work, procs):
        exe, litellm_note = (None, "LiteLLM arm left out") if not args.with_litellm else \
            litellm_venv(args.litellm_venv, not args.no_install)
        if exe is None:
            notes.append(litellm_note)
        upstream, up_port = spawn_role(__file__, "upstream", "--chunk-delay-ms", str(args.chunk_delay_ms),
                                       log=work / "upstream.log")
        procs.append(upstream)
        arms = [Arm("direct", up_port, None, args.compare_duration, warmup_of(args.compare_duration))]
        pv_proc, pv_port = start_proxyvisor(up_port, work)
        procs.append(pv_proc)
        big_alone: dict[str, BigEvent] = {}
        big_peak_mb, big_pings = None, []
        if args.big_event:
            off_proc, off_port = start_proxyvisor(up_port, work, supervision=False, name="unsupervised")
            procs.append(off_proc)
            print(f"big event of {args.big_event_mb:g} MB alone ...", end="", flush=True)
            big_alone["on"], big_pings = trio.run(big_event_with_pings, pv_port, args.big_event)
            big_alone["off"] = trio.run(relay_big_event, off_port, args.big_event, time.perf_counter())
            measured = usage_of(pv_proc, 0.0)
            big_peak_mb = measured.hwm_kb / 1024 if measured else None
            print(" supervision " + ", ".join(f"{k} {v.seconds:.2f} s" + (f" ({v.error})" if v.error else "")
                                            for k, v in big_alone.items()), flush=True)
        arms.append(Arm("proxyvisor", pv_port, pv_proc, args.duration, warmup_of(args.duration)))
        redis_url = ""
        if args.redis:
            redis_proc, redis_url = start_redis(work)
            procs.append(redis_proc)
            replicas = [start_proxyvisor(up_port, work, name=f"replica-{n}", redis_url=redis_url)
                        for n in range(args.replicas)]
            procs += [proc for proc, _port in replicas]
            arms.append(Arm("proxyvisor-redis", replicas[0][1], replicas[0][0], args.duration,
                            warmup_of(args.duration), replicas=[port for _proc, port in replicas]))
        if exe is not None:
            ll_proc, ll_port = start_litellm(exe, up_port, work)
            procs.append(ll_proc)
            try:
                wait_litellm(ll_proc, ll_port, work / "litellm.log")
                arms.append(Arm("litellm", ll_port, ll_proc, args.compare_duration,
                                warmup_of(args.compare_duration)))
            except BenchError as exc:
                notes.append(f"LiteLLM proxy left out: {exc}"[:500])
        print(f"{args.sessions} sessions; arms: " + ", ".join(f"{a.name} {a.duration_s:g} s" for a in arms),
              flush=True)
        for arm in arms:
            print(f"  {arm.name} ...", end="", flush=True)
            trio.run(run_arm, arm, settings, tls, upstream, args.big_event if arm.name == "proxyvisor" else 0)
            if arm.name == "proxyvisor":
                arm.ledger_lines = (ledger_lines(work / "proxyvisor-state") - bool(big_alone.get("on"))
                                    - (arm.big is not None))  # the big event's own lines
            if arm.name == "proxyvisor-redis":
                arm.ledger_lines = sum(ledger_lines(work / f"replica-{n}-state") for n in range(args.replicas))
                notes.append(redis_figures(redis_url))
            print(f" {len(arm.samples)} requests, {sum(1 for s in arm.samples if s.error)} errors", flush=True)
        errors = {arm.name: error_kinds(arm) for arm in arms}
        for arm in arms:
            if not arm.name.startswith("proxyvisor") and errors[arm.name]:
                by_count = sorted(errors[arm.name].items(), key=lambda item: -item[1])
                detail = ", ".join(f"{n}x {kind}" for kind, n in by_count)
                notes.append(f"{arm.name}: errors: {detail}"[:600])
        rows = rows_of(arms)
        if args.redis:
            notes.append(replica_ratio(rows, args.replicas))
        setup = setup_text(args, settings, arms, litellm_note if exe is not None else "", started, load_before)
        text = markdown(arms, rows, command, setup, notes, errors,
                        big_event_text(arms, big_alone, args.big_event, big_peak_mb, big_pings))
        print_report(text)
        if not args.no_write:
            write_section(SECTION if not args.redis else REDIS_SECTION if args.session_id else ANONYMOUS_SECTION,
                          text, args.results)
            print(f"wrote {args.results}")
        judged = verdicts(arms, errors)
        return exit_status(all(ok for ok, _, timing in judged if timing),
                           all(ok for ok, _, timing in judged if not timing))


if __name__ == "__main__":
    sys.exit(main())
