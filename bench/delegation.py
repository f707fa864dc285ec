"""What delegation costs through the proxy, and the breaker under a crowd at a pool's recovery.

Usage: python bench/delegation.py [--count 200] [--crowd 50] [--runs 5] [--write]

Everything runs in this one process and one trio loop, against the embedded scripted model, so the figures are
proxyvisor's own costs (plus loopback HTTP), not a provider's. One supervised proxy has delegation on, with one
role, ``reviewer``, on the ``scripted`` adapter (its child model answers in process); another has it off. The
arms, interleaved request by request, chat format, each as JSON and as a stream:

- **direct**: one request straight to the scripted model, no proxy (what a continuation's upstream call costs);
- **off**: one ordinary request through the proxy with ``[model_routing]`` off (the supervised path as before);
- **plain**: the same with delegation on and the ``reviewer`` tool offered, the model not calling it;
- **delegated**: a turn whose model calls ``reviewer``: the proxy runs the child, continues upstream, and the
  agent gets the continued answer (two upstream calls and one child);
- **child**: ``Delegator.delegate`` alone on the same child (route, breaker admit and settle, clocks, shaping).

*delegation added* is ``delegated - plain - direct - child`` (medians): what holding the response, building the
continuation and splicing it cost beyond the work the turn needs anyway (its second upstream call and its child).
*tools offered* is ``plain - off``.

**Crowd at recovery**: a pool whose cooldown has just run out gets ``--crowd`` delegations at once, ``--runs``
times; the child model takes 0.5 s to answer. Exactly one may reach the model (the half-open probe); the figure
counts the child requests and probes per run, and how long the refused callers waited for their answer.

``--write`` puts the tables into bench/RESULTS.md under "## Delegation and breakers (issue 6)".
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import orjson
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.results import write_section  # noqa: E402
from proxyvisor.adapters.failures import Failure  # noqa: E402
from proxyvisor.scripted.upstream import ScriptedUpstream  # noqa: E402
from proxyvisor.scripted.runtime import ScriptedRuntime  # noqa: E402
from proxyvisor.config import Config, ModelRoutingConfig, RoleConfig, UpstreamConfig  # noqa: E402
from proxyvisor.proxy.formats import CHAT, ToolSpec  # noqa: E402
from proxyvisor.proxy.service import running  # noqa: E402
from proxyvisor.store import Store  # noqa: E402

BASH = ToolSpec("Bash", {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]})
CALL = {"text": "Let me ask the reviewer.",
        "tool_calls": [{"name": "reviewer", "arguments": {"prompt": "Review app.py."}, "id": "call_rev"}]}
FINAL = {"text": "The reviewer found nothing wrong."}
CHILD = {"text": "app.py looks correct."}
ARMS = ("direct", "off", "plain", "delegated", "child")


def config(on: bool) -> Config:
    routing = ModelRoutingConfig(enabled=on, roles=(RoleConfig("reviewer", adapter="scripted"),))
    return Config(upstreams=(UpstreamConfig(name="scripted"),), model_routing=routing)


def body(stream: bool) -> bytes:
    messages = [{"role": "system", "content": "You are a coding agent."},
                {"role": "user", "content": "Is app.py right?"}]
    return orjson.dumps(CHAT.request_from_chat(messages, "scripted-model", stream, (BASH,)))


async def timed_request(client: httpx.AsyncClient, url: str, content: bytes) -> float:
    """Seconds until the whole reply is read (the reply checked: 200, no delegation call in it)."""
    started = time.perf_counter()
    async with client.stream("POST", url + "/v1/chat/completions", content=content,
                             headers={"content-type": "application/json"}) as response:
        data = b"".join([chunk async for chunk in response.aiter_raw()])
    elapsed = time.perf_counter() - started
    assert response.status_code == 200 and b"call_rev" not in data, data[-300:]
    return elapsed


async def measure_overhead(count: int, state: Path) -> dict[tuple[str, bool], list[float]]:
    parent_on, parent_off, child = (ScriptedUpstream(record=False) for _ in range(3))
    times: dict[tuple[str, bool], list[float]] = {(arm, stream): [] for arm in ARMS for stream in (False, True)}
    async with running(config(True), port=0, store=Store(state / "on"), scripted={"scripted": parent_on}) as on, \
            running(config(False), port=0, store=Store(state / "off"), scripted={"scripted": parent_off}) as off:
        delegator = on.pipeline.delegation.delegator
        delegator._runtimes["scripted"] = ScriptedRuntime(delegator.registry.get("scripted"), {}, upstream=child)
        async with httpx.AsyncClient(timeout=30, trust_env=False) as client:
            for i in range(count + 10):  # the first 10 rounds warm up and are not kept
                for stream in (False, True):
                    content = body(stream)
                    parent_off.queue(FINAL)
                    t_direct = await timed_request(client, off.scripted_urls["scripted"], content)
                    parent_off.queue(FINAL)
                    t_off = await timed_request(client, off.url + "/s/bench-off", content)
                    parent_on.queue(FINAL)
                    t_plain = await timed_request(client, on.url + "/s/bench-plain", content)
                    parent_on.queue(CALL, FINAL)
                    child.queue(CHILD)
                    t_delegated = await timed_request(client, on.url + "/s/bench-delegated", content)
                    child.queue(CHILD)
                    started = time.perf_counter()
                    result = await delegator.delegate("reviewer", "Review app.py.")
                    t_child = time.perf_counter() - started
                    assert result.status == "ok", result
                    if i >= 10:
                        for arm, t in zip(ARMS, (t_direct, t_off, t_plain, t_delegated, t_child), strict=True):
                            times[(arm, stream)].append(t * 1000)
    return times


async def crowd_at_recovery(crowd: int, state: Path) -> dict[str, Any]:
    """One run: ``crowd`` delegations at a pool whose cooldown just ended."""
    child = ScriptedUpstream([{"fault": {"first_byte_delay_s": 0.5}}, CHILD])
    async with running(config(True), port=0, store=Store(state), scripted={"scripted": ScriptedUpstream()}) as rp:
        delegator = rp.pipeline.delegation.delegator
        delegator._runtimes["scripted"] = ScriptedRuntime(delegator.registry.get("scripted"), {}, upstream=child)
        delegator.gate = type(delegator.gate)(crowd + 1)
        delegator.health.settle_sync("scripted:scripted", time.time() - 10,
                                     Failure("capacity", True, "known_failed", 1, "rate limit"))
        waited: list[tuple[bool, float]] = []

        async def caller() -> None:
            started = time.perf_counter()
            result = await delegator.delegate("reviewer", "Review app.py.")
            waited.append((bool(result.evidence.get("health_probe")), (time.perf_counter() - started) * 1000))

        started = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for _ in range(crowd):
                nursery.start_soon(caller)
        total = (time.perf_counter() - started) * 1000
        state_after = delegator.health.get("scripted:scripted").state
    refused = sorted(ms for probe, ms in waited if not probe)
    return {"upstream": len(child.requests), "probes": sum(probe for probe, _ in waited), "refused": len(refused),
            "refused_p50": statistics.median(refused) if refused else 0.0, "refused_max": max(refused, default=0.0),
            "total": total, "after": state_after}


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def tables(times: dict[tuple[str, bool], list[float]], crowds: list[dict[str, Any]], crowd: int) -> list[str]:
    lines = ["| arm | JSON p50 ms | JSON p90 ms | stream p50 ms | stream p90 ms |", "|---|---|---|---|---|"]
    for arm in ARMS:
        row = [f"{f(times[(arm, s)], q):.2f}" for s in (False, True) for f, q in ((pct, 0.5), (pct, 0.9))]
        lines.append(f"| {arm} | " + " | ".join(row) + " |")
    med = {k: statistics.median(v) for k, v in times.items()}
    added = [med[("delegated", s)] - med[("plain", s)] - med[("direct", s)] - med[("child", s)]
             for s in (False, True)]
    tools = [med[("plain", s)] - med[("off", s)] for s in (False, True)]
    lines.append(f"| *delegation added* (delegated - plain - direct - child) | {added[0]:.2f} | | {added[1]:.2f} "
                 "| |")
    lines.append(f"| *tools offered* (plain - off) | {tools[0]:.2f} | | {tools[1]:.2f} | |")
    lines += ["", f"**Crowd at recovery**: {crowd} delegations at once at a pool whose cooldown has just ended; the "
              "child model takes 0.5 s to answer.", "",
              "| run | requests to the child model | probes | refused | refused callers answered in (p50 / max, "
              "ms) | all answered in ms | pool after |", "|---|---|---|---|---|---|---|"]
    for n, c in enumerate(crowds, 1):
        lines.append(f"| {n} | {c['upstream']} | {c['probes']} | {c['refused']} | {c['refused_p50']:.1f} / "
                     f"{c['refused_max']:.1f} | {c['total']:.0f} | {c['after']} |")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--count", type=int, default=200, help="timed requests per arm and kind")
    parser.add_argument("--crowd", type=int, default=50, help="callers at the pool's recovery")
    parser.add_argument("--runs", type=int, default=5, help="crowd runs")
    parser.add_argument("--write", action="store_true", help="write the tables into bench/RESULTS.md")
    args = parser.parse_args()
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="proxyvisor-bench-delegation-") as tmp:
        times = trio.run(measure_overhead, args.count, Path(tmp))
        crowds = [trio.run(crowd_at_recovery, args.crowd, Path(tmp) / f"crowd-{n}") for n in range(args.runs)]
    lines = tables(times, crowds, args.crowd)
    ok = all(c["upstream"] == 1 and c["probes"] == 1 and c["refused"] == args.crowd - 1 for c in crowds)
    verdict = (f"exactly one probe reached the child model in {sum(c['upstream'] == 1 for c in crowds)} of "
               f"{len(crowds)} runs: {'ok' if ok else 'FAILED'}")
    print("\n".join(lines) + "\n\n" + verdict)
    if args.write:
        command = "python bench/delegation.py --write" + ("" if args.count == 200 else f" --count {args.count}")
        write_section("Delegation and breakers (issue 6)", "\n".join([
            "Latency of one agent request through a supervised proxy, in ms (client and proxy in one process and "
            "trio loop, embedded scripted model, loopback HTTP; arms interleaved; "
            f"{args.count} requests per arm and kind after 10 warm-up rounds). `bench/delegation.py` says what each "
            "arm is.", "", f"Command: `{command}`", "",
            f"Setup: Python {platform.python_version()}, {platform.system()} {platform.release()}; "
            f"{time.strftime('%Y-%m-%d')}; run took {time.time() - started:.0f} s.", "",
            *lines, "", verdict]))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
