"""Re-materialising supervision's notes: CPU per request of placing a thread's notes in the upstream body and
serialising it, on a growing synthetic session (``bench/histories.py``), each request one tool round longer.

Usage (from the repository root)::

    python bench/notes_profile.py                          # 16 notes, histories of 0.1, 1 and 4 MB, 3 formats
    python bench/notes_profile.py --checkout /tmp/old      # the same, and another checkout of proxyvisor as a
                                                           # baseline in the same run, with the ratio

The notes stay at the history positions they were first placed at (as ``Thread.notes`` are), spread evenly over the
first request's history. Each request is parsed by the body cache (not counted), then ``WireFormat.insert_notes``
and ``proxyvisor.proxy.bodies.chunks`` are timed together with the thread's CPU clock; the first 5 requests of each
session are not counted.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def measure(checkout: Path, sizes: list[float], formats: list[str], notes: int, count: int) -> dict[str, float]:
    """ms of CPU per request by ``"format size"``, proxyvisor imported from ``checkout``."""
    sys.path[:0] = [str(checkout), str(ROOT)]
    from bench.histories import History
    from proxyvisor.proxy.bodies import BodyCache, chunks
    from proxyvisor.proxy.formats import BY_NAME

    out = {}
    for fmt_name in formats:
        for size in sizes:
            fmt, history, cache = BY_NAME[fmt_name], History(fmt_name, int(size * 1024 * 1024)), BodyCache()
            placed: list[tuple[int, str]] = []
            spent = []
            for n in range(count + 5):
                body = cache.loads(fmt.history_field, fmt.name, history.body(n))
                if n == 0:
                    length = len(fmt.history(body))
                    step = max(length // notes, 1)
                    placed = [(i, f"[proxyvisor] note {i}: the same command ran three times with the same output.")
                              for i in range(2, length - 1, step)][:notes]
                started = time.thread_time()
                fmt.insert_notes(body, placed)
                chunks(body, fmt.history_field)
                spent.append(time.thread_time() - started)
            out[f"{fmt_name} {size:g}"] = statistics.mean(spent[5:]) * 1000
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="0.1,1,4", help="history sizes in MB, comma-separated")
    p.add_argument("--formats", default="chat,messages,responses")
    p.add_argument("--notes", type=int, default=16, help="notes in the thread (default 16)")
    p.add_argument("--count", type=int, default=30, help="requests measured per session (default 30)")
    p.add_argument("--checkout", type=Path, help="a baseline checkout of proxyvisor, measured in a subprocess")
    p.add_argument("--json", type=Path, help=argparse.SUPPRESS)  # the baseline's subprocess: its checkout
    args = p.parse_args(argv)
    sizes, formats = [float(s) for s in args.sizes.split(",")], args.formats.split(",")
    if args.json is not None:
        print(json.dumps(measure(args.json, sizes, formats, args.notes, args.count)))
        return 0
    base = None
    if args.checkout is not None:
        command = [sys.executable, str(Path(__file__).resolve()), "--json", str(args.checkout.resolve()),
                   "--sizes", args.sizes, "--formats", args.formats, "--notes", str(args.notes),
                   "--count", str(args.count)]
        done = subprocess.run(command, capture_output=True, text=True, check=True)
        base = json.loads(done.stdout)
    here = measure(ROOT, sizes, formats, args.notes, args.count)
    print(f"{args.notes} notes, CPU ms per request (insert_notes + serialise)"
          + (f"; baseline {args.checkout}" if base else ""))
    for key, ms in here.items():
        line = f"  {key:>14s} MB  {ms:7.3f}"
        if base is not None:
            line += f"   baseline {base[key]:7.3f}   ratio {ms / base[key]:5.2f}"
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
