"""``proxyvisor condense FILE``: the condensed result offline (the deterministic condenser), the numbered view, and
the condensed result through a real litellm call to a local scripted model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import trio

from proxyvisor.cli import build_parser, main
from proxyvisor.condense.protocol import SYSTEM_PROMPT

from helpers import LITELLM_PROBE

TASK = "Why did the widget build fail?"


def write_log(path: Path, lines: int = 1500, error_at: int = 700) -> Path:
    rows = [f"[{i:05d}] compiling module_{i}.c -> module_{i}.o ({i * 7 % 1000} ms)" for i in range(lines)]
    rows[error_at] = "src/widget.c:88:3: error: 'frob' undeclared (first use in this function)"
    path.write_bytes(("\n".join(rows) + "\n").encode())
    return path


def test_condense_documents_every_option() -> None:
    sub = build_parser()._subparsers._group_actions[0].choices["condense"]  # noqa: SLF001 - no public accessor
    text = sub.format_help()
    for action in sub._actions:  # noqa: SLF001
        for flag in action.option_strings:
            assert flag in text
        assert action.dest == "help" or (action.help or "").strip()
    for topic in ("numbered view", "tokens_threshold", "budget_tokens", "deterministic_kinds",
                  "[supervisor.model] name", "exit status", "examples:", "config file"):
        assert topic in text


def test_without_a_model_it_prints_the_deterministic_result(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    log = write_log(tmp_path / "build.log")
    assert main(["condense", str(log), "--task", TASK]) == 0
    out = capsys.readouterr().out
    assert f"{log}: 1,500 lines, 28,005 tokens (cl100k_base); a condense candidate" in out
    assert "condensed by the deterministic condenser: 28,005 -> " in out and "| " not in out  # no view
    assert "\nsrc/widget.c:88:3: error: 'frob' undeclared (first use in this function)\n" in out
    assert f"full original at {log}" in out
    assert main(["condense", str(log), "--task", TASK, "--view", "--budget", "3000"]) == 0
    out = capsys.readouterr().out
    assert " 701| src/widget.c:88:3: error: 'frob' undeclared" in out and "not shown in this view …]" in out
    assert out.index(" 701| ") < out.index("condensed by the deterministic condenser")


def test_json_output_and_usage_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    small = tmp_path / "small.txt"
    small.write_bytes(b"total 1\n\xff\xfe binary-ish \x00 line\n")
    assert main(["condense", str(small), "--task", "list files", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["candidate"] is False and report["lines"] == 2 and report["threshold"] == 5000
    assert report["view"]["visible_ranges"] == [[1, 2]] and not report["view"]["partial"]
    assert "\ufffd\ufffd binary-ish ␀ line" in report["view"]["text"] and report["condensed"] is None
    log = write_log(tmp_path / "build.log")
    assert main(["condense", str(log), "--task", TASK, "--json", "--budget", "2000"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["candidate"] and report["diagnostic_lines"] == [701] and report["view"]["tokens"] <= 2000
    assert any(a <= 701 <= b for a, b in report["view"]["visible_ranges"])
    assert main(["condense", str(log), "--task", TASK, "--budget", "100"]) == 2
    assert main(["condense", str(tmp_path / "missing.txt"), "--task", TASK]) == 1
    assert "cannot read" in capsys.readouterr().err
    with pytest.raises(SystemExit) as usage:
        main(["condense", str(log)])
    assert usage.value.code == 2


async def test_with_a_model_it_prints_the_condensed_result(tmp_path: Path, scripted_server,
                                                           monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    log = write_log(tmp_path / "build.log")
    answer = {"results": [{"id": "r1", "verdict": "extract", "lines": ["1-2", "1499-"]}]}
    scripted_server.script.queue({"condense": answer})
    config = tmp_path / "config.toml"
    config.write_text(f'[supervisor.model]\nname = "openai/scripted-model"\napi_base = "{scripted_server.url}/v1"\n'
                      'api_key_env = "PROXYVISOR_TEST_KEY"\n', encoding="utf-8")
    monkeypatch.setenv("PROXYVISOR_TEST_KEY", "test-key")
    # The command runs its own trio loop (in a worker thread) while this loop serves the scripted model.
    code = await trio.to_thread.run_sync(main, ["condense", str(log), "--task", TASK, "--config", str(config)])
    out = capsys.readouterr().out
    assert code == 0
    lines = log.read_text().splitlines(keepends=True)
    assert "condensed by the model condenser: 28,005 -> " in out
    assert ("".join(lines[:2]) + "[… 696 lines omitted: original lines 3-698 …]\n" + "".join(lines[698:703])
            + "[… 795 lines omitted: original lines 704-1498 …]\n" + "".join(lines[1498:]) + "---\n") in out
    assert "kept 9 of 1,500 original lines (the supervisor model chose" in out and f"full original at {log}" in out
    (request,) = scripted_server.script.condenser_requests
    sent = json.loads(request)
    assert sent["model"] == "scripted-model" and sent["temperature"] == 0.0
    assert sent["messages"][0] == {"role": "system", "content": SYSTEM_PROMPT}
    payload = json.loads(sent["messages"][1]["content"])
    assert payload["task_context"] == f"Current request: {TASK}" and payload["results"][0]["total_lines"] == 1500


def test_the_scripted_upstream_leaves_it_to_the_deterministic_condenser(tmp_path: Path,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """``api_base = "scripted:"`` calls the embedded scripted upstream, which answers no verdict: no key, no network,
    and the deterministic condenser's result keeps the error line verbatim."""
    log = write_log(tmp_path / "build.log")
    config = tmp_path / "config.toml"
    config.write_text('[supervisor.model]\nname = "scripted-condenser"\napi_base = "scripted:"\n', encoding="utf-8")
    code = main(["condense", str(log), "--task", TASK, "--config", str(config), "--budget", "2000"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "Provider" not in out + err and "condensed by the deterministic condenser: 28,005 -> " in out
    narrowed = out.split("condensed by the deterministic condenser", 1)[1]
    assert "src/widget.c:88:3: error: 'frob' undeclared (first use in this function)" in narrowed
    assert f"full original at {log}" in narrowed


def test_a_failing_condenser_is_named_in_one_line_and_the_deterministic_condenser_decides(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    from proxyvisor import condense_cli as offline

    def refusing(model):
        async def call(messages):
            raise ValueError("Provider NOT provided. Pass in the provider.\n Pass model as E.g. for 'X' pass in ...")
        return call

    monkeypatch.setattr(offline, "litellm_model", refusing)
    log = write_log(tmp_path / "build.log")
    config = tmp_path / "config.toml"
    config.write_text('[supervisor.model]\nname = "no-such-model"\n', encoding="utf-8")
    assert main(["condense", str(log), "--task", TASK, "--config", str(config), "--budget", "2000"]) == 0
    out = capsys.readouterr().out
    assert ("\ncondenser model: condenser failed: ValueError: Provider NOT provided. Pass in the provider.; condensed "
            "without a model\ncondensed by the deterministic condenser: ") in out


def test_the_scripted_condenser_is_called_without_importing_litellm(tmp_path: Path) -> None:
    """The scripted upstream's condenser answer is fixed text over loopback: importing litellm for it would cost seconds
    of CPU (tens of seconds of wall time on a loaded machine), many times the answer's own cost."""
    log = write_log(tmp_path / "build.log")
    config = tmp_path / "config.toml"
    config.write_text('[supervisor.model]\nname = "x"\napi_base = "scripted:"\n', encoding="utf-8")
    runner = tmp_path / "runner.py"
    runner.write_text(LITELLM_PROBE)
    done = subprocess.run([sys.executable, str(runner), "condense", str(log), "--task", TASK, "--config", str(config),
                           "--budget", "2000"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "condensed by the deterministic condenser: 28,005 -> " in done.stdout
    assert "src/widget.c:88:3: error: 'frob' undeclared (first use in this function)" in done.stdout.split(
        "condensed by the deterministic condenser", 1)[1]
    assert done.stderr.splitlines()[-1] == "litellm not imported", done.stderr
