"""``proxyvisor condense FILE``: what the condenser would see of a tool output, and what the model would get.

The file is treated as one plain-text tool result of the current round, alone in it, so its view gets the whole
round budget (``--budget``, else ``[supervisor.condense] view_budget_tokens``). The numbered view is always
printed. With ``[supervisor.model] name`` set and the file above the threshold, the condenser is called once and
the narrowed result is printed too; it names FILE itself as the full original, so nothing is spilled or cached.
``api_base = "scripted:"`` calls the embedded scripted upstream (its fixed condenser policy, no key), served on a
loopback port for the call, as ``demo`` and ``replay`` do. Without a model, that is said before the view.
Bytes that are not UTF-8 are kept as they are (``surrogateescape``), so kept lines are byte-exact on stdout.
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


def condense_command(config: Config, file: str, task: str, budget: int | None, as_json: bool) -> int:
    """The CLI entry. Exit 0 when the view (and, with a model, the condenser's answer) came out; 1 when the
    file cannot be read or the condenser call failed; 2 for a budget outside :data:`~proxyvisor.rules.VIEW_BUDGET`."""
    settings = config.supervisor.condense
    budget = settings.view_budget_tokens if budget is None else budget
    if not VIEW_BUDGET.admits(budget):
        print(f"proxyvisor: --budget must be {VIEW_BUDGET} tokens", file=sys.stderr)
        return 2
    path = Path(file).resolve()
    try:
        text = path.read_bytes().decode("utf-8", "surrogateescape")
    except OSError as exc:
        print(f"proxyvisor: cannot read {file}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    result = ToolResult("offline", path.name, text)
    tokens = count_tokens(text)
    threshold = effective_threshold(settings.tokens_threshold)
    candidate = settings.enabled and threshold is not None and tokens > threshold
    context = TaskContext(request=task)
    item = prepare_items([(result, tokens)], context, budget)[0]
    lines = split_lines(text)

    report: RoundReport | None = None
    model = config.supervisor.model
    if candidate and model.name:
        try:
            report = trio.run(_condense, config, msgspec.structs.replace(settings, view_budget_tokens=budget), path,
                              result, context)
        except ConfigError as exc:
            print(f"proxyvisor: configuration error: {exc}", file=sys.stderr)
            return 2
    decision = report.decisions.get("offline") if report else None

    if as_json:
        print(json.dumps({
            "file": str(path), "lines": len(lines), "tokens": tokens, "encoding": ENCODING,
            "threshold": threshold, "candidate": candidate, "budget": budget,
            "diagnostic_lines": [i + 1 for i in diagnostic_lines(lines)],
            "view": {"tokens": item.view.tokens, "partial": item.view.partial, "shown_lines": len(item.view.shown),
                     "visible_ranges": [list(r) for r in item.view.visible_ranges], "text": item.view.text},
            "model": model.name or None,
            "condensed": dataclasses.asdict(decision) if decision else None,
            "failure": report.failure if report else "",
        }, ensure_ascii=False, indent=1).encode("utf-8", "surrogateescape").decode("utf-8", "replace"))
    else:
        status = (f"a condense candidate (above the {threshold:,}-token threshold)" if candidate else
                  "condensing is off" if threshold is None or not settings.enabled else
                  f"below the {threshold:,}-token threshold: the proxy passes it through unchanged")
        print(f"{path}: {len(lines):,} lines, {tokens:,} tokens ({ENCODING}); {status}")
        print(f"view: {len(item.view.shown):,} of {len(lines):,} lines shown, {item.view.tokens:,} tokens of a "
              f"{budget:,}-token budget; {len(diagnostic_lines(lines))} diagnostic line(s)")
        if not model.name:
            print("no [supervisor.model] name configured: the numbered view only, no condenser call (a name with "
                  'api_base = "scripted:" calls the built-in scripted condenser, no key)')
        print()
        sys.stdout.write(item.view.text)
        if report is not None:
            _print_outcome(report)
    return 1 if report is not None and report.failure and not report.answered else 0


async def _condense(config: Config, settings: CondenseConfig, path: Path, result: ToolResult,
                    context: TaskContext) -> RoundReport:
    """One condenser round over ``result`` with ``[supervisor.model]``; ``api_base = "scripted:"`` is answered by
    an embedded scripted upstream served on a free loopback port until the round ends.

    Raises:
        ConfigError: the litellm route without a name.
    """
    model = config.supervisor.model
    async with trio.open_nursery() as nursery:
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
    if decision.text is None:
        print(f"condenser: the result stays unchanged ({report.failure or decision.reason})")
        return
    print(f"condenser: {decision.reason}, {decision.tokens_before:,} -> {decision.tokens_after:,} tokens, "
          f"{decision.kept_lines:,} of {decision.total_lines:,} lines kept\n")
    sys.stdout.flush()
    sys.stdout.buffer.write(decision.text.encode("utf-8", "surrogateescape"))
    sys.stdout.buffer.flush()
