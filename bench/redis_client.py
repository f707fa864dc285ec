"""How proxyvisor's trio event loop should talk to Redis: per-operation latency of a small ``GET`` and a 10 KB
``SET`` (a session state's size) as seen from a trio task, for each way of calling redis-py.

Usage (from the repository root, in the project's environment; needs the Debian ``redis-server``)::

    python bench/redis_client.py              # 2,000 operations per way and kind
    python bench/redis_client.py --ops 500 --no-write

The ways, each measured from inside ``trio.run`` on one ``redis-server`` on loopback:

- ``sync in to_thread``: redis-py's synchronous client called in ``trio.to_thread.run_sync`` (what
  ``proxyvisor.adapters.state`` does, as the diskcache stores always have);
- ``asyncio bridged``: redis-py's asyncio client on one dedicated asyncio thread, each call submitted with
  ``asyncio.run_coroutine_threadsafe`` and the trio task woken through its token (``proxyvisor.adapters.
  litellm_bridge``'s way);
- ``sync on the loop``: the synchronous client called on the event loop itself: the floor (one network round
  trip), not an option (it holds every other session while Redis answers).

A trio-native client would need neither thread; none is measured here (``coredis``, built on anyio, was not
tried). Alone (one task) and with 32 tasks at once. The figures go
to the "Redis client from trio (issue 15)" section of ``bench/RESULTS.md`` with the load average: the machine is
shared.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import os
import statistics
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import command_line, loadavg, pct, start_redis, workspace
from bench.results import write_section

VALUE = os.urandom(10 * 1024)
SECTION = "Redis client from trio (issue 15)"
THREAD, BRIDGED = "sync in to_thread", "asyncio bridged"


class Bridge:
    """One asyncio loop in a daemon thread running redis-py's asyncio client (litellm_bridge's pattern)."""

    def __init__(self, url: str) -> None:
        import redis.asyncio

        self.loop = asyncio.new_event_loop()
        ready = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(self.loop)
            self.loop.call_soon(ready.set)
            self.loop.run_forever()

        threading.Thread(target=run, daemon=True).start()
        ready.wait()
        self.client = redis.asyncio.Redis.from_url(url)

    async def call(self, fn: Callable[[Any], Awaitable[Any]]) -> Any:
        token = trio.lowlevel.current_trio_token()
        done = trio.Event()

        async def wrapped() -> Any:
            return await fn(self.client)

        future: concurrent.futures.Future[Any] = asyncio.run_coroutine_threadsafe(wrapped(), self.loop)
        future.add_done_callback(lambda _f: token.run_sync_soon(done.set))
        await done.wait()
        return future.result()


async def measure(url: str, ops: int, tasks: int) -> dict[str, dict[str, list[float]]]:
    import redis

    sync = redis.Redis.from_url(url)
    bridge = Bridge(url)
    sync.set("bench:get", b"x" * 16)
    ways: dict[str, dict[str, Callable[[], Awaitable[Any]]]] = {
        THREAD: {
            "GET": lambda: trio.to_thread.run_sync(sync.get, "bench:get"),
            "SET 10 KB": lambda: trio.to_thread.run_sync(lambda: sync.set("bench:set", VALUE, px=60000))},
        BRIDGED: {
            "GET": lambda: bridge.call(lambda c: c.get("bench:get")),
            "SET 10 KB": lambda: bridge.call(lambda c: c.set("bench:set", VALUE, px=60000))},
        "sync on the loop": {
            "GET": lambda: _now(sync.get, "bench:get"),
            "SET 10 KB": lambda: _now(sync.set, "bench:set", VALUE, px=60000)}}
    out: dict[str, dict[str, list[float]]] = {}
    for way, kinds in ways.items():
        for kind, op in kinds.items():
            for _ in range(50):  # warm: connections made, threads started
                await op()
            samples: list[float] = []
            async with trio.open_nursery() as nursery:
                for _ in range(tasks):
                    nursery.start_soon(_worker, op, ops // tasks, samples)
            out.setdefault(way, {})[kind] = samples
    sync.close()
    return out


async def _worker(op: Callable[[], Awaitable[Any]], n: int, samples: list[float]) -> None:
    for _ in range(n):
        started = time.perf_counter()
        await op()
        samples.append((time.perf_counter() - started) * 1000)


async def _now(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return fn(*args, **kwargs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ops", type=int, default=2000, help="operations per way, kind and concurrency (2000)")
    parser.add_argument("--no-write", action="store_true", help="print the figures without writing RESULTS.md")
    args = parser.parse_args(argv)
    command = command_line("bench/redis_client.py", argv)
    load_before = loadavg()
    with workspace("proxyvisor-redis-bench-") as (work, procs):
        proc, url = start_redis(work)
        procs.append(proc)
        rows = []
        for tasks in (1, 32):
            figures = trio.run(measure, url, args.ops, tasks)
            for way, kinds in figures.items():
                for kind, samples in kinds.items():
                    rows.append((tasks, way, kind, pct(samples, 50), pct(samples, 99), statistics.fmean(samples)))
    lines = [f"Command: `{command}`", "", (f"Per-operation latency (ms) as a trio task sees it, one redis-server "
                                              f"on loopback; {args.ops} operations per row; {os.cpu_count()} CPUs, "
                                              f"1-minute load average {load_before} before, {loadavg()} after."),
             "", "| tasks at once | way | op | p50 | p99 | mean |", "|---|---|---|---|---|---|"]
    lines += [f"| {tasks} | {way} | {kind} | {p50:.3f} | {p99:.3f} | {mean:.3f} |"
              for tasks, way, kind, p50, p99, mean in rows]
    p50 = {(tasks, way, kind): value for tasks, way, kind, value, _p99, _mean in rows}
    lines += ["", "Reading: " + "; ".join(
        f"{kind} with {tasks} task{'s' if tasks > 1 else ''} at once, p50 {p50[(tasks, THREAD, kind)]:.3f} ms in a "
        f"worker thread against {p50[(tasks, BRIDGED, kind)]:.3f} ms bridged "
        f"({p50[(tasks, BRIDGED, kind)] / p50[(tasks, THREAD, kind)]:.2f}x)"
        for tasks in (1, 32) for kind in ("GET", "SET 10 KB"))
        + ". The thread hop, not Redis, is most of the cost either way (the floor on the loop is one round trip); "
          "proxyvisor.adapters.state uses the synchronous client in a worker thread: "
        + ("as fast or faster in every row here" if all(
            p50[(t, BRIDGED, k)] >= p50[(t, THREAD, k)] for t in (1, 32) for k in ("GET", "SET 10 KB"))
           else "slower in some rows here, but")
        + ", one interface with the diskcache backend (whose calls run in worker threads too), and the CLI calls it "
          "directly without an event loop."]
    text = "\n".join(lines)
    print(text)
    if not args.no_write:
        write_section(SECTION, text)
        print(f"wrote the section {SECTION!r} of bench/RESULTS.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
