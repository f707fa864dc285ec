"""What OpenTelemetry tracing adds to a supervised request, against the same proxy with tracing off, in one run.

Usage: python bench/telemetry.py [--count N] [--block N] [--write]

Two proxies run in this process on the embedded scripted upstream, supervision on: ``off`` (``[telemetry]``
empty: the SDK is not imported) and ``on`` (``otlp_endpoint`` set). Requests (Chat Completions, JSON, a history
ending with a tool result, the agent's ``Bash`` tool, a client ``traceparent``) alternate between them in blocks,
and each is timed (wall, at the client) and costed (the process's CPU time over the block, per request). The
exporter's thread sends nothing during the run (its schedule delay is set past it), so the figure is what making
and queueing a request's spans costs the request path; encoding and sending them happens on that thread, off the
request. The ratios are on/off. **Target** (printed, not enforced: a shared runner is noisy): tracing adds under
0.5 ms p50 to a request.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import command_line, exit_status, free_port, loadavg, pct  # noqa: E402
from bench.results import write_section  # noqa: E402
from proxyvisor.config import Config  # noqa: E402
from proxyvisor.proxy.service import running  # noqa: E402
from proxyvisor.scripted.upstream import ScriptedUpstream  # noqa: E402
from proxyvisor.store import Store  # noqa: E402

TARGET_MS = 0.5
BODY = {"model": "scripted-model", "messages": [
    {"role": "system", "content": "You are a coding agent."},
    {"role": "user", "content": "Run the tests and tell me what fails."},
    {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
        "name": "Bash", "arguments": "{\"command\": \"pytest -q\"}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "3 passed in 0.2s"}],
    "tools": [{"type": "function", "function": {"name": "Bash", "parameters": {
        "type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}]}
TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


async def measure(count: int, block: int, state: Path) -> dict[str, tuple[list[float], list[float]]]:
    """Per arm, (wall ms of each request, CPU ms per request of each block)."""
    arms = {"off": Config(),
            "on": Config().with_overrides(telemetry={"otlp_endpoint": f"http://127.0.0.1:{free_port()}"})}
    out: dict[str, tuple[list[float], list[float]]] = {arm: ([], []) for arm in arms}
    async with running(arms["off"], port=0, store=Store(state / "off"), scripted={"scripted": ScriptedUpstream()}) \
            as off, running(arms["on"], port=0, store=Store(state / "on"),
                            scripted={"scripted": ScriptedUpstream()}) as on:
        urls = {"off": off.url, "on": on.url}
        async with httpx.AsyncClient(timeout=30) as client:
            for arm in arms:  # warm-up: the first request of a proxy pays for one-time set-up
                for _ in range(5):
                    (await client.post(urls[arm] + "/v1/chat/completions", json=BODY)).raise_for_status()
            done = 0
            while done < count:
                for arm in arms:
                    walls, cpus = out[arm]
                    cpu = time.process_time()
                    for _ in range(block):
                        started = time.perf_counter()
                        response = await client.post(urls[arm] + "/v1/chat/completions", json=BODY,
                                                     headers={"traceparent": TRACEPARENT})
                        walls.append((time.perf_counter() - started) * 1000)
                        response.raise_for_status()
                    cpus.append((time.process_time() - cpu) * 1000 / block)
                done += block
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=600, help="requests per arm (default 600)")
    parser.add_argument("--block", type=int, default=20, help="requests per arm before switching (default 20)")
    parser.add_argument("--write", action="store_true", help="write the section of bench/RESULTS.md")
    args = parser.parse_args(argv)
    # Nothing is sent during the run: no timed export, and a queue and a batch that hold every span of it.
    os.environ["OTEL_BSP_SCHEDULE_DELAY"] = str(24 * 3600 * 1000)
    os.environ["OTEL_BSP_MAX_QUEUE_SIZE"] = os.environ["OTEL_BSP_MAX_EXPORT_BATCH_SIZE"] = str(8 * (args.count + 10))
    # The endpoint is a closed port: the export at the proxy's exit fails (one warning) within a second.
    os.environ["OTEL_EXPORTER_OTLP_TIMEOUT"] = "1"
    with tempfile.TemporaryDirectory(prefix="proxyvisor-bench-telemetry-") as state:
        out = trio.run(measure, args.count, args.block, Path(state))
    rows = []
    p50 = {arm: pct(walls, 50) for arm, (walls, _) in out.items()}
    cpu = {arm: statistics.median(cpus) for arm, (_, cpus) in out.items()}
    for arm, (walls, _) in out.items():
        rows.append(f"| {arm} | {len(walls)} | {p50[arm]:.2f} | {pct(walls, 99):.2f} | {cpu[arm]:.3f} |")
    added = p50["on"] - p50["off"]
    table = "\n".join(["| tracing | n | p50 ms | p99 ms | CPU ms/request |", "|---|---|---|---|---|", *rows])
    summary = (f"tracing on adds {added:+.2f} ms p50 ({p50['on'] / p50['off']:.2f}x) and "
               f"{cpu['on'] - cpu['off']:+.3f} ms CPU per request ({cpu['on'] / cpu['off']:.2f}x); load average "
               f"{loadavg()}")
    print(table)
    print(summary)
    if added > TARGET_MS:
        print(f"MISSED target: tracing adds under {TARGET_MS} ms p50")
    if args.write:
        write_section("OpenTelemetry tracing", "A supervised request (Chat Completions, JSON, a tool-result round, a "
                      "client traceparent) through a proxy with [telemetry] off and one with it on, interleaved in "
                      "one run; spans made and queued, sent by the exporter's thread after the run (see "
                      "bench/telemetry.py). Tracing off imports nothing and does nothing: bench/overhead.py's "
                      "supervised arm is the figure for it.\n\n"
                      f"Command: `{command_line('bench/telemetry.py', argv)}`\n\n{table}\n\n{summary}.\n")
    return exit_status(added <= TARGET_MS)


if __name__ == "__main__":
    sys.exit(main())
