"""``proxyvisor replay``: drive a recorded agent trajectory through the running pipeline.

A trajectory is JSON lines, one Chat Completions message per line (the corpus format,
``../shared/corpus/trajectories/INDEX.md``). For each assistant message, the history before it is sent to the
proxy exactly as the agent sent it (growing history, in the chosen wire format), and the scripted upstream
answers with the recorded assistant turn. Each assistant message is one **round**. The replay checks that the
turn the agent got back equals the recorded one (text and tool calls), so a pipeline that drops or mangles a
response shows up as a failed round.
"""

from __future__ import annotations

import copy
import hashlib
import json
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import trio
from msgspec.structs import replace

from .scripted.upstream import ScriptedUpstream
from .supervisor_model import ModelCall, with_condense
from .config import Config, ConfigError
from .detectors.selfreport import strip
from .proxy.formats import BY_NAME, AssistantTurn, ToolSpec, WireFormat
from .proxy.formats.base import args_of, chat_text
from .proxy.info import plural
from .proxy.service import running
from .proxy.sse import SSEParser
from .store import Store

MODEL = "replay-model"


class TrajectoryError(ValueError):
    """The trajectory file cannot be read or a line is not a chat message; the message names the line."""


def load_trajectory(path: str | Path) -> list[dict[str, Any]]:
    """The messages of a trajectory file. Raises TrajectoryError (unreadable file, bad JSON, not a message, no
    message at all)."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise TrajectoryError(f"{path}: cannot read: {exc}") from None
    messages = []
    for number, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            message = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TrajectoryError(f"{path}:{number + 1}: not JSON: {exc}") from None
        if not isinstance(message, dict) or message.get("role") not in ("system", "user", "assistant", "tool"):
            raise TrajectoryError(f"{path}:{number + 1}: not a chat message (needs a role: system, user, "
                                  "assistant or tool)")
        calls = message.get("tool_calls")
        if calls is not None and not (isinstance(calls, list) and all(
                isinstance(c, dict) and isinstance(c.get("function"), dict)
                and isinstance(c["function"].get("name"), str) for c in calls)):
            raise TrajectoryError(f"{path}:{number + 1}: tool_calls must be a list of "
                                  '{"id", "type": "function", "function": {"name", "arguments"}} objects')
        messages.append(message)
    if not messages:
        raise TrajectoryError(f"{path} holds no messages")
    return messages


def recorded_turn(message: dict[str, Any]) -> AssistantTurn:
    """The recorded assistant message as a turn (what the scripted upstream must answer)."""
    from .proxy.formats import ToolCall

    calls = tuple(ToolCall(c["function"]["name"], args_of(c["function"].get("arguments")), c.get("id", ""))
                  for c in message.get("tool_calls") or ())
    return AssistantTurn(chat_text(message.get("content")), calls)


def _step(turn: AssistantTurn) -> dict[str, Any]:
    step: dict[str, Any] = {"text": turn.text}
    if turn.tool_calls:
        step["tool_calls"] = [{"name": c.name, "arguments": c.arguments, "id": c.id} for c in turn.tool_calls]
    return step


def tools_of(messages: list[dict[str, Any]]) -> tuple[ToolSpec, ...]:
    """The tools a trajectory used, offered with an open schema (trajectories do not record tool definitions)."""
    names = dict.fromkeys(c["function"]["name"] for m in messages for c in m.get("tool_calls") or ())
    return tuple(ToolSpec(n, {"type": "object"}) for n in names)


def as_final_answer(messages: list[dict[str, Any]], index: int) -> list[dict[str, Any]]:
    """``messages`` up to the assistant message at ``index``, a harness's submit action made as a tool call
    (mini-swe-agent's ``echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT``, SWE-agent's ``submit``), presented as the
    agent's final answer without tool calls, the way a chat agent says "done" (what a proxy sees as the end of a
    turn): its recorded text, or, when it has none, the submit command as text. What came after it (the submit's
    output) is left out. Raises TrajectoryError when ``index`` is not an assistant message."""
    if not 0 <= index < len(messages) or messages[index].get("role") != "assistant":
        raise TrajectoryError(f"line {index + 1} is not an assistant message")
    message = messages[index]
    commands = []
    for call in message.get("tool_calls") or ():
        args = args_of(call["function"].get("arguments"))
        commands.append(args["command"] if isinstance(args.get("command"), str) else json.dumps(args))
    text = chat_text(message.get("content")) or "\n".join(commands)
    return messages[:index] + [{"role": "assistant", "content": text}]


@dataclass
class Round:
    """One replayed assistant turn: its number (1-based), the 0-based line of the assistant message, the tool
    calls (``name: argument summary``), the HTTP status, latency and proxy overhead (ms), and whether the agent
    got back exactly the recorded turn.

    With supervision on, also what the supervisor did for this request: ``report``, the state of the reply's
    self-report when it had a valid one; ``detectors``, the signals that fired in the rounds this request's
    history completed, as ``signal@position`` (the history position where the round starts: the trajectory's
    line number in the chat format, the item number of the format's own history otherwise); ``steer``, the
    signal whose advisory note was added to this request, and ``steer_note`` its text.

    With condense on: ``condensed``, the decision for each result of the round's tool calls that was large enough
    to be a candidate (``call_id``, ``tool``, ``reason``: ``condensed``, ``replaced`` or why it stays whole,
    ``tokens_before``, ``tokens_after``, ``kept_lines``, ``total_lines``, ``spill_path``); ``condense_new``, how many
    of those were decided on this request (the others come from the decision cache); ``condense_saved_tokens``,
    the tokens the narrowed results (this round's and earlier ones, re-applied) saved in this request; and
    ``condense_failure``, why the condenser gave nothing, if it did not.

    With the gate on: ``gate``, the verify-gate's record of this request as the ledger line holds it
    (``proxyvisor.proxy.gating``: ``verdicts``, ``outcome``, ``passed``, ``reason``, ``gaps``, ``digest_tokens``,
    ``decided_by``, ...), None when the gate did not run on it.
    """

    number: int
    message: int
    tool_calls: list[str]
    status: int
    latency_ms: float
    overhead_ms: float
    matches: bool
    error: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    report: str | None = None
    detectors: list[str] = field(default_factory=list)
    steer: str | None = None
    steer_note: str | None = None
    condensed: list[dict[str, Any]] = field(default_factory=list)
    condense_new: int = 0
    condense_saved_tokens: int = 0
    condense_failure: str | None = None
    gate: dict[str, Any] | None = None


def _summary(name: str, args: dict[str, Any], width: int = 70) -> str:
    value = next((args[k] for k in ("command", "cmd", "file_path", "path", "pattern") if k in args), None)
    text = value if isinstance(value, str) else json.dumps(args, ensure_ascii=False)
    text = " ".join(text.split())
    return f"{name}: {text[:width] + '…' if len(text) > width else text}"


async def send_turn(client: httpx.AsyncClient, url: str, fmt: WireFormat, body: dict[str, Any],
                    stream: bool) -> tuple[int, AssistantTurn | None, str | None, float]:
    """POST ``body`` to ``url`` in ``fmt``, as an agent does; returns (the HTTP status, the assistant turn or None
    on an error status, the error body or None, the proxy's overhead in ms from its header)."""
    async with client.stream("POST", url + fmt.path, json=body) as response:
        overhead = float(response.headers.get("x-proxyvisor-overhead-ms", "nan"))
        data = await response.aread()
        if response.status_code != 200:
            return response.status_code, None, data.decode("utf-8", "replace"), overhead
        if not stream:
            return 200, fmt.parse_response(json.loads(data)), None, overhead
        parser = SSEParser()
        events = [(e.event, e.data) for e in parser.feed(data)]
        return 200, fmt.assemble(events), None, overhead


async def replay(config: Config, messages: list[dict[str, Any]], fmt: WireFormat, stream: bool = False,
                 session: str = "replay", store: Store | None = None,
                 on_round: Callable[[Round], None] | None = None, model: ModelCall | None = None,
                 gate: bool = False, scripted: ScriptedUpstream | None = None) -> list[Round]:
    """Replay ``messages`` through a proxy running ``config`` with a scripted upstream; returns the rounds.
    ``model`` replaces the supervisor model ``[supervisor.model]`` describes (see
    ``proxyvisor.proxy.service.running``; by default the session's route: the scripted upstream's fixed policies).
    ``gate``: the verify-gate runs as ``[supervisor.gate]`` says (off: every recorded turn goes through unjudged).
    ``scripted``: the scripted upstream that plays the turns, to read what it received (by default a new one that
    records nothing).

    The first upstream must be scripted (it plays the recorded turns). Raises ConfigError otherwise.
    """
    upstream, _native = config.upstream_for(fmt.name)
    if not upstream.scripted:
        raise ConfigError(f"replay needs a scripted upstream for {fmt.label}; [upstreams.{upstream.name}] is "
                          f"{upstream.url}")
    if not gate:
        config = config.with_overrides(supervisor={"gate": replace(config.supervisor.gate, enabled=False)})
    scripted = scripted or ScriptedUpstream(record=False)
    tools = tools_of(messages)
    rounds: list[Round] = []
    async with running(config, port=0, store=store, scripted={upstream.name: scripted},
                       model=model) as proxy:
        url = f"{proxy.url}/s/{session}"
        async with httpx.AsyncClient(timeout=120) as client:
            for index, message in enumerate(messages):
                if message.get("role") != "assistant":
                    continue
                expected = recorded_turn(message)
                scripted.queue(_step(expected))
                body = fmt.request_from_chat(messages[:index], MODEL, stream, tools)
                started = time.perf_counter()
                status, got, failure, overhead = await send_turn(client, url, fmt, body, stream)
                failure = failure and failure[:300]
                latency = (time.perf_counter() - started) * 1000
                # With supervision on, the agent gets the text without the model's self-report token.
                wanted = strip(expected.text)[0] if config.supervisor.enabled else expected.text
                matches = got is not None and got.text == wanted and [
                    (c.name, c.arguments, c.id) for c in got.tool_calls] == [
                    (c.name, c.arguments, c.id) for c in expected.tool_calls]
                if got is not None and not matches and failure is None:
                    failure = "the agent got a different turn than the recorded one"
                result = Round(len(rounds) + 1, index, [_summary(c.name, c.arguments) for c in expected.tool_calls],
                               status, round(latency, 3), overhead, matches, failure)
                _supervision(result, proxy.pipeline.sessions.get(session))
                rounds.append(result)
                if on_round:
                    on_round(result)
    return rounds


def _supervision(result: Round, session: Any) -> None:
    """Copy what the supervisor recorded for the request just sent into ``result`` (nothing when unsupervised)."""
    state = getattr(session, "supervision", None)
    if state is None or not state.records:
        return
    record = state.records[-1]
    if record.report is not None and record.report.report is not None:
        result.report = record.report.report.state
    result.detectors = [f"{signal}@{index}" for index, signals in record.firings for signal in signals]
    if record.note is not None:
        from .detectors.steer import note_text

        result.steer, result.steer_note = record.note, note_text(record.note)
    if record.condense is not None:
        done = record.condense
        result.condensed = [{"call_id": c.call_id, "tool": c.tool, **{k: v for k, v in asdict(c.decision).items()
                                                                        if k != "text"}} for c in done.round]
        result.condense_new, result.condense_saved_tokens = done.new, done.saved_tokens
        result.condense_failure = done.failure or None
    if record.gate is not None:
        result.gate = copy.deepcopy(record.gate)


NO_VERDICT = "no verdict"
"""The final label of a gated replay whose last stop the gate gave no outcome (no stop; the gate did not run)."""


def gate_config(config: Config) -> Config:
    """``config`` as a gated replay runs it: supervision and the verify-gate on, with the supervisor model
    ``[supervisor.model]`` describes (by default the session's route, here the embedded scripted upstream, which
    answers with its fixed verifier policy, no key, no network), a re-entry budget of 0 and ``headless`` off:
    a replay cannot play the rework a re-entry or a nudge asks for, so each stop ends at the gate's first
    judgment (a stop with standing gaps ends ``unverified``, with them). No unverified notice: the replay prints
    the label itself and compares each delivered answer with the recorded one."""
    gate = replace(config.supervisor.gate, enabled=True, reentry_budget=0, headless=False, unverified_notice="")
    return config.with_overrides(supervisor={"enabled": True, "gate": gate})


def to_the_end(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` ending at the run's last assistant message, presented as its final answer when it calls
    tools (a harness's submit action, or the last action of a run cut short: :func:`as_final_answer`), so a gated
    replay judges how the run ended. Unchanged when that message is a text answer or there is none."""
    last = max((i for i, m in enumerate(messages) if m.get("role") == "assistant"), default=None)
    if last is None or not messages[last].get("tool_calls"):
        return messages
    return as_final_answer(messages, last)


async def replay_gated(config: Config, messages: list[dict[str, Any]], fmt: WireFormat, stream: bool = False,
                       session: str = "replay", store: Store | None = None,
                       on_round: Callable[[Round], None] | None = None,
                       model: ModelCall | None = None) -> list[Round]:
    """:func:`replay` of :func:`to_the_end` of ``messages`` under :func:`gate_config` of ``config``: each round's
    ``gate`` is the gate's ledger record. ``model`` replaces the supervisor model (as for :func:`replay`). Raises
    ConfigError as :func:`replay` does."""
    return await replay(gate_config(config), to_the_end(messages), fmt, stream, session, store, on_round, model,
                        gate=True)


@dataclass
class GateStop:
    """What the verify-gate did at one stop of a gated replay (a round whose recorded reply has no tool calls),
    as the request's ledger record says (``proxyvisor.proxy.gating``; nothing is re-derived here).

    ``round``, ``message``: the round number and the trajectory line (0-based) of the reply; ``gated``: the gate
    ran on the stop (the request offered tools); ``decided_by``: what settled it (the record's last pass),
    ``evidence`` (free evidence, no model call) or ``model`` (a verifier call; assumed when the record has
    verdicts but no ``decided_by``), None
    when the gate did not run; ``outcome`` (``verified``, ``unknown``, ``failed``, ``unverified``), ``passed``,
    ``reason``, ``gaps`` (standing gaps, verbatim), ``verdicts`` (each verifier pass), ``digest_tokens`` (the
    verifier input's size in cl100k tokens; None when no digest was built), and ``route`` and ``model``, the
    supervisor route and model a verifier call went to (``session``: the session's own upstream; None when no
    call was made)."""

    round: int
    message: int
    gated: bool
    decided_by: str | None
    outcome: str | None
    passed: bool | None
    reason: str | None
    gaps: list[str]
    verdicts: list[str]
    digest_tokens: int | None
    route: str | None = None
    model: str | None = None


def gate_stop(r: Round) -> GateStop:
    """The :class:`GateStop` of the stop ``r`` (its ``gate`` record, or none)."""
    g = r.gate or {}
    verdicts = [v for v in g.get("verdicts") or () if isinstance(v, str)]
    by = g.get("decided_by")
    by = by[-1] if isinstance(by, list) and by else by  # one entry per pass: the last pass settled the stop
    decided = by if isinstance(by, str) else "model" if verdicts else None
    tokens = g.get("digest_tokens")
    return GateStop(r.number, r.message, r.gate is not None, decided, g.get("outcome"), g.get("passed"),
                    g.get("reason"), [str(x) for x in g.get("gaps") or ()], verdicts,
                    tokens if isinstance(tokens, int) else None,
                    *(g.get(k) if isinstance(g.get(k), str) else None for k in ("route", "model")))


def gate_stops(rounds: list[Round]) -> list[GateStop]:
    """The stops of ``rounds`` (rounds without recorded tool calls), in order."""
    return [gate_stop(r) for r in rounds if not r.tool_calls]


def final_label(stops: list[GateStop]) -> str:
    """The outcome at the last stop, or :data:`NO_VERDICT` when there is none or it has none."""
    return stops[-1].outcome or NO_VERDICT if stops else NO_VERDICT


def format_stop(stop: GateStop) -> str:
    """The gate's lines under a stop's round in the timeline (indented)."""
    if not stop.gated:
        return "        gate: not run (the request offered no tools, or the reply was not gated)"
    parts = [f"decided by {stop.decided_by or '-'}", f"{stop.outcome or 'no outcome'}"
             + ("" if stop.passed is None else " (passed)" if stop.passed else " (not passed)")]
    parts.append(f"digest {stop.digest_tokens:,} tokens" if stop.digest_tokens is not None
                 else "no digest (no verifier call)")
    if stop.verdicts:
        parts.append("passes: " + ", ".join(stop.verdicts))
    if stop.route:
        parts.append(f"verifier: {stop.route} route, model {stop.model or '?'}")
    lines = ["        gate: " + " · ".join(parts)]
    if stop.reason:
        lines.append(f"        reason: {stop.reason}")
    lines += [f"        gap: {gap}" for gap in stop.gaps]
    return "\n".join(lines)


def gate_summary(stops: list[GateStop]) -> str:
    """One line: how many stops, how the gate decided them, the outcomes and the final label."""
    judged = [s for s in stops if s.gated]
    by: dict[str, int] = {}
    outcomes: dict[str, int] = {}
    for s in judged:
        by[s.decided_by or "-"] = by.get(s.decided_by or "-", 0) + 1
        outcomes[s.outcome or NO_VERDICT] = outcomes.get(s.outcome or NO_VERDICT, 0) + 1
    return (f"{len(stops)} stop(s), the gate judged {len(judged)}"
            + (" (" + ", ".join(f"{n} by {k}" for k, n in sorted(by.items())) + ")" if by else "")
            + ("; outcomes: " + ", ".join(f"{k} {n}" for k, n in sorted(outcomes.items())) if outcomes else "")
            + f"; final label: {final_label(stops)}")


def format_round(r: Round) -> str:
    calls = "; ".join(r.tool_calls) if r.tool_calls else "(no tool call: text only)"
    flag = "" if r.matches else f"  MISMATCH: {r.error}"
    notes = "".join(part for part in (f"  | state {r.report}" if r.report else "",
                                      f"  | fired {' '.join(r.detectors)}" if r.detectors else "",
                                      f"  | steer note: {r.steer}" if r.steer else "",
                                      *(f"  | {_condensed(c)}" for c in r.condensed),
                                      f"  | condense failed: {r.condense_failure}" if r.condense_failure else "",
                                      f"  | condense saved {r.condense_saved_tokens:,} tokens in this request"
                                      if r.condense_saved_tokens else ""))
    return f"round {r.number:4d}  msg {r.message:4d}  {r.status}  {r.latency_ms:7.1f} ms  {calls}{flag}{notes}"


def _condensed(c: dict[str, Any]) -> str:
    if c["reason"] not in ("condensed", "replaced"):
        return f"{c['tool']} {c['tokens_before']:,} tokens kept whole ({c['reason']})"
    return (f"{c['reason']} {c['tool']} {c['tokens_before']:,} -> {c['tokens_after']:,} tokens, {c['kept_lines']:,} "
            f"of {c['total_lines']:,} lines; full original in {c['spill_path']}")


def replay_command(config: Config, path: str, format_name: str, stream: bool, as_json: bool,
                   condense: bool = False, gate: bool = False, keep_state: bool = False) -> int:
    """The CLI entry: prints the timeline; exit 0 when every round came back intact, 1 otherwise, 2 on a bad
    file. ``condense`` turns condensing on (``proxyvisor.supervisor_model.with_condense``); ``gate`` replays with
    the verify-gate on (:func:`replay_gated`) and shows what it did at every stop (with ``as_json``, one JSON
    object per stop instead of per round). ``keep_state``: ledgers and spill files go to ``config``'s state
    directory (``--state-dir``); otherwise to a temporary one removed at the end, so a replay never shows up
    among the user's own sessions."""
    try:
        messages = load_trajectory(path)
    except TrajectoryError as exc:
        print(f"proxyvisor: {exc}", file=sys.stderr)
        return 2
    if keep_state:
        return _replay_command(config, path, messages, format_name, stream, as_json, condense, gate)
    with tempfile.TemporaryDirectory(prefix="proxyvisor-replay-") as state:
        return _replay_command(config.with_overrides(state={"dir": state}), path, messages, format_name, stream,
                               as_json, condense, gate)


def _replay_command(config: Config, path: str, messages: list[dict[str, Any]], format_name: str, stream: bool,
                    as_json: bool, condense: bool, gate: bool) -> int:
    session = "replay-" + hashlib.sha256(str(Path(path).resolve()).encode()).hexdigest()[:16]
    if condense:
        config = with_condense(config)
    fmt = BY_NAME[format_name]

    def show(r: Round) -> None:
        stop = gate_stop(r) if gate and not r.tool_calls else None
        if as_json:
            if not gate:
                print(json.dumps(asdict(r)), flush=True)
            elif stop is not None:
                print(json.dumps(asdict(stop)), flush=True)
            return
        print(format_round(r) + (f"\n{format_stop(stop)}" if stop is not None else ""), flush=True)

    if not as_json:
        print(f"replaying {path}: {plural(len(messages), 'message')} as {fmt.label}{' (streaming)' if stream else ''}"
              + (", verify-gate on" if gate else ""))
    if gate:
        rounds = trio.run(lambda: replay_gated(config, messages, fmt, stream, session, on_round=show))
    else:
        rounds = trio.run(lambda: replay(config, messages, fmt, stream, session, on_round=show))
    bad = [r for r in rounds if not r.matches]
    if not as_json:
        saved = sum(r.condense_saved_tokens for r in rounds)
        condensed = sum(1 for r in rounds for c in r.condensed if c['spill_path'])
        print(f"{plural(len(rounds), 'round')}, {plural(sum(len(r.tool_calls) for r in rounds), 'tool call')}, "
              f"{len(bad)} failed" + (f"; condensed {plural(condensed, 'tool result')}, "
                                      f"{plural(saved, 'input token')} saved over all requests" if condense else ""))
        if gate:
            print(gate_summary(gate_stops(rounds)))
    return 1 if bad else 0
