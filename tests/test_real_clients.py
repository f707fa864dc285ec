"""Real agent CLIs (Claude Code, Codex, opencode) complete a turn with one tool call through ``proxyvisor wrap``.

Each test runs ``python -m proxyvisor wrap`` as a real subprocess with the built-in default configuration, so the
agent talks to the embedded scripted upstream in auto mode: the first request gets one call of a shell tool from
the agent's own tool list with the command ``ls``; the request after it, which carries the tool result, gets the
text :data:`DONE`. That text can only reach the agent's output if its second request ended with a tool result.

The CLIs come from ``.ci/install-agents`` (binaries in ``$PROXYVISOR_AGENTS_PREFIX/bin``, else the default prefix,
else ``PATH``). A missing CLI skips the test on a developer machine and fails it in CI (``CI`` set), where the
installer has run. The agent configuration follows ``../shared/reference/real-clients.md``: private config homes,
telemetry, update checks and plugin fetches off, so nothing leaves the loopback interface.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from proxyvisor.config import SCRIPTED_MODEL
from proxyvisor.gate import plan as plans
from proxyvisor.proxy.info import render_text, summarize

from helpers import expected_notice

pytestmark = pytest.mark.real_client

DONE = "Done: I ran the tool and read its output."
"""The scripted upstream's auto-mode answer to a request whose latest turn is a tool result."""
MARKER = "proxyvisor-marker.txt"
"""The one file in the agent's working directory: the ``ls`` output the tool result must carry."""
MODEL = "scripted-model"
TIMEOUT_S = 180
"""Per agent run; generous, because a healthy run takes seconds and a hang must fail rather than block CI."""

# Read at import, before the autouse fixture points HOME and XDG_CACHE_HOME into the test's tmp_path.
_DEFAULT_PREFIX = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "proxyvisor-agents"
_PREFIX_ENV = os.environ.get("PROXYVISOR_AGENTS_PREFIX")
_IN_CI = os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")
# Variables of the developer's own agent setup that would redirect or reconfigure the CLIs under test.
_FOREIGN_PREFIXES = ("ANTHROPIC_", "OPENAI_", "CLAUDE_", "CODEX_", "OPENCODE_")

# A user's Codex setup, offline: update checks, plugin and app fetches and analytics off. `wrap` itself points
# Codex at the proxy (proxyvisor/agents.py): Codex 0.171.0 ignores OPENAI_BASE_URL.
_CODEX_COMMON = """\
check_for_update_on_startup = false
# The sandbox depends on the host allowing user namespaces, which CI runners may not; it is not under test, and
# the only command the scripted model asks for is `ls` in a scratch directory.
sandbox_mode = "danger-full-access"

[features]
plugins = false  # else `git ls-remote https://github.com/openai/plugins.git` at startup
apps = false

[analytics]
enabled = false
"""
_CODEX_BUILT_IN = f'model = "{MODEL}"\n' + _CODEX_COMMON
"""The built-in ``openai`` provider (API key from ``OPENAI_API_KEY``), which asks for a WebSocket first."""
_CODEX_MINE = f"""\
model_provider = "mine"
{_CODEX_COMMON}
[model_providers.mine]
name = "mine"
# Not a usable URL: unless wrap redirects the provider, Codex fails in about 25 s (an unreachable address would
# leave it "waiting for network" until the test times out).
base_url = "not-redirected:"
env_key = "PROXYVISOR_TEST_API_KEY"
wire_api = "responses"
"""
_CODEX_OWN_PROVIDER = f'model = "{MODEL}"\n' + _CODEX_MINE
"""A provider of the user's own, as ``../shared/reference/real-clients.md`` configures it."""


def find_agent(name: str) -> str:
    """The path of agent CLI ``name``; skips the test (outside CI) or fails it (in CI) when it is absent."""
    for folder in (Path(_PREFIX_ENV) if _PREFIX_ENV else None, _DEFAULT_PREFIX):
        if folder is not None and os.access(folder / "bin" / name, os.X_OK):
            return str(folder / "bin" / name)
    found = shutil.which(name)
    if found:
        return found
    reason = (f"agent CLI {name!r} not found in {_PREFIX_ENV or '$PROXYVISOR_AGENTS_PREFIX (unset)'}/bin, "
              f"{_DEFAULT_PREFIX}/bin or PATH; install it with .ci/install-agents")
    if _IN_CI:
        pytest.fail(f"{reason} (CI is set, so the CLI must be installed)")
    pytest.skip(reason)


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str


@dataclass
class Workspace:
    """Scratch folders of one agent run: the agent's working directory, its config home, the state dir."""

    work: Path
    home: Path
    state: Path

    @classmethod
    def make(cls, tmp_path: Path) -> Workspace:
        ws = cls(tmp_path / "work", tmp_path / "agent-home", tmp_path / "state")
        for folder in (ws.work, ws.home, ws.state):
            folder.mkdir()
        (ws.work / MARKER).write_text("hello\n")
        return ws

    def ledger(self, session: str) -> list[dict[str, Any]]:
        path = self.state / "ledger" / f"{session}.jsonl"
        assert path.is_file(), f"no ledger at {path}; state dir holds {self.files()}"
        return [json.loads(line) for line in path.read_text().splitlines()]

    def files(self) -> list[str]:
        return sorted(str(p.relative_to(self.state)) for p in self.state.rglob("*"))


def proxyvisor(ws: Workspace, args: list[str], env: dict[str, str], timeout_s: float = TIMEOUT_S) -> Run:
    """Run ``python -m proxyvisor ARGS`` in ``ws.work`` with ``env`` added; fails on a hang.

    The run gets its own process group, so a timeout kills ``wrap``'s agent too; ``batch`` runs each agent in a
    group of its own, so it first gets SIGTERM, on which it stops them. Its ``TMPDIR`` is a folder of the
    workspace: the agent CLIs keep scratch files there (Claude Code its ``claude-UID`` folder) and leave them. Its
    ``PWD`` is ``ws.work``, as a shell there sets it: opencode takes its project folder from it.
    """
    tmp = ws.home / "tmp"
    tmp.mkdir(exist_ok=True)
    own = {k: v for k, v in os.environ.items() if not k.startswith(_FOREIGN_PREFIXES)}
    full_env = own | {"TMPDIR": str(tmp), "PWD": str(ws.work)} | env  # PWD as the user's shell sets it
    proc = subprocess.Popen([sys.executable, "-m", "proxyvisor", *args], cwd=ws.work, env=full_env,
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        finally:
            os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"proxyvisor {args[0]} did not finish in {timeout_s} s\n"
                    f"stdout:\n{stdout[-4000:]}\nstderr:\n{stderr[-4000:]}")
    return Run(proc.returncode, stdout, stderr)


def wrap(ws: Workspace, cmd: list[str], env: dict[str, str], *wrap_args: str) -> Run:
    """Run ``python -m proxyvisor wrap --state-dir ... WRAP_ARGS -- CMD`` (:func:`proxyvisor`)."""
    return proxyvisor(ws, ["wrap", "--state-dir", str(ws.state), *wrap_args, "--", *cmd], env)


def check_ledger(ws: Workspace, session: str, fmt: str) -> None:
    """The ledger shows the tool-call round trip: 2+ model requests in ``fmt``, each answered 200."""
    records = ws.ledger(session)
    assert len(records) >= 2, records
    assert {r["format"] for r in records} == {fmt}, records
    assert [r["status"] for r in records] == [200] * len(records), records
    assert {r["model"] for r in records} == {MODEL}, records


def json_lines(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def scripted_config(folder: Path, steps: list[dict[str, Any]], mark: str | None = None, more: str = "") -> Path:
    """A proxyvisor config in ``folder`` whose built-in scripted model plays ``steps`` (each marked ``mark`` when
    given), with the config text ``more`` after it; returns the config file's path."""
    script = folder / "script.jsonl"
    script.write_text("".join(json.dumps({"marker": mark, **step} if mark else step) + "\n" for step in steps))
    config = folder / "config.toml"
    config.write_text(f'[upstreams.scripted]\nscript = "{script}"\n' + (f"\n{more}" if more else ""))
    return config


# --- Claude Code -----------------------------------------------------------------------------------------------

def claude_env(ws: Workspace) -> dict[str, str]:
    return {"CLAUDE_CONFIG_DIR": str(ws.home), "ANTHROPIC_API_KEY": "dummy", "DISABLE_TELEMETRY": "1",
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_AUTOUPDATER": "1"}


def claude_run(ws: Workspace, output_format: str, *wrap_args: str) -> Run:
    cmd = [find_agent("claude"), "-p", "List the files in the current directory.", "--model", MODEL,
           "--output-format", output_format]
    if output_format == "stream-json":
        cmd.append("--verbose")  # required by -p with stream-json; adds the tool call and result events
    return wrap(ws, cmd, claude_env(ws), *wrap_args)


def test_claude_code_completes_a_tool_call_turn_through_wrap(tmp_path: Path) -> None:
    ws, session = Workspace.make(tmp_path), "claude-code-test"
    run = claude_run(ws, "stream-json", "--session", session)
    assert run.returncode == 0, run
    events = json_lines(run.stdout)
    blocks = [b for e in events if e.get("type") in ("assistant", "user") for b in e["message"]["content"]]
    calls = [b for b in blocks if b["type"] == "tool_use"]
    results = [b for b in blocks if b["type"] == "tool_result"]
    assert [(c["name"], c["input"]["command"]) for c in calls] == [("Bash", "ls")], calls
    assert len(results) == 1 and results[0]["tool_use_id"] == calls[0]["id"], results
    assert MARKER in str(results[0]["content"]) and not results[0]["is_error"], results
    final = events[-1]
    assert (final["type"], final["subtype"], final["is_error"], final["result"]) == ("result", "success", False, DONE)
    check_ledger(ws, session, "messages")
    assert f"proxyvisor: session {session}: " in run.stderr and "(messages)" in run.stderr, run.stderr


def test_claude_code_through_wrap_without_supervision_writes_nothing(tmp_path: Path) -> None:
    ws = Workspace.make(tmp_path)
    run = claude_run(ws, "json", "--no-supervision")
    assert run.returncode == 0, run
    result = json.loads(run.stdout)
    assert (result["subtype"], result["is_error"], result["result"]) == ("success", False, DONE), result
    assert result["num_turns"] == 2, result
    assert result["total_cost_usd"] == 0, result  # the scripted model reports zero usage: nothing to price
    assert ws.files() == []


def test_claude_code_gets_proxyvisors_answer_to_info_and_plan(tmp_path: Path) -> None:
    """Three headless runs in one proxied session: a tool-call turn, then ``/info``, then ``/plan``.

    Claude Code runs a prompt that starts with ``/`` as its own slash command, without any request
    (``-p /info`` prints "Unknown command: /info", ``-p /plan`` "/plan isn't available in this environment"; so
    does ``/info`` on stdin); with a leading space the text reaches the API verbatim, in the prompt's own text
    block after a ``<system-reminder>`` block, and proxyvisor answers it."""
    ws, session = Workspace.make(tmp_path), "claude-commands-test"
    claude = [find_agent("claude"), "--model", MODEL, "--output-format", "json", "-p"]
    runs = " && ".join(shlex.join(claude + [prompt])
                       for prompt in ("List the files in the current directory.", " /info", " /plan"))
    run = wrap(ws, ["sh", "-c", runs], claude_env(ws), "--session", session)
    assert run.returncode == 0, run
    work, info, plan = (json.loads(line) for line in run.stdout.splitlines())
    assert work["result"] == DONE, work
    assert (work["total_cost_usd"], info["total_cost_usd"], plan["total_cost_usd"]) == (0, 0, 0), (work, info, plan)
    lines = ws.ledger(session)
    assert [line.get("local") for line in lines] == [None, None, "/info", "/plan"], lines
    # The ledger's counters, then the live memory row (learning's records for the folder: it is on by default) in
    # place of the ledger's.
    expected = {"session": session, **summarize(lines[:2]), "learning": {}}
    assert (info["subtype"], info["is_error"], info["num_turns"]) == ("success", False, 1), info
    assert info["result"].startswith(render_text(expected) + "\n| memory "), info["result"]
    assert "| model requests   | 2 (tool rounds 1, errors 0) |" in info["result"]
    assert (plan["subtype"], plan["result"]) == ("success", plans.NO_PLAN), plan


def test_claude_code_resumed_in_a_second_wrap_run_goes_on_in_its_session(tmp_path: Path) -> None:
    """``claude --resume ID`` keeps its session id: the second ``wrap`` run's requests join the session of the first
    (one ledger, Claude Code's id), ``/info`` in the resumed conversation counts both runs, and the second run's
    summary counts its own requests, naming the session's total."""
    ws = Workspace.make(tmp_path)
    first = claude_run(ws, "json")
    assert first.returncode == 0, first
    sid = json.loads(first.stdout)["session_id"]
    assert f"proxyvisor: session {sid}: 2 model requests (messages)" in first.stderr, first.stderr
    claude = [find_agent("claude"), "--resume", sid, "--model", MODEL, "--output-format", "json", "-p"]
    runs = " && ".join(shlex.join(claude + [prompt]) for prompt in ("List the files again.", " /info"))
    second = wrap(ws, ["sh", "-c", runs], claude_env(ws))
    assert second.returncode == 0, second
    work, info = (json.loads(line) for line in second.stdout.splitlines())
    assert (work["session_id"], work["result"], info["session_id"]) == (sid, DONE, sid), (work, info)
    assert [p.name for p in (ws.state / "ledger").iterdir()] == [f"{sid}.jsonl"]
    assert len({line["run"] for line in ws.ledger(sid)}) == 2
    assert f"**proxyvisor /info · session {sid}**" in info["result"], info
    assert "| model requests   | 4 (tool rounds 2, errors 0); in 2 wrap runs |" in info["result"], info
    assert (f"proxyvisor: session {sid}, this run (4 model requests in the session in all): 2 model requests "
            "(messages)") in second.stderr, second.stderr


def test_claude_code_headless_batch_reports_each_tasks_gate_outcome(tmp_path: Path) -> None:
    """``proxyvisor batch`` runs ``claude -p`` once per task, in parallel, each in its own session with the gate
    on (streams held until the verdict). The scripted model follows one script per task, picked by the marker in
    the task's prompt; the scripted verifier gives the outcomes."""
    ws = Workspace.make(tmp_path)

    def bash(command: str) -> list[dict[str, Any]]:
        return [{"name": "Bash", "arguments": {"command": command, "description": "run it"}}]

    write = "printf 'def add(a, b):\\n    \"\"\"\\n    >>> add(2, 3)\\n    5\\n    \"\"\"\\n    return a + b\\n' > calc.py"
    check = "python3 -m doctest -v calc.py"  # a recognised test runner: verified needs one (a python -c assert is none)
    finals = {"edit": "calc.py has add(); its check passed.", "rework": "calc.py has add(); checked now.",
              "question": "Idempotent: twice has the same effect as once."}
    steps = [{"tool_calls": bash(write)}, {"tool_calls": bash(check)}, {"text": finals["edit"]},  # edit
             {"tool_calls": bash(write)}, {"text": "Done."}, {"tool_calls": bash(check)}, {"text": finals["rework"]},
             {"text": finals["question"]}]
    markers = ["edit"] * 3 + ["rework"] * 4 + ["question"]
    config = scripted_config(tmp_path, [{"marker": f"[task:{m}]", **step} for m, step in zip(markers, steps)],
                             more='[supervisor.model]\nname = "scripted-model"\napi_base = "scripted:"\n')
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({"id": m, "prompt": f"{text} [task:{m}]"}) + "\n" for m, text in (
        ("edit", "Write calc.py with add(a, b) and check it."), ("rework", "Write calc.py with add(a, b)."),
        ("question", "What does idempotent mean?"))))
    agent = (f"{shlex.quote(find_agent('claude'))} -p {{prompt}} --model {MODEL} --output-format json "
             "--allowedTools Bash")
    run = proxyvisor(ws, ["batch", str(tasks), "--config", str(config), "--agent", agent, "--parallel", "3",
                          "--state-dir", str(ws.state), "--workdir-template", str(ws.work / "{id}"),
                          "--report", str(tmp_path / "report")], claude_env(ws))
    assert run.returncode == 0, run
    report = [json.loads(line) for line in (tmp_path / "report.jsonl").read_text().splitlines()]
    assert [(r["id"], r["outcome"], r["exit_code"], r["reentries"]) for r in report] == [
        ("edit", "verified", 0, 0), ("rework", "verified", 0, 1), ("question", "unknown", 0, 0)], report
    for r in report:
        result = json.loads(Path(r["stdout"]).read_text())
        assert (result["subtype"], result["is_error"], result["result"]) == ("success", False, finals[r["id"]]), result
        lines = ws.ledger(r["session"])
        assert len(lines) == r["requests"] and {line["format"] for line in lines} == {"messages"}, lines
        assert all(line.get("stream") for line in lines if line.get("gate")), lines  # Claude Code streams
    assert (ws.work / "edit" / "calc.py").is_file() and (ws.work / "rework" / "calc.py").is_file()


GATE_MARK = "[task:gate]"
GATE_SOURCE = 'def add(a, b):\n    """\n    >>> add(2, 3)\n    5\n    """\n    return a + b\n'
GATE_FINAL = "calc.py has add(); its check passed."


def premature_done_script(tmp_path: Path, shell_tool: str) -> Path:
    """A config whose scripted model, for prompts carrying :data:`GATE_MARK`, writes :data:`GATE_SOURCE` with the
    agent's ``shell_tool``, says "done" at once, then (once the gate sends the turn back) runs the file's doctest, a
    recognised test runner (verified needs one), and answers :data:`GATE_FINAL`."""
    def shell(command: str) -> list[dict[str, Any]]:
        return [{"name": shell_tool, "arguments": {"command": command, "description": "run it"}}]

    steps = [{"tool_calls": shell(f"printf '{GATE_SOURCE.replace(chr(10), chr(92) + 'n')}' > calc.py")},
             {"text": "Done: calc.py has add()."},
             {"tool_calls": shell("python3 -m doctest -v calc.py")},
             {"text": GATE_FINAL}]
    return scripted_config(tmp_path, steps, GATE_MARK)


def test_claude_code_premature_done_is_held_reworked_and_verified_by_the_sessions_own_model(tmp_path: Path) -> None:
    """No ``[supervisor.model]`` at all: the verifier is the session's own route (the scripted upstream, in
    Claude Code's Anthropic format, with its credentials and model). A "done" right after an edit is held; the
    gate's advisory (from the free evidence: no check after the edit) continues the turn; the model runs the check,
    and the turn ends ``verified``, the ledger naming the route and model that judged it."""
    ws, session = Workspace.make(tmp_path), "claude-gate-test"
    config = premature_done_script(tmp_path, "Bash")
    cmd = [find_agent("claude"), "-p", f"Write calc.py with add(a, b). {GATE_MARK}", "--model", MODEL,
           "--output-format", "json", "--allowedTools", "Bash"]
    run = proxyvisor(ws, ["wrap", "--config", str(config), "--state-dir", str(ws.state), "--session", session, "--",
                          *cmd], claude_env(ws))
    assert run.returncode == 0, run
    assert "supervisor model: the session's own (each request's upstream and model)" in run.stderr, run.stderr
    result = json.loads(run.stdout)
    assert (result["subtype"], result["is_error"], result["result"]) == ("success", False, GATE_FINAL), result
    assert "Done: calc.py has add()." not in run.stdout  # the premature answer never reached the agent
    assert (ws.work / "calc.py").read_text() == GATE_SOURCE
    gates = [line["gate"] for line in ws.ledger(session) if line.get("gate")]
    assert [g.get("reentries") for g in gates] == [1, 0], gates
    assert gates[-1]["outcome"] == "verified" and gates[-1]["passed"] is True, gates
    assert [g["decided_by"] for g in gates] == [["evidence"], ["model"]], gates
    assert (gates[-1]["route"], gates[-1]["model"]) == ("session", MODEL) and "route" not in gates[0], gates
    summary = summarize(ws.ledger(session))
    assert summary["gate"]["judges"] == {f"session: {MODEL}": 1}, summary["gate"]
    assert summary["gate"]["decided_by"] == {"evidence": 0, "model": 1}, summary["gate"]


def test_claude_code_shows_an_unverified_answer_with_the_notice_after_it(tmp_path: Path) -> None:
    """A turn the gate cannot pass (an edit, then only insisting it is done: the re-entry budget is spent) reaches
    ``claude -p`` with its answer and the unverified notice after it, in the answer's last text block: Claude Code
    prints only that block, so a notice in a block of its own would replace the answer."""
    ws, session = Workspace.make(tmp_path), "claude-notice-test"
    mark = "[task:notice]"
    insisting = ["Done: notes.txt is written.", "notes.txt is written; nothing to check.", "As I said, it is written."]
    steps = [{"tool_calls": [{"name": "Bash", "arguments": {"command": "printf 'milk\\n' > notes.sh",
                                                              "description": "write it"}}]}]
    steps += [{"text": text} for text in insisting]
    config = scripted_config(tmp_path, steps, mark)
    cmd = [find_agent("claude"), "-p", f"Write notes.sh. {mark}", "--model", MODEL, "--output-format", "json",
           "--allowedTools", "Bash"]
    run = proxyvisor(ws, ["wrap", "--config", str(config), "--state-dir", str(ws.state), "--session", session, "--",
                          *cmd], claude_env(ws))
    assert run.returncode == 0, run
    result = json.loads(run.stdout)["result"]
    gates = [line["gate"] for line in ws.ledger(session) if line.get("gate")]
    assert gates[-1]["outcome"] in ("unverified", "failed") and gates[-1]["passed"] is False, gates
    answer, _, notice = result.rpartition("\n\n")
    assert notice == expected_notice(gates[-1]) and answer in insisting[1:], result


# --- Codex -----------------------------------------------------------------------------------------------------

def codex_run(ws: Workspace, config: str, *wrap_args: str, as_json: bool = True) -> Run:
    """``proxyvisor wrap WRAP_ARGS -- codex exec ...`` as a user types it, with ``config`` as Codex's config.toml."""
    (ws.home / "config.toml").write_text(config)
    cmd = [find_agent("codex"), "exec", "--skip-git-repo-check", *(["--json"] if as_json else []),
           "List the files in the current directory."]
    env = {"CODEX_HOME": str(ws.home), "OPENAI_API_KEY": "dummy", "PROXYVISOR_TEST_API_KEY": "dummy"}
    return wrap(ws, cmd, env, *wrap_args)


def check_codex_turn(events: list[dict[str, Any]]) -> None:
    """``codex exec --json`` events show one ``ls`` run with the marker in its output, then :data:`DONE`."""
    items = [e["item"] for e in events if e.get("type") == "item.completed"]
    commands = [i for i in items if i["type"] == "command_execution"]
    assert len(commands) == 1, items
    assert commands[0]["exit_code"] == 0 and MARKER in commands[0]["aggregated_output"], commands
    messages = [i["text"] for i in items if i["type"] == "agent_message"]
    assert messages[-1] == DONE, items
    assert events[-1]["type"] == "turn.completed", events[-1]


def test_codex_completes_a_tool_call_turn_through_wrap(tmp_path: Path) -> None:
    ws, session = Workspace.make(tmp_path), "codex-test"
    run = codex_run(ws, _CODEX_OWN_PROVIDER, "--session", session)
    assert run.returncode == 0, run
    check_codex_turn(json_lines(run.stdout))
    check_ledger(ws, session, "responses")
    assert f"proxyvisor: session {session}: " in run.stderr and "(responses)" in run.stderr, run.stderr


def test_codex_resumed_in_a_second_wrap_run_goes_on_in_its_session(tmp_path: Path) -> None:
    """``codex exec resume ID`` keeps its thread id (Codex's ``session-id``): the second ``wrap`` run's requests join
    the session of the first, and its summary counts its own."""
    ws = Workspace.make(tmp_path)
    first = codex_run(ws, _CODEX_OWN_PROVIDER)
    assert first.returncode == 0, first
    (thread,) = [e["thread_id"] for e in json_lines(first.stdout) if e.get("type") == "thread.started"]
    cmd = [find_agent("codex"), "exec", "--skip-git-repo-check", "--json", "resume", thread,
           "List the files again."]
    second = wrap(ws, cmd, {"CODEX_HOME": str(ws.home), "PROXYVISOR_TEST_API_KEY": "dummy"})
    assert second.returncode == 0, second
    check_codex_turn(json_lines(second.stdout))
    assert [p.name for p in (ws.state / "ledger").iterdir()] == [f"{thread}.jsonl"]
    runs = [line["run"] for line in ws.ledger(thread)]
    assert len(set(runs)) == 2 and runs[0] != runs[-1], runs
    assert f"proxyvisor: session {thread}, this run (" in second.stderr, second.stderr


def test_codex_with_the_built_in_openai_provider_falls_back_to_http_at_once(tmp_path: Path) -> None:
    """The built-in provider first asks for a WebSocket; the proxy's 426 makes it POST at once, with no retries,
    and ``codex exec`` prints no ERROR line about it."""
    ws, session = Workspace.make(tmp_path), "codex-openai-test"
    run = codex_run(ws, _CODEX_BUILT_IN, "--session", session, "--log-level", "info")
    assert run.returncode == 0, run
    events = json_lines(run.stdout)
    check_codex_turn(events)
    # Any other answer costs "Reconnecting... n/5" error events, then a "Falling back from WebSockets" item.
    transport = [e for e in events if e.get("type") == "error" or
                 (e.get("type") == "item.completed" and e["item"]["type"] == "error"
                  and "WebSocket" in e["item"]["message"])]
    assert transport == [], transport
    assert run.stderr.count("refused a WebSocket upgrade") == 1, run.stderr  # one attempt for the whole session
    # Codex logs that refusal as an ERROR unless wrap silences its log target (proxyvisor/agents.py).
    assert "Responses WebSocket" not in run.stderr and " ERROR " not in run.stderr, run.stderr
    records = ws.ledger(session)
    assert [(r["format"], r["model"], r["status"]) for r in records] == [("responses", MODEL, 200)] * 2, records


def test_codex_through_wrap_without_supervision_writes_nothing(tmp_path: Path) -> None:
    ws = Workspace.make(tmp_path)
    run = codex_run(ws, _CODEX_OWN_PROVIDER, "--no-supervision", as_json=False)
    assert run.returncode == 0, run
    # Without --json, `codex exec` prints the final agent message alone on stdout.
    assert run.stdout.strip() == DONE, run
    assert ws.files() == []


_CODEX_DEFAULT_MODEL = _CODEX_MINE
"""The same provider and no `model`: Codex 0.171.0 then uses its default model, whose catalog entry (tool_mode
"code_mode_only", use_responses_lite) makes it send the shape of ../shared/reference/real-clients.md section 9: no
top-level `tools`, an `additional_tools` input item with namespaces, a freeform `exec` tool taking JavaScript that
runs shell commands through nested `tools.exec_command({cmd})` calls, answered as `custom_tool_call` items."""


def exec_script(command: str) -> str:
    """The JavaScript input of Codex's ``exec`` tool that runs ``command`` and prints its result."""
    return f"text(await tools.exec_command({{cmd: {json.dumps(command)}}}));"


def test_codex_with_its_default_model_is_gated_reworked_and_verified(tmp_path: Path) -> None:
    """Codex's default-model request shape, supervised: a premature "done" after an edit is held by the gate
    (no check ran), the turn continues upstream with the gap, the model runs the tests through the freeform
    ``exec`` tool, and the turn ends ``verified``. Codex runs the scripted ``custom_tool_call`` items only because
    its request declared ``exec`` as a freeform tool: a tool it did not declare gets "unsupported call"."""
    ws, session = Workspace.make(tmp_path), "codex-default-model-test"
    write = ("printf 'def add(a, b):\\n    return a + b\\n' > calc.py && printf 'import unittest\\nimport calc\\n\\n"
             "class T(unittest.TestCase):\\n    def test_add(self):\\n        self.assertEqual(calc.add(2, 3), 5)\\n'"
             " > test_calc.py")
    final = "calc.py has add(); its tests pass."

    def exec_call(command: str) -> dict[str, Any]:
        return {"tool_calls": [{"name": "exec", "input": exec_script(command)}]}

    # No [supervisor.model]: the session's own.
    config = scripted_config(tmp_path, [exec_call(write), {"text": "Done."}, exec_call("python3 -m unittest -v"),
                                        {"text": final}])
    (ws.home / "config.toml").write_text(_CODEX_DEFAULT_MODEL)
    cmd = [find_agent("codex"), "exec", "--skip-git-repo-check", "--json", "Write calc.py with add(a, b)."]
    run = wrap(ws, cmd, {"CODEX_HOME": str(ws.home), "PROXYVISOR_TEST_API_KEY": "dummy"},
               "--session", session, "--config", str(config))
    assert run.returncode == 0, run
    events = json_lines(run.stdout)
    items = [e["item"] for e in events if e.get("type") == "item.completed"]
    commands = [(i["command"], i["exit_code"]) for i in items if i["type"] == "command_execution"]
    assert [c for c, _ in commands] and all(code == 0 for _, code in commands), items
    assert "unittest" in commands[-1][0] and (ws.work / "calc.py").is_file(), commands
    messages = [i["text"] for i in items if i["type"] == "agent_message"]
    # hold = "stop" (the default): Codex read the premature text as it streamed, its turn did not end there, and
    # the reworked turn (the test run, the final answer) went on in the same response.
    assert messages == ["Done.", final], items
    records = ws.ledger(session)
    assert {r["format"] for r in records} == {"responses"}, records
    gates = [r["gate"] for r in records if r.get("gate")]
    assert gates[0]["reentries"] == 1 and gates[0]["verdicts"][0] == "gaps", gates
    assert gates[-1]["outcome"] == "verified", gates
    # The premature "done" is settled by the free evidence (no check after the edit), with no verifier call; the
    # reworked one by the verifier on the session's own route.
    assert gates[0]["decided_by"] == ["evidence"] and "route" not in gates[0], gates
    assert gates[-1]["decided_by"] == ["model"], gates
    # The built-in scripted upstream judged, whatever model Codex named: the ledger names it, not Codex's model.
    assert {(g["route"], g["model"]) for g in gates[1:]} == {("session", SCRIPTED_MODEL)}, gates


def test_codex_shows_an_unverified_answer_with_the_notice_after_it(tmp_path: Path) -> None:
    """As for Claude Code: ``codex exec`` reports each message item as the agent's message, so the unverified notice
    ends the answer's own message rather than coming as a message of its own."""
    ws, session = Workspace.make(tmp_path), "codex-notice-test"
    insisting = ["Done.", "notes.sh is written; nothing to check.", "As I said, it is written."]
    write = {"tool_calls": [{"name": "exec", "input": exec_script("printf 'milk\\n' > notes.sh")}]}
    config = scripted_config(tmp_path, [write] + [{"text": text} for text in insisting])
    (ws.home / "config.toml").write_text(_CODEX_DEFAULT_MODEL)
    cmd = [find_agent("codex"), "exec", "--skip-git-repo-check", "--json", "Write notes.sh."]
    run = wrap(ws, cmd, {"CODEX_HOME": str(ws.home), "PROXYVISOR_TEST_API_KEY": "dummy"},
               "--session", session, "--config", str(config))
    assert run.returncode == 0, run
    items = [e["item"] for e in json_lines(run.stdout) if e.get("type") == "item.completed"]
    last = [i["text"] for i in items if i["type"] == "agent_message"][-1]
    gates = [r["gate"] for r in ws.ledger(session) if r.get("gate")]
    assert gates[-1]["passed"] is False, gates
    answer, _, notice = last.rpartition("\n\n")
    assert notice == expected_notice(gates[-1]) and answer in insisting[1:], items


# --- the tool authorizer ---------------------------------------------------------------------------------------

_RAN = "pytest-ran.txt"
"""Written by the scripted test command before it runs pytest: present only if the command was executed."""


def _authorizer_config(tmp_path: Path, steps: list[dict[str, Any]], mark: str) -> Path:
    return scripted_config(tmp_path, steps, mark, "[supervisor.authorizer]\nenabled = true\n")


def _check_blocked(ws: Workspace, session: str) -> None:
    """The prohibition of the agent's first user turn blocked its one test command (Codex's environment context
    before it is no user turn)."""
    assert not (ws.work / _RAN).exists(), "the blocked command ran"
    records = ws.ledger(session)
    decisions = [d for r in records for d in (r.get("authorizer") or {}).get("decisions", [])]
    assert [(d["decision"], d["by"], d["source"]) for d in decisions] == [("block", "confirmed", "user:1")], decisions
    assert decisions[0]["quote"] == "Do not run the tests."
    assert summarize(records)["authorizer"]["blocked"] == 1


def test_claude_code_never_runs_a_command_the_user_prohibited(tmp_path: Path) -> None:
    """The user says "Do not run the tests"; the scripted model tries ``pytest``; the authorizer (judged on the
    session's own route: the scripted upstream's fixed policy) blocks it, the turn continues upstream with the
    tool error, and Claude Code gets the model's continued answer and ends. The command never ran."""
    ws, session = Workspace.make(tmp_path), "claude-authz-test"
    mark = "[task:authz]"
    final = "I left the tests alone, as you asked."
    config = _authorizer_config(tmp_path, [
        {"tool_calls": [{"name": "Bash", "arguments": {"command": f"touch {_RAN} && pytest -q",
                                                       "description": "run the tests"}}]},
        {"text": final}], mark)
    cmd = [find_agent("claude"), "-p", f"Explain what calc.py does. Do not run the tests. {mark}", "--model", MODEL,
           "--output-format", "json", "--allowedTools", "Bash"]
    run = proxyvisor(ws, ["wrap", "--config", str(config), "--state-dir", str(ws.state), "--session", session, "--",
                          *cmd], claude_env(ws))
    assert run.returncode == 0, run
    result = json.loads(run.stdout)
    assert (result["subtype"], result["is_error"], result["result"]) == ("success", False, final), result
    _check_blocked(ws, session)


def test_claude_code_never_writes_a_file_when_the_user_says_read_only(tmp_path: Path) -> None:
    """The user says "Read-only: no edits."; the scripted model reads a file and writes one in the same batch. The
    read reaches Claude Code ("read-only" forbids changing, not reading); the write is
    blocked, so the file is never written, and the model sees the blocked call with its error in its own turn when
    Claude Code sends the read's result; the session ends with the model's answer."""
    ws, session = Workspace.make(tmp_path), "claude-authz-readonly"
    mark = "[task:authz-ro]"
    final = "It only holds a greeting; I changed nothing, as you asked."
    notes = ws.work / "notes.md"
    config = _authorizer_config(tmp_path, [
        {"tool_calls": [{"name": "Read", "arguments": {"file_path": str(ws.work / MARKER)}},
                        {"name": "Write", "arguments": {"file_path": str(notes), "content": "a summary\n"}}]},
        {"text": final}], mark)
    cmd = [find_agent("claude"), "-p", f"Tell me what {MARKER} holds. Read-only: no edits. {mark}", "--model", MODEL,
           "--output-format", "json", "--allowedTools", "Read", "Write"]
    run = proxyvisor(ws, ["wrap", "--config", str(config), "--state-dir", str(ws.state), "--session", session, "--",
                          *cmd], claude_env(ws))
    assert run.returncode == 0, run
    result = json.loads(run.stdout)
    assert (result["subtype"], result["is_error"], result["result"]) == ("success", False, final), result
    assert not notes.exists(), "the blocked write ran"
    records = ws.ledger(session)
    decisions = {d["tool"]: d for r in records for d in (r.get("authorizer") or {}).get("decisions", [])}
    assert (decisions["Write"]["decision"], decisions["Write"]["by"], decisions["Write"]["source"],
            decisions["Write"]["quote"]) == ("block", "confirmed", "user:1", "Read-only: no edits."), decisions
    # The read is pre-screened, or judged when its path holds a word of the rule (this test's folder, "writes"):
    # either way it is never blocked.
    assert decisions.get("Read", {"decision": "allow"})["decision"] == "allow", decisions
    assert summarize(records)["authorizer"]["blocked"] == 1


def test_codex_never_runs_a_command_the_user_prohibited(tmp_path: Path) -> None:
    """As for Claude Code, through Codex's ``exec_command`` tool (Responses format)."""
    ws, session = Workspace.make(tmp_path), "codex-authz-test"
    mark = "[task:authz]"
    final = "I left the tests alone, as you asked."
    config = _authorizer_config(tmp_path, [
        {"tool_calls": [{"name": "exec_command", "arguments": {"cmd": f"touch {_RAN} && pytest -q"}}]},
        {"text": final}], mark)
    (ws.home / "config.toml").write_text(_CODEX_OWN_PROVIDER)
    cmd = [find_agent("codex"), "exec", "--skip-git-repo-check", "--json",
           f"Explain what calc.py does. Do not run the tests. {mark}"]
    run = wrap(ws, cmd, {"CODEX_HOME": str(ws.home), "PROXYVISOR_TEST_API_KEY": "dummy"},
               "--session", session, "--config", str(config))
    assert run.returncode == 0, run
    events = json_lines(run.stdout)
    items = [e["item"] for e in events if e.get("type") == "item.completed"]
    assert [i for i in items if i["type"] == "command_execution"] == [], items
    assert [i["text"] for i in items if i["type"] == "agent_message"][-1] == final, items
    assert events[-1]["type"] == "turn.completed", events[-1]
    _check_blocked(ws, session)


# --- rate limits ---------------------------------------------------------------------------------------------

def rate_limited(ws: Workspace) -> str:
    """A proxyvisor config whose scripted upstream answers the first two model requests 429 with Retry-After 1,
    then plays its auto mode; returns the config file's path. The second 429 is the failed probe: it cools the
    pool 2 s while it tells the agent 1 s, so an agent that retries after 1 s meets proxyvisor's own 429."""
    limit = {"fault": {"status": 429, "retry_after": "1", "message": "rate limited"}}
    folder = ws.home / "proxyvisor"  # beside, not over, an agent's own config.toml in its home (Codex's)
    folder.mkdir()
    return str(scripted_config(folder, [limit, limit]))


def check_no_request_during_the_cooldown(ws: Workspace, session: str) -> None:
    """The ledger: the upstream's 429 tripped the pool, every request until the cooldown ended was answered by
    proxyvisor without reaching the upstream (``refused``), then exactly one probe, then healthy answers."""
    lines = [r["upstream"] for r in ws.ledger(session)]
    assert (lines[0]["outcome"], lines[0]["health_state"]) == ("failed", "healthy"), lines
    probes = [i for i, u in enumerate(lines) if u["health_probe"]]
    assert [lines[i]["outcome"] for i in probes] == ["failed", "answered"], lines
    for start, end in ((1, probes[0]), (probes[0] + 1, probes[1])):  # the two cooldowns
        assert {u["outcome"] for u in lines[start:end]} <= {"refused"}, lines
    assert {u["outcome"] for u in lines[probes[1]:]} == {"answered"}, lines


def test_claude_code_waits_out_a_rate_limit_that_proxyvisor_keeps_from_the_upstream(tmp_path: Path) -> None:
    ws, session = Workspace.make(tmp_path), "claude-limited"
    run = claude_run(ws, "stream-json", "--session", session, "--config", rate_limited(ws))
    assert run.returncode == 0, run
    final = json_lines(run.stdout)[-1]
    assert (final["type"], final["subtype"], final["result"]) == ("result", "success", DONE), final
    check_no_request_during_the_cooldown(ws, session)


def test_codex_waits_out_a_rate_limit_that_proxyvisor_keeps_from_the_upstream(tmp_path: Path) -> None:
    ws, session = Workspace.make(tmp_path), "codex-limited"
    run = codex_run(ws, _CODEX_OWN_PROVIDER, "--session", session, "--config", rate_limited(ws))
    assert run.returncode == 0, run
    check_codex_turn(json_lines(run.stdout))
    check_no_request_during_the_cooldown(ws, session)


def test_claude_code_run_whose_user_states_a_secret_leaves_it_in_no_memory_file(tmp_path: Path) -> None:
    """A ``wrap`` run of Claude Code whose prompt is a durable instruction holding a cloud secret key: learning
    stores no rule or experience holding it: no memory file holds the key. (The session's supervision state holds
    the session's content by design, for its TTL: ``proxyvisor.proxy.session_state``.)"""
    from proxyvisor.proxy.learning import FOLDER

    ws, key = Workspace.make(tmp_path), "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"
    prompt = f"Always export AWS_SECRET_ACCESS_KEY={key} before deploying. List files."
    cmd = [find_agent("claude"), "-p", prompt, "--model", MODEL, "--output-format", "json"]
    run = wrap(ws, cmd, claude_env(ws), "--session", "secret-0")
    assert run.returncode == 0, run
    assert list((ws.state / FOLDER).iterdir()), "learning stored the run's records"
    holding = [p for p in (ws.state / FOLDER).rglob("*") if p.is_file() and key.encode() in p.read_bytes()]
    assert holding == [], holding


def test_claude_code_recalls_in_its_next_run_the_rule_the_user_stated_in_one_folder(tmp_path: Path) -> None:
    """Two ``wrap`` runs of Claude Code in one folder: the second run's first request that can take a note carries
    the rule the user stated in the first (``[supervisor.learning]``, on by default; the scope: the folder)."""
    from proxyvisor.learning.memory import RULE, Memory
    from proxyvisor.proxy.learning import FOLDER

    ws = Workspace.make(tmp_path)
    rule = "Always use uv, never pip."
    for n, prompt in enumerate((f"{rule} List the files in the current directory.", "List the files again.")):
        cmd = [find_agent("claude"), "-p", prompt, "--model", MODEL, "--output-format", "json"]
        run = wrap(ws, cmd, claude_env(ws), "--session", f"learn-{n}")
        assert run.returncode == 0, run
    (path,) = (ws.state / FOLDER).iterdir()
    memory = Memory.decode(path.read_bytes())
    assert memory.scope == str(ws.work.resolve())
    (stored,) = [r for r in memory.records.values() if r.kind == RULE]
    assert stored.text == rule and stored.session == "learn-0"
    # Recalled once, on the first request that offers tools, before the model's first action: Claude Code's first
    # request ends with a system item of its own, and the note goes before it, after the user's message.
    lines = ws.ledger("learn-1")
    recalled = [(n, line["learning"]) for n, line in enumerate(lines) if "recalled" in line.get("learning", {})]
    assert len(recalled) == 1 and stored.id in recalled[0][1]["recalled"], lines
    assert recalled[0][0] < next(n for n, line in enumerate(lines) if line.get("tool_round")), lines


# --- opencode --------------------------------------------------------------------------------------------------

_OPENCODE_COMMON: dict[str, Any] = {"autoupdate": False, "share": "disabled"}
_OPENCODE_OWN_PROVIDER = {**_OPENCODE_COMMON, "model": f"mine/{MODEL}", "provider": {"mine": {
    "npm": "@ai-sdk/openai-compatible", "name": "mine",
    "options": {"baseURL": "{env:OPENAI_BASE_URL}", "apiKey": "dummy"},
    "models": {MODEL: {"name": MODEL, "tool_call": True}}}}}
"""A provider of the user's own whose base URL follows ``OPENAI_BASE_URL``, as the README says to write it: Chat
Completions."""
BUILT_IN_MODEL = "gpt-4.1"
"""A model opencode's built-in ``openai`` provider knows offline (it refuses one it does not list)."""
_OPENCODE_BUILT_IN = {**_OPENCODE_COMMON, "model": f"openai/{BUILT_IN_MODEL}"}
"""The built-in ``openai`` provider (API key from ``OPENAI_API_KEY``): the Responses API."""
ANTHROPIC_MODEL = "claude-sonnet-4-5"
_OPENCODE_ANTHROPIC = {**_OPENCODE_COMMON, "model": f"anthropic/{ANTHROPIC_MODEL}"}
"""The built-in ``anthropic`` provider (API key from ``ANTHROPIC_API_KEY``): Messages, at ``ANTHROPIC_BASE_URL``
with ``/messages`` appended (the AI SDK's reading of that variable: no ``/v1`` added)."""


def opencode_env(ws: Workspace, config: dict[str, Any]) -> dict[str, str]:
    """opencode's environment: ``config`` as its config file, its data (where ``--continue`` finds the last session)
    in the workspace, and the model list, LSP downloads and update checks off, so nothing leaves loopback."""
    path = ws.home / "opencode.json"
    path.write_text(json.dumps(config))
    return {"OPENCODE_CONFIG": str(path), "OPENCODE_DISABLE_AUTOUPDATE": "1", "OPENCODE_DISABLE_MODELS_FETCH": "1",
            "OPENCODE_DISABLE_LSP_DOWNLOAD": "1", "XDG_CONFIG_HOME": str(ws.home / "config"),
            "XDG_DATA_HOME": str(ws.home / "data"), "XDG_STATE_HOME": str(ws.home / "state"),
            "XDG_CACHE_HOME": str(ws.home / "cache"), "OPENAI_API_KEY": "dummy", "ANTHROPIC_API_KEY": "dummy"}


def opencode(*args: str) -> list[str]:
    return [find_agent("opencode"), "run", "--format", "json", *args]


def check_opencode_turn(events: list[dict[str, Any]]) -> str:
    """``opencode run --format json`` events show one ``ls`` run through its ``bash`` tool with the marker in its
    output, then :data:`DONE`; returns the session id every event carries."""
    tools = [e["part"] for e in events if e.get("type") == "tool_use"]
    assert [(t["tool"], t["state"]["input"].get("command"), t["state"]["status"]) for t in tools] == [
        ("bash", "ls", "completed")], tools
    assert MARKER in tools[0]["state"]["output"], tools
    texts = [e["part"]["text"] for e in events if e.get("type") == "text"]
    assert texts and texts[-1] == DONE, events
    (session,) = {e["sessionID"] for e in events}
    return str(session)


def test_opencode_completes_a_tool_call_turn_through_wrap(tmp_path: Path) -> None:
    """A provider of the user's own, written as the README says: the requests go through the proxy (Chat
    Completions), in opencode's own session (its ``x-session-id``), its title request included."""
    ws = Workspace.make(tmp_path)
    run = wrap(ws, opencode("List the files in the current directory."), opencode_env(ws, _OPENCODE_OWN_PROVIDER))
    assert run.returncode == 0, run
    session = check_opencode_turn(json_lines(run.stdout))
    assert session.startswith("ses_"), session
    check_ledger(ws, session, "chat")
    assert len(ws.ledger(session)) == 3  # the title request, then the turn's two
    assert f"proxyvisor: session {session}: 3 model requests (chat)" in run.stderr, run.stderr


@pytest.mark.parametrize(("config", "fmt", "model"), [(_OPENCODE_BUILT_IN, "responses", BUILT_IN_MODEL),
                                                      (_OPENCODE_ANTHROPIC, "messages", ANTHROPIC_MODEL)],
                         ids=["openai", "anthropic"])
def test_opencode_with_a_built_in_provider_goes_through_wrap(tmp_path: Path, config: dict[str, Any], fmt: str,
                                                              model: str) -> None:
    """The built-in ``openai`` provider follows ``OPENAI_BASE_URL`` and speaks the Responses API; the ``anthropic``
    one follows ``ANTHROPIC_BASE_URL``, which ``wrap`` sets as Claude Code reads it (no ``/v1``), and sends
    ``/messages`` there: the proxy takes it as ``/v1/messages``."""
    ws = Workspace.make(tmp_path)
    run = wrap(ws, opencode("List the files in the current directory."), opencode_env(ws, config))
    assert run.returncode == 0, run
    session = check_opencode_turn(json_lines(run.stdout))
    records = ws.ledger(session)
    assert {(r["format"], r["status"]) for r in records} == {(fmt, 200)}, records
    # The turn's two requests, and the title request on the provider's own small model.
    assert len(records) == 3 and [r["model"] for r in records].count(model) == 2, records


def test_opencode_continued_in_a_second_wrap_run_goes_on_in_its_session(tmp_path: Path) -> None:
    """``opencode run --continue`` keeps its session id: the second ``wrap`` run's requests join the session of the
    first, and ``/info`` asked in the continued conversation counts both runs."""
    ws = Workspace.make(tmp_path)
    env = opencode_env(ws, _OPENCODE_OWN_PROVIDER)
    first = wrap(ws, opencode("List the files in the current directory."), env)
    assert first.returncode == 0, first
    session = check_opencode_turn(json_lines(first.stdout))
    runs = " && ".join(shlex.join(opencode("--continue", prompt)) for prompt in ("List the files again.", "/info"))
    second = wrap(ws, ["sh", "-c", runs], env)
    assert second.returncode == 0, second
    events = json_lines(second.stdout)
    assert {e["sessionID"] for e in events} == {session}, events
    *work, info = [e["part"]["text"] for e in events if e.get("type") == "text"]
    assert work[-1] == DONE, work
    assert f"**proxyvisor /info · session {session}**" in info, info
    assert "| model requests   | 5 (tool rounds 2, errors 0); in 2 wrap runs |" in info, info
    assert [p.name for p in (ws.state / "ledger").iterdir()] == [f"{session}.jsonl"]
    assert len({line["run"] for line in ws.ledger(session)}) == 2
    assert f"proxyvisor: session {session}, this run (" in second.stderr, second.stderr


def test_opencode_premature_done_is_reworked_and_verified_by_the_sessions_own_model(tmp_path: Path) -> None:
    """No ``[supervisor.model]``: the verifier is the session's own route (the scripted upstream in Chat
    Completions). A "done" right after an edit gets the evidence gap (no check after the edit), the turn goes on in
    the same stream, the model runs the check, and the turn ends ``verified``. opencode's title request, sent beside
    the turn's first request with the same prompt, offers no tools and so takes none of the script's steps."""
    ws, session = Workspace.make(tmp_path), "opencode-gate-test"
    config = premature_done_script(tmp_path, "bash")
    run = proxyvisor(ws, ["wrap", "--config", str(config), "--state-dir", str(ws.state), "--session", session, "--",
                          *opencode(f"Write calc.py with add(a, b). {GATE_MARK}")],
                     opencode_env(ws, _OPENCODE_OWN_PROVIDER))
    assert run.returncode == 0, run
    events = json_lines(run.stdout)
    commands = [e["part"]["state"]["input"]["command"] for e in events if e.get("type") == "tool_use"]
    assert [c.split()[0] for c in commands] == ["printf", "python3"], commands
    assert [e["part"]["text"] for e in events if e.get("type") == "text"][-1] == GATE_FINAL, events
    assert (ws.work / "calc.py").read_text() == GATE_SOURCE
    gates = [line["gate"] for line in ws.ledger(session) if line.get("gate")]
    assert [(g.get("reentries"), g.get("decided_by")) for g in gates] == [(1, ["evidence"]), (0, ["model"])], gates
    assert (gates[-1]["outcome"], gates[-1]["route"]) == ("verified", "session"), gates
