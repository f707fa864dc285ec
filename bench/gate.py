"""What the verify-gate costs proxyvisor itself, beyond the verifier's own answer time.

Usage: python bench/gate.py [--repeat 40] [--write]

A turn-ending request (the model answers without tool calls) is sent through a running proxy (embedded scripted
upstream, in-process) at three history lengths of the synthetic session of ``bench/detectors.py`` (10, 500 and
2,000 messages), in the chat format, JSON and streamed, as the session has it (several user turns: the turn the
verifier reads starts at the latest) and as one turn (a headless run: every action is in the turn), with two arms
interleaved request by request:

- **gate off**: supervision on, ``[supervisor.gate] enabled = false``: the baseline;
- **gate on**: the same, with a verifier that answers "pass" at once (no model latency), so the difference is
  proxyvisor's own work: holding the answer, reading the turn's actions, building the digest (tokenising it within
  its budget), parsing the verdict, writing the gate's ledger fields.

Each figure is the median latency in ms over ``--repeat`` requests per arm; "added" is gate on minus gate off, and
the ratio is gate on over gate off, measured in the same run. ``digest`` is reading the turn's actions (with the receipts the detectors already made)
and ``proxyvisor.gate.digest.build`` on that history, median ms. A real verifier call (seconds) comes on top of "added"; it is the price of the check,
not of proxyvisor. ``--write`` puts the table into bench/RESULTS.md under "## Verify-gate cost (issue 4)".
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import orjson
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.detectors import TOOLS, session  # noqa: E402
from bench.results import write_section  # noqa: E402
from proxyvisor.adapters.scripted import ScriptedUpstream  # noqa: E402
from proxyvisor.config import Config, GateConfig  # noqa: E402
from proxyvisor.detectors.receipts import RoundReader  # noqa: E402
from proxyvisor.gate import digest  # noqa: E402
from proxyvisor.proxy.formats import CHAT  # noqa: E402
from proxyvisor.proxy.service import running  # noqa: E402
from proxyvisor.store import Store  # noqa: E402

SIZES = (10, 500, 2000)
PASS = orjson.dumps({"requirements": [{"id": 1, "requirement": "r", "status": "matched", "basis": None,
                                       "evidence": "e"}], "gaps": [], "handback": None, "verdict": "pass"}).decode()
ANSWER = {"text": "Done: the parser tests pass now."}


async def instant_verifier(_messages: list[dict[str, str]]) -> str:
    return PASS


def body_of(history: list[dict[str, Any]], stream: bool) -> bytes:
    # The history ends with tool results; the model's answer to it ends the turn.
    return orjson.dumps({"model": "scripted-model", "messages": history, "tools": TOOLS, "stream": stream})


async def timed_requests(url: str, bodies: list[bytes], session: str) -> list[float]:
    times = []
    async with httpx.AsyncClient(timeout=60) as client:
        for body in bodies:
            started = time.perf_counter()
            async with client.stream("POST", url + "/v1/chat/completions", content=body,
                                     headers={"content-type": "application/json",
                                              "x-proxyvisor-session": session}) as response:
                async for _ in response.aiter_raw():
                    pass
            assert response.status_code == 200
            times.append((time.perf_counter() - started) * 1000)
    return times


async def measure(repeat: int, state: Path) -> list[dict[str, Any]]:
    rows = []
    for size, one_turn, stream in [(size, one_turn, stream) for size in SIZES for one_turn in (False, True)
                                   for stream in (False, True)]:
        history = session(size)
        if history[-1]["role"] != "tool":
            history = history[:max(i for i, m in enumerate(history) if m["role"] == "tool") + 1]
        if one_turn:  # a headless run: one request, every action in the turn the verifier reads
            history = history[:2] + [m for m in history[2:] if m["role"] != "user"]
        if True:
            body = body_of(history, stream)
            arms: dict[str, list[float]] = {"off": [], "on": []}
            upstream = ScriptedUpstream([ANSWER] * (2 * repeat + 4), record=False)
            configs = {"off": Config().with_overrides(supervisor={"gate": GateConfig(enabled=False)}),
                       "on": Config()}
            async with running(configs["off"], port=0, store=Store(state / f"off-{size}-{stream}"),
                               scripted={"scripted": upstream}, model=instant_verifier) as off, \
                    running(configs["on"], port=0, store=Store(state / f"on-{size}-{stream}"),
                            scripted={"scripted": upstream}, model=instant_verifier) as on:
                for name, proxy in (("off", off), ("on", on)):  # warm-up (imports, first connection)
                    await timed_requests(proxy.url, [body], f"warm-{name}")
                for n in range(repeat):
                    for name, proxy in (("off", off), ("on", on)) if n % 2 == 0 else (("on", on), ("off", off)):
                        arms[name] += await timed_requests(proxy.url, [body], f"{name}-{size}-{stream}-{n}")
            messages = [CHAT.message(m) for m in history]
            turn = max(i for i, m in enumerate(history) if m["role"] == "user") + 1
            reader = RoundReader()  # the proxy's detectors have read the history already: their receipts are reused
            for index, message in enumerate(messages):
                reader.feed(index, message, {})
            started = []
            for _ in range(max(5, repeat // 4)):
                t0 = time.perf_counter()
                digest.build("Fix the failing tests in the parser.", [ANSWER["text"]],
                             digest.turn_actions(messages[turn:], {}, known=reader.turn_receipts),
                             instructions=history[0]["content"])
                started.append((time.perf_counter() - t0) * 1000)
            off_ms, on_ms = statistics.median(arms["off"]), statistics.median(arms["on"])
            rows.append({"size": size, "stream": stream, "off": off_ms, "on": on_ms, "one_turn": one_turn,
                         "actions": sum(len(m.get("tool_calls") or ()) for m in history[turn:]),
                         "digest": statistics.median(started), "bytes": len(body)})
            print(f"{size:>5} messages {'one turn' if one_turn else 'session '} {'stream' if stream else 'json  '}: gate off {off_ms:.2f} ms, on "
                  f"{on_ms:.2f} ms (+{on_ms - off_ms:.2f}, x{on_ms / off_ms:.2f}); digest build "
                  f"{rows[-1]['digest']:.2f} ms", file=sys.stderr)
    return rows


def table(rows: list[dict[str, Any]], repeat: int) -> str:
    lines = ["| history (messages) | actions in the turn | body | mode | gate off p50 (ms) | gate on p50 (ms) | "
             "added (ms) | ratio | digest build (ms) |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['size']:,} | {r['actions']:,} | {r['bytes'] / 1024:,.0f} KB | "
                     f"{'stream' if r['stream'] else 'json'} | "
                     f"{r['off']:.2f} | {r['on']:.2f} | {r['on'] - r['off']:+.2f} | {r['on'] / r['off']:.2f} | "
                     f"{r['digest']:.2f} |")
    return ("`python bench/gate.py --repeat %d --write`: a turn-ending request through a running proxy, gate off vs "
            "gate on with a verifier that answers at once (arms interleaved, same run; medians). \"added\" is "
            "proxyvisor's own work per gated turn end: holding the answer, the turn's actions, the digest within its "
            "budget, the verdict, the ledger. Tool-call rounds are not gated and cost nothing extra. A real verifier "
            "call (its model latency, typically seconds) comes on top.\n\n" % repeat) + "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=20, help="requests per arm and case (default 20)")
    parser.add_argument("--write", action="store_true", help="write the table into bench/RESULTS.md")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="proxyvisor-gate-bench-") as state:
        rows = trio.run(measure, args.repeat, Path(state))
    text = table(rows, args.repeat)
    print(text)
    if args.write:
        write_section("Verify-gate cost (issue 4)", text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
