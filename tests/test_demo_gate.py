"""The demo's verify-gate scene: a premature "done" held, the gap, the rework, the verified label, /info."""

from __future__ import annotations

import io
import re
from pathlib import Path

import msgspec
import pytest
from rich.console import Console

from proxyvisor.config import Config
from proxyvisor.demo_gate import FINAL, PREMATURE, run_gated_agent
from proxyvisor.proxy.formats import BY_NAME
from proxyvisor.proxy.service import running
from proxyvisor.store import Store


async def _scene(tmp_path: Path, fmt: str, config: Config) -> tuple[str, list[dict], Path]:
    """Run the gate scene in ``fmt``; returns (what it printed, the session's ledger, the scratch folder)."""
    out = io.StringIO()
    workdir = tmp_path / "project"
    workdir.mkdir()
    store = Store(tmp_path / "state")
    async with running(config, port=0, store=store) as proxy:
        await run_gated_agent(proxy, BY_NAME[fmt], workdir, Console(file=out, width=200))
    [session] = store.sessions()
    return out.getvalue(), store.read_ledger(session), workdir


HELD = {"answer": "the verify-gate held this answer (the agent never got it)",
        "stop": "the verify-gate kept back this answer's stop (its text reached the agent as it streamed)"}
ENDED = {"answer": 'the agent never received the premature "done": it got the reworked turn',
         "stop": 'the agent read the premature "done" as it streamed, but its turn did not end there: the reworked '
                 "turn went on in the same message"}


@pytest.mark.parametrize("hold", ["stop", "answer"])
@pytest.mark.parametrize("fmt", ["chat", "messages", "responses"])
async def test_the_gate_holds_a_premature_done_and_the_reworked_turn_is_verified(tmp_path: Path, fmt: str,
                                                                                 hold: str) -> None:
    config = Config()
    config = config.with_overrides(supervisor={"gate": msgspec.structs.replace(config.supervisor.gate, hold=hold)})
    text, ledger, workdir = await _scene(tmp_path, fmt, config)
    # The premature answer is shown first, then what the gate did with it.
    held = text.index(HELD[hold])
    assert PREMATURE in text[text.index("answers, ending the turn:"):held]
    # The gap, read from the recorded evidence without a model call, and what would settle it, as the model got them.
    assert re.search(r"the recorded evidence settled it without a model call:\n\s+State changed but no check ran "
                     r"after the last change", text)
    assert "(read from the recorded evidence, without a model call):\n" in text
    assert "1. State changed but no check ran after the last change." in text
    assert "(would be settled by: a run of the project's checks" in text
    # The rework: the tests ran for real in the scratch folder, after the fix, and passed.
    rework = text.index("calls bash({'command': 'python -m unittest test_app'})")
    assert held < rework < text.index("| Ran 1 test in ") < text.index("|  | OK | exit code 0")
    assert "return a + b" in (workdir / "app.py").read_text()
    verified = text.index("held this answer too; the verifier said pass (completion verified: state changed and the "
                          "latest check after it passed), so the agent got it\n             turn outcome: verified")
    assert text.index(f"answers: {FINAL}") < verified
    assert ENDED[hold] in text and ENDED["answer" if hold == "stop" else "stop"] not in text
    # /info, answered by proxyvisor with no model call, counts the gate's work.
    assert "proxyvisor answers /info itself (status 200, model calls: 0):" in text
    assert re.search(r"gate\s+runs 2 · passes 1 · gaps 1 · nudges 0 · re-entries 1", text)
    assert re.search(r"gate outcomes\s+verified 1 \(last: verified\) · decided by evidence 0, by the model 1", text)
    assert re.search(r"supervisor model\s+1 call \(verify 1\)", text)  # the first pass cost no model call
    # Five model replies were shown for four agent requests: the demo says why, next to /info's count.
    assert re.search(r"model requests\s+4 \(tool rounds 3", text)
    assert '"model requests 4" counts the agent\'s requests; the model replied 5 times above' in text
    # The ledger: one line per request, the gate's outcome on the turn's last model request.
    gates = [(line.get("gate") or {}) for line in ledger]
    assert [g.get("verdicts") for g in gates] == [None, None, ["gaps"], ["pass"], None]
    assert [g.get("decided_by") for g in gates] == [None, None, ["evidence"], ["model"], None]
    assert [g.get("outcome") for g in gates] == [None, None, None, "verified", None]
    assert ledger[-1]["local"] == "/info" and ledger[-1]["input_tokens"] == 0
    assert re.search(r"tool result\s+progressing \(reworked\)\s+gaps → re-entered\s+-", text)
    assert re.search(r"tool result\s+done\s+pass\s+verified", text)
    assert re.search(r"/info\s+-\s+-\s+answered locally", text)


async def test_without_the_gate_the_agent_gets_the_premature_done(tmp_path: Path) -> None:
    config = Config()
    config = config.with_overrides(supervisor={"gate": msgspec.structs.replace(config.supervisor.gate, enabled=False)})
    text, ledger, _workdir = await _scene(tmp_path, "chat", config)
    assert f"answers: {PREMATURE}" in text
    assert 'the agent received the premature "done"' in text and "never received" not in text
    assert "unittest" not in text and all("gate" not in line for line in ledger)
