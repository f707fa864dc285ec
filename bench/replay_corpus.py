"""Replay every corpus trajectory through the pipeline, in each wire format, streamed and not.

Usage: python bench/replay_corpus.py [CORPUS_TRAJECTORIES_DIR] [--formats chat,messages,responses] [--write]

The directory defaults to ../shared/corpus/trajectories next to the repository. For each trajectory and each
format and mode, every assistant turn is sent as the agent sent it (growing history) and the scripted upstream
answers with the recorded turn; a round fails when the agent does not get exactly the recorded turn back. Prints a
table (rounds, tool calls, failures, median and p99 round latency in ms, median proxy overhead in ms) and exits 1 if
any round failed. ``--write`` puts the table into bench/RESULTS.md under "## Replay (issue 2)".
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import corpus_parser, trajectories  # noqa: E402
from bench.results import write_section  # noqa: E402
from proxyvisor.config import Config  # noqa: E402
from proxyvisor.proxy.formats import BY_NAME  # noqa: E402
from proxyvisor.replay import load_trajectory, replay  # noqa: E402
from proxyvisor.store import Store  # noqa: E402



def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(0.99 * (len(ordered) - 1))))]


async def run(paths: list[Path], formats: list[str]) -> tuple[list[str], int]:
    rows, failures = [], 0
    config = Config()
    for path in paths:
        messages = load_trajectory(path)
        for name in formats:
            for stream in (False, True):
                with tempfile.TemporaryDirectory() as state:
                    rounds = await replay(config, messages, BY_NAME[name], stream, store=Store(Path(state)))
                bad = sum(not r.matches for r in rounds)
                failures += bad
                latencies = [r.latency_ms for r in rounds] or [0.0]
                overheads = [r.overhead_ms for r in rounds] or [0.0]
                rows.append(f"| {path.name} | {name} | {'stream' if stream else 'json'} | {len(rounds)} | "
                            f"{sum(len(r.tool_calls) for r in rounds)} | {bad} | {statistics.median(latencies):.1f} | "
                            f"{p99(latencies):.1f} | {statistics.median(overheads):.2f} |")
                print(rows[-1], flush=True)
    return rows, failures


def main() -> int:
    parser = corpus_parser(__doc__, formats=True)
    args = parser.parse_args()
    paths = trajectories(args.corpus)
    if not paths:
        return 2
    header = ["| trajectory | format | mode | rounds | tool calls | failed | median ms | p99 ms | overhead ms |",
              "|---|---|---|---|---|---|---|---|---|"]
    print("\n".join(header))
    started = time.perf_counter()
    rows, failures = trio.run(run, paths, args.formats.split(","))
    elapsed = time.perf_counter() - started
    summary = (f"{len(paths)} trajectories x {len(args.formats.split(','))} formats x 2 modes, "
               f"{failures} failed rounds, {elapsed:.0f} s")
    print(summary)
    if args.write:
        write_section("Replay (issue 2)", "\n".join([
            "Every corpus trajectory replayed through the proxy (supervision on, scripted upstream answering the "
            "recorded turns); a round fails when the agent does not get exactly the recorded turn back.",
            "", "Command: `python bench/replay_corpus.py ../shared/corpus/trajectories --write`", "",
            *header, *rows, "", summary]))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
