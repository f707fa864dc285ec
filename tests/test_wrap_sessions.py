"""``proxyvisor wrap`` follows the agent's own session across runs: a request that names its session (Claude Code's
``X-Claude-Code-Session-Id`` and ``metadata.user_id``, which ``claude --resume`` keeps) belongs to it, one that names
none to the run's own session, and ``--session`` forces; each run's summary counts that run's requests.

The agent is a small Claude-Code-shaped client (below) whose history lives in a file, so a second run resumes it
the way ``claude --resume`` does: the same session id, the whole history sent again."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from proxyvisor.cli import main
from proxyvisor.store import Store

from helpers import closed_port

SID = "6f1c2b1e-0d3a-4a55-9c2e-1f0e7d2c9b11"

AGENT = r'''
import json, os, sys, urllib.parse, urllib.request

base, history_file, sid = os.environ["ANTHROPIC_BASE_URL"], sys.argv[1], sys.argv[2]
headers = {"content-type": "application/json"}
metadata = {}
if sid:
    headers["x-claude-code-session-id"] = sid
    metadata = {"user_id": json.dumps({"device_id": "d" * 64, "account_uuid": "", "session_id": sid})}
history = json.load(open(history_file)) if os.path.exists(history_file) else []


def post(messages):
    body = {"model": "claude-sonnet-4-5", "max_tokens": 64, "system": "You poll a build.", "messages": messages,
            "tools": [{"name": "Bash", "input_schema": {"type": "object"}}], "metadata": metadata}
    request = urllib.request.Request(base + "/v1/messages", json.dumps(body).encode(), headers)
    with urllib.request.urlopen(request) as reply:
        return json.load(reply)


for step in sys.argv[3:]:
    if step == "info":
        answer = post(history + [{"role": "user", "content": "/info"}])
        print(json.dumps({"info": answer["content"][0]["text"]}))
    elif step == "current":  # what an MCP server under wrap asks for "the current session"
        origin = "{0.scheme}://{0.netloc}".format(urllib.parse.urlsplit(os.environ["PROXYVISOR_URL"]))
        url = f"{origin}/proxyvisor/sessions/{os.environ['PROXYVISOR_SESSION']}/info"
        with urllib.request.urlopen(url) as reply:
            info = json.load(reply)
        print(json.dumps({"current": info["session"], "requests": info["requests"], "runs": info["runs"]}))
    else:
        n = len(history)
        history.append({"role": "user", "content": "Wait for the build."} if not history else
                       {"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"c{n - 1}",
                                                     "content": "building: 3 of 7"}]})
        post(history)
        history.append({"role": "assistant", "content": [{"type": "tool_use", "id": f"c{n}", "name": "Bash",
                                                          "input": {"command": "cat status"}}]})
json.dump(history, open(history_file, "w"))
print(json.dumps({"run": os.environ["PROXYVISOR_SESSION"]}))
'''


def wrap(tmp_path: Path, sid: str, *steps: str, session: str | None = None) -> tuple[list[dict[str, Any]], list[str]]:
    """One ``proxyvisor wrap`` run of the agent above (session id ``sid``, "" for none) doing ``steps``, on the state
    directory of ``tmp_path``; returns what the agent printed and wrap's summary lines."""
    agent = tmp_path / "agent.py"
    agent.write_text(AGENT)
    flags = ["--session", session] if session else []
    done = subprocess.run([sys.executable, "-m", "proxyvisor", "wrap", "--state-dir", str(tmp_path / "state"),
                           *flags, "--", sys.executable, str(agent), str(tmp_path / "history.json"), sid, *steps],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    return ([json.loads(line) for line in done.stdout.splitlines()],
            [line for line in done.stderr.splitlines() if line.startswith("proxyvisor: session ")])


def test_a_resumed_session_is_one_session_across_runs_and_each_summary_counts_its_own_run(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    said, first = wrap(tmp_path, SID, "poll", "poll")
    run1 = said[-1]["run"]
    assert first[0].startswith(f"proxyvisor: session {SID}: 2 model requests (messages), 0 errors, 1 tool round"), \
        first
    said, second = wrap(tmp_path, SID, "poll", "current", "info")
    current, info, run2 = said[0], said[1]["info"], said[2]["run"]
    assert run2 != run1
    # One session, its ledger holding both runs' requests; nothing under either run's own id.
    store = Store(tmp_path / "state")
    assert store.sessions() == [SID]
    lines = store.read_ledger(SID)
    assert [(line["run"], line.get("local")) for line in lines] == [(run1, None), (run1, None), (run2, None),
                                                                      (run2, "/info")]
    # /info in the resumed conversation shows both runs; the run's id names the session it went to.
    assert "| model requests   | 3 (tool rounds 2, errors 0); in 2 wrap runs |" in info, info
    assert current == {"current": SID, "requests": 3, "runs": 2}
    assert second[0].startswith(f"proxyvisor: session {SID}, this run (3 model requests in the session in all): 1 "
                                "model request (messages), 0 errors, 1 tool round; upstream "), second
    assert second[0].endswith("; 1 question answered by proxyvisor itself (/info 1)"), second
    # Its proxy gone with it, a run's id still names the session: from the ledger, whose lines record their run.
    capsys.readouterr()
    assert main(["info", run1, "--json", "--url", f"http://127.0.0.1:{closed_port()}",
                 "--state-dir", str(tmp_path / "state")]) == 0
    assert json.loads(capsys.readouterr().out)["session"] == SID


def test_a_client_that_names_no_session_is_the_runs_session(tmp_path: Path) -> None:
    said, summary = wrap(tmp_path, "", "poll", "poll", "current")
    current, run = said[0], said[1]["run"]
    assert current == {"current": run, "requests": 2, "runs": 1}
    assert Store(tmp_path / "state").sessions() == [run]
    assert summary[0].startswith(f"proxyvisor: session {run}: 2 model requests (messages)"), summary


def test_wrap_session_forces_the_session_over_the_clients_own(tmp_path: Path) -> None:
    said, summary = wrap(tmp_path, SID, "poll", "current", session="mine")
    assert said[0] == {"current": "mine", "requests": 1, "runs": 1} and said[1] == {"run": "mine"}
    store = Store(tmp_path / "state")
    assert store.sessions() == ["mine"]
    (line,) = store.read_ledger("mine")
    assert isinstance(line["run"], str) and len(line["run"]) == 32  # the run is recorded all the same
    assert summary[0].startswith("proxyvisor: session mine: 1 model request (messages)"), summary


def test_info_as_the_first_request_of_a_resumed_run_counts_that_run(tmp_path: Path) -> None:
    # The asking /info's own ledger line is written after its answer is made: its run is counted all the same, the
    # /info itself is not (as in the test above).
    said, _ = wrap(tmp_path, SID, "poll", "poll")
    run1 = said[-1]["run"]
    said, _ = wrap(tmp_path, SID, "info")
    info, run2 = said[0]["info"], said[1]["run"]
    assert "| model requests   | 2 (tool rounds 1, errors 0); in 2 wrap runs |" in info, info
    assert [(line["run"], line.get("local")) for line in Store(tmp_path / "state").read_ledger(SID)] == \
        [(run1, None), (run1, None), (run2, "/info")]
