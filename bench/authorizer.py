"""What the tool authorizer costs, and how often it asks a judge.

Usage: python bench/authorizer.py [CORPUS_TRAJECTORIES_DIR] [--repeat 200] [--write]

1. **Corpus replay**: every trajectory is replayed through the proxy (chat format, JSON; scripted upstream answering
   the recorded turns) with ``[supervisor.authorizer] enabled = true`` and a judge double that allows everything
   and counts its calls (an allowing double keeps the replay on the recorded turns; it decides nothing the figures
   depend on). Per trajectory: the tool-call rounds, the rounds during which a user prohibition stood (the
   authorizer's stage ran: it is installed only then), the batches the pre-screen admitted for free, the batches
   that reached the judge, and the judge calls made in rounds with no prohibition standing (must be 0).
2. **Latency of a tool-call round**, in the same run, arms interleaved request by request: a streamed and a JSON
   tool-call answer (chat format, embedded scripted upstream, in-process), supervision on and the gate off in
   every arm: ``on, no prohibition`` (enabled, nothing standing: the stage is not installed) against ``off``
   (disabled, the same request), and ``on, pre-screened`` (enabled, "Never push to main." standing, a ``Read``
   call the pre-screen admits: the stream is held from the call's start to its end and released after the free
   check) against ``off, prohibition`` (disabled, the same request). Median ms over ``--repeat`` requests per
   arm, the added ms and the ratio.

``--write`` puts both tables into bench/RESULTS.md under "## Tool authorizer (issue 13)".
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import httpx
import orjson
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import corpus_parser, trajectories  # noqa: E402
from bench.results import write_section  # noqa: E402
from proxyvisor.config import AuthorizerConfig, Config, GateConfig  # noqa: E402
from proxyvisor.gate.authorize import CONFIRM_INSTRUCTIONS, JUDGE_INSTRUCTIONS  # noqa: E402
from proxyvisor.proxy.formats import CHAT, ToolSpec  # noqa: E402
from proxyvisor.proxy.service import running  # noqa: E402
from proxyvisor.replay import load_trajectory, replay  # noqa: E402
from proxyvisor.scripted.upstream import ScriptedUpstream  # noqa: E402
from proxyvisor.store import Store  # noqa: E402
from proxyvisor.supervisor_model import ModelAnswer  # noqa: E402


def configured(enabled: bool) -> Config:
    return Config().with_overrides(supervisor={"gate": GateConfig(enabled=False),
                                               "authorizer": AuthorizerConfig(enabled=enabled)})


class CountingJudge:
    """Allows everything; counts the authorizer's calls (the condenser, which shares the supervisor model, gets
    an answer it cannot use and condenses without a model)."""

    def __init__(self) -> None:
        self.calls = 0

    async def __call__(self, messages: list[dict[str, str]]) -> ModelAnswer:
        self.calls += messages[0]["content"] in (JUDGE_INSTRUCTIONS, CONFIRM_INSTRUCTIONS)
        return ModelAnswer('{"blocks": []}')


async def corpus(paths: list[Path]) -> list[list[Any]]:
    rows = []
    for path in paths:
        messages = load_trajectory(path)
        judge = CountingJudge()
        per_round: list[int] = []

        def seen(_round: Any, judge: CountingJudge = judge, per_round: list[int] = per_round) -> None:
            per_round.append(judge.calls - sum(per_round))

        with tempfile.TemporaryDirectory() as state:
            store = Store(Path(state))
            rounds = await replay(configured(True), messages, CHAT, False, store=store, model=judge, on_round=seen)
            (session,) = store.sessions()
            lines = [line for line in store.read_ledger(session) if "local" not in line]
        tool_rounds = sum(bool(r.tool_calls) for r in rounds)
        standing = [line.get("authorizer") for line in lines]
        judged = sum(1 for a in standing if a and a.get("checked"))
        prescreened = sum(a.get("prescreened", 0) for a in standing if a)
        stray = sum(n for n, a in zip(per_round, standing) if n and not a)
        failed = sum(not r.matches for r in rounds)
        rows.append([path.stem[:60], len(rounds), tool_rounds, sum(1 for a in standing if a), prescreened, judged,
                     judge.calls, stray, failed])
    return rows


READ = {"tool_calls": [{"name": "Read", "arguments": {"file_path": "src/parser.py"}, "id": "call_r1"}]}
TOOLS = (ToolSpec("Read", {"type": "object", "properties": {"file_path": {"type": "string"}}}, "Read a file"),)


def body(prompt: str, stream: bool) -> bytes:
    messages = [{"role": "system", "content": "You are a coding agent."}, {"role": "user", "content": prompt}]
    return orjson.dumps(CHAT.request_from_chat(messages, "bench-model", stream, TOOLS))


FREE, STANDING = "Explain the parser.", "Explain the parser. Never push to main."
ARMS = {"off": (False, FREE), "on, no prohibition": (True, FREE),
        "off, prohibition": (False, STANDING), "on, pre-screened": (True, STANDING)}
BASELINE = {"on, no prohibition": "off", "on, pre-screened": "off, prohibition"}
"""Each arm against the one with the same request: a standing prohibition is also recited to the model, which
changes the request whether the authorizer is on or not."""


async def latency(repeat: int, state: Path) -> list[list[Any]]:
    rows = []
    for stream in (False, True):
        times: dict[str, list[float]] = {arm: [] for arm in ARMS}
        async with AsyncExitStack() as stack:
            proxies, upstreams = {}, {}
            for arm, (enabled, _prompt) in ARMS.items():
                upstreams[arm] = ScriptedUpstream(record=False)
                proxies[arm] = await stack.enter_async_context(running(
                    configured(enabled), port=0, store=Store(state / f"{arm}-{stream}"),
                    scripted={"scripted": upstreams[arm]}, model=CountingJudge()))
            client = await stack.enter_async_context(httpx.AsyncClient(timeout=60))
            for n in range(repeat + 10):
                for arm, (_enabled, prompt) in ARMS.items():
                    upstreams[arm].queue(READ)
                    started = time.perf_counter()
                    response = await client.post(proxies[arm].url + "/v1/chat/completions",
                                                 content=body(prompt, stream),
                                                 headers={"content-type": "application/json",
                                                          "x-proxyvisor-session": f"b-{arm.replace(' ', '').replace(',', '')}-{stream}"})
                    assert response.status_code == 200 and b"call_r1" in response.content, response.content[:600]
                    if n >= 10:  # warm-up excluded
                        times[arm].append((time.perf_counter() - started) * 1000)
        for arm, values in times.items():
            median = statistics.median(values)
            base = statistics.median(times[BASELINE.get(arm, arm)])
            rows.append(["stream" if stream else "json", arm, BASELINE.get(arm, "-"), f"{median:.3f}",
                         f"{median - base:+.3f}", f"{median / base:.3f}"])
    return rows


def table(header: list[str], rows: list[list[Any]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *("| " + " | ".join(str(v) for v in row) + " |" for row in rows)]


def main() -> int:
    parser = corpus_parser(__doc__)
    parser.add_argument("--repeat", type=int, default=200, help="requests per arm for the latency table")
    args = parser.parse_args()
    paths = trajectories(args.corpus)
    if not paths:
        return 2
    corpus_rows = trio.run(corpus, paths)
    corpus_table = table(["trajectory", "rounds", "tool rounds", "rounds with a prohibition", "pre-screened",
                          "batches judged", "judge calls", "judge calls with no prohibition", "replay failures"],
                         corpus_rows)
    totals = [sum(r[i] for r in corpus_rows) for i in range(1, 9)]
    corpus_table.append("| **total** | " + " | ".join(str(t) for t in totals) + " |")
    with tempfile.TemporaryDirectory() as state:
        latency_rows = trio.run(latency, args.repeat, Path(state))
    latency_table = table(["mode", "arm", "against", "median ms", "added ms", "ratio"], latency_rows)
    print("\n".join(corpus_table), "\n", "\n".join(latency_table), sep="\n")
    if args.write:
        write_section("Tool authorizer (issue 13)", "\n".join([
            "Corpus trajectories replayed with the authorizer on and a judge double that allows everything (it "
            "counts calls; it decides nothing the counts depend on). A round \"with a prohibition\" is one in which "
            "a user prohibition stood, so the authorizer's stage ran; the last column must be 0. The mini-SWE-agent "
            "and SWE-agent prompts state \"DO NOT MODIFY: Tests, configuration files\" and \"Do NOT try to run "
            "multiple independent commands...\": a prohibition on running things could concern any shell call, and "
            "those agents make nothing but shell calls, so none of their batches is pre-screened.",
            "", "Command: `python bench/authorizer.py ../shared/corpus/trajectories --write`", "", *corpus_table, "",
            f"A tool-call round's latency (chat, embedded scripted upstream, in-process), {args.repeat} requests per "
            "arm, arms interleaved in the same run; added and ratio against the arm named, which sends the same request "
            "with the authorizer off.", "", *latency_table]))
    return 1 if totals[6] else 0


if __name__ == "__main__":
    sys.exit(main())
