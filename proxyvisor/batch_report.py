"""The report of a ``proxyvisor batch`` run: one :class:`TaskResult` per task, from its session's ledger, written
as JSON lines and as Markdown.

A task's figures come from its session's ledger lines, summed by :func:`proxyvisor.proxy.info.summarize` (the
source of ``/info`` too), and from its agent process. Its **outcome** is the label the verify-gate gave the last
turn that ended with a verdict (``verified``, ``unknown``, ``failed``, ``unverified``: ``proxyvisor.gate.outcome``),
or :data:`NO_VERDICT` when no turn of the session ended with one (the agent crashed or was stopped before its
answer, made no model request, or the gate never ran).

JSON lines: one object per task, in task-file order, with the keys of :data:`FIELDS` (``None`` where a value is
unknown: ``exit_code`` of an agent that never started, ``error`` of a clean run). Markdown: a heading with the run's
facts, a table with one row per task and a totals row (:data:`COLUMNS`: the same values as the JSON lines), and
a table of each task's session, working directory and output files.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from .store import atomic_write

NO_VERDICT = "no_verdict"
VERIFIED = "verified"
OUTCOMES = (VERIFIED, "unknown", "failed", "unverified", NO_VERDICT)
"""Every outcome label, best first (the order totals are listed in)."""


@dataclass(frozen=True)
class TaskResult:
    """One task's line of the report.

    ``outcome``: see the module docstring. ``gate_rounds``: verifier passes (calls of the verifier);
    ``gaps``: of them, the passes that found gaps; ``reentries``: times the gate continued a turn upstream to close
    gaps; ``nudges``: continue nudges of the headless pre-check; ``detector_fires`` and ``steers``: detector signals
    fired and steer notes added, all signals together. ``input_tokens``/``output_tokens``: the agent's model
    (upstream) tokens; ``cost_usd``: upstream plus supervisor model, in USD, with ``cost_known`` false when some
    upstream or supervisor answer is not priced (the built-in scripted model's, or a model missing from litellm's
    cost map: it then counts 0, and a cost of 0 reads "not priced"). ``requests``: model requests through the
    proxy. ``seconds``: the agent's wall time. ``exit_code``: the agent's exit status (128+N when a signal N ended
    it; 127 when it could not start, None when it never ran). ``error``: why the task did not end cleanly (timed
    out, interrupted, could not start, or the last line of the agent's stderr when it exited non-zero), else None.
    """

    id: str
    session: str
    outcome: str
    exit_code: int | None
    error: str | None
    seconds: float
    gate_rounds: int = 0
    gaps: int = 0
    reentries: int = 0
    nudges: int = 0
    detector_fires: int = 0
    steers: int = 0
    requests: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    cost_usd: float = 0.0
    cost_known: bool = True
    workdir: str = ""
    stdout: str = ""
    stderr: str = ""

    @property
    def verified(self) -> bool:
        """Whether the task counts as verified for ``--require-verified``: outcome verified and a clean exit."""
        return self.outcome == VERIFIED and self.exit_code == 0 and self.error is None


FIELDS = tuple(f.name for f in dataclasses.fields(TaskResult))

COLUMNS = (("task", "id"), ("outcome", "outcome"), ("exit", "exit_code"), ("gate rounds", "gate_rounds"),
           ("gaps", "gaps"), ("re-entries", "reentries"), ("nudges", "nudges"), ("detector fires", "detector_fires"),
           ("steers", "steers"), ("requests", "requests"), ("input tokens", "input_tokens"),
           ("output tokens", "output_tokens"), ("cost (USD)", "cost_usd"), ("agent seconds", "seconds"),
           ("error", "error"))
"""The Markdown table's columns: (heading, :class:`TaskResult` field). The totals row sums each column, so its
agent seconds add up the agents' times, which overlap when tasks run in parallel (the report's facts give the
batch's wall time)."""
_SUMMED = ("gate_rounds", "gaps", "reentries", "nudges", "detector_fires", "steers", "requests", "input_tokens",
           "output_tokens", "cost_usd", "seconds")


def from_summary(info: Mapping[str, Any], **run: Any) -> TaskResult:
    """The result of a task whose session's :func:`~proxyvisor.proxy.info.summarize` object is ``info``; ``run``
    gives the fields that come from the run itself (id, session, exit_code, error, seconds, workdir, stdout,
    stderr)."""
    gate, upstream, supervisor = info["gate"], info["upstream"], info["supervisor_model"]
    return TaskResult(
        outcome=gate["last_outcome"] or NO_VERDICT, gate_rounds=supervisor["calls"].get("verify", 0),
        gaps=gate["gaps"], reentries=gate["reentries"], nudges=gate["nudges"],
        detector_fires=sum(info["detectors"]["fires"].values()), steers=sum(info["detectors"]["steers"].values()),
        requests=info["requests"], input_tokens=upstream["input_tokens"], output_tokens=upstream["output_tokens"],
        cost_usd=upstream["cost_usd"] + supervisor["cost_usd"], cost_known=upstream["cost_known"] and not upstream["scripted_requests"]
        and not supervisor.get("unpriced_calls"), **run)


def cell(result: TaskResult, field: str) -> str:
    """The Markdown cell of ``field`` of ``result`` (the one rule both the rows and the tests read)."""
    value = getattr(result, field)
    if field == "cost_usd":
        return f"{value:.4f}" + ("" if result.cost_known else "*") if value or result.cost_known else "not priced"
    if field == "seconds":
        return f"{value:.1f}"
    if value is None:
        return "–"
    return _escape(str(value))


def _escape(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def outcome_counts(results: Iterable[TaskResult]) -> dict[str, int]:
    """``{label: n}`` over ``results``, in :data:`OUTCOMES` order, labels with none left out."""
    counts = Counter(r.outcome for r in results)
    return {label: counts[label] for label in OUTCOMES if counts[label]}


def markdown(results: Sequence[TaskResult], facts: Sequence[tuple[str, str]]) -> str:
    """The Markdown report: ``facts`` (name, text) as a list, then the tables (module docstring)."""
    lines = ["# proxyvisor batch report", ""]
    lines += [f"- {name}: {text}" for name, text in facts]
    counts = outcome_counts(results)
    lines += [f"- outcomes: {', '.join(f'{k} {v}' for k, v in counts.items()) or 'none'}", ""]
    lines.append("| " + " | ".join(head for head, _ in COLUMNS) + " |")
    lines.append("|" + "|".join("---" if field in ("id", "outcome", "error") else "---:" for _, field in COLUMNS) + "|")
    lines += ["| " + " | ".join(cell(r, field) for _, field in COLUMNS) + " |" for r in results]
    total = {field: sum(getattr(r, field) for r in results) for field in _SUMMED}
    verified = sum(r.verified for r in results)
    totals = {"id": "**total**", "outcome": f"{verified} of {len(results)} verified", "exit_code": "", "error": "",
              "cost_usd": f"{total['cost_usd']:.4f}" + ("" if all(r.cost_known for r in results) else "*")
              if total["cost_usd"] or all(r.cost_known for r in results) else "not priced",
              "seconds": f"{total['seconds']:.1f}"}
    lines.append("| " + " | ".join(totals.get(field, str(total.get(field, ""))) for _, field in COLUMNS) + " |")
    if not all(r.cost_known for r in results):
        unpriced = ("* (or \"not priced\"): the total leaves out answers that have no price: those of the built-in "
                    "scripted model, and tokens of a model litellm's cost map does not price.")
        lines += ["", unpriced]
    lines += ["", "| task | session | working directory | stdout | stderr |", "|---|---|---|---|---|"]
    lines += [f"| {r.id} | {r.session} | {_escape(r.workdir)} | {_escape(r.stdout)} | {_escape(r.stderr)} |"
              for r in results]
    return "\n".join(lines) + "\n"


def write(prefix: Path, results: Sequence[TaskResult], facts: Sequence[tuple[str, str]]) -> tuple[Path, Path]:
    """Write ``PREFIX.jsonl`` and ``PREFIX.md`` (replacing them, each whole or not at all; new files are 0600:
    they quote the agents' output); returns their paths. Raises OSError."""
    prefix.parent.mkdir(parents=True, exist_ok=True)
    jsonl, md = prefix.with_name(prefix.name + ".jsonl"), prefix.with_name(prefix.name + ".md")
    atomic_write(jsonl, b"".join(orjson.dumps(dataclasses.asdict(r)) + b"\n" for r in results))
    atomic_write(md, markdown(results, facts).encode("utf-8"))
    return jsonl, md


__all__ = ["COLUMNS", "FIELDS", "NO_VERDICT", "OUTCOMES", "TaskResult", "cell", "from_summary", "markdown",
           "outcome_counts", "write"]
