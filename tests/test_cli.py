"""The command line: help text, wrap (exit codes, environment, summary), demo, replay on a fixture trajectory."""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
from rich.cells import cell_len
from rich.console import Console

from proxyvisor.cli import build_parser, main
from proxyvisor.config import Config
from proxyvisor.demo import demo, failing_suite_log
from proxyvisor.proxy.formats import BY_NAME
from proxyvisor.replay import TrajectoryError, load_trajectory, replay
from proxyvisor.store import Store

TRAJECTORY = [
    {"role": "system", "content": "You are an agent."},
    {"role": "user", "content": "Fix the bug in app.py"},
    {"role": "assistant", "content": "Let me look.", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "bash", "arguments": "{\"command\": \"cat app.py\"}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "print('hi'"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_2", "type": "function", "function": {"name": "bash", "arguments": "{\"command\": \"sed -i s/'$/')/ app.py\"}"}},
        {"id": "call_3", "type": "function", "function": {"name": "read", "arguments": "{\"path\": \"app.py\"}"}}]},
    {"role": "tool", "tool_call_id": "call_2", "content": ""},
    {"role": "tool", "tool_call_id": "call_3", "content": "print('hi')", "is_error": False},
    {"role": "user", "content": "Please always provide EXACTLY ONE action."},
    {"role": "assistant", "content": "Fixed: app.py now prints hi. ünïcödé ✓"},
]


def write_trajectory(path: Path, messages: list[dict]) -> Path:
    path.write_text("".join(json.dumps(m) + "\n" for m in messages), encoding="utf-8")
    return path


def run_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "proxyvisor", *args], capture_output=True, text=True,
                          timeout=timeout)


def _commands(parser: argparse.ArgumentParser, name: str = "proxyvisor") -> list[tuple[str, argparse.ArgumentParser]]:
    """Every command and sub-command of ``parser`` (``proxyvisor routing set``...), with its parser."""
    found = []
    for action in parser._actions:  # noqa: SLF001 - argparse has no public accessor
        if isinstance(action, argparse._SubParsersAction):  # noqa: SLF001
            for sub_name, sub in action.choices.items():
                found += [(f"{name} {sub_name}", sub), *_commands(sub, f"{name} {sub_name}")]
    return found


def test_every_argument_of_every_command_has_help_showing_its_default() -> None:
    commands = _commands(build_parser())
    assert {"proxyvisor delegate", "proxyvisor routing set", "proxyvisor health clear"} <= {n for n, _ in commands}
    for name, sub in commands:
        text = " ".join(sub.format_help().split())
        for action in sub._actions:  # noqa: SLF001
            if isinstance(action, argparse._SubParsersAction) or action.dest == "help":  # noqa: SLF001
                continue
            assert (action.help or "").strip(), f"{name} {action.option_strings or action.metavar} has no help"
            for flag in action.option_strings:
                assert flag in text
            if action.default not in (None, False, "") and not isinstance(action.default, bool):
                shown = " ".join((action.help % {"default": action.default}).split())
                assert f"default: {action.default:g}" in shown if isinstance(action.default, float) else \
                    f"default: {action.default}" in shown, f"{name} {action.option_strings}: {shown}"
    for name, sub in commands:
        if name in ("proxyvisor serve", "proxyvisor wrap", "proxyvisor demo", "proxyvisor replay"):
            assert "config file" in sub.format_help()  # it says where its configuration comes from


def test_serve_help_lists_every_endpoint_the_readme_lists() -> None:
    readme = (Path(__file__).parent.parent / "README.md").read_text(encoding="utf-8")
    section = readme.split("\n## Endpoints\n", 1)[1].split("A WebSocket upgrade", 1)[0]
    help_text = " ".join(dict(_commands(build_parser()))["proxyvisor serve"].format_help().split())
    paths = {p.replace("{id}", "ID") for p in re.findall(r"`(?:[A-Z]+ )?(/[a-z0-9_/{}.]*)", section)}
    assert {"/proxyvisor/ui", "/healthz", "/v1/messages/count_tokens", "/messages"} <= paths
    # The prefixes and the paths without /v1 are said once for all, not path by path.
    for path in paths - {"/", "/s/{session}/", "/r/{run}/", "/messages", "/chat/completions", "/responses"}:
        assert re.search(rf"{re.escape(path)}(?![a-z_/])", help_text) or \
            path.replace("/proxyvisor/sessions/ID/", ".../ID/") in help_text, path
    assert "GET /proxyvisor/ui the web view" in help_text and "HEAD / GET /healthz" in help_text
    assert "prefix /s/{session}/ and the run prefix /r/{run}/" in help_text
    assert "the model paths also answer without their /v1, e.g. POST /messages" in help_text


def test_delegate_help_says_what_a_role_is_and_where_roles_come_from(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["delegate", "--help"])
    assert exit_info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "A role is a named kind of child work" in text and "[model_routing.roles.R]" in text
    assert "proxyvisor routing set --role R" in text and "proxyvisor routing show" in text
    assert re.search(r"PROMPT the child's task", text) and re.search(r"--role R the role to run", text)
    assert 'proxyvisor delegate --role reviewer "' in text, "an example"
    assert "exit status: 0" in text


def test_no_command_prints_help_and_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert "wrap" in capsys.readouterr().out


def test_wrap_returns_the_agent_exit_code_and_hands_it_the_base_urls(tmp_path: Path) -> None:
    script = ("import os, sys, urllib.request, json\n"
              "base = os.environ['OPENAI_BASE_URL']\n"
              "assert os.environ['ANTHROPIC_BASE_URL'] + '/v1' == base\n"
              "body = json.dumps({'model': 'm', 'messages': [{'role': 'user', 'content': 'hi'}]}).encode()\n"
              "req = urllib.request.Request(base + '/chat/completions', body, {'content-type': 'application/json'})\n"
              "print(json.load(urllib.request.urlopen(req))['choices'][0]['message']['content'])\n"
              "sys.exit(7)\n")
    done = run_cli("wrap", "--state-dir", str(tmp_path / "state"), "--session", "s-test", "--",
                   sys.executable, "-c", script)
    assert done.returncode == 7, done.stderr
    assert "Hello from the scripted upstream." in done.stdout
    assert "session s-test: 1 model request (chat), 0 errors" in done.stderr
    ledger = (tmp_path / "state" / "ledger" / "s-test.jsonl").read_text().splitlines()
    assert len(ledger) == 1 and json.loads(ledger[0])["status"] == 200


def test_wrap_reports_a_missing_command() -> None:
    done = run_cli("wrap", "--quiet", "--", "definitely-not-a-command-xyz")
    assert done.returncode == 127
    assert "cannot run 'definitely-not-a-command-xyz'" in done.stderr


def test_wrap_rejects_an_invalid_session_id() -> None:
    done = run_cli("wrap", "--session", "../etc", "--", "true")
    assert done.returncode == 2
    assert "invalid session id" in done.stderr


def test_a_corrupt_config_file_is_a_clear_error(tmp_path: Path) -> None:
    bad = tmp_path / "config.toml"
    bad.write_text("[proxy\nport = 1\n")
    done = run_cli("serve", "--config", str(bad))
    assert done.returncode == 2
    assert "not valid TOML" in done.stderr and str(bad) in done.stderr


def test_demo_shows_the_tool_call_round_trip_in_every_format(tmp_path: Path) -> None:
    out = io.StringIO()
    assert demo(Config().with_overrides(state={"dir": str(tmp_path)}), "all", Console(file=out, width=80)) == 0
    text = out.getvalue()
    # On an 80-column terminal every line fits, and only headings and the closing table start at column 0: a
    # wrapped line goes on under its text column (13 for a speaker's line).
    lines = text.splitlines()
    assert max(cell_len(line) for line in lines) <= 80
    headings = ("proxyvisor is serving", "upstream: ", "state dir ", "OpenAI ", "Anthropic ", "An agent ",
                "A premature ", "A model that ", "┏", "┃", "┡", "│", "└")
    assert [line for line in lines if line[:1].strip() and not line.startswith(headings)] == []
    assert re.search(r"answers: Done: I ran the tool and read its output\. \(proxy overhead\n {13}[\d.]+ ms\)", text)
    # The closing table's gate column is explained under it.
    words = " ".join(text.split())
    assert ("gate: what the verify-gate made of an answer that ended a turn: verified = the latest check after the "
            "change passed") in words
    assert "unknown = passed on reading alone" in words and "re-entered = held, and the turn went on" in words
    for label in ("OpenAI Chat Completions", "Anthropic Messages", "OpenAI Responses"):
        assert label in text
    assert text.count("calls bash({'command': 'ls'})") == 3
    assert text.count("answers: Done: I ran the tool and read its output.") == 3
    ledgers = [p for p in (tmp_path / "ledger").glob("*.jsonl") if not p.name.startswith(("demo-loop-",
                                                                                          "demo-condense-",
                                                                                          "demo-gate-",
                                                                                          "demo-delegate-"))]
    assert len(ledgers) == 3 and all(len(p.read_text().splitlines()) == 2 for p in ledgers)
    # Each of those turns ends at an answer the verify-gate passed on reading alone (nothing was changed).
    assert [json.loads(p.read_text().splitlines()[-1])["gate"]["outcome"] for p in ledgers] == ["unknown"] * 3
    # The gate scene runs once, in the first format, and the closing table labels its verified turn.
    assert text.count('the agent read the premature "done" as it streamed') == 1
    assert re.search(r"│ chat +│ 200 +│ [\d/]+ +│ [\d.]+ +│ [\d.]+ +│ verified +│", text)
    # The large log is condensed for the model by the scripted condenser (no key), its original spilled.
    condensed = re.search(r"condensed the bash result for the model: ([\d,]+) -> ([\d,]+) tokens", text)
    assert condensed and int(condensed[2].replace(",", "")) * 10 < int(condensed[1].replace(",", ""))
    spill = tmp_path / re.search(r"full original, relative to the state dir:\n {13}(\S+)\n", text)[1]
    assert spill.is_relative_to(tmp_path / "spill") and spill.read_text() == failing_suite_log() + "exit code 0"


def test_the_sample_trajectory_replays_with_the_loop_detected_and_steered(capsys: pytest.CaptureFixture[str]) -> None:
    sample = Path(__file__).resolve().parent.parent / "examples" / "replay" / "polling-loop.jsonl"
    assert main(["replay", str(sample)]) == 0
    lines = capsys.readouterr().out.splitlines()
    rounds = [line for line in lines if line.startswith("round ")]
    assert len(rounds) == 6 and "fired loop@" not in "".join(rounds[:3])
    assert "fired loop@6" in rounds[3] and "steer note: loop" in rounds[3]
    assert "state progressing" in rounds[1] and "state need_input" in rounds[5], "its self-reports are valid"
    assert lines[-1] == "6 rounds, 5 tool calls, 0 failed"


def test_the_demo_leaves_no_folder_behind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without --state-dir the demo's state (ledgers, spill files) and its scratch project live in temporary
    folders, both removed at the end; the demo says so."""
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    out = io.StringIO()
    assert demo(Config(), "chat", Console(file=out, width=120)) == 0
    words = " ".join(out.getvalue().split())
    assert "a temporary folder, removed at the end: --state-dir DIR keeps them" in words
    assert "condensed the bash result for the model" in words, "the scenes that write ran"
    assert list(scratch.iterdir()) == []


@pytest.mark.parametrize("fmt", ["chat", "messages", "responses"])
@pytest.mark.parametrize("stream", [False, True])
async def test_replay_returns_every_recorded_turn_intact(tmp_path: Path, fmt: str, stream: bool) -> None:
    rounds = await replay(Config(), TRAJECTORY, BY_NAME[fmt], stream, store=Store(tmp_path))
    assert [r.message for r in rounds] == [2, 4, 8]
    assert all(r.matches and r.status == 200 for r in rounds), [r.error for r in rounds]
    assert rounds[1].tool_calls == ["bash: sed -i s/'$/')/ app.py", "read: app.py"]
    assert rounds[2].tool_calls == []


def test_replay_command_prints_one_line_per_round(tmp_path: Path) -> None:
    path = write_trajectory(tmp_path / "t.jsonl", TRAJECTORY)
    done = run_cli("replay", "--state-dir", str(tmp_path / "state"), str(path))
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stdout.splitlines() if line.startswith("round")]
    assert len(lines) == 3 and "bash: cat app.py" in lines[0]
    as_json = run_cli("replay", "--json", "--format", "messages", "--state-dir", str(tmp_path / "state"), str(path))
    records = [json.loads(line) for line in as_json.stdout.splitlines()]
    assert [r["message"] for r in records] == [2, 4, 8] and all(r["matches"] for r in records)


def test_replay_names_the_bad_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(TRAJECTORY[0]) + "\n{not json\n")
    with pytest.raises(TrajectoryError, match=r"bad.jsonl:2: not JSON"):
        load_trajectory(path)
    done = run_cli("replay", str(path))
    assert done.returncode == 2 and "bad.jsonl:2" in done.stderr


def test_serve_on_a_taken_port_says_so_and_exits_1() -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = run_cli("serve", "--port", str(port))
    assert done.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port}" in done.stderr and "Traceback" not in done.stderr


def test_a_missing_script_file_is_a_configuration_error(tmp_path: Path) -> None:
    config = tmp_path / "config.toml"
    config.write_text('[upstreams.scripted]\nscript = "/nonexistent/steps.json"\n')
    for command in (["serve", "--port", "0"], ["demo"], ["wrap", "--", "true"]):
        done = run_cli(*command[:1], "--config", str(config), *command[1:])
        assert done.returncode == 2, (command, done.stderr)
        assert "script" in done.stderr and "Traceback" not in done.stderr


def test_wrap_ignores_the_auth_token_of_a_public_serve_config(tmp_path: Path) -> None:
    config = tmp_path / "config.toml"
    config.write_text('[proxy]\nhost = "0.0.0.0"\nauth_token = "s3cret"\n')
    script = ("import os, urllib.request, json\n"
              "body = json.dumps({'model': 'm', 'messages': [{'role': 'user', 'content': 'hi'}]}).encode()\n"
              "req = urllib.request.Request(os.environ['OPENAI_BASE_URL'] + '/chat/completions', body,"
              " {'content-type': 'application/json'})\n"
              "print(os.environ['OPENAI_BASE_URL'].split('/')[2].split(':')[0])\n"
              "print(json.load(urllib.request.urlopen(req))['choices'][0]['message']['content'])\n")
    done = run_cli("wrap", "--config", str(config), "--quiet", "--", sys.executable, "-c", script)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0] == "127.0.0.1"
    assert "Hello from the scripted upstream." in done.stdout


async def test_replay_matches_turns_whose_self_report_the_agent_never_sees(tmp_path: Path) -> None:
    report = '<sup>{"state":"done","focus":"fix app.py","next":null,"carry":[],"plan":null}</sup>'
    messages = [*TRAJECTORY[:-1], {"role": "assistant", "content": "Fixed. " + report}]
    for fmt in ("chat", "messages", "responses"):
        rounds = await replay(Config(), messages, BY_NAME[fmt], True, store=Store(tmp_path))
        assert all(r.matches for r in rounds), [r.error for r in rounds]


def test_replay_names_a_line_with_malformed_tool_calls(tmp_path: Path) -> None:
    path = tmp_path / "calls.jsonl"
    path.write_text(json.dumps({"role": "assistant", "content": None, "tool_calls": "bash ls"}) + "\n")
    with pytest.raises(TrajectoryError, match=r"calls.jsonl:1: tool_calls must be a list"):
        load_trajectory(path)


SCRIPTED_NOTICE = "upstream: the built-in scripted model (no key, no network): answers are not a real model's\n"
SCRIPTED_HOWTO = "for a real model, replace [upstreams.scripted] in a config file (--config FILE, or "
KEY_WARNING = ("[supervisor.model] api_key_env names PROXYVISOR_TEST_KEY_NOT_SET, which is not set: every supervisor "
               "call will fail")


def serve_start(config: Path, until: str = "listening on") -> str:
    """The stderr lines ``serve`` prints up to the one holding ``until``; then it is stopped with SIGINT."""
    import signal

    process = subprocess.Popen([sys.executable, "-m", "proxyvisor", "serve", "--config", str(config), "--port", "0"],
                               stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    try:
        assert process.stderr is not None
        for line in process.stderr:
            lines.append(line)
            if until in line:
                break
    finally:
        process.send_signal(signal.SIGINT)
        process.communicate(timeout=30)
    return "".join(lines)


def test_serve_names_its_web_view(tmp_path: Path) -> None:
    config = tmp_path / "admin.toml"
    config.write_text('[proxy]\nadmin_token = "secret-admin-token"\n')
    started = serve_start(config, until="web view at")
    assert re.search(r"^proxyvisor: web view at http://127\.0\.0\.1:\d+/proxyvisor/ui#admin=TOKEN \(your \[proxy\] "
                     r"admin_token\)$", started, re.MULTILINE), started
    assert "secret-admin-token" not in started
    config.write_text('[proxy]\nadmin_token = "secret-admin-token"\nauth_token = "secret-auth-token"\n')
    started = serve_start(config, until="web view at")
    assert re.search(r"/proxyvisor/ui#admin=TOKEN&auth=TOKEN \(your \[proxy\] admin_token and auth_token\)$",
                     started, re.MULTILINE), started
    assert "secret-a" not in started


def test_serve_and_wrap_say_when_the_upstream_is_the_scripted_model(tmp_path: Path) -> None:
    default = tmp_path / "default.toml"
    default.write_text("")
    real = tmp_path / "real.toml"
    real.write_text('[upstreams.openai]\nurl = "http://127.0.0.1:9"\n')
    started = serve_start(default)
    assert started.count(SCRIPTED_NOTICE) == 1 and started.count(SCRIPTED_HOWTO) == 1
    # How to add a real one: the file to write (in the isolated HOME), and the one in use.
    assert f"{tmp_path}/home/.config/proxyvisor/config.toml; in use: {default})" in started
    assert 'e.g. [upstreams.anthropic] url = "https://api.anthropic.com"' in started
    assert "scripted model" not in serve_start(real)
    done = run_cli("wrap", "--config", str(default), "--state-dir", str(tmp_path / "state"), "--", "true")
    assert done.returncode == 0 and done.stderr.count(SCRIPTED_NOTICE) == 1, done.stderr
    assert done.stderr.count(SCRIPTED_HOWTO) == 1, done.stderr
    done = run_cli("wrap", "--config", str(real), "--state-dir", str(tmp_path / "state"), "--", "true")
    assert done.returncode == 0 and "scripted model" not in done.stderr, done.stderr
    done = run_cli("wrap", "--quiet", "--config", str(default), "--state-dir", str(tmp_path / "state"), "--", "true")
    assert (done.returncode, done.stderr) == (0, ""), done.stderr  # --quiet: no notice, no summary


def test_serve_and_wrap_warn_once_of_an_unset_supervisor_key_variable(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PROXYVISOR_TEST_KEY_NOT_SET", raising=False)
    config = tmp_path / "config.toml"
    config.write_text('[supervisor.model]\nname = "openai/gpt-4o-mini"\napi_key_env = "PROXYVISOR_TEST_KEY_NOT_SET"\n')
    assert serve_start(config).count(KEY_WARNING) == 1
    done = run_cli("wrap", "--config", str(config), "--state-dir", str(tmp_path / "state"), "--", "true")
    assert done.returncode == 0 and done.stderr.count(KEY_WARNING) == 1, done.stderr
    done = run_cli("wrap", "--quiet", "--config", str(config), "--state-dir", str(tmp_path / "state"), "--", "true")
    assert done.stderr == f"proxyvisor: warning: {KEY_WARNING}\n", done.stderr  # a warning is not silenced
    monkeypatch.setenv("PROXYVISOR_TEST_KEY_NOT_SET", "sk-test")
    done = run_cli("wrap", "--config", str(config), "--state-dir", str(tmp_path / "state"), "--", "true")
    assert done.returncode == 0 and "api_key_env" not in done.stderr, done.stderr


def test_replay_keeps_out_of_the_users_state_directory_unless_given_one(tmp_path: Path) -> None:
    import os

    path = write_trajectory(tmp_path / "t.jsonl", TRAJECTORY)
    env = {k: v for k, v in os.environ.items() if k != "PROXYVISOR_STATE_DIR"}
    env.update(XDG_STATE_HOME=str(tmp_path / "xdg"), HOME=str(tmp_path / "home"))
    done = subprocess.run([sys.executable, "-m", "proxyvisor", "replay", str(path)], capture_output=True, text=True,
                          timeout=60, env=env)
    assert done.returncode == 0, done.stderr
    assert not list(tmp_path.glob("xdg/**/*.jsonl")) and not list(tmp_path.glob("home/**/*.jsonl"))
    done = subprocess.run([sys.executable, "-m", "proxyvisor", "replay", "--state-dir", str(tmp_path / "kept"),
                           str(path)], capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 0, done.stderr
    assert list((tmp_path / "kept" / "ledger").glob("replay-*.jsonl"))


def test_a_logged_exception_is_one_line_without_a_traceback_unless_debug() -> None:
    import logging

    from proxyvisor.cli import OneLineFormatter

    def record() -> logging.LogRecord:
        try:
            {}["missing"]
        except KeyError:
            import sys
            return logging.LogRecord("proxyvisor.x", logging.ERROR, __file__, 1, "it failed", None, sys.exc_info())

    plain = OneLineFormatter("%(name)s: %(message)s", tracebacks=False).format(record())
    assert plain == "proxyvisor.x: it failed [KeyError: 'missing']"
    assert "Traceback" not in plain and "\n" not in plain
    debug = OneLineFormatter("%(name)s: %(message)s", tracebacks=True).format(record())
    assert debug.startswith("proxyvisor.x: it failed\nTraceback (most recent call last):")


def test_a_logged_exception_names_the_innermost_frame_of_the_package_only() -> None:
    """The frame named is one of the installed package's files, whatever folder names lie above it (a clone in a
    folder called ``proxyvisor`` is not the package)."""
    import logging
    import sys

    from proxyvisor.cli import OneLineFormatter
    from proxyvisor.proxy.sse import SSEParser

    def record(fail: Any) -> logging.LogRecord:
        try:
            fail()
        except Exception:  # noqa: BLE001 - any exception is the record's
            return logging.LogRecord("proxyvisor.x", logging.ERROR, __file__, 1, "it failed", None, sys.exc_info())
        raise AssertionError("did not fail")

    formatter = OneLineFormatter("%(message)s", tracebacks=False)
    inside = formatter.format(record(lambda: SSEParser(max_event=1).feed(b"data: xx")))
    assert inside.startswith("it failed [EventTooLarge: ") and inside.endswith(")]") and "(at sse.py:" in inside
    outside = compile("raise KeyError('m')", os.path.join(os.sep, "tmp", "clone", "proxyvisor", "t.py"), "exec")
    assert formatter.format(record(lambda: exec(outside))) == "it failed [KeyError: 'm']"
