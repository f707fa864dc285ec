"""The verify-gate part of ``proxyvisor demo``: a premature "done" held, the turn reworked, then ``/info``.

The example agent is asked to fix a bug in the scratch project's ``app.py`` so that ``test_app.py`` passes. The
scripted model reads the file, fixes it with ``sed -i`` (the agent runs it for real in its scratch folder), and
then claims "done" without running the tests. The verify-gate (``proxyvisor.proxy.gating``) holds that answer;
its free evidence pre-check settles it without a model call (state changed and no check ran after it is a gap)
and continues the turn upstream with an advisory naming the gap and what would settle it. With
``[supervisor.gate] hold = "stop"`` (the default) the premature answer's text reaches the agent as it streams but
its stop waits for the verdict, and the continued reply goes on in the same message; with ``hold = "answer"`` the
agent never receives the premature answer. The model's continued reply runs the tests (``python -m unittest test_app``),
they pass, the supervisor model (with no ``[supervisor.model]`` configured, the scripted upstream's fixed verifier
policy, ``proxyvisor.scripted.verifier``) passes its second "done", and it is verified. Then the agent
sends ``/info``, which proxyvisor answers itself without a model call (``proxyvisor.proxy.commands``), and the demo
prints the session's ledger with the gate's outcome per request.

The premature "done" is an ``until`` step (``proxyvisor.scripted.upstream``): the scripted model repeats it until
its input holds the gate's advisory (:data:`ADVISORY_MARK`), so the tests run only because the gate asked.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import orjson
from rich import box
from rich.console import Console
from rich.markdown import Markdown
from rich.markup import escape
from rich.padding import Padding
from rich.table import Table
from rich.text import Text

from .demo import agent_turn, assistant_message, call_text, opening, output_text, run_tool, say
from .proxy.formats import WireFormat
from .proxy.info import plural
from .rules import HOLD_STOP

TASK = "Fix the bug in app.py so that test_app.py passes."
APP = "def add(a, b):\n    return a - b\n"
TEST_APP = ("import unittest\n\nfrom app import add\n\n\nclass TestAdd(unittest.TestCase):\n"
            "    def test_add(self):\n        self.assertEqual(add(2, 3), 5)\n\n\n"
            'if __name__ == "__main__":\n    unittest.main()\n')
ADVISORY_MARK = "A verifier found gaps between your answer and the request"
"""The opening of the gate's advisory (``proxyvisor.gate.outcome.advisory``), as the scripted model matches it."""
PREMATURE = "Fixed: add() in app.py subtracted instead of adding; it now returns a + b. Done."
FINAL = "Fixed: add() in app.py subtracted instead of adding; it now returns a + b, and test_app.py passes."


def _report(state: str, focus: str) -> str:
    """The model's self-report token (``proxyvisor.detectors.selfreport``), on a line of its own."""
    report: dict[str, Any] = {"state": state, "focus": focus, "next": None, "carry": [], "plan": None}
    return f"\n<sup>{orjson.dumps(report).decode()}</sup>"


def _bash(text: str, command: str) -> dict[str, Any]:
    return {"text": text, "tool_calls": [{"name": "bash", "arguments": {"command": command}}]}


GATE_SCRIPT = [
    _bash("Let me look at app.py." + _report("exploring", "read app.py"), "cat app.py"),
    _bash("add() subtracts; it should add." + _report("progressing", "fix add() in app.py"),
          "sed -i 's/a - b/a + b/' app.py"),
    {"text": PREMATURE + _report("done", "add() fixed"), "until": ADVISORY_MARK},
    _bash("I have not run the tests yet; running them now." + _report("progressing", "run test_app.py"),
          "python -m unittest test_app"),
    {"text": FINAL + _report("done", "add() fixed and test_app.py passes")},
]


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
    gated = False  # the gate continued the turn
    streamed = proxy.pipeline.config.supervisor.gate.hold == HOLD_STOP  # the premature text reaches the agent
    first = len(upstream.requests)
    console.print(f"[bold]A premature \"done\" and the verify-gate[/bold]  ({fmt.label}, streaming)")
    say(console, "[cyan]user[/cyan]", TASK)
    async with httpx.AsyncClient(timeout=60) as client:
        for _ in range(max_rounds):
            sent = len(upstream.requests)
            turn, _overhead, status = await agent_turn(client, url, fmt, messages)
            received.append(turn.text)
            messages.append(assistant_message(turn))
            record = proxy.pipeline.sessions.get(session).supervision.records[-1]
            gate = record.gate or {}
            gated = gated or bool(gate.get("reentries"))
            if gate.get("reentries"):
                _show_reentry(gate, record.model.calls.get("refute", 0), fmt, upstream.requests[sent:], console,
                              streamed)
            if status != 200 or not turn.tool_calls:
                say(console, "[magenta]model[/magenta]", f"answers: {escape(turn.text.strip())}")
                if gate.get("outcome"):
                    say(console, "[red]supervisor[/red]",
                        f"held this answer too; the verifier said {gate['verdicts'][-1]} ({gate['reason']}), so the "
                        f"agent got it\nturn outcome: [bold]{gate['outcome']}[/bold]")
                break
            for call in turn.tool_calls:
                say(console, "[magenta]model[/magenta]", f"calls {call_text(call)}")
                output = run_tool(str(call.arguments.get("command", "")), workdir)
                say(console, "[green]agent[/green]", f"runs it: {output_text(output)}")
                messages.append({"role": "tool", "tool_call_id": call.id, "content": output})
        if streamed and gated:
            say(console, None, "the agent read the premature \"done\" as it streamed, but its turn did not end there: "
                "the reworked turn went on in the same message")
        elif any(PREMATURE in text for text in received):
            say(console, None, "[red]the agent received the premature \"done\"[/red]")
        else:
            say(console, None, "the agent never received the premature \"done\": it got the reworked turn")
        replies = len(upstream.requests) - first
        say(console, "[cyan]user[/cyan]", "/info")
        messages.append({"role": "user", "content": "/info"})
        before = len(upstream.requests) + len(upstream.supervisor_requests)
        turn, _overhead, status = await agent_turn(client, url, fmt, messages)
    calls = len(upstream.requests) + len(upstream.supervisor_requests) - before
    ledger = proxy.pipeline.store.read_ledger(session)
    say(console, "[red]proxyvisor[/red]", f"answers /info itself (status {status}, model calls: {calls}):")
    say(console, "", Markdown(turn.text), bar=True)
    requests = sum(1 for line in ledger if not line.get("local"))
    say(console, "", f"\"model requests {requests}\" counts the agent's requests; the model replied "
        f"{plural(replies, 'time')} above, as each re-entry is one more model call inside the same agent request")
    _show_ledger(ledger, console)


def _show_reentry(gate: dict[str, Any], refutations: int, fmt: WireFormat,
                  requests: list[tuple[str, bytes, dict[str, str]]], console: Console, streamed: bool) -> None:
    """What the gate did with a held answer: the verifier's gaps (``refutations``: calls of the second check,
    which tries to dismiss each gap) and the advisory the model got next, read from the upstream request that
    continued the turn (its last two history items: the held answer, the advisory). ``streamed``: the answer's
    text went out as it came (``hold = "stop"``), only its stop was held."""
    continued = next((orjson.loads(body) for _target, body, _headers in requests
                      if ADVISORY_MARK.encode() in body), None)
    held, advisory = (fmt.message(item).text for item in fmt.history(continued)[-2:]) if continued else ("", "")
    say(console, "[magenta]model[/magenta]", "answers, ending the turn:")
    say(console, "", Text(held.strip(), style="italic"), bar=True)
    stood = ", and a second check agreed" if refutations and not gate.get("refuted") else ""
    found = ("the recorded evidence settled it without a model call" if "evidence" in gate.get("decided_by", ())
             else f"the verifier found a gap{stood}")
    gaps = "\n".join(escape(gap) for gap in gate.get("gaps", ()))
    held_what = ("kept back this answer's stop (its text reached the agent as it streamed)" if streamed
                 else "held this answer (the agent never got it)")
    say(console, "[red]supervisor[/red]", f"the verify-gate {held_what}; {found}:\n{gaps}")
    say(console, "[red]supervisor[/red]", "continued the turn upstream; the model got this advisory:")
    say(console, "", Text(advisory), bar=True)
    say(console, "", "and the model's continued reply went on in the same message:" if streamed
        else "and the agent got the model's continued reply instead:")


def _show_ledger(lines: list[dict[str, Any]], console: Console) -> None:
    """The session's ledger, one row per agent request, with what the gate did. A re-entry happens inside the
    request whose answer was held, so that row's self-report is the reworked reply's."""
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    for column in ("agent sent", "reply's self-report", "verifier", "turn outcome"):
        table.add_column(column, no_wrap=True)
    for line in lines:
        gate = line.get("gate") or {}
        verdicts = ", ".join(gate.get("verdicts", ())) or "-"
        state = (line.get("report") or {}).get("state") or "-"
        if gate.get("reentries"):  # one "gaps" verdict per re-entry: the count is in the verdicts
            verdicts += " → re-entered"
            state += " (reworked)"
        table.add_row(line.get("local") or ("tool result" if line.get("tool_round") else "the task"), state, verdicts,
                      gate.get("outcome") or ("answered locally" if line.get("local") else "-"))
    say(console, None, f"this session's ledger ({len(lines)} lines, one per agent request):")
    console.print(Padding(table, (0, 0, 0, 4), expand=False))
