"""``proxyvisor replay``: drive a recorded agent trajectory through the running pipeline.

A trajectory is JSON lines, one Chat Completions message per line (the corpus format,
``../shared/corpus/trajectories/INDEX.md``). For each assistant message, the history before it is sent to the
proxy exactly as the agent sent it (growing history, in the chosen wire format), and the scripted upstream
answers with the recorded assistant turn. Each assistant message is one **round**. The replay checks that the
turn the agent got back equals the recorded one (text and tool calls), so a pipeline that drops or mangles a
response shows up as a failed round.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import trio

from .adapters.scripted import ScriptedUpstream
from .supervisor_model import ModelCall, with_condense
from .config import Config, ConfigError
from .detectors.selfreport import strip
from .proxy.formats import BY_NAME, AssistantTurn, ToolSpec, WireFormat
from .proxy.formats.base import args_of, chat_text
from .proxy.service import running
from .proxy.sse import SSEParser
from .store import Store

MODEL = "replay-model"


class TrajectoryError(ValueError):
    """The trajectory file cannot be read or a line is not a chat message; the message names the line."""


def load_trajectory(path: str | Path) -> list[dict[str, Any]]:
    """The messages of a trajectory file. Raises TrajectoryError (unreadable file, bad JSON, not a message)."""
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
                 on_round: Callable[[Round], None] | None = None, model: ModelCall | None = None) -> list[Round]:
    """Replay ``messages`` through a proxy running ``config`` with a scripted upstream; returns the rounds.
    ``model`` replaces the one ``[supervisor.model]`` describes (see ``proxyvisor.proxy.service.running``).

    The first upstream must be scripted (it plays the recorded turns). Raises ConfigError otherwise.
    """
    upstream, _native = config.upstream_for(fmt.name)
    if not upstream.scripted:
        raise ConfigError(f"replay needs a scripted upstream for {fmt.label}; [upstreams.{upstream.name}] is "
                          f"{upstream.url}")
    scripted = ScriptedUpstream(record=False)
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
                   condense: bool = False) -> int:
    """The CLI entry: prints the timeline; exit 0 when every round came back intact, 1 otherwise, 2 on a bad
    file. ``condense`` turns condensing on (``proxyvisor.supervisor_model.with_condense``)."""
    try:
        messages = load_trajectory(path)
    except TrajectoryError as exc:
        print(f"proxyvisor: {exc}", file=sys.stderr)
        return 2
    session = "replay-" + hashlib.sha256(str(Path(path).resolve()).encode()).hexdigest()[:16]
    if condense:
        config = with_condense(config)

    def show(r: Round) -> None:
        print(json.dumps(asdict(r)) if as_json else format_round(r), flush=True)

    if not as_json:
        print(f"replaying {path}: {len(messages)} messages as {BY_NAME[format_name].label}"
              f"{' (streaming)' if stream else ''}")
    rounds = trio.run(lambda: replay(config, messages, BY_NAME[format_name], stream, session, on_round=show))
    bad = [r for r in rounds if not r.matches]
    if not as_json:
        saved = sum(r.condense_saved_tokens for r in rounds)
        print(f"{len(rounds)} rounds, {sum(len(r.tool_calls) for r in rounds)} tool calls, {len(bad)} failed"
              + (f"; condensed {sum(1 for r in rounds for c in r.condensed if c['spill_path'])} tool result(s), "
                 f"{saved:,} input tokens saved over all requests" if condense else ""))
    return 1 if bad else 0
