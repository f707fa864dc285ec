"""What a rewritten history costs the proxy's request side: reading it from the start, at once as before and as the
proxy now does (receipts reused by content, in steps on the event loop).

Usage: python bench/rewrite.py [--sizes 1,4] [--repeat 5]

For each format (Chat, Anthropic messages) and history size in MB (``bench/histories.py``), a thread's tracker reads
the history as sent, then each rewrite of it, as a compacting or editing agent sends it next:

- ``first edited``: the first message (the task) edited, the rest as before;
- ``compacted``: the first messages, a summary, then the later half (the middle dropped, as compaction does);
- ``summary in front``: a summary, then the later half.

It prints, per case, the CPU time (thread time, median of ``--repeat``) of reading the rewritten history with every
receipt computed again (the baseline: what each rewrite cost before), with receipts reused by content, the ratio, and
the longest the event loop was held at once when the proxy reads it in steps (``Supervisor.catch_up``: CPU time
between two turns of the loop's other tasks). Nothing here starts a server; it does not load the machine for long.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.histories import History  # noqa: E402
from proxyvisor.config import SupervisorConfig  # noqa: E402
from proxyvisor.detectors import receipts  # noqa: E402
from proxyvisor.detectors.detectors import HistoryTracker  # noqa: E402
from proxyvisor.proxy.formats import BY_NAME, WireFormat  # noqa: E402
from proxyvisor.proxy.sessions import Session  # noqa: E402
from proxyvisor.proxy.supervise import Supervisor  # noqa: E402


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


def read(fmt: WireFormat, before: dict[str, Any], after: dict[str, Any], reuse: bool) -> float:
    """CPU seconds of a tracker that read ``before`` reading ``after`` (a rewrite: read from the start)."""
    schemas = {t.name: t.schema for t in fmt.tools(after)}
    saved = receipts.CACHED
    receipts.CACHED = saved if reuse else 0
    try:
        tracker = HistoryTracker()
        tracker.update(fmt.history(before), fmt.message, schemas)
        return cpu(lambda: tracker.update(fmt.history(after), fmt.message, schemas))
    finally:
        receipts.CACHED = saved


async def held(fmt: WireFormat, before: dict[str, Any], after: dict[str, Any]) -> float:
    """The longest CPU time (s) the event loop's other tasks waited at once while the proxy's supervisor read
    ``after`` (``catch_up`` then ``begin``) in a session that read ``before``."""
    supervisor, session = Supervisor(SupervisorConfig()), Session("bench", 0, 0)
    supervisor.begin(session, fmt, orjson.loads(orjson.dumps(before)))
    body = orjson.loads(orjson.dumps(after))
    worst, reading = 0.0, True

    async def heartbeat() -> None:
        nonlocal worst
        while reading:
            started = time.thread_time()
            await trio.lowlevel.checkpoint()
            worst = max(worst, time.thread_time() - started)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(heartbeat)
        await trio.lowlevel.checkpoint()
        update = await supervisor.catch_up(session, fmt, body)
        supervisor.begin(session, fmt, body, update=update)
        reading = False
    return worst


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1,4", help="history sizes in MB, comma-separated (default 1,4)")
    parser.add_argument("--repeat", type=int, default=5, help="runs per case; the median is shown (default 5)")
    args = parser.parse_args()
    print(f"{'format':<9} {'MB':>3} {'rewrite':<17} {'items':>6} {'recompute ms':>13} {'reuse ms':>9} {'ratio':>6} "
          f"{'longest hold ms (stepped)':>26}")
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
