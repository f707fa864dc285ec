"""Cross-session learning (``proxyvisor.learning``, ``proxyvisor.proxy.learning``): recall's cost per request, the
pack's bound with a full memory, and distill calls per session on the corpus.

Usage: python bench/learning.py [CORPUS_TRAJECTORIES_DIR] [--repeat N] [--write]

1. **Recall's added time per request after the first**: a corpus trajectory's requests (chat format, growing
   history) are fed to the supervised path's request step (``Supervisor.begin``, then ``Learning.begin`` and the
   request's steps) twice in the same run, with learning off (the baseline) and on with a project memory of 1,000
   records, each request timed; the figure is the median over the requests after the first of (on - off), per
   repeat, and its median over ``--repeat`` repeats. **Target** (printed, not enforced: a shared runner is noisy):
   under 1 ms.
2. **The pack's bound**: the Active Memory Pack assembled from 1,000 stored records (rules, orientation and
   experience) for a task, against ``[supervisor.learning] budget_tokens`` (1,500): its tokens (exact, cl100k) and
   the time to assemble it (once per session). **Target** (exit 1 when missed): within the budget.
3. **Distill calls per session**: each trajectory replayed through the proxy (``proxyvisor.replay``: the verify-gate
   on, learning on for a scope of its own) with a supervisor model double that passes every verification and
   answers the distill call with no records; per trajectory, the distills (turn ends the gate judged, compactions
   and the session's end), the distill calls the pre-screen let through, and the records stored.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import msgspec
import orjson
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import corpus_parser, trajectories  # noqa: E402
from bench.results import write_section  # noqa: E402
from proxyvisor.condense.text import count_tokens  # noqa: E402
from proxyvisor.config import Config, LearningConfig  # noqa: E402
from proxyvisor.gate.verdict import VERIFIER_INSTRUCTIONS  # noqa: E402
from proxyvisor.learning import distill  # noqa: E402
from proxyvisor.learning.memory import EXPERIENCE, ORIENTATION, RULE, VERIFIED, Candidate, Memory  # noqa: E402
from proxyvisor.learning.pack import assemble  # noqa: E402
from proxyvisor.proxy.formats import BY_NAME  # noqa: E402
from proxyvisor.proxy.learning import FOLDER, Learning, MemoryFiles, project_root  # noqa: E402
from proxyvisor.proxy.sessions import Session  # noqa: E402
from proxyvisor.proxy.supervise import Supervisor  # noqa: E402
from proxyvisor.replay import MODEL, load_trajectory, replay, tools_of  # noqa: E402
from proxyvisor.store import Store  # noqa: E402
from proxyvisor.supervisor_model import ModelAnswer  # noqa: E402

RECALL_TARGET_MS = 1.0
SIGNAL_MARK = b'signal=\\"memory\\"'
"""The memory note's wrapper as it appears inside a JSON body."""
RECORDS = 1000


def full_memory(scope: str) -> Memory:
    """A memory of :data:`RECORDS` records: a few rules, then orientation and experience records half and half."""
    memory = Memory(scope)
    for n in range(RECORDS):
        if n < 20:
            memory.add(Candidate(RULE, f"Always run the linter {n} before committing module{n}.", f"user turn {n}"),
                       n, "s")
        elif n % 2:
            memory.add(Candidate(ORIENTATION, f"module{n} lives in src/pkg/module{n}.py and its tests in "
                                 f"tests/test_module{n}.py", f"action #{n}: Bash `ls src/pkg` (succeeded)"), n, "s")
        else:
            memory.add(Candidate(EXPERIENCE, f"Refactor module{n} to split its parser", f"session s{n}, gate: verified",
                                 VERIFIED), n, "s")
    assert len(memory.records) == RECORDS
    return memory


async def request_times(messages: list[dict[str, Any]], learning: Learning) -> tuple[list[float], bool]:
    """Seconds of the supervised request step for each request of ``messages`` (module docstring, 1), and whether
    the last request's body carried the memory note."""
    fmt = BY_NAME["chat"]
    config = Config().supervisor
    supervisor = Supervisor(config)
    session = Session("bench", 0.0, 0.0)
    tools = tools_of(messages)
    times = []
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        body = fmt.request_from_chat(messages[:i], MODEL, False, tools)
        started = time.perf_counter()
        exchange = supervisor.begin(session, fmt, body)
        learning.begin(session, exchange, None)
        await exchange.before_forward()
        times.append(time.perf_counter() - started)
    return times, SIGNAL_MARK in orjson.dumps(body)


async def recall_cost(path: Path, repeat: int, root: Path) -> tuple[float, float, int]:
    """(median added ms after the first request, median off ms, requests) for ``path`` (module docstring, 1)."""
    messages = load_trajectory(path)
    scope = str(root / "project")
    MemoryFiles(root / "state" / FOLDER).save(full_memory(project_root(scope)), set())
    settings = LearningConfig(scope=scope)
    added, base, n = [], [], 0
    for _ in range(repeat):
        off, recalled = await request_times(messages, Learning(LearningConfig(enabled=False), None))
        assert not recalled
        on, recalled = await request_times(messages, Learning(settings, MemoryFiles(root / "state" / FOLDER)))
        assert recalled, "learning on recalled nothing: the timing would measure no recall"
        n = len(on)
        added.append(statistics.median(b - a for a, b in zip(off[1:], on[1:])) * 1000)
        base.append(statistics.median(off[1:]) * 1000)
    return statistics.median(added), statistics.median(base), n


class Model:
    """The supervisor model double of the distill replay (module docstring, 3)."""

    def __init__(self) -> None:
        self.distill_calls = 0

    async def __call__(self, messages: list[dict[str, str]]) -> ModelAnswer:
        system = messages[0]["content"]
        if system == VERIFIER_INSTRUCTIONS:
            return ModelAnswer(json.dumps({"requirements": [], "gaps": [], "handback": None, "verdict": "pass"}))
        if system == distill.INSTRUCTIONS:
            self.distill_calls += 1
            return ModelAnswer('{"rules": [], "orientation": []}')
        return ModelAnswer('{"findings": []}')


async def distills(path: Path, root: Path) -> dict[str, Any]:
    """The distill figures of one trajectory (module docstring, 3)."""
    scope = root / path.stem
    scope.mkdir()
    learning = LearningConfig(scope=str(scope))
    config = Config()
    config = msgspec.structs.replace(config, supervisor=msgspec.structs.replace(config.supervisor, learning=learning))
    model = Model()
    state = root / f"state-{path.stem}"
    rounds = await replay(config, load_trajectory(path), BY_NAME["chat"], False, store=Store(state), model=model,
                          gate=True)
    memory = MemoryFiles(state / FOLDER).read(MemoryFiles(state / FOLDER).path(project_root(str(scope))))
    records = list(memory.records.values()) if memory is not None else []
    return {"rounds": len(rounds), "distill_calls": model.distill_calls,
            "rules": sum(r.kind == RULE for r in records), "orientation": sum(r.kind == ORIENTATION for r in records),
            "experience": sum(r.kind == EXPERIENCE for r in records)}


async def run(paths: list[Path], repeat: int) -> tuple[list[str], bool]:
    lines: list[str] = []
    with tempfile.TemporaryDirectory(prefix="proxyvisor-bench-learning-") as tmp:
        root = Path(tmp)
        longest = max(paths, key=lambda p: p.stat().st_size)
        added, base, n = await recall_cost(longest, repeat, root)
        lines.append(f"Recall, {longest.name} ({n} requests, a memory of {RECORDS:,} records): the request step "
                     f"takes {base:.3f} ms (median, learning off); learning on adds {added:.3f} ms per request "
                     f"after the first (median of {repeat}; target < {RECALL_TARGET_MS:g} ms: "
                     f"{'met' if added < RECALL_TARGET_MS else 'MISSED'}).")
        memory = full_memory("/bench")
        started = time.perf_counter()
        pack = assemble(memory.active(), "Refactor module42 to split its parser", LearningConfig().budget_tokens,
                        count_tokens)
        assembled_ms = (time.perf_counter() - started) * 1000
        within = pack.tokens <= LearningConfig().budget_tokens
        kinds = {k: sum(r.kind == k for r in pack.records) for k in (RULE, ORIENTATION, EXPERIENCE)}
        lines.append(f"Pack from {RECORDS:,} stored records: {len(pack.records)} items ({kinds[RULE]} rules, "
                     f"{kinds[ORIENTATION]} orientation, {kinds[EXPERIENCE]} experience), {pack.tokens:,} tokens "
                     f"of a {LearningConfig().budget_tokens:,}-token budget "
                     f"({'within' if within else 'OVER'}); assembled in {assembled_ms:.1f} ms, once per session.")
        lines += ["", "| trajectory | rounds | distill calls | rules | orientation | experience |",
                  "|---|---|---|---|---|---|"]
        total_calls = 0
        for path in paths:
            figures = await distills(path, root)
            total_calls += figures["distill_calls"]
            lines.append(f"| {path.name} | {figures['rounds']} | {figures['distill_calls']} | {figures['rules']} | "
                         f"{figures['orientation']} | {figures['experience']} |")
        lines += ["", f"{len(paths)} sessions: {total_calls} distill calls in all, "
                      f"{total_calls / len(paths):.2f} per session."]
    return lines, within


def main() -> int:
    parser = corpus_parser(__doc__)
    parser.add_argument("--repeat", type=int, default=3, help="repeats of the recall timing (default 3)")
    args = parser.parse_args()
    paths = trajectories(args.corpus)
    if not paths:
        return 2
    lines, within = trio.run(run, paths, args.repeat)
    print("\n".join(lines))
    if args.write:
        write_section("Cross-session learning", "\n".join([
            "Recall's added time per request after the first (the supervised request step with learning on against "
            "off, the same requests, the same run), the Active Memory Pack's size with 1,000 stored records, and "
            "the distill calls per session on the corpus (each trajectory replayed with the verify-gate on, a "
            "supervisor double passing every verification).", "",
            "Command: `python bench/learning.py ../shared/corpus/trajectories --write`", "", *lines]))
    return 0 if within else 1


if __name__ == "__main__":
    sys.exit(main())
