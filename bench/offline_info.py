"""How long offline ``proxyvisor info`` takes on a 2-line ledger (wall and CPU), with no proxy to ask.

The command prices tokens from proxyvisor's own table, never importing litellm (whose import alone costs
seconds); the test suite asserts that (``tests/test_pricing.py``) and this benchmark measures the time.

    python bench/offline_info.py [--runs 10]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import command_line, loadavg, workspace  # noqa: E402
from bench.results import write_section  # noqa: E402

LINES = [{"time": "2026-01-01T00:00:00.000+00:00", "format": "messages", "model": "claude-sonnet-4-5",
          "status": 200, "input_tokens": 10_000, "output_tokens": 1_000, "overhead_ms": 1.5},
         {"time": "2026-01-01T00:00:01.000+00:00", "format": "chat", "model": "my-local-llm", "status": 200,
          "input_tokens": 500, "output_tokens": 50, "overhead_ms": 0.5}]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10, help="runs of the command (default 10)")
    args = parser.parse_args(argv)
    walls, cpus = [], []
    load_before = loadavg()
    with workspace("pv-bench-info-") as (work, _procs):
        ledger = work / "state" / "ledger"
        ledger.mkdir(parents=True)
        (ledger / "quick.jsonl").write_text("".join(json.dumps(line) + "\n" for line in LINES))
        for _ in range(args.runs):
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            start = time.perf_counter()
            subprocess.run([sys.executable, "-m", "proxyvisor", "info", "quick", "--state-dir", str(work / "state"),
                            "--url", "http://127.0.0.1:9"], check=True, capture_output=True, timeout=120, cwd=ROOT)
            walls.append(time.perf_counter() - start)
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            cpus.append((after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime))
    body = (f"Command: `{command_line('bench/offline_info.py', argv)}`\n\n"
            f"Setup: `proxyvisor info SESSION --url http://127.0.0.1:9` (no proxy listening) on a 2-line ledger, "
            f"{args.runs} runs. {os.cpu_count()} CPUs, Python {platform.python_version()}; {date.today()}; "
            f"1-minute load average {load_before} before, {loadavg()} after.\n\n"
            "| measure | median | max |\n|---|---|---|\n"
            f"| wall (s) | {statistics.median(walls):.3f} | {max(walls):.3f} |\n"
            f"| CPU (s) | {statistics.median(cpus):.3f} | {max(cpus):.3f} |\n")
    write_section("Offline info", body)
    print(body)


if __name__ == "__main__":
    main()
