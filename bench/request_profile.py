"""Where a supervised request spends its time, stage by stage, as its history grows: CPU per request of each step
of the request side (parse, session lookup, supervision's reading of the history, condensing, serialising, the
ledger), of the reply side (supervision's stages, the verify-gate check, the answer's accounting) and of the
session state's load and save, for one synthetic agent session (``bench/histories.py``) of a given size and format.
``save (loop only)`` is the CPU on the event loop, which on this local store includes the write (a Redis
write would run in a worker thread, not counted).

Usage (from the repository root)::

    python bench/request_profile.py                       # chat, messages and responses at 4 MB, 30 requests
    python bench/request_profile.py --sizes 0.1,1,4 --formats chat
    python bench/request_profile.py --checkout /tmp/old   # the same stages in another checkout of proxyvisor
    python bench/request_profile.py --threads 8           # one session of 8 threads (sub-agents), round robin

Everything runs in this process: the proxy (supervision on, its defaults) and the scripted upstream on loopback
sockets, the requests handed straight to the proxy's handler (no client socket: the body's trip in is not
counted). Each stage is timed with the thread's CPU clock, so other work on the machine barely moves it; a stage
that awaits (condensing's step) counts what the loop ran meanwhile. ``overhead p50`` is the proxy's own
``x-proxyvisor-overhead-ms`` (wall time). Figures are printed; the comparison before/after is in bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="4", help="history sizes in MB, comma-separated (default 4)")
    p.add_argument("--formats", default="chat,messages,responses", help="formats, comma-separated")
    p.add_argument("--count", type=int, default=30, help="requests measured per size and format (default 30)")
    p.add_argument("--threads", type=int, default=1,
                   help="threads of the session (sub-agents: histories of their own), its requests going round them "
                        "(default 1)")
    p.add_argument("--checkout", type=Path, help="import proxyvisor from this checkout instead of this one")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from bench.histories import History  # noqa: E402 - this checkout's synthetic histories
    from bench.common import proxy_in_process  # noqa: E402

    if args.checkout is not None:
        sys.path.insert(0, str(args.checkout.resolve()))
        for name in [m for m in sys.modules if m == "proxyvisor" or m.startswith("proxyvisor.")]:
            del sys.modules[name]
    import trio

    from proxyvisor.detectors.detectors import HistoryTracker
    from proxyvisor.proxy import commands, pipeline, session_state, supervise
    from proxyvisor.proxy.condensing import RequestCondenser
    from proxyvisor.proxy.server import Request

    spent: collections.Counter[str] = collections.Counter()

    def timed(owner: Any, name: str, label: str) -> None:
        inner = getattr(owner, name)

        def wrapper(*a: Any, **k: Any) -> Any:
            started = time.thread_time()
            try:
                return inner(*a, **k)
            finally:
                spent[label] += time.thread_time() - started

        setattr(owner, name, wrapper)

    def timed_async(owner: Any, name: str, label: str) -> None:
        inner = getattr(owner, name)

        async def wrapper(*a: Any, **k: Any) -> Any:
            started = time.thread_time()
            try:
                return await inner(*a, **k)
            finally:
                spent[label] += time.thread_time() - started

        setattr(owner, name, wrapper)

    try:
        from proxyvisor.proxy.bodies import BodyCache
        timed(BodyCache, "loads", "parse the body")
    except ImportError:  # a checkout from before proxy/bodies.py: the pipeline parses with orjson
        class Parse:
            import orjson as _orjson
            JSONDecodeError = _orjson.JSONDecodeError
            loads = staticmethod(_orjson.loads)
            dumps = staticmethod(_orjson.dumps)

        pipeline.orjson = Parse  # type: ignore[assignment]
        timed(Parse, "loads", "parse the body")
    timed(pipeline, "identify", "identify the session")
    timed(commands, "strip_exchanges", "strip command exchanges")
    # catch_up finds what begin takes (the thread, its key's parts, the tools) and reads a history from the start.
    timed_async(supervise.Supervisor, "catch_up", "Supervisor.catch_up")
    timed(supervise.Supervisor, "begin", "Supervisor.begin (all)")
    timed(HistoryTracker, "update", "  begin: detectors (new items)")
    if hasattr(HistoryTracker, "go_on"):  # begin feeds a history catch_up found going on through it
        timed(HistoryTracker, "go_on", "  begin: detectors (new items)")
    timed(RequestCondenser, "collect", "  begin: condense candidates")
    timed_async(supervise.Exchange, "before_forward", "before_forward (condense, plan)")
    # Serialised as one body, or (later) as the pieces that go upstream.
    timed(supervise.Exchange, "upstream_chunks" if hasattr(supervise.Exchange, "upstream_chunks") else "upstream_body",
          "serialise the upstream body")
    timed(pipeline.Pipeline, "_account", "ledger line")
    # The reply side and the work after the answer (on this local store the state's save runs once the client has
    # the whole answer: the server's Response.after step, counted here all the same).
    timed(supervise.Exchange, "reply", "reply: supervision's stages")
    timed_async(pipeline.Pipeline, "_gated", "reply: verify-gate check")
    timed(pipeline.Pipeline, "_respond", "reply: parse, usage, ledger line")
    timed_async(session_state.SessionStates, "load", "session state: load")
    timed_async(session_state.SessionStates, "save", "session state: save (loop only)")
    timed(session_state, "encode", "  save: pickle")

    async def measure(fmt: str, size_mb: float) -> tuple[int, list[float]]:
        async with proxy_in_process("bench/request_profile.py") as proxy:
            # Each thread's history its own (another system prompt), all of one session by its header; one
            # thread's session is known by its history, as in the runs before --threads.
            histories = [History(fmt, int(size_mb * 1024 * 1024), seed=11 + t) for t in range(args.threads)]
            headers = [(b"content-type", b"application/json"), (b"authorization", b"Bearer bench")] + \
                ([(b"x-proxyvisor-session", b"bench")] if args.threads > 1 else [])
            overheads = []
            warm = 5 * args.threads  # the first requests read the histories whole (the session's start)
            for n in range(args.count + warm):
                if n == warm:
                    spent.clear()
                history = histories[n % args.threads]
                body = history.body(n // args.threads)
                response = await proxy.pipeline(Request("POST", history.path, headers, body,
                                                        time.perf_counter()))
                if not isinstance(response.body, bytes):
                    async for _ in response.body:
                        pass
                if n >= warm:
                    overheads.append(float(dict(response.headers)[b"x-proxyvisor-overhead-ms"]))
        return len(histories[0].body(0)), overheads

    where = args.checkout or ROOT
    print(f"proxyvisor from {where}")
    for size in [float(x) for x in args.sizes.split(",")]:
        for fmt in args.formats.split(","):
            first, overheads = trio.run(measure, fmt, size)
            print(f"{fmt}, {first / 1024:.0f} KB history, {args.threads} thread(s), {args.count} requests "
                  "(CPU ms per request):")
            for label, seconds in spent.items():
                print(f"  {label:34s} {seconds / args.count * 1000:8.3f}")
            print(f"  {'overhead p50 (header, wall ms)':34s} {statistics.median(overheads):8.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
