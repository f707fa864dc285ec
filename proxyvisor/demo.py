"""``proxyvisor demo``: a small example agent works through the proxy against the scripted upstream.

The agent is the simplest real one: it offers the model a ``bash`` tool, runs the command the model asks for
(in a scratch folder), sends the result back, and stops at the first answer without tool calls. It speaks each
wire format in turn, streaming, and the demo prints what passed through the proxy: every request, the model's
tool call, the tool result, the final answer, the proxy's overhead per request, and the session's ledger.

Then the same agent gets stuck: the scripted model keeps checking a build status that never changes, ending
each turn with its self-report. The demo shows the self-report the proxy read (and removed: the agent never
sees it), the loop detector firing on the third identical round, the steer note the proxy added to the next
request, and the model answering that note by handing back instead of polling on: it asks the user whether to
restart the build, so the verify-gate lets the hand-back through (the remaining work needs the user).

Last, the agent reads a test log of about 2,000 lines. The proxy condenses the model's copy of it (the agent's
own copy is untouched): the demo shows the tokens before and after, the spill file holding the full original,
and the narrowed text the model got, whose kept lines are the log's own. With no ``[supervisor.model]``
configured, the embedded scripted upstream is the condenser (``proxyvisor.scripted.condenser``).

Then the verify-gate (``proxyvisor.demo_gate``): asked to fix a bug, the model edits ``app.py`` and claims
"done" without running the tests; the gate holds that answer, the verifier finds the gap, the turn is continued
upstream with an advisory, the model runs the tests and its second "done" is verified. The agent never receives
the premature answer. Its ``/info`` is answered by proxyvisor itself, and the session's ledger shows the gate's
outcome per request. With no ``[supervisor.model]`` configured, the scripted upstream is the verifier
(``proxyvisor.scripted.verifier``).

Then delegation (``proxyvisor.demo_delegation``): the model hands review work to a child role, and a child's
rate limit cools its pool until the half-open probe brings it back. The closing table lists every request of
every session with the gate's label.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import orjson
import trio
from rich.console import Console, RenderableType
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from .adapters import litellm_bridge
from .config import Config
from .detectors.detectors import DESCRIPTIONS
from .detectors.steer import note_text
from .proxy.formats import BY_NAME, AssistantTurn, ToolSpec, WireFormat
from .proxy.service import running
from .replay import send_turn
from .rules import FORMATS
from .store import Store
from .supervisor_model import LITELLM, route_of

BASH = ToolSpec("bash", {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]})
TASK = "What files are in the project folder?"
SYSTEM = "You are a careful coding agent."


def opening(task: str) -> list[dict[str, Any]]:
    """The history an agent starts a turn with: its system prompt and ``task`` from the user."""
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task}]


def run_tool(command: str, cwd: Path) -> str:
    """Run the model's shell command in ``cwd`` (10 s limit) and return its combined output with the exit code.
    The Python running proxyvisor comes first on ``PATH``, so ``python`` works where only ``python3`` exists."""
    path = os.pathsep.join((str(Path(sys.executable).parent), os.environ.get("PATH", "")))
    try:
        done = subprocess.run(command, shell=True, cwd=cwd, capture_output=True, text=True, timeout=10,
                              env={**os.environ, "PATH": path, "PYTHONDONTWRITEBYTECODE": "1"})
    except subprocess.TimeoutExpired:
        return "command timed out after 10 s"
    return f"{done.stdout}{done.stderr}exit code {done.returncode}"


async def agent_turn(client: httpx.AsyncClient, url: str, fmt: WireFormat, messages: list[dict[str, Any]],
                     stream: bool = True) -> tuple[AssistantTurn, float, int]:
    """Send one request; returns (the assistant turn, the proxy's overhead in ms, the HTTP status)."""
    body = fmt.request_from_chat(messages, "scripted-model", stream, (BASH,))
    status, turn, failure, overhead = await send_turn(client, url, fmt, body, stream)
    return (turn if turn is not None else AssistantTurn(f"error {status}: {failure}")), overhead, status


async def run_agent(url: str, fmt: WireFormat, workdir: Path, console: Console, max_rounds: int = 4) -> None:
    messages = opening(TASK)
    console.print(f"[bold]{fmt.label}[/bold]  POST {fmt.path}  (streaming)")
    say(console, "[cyan]user[/cyan]", TASK)
    async with httpx.AsyncClient(timeout=30) as client:
        for _ in range(max_rounds):
            turn, overhead, status = await agent_turn(client, url, fmt, messages)
            note = f"[dim](proxy overhead {overhead:.2f} ms)[/dim]"
            if status != 200:
                say(console, "[red]error[/red]", f"{escape(turn.text)} {note}")
                return
            call_msgs = []
            for call in turn.tool_calls:
                say(console, "[magenta]model[/magenta]", f"calls {call_text(call)} {note}")
                output = run_tool(str(call.arguments.get("command", "")), workdir)
                say(console, "[green]agent[/green]", f"runs it: {output_text(output)}")
                call_msgs.append({"role": "tool", "tool_call_id": call.id, "content": output})
            messages.append(assistant_message(turn))
            messages += call_msgs
            if not turn.tool_calls:
                say(console, "[magenta]model[/magenta]", f"answers: {escape(turn.text)} {note}")
                return


TEXT_COLUMN = 13
"""Where a scene's text starts: two spaces, then the speaker's label (``user``, ``model``, ...) padded to 11."""


def say(console: Console, label: str | None, body: RenderableType, *, bar: bool = False) -> None:
    """Print one line of a scene: ``label`` (rich markup such as ``"[cyan]user[/cyan]"``; ``""`` goes on under
    the text column, ``None`` is a narrator's line two columns in), then ``body`` (rich markup, or any renderable)
    wrapped within the console width with a hanging indent: every wrapped line starts under the first.

    ``bar`` quotes the body behind a dim ``│``. Leading and trailing blank lines are dropped and runs of them
    kept as one (a rendered Markdown answer ends in blank lines). Lines are right-stripped, so nothing is printed
    past the text it holds."""
    column = 2 if label is None else TEXT_COLUMN
    head = Text.from_markup(f"  {label or ''}")
    head.truncate(column, pad=True)
    rest = Text(" " * column)
    if bar:
        head, rest = (part + Text("│ ", style="dim") for part in (head, rest))
    options = console.options.update(width=max(20, console.width - len(rest)))
    lines: list[Text] = []
    for segments in console.render_lines(Text.from_markup(body) if isinstance(body, str) else body, options,
                                         pad=False):
        text = Text.assemble(*((segment.text, segment.style or "") for segment in segments if not segment.control))
        text.rstrip()
        if text.plain or (lines and lines[-1].plain):
            lines.append(text)
    for number, text in enumerate(lines[:-1] if lines and not lines[-1].plain else lines):
        line = (rest if number else head) + text
        line.rstrip()
        console.print(line, no_wrap=True, overflow="ellipsis")


def call_text(call: Any) -> str:
    """A tool call as the scenes show it: ``name({arguments})``, as rich markup."""
    return escape(f"{call.name}({call.arguments})")


def output_text(output: str) -> str:
    """A short tool output on one line (``|`` between its lines), as rich markup."""
    return escape(output.strip().replace("\n", " | "))


LOOP_TASK = "Wait for the build described in build.status to finish, then tell me how it went."
LOOP_MARK = "repeated the same calls and got the same results"
"""A phrase of the loop note (without quotes, as the scripted upstream matches raw JSON): the scripted model
keeps polling until its input holds it."""
_REPORT = '<sup>{"state":"%s","focus":"%s","next":%s,"carry":[],"plan":null}</sup>'
LOOP_SCRIPT = [
    {"text": "The build is still running; let me check its status again.\n"
             + _REPORT % ("progressing", "wait for the build to finish", '"check build.status"'),
     "tool_calls": [{"name": "bash", "arguments": {"command": "cat build.status"}}], "until": LOOP_MARK},
    {"text": "build.status has not changed in three checks, so polling again will not help: the build looks "
             "stuck at 3 of 7 modules. I am handing this back rather than waiting on: should I restart it?\n"
             + _REPORT % ("blocked", "the build is stuck at 3 of 7 modules", "null")},
]


async def run_looping_agent(proxy: Any, fmt: WireFormat, workdir: Path, console: Console,
                            max_rounds: int = 8) -> None:
    """The stuck agent (module docstring): prints each round and what the supervisor made of it."""
    (workdir / "build.status").write_text("building: 3 of 7 modules compiled\n")
    proxy.scripted[next(iter(proxy.scripted))].queue(*LOOP_SCRIPT)
    session = f"demo-loop-{fmt.name}-{int(time.time())}"
    url = f"{proxy.url}/s/{session}"
    messages = opening(LOOP_TASK)
    console.print(f"[bold]An agent that loops[/bold]  ({fmt.label}, streaming)")
    say(console, "[cyan]user[/cyan]", LOOP_TASK)
    saw_token = False
    async with httpx.AsyncClient(timeout=30) as client:
        for number in range(1, max_rounds + 1):
            turn, _overhead, status = await agent_turn(client, url, fmt, messages)
            record = proxy.pipeline.sessions.get(session).supervision.records[-1]
            for _index, signals in record.firings:
                for signal in signals:
                    # This request carries the rounds so far, so the detector fired on the latest of them.
                    say(console, "[red]supervisor[/red]",
                        f"the {signal} detector fired on round {number - 1}: {DESCRIPTIONS[signal]}")
            if record.note:
                say(console, "[red]supervisor[/red]", "added a steer note to this request, after the latest tool "
                    f"result:\n[italic]{escape(note_text(record.note))}[/italic]")
            report = record.report.report if record.report is not None else None
            state = (f"  [dim](self-report, removed before the agent saw it: {escape(report.state)} · "
                     f"{escape(report.focus)})[/dim]") if report else ""
            saw_token = saw_token or "<sup>" in turn.text
            if status != 200:
                say(console, "[red]error[/red]", escape(turn.text))
                return
            if not turn.tool_calls:
                say(console, "[magenta]model[/magenta]", f"answers: {escape(turn.text.strip())}{state}")
                if record.gate and record.gate.get("outcome"):
                    say(console, "[red]supervisor[/red]",
                        f"the verify-gate, which reads each answer that ends a turn before the agent gets it, let "
                        f"this one through: {record.gate['reason']} (turn outcome: {record.gate['outcome']})")
                break
            messages.append(assistant_message(turn))
            for call in turn.tool_calls:
                say(console, "[magenta]model[/magenta]", f"round {number}: calls {call_text(call)}{state}")
                output = run_tool(str(call.arguments.get("command", "")), workdir)
                say(console, "[green]agent[/green]", f"runs it: {output_text(output)}")
                messages.append({"role": "tool", "tool_call_id": call.id, "content": output})
    say(console, None, f"the agent saw a <sup> token: {'yes' if saw_token else 'no'}")


CONDENSE_TASK = "The test suite fails. Find out which test fails and why."
CONDENSE_SCRIPT = [
    {"text": "Let me run the test suite and look at the failure.",
     "tool_calls": [{"name": "bash", "arguments": {"command": "cat test-output.log"}}]},
    {"text": "One test fails: tests/test_dates.py::test_parse_iso_week, because parse_week('2026-W53') returns "
             "None where week 53 of 2026 was expected. The other 1,999 tests pass."},
]


def failing_suite_log(tests: int = 2000, failing: int = 1234) -> str:
    """A pytest-like log: one line per test, a failure in the middle with its traceback, and a summary."""
    rows = ["============================= test session starts ==============================",
            "platform linux -- Python 3.11.7, pytest-8.3.2", f"collected {tests} items", ""]
    for i in range(tests):
        rows.append(f"tests/test_module_{i // 50:02d}.py::test_case_{i:04d} PASSED"
                    f"{'':>{8 + i % 5}}[{(i + 1) * 100 // tests:3d}%]")
        if i == failing:
            rows[-1] = "tests/test_dates.py::test_parse_iso_week FAILED                         [ 61%]"
    rows += ["", "=================================== FAILURES ===================================",
             "___________________________ test_parse_iso_week ___________________________",
             "    def test_parse_iso_week():",
             ">       assert parse_week('2026-W53') == Week(2026, 53)",
             "E       AssertionError: assert None == Week(year=2026, week=53)",
             "tests/test_dates.py:41: AssertionError",
             "=========================== short test summary info ============================",
             "FAILED tests/test_dates.py::test_parse_iso_week - AssertionError: assert None == Week(year=2026, week=53)",
             f"======================= 1 failed, {tests - 1} passed in 42.17s ======================="]
    return "\n".join(rows) + "\n"


async def run_condensing_agent(proxy: Any, fmt: WireFormat, workdir: Path, console: Console) -> None:
    """The agent that reads a large log (module docstring): prints what the proxy did to the model's copy."""
    (workdir / "test-output.log").write_text(failing_suite_log())
    proxy.scripted[next(iter(proxy.scripted))].queue(*CONDENSE_SCRIPT)
    session = f"demo-condense-{fmt.name}-{int(time.time())}"
    messages = opening(CONDENSE_TASK)
    console.print(f"[bold]An agent that reads a large tool output[/bold]  ({fmt.label}, streaming)")
    say(console, "[cyan]user[/cyan]", CONDENSE_TASK)
    async with httpx.AsyncClient(timeout=120) as client:
        for _ in range(3):
            turn, _overhead, status = await agent_turn(client, f"{proxy.url}/s/{session}", fmt, messages)
            record = proxy.pipeline.sessions.get(session).supervision.records[-1].condense
            for done in record.round if record is not None else ():
                _show_condensed(done, proxy.pipeline.store, console)
            if status != 200 or not turn.tool_calls:
                say(console, "[magenta]model[/magenta]", f"answers: {escape(_visible(turn.text))}")
                return
            messages.append(assistant_message(turn))
            for call in turn.tool_calls:
                say(console, "[magenta]model[/magenta]", f"calls {call_text(call)}")
                output = run_tool(str(call.arguments.get("command", "")), workdir)
                say(console, "[green]agent[/green]",
                    f"runs it: {len(output.splitlines()):,} lines, {len(output):,} characters, sent back whole")
                messages.append({"role": "tool", "tool_call_id": call.id, "content": output})


def _show_condensed(done: Any, store: Store | None, console: Console) -> None:
    """One condensed tool result: the tokens saved, where the original went (relative to the state dir, which
    the demo's first line names, so that the path fits the text column), and the text the model got, one line
    per log line (cut short with an ellipsis, never wrapped)."""
    d = done.decision
    if d.text is None:
        say(console, "[red]supervisor[/red]", f"left the {done.tool} result whole ({escape(d.reason)})")
        return
    spill = Path(d.spill_path)
    where = ("full original, relative to the state dir:", spill.relative_to(store.root)) \
        if store is not None and spill.is_relative_to(store.root) else ("full original:", spill)
    say(console, "[red]supervisor[/red]",
        f"condensed the {done.tool} result for the model: {d.tokens_before:,} -> {d.tokens_after:,} tokens\n"
        f"{d.kept_lines} of {d.total_lines:,} lines kept verbatim; the agent's own copy is untouched\n"
        f"{where[0]}\n{escape(str(where[1]))}\nwhat the model got:")
    say(console, "", Text(d.text, no_wrap=True, overflow="ellipsis"), bar=True)


def _visible(text: str) -> str:
    return text.split("<sup>")[0].strip()


def assistant_message(turn: AssistantTurn) -> dict[str, Any]:
    """``turn`` as the Chat Completions assistant message that carries it on in the next request's history."""
    if not turn.tool_calls:
        return {"role": "assistant", "content": turn.text}
    return {"role": "assistant", "content": turn.text or None,
            "tool_calls": [{"id": c.id, "type": "function",
                            "function": {"name": c.name, "arguments": orjson.dumps(c.arguments).decode()}}
                           for c in turn.tool_calls]}




async def _demo(config: Config, formats: list[str], state_dir: Path, console: Console, temporary: bool) -> None:
    with tempfile.TemporaryDirectory(prefix="proxyvisor-demo-project-") as scratch:
        workdir = Path(scratch)
        for name in ("README.md", "app.py", "test_app.py"):
            (workdir / name).write_text(f"# {name}\n")
        store = Store(state_dir)
        async with running(config, port=0, store=store) as proxy:
            console.print(f"proxyvisor is serving on {proxy.url}\n"
                          "upstream: the embedded scripted model (no API key, no network)")
            console.print("state dir (ledgers and spill files; the paths below are relative to it"
                          + ("; a temporary folder, removed at the end: --state-dir DIR keeps them" if temporary
                             else "") + "):")
            say(console, None, escape(str(state_dir)))
            console.print()
            if route_of(config.supervisor.model) == LITELLM:
                # The supervisor model goes through litellm, whose import takes seconds: done now, it does not
                # show up as the first gated turn's latency.
                await trio.to_thread.run_sync(litellm_bridge.import_litellm)
            for name in formats:
                session = f"demo-{name}-{int(time.time())}"
                await run_agent(f"{proxy.url}/s/{session}", BY_NAME[name], workdir, console)
                console.print()
            if proxy.scripted and config.supervisor.enabled:
                await run_looping_agent(proxy, BY_NAME[formats[0]], workdir, console)
                console.print()
                if proxy.pipeline.supervisor.condenser is not None:
                    await run_condensing_agent(proxy, BY_NAME[formats[0]], workdir, console)
                    console.print()
                if config.supervisor.gate.enabled:
                    from .demo_gate import run_gated_agent  # it builds on this module

                    await run_gated_agent(proxy, BY_NAME[formats[0]], workdir, console)
                    console.print()
        if any(u.scripted for u in config.upstreams):
            from .demo_delegation import run_delegating_agent  # it builds on this module

            await run_delegating_agent(config, store, BY_NAME[formats[0]], console)
            console.print()
    table = Table(title="every request of every session (ledger/ in the state dir)")
    for column in ("format", "status", "tokens in/out", "latency ms", "overhead ms", "gate"):
        table.add_column(column, no_wrap=True)
    for session in store.sessions():
        for r in store.read_ledger(session):
            table.add_row(r["format"], str(r["status"]), f"{r['input_tokens']}/{r['output_tokens']}",
                          f"{r['latency_ms']:.2f}", f"{r['overhead_ms']:.2f}", _gate_label(r))
    console.print(table)
    say(console, None, "[bold]gate[/bold]: what the verify-gate made of an answer that ended a turn: [bold]verified"
        "[/bold] = the latest check after the change passed · [bold]unknown[/bold] = passed on reading alone (nothing was "
        "changed, or it handed back to the user) · [bold]re-entered[/bold] = held, and the turn went on upstream "
        "· [bold]failed[/bold] / [bold]unverified[/bold] = gaps remained or no verifier answered · blank = no turn "
        "ended there")


def _gate_label(line: dict[str, Any]) -> str:
    """What the verify-gate did for a ledger line: the turn's outcome label, a re-entry, or nothing."""
    gate = line.get("gate") or {}
    outcome: str = gate.get("outcome") or ""
    if outcome:
        return outcome
    return "re-entered" if gate.get("reentries") else ""


def demo(config: Config, which: str = "all", console: Console | None = None) -> int:
    """Run the demo (see the module docstring). Writes its ledger to the configured state directory when one
    is set (``--state-dir``), else to a fresh temporary folder removed at the end. Returns the exit code."""
    console = console or Console()
    formats: list[str] = list(FORMATS) if which == "all" else [which]
    if config.state.dir:
        trio.run(_demo, config, formats, Path(config.state.dir), console, False)
        return 0
    with tempfile.TemporaryDirectory(prefix="proxyvisor-demo-") as state_dir:
        trio.run(_demo, config, formats, Path(state_dir), console, True)
    return 0
