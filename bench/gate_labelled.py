"""Replay a folder of labelled trajectories with the verify-gate on: does the gate's final label tell a resolved
run from an unresolved one?

Usage: python bench/gate_labelled.py FOLDER LABELS.csv [--config FILE] [--format chat|messages|responses]
                                     [--stream] [--write]

Each ``*.jsonl`` trajectory of FOLDER and its subfolders (any file ``proxyvisor replay`` reads) is replayed as ``proxyvisor replay
FILE --gate`` does (``proxyvisor.replay.replay_gated``: supervision and the gate on, re-entry budget 0, the run's
last assistant message as its final answer). The verifier is the configured supervisor route: by default the
session's own route, here the embedded scripted upstream, which answers with its fixed verifier policy (no key, no
network: the figures then measure free evidence plus a fixed rule, not a model); with ``--config FILE`` whose
``[supervisor.model]`` picks the litellm route (``name`` with ``api_base`` or ``api_key_env``), that model. The
configuration's upstream for ``--format`` must be scripted (the default): it plays the recorded turns.

**The final label** of a run is the gate's outcome at its last stop (a reply without tool calls): ``verified``,
``unknown``, ``failed``, ``unverified``, or ``no verdict`` (no stop was judged: no tools offered, or no stop).

**Labels**: a CSV file with a header holding the columns ``file`` (the trajectory's file name, or its path relative
to FOLDER) and ``resolved`` (``true``/``false``, ``1``/``0``, ``yes``/``no``, any case); other columns are ignored.
A row with an unreadable ``resolved`` is reported and ignored.

Prints the confusion table of the final label against ``resolved``, the precision and recall of ``verified`` (a
``verified`` run counts as predicting "resolved"), the base rate, and one line per run. Never stops on one file:
files without a label, labels without a file, and files that fail to replay (unreadable, not a trajectory, no messages, a
replay error) are counted and listed. ``--write`` puts the tables into bench/RESULTS.md under "## Verify-gate against
resolved labels (issue 11)". Exit status: 0 the table was made, 2 no trajectory, or the labels or config file
cannot be read.
"""

from __future__ import annotations

import argparse
import csv
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.results import write_section  # noqa: E402
from proxyvisor.config import Config, ConfigError, load  # noqa: E402
from proxyvisor.proxy.formats import BY_NAME  # noqa: E402
from proxyvisor.replay import (NO_VERDICT, GateStop, TrajectoryError, final_label, gate_stops,  # noqa: E402
                               load_trajectory, replay_gated)
from proxyvisor.store import Store  # noqa: E402

LABELS = ("verified", "unknown", "failed", "unverified", NO_VERDICT)
"""Rows of the confusion table, in order; an outcome outside them gets its own row after them."""
_TRUE, _FALSE = {"true", "1", "yes", "y", "resolved"}, {"false", "0", "no", "n", "unresolved"}


class LabelsError(ValueError):
    """The labels file cannot be read or has no ``file`` and ``resolved`` columns."""


@dataclass
class Labels:
    """The labels read from a CSV file: ``resolved`` by file key, and the rows that could not be read."""

    resolved: dict[str, bool] = field(default_factory=dict)
    bad_rows: list[str] = field(default_factory=list)


def read_labels(path: Path) -> Labels:
    """The labels of ``path`` (module docstring). Raises LabelsError when the file is unreadable or lacks the
    columns; a bad row is kept in ``bad_rows`` (``line N: why``), not raised."""
    try:
        text = path.read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as exc:
        raise LabelsError(f"{path}: cannot read: {exc}") from None
    reader = csv.DictReader(text.splitlines())
    columns = {(name or "").strip().lower(): name for name in reader.fieldnames or ()}
    if "file" not in columns or "resolved" not in columns:
        raise LabelsError(f"{path}: needs a header with the columns file and resolved, got {reader.fieldnames}")
    labels = Labels()
    for number, row in enumerate(reader, 2):
        name = (row.get(columns["file"]) or "").strip()
        value = (row.get(columns["resolved"]) or "").strip().lower()
        if not name:
            labels.bad_rows.append(f"line {number}: no file name")
        elif value in _TRUE or value in _FALSE:
            labels.resolved[name] = value in _TRUE
        else:
            labels.bad_rows.append(f"line {number}: resolved is {value!r}, not true/false, 1/0 or yes/no")
    return labels


@dataclass
class Run:
    """One labelled trajectory's replay: its final label and stops, or why it failed to replay."""

    name: str
    resolved: bool
    label: str = NO_VERDICT
    stops: list[GateStop] = field(default_factory=list)
    changed_rounds: int = 0
    error: str | None = None
    seconds: float = 0.0


def label_of(labels: Labels, folder: Path, path: Path) -> bool | None:
    """The label of ``path``: by its path relative to ``folder``, else its file name; None when unlabelled."""
    relative = path.relative_to(folder).as_posix()
    return labels.resolved.get(relative, labels.resolved.get(path.name))


async def replay_one(config: Config, path: Path, resolved: bool, fmt: str, stream: bool, state: Path) -> Run:
    """Replay ``path`` gated; a failure to read or replay it is the run's ``error``, never raised."""
    run = Run(path.name, resolved)
    started = time.perf_counter()
    try:
        messages = load_trajectory(path)
        rounds = await replay_gated(config, messages, BY_NAME[fmt], stream, session="labelled",
                                    store=Store(state / path.stem[:60]))
    except TrajectoryError as exc:
        run.error = str(exc)
    except Exception as exc:  # noqa: BLE001 - one bad file must not stop a benchmark over hundreds of runs
        run.error = f"replay failed: {type(exc).__name__}: {exc}"[:300]
    else:
        run.stops = gate_stops(rounds)
        run.label = final_label(run.stops)
        run.changed_rounds = sum(not r.matches for r in rounds)
    run.seconds = time.perf_counter() - started
    return run


def confusion(runs: list[Run]) -> list[str]:
    """The confusion table (Markdown) of the replayed runs' final labels by ``resolved``."""
    rows = list(LABELS) + sorted({r.label for r in runs} - set(LABELS))
    lines = ["| final label | resolved | not resolved | total |", "|---|---|---|---|"]
    for label in rows:
        yes = sum(r.label == label and r.resolved for r in runs)
        no = sum(r.label == label and not r.resolved for r in runs)
        lines.append(f"| {label} | {yes} | {no} | {yes + no} |")
    yes = sum(r.resolved for r in runs)
    lines.append(f"| total | {yes} | {len(runs) - yes} | {len(runs)} |")
    return lines


def _ratio(part: int, whole: int) -> str:
    return f"{part / whole:.0%} ({part}/{whole})" if whole else f"n/a (0/{whole})"


def scores(runs: list[Run]) -> str:
    """Precision and recall of ``verified`` as a prediction of "resolved", and the base rate."""
    true_positive = sum(r.label == "verified" and r.resolved for r in runs)
    predicted = sum(r.label == "verified" for r in runs)
    resolved = sum(r.resolved for r in runs)
    return (f"precision of verified {_ratio(true_positive, predicted)}; recall of verified "
            f"{_ratio(true_positive, resolved)}; base rate (resolved) {_ratio(resolved, len(runs))}")


def per_run(runs: list[Run]) -> list[str]:
    lines = ["| trajectory | resolved | final label | decided by | stops judged | gaps at the last stop |",
             "|---|---|---|---|---|---|"]
    for r in runs:
        last = r.stops[-1] if r.stops else None
        gaps = "; ".join(last.gaps)[:120] if last is not None and last.gaps else "-"
        lines.append(f"| {r.name} | {'yes' if r.resolved else 'no'} | {r.label} | "
                     f"{(last.decided_by if last is not None else None) or '-'} | "
                     f"{sum(s.gated for s in r.stops)}/{len(r.stops)} | {gaps} |")
    return lines


def route(config: Config, runs: list[Run]) -> str:
    """Which verifier judged: the route the configuration picks, and the routes and models the ledger names."""
    model = config.supervisor.model
    if model.api_base and model.api_base != "scripted:" or model.api_key_env:
        picked = f"[supervisor.model] {model.name} through litellm"
    else:
        picked = ("the scripted verifier policy (the session's route to the embedded scripted upstream: free "
                  "evidence plus a fixed rule, not a model)")
    seen = sorted({f"{s.route} route, model {s.model}" for r in runs for s in r.stops if s.route})
    return picked + (f"; the ledger names: {'; '.join(seen)}" if seen else "")


def report(runs: list[Run], failed: list[Run], unlabelled: list[str], missing: list[str], bad_rows: list[str],
           config: Config, elapsed: float) -> list[str]:
    lines = [f"Verifier: {route(config, runs)}.", "", *confusion(runs), "", scores(runs), ""]
    lines.append(f"{len(runs)} labelled run(s) replayed in {elapsed:.0f} s; {len(failed)} failed to replay; "
                 f"{len(unlabelled)} file(s) without a label (not replayed); {len(missing)} label(s) without a "
                 f"file; {len(bad_rows)} unreadable label row(s); "
                 f"{sum(r.changed_rounds for r in runs)} replayed round(s) came back changed.")
    for title, items in (("Failed to replay", [f"{r.name}: {r.error}" for r in failed]),
                         ("Without a label", unlabelled), ("Labels without a file", missing),
                         ("Unreadable label rows", bad_rows)):
        if items:
            lines += ["", f"{title}:", *(f"- {item}" for item in items)]
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", help="folder of trajectory .jsonl files")
    parser.add_argument("labels", help="CSV with the columns file,resolved")
    parser.add_argument("--config", metavar="FILE", help="proxyvisor configuration (the supervisor route)")
    parser.add_argument("--format", choices=sorted(BY_NAME), default="chat", help="wire format of the replay")
    parser.add_argument("--stream", action="store_true", help="replay with streaming requests")
    parser.add_argument("--write", action="store_true", help="write the tables into bench/RESULTS.md")
    args = parser.parse_args(argv)
    folder = Path(args.folder)
    try:
        labels = read_labels(Path(args.labels))
        config = load(args.config) if args.config else Config()
    except (LabelsError, ConfigError) as exc:
        print(f"gate_labelled: {exc}", file=sys.stderr)
        return 2
    paths = sorted(folder.rglob("*.jsonl"))
    if not paths:
        print(f"gate_labelled: no trajectories (*.jsonl) in {folder}", file=sys.stderr)
        return 2
    unlabelled = [p.relative_to(folder).as_posix() for p in paths if label_of(labels, folder, p) is None]
    known = {p.relative_to(folder).as_posix() for p in paths} | {p.name for p in paths}
    missing = sorted(name for name in labels.resolved if name not in known)
    started = time.perf_counter()

    async def replay_all() -> list[Run]:
        done = []
        with tempfile.TemporaryDirectory() as state:
            for path in paths:
                resolved = label_of(labels, folder, path)
                if resolved is None:
                    continue
                run = await replay_one(config, path, resolved, args.format, args.stream, Path(state))
                print(f"{path.name}: {run.error or run.label} ({run.seconds:.1f} s)", file=sys.stderr, flush=True)
                done.append(run)
        return done

    everything = trio.run(replay_all)
    runs = [r for r in everything if r.error is None]
    failed = [r for r in everything if r.error is not None]
    lines = report(runs, failed, unlabelled, missing, labels.bad_rows, config, time.perf_counter() - started)
    print("\n".join(lines + ["", "Per run:", "", *per_run(runs)]))
    if args.write:
        write_section("Verify-gate against resolved labels (issue 11)", "\n".join([
            "Every labelled trajectory replayed as `proxyvisor replay FILE --gate` does (supervision and the gate on, "
            "re-entry budget 0, the run's last assistant message as its final answer); the final label is the "
            "gate's outcome at the run's last stop. `verified` counts as predicting \"resolved\".", "",
            f"Command: `python bench/gate_labelled.py {args.folder} {args.labels}"
            + (f" --config {args.config}" if args.config else "") + (f" --format {args.format}"
                                                                     if args.format != "chat" else "")
            + (" --stream" if args.stream else "") + " --write`", "",
            f"The corpus folder `{args.folder}` is beside the repository, not in it: it exists only in our CI and on "
            "developers' machines; pass your own folder of trajectories (and labels) to run it elsewhere.", "",
            f"Labels: `{args.labels}`. The corpus's, `bench/corpus_labels.csv`, are the SWE-bench runs' outcomes "
            "from the sources' own evaluation and, for two Claude Code sessions, INDEX.md's account of how they end "
            "(its `basis` column says which, row by row); runs with no outcome to label are left out, listed "
            "below.", "",
            *lines, "", "Per run:", "", *per_run(runs)]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
