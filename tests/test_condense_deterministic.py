"""The deterministic condenser: diagnostics grouped by template, long lines clipped, a result within its budget,
every distinct failure kept; the comparison of a failing build with its last green run in one session; kinds,
commands and templates; the offline command's JSON."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from proxyvisor.cli import main
from proxyvisor.condense.baseline import command_key, kind_of, new_lines, passed
from proxyvisor.condense.mask import template
from proxyvisor.condense.reconstruct import condense
from proxyvisor.condense.select import CLIP_CHARS, CLIP_HEAD, CLIP_TAIL
from proxyvisor.condense.text import count_tokens, split_lines
from proxyvisor.config import Config, GateConfig
from proxyvisor.proxy.formats import CHAT, ToolSpec
from proxyvisor.proxy.service import running
from proxyvisor.scripted.upstream import ScriptedUpstream
from proxyvisor.store import Store

SPILL = "/state/spill/s1/bash-0123456789abcdef.txt"
BUDGET = 4000
_MARKER = re.compile(r"^\[… (\d+) lines? omitted: original lines? (\d+)(?:-(\d+))? …\]$")
_CLIPPED = re.compile(r"^(.*)\[… ([\d,]+) characters of line (\d+) cut …\](.*)$", re.S)


def noisy_test_log() -> tuple[str, dict[str, int]]:
    """A synthetic CI test log: 700 errors of one template at varying timestamps, paths and numbers, 5 KB lines
    (a fixture dump and an assertion holding a whole page), and 4 distinct failures; the failures' line numbers."""
    rows = ["$ ./run-tests --ci", "collecting 2,100 tests"]
    at: dict[str, int] = {}
    for i in range(700):
        rows.append(f"2024-03-0{i % 9 + 1}T10:{i % 60:02d}:{i % 60:02d}.{i:06d}Z [ERROR] pkg/mod_{i}/handler.go:{i + 10}: "
                    f"retry failed: connection refused (attempt {i % 7}, id 0x{i * 7919:08x})")
        rows.append(f"ok   pkg/mod_{i} {i % 13}.{i % 100:02d}s")
        if i == 350:
            rows.append("fixture dump: " + "".join(f"<row id={k} value={k * 31}/>" for k in range(240)))
            at["dump"] = len(rows)
    failures = [("TestParseHeader", "expected 'Content-Type', got ''"),
                ("TestRetryBudget", "retry budget exceeded after 3 attempts"),
                ("TestPageRender", "rendered page differs: " + "<div class='row'>cell</div>" * 190),
                ("TestShutdown", "panic: close of closed channel")]
    for name, message in failures:
        rows += [f"--- FAIL: {name} (0.{len(name)}s)", f"    {name.lower()}_test.go:42: {message}"]
        at[name] = len(rows)
    rows += ["FAIL", "FAIL\tpkg/app\t12.345s", "exit code 1"]
    return "\n".join(rows) + "\n", at


def walk(lines: list[str], text: str) -> dict[int, str]:
    """Check a condensed ``text`` against the original ``lines``: every kept line is the original (or its clipped
    head and tail), at its original number, and the markers account for every other line up to the notice.
    Returns the kept lines by number (as rendered)."""
    kept: dict[int, str] = {}
    number = 1
    for piece in split_lines(text):
        body = piece.rstrip("\n")
        if body == "---":
            break
        if (m := _MARKER.match(body)) is not None:
            assert int(m.group(2)) == number
            number += int(m.group(1))
            continue
        if body.startswith("[… "):
            continue  # a group note
        original = lines[number - 1].rstrip("\n")
        if (c := _CLIPPED.match(body)) is not None and len(original) > CLIP_CHARS:
            assert int(c.group(3)) == number
            assert original.startswith(c.group(1)) and original.endswith(c.group(4))
            assert len(c.group(1)) == CLIP_HEAD and len(c.group(4)) == CLIP_TAIL
        else:
            assert body == original, (number, body[:80])
        kept[number] = body
        number += 1
    assert number == len(lines) + 1
    return kept


def test_700_repeats_and_5_kb_lines_fit_the_budget_with_every_distinct_failure() -> None:
    text, at = noisy_test_log()
    lines = split_lines(text)
    tokens = count_tokens(text)
    result = condense(lines, spill_path=SPILL, tokens_before=tokens, budget=BUDGET, terms=["retry"])
    assert not isinstance(result, str)
    assert tokens > 10 * BUDGET and result.tokens == count_tokens(result.text) <= BUDGET
    kept = walk(lines, result.text)
    for name in ("TestParseHeader", "TestRetryBudget", "TestPageRender", "TestShutdown"):
        assert at[name] in kept and at[name] - 1 in kept, name  # the failure and its test line
    # The 700 repeated errors: the first and the last, and a note with the count and both line numbers.
    warnings = [n for n, line in enumerate(lines, 1) if " [ERROR] " in line]
    assert len(warnings) == 700 and {warnings[0], warnings[-1]} <= set(kept)
    assert len(set(warnings) & set(kept)) == 2
    assert (f"[… this line occurs 700 times once numbers, ids, paths and timestamps are masked: first at line "
            f"{warnings[0]}, last at line {warnings[-1]} …]") in result.text
    # The 5 KB assertion line is clipped head and tail, the cut marked with its line number.
    page = at["TestPageRender"]
    assert len(lines[page - 1]) > 5000 and f"characters of line {page} cut …]" in kept[page]
    assert "clipped where marked" in result.text and SPILL in result.text
    # The runner's verdict and the command.
    assert {1, len(lines)} <= set(kept) and result.condenser == "deterministic"
    assert result.kept_ranges[0][0] == 1


def test_a_result_that_fits_its_budget_is_left_whole() -> None:
    lines = split_lines("".join(f"line {i}\n" for i in range(100)))
    assert condense(lines, spill_path=SPILL, tokens_before=400, budget=BUDGET) == "every line kept"


def test_templates_mask_what_varies_between_runs_and_keep_the_words() -> None:
    a = template("2022-05-30T09:11:02.8564038Z [ERROR] /builds/ws/src/Foo.java:[147,78] cannot find symbol 0x7ffd12a3")
    b = template("2023-01-02T00:00:00Z [ERROR] /home/ci/src/Bar.java:[12,3] cannot find symbol 0x1")
    assert a == b == "<ts> [ERROR] <path> cannot find symbol <id>"
    assert template("FAILED tests/test_x.py::TestA::test_b - assert 1 == 2") == "FAILED <path> - assert # == #"
    assert template("test_x_axis FAILED") != template("test_y_axis FAILED")
    assert template("commit 9fceb02d0ae598e95dc970b74767f19372d61af8 took 12 ms") == "commit <id> took #"


@pytest.mark.parametrize(("arguments", "output", "kind"), [
    ('{"command": "python -m pytest -x tests/"}', "", "test"),
    ('{"command": "cd app && go test ./..."}', "", "test"),
    ('{"cmd": ["cargo", "build", "--release"]}', "", "build"),
    ('{"command": "mvn -B -q package"}', "", "build"),
    ('{"command": "npm ci"}', "", "install"),
    ('{"command": "pip install -e .[dev]"}', "", "install"),
    ('{"command": "grep -rn foo src"}', "src/a.py:1: foo\n", ""),
    ("", "[INFO] BUILD FAILURE\n", "build"),
    ("", "============ 3 failed, 9 passed in 1.2s ============\n", "test"),
    ("", "Successfully installed requests-2.32.0\n", "install"),
])
def test_the_kind_comes_from_the_command_else_from_the_output(arguments: str, output: str, kind: str) -> None:
    assert kind_of(arguments, output) == kind


def test_commands_are_keyed_with_their_working_directory() -> None:
    assert command_key('{"command": "make  all 2>&1"}') == command_key('{"command": "make all"}') != ""
    assert command_key('{"command": "make all", "cwd": "/a"}') != command_key('{"command": "make all", "cwd": "/b"}')
    assert command_key('{"path": "x.py"}') == "" and command_key("") == ""


def test_green_and_new_lines() -> None:
    green = split_lines("10:00:01 compiling a.c\n10:00:02 compiling b.c\nBUILD SUCCESS in 3s\n")
    red = split_lines("10:05:01 compiling a.c\n10:05:02 compiling b.c\nb.c:7:1: error: expected ';'\n"
                      "BUILD FAILURE in 4s\n")
    assert passed(green, False) and not passed(red, False) and not passed(green, True)
    assert new_lines(red, green) == [2, 3]


# --- against the last green run, in one session, through the proxy ----------------------------------------------

BASH = ToolSpec("bash", {"type": "object", "properties": {"command": {"type": "string"}}})
NO_GATE = Config().with_overrides(supervisor={"gate": GateConfig(enabled=False)})


def build_output(failing: bool) -> str:
    """One build of a C project, 1,800 lines: compile steps with their own timings and object ids; the failing run
    breaks one file with a compiler error, its caret lines and a failure summary."""
    run = "b" if failing else "a"
    rows = [f"[{i + 1}/1800] CC src/module_{i}.c -> build/module_{i}.o ({(i * 37 + len(run)) % 900} ms, "
            f"obj 0x{(i * 2654435761 + ord(run)) % 2**32:08x})" for i in range(1800)]
    if failing:
        rows[1200:1200] = ["src/module_1200.c:88:13: error: 'frob_limit' undeclared (first use in this function)",
                           "   88 |     int n = frob_limit;", "      |             ^~~~~~~~~~",
                           "ninja: build stopped: subcommand failed."]
        rows.append("BUILD FAILED in 41s")
    else:
        rows.append("BUILD SUCCEEDED in 40s")
    return "\n".join(rows) + "\n"


def tool_call(call_id: str, command: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": "bash", "arguments": json.dumps(
        {"command": command, "cwd": "/work/app"})}}


async def test_a_failing_build_leads_with_its_lines_new_against_the_last_green_run(tmp_path: Path) -> None:
    green, red = build_output(False), build_output(True)
    history = [
        {"role": "system", "content": "You are a careful coding agent."},
        {"role": "user", "content": "Make the build pass after the refactor."},
        {"role": "assistant", "content": "Building first.", "tool_calls": [tool_call("call_1", "ninja -C build")]},
        {"role": "tool", "tool_call_id": "call_1", "content": green},
        {"role": "assistant", "content": "Now the refactor.", "tool_calls": [tool_call("call_2", "git apply p.diff")]},
        {"role": "tool", "tool_call_id": "call_2", "content": "applied\n"},
        {"role": "assistant", "content": "Rebuilding.", "tool_calls": [tool_call("call_3", "ninja  -C build")]},
        {"role": "tool", "tool_call_id": "call_3", "content": red},
    ]
    upstream = ScriptedUpstream()
    async with running(NO_GATE, port=0, store=Store(tmp_path / "state"), scripted={"scripted": upstream}) as proxy, \
            httpx.AsyncClient(timeout=60) as client:
        for end in (4, 6, 8):
            upstream.queue({"text": "ok"})
            body = CHAT.request_from_chat(orjson.loads(orjson.dumps(history[:end])), "m", False, (BASH,))
            response = await client.post(f"{proxy.url}/s/build-session{CHAT.path}", json=body)
            assert response.status_code == 200, response.text
        sent = orjson.loads(upstream.requests[-1][1])
    results = {m["tool_call_id"]: m["content"] for m in sent["messages"] if m["role"] == "tool"}
    # The green run was condensed on its own (no earlier run); the failing one against it.
    assert results["call_1"] != green and "new against the last successful run" not in results["call_1"]
    text = results["call_3"]
    assert text.startswith("[… 5 lines new against the last successful run of this command (call_1), once numbers, "
                           "ids, paths and timestamps are masked; they come first and are not repeated below …]\n"
                           "[… new: original lines 1201-1204 …]\n"
                           "src/module_1200.c:88:13: error: 'frob_limit' undeclared (first use in this function)\n")
    lead = text.split("[… the rest of the condensed output, in order …]\n", 1)[0]
    assert "BUILD FAILED in 41s" in lead and "ninja: build stopped" in lead and "CC src/module_" not in lead
    assert count_tokens(text) <= BUDGET < count_tokens(red) / 5
    ledger = Store(tmp_path / "state").read_ledger("build-session")
    items = [item for line in ledger for item in line.get("condensed", {}).get("items", [])]
    assert [(i["call_id"], i["condenser"]) for i in items] == [("call_1", "deterministic"), ("call_3", "deterministic")]
    assert items[1]["tokens_before"] == count_tokens(red) and items[1]["tokens_after"] == count_tokens(text)
    assert not upstream.condenser_requests  # builds are condensed without a model call


# --- the offline command ------------------------------------------------------------------------------------------

def test_condense_json_holds_the_condensed_text_tokens_ranges_and_spill(tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    text, at = noisy_test_log()
    log = tmp_path / "ci.log"
    log.write_text(text, encoding="utf-8")
    assert main(["condense", str(log), "--task", "Why does CI fail?", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    condensed = report["condensed"]
    assert condensed["condenser"] == "deterministic" and condensed["spill_path"] == str(log)
    assert condensed["tokens"] == count_tokens(condensed["text"]) <= BUDGET
    assert any(a <= at["TestShutdown"] <= b for a, b in condensed["kept_ranges"])
    assert report["kind"] == "test" and report["model"] is None
    assert main(["condense", str(log), "--task", "Why does CI fail?"]) == 0
    out = capsys.readouterr().out
    assert "condensed by the deterministic condenser: " in out and condensed["text"] in out


def test_condense_compares_with_a_green_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    green, red = tmp_path / "green.log", tmp_path / "red.log"
    green.write_text(build_output(False), encoding="utf-8")
    red.write_text(build_output(True), encoding="utf-8")
    assert main(["condense", str(red), "--task", "Why did it break?", "--green", str(green), "--json"]) == 0
    condensed = json.loads(capsys.readouterr().out)["condensed"]
    assert condensed["baseline"] == f"--green {green}"
    assert condensed["text"].startswith("[… 5 lines new against the last successful run")
    assert main(["condense", str(red), "--task", "x", "--green", str(tmp_path / "missing.log")]) == 1


def test_distinct_diagnostics_that_do_not_fit_are_counted_in_the_notice() -> None:
    names = [f"{a}_{b}" for a in ("alpha", "beta", "gamma", "delta", "omega", "kappa", "sigma", "theta")
             for b in ("red", "green", "blue", "cyan", "teal", "plum", "rust", "gold", "jade", "navy")]
    rows = [f"src/{name}.ts(12,5): error TS2304: Cannot find name '{name}_value' in this scope, check imports."
            for name in names * 5]
    rows.append(f"Found {len(rows)} errors in {len(names)} files.")
    lines = split_lines("\n".join(rows) + "\n")
    result = condense(lines, spill_path=SPILL, tokens_before=count_tokens("".join(lines)), budget=1000)
    assert not isinstance(result, str) and result.tokens <= 1000
    distinct = len(names)  # each name's five errors share one template
    shown = [n for n in result.kept if n <= distinct]
    assert 1 in shown and 0 < len(shown) < distinct
    match = re.search(r"; (\d+) more distinct diagnostic lines are not shown \(lines ([\d, ]+), …\)", result.text)
    assert match is not None and int(match.group(1)) == distinct - len(shown)
    assert [int(n) for n in match.group(2).split(", ")] == [n for n in range(1, distinct + 1) if n not in shown][:10]
