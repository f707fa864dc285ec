"""What a rewritten history costs the proxy's request side: reading it from the start, at once as before and as the
proxy now does (receipts reused by content, in steps on the event loop).

Usage: python bench/rewrite.py [--sizes 1,4] [--repeat 5]

For each format (Chat, Anthropic messages) and history size in MB (``bench/histories.py``), a thread's tracker reads
the history as sent, then each rewrite of it, as a compacting or editing agent sends it next:

- ``first edited``: the first message (the task) edited, the rest as before;
- ``compacted``: the first messages, a summary, then the later half (the middle dropped, as compaction does);
- ``summary in front``: a summary, then the later half.

It prints, per case, the CPU time (thread time, median of ``--repeat``) of reading the rewritten history with every
receipt computed again and none kept (the baseline: what each rewrite cost before, all of it at once on the event
loop), with
receipts reused by content, the ratio, and the longest another task on the event loop waited between two of its
turns while the proxy read it in steps (``Supervisor.catch_up`` then ``begin``; CPU time of the loop's thread: trio
runs each ready task once per round in a random order, so such a wait can span two steps). Nothing here starts a
server; it does not load the machine for long. Then, what the reuse costs the usual request (a key for each new
receipt): the tracker's CPU per request of a growing 1 MB session, with and without reuse, and their ratio. Last, the
whole request of the largest size and each rewrite of it through a supervised proxy in this process (its defaults,
the scripted upstream on loopback, each request handed to its handler): its CPU, its body parse's, and the longest
another task waited meanwhile (what the other stages still do at once: the parse, condensing's candidates, the
upstream body's serialisation).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import orjson
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import proxy_in_process  # noqa: E402
from bench.histories import History  # noqa: E402
from proxyvisor.config import SupervisorConfig  # noqa: E402
from proxyvisor.detectors import receipts  # noqa: E402
from proxyvisor.detectors.detectors import HistoryTracker  # noqa: E402
from proxyvisor.detectors.receipts import ReceiptCache  # noqa: E402
from proxyvisor.proxy.bodies import BodyCache  # noqa: E402
from proxyvisor.proxy.formats import BY_NAME, WireFormat  # noqa: E402
from proxyvisor.proxy.server import Request  # noqa: E402
from proxyvisor.proxy.sessions import Session  # noqa: E402
from proxyvisor.proxy.supervise import Supervisor  # noqa: E402


ROUNDS = 300
"""Requests of the growing session (one round each)."""


def rewrites(fmt: WireFormat, body: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The rewritten bodies of ``body``, by name (module docstring)."""
    items = fmt.history(body)
    half = len(items) // 2
    if fmt.message(items[half]).role == "tool":  # start the later half at an assistant turn
        half += 1
    summary = fmt.history(fmt.request_from_chat([{"role": "user", "content": "Summary: the tests were run."}],
                                                "m", False, ()))
    first = orjson.loads(orjson.dumps(items[0]).replace(b'"content":"', b'"content":"(edited) ', 1))
    shapes = {"first edited": [first, *items[1:]],
              "compacted": [*items[:1], *summary, *items[half:]],
              "summary in front": [*summary, *items[half:]]}
    return {name: {**body, fmt.history_field: new} for name, new in shapes.items()}


def cpu(fn: Callable[[], Any]) -> float:
    started = time.thread_time()
    fn()
    return time.thread_time() - started


def measured(fn: Callable[[], Any], reuse: bool) -> float:
    """CPU seconds of ``fn()``, with receipts reused by content, or (the baseline) every receipt computed and no key
    made or kept, as before the cache."""
    cached = ReceiptCache.receipt
    if not reuse:
        ReceiptCache.receipt = lambda self, use, output, schema: receipts.receipt(  # type: ignore[method-assign]
            use, output, schema, self.mutating_tools)
    try:
        return cpu(fn)
    finally:
        ReceiptCache.receipt = cached  # type: ignore[method-assign]


def read(fmt: WireFormat, before: dict[str, Any], after: dict[str, Any], reuse: bool) -> float:
    """CPU seconds of a tracker that read ``before`` reading ``after`` (a rewrite: read from the start)."""
    schemas = {t.name: t.schema for t in fmt.tools(after)}
    tracker = HistoryTracker()
    tracker.update(fmt.history(before), fmt.message, schemas)
    return measured(lambda: tracker.update(fmt.history(after), fmt.message, schemas), reuse)


def grow(fmt: WireFormat, body: dict[str, Any], rounds: int, reuse: bool) -> float:
    """CPU seconds per request of a tracker fed ``body``'s history as a session sends it, its last ``rounds``
    rounds one request each (what the reuse costs the usual request: a key for each new receipt)."""
    schemas = {t.name: t.schema for t in fmt.tools(body)}
    items = fmt.history(body)
    ends = [len(items) - 2 * n for n in range(rounds, -1, -1)]
    tracker = HistoryTracker()
    tracker.update(items[:ends[0]], fmt.message, schemas)

    def requests() -> None:
        for end in ends[1:]:
            tracker.update(items[:end], fmt.message, schemas)

    return measured(requests, reuse) / rounds


async def longest_wait(work: Callable[[], Awaitable[Any]]) -> float:
    """The longest CPU time (s) another task on the event loop waited between two of its turns while ``work()``
    ran."""
    worst, running = 0.0, True

    async def heartbeat(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        nonlocal worst
        last = time.thread_time()
        task_status.started()  # (the work starts only now: its first stretch is measured too)
        while running:
            await trio.lowlevel.checkpoint()
            now = time.thread_time()
            worst, last = max(worst, now - last), now

    async with trio.open_nursery() as nursery:
        await nursery.start(heartbeat)
        await work()
        running = False
    return worst


async def held(fmt: WireFormat, before: dict[str, Any], after: dict[str, Any]) -> float:
    """:func:`longest_wait` while the proxy's supervisor read ``after`` (``catch_up`` then ``begin``) in a session
    that read ``before``."""
    supervisor, session = Supervisor(SupervisorConfig()), Session("bench", 0, 0)
    supervisor.begin(session, fmt, orjson.loads(orjson.dumps(before)))
    body = orjson.loads(orjson.dumps(after))

    async def read() -> None:
        supervisor.begin(session, fmt, body, reading=await supervisor.catch_up(session, fmt, body))

    return await longest_wait(read)


async def through_proxy(name: str, size: int) -> list[tuple[str, float, float, float]]:
    """A session of ``size`` bytes in format ``name``, then each of its rewrites, sent to a supervised proxy in this
    process (its defaults, the scripted upstream on loopback; the request handed to its handler): per request, its
    name, the CPU seconds of the whole request, of the body's parse, and :func:`longest_wait`."""
    fmt, history = BY_NAME[name], History(name, size)
    first = history.body(0)
    requests = {"as sent": first, **{shape: orjson.dumps(body)
                                     for shape, body in rewrites(fmt, orjson.loads(first)).items()}}
    headers = [(b"content-type", b"application/json"), (b"authorization", b"Bearer bench"),
               (b"x-proxyvisor-session", b"bench")]
    parsed = BodyCache.loads
    parse = 0.0

    def timed_parse(*args: Any) -> Any:
        nonlocal parse
        started = time.thread_time()
        try:
            return parsed(*args)
        finally:
            parse += time.thread_time() - started

    out = []
    BodyCache.loads = timed_parse  # type: ignore[method-assign]
    try:
        async with proxy_in_process("bench/rewrite.py") as proxy:
            for shape, body in requests.items():
                async def send(body: bytes = body) -> None:
                    response = await proxy.pipeline(Request("POST", history.path, headers, body,
                                                            time.perf_counter()))
                    if not isinstance(response.body, bytes):
                        async for _ in response.body:
                            pass

                parse, started = 0.0, time.thread_time()
                wait = await longest_wait(send)
                out.append((shape, time.thread_time() - started, parse, wait))
    finally:
        BodyCache.loads = parsed  # type: ignore[method-assign]
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1,4", help="history sizes in MB, comma-separated (default 1,4)")
    parser.add_argument("--repeat", type=int, default=5, help="runs per case; the median is shown (default 5)")
    args = parser.parse_args()
    print(f"{'format':<9} {'MB':>3} {'rewrite':<17} {'items':>6} {'recompute ms':>13} {'reuse ms':>9} {'ratio':>6} "
          f"{'longest wait ms (stepped)':>26}")
    for name in ("chat", "messages"):
        fmt = BY_NAME[name]
        for size in (float(s) for s in args.sizes.split(",")):
            body = orjson.loads(History(name, int(size * 1024 * 1024)).body(0))
            for shape, rewritten in rewrites(fmt, body).items():
                gc.collect()
                gc.disable()
                try:
                    base = statistics.median(read(fmt, body, rewritten, False) for _ in range(args.repeat))
                    reuse = statistics.median(read(fmt, body, rewritten, True) for _ in range(args.repeat))
                    hold = statistics.median(trio.run(held, fmt, body, rewritten) for _ in range(args.repeat))
                finally:
                    gc.enable()
                print(f"{name:<9} {size:>3g} {shape:<17} {len(fmt.history(rewritten)):>6} {base * 1000:>13.1f} "
                      f"{reuse * 1000:>9.1f} {base / reuse:>6.1f} {hold * 1000:>26.2f}")
    print(f"\nper request of a growing session, {ROUNDS} requests of one round each (us, median of --repeat):")
    for name in ("chat", "messages"):
        fmt = BY_NAME[name]
        body = orjson.loads(History(name, 1024 * 1024, seed=3).body(ROUNDS))
        base = statistics.median(grow(fmt, body, ROUNDS, False) for _ in range(args.repeat))
        reuse = statistics.median(grow(fmt, body, ROUNDS, True) for _ in range(args.repeat))
        print(f"{name:<9} 1 MB  recompute {base * 1e6:7.1f}  reuse {reuse * 1e6:7.1f}  ratio {reuse / base:5.2f}")
    size = max(float(s) for s in args.sizes.split(","))
    print(f"\nthe whole request through a supervised proxy in this process, {size:g} MB (CPU ms):")
    for name in ("chat", "messages"):
        gc.collect()
        gc.disable()
        try:
            rows = trio.run(through_proxy, name, int(size * 1024 * 1024))
        finally:
            gc.enable()
        for shape, total, parse, wait in rows:
            print(f"{name:<9} {shape:<17} request {total * 1000:7.1f}  body parse {parse * 1000:6.1f}  "
                  f"longest wait {wait * 1000:6.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
