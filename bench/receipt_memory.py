"""Memory the receipt caches of many sessions hold: ``--sessions`` sessions (each with its own cache, as a session's
supervision has) read ``--calls`` tool calls each (a shell command, its arguments parsed from JSON as a request's
are, and 1 KB of output), one session after another; then the process's resident memory added since the start
(MB), and the share of the last session's calls found again in its cache (reuse of what is used last).

Usage (from the repository root)::

    python bench/receipt_memory.py                          # this checkout
    python bench/receipt_memory.py --compare /tmp/old       # and another checkout, with the ratio

Each checkout runs in a process of its own (``--checkout`` is how the parent runs the other one).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import add_compare_options, checkouts, run_in_checkout  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sessions", type=int, default=128, help="sessions (default 128)")
    p.add_argument("--calls", type=int, default=2048, help="tool calls per session (default 2048)")
    add_compare_options(p)
    return p.parse_args(argv)


def _rss_mb() -> float:
    """The process's resident memory, MB (Linux)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def measure(sessions: int, calls: int) -> tuple[float, float]:
    """Resident MB added and the share of the last session's calls found again (module docstring), with proxyvisor
    imported from ``sys.path``."""
    import gc

    import orjson

    from proxyvisor.detectors.receipts import ReceiptCache
    from proxyvisor.transcript import ToolOutput, ToolUse

    runner = {"type": "object", "properties": {"command": {"type": "string"}}}

    def call(session: int, n: int) -> tuple[ToolUse, ToolOutput]:
        arguments = orjson.loads(orjson.dumps({"command": f"pytest tests/test_{session}_{n}.py -q"}))
        return ToolUse(f"c{n}", "Bash", arguments), ToolOutput(f"c{n}", "." * 1024 + f"\n{n} passed in 0.1s")

    gc.collect()
    before = _rss_mb()
    caches = [ReceiptCache() for _ in range(sessions)]
    for s, cache in enumerate(caches):
        for n in range(calls):
            cache.receipt(*call(s, n), runner)
    gc.collect()
    added = _rss_mb() - before
    last = caches[-1]
    first = {n: last.receipt(*call(sessions - 1, n), runner) for n in range(calls)}
    found = sum(last.receipt(*call(sessions - 1, n), runner) is first[n] for n in range(calls))
    return added, found / calls


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.checkout is not None:
        sys.path.insert(0, str(args.checkout.resolve()))
        mb, found = measure(args.sessions, args.calls)
        print(f"{mb:.1f} {found:.3f}")
        return 0
    added: dict[str, float] = {}
    for label, where in checkouts(args.compare):
        out = run_in_checkout(__file__, where, "--sessions", str(args.sessions), "--calls", str(args.calls))
        mb, found = (float(v) for v in out.split()[-2:])
        added[label] = mb
        print(f"{label} ({where}): {mb:.1f} MB resident added by {args.sessions} sessions of {args.calls} calls; "
              f"the last session's calls found again: {found:.0%}")
    if args.compare:
        print(f"ratio: {added['this checkout'] / added['compared']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
