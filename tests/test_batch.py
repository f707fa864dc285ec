"""``proxyvisor batch`` end to end: the shipped example batch (``examples/batch``: the example agent against the
scripted upstream, each task's prompt carrying a marker that picks its own script) gives each task the outcome it
was written for, and the JSONL and Markdown reports say the same; ``--require-verified``, ``--parallel``,
timeouts, Ctrl-C and bad task files.

The batches run in this process through ``proxyvisor.cli.main`` (the agents are real child processes), except
the Ctrl-C test, which needs a process to signal.
"""

from __future__ import annotations

import json
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from proxyvisor.scripted.upstream import ScriptedUpstream, load_script
from proxyvisor.batch import MAX_ARG_STRLEN, Task, agent_argv, check_template, load_tasks
from proxyvisor.batch_report import COLUMNS
from proxyvisor.cli import main
from proxyvisor.detectors.selfreport import strip

from helpers import alive, expected_notice, http_client, request_body, serve_handler

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "batch"
AGENT = f"{shlex.quote(sys.executable)} -m proxyvisor.example_agent {{prompt}}"

# What each example task was scripted to do (examples/batch/script.jsonl), as its report line must show it.
_KEYS = ("outcome", "exit_code", "gate_rounds", "gaps", "reentries", "nudges", "detector_fires", "steers", "requests")
EXPECTED = {
    "edit-and-test": ("verified", 0, 1, 0, 0, 0, 0, 0, 3),  # writes, tests, done: passes at once
    "nudged": ("verified", 0, 1, 0, 0, 1, 0, 0, 3),  # stops "progressing": nudged on by the headless pre-check
    "rework": ("verified", 0, 1, 1, 1, 0, 0, 0, 3),  # "done" untested: evidence gap, re-entry, tests, model passes
    "question": ("unknown", 0, 1, 0, 0, 0, 0, 0, 1),  # nothing changed: passed on reading alone
    # Only insists: the evidence asks for the checks once, then the model judges the insisting answers (2 rounds,
    # gaps each time); the budget of 2 re-entries spent.
    "no-check": ("unverified", 0, 2, 3, 2, 0, 0, 0, 2),
    "failing-check": ("failed", 0, 0, 2, 1, 0, 1, 1, 4),  # the same failing test after re-entry: the same gap
    "crash": ("no_verdict", 1, 0, 0, 0, 0, 0, 0, 1),  # the model endpoint refuses: the agent exits 1
}
FILES = {"edit-and-test": "calc.py", "nudged": "hello.py", "rework": "greet.py", "no-check": "notes.txt",
         "failing-check": "sub.py"}


def batch(tmp_path: Path, tasks: Path | str, *args: str, agent: str = AGENT) -> tuple[int, list[dict[str, Any]], str]:
    """Run ``proxyvisor batch`` with the example configuration in the repository; returns (exit status, the JSONL
    report, the Markdown report)."""
    prefix = tmp_path / "report"
    code = main(["batch", str(tasks), "--config", str(EXAMPLE / "config.toml"), "--agent", agent,
                 "--workdir-template", str(tmp_path / "runs" / "{id}"), "--report", str(prefix), *args])
    jsonl = prefix.with_suffix(".jsonl")
    lines = [json.loads(line) for line in jsonl.read_text().splitlines()] if jsonl.exists() else []
    md = prefix.with_suffix(".md").read_text() if prefix.with_suffix(".md").exists() else ""
    return code, lines, md


@pytest.fixture(autouse=True)
def in_repo(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)


def final_answers() -> dict[str, str]:
    """Each example task's last scripted text, without its self-report: what its agent prints last."""
    answers = {}
    for step in load_script(EXAMPLE / "script.jsonl"):
        if "text" in step:
            answers[step["marker"].removeprefix("[task:").removesuffix("]")] = strip(step["text"])[0].strip()
    return answers


def markdown_rows(md: str) -> dict[str, dict[str, str]]:
    """The main table of a Markdown report: task id (or ``**total**``) -> {heading: cell}."""
    headings = [head for head, _ in COLUMNS]
    header = "| " + " | ".join(headings) + " |"
    lines = md.splitlines()
    start = lines.index(header) + 2
    rows = {}
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split(" | ")]
        assert len(cells) == len(headings), line
        rows[cells[0]] = dict(zip(headings, cells))
    return rows


def test_the_example_batch_gives_every_task_its_outcome_and_both_reports_agree(
        tmp_path: Path, state_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, report, md = batch(tmp_path, EXAMPLE / "tasks.jsonl", "--parallel", "4", "--state-dir", str(state_dir))
    assert code == 1  # the crash task's agent exited 1
    assert [r["id"] for r in report] == list(EXPECTED)  # task-file order, whatever order they finished in
    answers = final_answers()
    for r in report:
        assert tuple(r[k] for k in _KEYS) == EXPECTED[r["id"]], r
        assert r["session"].startswith(r["id"] + "-")
        ledger = state_dir / "ledger" / f"{r['session']}.jsonl"
        assert len(ledger.read_text().splitlines()) == r["requests"]
        assert Path(r["workdir"]) == tmp_path / "runs" / r["id"]
        assert sorted(p.name for p in Path(r["workdir"]).iterdir() if p.suffix != ".pyc" and p.name != "__pycache__") \
            == ([FILES[r["id"]]] if r["id"] in FILES else [])
        stdout = Path(r["stdout"]).read_text()
        assert "<sup>" not in stdout
        assert r["seconds"] > 0
        if r["id"] == "crash":
            # Every request was refused (400): no answer of the scripted model, nothing spent, so the cost is known.
            assert (r["input_tokens"], r["output_tokens"], r["cost_usd"], r["cost_known"]) == (0, 0, 0.0, True)
            assert r["error"] == "example_agent: the model call failed: Error code: 400 - scripted: this task's " \
                                 "model refuses every request"
            assert stdout == "" and r["error"] in Path(r["stderr"]).read_text()
        else:
            # The scripted model reports none, the ledger counts its tokens; its answers are never priced.
            assert r["input_tokens"] > 0 and r["output_tokens"] > 0 and (r["cost_usd"], r["cost_known"]) == (0.0, False)
            assert r["error"] is None
            out = stdout.strip()
            if r["outcome"] in ("failed", "unverified"):  # delivered not passed under fail_closed: the notice
                gate = [line["gate"] for line in map(json.loads, ledger.read_text().splitlines()) if line.get("gate")]
                notice = expected_notice(gate[-1])
                assert out.endswith("\n\n" + notice) and out.count(notice) == 1
                out = out.removesuffix(notice).rstrip()
            assert out == answers[r["id"]]
    # The Markdown table shows the same values, and totals that add up.
    rows = markdown_rows(md)
    for r in report:
        row = rows[r["id"]]
        for heading, field in COLUMNS:
            if field == "cost_usd" and not r["cost_known"] and not r["cost_usd"]:
                assert row[heading] == "not priced", r["id"]
            elif field in ("cost_usd", "seconds"):
                # Rounded to 1 decimal (seconds) or 4 (cost); 0.051 as a float's half-way case (1.25) may round down.
                assert float(row[heading].rstrip("*")) == pytest.approx(r[field], abs=0.051), (r["id"], field)
            elif r[field] is None:
                assert row[heading] == "–"
            else:
                assert row[heading] == str(r[field]).replace("|", "\\|"), (r["id"], field)
    total = rows["**total**"]
    for heading, field in COLUMNS:
        if field in ("gate_rounds", "gaps", "reentries", "nudges", "detector_fires", "steers", "requests",
                     "input_tokens", "output_tokens"):
            assert int(total[heading]) == sum(r[field] for r in report), heading
    assert total["outcome"] == "3 of 7 verified" and total["cost (USD)"] == "not priced"
    # The report quotes the agents' output: private, as the state directory is.
    for path in (md_path := Path(report[0]["stdout"]).parent, *md_path.iterdir()):
        assert path.stat().st_mode & 0o077 == 0, path
    assert "- outcomes: verified 3, unknown 1, failed 1, unverified 1, no_verdict 1" in md
    for r in report:  # the second table: where each task's session and files are
        assert f"| {r['id']} | {r['session']} | {r['workdir']} | {r['stdout']} | {r['stderr']} |" in md
    assert "- wall time: " in md and "- require verified: no" in md
    err = capsys.readouterr().err
    assert "edit-and-test: verified, exit 0" in err and "crash: no_verdict, exit 1" in err
    assert "done 7/7 · verified 3 · running 0" in err  # not "7/7 verified 3"


def subset(tmp_path: Path, *ids: str) -> Path:
    """A task file holding the example tasks ``ids`` (the script still picks their steps by marker)."""
    tasks = {json.loads(line)["id"]: line for line in (EXAMPLE / "tasks.jsonl").read_text().splitlines()}
    path = tmp_path / "tasks.jsonl"
    path.write_text("".join(tasks[i] + "\n" for i in ids))
    return path


def test_require_verified_exits_0_only_when_every_task_is_verified(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, report, md = batch(tmp_path / "a", subset(tmp_path, "edit-and-test", "rework"), "--require-verified")
    assert code == 0 and [r["outcome"] for r in report] == ["verified", "verified"]
    assert "- require verified: yes: 2 of 2 verified" in md
    assert "not verified" not in capsys.readouterr().err
    code, report, md = batch(tmp_path / "b", subset(tmp_path, "edit-and-test", "question"), "--require-verified",
                             "--parallel", "2")
    assert [(r["outcome"], r["exit_code"]) for r in report] == [("verified", 0), ("unknown", 0)]
    assert code == 1  # every agent exited 0: only --require-verified fails it, and says so
    assert "--require-verified: 1 of 2 tasks not verified (outcome verified with exit 0): question (unknown, " \
           "exit 0)" in capsys.readouterr().err
    assert "- require verified: yes: 1 of 2 verified" in md


def test_the_example_runs_from_any_folder_and_its_gate_messages_are_not_warnings(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """The example configuration names its script relative to itself (config.py resolves it against the file's
    folder); an expected outcome ("unverified") is logged as info, not as a warning among the task lines."""
    import logging

    from proxyvisor.config import load

    monkeypatch.chdir(tmp_path)
    assert load(str(EXAMPLE / "config.toml")).upstreams[0].script == str(EXAMPLE / "script.jsonl")
    caplog.set_level(logging.INFO)
    code, report, _ = batch(tmp_path, subset(tmp_path, "question", "no-check"))
    assert code == 0 and [r["outcome"] for r in report] == ["unknown", "unverified"]
    gate = [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "proxyvisor.gate"]
    assert any(level == "INFO" and text.startswith("turn unverified") for level, text in gate), gate
    assert not [g for g in gate if g[0] == "WARNING"]


def test_a_task_whose_folder_cannot_be_made_fails_alone_and_the_report_is_written(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps({"id": "bad", "prompt": "x", "workdir": "/proc/nope"}) + "\n"
                     + json.dumps({"id": "good", "prompt": "y"}) + "\n")
    code, report, md = batch(tmp_path, tasks, agent="true {prompt}")
    assert code == 1
    assert [(r["id"], r["outcome"], r["exit_code"], r["error"]) for r in report] == [
        ("bad", "no_verdict", None, "cannot make the working directory /proc/nope: No such file or directory"),
        ("good", "no_verdict", 0, None)]
    assert "| bad | no_verdict |" in md
    assert "bad: no_verdict, exit –" in capsys.readouterr().err
    # The same from --workdir-template: every task fails on its own, and the report still comes out.
    prefix = tmp_path / "again"
    code = main(["batch", str(tasks), "--agent", "true {prompt}", "--workdir-template", "/proc/{id}",
                 "--report", str(prefix)])
    report = [json.loads(line) for line in prefix.with_suffix(".jsonl").read_text().splitlines()]
    assert code == 1 and [r["error"] for r in report] == [
        "cannot make the working directory /proc/nope: No such file or directory",
        "cannot make the working directory /proc/good: No such file or directory"]


def test_a_relative_template_is_relative_to_the_current_folder_and_a_tasks_workdir_to_its_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "tasks").mkdir()
    tasks = tmp_path / "tasks" / "tasks.jsonl"
    tasks.write_text(json.dumps({"id": "own", "prompt": "x", "workdir": "mine"}) + "\n"
                     + json.dumps({"id": "templated", "prompt": "y"}) + "\n")
    (tmp_path / "here").mkdir()
    monkeypatch.chdir(tmp_path / "here")
    code = main(["batch", str(tasks), "--agent", "true {prompt}", "--workdir-template", "runs/{id}",
                 "--report", str(tmp_path / "report")])
    report = [json.loads(line) for line in (tmp_path / "report.jsonl").read_text().splitlines()]
    assert code == 0 and {r["id"]: r["workdir"] for r in report} == {
        "own": str(tmp_path / "tasks" / "mine"), "templated": str(tmp_path / "here" / "runs" / "templated")}


def test_a_report_folder_that_cannot_be_made_is_refused_before_anything_runs(
        tmp_path: Path, state_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tasks = subset(tmp_path, "question")
    code = main(["batch", str(tasks), "--agent", "true {prompt}", "--report", "/proc/x/r",
                 "--workdir-template", str(tmp_path / "runs" / "{id}")])
    assert code == 2
    assert "--report: cannot make the folder /proc/x: No such file or directory" in capsys.readouterr().err
    assert not state_dir.exists() and not (tmp_path / "runs").exists()


def test_without_a_supervisor_model_the_report_names_the_sessions_own_route(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tasks = subset(tmp_path, "question")
    prefix = tmp_path / "report"
    code = main(["batch", str(tasks), "--agent", "true {prompt}", "--report", str(prefix),
                 "--workdir-template", str(tmp_path / "runs" / "{id}")])
    assert code == 0
    md = prefix.with_suffix(".md").read_text()
    assert "the session's own (each request's upstream and model)" in md and "idle" not in md


# An agent that proves how many tasks run at once. Agents arrive in groups of `want` (by arrival order, a file in
# arrived/ that stays): each waits (at most 20 s) until its whole group has arrived, which it can only see if they
# run at the same time; it exits 0 if they did, and records the most agents it saw running (files in running/).
_GATHER = """\
import os, sys, time
folder, want, me = sys.argv[1], int(sys.argv[2]), os.environ["PROXYVISOR_TASK_ID"]
for sub in ("arrived", "running"):
    os.makedirs(os.path.join(folder, sub), exist_ok=True)
open(os.path.join(folder, "running", me), "w").close()
open(os.path.join(folder, "arrived", me), "w").close()
group_end = (len(os.listdir(os.path.join(folder, "arrived"))) - 1) // want * want + want
most = 0
deadline = time.monotonic() + 20
while time.monotonic() < deadline:
    most = max(most, len(os.listdir(os.path.join(folder, "running"))))
    if len(os.listdir(os.path.join(folder, "arrived"))) >= group_end:
        break
    time.sleep(0.01)
met = len(os.listdir(os.path.join(folder, "arrived"))) >= group_end
most = max(most, len(os.listdir(os.path.join(folder, "running"))))
with open(os.path.join(folder, "most-" + me), "w") as f:
    f.write(str(most))
os.remove(os.path.join(folder, "running", me))
sys.exit(0 if met else 3)
"""


def test_parallel_runs_that_many_tasks_at_once_and_no_more(tmp_path: Path) -> None:
    (tmp_path / "gather.py").write_text(_GATHER)
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({"id": f"t{n}", "prompt": f"task {n}"}) + "\n" for n in range(4)))
    agent = f"{shlex.quote(sys.executable)} {tmp_path / 'gather.py'} {tmp_path / 'shared'} 2 {{prompt}}"
    code, report, _ = batch(tmp_path, tasks, "--parallel", "2", agent=agent)
    assert code == 0, report
    assert [(r["id"], r["exit_code"], r["outcome"], r["requests"]) for r in report] == \
        [(f"t{n}", 0, "no_verdict", 0) for n in range(4)]
    assert max(int((tmp_path / "shared" / f"most-t{n}").read_text()) for n in range(4)) == 2


# An agent that starts a helper in its process group, notes both pids in its working directory, then hangs.
_HANG = "sh -c 'sleep 60 & echo $! > {workdir}/child.pid; echo $$ > {workdir}/agent.pid; : {prompt}; wait'"


def test_a_task_past_its_timeout_is_stopped_with_its_whole_process_group(tmp_path: Path) -> None:
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps({"id": "hangs", "prompt": "wait", "timeout_s": 1}) + "\n"
                     + json.dumps({"id": "quick", "prompt": "hello"}) + "\n")
    code, report, _ = batch(tmp_path, tasks, agent=_HANG.replace("wait'", "[ {id} = quick ] || wait'"))
    assert code == 1
    hung, quick = report
    assert (hung["error"], hung["exit_code"], hung["outcome"]) == ("timed out after 1 s", 128 + signal.SIGTERM,
                                                                   "no_verdict")
    assert (quick["error"], quick["exit_code"]) == (None, 0)
    for name in ("agent.pid", "child.pid"):
        assert not alive(int((tmp_path / "runs" / "hangs" / name).read_text()))
    # quick's own helper was left running when its agent exited: the batch killed it.
    assert not alive(int((tmp_path / "runs" / "quick" / "child.pid").read_text()))


def test_ctrl_c_stops_the_running_agent_and_reports_what_started(tmp_path: Path) -> None:
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({"id": f"t{n}", "prompt": "wait"}) + "\n" for n in range(2)))
    prefix = tmp_path / "report"
    proc = subprocess.Popen(
        [sys.executable, "-m", "proxyvisor", "batch", str(tasks), "--agent", _HANG, "--report", str(prefix),
         "--workdir-template", str(tmp_path / "runs" / "{id}")],
        cwd=tmp_path, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        started = tmp_path / "runs" / "t0" / "agent.pid"
        deadline = time.monotonic() + 60
        while not (started.exists() and started.read_text().strip()) and time.monotonic() < deadline:
            time.sleep(0.05)
        if not started.exists():
            proc.kill()
            pytest.fail(f"the first agent never started; stderr:\n{proc.communicate()[1]}")
        proc.send_signal(signal.SIGINT)
        _out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    report = [json.loads(line) for line in prefix.with_suffix(".jsonl").read_text().splitlines()]
    assert [(r["id"], r["error"], r["outcome"], r["exit_code"]) for r in report] == \
        [("t0", "interrupted", "no_verdict", 128 + signal.SIGTERM)]  # t1 never started (--parallel 1)
    for name in ("agent.pid", "child.pid"):
        assert not alive(int((tmp_path / "runs" / "t0" / name).read_text()))
    assert "- interrupted: by SIGINT after 1 of 2 tasks started" in prefix.with_suffix(".md").read_text()
    assert "SIGINT: stopping the running agents" in err


@pytest.mark.parametrize(("content", "message"), [
    ('{"id": "a", "prompt": "x"}\n{not json\n', r"tasks.jsonl:2: not JSON"),
    ('\n["a", "x"]\n', r"tasks.jsonl:2: a task must be a JSON object, got an array"),
    ('{"prompt": "x"}\n', r"tasks.jsonl:1: 'id' must be 1-64 of"),
    ('{"id": "../up", "prompt": "x"}\n', r"tasks.jsonl:1: 'id' must be 1-64 of"),
    ('{"id": "a"}\n', r"tasks.jsonl:1: 'prompt' must be a non-empty string"),
    ('{"id": "a", "prompt": "x", "promt": "y"}\n', r"tasks.jsonl:1: unknown key\(s\) \['promt'\]"),
    ('{"id": "a", "prompt": "x", "timeout_s": 0}\n', r"tasks.jsonl:1: 'timeout_s' must be a positive number"),
    ('{"id": "a", "prompt": "x", "env": {"A": 1}}\n', r"tasks.jsonl:1: 'env' must be an object"),
    ('{"id": "a", "prompt": "x"}\n\n{"id": "a", "prompt": "y"}\n',
     r"tasks.jsonl:3: task id 'a' is already used on line 1"),
    ("\n\n", r"tasks.jsonl: no tasks"),
    ('{"id": "a", "prompt": "a\\u0000b"}\n', r"tasks.jsonl:1: prompt contains a NUL byte"),
    ('{"id": "a", "prompt": "x", "env": {"X": "a\\u0000b"}}\n', r"tasks.jsonl:1: env 'X' contains a NUL byte"),
    ('{"id": "a", "prompt": "x", "workdir": "w\\u0000"}\n', r"tasks.jsonl:1: workdir contains a NUL byte"),
])
def test_a_bad_task_file_is_refused_naming_the_line_before_anything_runs(
        tmp_path: Path, state_dir: Path, capsys: pytest.CaptureFixture[str], content: str, message: str) -> None:
    import re

    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(content)
    code, report, md = batch(tmp_path, tasks)
    assert code == 2
    assert re.search(message, capsys.readouterr().err)
    assert (report, md) == ([], "") and not state_dir.exists() and not (tmp_path / "runs").exists()


@pytest.mark.parametrize(("agent", "message"), [
    ("my-agent --quiet", "--agent: the command must contain {prompt}"),
    ("my-agent 'unclosed {prompt}", "--agent: cannot split the command line"),
    ("", "--agent: the command is empty"),
    ("my-agent {prompt} --out {bogus}",
     "--agent: unknown placeholder(s) {bogus}; the known ones are {prompt}, {id}, {workdir}, {session}"),
])
def test_an_unusable_agent_command_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str], agent: str,
                                              message: str) -> None:
    tasks = subset(tmp_path, "question")
    assert batch(tmp_path, tasks, agent=agent)[0] == 2
    assert message in capsys.readouterr().err


def test_placeholders_are_filled_in_as_they_are_and_never_run_through_a_shell() -> None:
    task = Task("t-1", "it's \"$HOME\" `rm -rf /`; {id} 'unclosed", 1)
    argv = agent_argv("agent -p {prompt} --tag={id} --cwd {workdir} {session}", task, Path("/w d"), "t-1-abc")
    assert argv == ["agent", "-p", task.prompt, "--tag=t-1", "--cwd", "/w d", "t-1-abc"]
    # Quoted by the user or not, a placeholder is the same word: the command line is split before it is filled in.
    assert agent_argv("agent '{prompt}' \"--t={id}\" x{session}y", task, Path("/w"), "s") == \
        ["agent", task.prompt, "--t=t-1", "xsy"]
    check_template("sh -c 'echo ${HOME} \"$1\"' sh {prompt}")  # the shell's own ${NAME} is not a placeholder


def test_a_prompt_must_fit_in_one_argument_and_environment_string(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Linux refuses an argument or environment string of MAX_ARG_STRLEN bytes or more (with its NUL); the prompt
    is passed in PROXYVISOR_PROMPT=... too, so the longest prompt is shorter by that name."""
    longest = MAX_ARG_STRLEN - 1 - len("PROXYVISOR_PROMPT=")
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps({"id": "big", "prompt": "é" * (longest // 2) + "x" * (longest % 2)}) + "\n")
    code, report, _ = batch(tmp_path, tasks, agent='sh -c \'test "$1" = "$PROXYVISOR_PROMPT"\' sh {prompt}')
    assert code == 0 and report[0]["exit_code"] == 0  # the longest prompt reaches the agent, both ways
    tasks.write_text(json.dumps({"id": "big", "prompt": "x" * (longest + 1)}) + "\n")
    code, report, _ = batch(tmp_path / "b", tasks)
    assert (code, report) == (2, [])
    assert f"tasks.jsonl:1: prompt is too long to pass to a program: {MAX_ARG_STRLEN + 1:,} bytes" \
        in capsys.readouterr().err
    with pytest.raises(ValueError, match="env 'X' is too long"):
        tasks.write_text(json.dumps({"id": "a", "prompt": "x", "env": {"X": "x" * MAX_ARG_STRLEN}}) + "\n")
        load_tasks(tasks)


async def test_each_marker_plays_its_own_script_and_unmarked_requests_the_rest() -> None:
    upstream = ScriptedUpstream([{"marker": "[task:a]", "text": "a1"}, {"text": "plain"},
                                 {"marker": "[task:b]", "text": "b1"}, {"marker": "[task:a]", "text": "a2"}])

    async def ask(prompt: str) -> str:
        body = request_body("chat", messages=[{"role": "user", "content": prompt}])
        response = await client.post("/v1/chat/completions", json=body)
        message = response.json()["choices"][0]["message"]
        return "(tool call)" if message.get("tool_calls") else message["content"]

    async with serve_handler(upstream) as url, http_client(url) as client:
        answers = [await ask(p) for p in ("do [task:b]", "do [task:a]", "no marker", "do [task:a]", "do [task:a]",
                                          "do [task:b]", "no marker")]
    # A used-up marker answers in auto mode (with tools offered: a tool call), never with an unmarked step.
    assert answers == ["b1", "a1", "plain", "a2", "(tool call)", "(tool call)", "(tool call)"]


async def test_a_step_that_calls_tools_waits_for_a_request_that_offers_tools() -> None:
    """An agent's side request with the task's prompt but no tools (opencode's session title) gets an auto-mode
    answer and leaves the script's tool-call step to the turn's request, which offers tools."""
    call = {"name": "Bash", "arguments": {"command": "ls"}}
    upstream = ScriptedUpstream([{"marker": "[task:a]", "tool_calls": [call]}, {"marker": "[task:a]", "text": "done"}])

    async def ask(tools: bool) -> str:
        body = request_body("chat", messages=[{"role": "user", "content": "do [task:a]"}])
        if not tools:
            del body["tools"]
        message = (await client.post("/v1/chat/completions", json=body)).json()["choices"][0]["message"]
        return "(tool call)" if message.get("tool_calls") else message["content"]

    async with serve_handler(upstream) as url, http_client(url) as client:
        answers = [await ask(False), await ask(True), await ask(False), await ask(True)]
    assert answers == ["Hello from the scripted upstream.", "(tool call)", "done", "(tool call)"]


def test_batch_help_documents_every_option_the_task_file_and_the_exit_status() -> None:
    from proxyvisor.cli import build_parser

    sub = build_parser()._subparsers._group_actions[0].choices["batch"]  # noqa: SLF001 - no public accessor
    text = sub.format_help()
    for action in sub._actions:  # noqa: SLF001
        for flag in action.option_strings:
            assert flag in text
    for part in ("task file:", "agent command:", "outcome of a task:", "report files", "exit status:", "examples:",
                 "{prompt}", "no_verdict", "PREFIX.jsonl", "PREFIX-logs/", "files and environment:"):
        assert part in text, part
    assert "every turn ends unverified" not in text and "shell-quoted" not in text
    # The verifier is the session's own model (README, "The supervisor model"): the gate is never idle.
    assert "idle" not in text and "The verifier is the session's own model by default" in text
    # Each relative folder says what it is relative to.
    flat = " ".join(text.split())
    assert "a relative one is relative to the current folder, where a task's own workdir is relative to the task " \
           "file's folder" in flat and "(created if missing; relative to the task file's folder)" in flat


def test_the_example_agent_reports_exit_codes_and_kills_a_command_past_its_timeout(tmp_path: Path) -> None:
    from proxyvisor.example_agent import run_bash

    assert run_bash("echo hi; echo oops >&2; exit 3", 10) == "exit code: 3\nhi\noops\n"
    started = tmp_path / "started"
    result = run_bash(f"sleep 30 & echo $! > {started}; wait", 0.5)
    assert result.startswith("exit code: 124\n") and "[killed after 0.5 s]" in result
    assert not alive(int(started.read_text()))


def test_a_missing_task_file_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert batch(tmp_path, tmp_path / "missing.jsonl")[0] == 2
    assert "missing.jsonl: cannot read the task file: No such file or directory" in capsys.readouterr().err


def test_each_agent_runs_with_pwd_naming_its_workdir(tmp_path: Path, state_dir: Path) -> None:
    """An agent that takes its project folder from ``PWD`` (opencode does) works in its task's folder, not in the
    folder batch was started from: PWD is the workdir, as a shell in it would set it."""
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({"id": i, "prompt": "x"}) + "\n" for i in ("a", "b")))
    agent = f"{sys.executable} -c \"import os; open('pwd.txt', 'w').write(os.environ['PWD'])\" {{prompt}}"
    code, report, _ = batch(tmp_path, tasks, "--state-dir", str(state_dir), agent=agent)
    assert code == 0, report
    for r in report:
        assert (Path(r["workdir"]) / "pwd.txt").read_text() == r["workdir"] == str(tmp_path / "runs" / r["id"])


def test_without_report_the_report_goes_to_the_state_directory_not_the_current_folder(
        tmp_path: Path, state_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """A batch run from a checkout leaves nothing in the working tree unless --report asks for it."""
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    monkeypatch.chdir(checkout)
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps({"id": "one", "prompt": "x", "workdir": str(tmp_path / "work")}) + "\n")
    assert main(["batch", str(tasks), "--agent", "true {prompt}"]) == 0
    assert list(checkout.iterdir()) == []
    (md,) = (state_dir / "batch").glob("batch-*.md")
    assert md.with_suffix(".jsonl").is_file() and md.with_name(md.stem + "-logs").is_dir()
    assert str(md) in capsys.readouterr().err, "the last line names where the report went"
    assert oct((state_dir / "batch").stat().st_mode & 0o777) == "0o700"
