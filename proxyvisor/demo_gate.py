"""The verify-gate part of ``proxyvisor demo``: a premature "done" held, the turn reworked, then ``/info``.

The example agent is asked to fix a bug in the scratch project's ``app.py`` so that ``test_app.py`` passes. The
scripted model reads the file, fixes it with ``sed -i`` (the agent runs it for real in its scratch folder), and
then claims "done" without running the tests. The verify-gate (``proxyvisor.proxy.gating``) holds that answer,
asks the supervisor model (with no ``[supervisor.model]`` configured, the scripted upstream's fixed verifier
policy, ``proxyvisor.adapters.scripted_verifier``: state changed and no check ran after it is a gap), and
continues the turn upstream with an advisory naming the gap and what would settle it. The agent never receives
the premature answer: the model's continued reply runs the tests (``python test_app.py``), they pass, and its
second "done" is verified. Then the agent sends ``/info``, which proxyvisor answers itself without a model call
(``proxyvisor.proxy.commands``), and the demo prints the session's ledger with the gate's outcome per request.

The premature "done" is an ``until`` step (``proxyvisor.adapters.scripted``): the scripted model repeats it until
its input holds the gate's advisory (:data:`ADVISORY_MARK`), so the tests run only because the gate asked.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import orjson
from rich import box
from rich.console import Console, RenderableType
from rich.markdown import Markdown
from rich.padding import Padding
from rich.table import Table
from rich.text import Text

from .demo import agent_turn, assistant_message, opening, run_tool
from .proxy.formats import WireFormat

TASK = "Fix the bug in app.py so that test_app.py passes."
APP = "def add(a, b):\n    return a - b\n"
TEST_APP = ("from app import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n\n\n"
            'if __name__ == "__main__":\n    test_add()\n    print("test_app.py: 1 test passed")\n')
ADVISORY_MARK = "A verifier found gaps between your answer and the request"
"""The opening of the gate's advisory (``proxyvisor.gate.outcome.advisory``), as the scripted model matches it."""
PREMATURE = "Fixed: add() in app.py subtracted instead of adding; it now returns a + b. Done."
FINAL = "Fixed: add() in app.py subtracted instead of adding; it now returns a + b, and test_app.py passes."


def _report(state: str, focus: str) -> str:
    """The model's self-report token (``proxyvisor.detectors.selfreport``), on a line of its own."""
    report = {"state": state, "focus": focus, "next": None, "carry": [], "plan": None}
    return f"\n<sup>{orjson.dumps(report).decode()}</sup>"


def _bash(text: str, command: str) -> dict[str, Any]:
    return {"text": text, "tool_calls": [{"name": "bash", "arguments": {"command": command}}]}


GATE_SCRIPT = [
    _bash("Let me look at app.py." + _report("exploring", "read app.py"), "cat app.py"),
    _bash("add() subtracts; it should add." + _report("progressing", "fix add() in app.py"),
          "sed -i 's/a - b/a + b/' app.py"),
    {"text": PREMATURE + _report("done", "add() fixed"), "until": ADVISORY_MARK},
    _bash("I have not run the tests yet; running them now." + _report("progressing", "run test_app.py"),
          "python test_app.py"),
    {"text": FINAL + _report("done", "add() fixed and test_app.py passes")},
]
_INDENT = " " * 13


async def run_gated_agent(proxy: Any, fmt: WireFormat, workdir: Path, console: Console,
                          max_rounds: int = 6) -> None:
    """The turn of the module docstring, then ``/info``, printed as they happen."""
    (workdir / "app.py").write_text(APP)
    (workdir / "test_app.py").write_text(TEST_APP)
    upstream = proxy.scripted[next(iter(proxy.scripted))]
    upstream.queue(*GATE_SCRIPT)
    upstream.record = True  # the scene shows what the model got when the gate continued the turn
    session = f"demo-gate-{fmt.name}-{int(time.time())}"
    url = f"{proxy.url}/s/{session}"
    messages = opening(TASK)
    received: list[str] = []
    console.print(f"[bold]A premature \"done\" and the verify-gate[/bold]  ({fmt.label}, streaming)")
    console.print(f"  [cyan]user[/cyan]       {TASK}")
    async with httpx.AsyncClient(timeout=60) as client:
        for _ in range(max_rounds):
            sent = len(upstream.requests)
            turn, _overhead, status = await agent_turn(client, url, fmt, messages)
            received.append(turn.text)
            messages.append(assistant_message(turn))
            record = proxy.pipeline.sessions.get(session).supervision.records[-1]
            gate = record.gate or {}
            if gate.get("reentries"):
                _show_reentry(gate, record.model.calls.get("refute", 0), fmt, upstream.requests[sent:], console)
            if status != 200 or not turn.tool_calls:
                if gate.get("outcome"):
                    console.print(f"  [red]supervisor[/red] held this answer too; the verifier said "
                                  f"{gate['verdicts'][-1]}:\n{_INDENT}{gate['reason']}\n"
                                  f"{_INDENT}turn outcome: [bold]{gate['outcome']}[/bold]")
                console.print(f"  [magenta]model[/magenta]      answers: {turn.text.strip()}")
                break
            for call in turn.tool_calls:
                console.print(f"  [magenta]model[/magenta]      calls {call.name}({call.arguments})")
                output = run_tool(str(call.arguments.get("command", "")), workdir)
                console.print(f"  [green]agent[/green]      runs it: {output.strip().replace(chr(10), ' | ')}")
                messages.append({"role": "tool", "tool_call_id": call.id, "content": output})
        if any(PREMATURE in text for text in received):
            console.print("  [red]the agent received the premature \"done\"[/red]")
        else:
            console.print("  the agent never received the premature \"done\": it got the reworked turn")
        console.print("  [cyan]user[/cyan]       /info")
        messages.append({"role": "user", "content": "/info"})
        before = len(upstream.requests) + len(upstream.supervisor_requests)
        turn, _overhead, status = await agent_turn(client, url, fmt, messages)
    calls = len(upstream.requests) + len(upstream.supervisor_requests) - before
    console.print(f"  [red]proxyvisor[/red] answers /info itself (status {status}, model calls: {calls}):")
    _quote(Markdown(turn.text), console)
    _show_ledger(proxy.pipeline.store.read_ledger(session), console)


def _show_reentry(gate: dict[str, Any], refutations: int, fmt: WireFormat,
                  requests: list[tuple[str, bytes, dict[str, str]]], console: Console) -> None:
    """What the gate did with a held answer: the verifier's gaps (``refutations``: refuter calls made) and the
    advisory the model got next, read from the upstream request that continued the turn (its last two history
    items: the held answer, the advisory)."""
    continued = next((orjson.loads(body) for _target, body, _headers in requests
                      if ADVISORY_MARK.encode() in body), None)
    held, advisory = (fmt.message(item).text for item in fmt.history(continued)[-2:]) if continued else ("", "")
    console.print("  [red]supervisor[/red] held the model's turn-ending answer; the agent never got it:")
    _quote(Text(held.strip(), style="italic"), console)
    stood = " (a refutation pass let it stand)" if refutations and not gate.get("refuted") else ""
    console.print(f"  [red]supervisor[/red] the verifier found a gap{stood}:")
    for gap in gate.get("gaps", ()):
        console.print(f"{_INDENT}{gap}")
    console.print("  [red]supervisor[/red] continued the turn upstream; the model got this advisory:")
    _quote(Text(advisory), console)
    console.print(f"{_INDENT}and the agent got the model's continued reply instead:")


def _quote(renderable: RenderableType, console: Console) -> None:
    """``renderable`` indented behind a ``│`` bar; leading and trailing blank lines dropped, runs of them kept
    as one."""
    options = console.options.update(width=max(40, console.width - len(_INDENT) - 2))
    lines: list[Text] = []
    for line in console.render_lines(renderable, options, pad=False):
        text = Text.assemble(*((seg.text, seg.style) for seg in line if not seg.control))
        text.rstrip()
        if text.plain or (lines and lines[-1].plain):
            lines.append(text)
    for text in lines[:-1] if lines and not lines[-1].plain else lines:
        console.print(Text(f"{_INDENT}│ ", style="dim") + text, no_wrap=True, overflow="ellipsis")


def _show_ledger(lines: list[dict[str, Any]], console: Console) -> None:
    """The session's ledger, one row per request, with what the gate did."""
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    for column in ("agent sent", "self-report", "verifier", "turn outcome"):
        table.add_column(column, no_wrap=True)
    for line in lines:
        gate = line.get("gate") or {}
        verdicts = ", ".join(gate.get("verdicts", ())) or "-"
        if gate.get("reentries"):
            verdicts += f" (re-entered {gate['reentries']}x)"
        table.add_row(line.get("local") or ("tool result" if line.get("tool_round") else "the task"),
                      (line.get("report") or {}).get("state") or "-", verdicts,
                      gate.get("outcome") or ("answered locally" if line.get("local") else "-"))
    console.print(f"  this session's ledger ({len(lines)} lines, one per request):")
    console.print(Padding(table, (0, 0, 0, 4)))
