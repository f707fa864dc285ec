"""Prompt-cache prefix over the corpus: how much of each upstream request is a byte prefix of the next?

Usage: python bench/cache_prefix.py [CORPUS_TRAJECTORIES_DIR] [--formats chat,messages,responses]
                                    [--modes json,stream] [--write]

The directory defaults to ../shared/corpus/trajectories next to the repository. Each trajectory is replayed as its
agent sent it (``proxyvisor.replay``: growing history, supervision, condensing and the verify-gate on, the scripted
upstream answering the recorded turns and, as the session's supervisor model, the condenser, verifier and planner
calls with its fixed policies; learning recalls a project memory of two records into every session), and every model
request the upstream received is kept, a gate's continued requests included. For each pair of consecutive upstream requests, the bench reads both as a provider's prompt cache does
(``WireFormat.prompt``: every field but the history, then each history item, as serialised) and prints the share of
the earlier request that begins the later one (``shared_prefix``).

A pair whose agent requests do not themselves share the whole earlier prompt (the agent rewrote its history; the
corpus replays only grow theirs) is the agent's own rewrite; it is counted apart and not held to the target. **Target** (exit 1 when missed): every other pair at
least 99.9%.

Prints one line per trajectory, format and mode (pairs, the agent's rewrites, gate re-entries, the lowest share and
the bytes of the earlier requests not shared, outside rewrites), then a summary; ``--write`` puts the summary lines
per format and mode into bench/RESULTS.md under "## Prompt-cache prefix (issue 12)".
"""

from __future__ import annotations

import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import trio
from msgspec.structs import replace

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import corpus_parser, trajectories  # noqa: E402
from bench.results import write_section  # noqa: E402
from proxyvisor.scripted.upstream import ScriptedUpstream  # noqa: E402
from proxyvisor.config import Config, LearningConfig  # noqa: E402
from proxyvisor.learning.memory import ORIENTATION, RULE, Candidate, Memory  # noqa: E402
from proxyvisor.proxy.learning import FOLDER, MemoryFiles  # noqa: E402
from proxyvisor.proxy.formats import BY_NAME, WireFormat  # noqa: E402
from proxyvisor.proxy.formats.base import shared_prefix  # noqa: E402
from proxyvisor.replay import MODEL, Round, load_trajectory, replay, tools_of  # noqa: E402
from proxyvisor.store import Store  # noqa: E402

TARGET = 0.999
"""The least share of a request that must begin the next one, outside the agent's own rewrites."""


@dataclass
class Pairs:
    """The consecutive request pairs of one replay: how many, the agent's rewrites among them, the gate's continued
    requests, and, outside rewrites, the lowest share, the pairs under :data:`TARGET` and the bytes not shared."""

    pairs: int = 0
    rewrites: int = 0
    continued: int = 0
    lowest: float = 1.0
    under: int = 0
    missed: int = 0
    total: int = 0

    def add(self, before: list[bytes], after: list[bytes], rewrite: bool) -> None:
        self.pairs += 1
        if rewrite:
            self.rewrites += 1
            return
        size = sum(map(len, before))
        shared = shared_prefix(before, after)
        share = shared / size if size else 1.0
        self.lowest = min(self.lowest, share)
        self.under += share < TARGET
        self.missed += size - shared
        self.total += size

    def merge(self, other: Pairs) -> None:
        self.pairs += other.pairs
        self.rewrites += other.rewrites
        self.continued += other.continued
        self.lowest = min(self.lowest, other.lowest)
        self.under += other.under
        self.missed += other.missed
        self.total += other.total

    def row(self) -> str:
        shared = 1 - self.missed / self.total if self.total else 1.0
        return (f"{self.pairs} | {self.rewrites} | {self.continued} | {100 * self.lowest:.3f}% | "
                f"{100 * shared:.4f}% | {self.missed:,} | {self.under}")


def agent_prompts(fmt: WireFormat, messages: list[dict[str, Any]], stream: bool) -> dict[int, list[bytes]]:
    """The prompt of the agent's own request for each assistant message (by line), as ``replay`` sends it."""
    tools = tools_of(messages)
    return {i: fmt.prompt(fmt.request_from_chat(messages[:i], MODEL, stream, tools))
            for i, m in enumerate(messages) if m.get("role") == "assistant"}


def recalling(state: Path) -> Config:
    """The default configuration with learning's scope set to a project whose memory (in ``state``) holds a rule
    and a fact, so every replay recalls them: the memory note is held to the prefix like the other notes."""
    project = str(state / "project")
    memory = Memory(project)
    memory.add(Candidate(RULE, "Always use uv, never pip.", "user turn 1 of session bench"), 0.0, "bench")
    memory.add(Candidate(ORIENTATION, "`pytest -q` runs the project's checks (it passed)", "action #1"), 0.0, "bench")
    MemoryFiles(state / FOLDER).save(memory, set())
    config = Config()
    return replace(config, supervisor=replace(config.supervisor, learning=LearningConfig(scope=project)))


async def measure(path: Path, fmt: WireFormat, stream: bool) -> Pairs:
    """Replay ``path`` in ``fmt`` and measure its consecutive upstream requests (module docstring)."""
    messages = load_trajectory(path)
    agent = agent_prompts(fmt, messages, stream)
    upstream = ScriptedUpstream()
    served: list[tuple[int, int]] = []  # per round: its line, and how many upstream requests were in by its end

    def on_round(result: Round) -> None:
        served.append((result.message, len(upstream.requests)))

    with tempfile.TemporaryDirectory(prefix="proxyvisor-bench-prefix-") as state:
        await replay(recalling(Path(state)), messages, fmt, stream, store=Store(Path(state)), on_round=on_round,
                     gate=True, scripted=upstream)
    prompts = [fmt.prompt(orjson.loads(body)) for _target, body, _headers in upstream.requests]
    pairs = Pairs()
    start, previous = 0, None
    for line, end in served:
        if previous is not None and end > start:
            rewrite = shared_prefix(agent[previous], agent[line]) < sum(map(len, agent[previous]))
            pairs.add(prompts[start - 1], prompts[start], rewrite)
        pairs.continued += max(end - start - 1, 0)
        for i in range(start + 1, end):  # a gate's continued requests: the same agent request, carried on
            pairs.add(prompts[i - 1], prompts[i], False)
        if end > start:
            start, previous = end, line
    return pairs


async def run(paths: list[Path], formats: list[str], modes: list[str]) -> dict[tuple[str, str], Pairs]:
    totals: dict[tuple[str, str], Pairs] = {}
    for name in formats:
        for mode in modes:
            total = totals.setdefault((name, mode), Pairs())
            for path in paths:
                pairs = await measure(path, BY_NAME[name], mode == "stream")
                total.merge(pairs)
                print(f"| {path.name} | {name} | {mode} | {pairs.row()} |", flush=True)
    return totals


HEADER = ["| trajectory | format | mode | pairs | agent rewrites | continued | lowest share | shared | bytes missed "
          "| under 99.9% |", "|---|---|---|---|---|---|---|---|---|---|"]


def main() -> int:
    parser = corpus_parser(__doc__, formats=True, modes=True)
    args = parser.parse_args()
    paths = trajectories(args.corpus)
    if not paths:
        return 2
    formats, modes = args.formats.split(","), args.modes.split(",")
    print("\n".join(HEADER))
    started = time.perf_counter()
    totals = trio.run(run, paths, formats, modes)
    elapsed = time.perf_counter() - started
    every = Pairs()
    for pairs in totals.values():
        every.merge(pairs)
    rows = [f"| all {len(paths)} | {name} | {mode} | {pairs.row()} |" for (name, mode), pairs in totals.items()]
    summary = (f"{len(paths)} trajectories x {len(totals)} format/mode(s): {every.pairs:,} consecutive upstream "
               f"request pairs ({every.continued} continued by the gate), {every.rewrites} rewritten by the agent; "
               f"outside those the lowest share is {100 * every.lowest:.3f}%, {every.under} pair(s) under "
               f"{100 * TARGET:g}%, {every.missed:,} of {every.total:,} bytes not shared; {elapsed:.0f} s.")
    print("\n".join(HEADER[:2] + rows))
    print(summary)
    if args.write:
        write_section("Prompt-cache prefix (issue 12)", "\n".join([
            "Each corpus trajectory replayed through the proxy (supervision, condensing and the verify-gate on, "
            "the scripted upstream answering the recorded turns and the supervisor calls); for each pair of "
            "consecutive upstream requests, the share of the earlier one's prompt (every field but the history, "
            "then each history item, as serialised) that is a byte prefix of the later one. Pairs where the "
            "agent's own requests differ before the earlier one's end (the agent rewrote its history) are counted "
            f"apart. Target: every other pair at least {100 * TARGET:g}%.",
            "", "Command: `python bench/cache_prefix.py ../shared/corpus/trajectories --write`", "",
            *HEADER, *rows, "", summary]))
    return 1 if every.under else 0


if __name__ == "__main__":
    raise SystemExit(main())
