"""CPU of supervision's own steps before a request goes upstream (``Supervisor.catch_up`` then ``Supervisor.begin``)
per request, without the detectors' reading of the new items (``HistoryTracker.update`` / ``go_on``, timed and taken
out: the same work in every checkout, and most of the stage), on one synthetic agent session
(``bench/histories.py``) whose bodies are parsed as the pipeline parses them (``proxyvisor.proxy.bodies``). Median
thread CPU over ``--count`` requests after 5 warm-up requests (the first reads the history whole).

Usage (from the repository root)::

    python bench/supervise_steps.py                           # this checkout, chat, messages and responses at 79 KB
    python bench/supervise_steps.py --compare /tmp/old        # and another checkout, with the ratio
    python bench/supervise_steps.py --sizes 0.08,1 --rounds 3 # each checkout three times, alternating

Each checkout runs in a process of its own (``--checkout`` is how the parent runs one).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import ROOT, add_compare_options, checkouts, run_in_checkout  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="0.08", help="history sizes in MB, comma-separated (default 0.08: 79 KB)")
    p.add_argument("--formats", default="chat,messages,responses", help="formats, comma-separated")
    p.add_argument("--count", type=int, default=300, help="requests measured (default 300)")
    p.add_argument("--rounds", type=int, default=1, help="runs of each checkout, alternating (default 1)")
    add_compare_options(p)
    return p.parse_args(argv)


def measure(fmt_name: str, size_mb: float, count: int) -> float:
    """Median thread CPU (us) of catch_up + begin less the detectors' reading, with proxyvisor from ``sys.path``."""
    import trio

    from bench.histories import History
    from proxyvisor.config import SupervisorConfig
    from proxyvisor.detectors.detectors import HistoryTracker
    from proxyvisor.proxy.bodies import BodyCache
    from proxyvisor.proxy.formats import BY_NAME
    from proxyvisor.proxy.sessions import Session
    from proxyvisor.proxy.supervise import Supervisor

    reading = [0.0]

    def timed(name: str) -> None:
        inner = getattr(HistoryTracker, name)

        def wrapper(*a: Any, **k: Any) -> Any:
            started = time.thread_time()
            try:
                return inner(*a, **k)
            finally:
                reading[0] += time.thread_time() - started

        setattr(HistoryTracker, name, wrapper)

    for name in ("update", "go_on"):  # go_on: a checkout whose begin feeds a history catch_up found going on
        if hasattr(HistoryTracker, name):
            timed(name)
    fmt = BY_NAME[fmt_name]
    history = History(fmt_name, int(size_mb * 1024 * 1024), seed=11)
    bodies, supervisor, session = BodyCache(), Supervisor(SupervisorConfig()), Session("bench", 0.0, 0.0)

    async def run() -> float:
        spent = []
        for n in range(count + 5):
            body = bodies.loads(fmt.history_field, fmt.name, history.body(n))
            reading[0] = 0.0
            started = time.thread_time()
            # The sixth argument: what catch_up found (a Reading, or an older checkout's Update).
            exchange = supervisor.begin(session, fmt, body, None, None, await supervisor.catch_up(session, fmt, body))
            if n >= 5:
                spent.append(time.thread_time() - started - reading[0])
            if hasattr(exchange, "close"):
                exchange.close()
        return statistics.median(spent) * 1e6

    return trio.run(run)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    runs = checkouts(args.compare)
    cases = [(fmt, float(size)) for size in args.sizes.split(",") for fmt in args.formats.split(",")]
    if args.checkout is not None:
        sys.path[:0] = [str(args.checkout.resolve()), str(ROOT)]  # its proxyvisor, this checkout's histories
        for fmt, size in cases:
            print(f"{measure(fmt, size, args.count):.1f}")
        return 0
    found: dict[str, list[list[float]]] = {label: [] for label, _ in runs}
    for _ in range(args.rounds):
        for label, where in runs:
            out = run_in_checkout(__file__, where, "--sizes", args.sizes, "--formats", args.formats,
                                  "--count", str(args.count))
            found[label].append([float(x) for x in out.split()])
    for i, (fmt, size) in enumerate(cases):
        line = [f"{fmt}, {size:g} MB:"]
        for label, where in runs:
            line.append(f"{label} ({where}) " + " / ".join(f"{r[i]:.1f}" for r in found[label]) + " us")
        if args.compare:
            ratio = statistics.median(r[i] for r in found["this checkout"]) / \
                statistics.median(r[i] for r in found["compared"])
            line.append(f"ratio {ratio:.2f}")
        print("  ".join(line))
    return 0


if __name__ == "__main__":
    sys.exit(main())
