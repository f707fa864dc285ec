"""Condensing the tool results of a supervised request: the proxy side of :mod:`proxyvisor.condense`.

Two steps per request, around the supervisor's other edits (``proxyvisor.proxy.supervise``):

1. :meth:`RequestCondenser.collect` (before proxyvisor adds anything to the body) reads the agent's own history,
   in any format, through ``WireFormat.history`` and ``WireFormat.message``: the tool results of the **latest
   round** (those after the last assistant item: the ones the agent sends for the first time), the earlier ones,
   and the trusted task context (system prompt, first and latest user messages, the assistant text sent with the
   latest tool calls).
2. :meth:`RequestCondenser.apply` (before forwarding) runs one condense round for the latest results (at most one
   condenser call, only for results without a decision yet), recalls the decisions made for the earlier ones on
   the requests where they were latest (never deciding anew, so a result that went upstream whole stays whole,
   and a narrowed one gets the identical bytes on every later request), and writes the narrowed texts into the
   upstream body with ``WireFormat.replace_tool_results``: only the text of those results changes, so no tool
   call is separated from its result and nothing is reordered. The agent's own copy is never touched.

What is left alone, failing open: results holding anything besides text (images, documents, JSON blocks), results
whose call id is missing or shared by several results, and every result of an agent that cannot read a spill file
back (:func:`can_read_back`). A condenser that fails or times out leaves the round whole (logged by the engine).
"""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import wirejson
from ..condense.baseline import command_key, passed
from ..condense.protocol import TaskContext
from ..condense.text import split_lines, tokens_may_exceed
from ..adapters.state import DiskBackend, StateBackend
from .condense_decisions import Decision, DecisionCache
from .condense_engine import MIN_THRESHOLD, CondenseEngine, ToolResult
from .spill import SpillStore
from ..supervisor_model import ModelAnswer, ModelCall
from ..config import SupervisorConfig
from .formats import ToolSpec, WireFormat
from .formats.base import derived
from .formats.freeform import SHELL_TOOLS, runs_commands, split
from ..transcript import Message, ToolOutput, ToolUse, harness_context

log = logging.getLogger("proxyvisor.condense")

READ_TOOLS = frozenset({"read", "read_file", "readfile", "view", "view_file", "open", "open_file", "cat",
                        "read_many_files", "extract_lines", "text_editor", "str_replace_editor",
                        "str_replace_based_edit_tool"})
"""Tool names (compared in lower case) that read a file: Claude Code ``Read``, opencode ``read``, Gemini CLI
``read_file``, OpenHands' and SWE-agent's editors (``view``), seed 003's ``view``/``text_editor``/``extract_lines``."""


def can_read_back(tools: Sequence[ToolSpec]) -> bool:
    """Whether an agent offering ``tools`` can read a spill file back, so a result may be condensed.

    The rule (seed 003 asks for a local file-reading tool): a tool named as in :data:`READ_TOOLS` or
    :data:`~.formats.freeform.SHELL_TOOLS` (which read a file with ``sed -n 'A,Bp' PATH``), ignoring case and
    namespace, any tool taking a free-form ``command`` or ``cmd`` argument (a string or a list of strings without
    an ``enum``), which is how shell tools under other names look, or a freeform tool that runs commands
    (:func:`~.formats.freeform.runs_commands`: Codex's ``exec`` script tool). The spill file is
    on the proxy's machine, so this assumes the agent runs there too (proxyvisor listens on loopback by default);
    turn ``[supervisor.condense] enabled`` off for an agent that does not.
    """
    for tool in tools:
        name = split(tool.name)[1].lower()
        if name in READ_TOOLS or name in SHELL_TOOLS or runs_commands(tool):
            return True
        properties = tool.schema.get("properties") if isinstance(tool.schema, dict) else None
        for key in ("command", "cmd"):
            spec = properties.get(key) if isinstance(properties, dict) else None
            if isinstance(spec, dict) and "enum" not in spec and spec.get("type") in ("string", "array"):
                return True
    return False


@dataclass(frozen=True)
class Pending:
    """What :meth:`RequestCondenser.collect` found: the ``latest`` round's results, the ``earlier`` ones, and the
    ``context`` for the condenser."""

    latest: list[ToolResult]
    earlier: list[ToolResult]
    context: TaskContext


@dataclass(frozen=True)
class Condensed:
    """The decision for one result of the latest round (made now, ``new``, or on an earlier request): its
    ``call_id``, ``tool`` name and :class:`~proxyvisor.condense.Decision`."""

    call_id: str
    tool: str
    decision: Decision
    new: bool = False


@dataclass
class CondenseRecord:
    """What condensing did for one request: ``round``, the decisions for the latest round's results (each result
    above the threshold; ``decision.text`` None when it stays whole); ``new``, how many were made on this request;
    ``condenser_called`` and its ``answer`` (for its usage); ``failure``, why the round gave nothing (empty when
    it did); ``applied``, the narrowed
    results in the upstream body (this round's and earlier ones); ``saved_tokens``, the tokens they saved in it."""

    round: list[Condensed] = field(default_factory=list)
    new: int = 0
    condenser_called: bool = False
    answer: ModelAnswer | None = None
    failure: str = ""
    applied: int = 0
    saved_tokens: int = 0


class RequestCondenser:
    """The request side of condensing for every session of a proxy, over one :class:`CondenseEngine`."""

    def __init__(self, engine: CondenseEngine) -> None:
        self.engine = engine

    def collect(self, fmt: WireFormat, items: list[Any], tools: Sequence[ToolSpec],
                parts: tuple[str, str]) -> Pending | None:
        """Read a request in ``fmt`` as the agent sent it, from what the supervisor already read of it: its history
        ``items`` (``WireFormat.history``), ``tools`` (``WireFormat.tools``) and (system prompt, first user
        message) ``parts`` (``WireFormat.fingerprint_parts``). None when there is nothing to do: condensing is
        off, the agent cannot read a spill back, or no result is large enough to have a decision."""
        if not self.engine.active or not can_read_back(tools):
            return None
        seen = _scanned(fmt, items)
        # The latest round's results are those after the last assistant item: the scan's results from ``split`` on.
        split = len(seen.results)
        while split and seen.results[split - 1][0] > seen.last:
            split -= 1
        latest = [dataclasses.replace(result, green=_green(result, seen, position))
                  for _index, position, out, use, read in seen.results[split:]
                  if (result := _usable(seen, out, use, read)) is not None]
        if seen.repeated:
            earlier = [result for _index, _position, out, use, read in seen.results[:split]
                       if (result := _usable(seen, out, use, read)) is not None]
        else:  # every result stands as it was read (:func:`_usable`): one slice, not a pass over the history
            earlier = seen.found[:split]
        if not latest and not earlier:
            return None
        return Pending(latest, earlier, _context(parts, _Messages(fmt, items), seen.last, seen.request))

    async def apply(self, session: str, fmt: WireFormat, body: dict[str, Any], pending: Pending,
                    condenser: ModelCall | None) -> CondenseRecord:
        """Condense the latest round of ``pending`` for ``session`` with ``condenser`` (the request's supervisor
        model call; None: the deterministic condenser alone), recall the earlier decisions, and put every narrowed text into ``body`` (the upstream body,
        in place). Returns what was done. Never raises for a
        condenser, cache or spill problem (the results concerned stay whole, logged); cancellation propagates
        with ``body`` untouched."""
        record = CondenseRecord()
        try:
            report = await self.engine.run_round(session, pending.latest, pending.context, condenser)
            earlier = await self.engine.recall(session, pending.earlier)
        except Exception as exc:  # noqa: BLE001 - condensing must never cost the agent its request
            log.exception("condensing failed for session %s; its tool results go upstream whole", session)
            record.failure = f"{type(exc).__name__}: {exc}"
            return record
        record.round = [Condensed(r.call_id, r.tool, report.decisions[r.call_id], r.call_id in report.fresh)
                        for r in pending.latest if r.call_id in report.decisions]
        record.new, record.condenser_called, record.failure = report.new, report.condenser_called, report.failure
        record.answer = report.answer
        decisions = {**earlier, **report.decisions}
        texts = {call_id: d.text for call_id, d in decisions.items() if d.text is not None}
        if texts:
            done = fmt.replace_tool_results(body, texts)
            record.applied = len(done)
            record.saved_tokens = sum(decisions[c].tokens_before - decisions[c].tokens_after for c in done)
        return record


class _Messages(Sequence[Message]):
    """The messages of history ``items``, read as they are asked for (the context reads a few from the end)."""

    def __init__(self, fmt: WireFormat, items: list[Any]) -> None:
        self.fmt, self.items = fmt, items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return [self.fmt.message(item) for item in self.items[index]]
        return self.fmt.message(self.items[index])


@dataclass
class _Scan:
    """What collecting reads from a history up to ``index`` (exclusive): the position of the last assistant item,
    the latest user text (``request``), the tool calls by id, how many results each call id has, and the results
    that may be large enough for a decision (position, place in ``runs``, output, the call it answered when read,
    its :class:`ToolResult`)."""

    index: int
    last: int = -1
    request: str = ""
    uses: dict[str, ToolUse] = field(default_factory=dict)
    ids: Counter[str] = field(default_factory=Counter)
    runs: list[tuple[str, str, bool]] = field(default_factory=list)
    """Every plain-text output in order: (call id, text, is_error), for the last green run of a command."""
    commands: dict[str, list[int]] = field(default_factory=dict)
    """The places in ``runs`` of each command's outputs (``command_key`` of the call's arguments)."""
    repeated: bool = False
    """A call id was used twice (two calls, two results, a call after its result): ``commands`` may then pair an
    output with the wrong call, and the runs are read one by one instead."""
    results: list[tuple[int, int, ToolOutput, ToolUse | None, ToolResult]] = field(default_factory=list)
    found: list[ToolResult] = field(default_factory=list)
    """The :class:`ToolResult` of each of :attr:`results`, in the same order (the earlier ones are one slice)."""


def _usable(scan: _Scan, out: ToolOutput, use: ToolUse | None, result: ToolResult) -> ToolResult | None:
    """The result to condense for ``out`` (read as ``result``, answering ``use``) given the whole history of
    ``scan``: None when its call id has several results, named after a call of its id that came after it. Both
    cases set :attr:`_Scan.repeated`: without it, ``result`` itself."""
    if scan.ids[out.call_id] > 1:
        return None
    if scan.uses.get(out.call_id) is not use:  # a call of that id came after the result: name it after that
        return _result(out, scan.uses.get(out.call_id))
    return result


def _scanned(fmt: WireFormat, items: list[Any]) -> _Scan:
    """:class:`_Scan` of ``items``, going on from the scan kept on the last item an earlier request of the same
    body lineage had (:class:`~.formats.base.Item`), so a request reads only its new items.

    The kept scan goes on in place (copying it cost as much as reading the history): the items it was kept on
    before no longer match it (its :attr:`~_Scan.index` moves on, and is -1 while it is read), so a request that
    branches off at one of them reads its history again, whole."""
    start, done = len(items), None
    while start:
        kept = derived(items[start - 1])
        found = kept.get("scan") if kept is not None else None
        if isinstance(found, _Scan) and found.index == start:
            done = found
            break
        start -= 1
    scan = done if done is not None else _Scan(0)
    scan.index = -1  # an exception below leaves no scan that claims items it holds only part of
    for index in range(start, len(items)):
        message = fmt.message(items[index])
        if message.role == "assistant":
            scan.last = index
        elif message.role == "user" and message.text and not harness_context(message.text):
            scan.request = message.text
        for use in message.tool_uses:
            scan.repeated = scan.repeated or use.id in scan.uses or use.id in scan.ids  # a call after its result
            scan.uses[use.id] = use
        for out in message.tool_outputs:
            scan.ids[out.call_id] += 1
            scan.repeated = scan.repeated or scan.ids[out.call_id] > 1
            if out.structured or not out.call_id:
                continue
            scan.runs.append((out.call_id, out.text, out.is_error is True))
            called = scan.uses.get(out.call_id)
            if called is not None and (key := command_key(_arguments(called.arguments))):
                scan.commands.setdefault(key, []).append(len(scan.runs) - 1)
            # A short text has no decision to find.
            if tokens_may_exceed(out.text, MIN_THRESHOLD):
                result = _result(out, called)
                scan.results.append((index, len(scan.runs) - 1, out, called, result))
                scan.found.append(result)
    scan.index = len(items)
    if items and (kept := derived(items[-1])) is not None:
        kept["scan"] = scan
    return scan


def _result(out: ToolOutput, use: ToolUse | None) -> ToolResult:
    return ToolResult(out.call_id, use.name if use and use.name else "tool", out.text, out.is_error is True,
                      _arguments(use.arguments) if use else "")


def request_condenser(settings: SupervisorConfig, state_dir: Path | None,
                      backend: StateBackend | None = None) -> RequestCondenser | None:
    """The request condenser of a proxy (the condenser is each request's supervisor model): spill files in
    ``{state_dir}/spill``, decisions in ``backend``'s ``condense`` namespace (by default a diskcache in
    ``{state_dir}/condense``). None (condensing off) without a state directory (nothing may be written) or with
    ``[supervisor.condense] enabled = false``."""
    if state_dir is None or not settings.condense.enabled:
        return None
    backend = backend or DiskBackend(state_dir)
    cache = DecisionCache(backend.kv(DecisionCache.NAMESPACE, **DecisionCache.SETTINGS))
    engine = CondenseEngine(settings.condense, None, spill=SpillStore(state_dir / "spill"), cache=cache,
                            model_name=settings.model.name)
    return RequestCondenser(engine)


def _green(result: ToolResult, scan: _Scan, position: int) -> tuple[str, str] | None:
    """The last green run of ``result``'s command (same key, ``proxyvisor.condense.baseline``) among the outputs
    before ``position`` in ``scan.runs``, as (call id, output); None when its call ran no command or no such run
    passed."""
    key = command_key(result.arguments)
    if not key:
        return None
    if scan.repeated:
        places: Iterable[int] = (i for i in range(position - 1, -1, -1) if (use := scan.uses.get(scan.runs[i][0]))
                                 is not None and command_key(_arguments(use.arguments)) == key)
    else:
        places = (i for i in reversed(scan.commands.get(key, ())) if i < position)
    for i in places:
        call_id, text, is_error = scan.runs[i]
        if passed(split_lines(text[-65_536:]), is_error):
            return call_id, text
    return None


def _arguments(arguments: dict[str, Any]) -> str:
    if set(arguments) == {"raw"} and isinstance(arguments["raw"], str):
        return arguments["raw"]  # not JSON: kept as the model wrote it (formats.base.args_of)
    return wirejson.dumps(arguments).decode()


def _context(parts: tuple[str, str], messages: Sequence[Message], last: int, request: str) -> TaskContext:
    """The trusted task context: the system prompt, the first user message as the goal, the latest user message
    with text (``request``) as the current request (when it is not the first), and, as the round's intent, the
    text of the assistant turn that made the latest tool calls (a turn spans several items in the Responses
    format)."""
    system, goal = parts
    intent: list[str] = []
    index = last
    while index >= 0 and messages[index].role in ("assistant", "other"):
        if messages[index].text:
            intent.append(messages[index].text)
        index -= 1
    return TaskContext(agent_context=system, goal=goal, request="" if request == goal else request,
                       intent="\n".join(reversed(intent)))
