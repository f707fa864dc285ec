"""Per-request cost of supervision as a session grows: it must not grow with the history's length.

Usage: python bench/detectors.py [--messages 2000] [--repeat 300] [--write]

A synthetic 2,000-message agent session (chat format: varied tool rounds, reads, edits, failing and passing test
runs, polls that loop, harness nudges, user turns) is sent the way agents send it: one request per round, each
carrying the whole history. The state is brought up to date request by request; then, at 10, 500 and 2,000
messages, the next requests are timed ``--repeat`` times (the state is copied before each run, outside the
timing) for:

- **detectors**: ``HistoryTracker.update`` (normalising the new items, the rewrite check, the detectors);
- **supervision step**: ``Supervisor.begin`` (the above plus thread lookup, the steer policy, re-inserting the
  notes and appending the instruction), without serialising the body; it grows with the number of steer notes
  the thread has collected (shown; at most ``proxyvisor.proxy.supervise.NOTES``), not with the history;
- **serialise body**: ``orjson.dumps`` of the upstream body, for scale: it is proportional to the body's size,
  like parsing the request, which every supervised request needs anyway.

Each figure is the median, over the runs, of the mean cost of :data:`CYCLE` consecutive requests (one cycle of
the session's kinds of rounds), so every size is measured on the same mix of work; the column is the history
length where they start (for the largest size: where they end).

The ratio is each cost at 2,000 messages over its cost at 10 messages (target for the detectors: <= 1.5).
``--write`` puts the table into bench/RESULTS.md under "## Detector cost (issue 3)".
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import exit_status  # noqa: E402
from bench.results import write_section  # noqa: E402
from proxyvisor.config import SupervisorConfig  # noqa: E402
from proxyvisor.detectors.detectors import HistoryTracker  # noqa: E402
from proxyvisor.proxy.formats import CHAT  # noqa: E402
from proxyvisor.proxy.sessions import Session  # noqa: E402
from proxyvisor.proxy.supervise import Supervisor  # noqa: E402

SIZES = (10, 500, 2000)
TOOLS = [{"type": "function", "function": {"name": n, "parameters": {"type": "object", "properties": p}}}
         for n, p in (("Bash", {"command": {"type": "string"}}), ("Read", {"file_path": {"type": "string"}}),
                      ("Edit", {"file_path": {"type": "string"}, "old_string": {"type": "string"}}))]


def session(messages: int) -> list[dict[str, Any]]:
    """A deterministic agent history of about ``messages`` messages."""
    history: list[dict[str, Any]] = [{"role": "system", "content": "You are a coding agent. " * 50},
                                     {"role": "user", "content": "Fix the failing tests in the parser."}]
    n = 0
    while len(history) < messages:
        n += 1
        kind = n % 11
        if kind == 10:
            history.append({"role": "user", "content": f"Status? ({n})"})
            continue
        if kind == 9:
            history.append({"role": "user", "content": "No tool calls found in the response."})
            continue
        name, args, output = {
            0: ("Read", {"file_path": f"src/mod{n % 40}.py"}, "".join(f"{i}\tline {i} of {n}\n" for i in range(80))),
            1: ("Bash", {"command": "pytest -q tests/test_parser.py"}, f"Exit code 1\n{n % 5 + 1} failed in 1.2s"),
            2: ("Edit", {"file_path": f"src/mod{n % 40}.py", "old_string": f"x = {n}", "new_string": "x = 1"}, "ok"),
            3: ("Bash", {"command": "cat build.status"}, "building: 3 of 7"),
            4: ("Bash", {"command": "cat build.status"}, "building: 3 of 7"),
            5: ("Bash", {"command": "cat build.status"}, "building: 3 of 7"),
            6: ("Bash", {"command": f"grep -rn parse_{n} src"}, f"src/mod{n % 40}.py:{n}: def parse_{n}():"),
            7: ("Bash", {"command": "pytest -q tests/test_parser.py"}, "Exit code 0\n12 passed in 1.1s"),
            8: ("Read", {"file_path": "README.md"}, "# parser\n" * 30),
        }[kind]
        call_id = f"call_{n}"
        history.append({"role": "assistant", "content": f"Step {n}.", "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}]})
        history.append({"role": "tool", "tool_call_id": call_id, "content": output})
    return history


def request_ends(history: list[dict[str, Any]]) -> list[int]:
    """History lengths at which the agent sent a request (before each assistant message, and at the end)."""
    return [i for i, m in enumerate(history) if m["role"] == "assistant"] + [len(history)]


CYCLE = 9
"""Requests timed together at each size: one full cycle of the session's kinds of rounds, so every size is
measured on the same mix of work."""


def median_us(run: Callable[[Any], Any], prepare: Callable[[], Any], repeat: int, per: int) -> float:
    """Median over ``repeat`` runs of ``run(prepare())``, divided by ``per`` requests (µs)."""
    samples = []
    for _ in range(repeat):
        state = prepare()
        gc.collect()
        gc.disable()  # as timeit does: a collection over the copied state is not the code's cost
        try:
            started = time.perf_counter_ns()
            run(state)
            samples.append((time.perf_counter_ns() - started) / 1000 / per)
        finally:
            gc.enable()
    return statistics.median(samples)


def _body(items: list[dict[str, Any]]) -> dict[str, Any]:
    return orjson.loads(orjson.dumps({"model": "m", "messages": items, "tools": TOOLS}))


def measure(history: list[dict[str, Any]], repeat: int) -> dict[int, dict[str, float]]:
    ends = request_ends(history)
    tracker, supervisor, sess = HistoryTracker(), Supervisor(SupervisorConfig()), Session("bench", 0, 0)
    results: dict[int, dict[str, float]] = {}
    done = 0
    for size in SIZES:
        first = min(i for i, e in enumerate(ends) if e >= size)
        window = ends[max(0, min(first, len(ends) - CYCLE)):][:CYCLE]
        for end in (e for e in ends if done < e < window[0]):  # bring the state up to the request before
            tracker.update(history[:end], CHAT.message, {})
            supervisor.begin(sess, CHAT, _body(history[:end]))
        done = window[0] - 1
        slices = [history[:end] for end in window]
        bodies = [orjson.dumps(_body(items)) for items in slices]

        def detectors(t: HistoryTracker, slices: list[list[dict[str, Any]]] = slices) -> None:
            for items in slices:
                t.update(items, CHAT.message, {})

        def step(state: tuple[Session, list[dict[str, Any]]]) -> None:
            for body in state[1]:
                supervisor.begin(state[0], CHAT, body)

        results[size] = {
            "detectors": median_us(detectors, lambda: copy.deepcopy(tracker), repeat, len(window)),
            "supervision step": median_us(step, lambda bodies=bodies: (copy.deepcopy(sess),
                                                                       [orjson.loads(b) for b in bodies]),
                                          repeat, len(window)),
            "serialise body": median_us(orjson.dumps, lambda last=bodies[-1]: orjson.loads(last), repeat, 1),
            "notes re-inserted (count)": float(sum(len(t.notes) for t in sess.supervision.threads.values())),
        }
    return results


def table(results: dict[int, dict[str, float]]) -> tuple[list[str], float]:
    sizes = sorted(results)
    lines = ["| cost per request (median, µs) | " + " | ".join(f"{s} messages" for s in sizes)
             + f" | ratio {sizes[-1]}/{sizes[0]} |", "|---|" + "---|" * (len(sizes) + 1)]
    ratio = 0.0
    for name in results[sizes[0]]:
        values = [results[s][name] for s in sizes]
        if name.endswith("(count)"):
            lines.append(f"| {name} | " + " | ".join(f"{v:.0f}" for v in values) + " | |")
            continue
        r = values[-1] / values[0]
        ratio = r if name == "detectors" else ratio
        lines.append(f"| {name} | " + " | ".join(f"{v:.1f}" for v in values) + f" | {r:.2f} |")
    return lines, ratio


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=2000, help="length of the synthetic session")
    parser.add_argument("--repeat", type=int, default=300, help="timed runs per size (the median is shown)")
    parser.add_argument("--write", action="store_true", help="write the table into bench/RESULTS.md")
    args = parser.parse_args()
    history = session(args.messages)
    lines, ratio = table(measure(history, args.repeat))
    verdict = f"detectors ratio {ratio:.2f} (target <= 1.5): {'ok' if ratio <= 1.5 else 'OVER TARGET'}"
    print("\n".join(lines) + "\n\n" + verdict)
    if args.write:
        write_section("Detector cost (issue 3)", "\n".join([
            "Per-request cost of supervision on a synthetic session of "
            f"{len(history)} messages, one request per round, state updated incrementally "
            "(`bench/detectors.py`).", "", "Command: `python bench/detectors.py --write`", "",
            *lines, "", verdict]))
    return exit_status(ratio <= 1.5)


if __name__ == "__main__":
    sys.exit(main())
