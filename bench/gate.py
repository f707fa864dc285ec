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

Then the latency a gated turn end shows the agent under each ``[supervisor.gate] hold``, in the same run: a streamed
turn-ending answer (every format) with a stand-in verifier that sleeps ``--verifier-s`` seconds (2 by default; a
fake delay, not a model: it stands for a real verifier's answer time) and then passes, or finds one gap the first
time (the turn is continued once: the verifier, the refuter and the verifier again, each taking that long). Per
hold and case: the median time to the first answer text the agent receives (TTFT) and to the end of the stream,
over ``--ttft-repeat`` requests, arms interleaved. ``--write`` puts that table under "## Verify-gate latency:
hold = answer vs stop (issue 11)".
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
from proxyvisor.rules import FORMATS  # noqa: E402
from proxyvisor.scripted.upstream import ScriptedUpstream  # noqa: E402
from proxyvisor.config import Config, GateConfig  # noqa: E402
from proxyvisor.detectors.receipts import RoundReader  # noqa: E402
from proxyvisor.gate import digest  # noqa: E402
from proxyvisor.gate.verdict import REFUTER_INSTRUCTIONS  # noqa: E402
from proxyvisor.proxy.formats import BY_NAME, CHAT, ToolSpec  # noqa: E402
from proxyvisor.proxy.sse import SSEParser  # noqa: E402
from proxyvisor.proxy.service import running  # noqa: E402
from proxyvisor.store import Store  # noqa: E402
from proxyvisor.supervisor_model import ModelAnswer, ModelCall  # noqa: E402

SIZES = (10, 500, 2000)
PASS = orjson.dumps({"requirements": [{"id": 1, "requirement": "r", "status": "matched", "basis": None,
                                       "evidence": "e"}], "gaps": [], "handback": None, "verdict": "pass"}).decode()
ANSWER = {"text": "Done: the parser tests pass now."}


async def instant_verifier(_messages: list[dict[str, str]]) -> ModelAnswer:
    return ModelAnswer(PASS)


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


VERIFY_GAP = orjson.dumps({"requirements": [{"id": 1, "requirement": "r", "status": "unmatched",
                                            "basis": "absent_action", "evidence": "e"}],
                           "gaps": [{"requirement": 1, "gap": "the tests were not run", "settles": "a test run"}],
                           "handback": None, "verdict": "gaps"}).decode()
LATENCY_CASES = ("pass", "gaps")


def slow_verifier(seconds: float, case: str) -> ModelCall:
    """A stand-in verifier that sleeps ``seconds`` per call (a fake delay) and passes, or finds one gap on its
    first verdict (``case`` "gaps"); the refuter lets the gap stand."""
    verdicts = 0

    async def answer(messages: list[dict[str, str]]) -> ModelAnswer:
        nonlocal verdicts
        await trio.sleep(seconds)
        if messages[0]["content"] == REFUTER_INSTRUCTIONS:
            return ModelAnswer('{"findings": []}')
        verdicts += 1
        return ModelAnswer(VERIFY_GAP if case == "gaps" and verdicts % 2 == 1 else PASS)

    return answer


async def first_text_and_end(url: str, fmt: str, body: bytes, session: str) -> tuple[float, float]:
    """Seconds from sending ``body`` to the first answer text received and to the end of the stream."""
    w = BY_NAME[fmt]
    got, first = b"", None
    started = time.perf_counter()
    async with httpx.AsyncClient(timeout=120) as client:
        async with client.stream("POST", url + w.path, content=body,
                                 headers={"content-type": "application/json",
                                          "x-proxyvisor-session": session}) as response:
            async for chunk in response.aiter_raw():
                got += chunk
                if first is None and w.assemble([(e.event, e.data) for e in SSEParser().feed(got)]).text:
                    first = time.perf_counter() - started
        assert response.status_code == 200
    end = time.perf_counter() - started
    return (first if first is not None else end), end


async def measure_latency(repeat: int, seconds: float, state: Path) -> list[dict[str, Any]]:
    rows = []
    for fmt in FORMATS:
        for case in LATENCY_CASES:
            answers = [{"text": "Done: the parser tests pass now."}] * (4 * repeat + 8)
            times: dict[str, list[tuple[float, float]]] = {"answer": [], "stop": []}
            proxies = {}
            for hold in times:
                config = Config().with_overrides(supervisor={"gate": GateConfig(hold=hold)})
                proxies[hold] = running(config, port=0, store=Store(state / f"lat-{fmt}-{case}-{hold}"),
                                        scripted={"scripted": ScriptedUpstream(answers, record=False)},
                                        model=slow_verifier(seconds, case))
            async with proxies["answer"] as on_answer, proxies["stop"] as on_stop:
                urls = {"answer": on_answer.url, "stop": on_stop.url}
                body = orjson.dumps(request_from(fmt))
                for n in range(repeat):
                    for hold in ("answer", "stop") if n % 2 == 0 else ("stop", "answer"):
                        times[hold].append(await first_text_and_end(urls[hold], fmt, body,
                                                                    f"{fmt}-{case}-{hold}-{n}"))
            for hold, pairs in times.items():
                rows.append({"format": fmt, "case": case, "hold": hold,
                             "ttft": statistics.median(p[0] for p in pairs),
                             "end": statistics.median(p[1] for p in pairs)})
                print(f"{fmt:>9} {case:>4} hold={hold:<6}: first text {rows[-1]['ttft']:.2f} s, end "
                      f"{rows[-1]['end']:.2f} s", file=sys.stderr)
    return rows


def request_from(fmt: str) -> dict[str, Any]:
    """A streamed agent request whose answer ends the turn (tools offered, so it is gated)."""
    messages = [{"role": "system", "content": "You are a coding agent."},
                {"role": "user", "content": "Fix the failing tests in the parser."}]
    return BY_NAME[fmt].request_from_chat(messages, "scripted-model", True,
                                          (ToolSpec("Bash", {"type": "object"}, "Run a command"),))


def latency_table(rows: list[dict[str, Any]], repeat: int, seconds: float) -> str:
    lines = ["| format | verdict | hold | first text p50 (s) | stream end p50 (s) |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['format']} | {'pass' if r['case'] == 'pass' else 'gaps, then pass'} | {r['hold']} | "
                     f"{r['ttft']:.2f} | {r['end']:.2f} |")
    return (f"`python bench/gate.py --ttft-repeat {repeat} --verifier-s {seconds:g} --write`: a streamed turn-ending "
            f"answer through a running proxy (embedded scripted upstream), gated by a stand-in verifier that sleeps "
            f"{seconds:g} s per call (a fake delay standing for a real verifier's answer time, not a model), "
            "`[supervisor.gate] hold = \"answer\"` vs `\"stop\"` interleaved in the same run; medians. \"gaps, then "
            "pass\": the first verdict finds a gap, so the refuter and a second verdict run and the turn is "
            "continued once.\n\n" + "\n".join(lines))


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
    parser.add_argument("--ttft-repeat", type=int, default=3,
                        help="streamed requests per hold and case for the latency table (default 3)")
    parser.add_argument("--verifier-s", type=float, default=2.0,
                        help="seconds the stand-in verifier sleeps per call (default 2)")
    parser.add_argument("--latency-only", action="store_true", help="only the hold = answer vs stop latency table")
    parser.add_argument("--write", action="store_true", help="write the tables into bench/RESULTS.md")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="proxyvisor-gate-bench-") as state:
        if not args.latency_only:
            text = table(trio.run(measure, args.repeat, Path(state)), args.repeat)
            print(text)
            if args.write:
                write_section("Verify-gate cost (issue 4)", text)
        latency = latency_table(trio.run(measure_latency, args.ttft_repeat, args.verifier_s, Path(state)),
                                args.ttft_repeat, args.verifier_s)
    print(latency)
    if args.write:
        write_section("Verify-gate latency: hold = answer vs stop (issue 11)", latency)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
