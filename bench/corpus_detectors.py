"""Replay the corpus trajectories through the proxy and compare what the detectors fired with the human labels.

Usage: python bench/corpus_detectors.py [CORPUS_TRAJECTORIES_DIR] [--write]

The directory defaults to ../shared/corpus/trajectories next to the repository. Each trajectory is replayed as its
agent sent it (``proxyvisor.replay``, chat format, supervision on, the scripted upstream answering the recorded
turns), and every detector firing is collected with the position (the trajectory's 0-based line) of the round it
fired at. The labels below are transcribed from that folder's INDEX.md ("which detector SHOULD fire, roughly
where"); they are judgments, not ground truth.

Targets (issue 3): every labelled loop and repeated failing command is caught within 2 rounds of where its label
puts it; nothing fires on the user-requested repeats (e77833af) or on the clean successful runs. A round is an
assistant turn, or a turn the client dropped (a repeated prompt, see ``proxyvisor.detectors.receipts``).

The table lists, per trajectory, the labels with the firing that caught each one (the nearest), and every firing that started
a streak outside the labels (a detector keeps firing while the agent stays stuck; only where a streak starts is
judged). Exits 1 when a target is missed. ``--write`` puts the table into bench/RESULTS.md under
"## Detectors (issue 3)".
"""

from __future__ import annotations

import bisect
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import corpus_parser, trajectories  # noqa: E402
from bench.results import write_section  # noqa: E402
from proxyvisor.config import Config  # noqa: E402
from proxyvisor.detectors.receipts import Round, read_rounds  # noqa: E402
from proxyvisor.proxy.formats import CHAT  # noqa: E402
from proxyvisor.replay import load_trajectory, replay  # noqa: E402
from proxyvisor.store import Store  # noqa: E402

STUCK = frozenset({"loop", "no_progress", "monologue", "alternation"})
"""What the INDEX calls "loop" or "loop/no-progress": any of the repetition detectors."""
FAILING = frozenset({"recovery", "loop"})
"""What the INDEX calls "fail-repeat": the same command failing again."""
TOLERANCE = 2


@dataclass(frozen=True)
class Label:
    """An expected firing: one of ``kinds`` between lines ``first`` and ``last`` (within :data:`TOLERANCE`
    rounds). ``required`` labels are targets; the others only make a firing there expected."""

    name: str
    kinds: frozenset[str]
    first: int
    last: int
    required: bool = True


LABELS: dict[str, list[Label]] = {
    # "loop at ~44 (3rd identical command + identical output) or at latest 48; fail-repeat at 50/62"
    "mswea-gemini3pro__sympy-15976__noop-sed-loop-then-resolved.jsonl": [
        Label("loop", STUCK, 44, 48), Label("fail-repeat", FAILING, 50, 62)],
    # "loop early (e.g. by the 3rd-5th identical poll, ~8)"
    "claudecode__subagent-75f0cae4__bashoutput-polling-loop.jsonl": [Label("loop", STUCK, 6, 10)],
    # "loop/no-progress from ~42 (3rd consecutive empty turn) and again at ~86"
    "mswea-gpt5mini__django-14631__no-toolcall-loop-then-premature-done.jsonl": [
        Label("loop/no-progress", STUCK, 42, 42), Label("loop/no-progress", STUCK, 86, 86)],
    # "loop/no-progress at ~36 and ~96"; the other runs of consecutive "No tool calls" turns it lists
    # (52-60, 63-67, 70-77, 80-91) are stretches where a firing is expected too.
    "mswea-gpt5mini__django-13590__128k-output-no-toolcall-loop-resolved.jsonl": [
        Label("loop/no-progress", STUCK, 36, 36), Label("loop/no-progress", STUCK, 96, 96),
        Label("no-tool-call run", STUCK, 52, 60, False), Label("no-tool-call run", STUCK, 63, 67, False),
        Label("no-tool-call run", STUCK, 70, 77, False), Label("no-tool-call run", STUCK, 80, 91, False)],
    # "fail-repeat at 17: the identical failed edit is resubmitted"
    "sweagent-gpt4__pydicom-1458__repeated-failing-edit-unverified-submit.jsonl": [
        Label("fail-repeat", FAILING, 17, 17)],
    # "same command failing 5x ... a good detector warns softly at most (~170), not hard-stops"
    "claudecode__e6f53930__repeated-pytest-fixes-then-done-with-7-failing.jsonl": [
        Label("fail-repeat (soft)", FAILING, 170, 170)],
    # "The 9 empty turns are a real, short no-progress stretch - a loop detector firing at ~24 is acceptable"
    "mswea-gpt5mini__scikit-learn-15100__success.jsonl": [Label("short no-tool-call run", STUCK, 24, 24, False)],
    # "fail-repeat is borderline (3 runs of the same command with edits in between)"
    "mswea-gemini3pro__django-11276__done-despite-failing-test.jsonl": [
        Label("fail-repeat (borderline)", FAILING, 32, 54, False)],
    # "Also mild fail-repeat at 62-71 (python3 reproduce_issue.py failing 3x while the agent edits its own repro)"
    "mswea-gemini3pro__django-15629__stray-orig-files-151k-diff.jsonl": [
        Label("fail-repeat (mild)", FAILING, 62, 71, False)],
}
QUIET = {
    "claudecode__e77833af__user-requested-repeat-checks.jsonl": "user-requested repeats: nothing may fire",
    "mswea-gemini3pro__django-14765__clean-success.jsonl": "clean success: nothing may fire",
    "mswea-gpt5mini__sympy-22456__success-63k-output.jsonl": "success: nothing may fire",
    "claudecode__405511d3__tests-pass-then-stop-hook-gate.jsonl": "success, normal re-runs: nothing may fire",
    "mswea-gemini3pro__django-15252__done-without-running-tests.jsonl": "no loop",
    "mswea-gemini3pro__sphinx-7748__done-with-preexisting-test-failure.jsonl": "nothing else should fire",
    "mswea-gpt5mini__scikit-learn-15100__success.jsonl": "success: nothing but the ~24 stretch",
}


@dataclass
class Result:
    name: str
    rows: list[str]
    missed: int
    unexpected: int
    notes: int


def firings_of(rounds: list) -> list[tuple[int, str]]:
    found = set()
    for r in rounds:
        for item in r.detectors:
            signal, _, position = item.partition("@")
            found.add((int(position), signal))
    return sorted(found)


def judge(name: str, messages: list[dict], fired: list[tuple[int, str]], notes: int) -> Result:
    starts = [e.index for e in read_rounds([CHAT.message(m) for m in messages]) if isinstance(e, Round)]

    def rank(line: int) -> int:
        return bisect.bisect_left(starts, line)

    labels = LABELS.get(name, [])
    rows, missed = [], 0
    for label in labels:
        low, high = rank(label.first) - TOLERANCE, rank(label.last) + TOLERANCE
        near = sorted((max(rank(label.first) - rank(p), rank(p) - rank(label.last), 0), p, s)
                      for p, s in fired if s in label.kinds and low <= rank(p) <= high)
        caught = [f"{s}@{p}" for _, p, s in near]
        ok = bool(caught) or not label.required
        missed += not ok
        where = str(label.first) if label.first == label.last else f"{label.first}-{label.last}"
        verdict = ("caught" if caught else "not caught") + ("" if label.required else " (not a target)")
        rows.append(f"| {name} | {label.name} @ {where} | {caught[0] if caught else '-'} | "
                    f"{verdict if ok else '**MISSED**'} |")
    fired_at = {rank(p) for p, _ in fired}
    extra = []
    for position, signal in fired:
        r = rank(position)
        if r - 1 in fired_at:
            continue  # a streak going on: judged where it started
        if any(signal in label.kinds and rank(label.first) - TOLERANCE <= r <= rank(label.last) + TOLERANCE
               for label in labels):
            continue
        extra.append(f"{signal}@{position}")
    quiet = name in QUIET
    if extra:
        rows.append(f"| {name} | {QUIET.get(name, 'not labelled here')} | {' '.join(extra)} | "
                    f"{'**UNEXPECTED**' if quiet else 'not labelled'} |")
    elif not labels:
        rows.append(f"| {name} | {QUIET.get(name, 'no detector label')} | - | ok |")
    return Result(name, rows, missed, len(extra) if quiet else 0, notes)


async def run(paths: list[Path]) -> list[Result]:
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for path in paths:
            messages = load_trajectory(path)
            rounds = await replay(Config(), messages, CHAT, False, session="corpus-" + path.stem[:40],
                                  store=Store(Path(tmp)))
            notes = sum(1 for r in rounds if r.steer)
            results.append(judge(path.name, messages, firings_of(rounds), notes))
            print(f"{path.name}: {len(rounds)} rounds, {notes} steer notes", file=sys.stderr)
    return results


def main() -> int:
    args = corpus_parser(__doc__).parse_args()
    paths = trajectories(args.corpus)
    if not paths:
        return 2
    started = time.perf_counter()
    results = trio.run(run, paths)
    required = sum(label.required for labels in LABELS.values() for label in labels)
    missed = sum(r.missed for r in results)
    unexpected = sum(r.unexpected for r in results)
    lines = ["| trajectory | expected (INDEX.md label @ line) | fired (nearest matching signal@line) | verdict |",
             "|---|---|---|---|"] + [row for r in results for row in r.rows]
    notes = ", ".join(f"{r.name.split('__')[1]} {r.notes}" for r in results if r.notes)
    summary = (f"{required - missed}/{required} labelled loops and repeated failing commands caught within "
               f"{TOLERANCE} rounds; {unexpected} unexpected streaks on the quiet trajectories "
               f"(user-requested repeats, successful runs). Steer notes sent: {notes}. "
               f"{len(results)} trajectories, {time.perf_counter() - started:.0f} s.")
    print("\n".join(lines) + "\n\n" + summary)
    if args.write:
        write_section("Detectors (issue 3)", "\n".join([
            "Every corpus trajectory replayed through the proxy (chat format, supervision on, the scripted upstream "
            "answering the recorded turns); detector firings compared with the labels of the corpus INDEX.md. "
            "Positions are the trajectories' 0-based lines (for a round: where its assistant turn, or the "
            "repeated prompt standing for a dropped turn, is).", "",
            "Command: `python bench/corpus_detectors.py ../shared/corpus/trajectories --write`", "",
            *lines, "", summary]))
    return 1 if missed or unexpected else 0


if __name__ == "__main__":
    sys.exit(main())
