"""``proxyvisor condense FILE``: what the model would get of a tool output, and what a condenser model would see.

The file is treated as one plain-text tool result of the current round, alone in it. Above the threshold it is
condensed as the proxy would condense it: by the deterministic condenser (``proxyvisor.condense.select``) when no
``[supervisor.model] name`` is configured, when FILE is a test run, build or install of
``[supervisor.condense] deterministic_kinds`` (read from its shape: no command is known offline), or when the model
call gives nothing usable; otherwise by one condenser call, whose numbered view gets the whole round budget
(``--budget``, else ``view_budget_tokens``). The result names FILE itself as the full original, so nothing is
spilled or cached. ``--green FILE`` is the output of the last successful run of the same command: a failing FILE
then leads with its lines new against it. ``--view`` prints the numbered view a condenser model gets, too.
``api_base = "scripted:"`` calls the embedded scripted upstream, which answers no verdict, so the deterministic
condenser decides, as in ``demo`` and ``replay``. Bytes that are not UTF-8 are kept as they are
(``surrogateescape``), so kept lines are byte-exact on stdout.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import msgspec
import trio

from .scripted.upstream import ScriptedUpstream
from .config import SCRIPTED_URL, Config, ConfigError, CondenseConfig
from .proxy.server import Limits, bound_port, open_listeners, serve_listeners
from .rules import VIEW_BUDGET
from .supervisor_model import configured_model, litellm_model
from .proxy.condense_engine import CondenseEngine, RoundReport, ToolResult, effective_threshold, prepare_items
from .condense.protocol import TaskContext
from .condense.baseline import kind_of
from .condense.signals import diagnostic_lines
from .proxy.spill import SpillStore
from .condense.text import ENCODING, count_tokens, split_lines


class _FileIsSpill(SpillStore):
    """The offline tool's "spill": the input file itself, already on disk."""

    def __init__(self, path: Path) -> None:
        super().__init__(path.parent)
        self.file = path

    def path_for(self, session: str, tool: str, digest: str) -> Path:
        return self.file

    def write(self, path: Path, text: str) -> None:
        return None


def condense_command(config: Config, file: str, task: str, budget: int | None, as_json: bool,
                     green: str | None = None, view: bool = False) -> int:
    """The CLI entry. Exit 0 when the result came out; 1 when FILE (or ``green``) cannot be read; 2 for a budget
    outside :data:`~proxyvisor.rules.VIEW_BUDGET` or a configuration error."""
    settings = config.supervisor.condense
    budget = settings.view_budget_tokens if budget is None else budget
    if not VIEW_BUDGET.admits(budget):
        print(f"proxyvisor: --budget must be {VIEW_BUDGET} tokens", file=sys.stderr)
        return 2
    path = Path(file).resolve()
    try:
        text = _read(path)
        earlier = ("--green " + green, _read(Path(green))) if green else None
    except OSError as exc:
        print(f"proxyvisor: cannot read {exc.filename}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    result = ToolResult("offline", path.name, text, green=earlier)
    tokens = count_tokens(text)
    threshold = effective_threshold(settings.tokens_threshold)
    candidate = settings.enabled and threshold is not None and tokens > threshold
    context = TaskContext(request=task)
    item = prepare_items([(result, tokens)], context, budget)[0] if view or as_json else None
    lines = split_lines(text)

    report: RoundReport | None = None
    model = config.supervisor.model
    if candidate:
        try:
            report = trio.run(_condense, config, msgspec.structs.replace(settings, view_budget_tokens=budget), path,
                              result, context)
        except ConfigError as exc:
            print(f"proxyvisor: configuration error: {exc}", file=sys.stderr)
            return 2
    decision = report.decisions.get("offline") if report else None

    if as_json:
        assert item is not None
        condensed = None
        if decision is not None:
            condensed = {**dataclasses.asdict(decision), "tokens": decision.tokens_after,
                         "kept_ranges": [list(r) for r in decision.kept_ranges]}
        print(json.dumps({
            "file": str(path), "lines": len(lines), "tokens": tokens, "encoding": ENCODING,
            "threshold": threshold, "candidate": candidate, "budget": budget,
            "budget_tokens": settings.budget_tokens, "kind": kind_of("", text) or None,
            "diagnostic_lines": [i + 1 for i in diagnostic_lines(lines)],
            "view": {"tokens": item.view.tokens, "partial": item.view.partial, "shown_lines": len(item.view.shown),
                     "visible_ranges": [list(r) for r in item.view.visible_ranges], "text": item.view.text},
            "model": model.name or None,
            "condensed": condensed,
            "failure": report.failure if report else "",
        }, ensure_ascii=False, indent=1).encode("utf-8", "surrogateescape").decode("utf-8", "replace"))
        return 0
    status = (f"a condense candidate (above the {threshold:,}-token threshold)" if candidate else
              "condensing is off" if threshold is None or not settings.enabled else
              f"below the {threshold:,}-token threshold: the proxy passes it through unchanged")
    print(f"{path}: {len(lines):,} lines, {tokens:,} tokens ({ENCODING}); {status}")
    if item is not None:
        print(f"view: {len(item.view.shown):,} of {len(lines):,} lines shown, {item.view.tokens:,} tokens of a "
              f"{budget:,}-token budget; {len(diagnostic_lines(lines))} diagnostic line(s)\n")
        sys.stdout.write(item.view.text)
    if report is not None:
        _print_outcome(report)
    return 0


def _read(path: Path) -> str:
    return path.read_bytes().decode("utf-8", "surrogateescape")


async def _condense(config: Config, settings: CondenseConfig, path: Path, result: ToolResult,
                    context: TaskContext) -> RoundReport:
    """One condense round over ``result``: with ``[supervisor.model]`` when it names a model (``api_base =
    "scripted:"`` is answered by an embedded scripted upstream served on a free loopback port until the round
    ends), else by the deterministic condenser alone.

    Raises:
        ConfigError: the litellm route without a name.
    """
    model = config.supervisor.model
    async with trio.open_nursery() as nursery:
        call = None
        if model.name:
            url = None
            if model.api_base == SCRIPTED_URL:
                listeners = await open_listeners("127.0.0.1", 0)
                await nursery.start(serve_listeners, listeners, ScriptedUpstream(record=False), Limits())
                url = f"http://127.0.0.1:{bound_port(listeners)}"
            # The session route has no session offline: the model is then called by name through litellm.
            call = configured_model(model, url) or litellm_model(model)
        engine = CondenseEngine(settings, call, spill=_FileIsSpill(path), model_name=model.name)
        report = await engine.run_round("offline", [result], context)
        nursery.cancel_scope.cancel()
    return report


def _print_outcome(report: RoundReport) -> None:
    decision = report.decisions["offline"]
    print()
    if report.failure:
        print(f"condenser model: {report.failure}; condensed without a model")
    if decision.text is None:
        print(f"the result stays unchanged ({decision.reason})")
        return
    ranges = ", ".join(f"{a}-{b}" if a != b else str(a) for a, b in decision.kept_ranges)
    print(f"{decision.reason} by the {decision.condenser} condenser: {decision.tokens_before:,} -> "
          f"{decision.tokens_after:,} tokens, {decision.kept_lines:,} of {decision.total_lines:,} lines kept "
          f"({ranges or 'none'})" + (f"; compared with {decision.baseline}" if decision.baseline else "") + "\n")
    sys.stdout.flush()
    sys.stdout.buffer.write(decision.text.encode("utf-8", "surrogateescape"))
    sys.stdout.buffer.flush()
