"""Adapters: descriptor discovery, capability checks, pools, the parity suite, and each built-in runtime."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import trio

import proxyvisor
from proxyvisor.adapters.claude_code import ClaudeCodeRuntime
from proxyvisor.adapters.codex import CodexRuntime
from proxyvisor.adapters.descriptors import (BUILTIN_DIR, DISPATCH, DescriptorError, TargetError, discover,
                                             load_descriptor, registry_for)
from proxyvisor.adapters.failures import CATEGORIES
from proxyvisor.adapters.litellm_runtime import LiteLLMRuntime
from proxyvisor.adapters.runtime import ChildJob, ChildProgress, NativeError
from proxyvisor.scripted.upstream import ScriptedUpstream

from helpers import serve_handler
from routing_support import FIXTURE_ADAPTERS

CAPTURES = Path(__file__).resolve().parent / "fixtures" / "captures"
BUILTIN = ("claude-code", "codex", "litellm", "scripted")
NOW = 1_800_000_000.0


def write(folder: Path, name: str, text: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(text)
    return path


def test_the_built_in_descriptors_are_discovered_with_their_capabilities() -> None:
    registry = registry_for("")
    assert sorted(registry.ids()) == sorted(BUILTIN) and registry.errors == []
    for adapter in BUILTIN:
        assert registry.get(adapter).has(DISPATCH)
    assert registry.get("litellm").has("structured_output") and not registry.get("claude-code").has("structured_output")
    assert registry.get("claude-code").model("claude-haiku-4-5").bucket == "haiku-4-5"


def test_a_user_adapter_is_discovered_from_its_folder_and_runs_without_any_core_change(tmp_path: Path) -> None:
    registry = registry_for(str(FIXTURE_ADAPTERS))
    fixture = registry.get("fixture-cli")
    assert fixture.path.parent == FIXTURE_ADAPTERS and fixture.dispatch == "fixture_runtime.py:FixtureRuntime"
    runtime = fixture.load_runtime({})
    assert runtime.readiness() is None
    progress = ChildProgress()
    trio.run(runtime.run, ChildJob("j1", "r", "mode:echo hello", "fixture-cli", "fixture-big"), progress)
    assert progress.finish_reason == "stop" and progress.text.startswith("mode:echo hello | model=fixture-big")


CORE_MODULES = ["adapters/" + m for m in ("descriptors.py", "routing.py", "health.py", "health_store.py",
                                          "children.py", "delegate.py", "results.py", "graph.py", "settings.py",
                                          "failures.py", "runtime.py", "process.py", "cache.py")] + ["routing_cli.py"]


@pytest.mark.parametrize("module", CORE_MODULES)
def test_no_core_module_names_an_adapter(module: str) -> None:
    tree = ast.parse((Path(proxyvisor.__file__).parent / module).read_text())
    # Documentation may show examples (docstrings, *_HELP texts); code may not name an adapter.
    prose = {id(node.body[0].value) for node in ast.walk(tree)
             if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
             and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    prose |= {id(n) for node in ast.walk(tree) if isinstance(node, ast.Assign)
              and any(isinstance(t, ast.Name) and t.id.endswith("_HELP") for t in node.targets)
              for n in ast.walk(node.value)}
    literals = [n.value.lower() for n in ast.walk(tree)
                if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in prose]
    names = BUILTIN + ("claude", "anthropic", "openai", "fixture")
    offenders = [s for s in literals if any(name in s for name in names)]
    assert offenders == []


def test_a_later_descriptor_replaces_a_built_in_one_and_broken_ones_are_skipped_with_a_reason(tmp_path: Path) -> None:
    user = tmp_path / "adapters"
    write(user, "codex.toml", 'description = "mine"\n[runtime_entrypoints]\ndispatch = "x:y"\n'
                              'capabilities = ["dispatch"]\n[[models]]\nid = "m"\nbucket = "b"\n')
    write(user, "bad-cap.toml", '[runtime_entrypoints]\ncapabilities = ["teleport"]\n')
    write(user, "no-entry.toml", '[runtime_entrypoints]\ncapabilities = ["dispatch"]\n')
    write(user, "bad-toml.toml", "id = \n")
    write(user, "twice.toml", '[[models]]\nid = "a"\n[[models]]\nid = "a"\n')
    write(user, "bad-default.toml", 'default_model = "zz"\n[[models]]\nid = "a"\n')
    registry = discover([BUILTIN_DIR, user])
    assert registry.get("codex").description == "mine" and registry.get("codex").pool("m") == "codex:b"
    joined = "\n".join(registry.errors)
    for name, words in (("bad-cap", "teleport"), ("no-entry", "no dispatch entrypoint"), ("bad-toml", "TOML"),
                        ("twice", "declared twice"), ("bad-default", "default_model")):
        assert f"{name}.toml" in joined and words in joined, (name, joined)
    assert "bad-cap" not in registry


def test_a_missing_capability_or_undeclared_target_is_an_explicit_invalid_failure(tmp_path: Path) -> None:
    registry = registry_for(str(FIXTURE_ADAPTERS))
    cases = [
        (lambda: registry.get("no-dispatch").load_runtime({}), "does not declare dispatch"),
        (lambda: registry.get("no-dispatch").check("other", ""), "does not declare model_selection"),
        (lambda: registry.get("no-dispatch").check("", "high"), "does not declare effort_selection"),
        (lambda: registry.get("claude-code").check("gpt-5", ""), "does not declare model 'gpt-5'"),
        (lambda: registry.get("claude-code").check("", "ludicrous"), "does not accept effort 'ludicrous'"),
        (lambda: registry.get("nope"), "unknown adapter 'nope'"),
    ]
    for call, words in cases:
        with pytest.raises(TargetError, match=words):
            call()
    registry.get("no-dispatch").check("static", "")  # its own default needs no model_selection
    registry.get("codex").check("any-model-string", "high")  # an empty catalog accepts any model


def test_pools_follow_the_declared_buckets() -> None:
    registry = registry_for(str(FIXTURE_ADAPTERS))
    assert registry.get("claude-code").pool("claude-opus-4-8") == "claude-code:opus-4x"
    fixture = registry.get("fixture-cli")
    assert fixture.pool("fixture-big") == fixture.pool("fixture-big-2") == "fixture-cli:big"
    assert fixture.pool("fixture-fast") == "fixture-cli:fast"
    assert registry.get("codex").pool("o9") == "codex"  # no pools declared: the adapter is one pool
    assert registry.get("litellm").pool("openai/gpt-x") == "litellm:openai/gpt-x"  # pool_per_model


def test_an_entrypoint_that_cannot_load_is_a_descriptor_error(tmp_path: Path) -> None:
    path = write(tmp_path, "ghost.toml", '[runtime_entrypoints]\ndispatch = "missing_file.py:Factory"\n'
                                         'capabilities = ["dispatch"]\n')
    with pytest.raises(DescriptorError, match="ghost.toml.*cannot be loaded"):
        load_descriptor(path).load_runtime({})


# ---- parity: every adapter declaring dispatch normalises failures the same way (seed 000) ----------------


def _dispatchers() -> list[str]:
    registry = registry_for(str(FIXTURE_ADAPTERS))
    return [d.id for d in registry.descriptors.values() if d.has(DISPATCH)]


@pytest.fixture(params=_dispatchers())
def runtime(request: pytest.FixtureRequest):
    return registry_for(str(FIXTURE_ADAPTERS)).get(request.param).load_runtime({})


@pytest.mark.parametrize("wording", [
    "Error: 429 Too Many Requests", "Rate limit reached for requests", "rate_limit_error: too many tokens",
    "Claude AI usage limit reached|1800003600", "exceeded retry limit, last status: 429 Too Many Requests",
    "RESOURCE_EXHAUSTED: Quota exceeded"])
def test_parity_a_common_provider_limit_is_retryable_capacity_known_failed(runtime, wording: str) -> None:
    failure = runtime.normalise(NativeError(wording), NOW)
    assert (failure.category, failure.retryable, failure.outcome) == ("capacity", True, "known_failed")


@pytest.mark.parametrize("native, seconds", [
    (NativeError("429 Too Many Requests: rate limit exceeded, retry after 30 seconds"), 30),
    (NativeError("Rate limit reached. Please try again in 1m30s."), 90),
    (NativeError("Claude AI usage limit reached|1800003600"), 3600),
    (NativeError("rate limited", status=429, retry_after="12"), 12),
])
def test_parity_a_provider_supplied_delay_is_extracted(runtime, native: NativeError, seconds: int) -> None:
    assert runtime.normalise(native, NOW).retry_after_s == seconds


@pytest.mark.parametrize("native", [NativeError("Request timed out after 600 s"),
                                    NativeError("upstream stalled", timed_out=True),
                                    NativeError("gateway timeout", status=504)])
def test_parity_a_timeout_keeps_an_unknown_outcome(runtime, native: NativeError) -> None:
    failure = runtime.normalise(native, NOW)
    assert (failure.category, failure.outcome) == ("timeout", "unknown")


@pytest.mark.parametrize("native", [NativeError("401 Unauthorized: invalid api key"),
                                    NativeError("Invalid API key · Fix external API key"),
                                    NativeError("denied", status=403)])
def test_parity_auth_is_auth_never_a_timed_limit(runtime, native: NativeError) -> None:
    failure = runtime.normalise(native, NOW)
    assert (failure.category, failure.retryable, failure.retry_after_s) == ("auth", False, None)


@pytest.mark.parametrize("native", [NativeError("segmentation fault (core dumped) ☃"), NativeError(""),
                                    NativeError("weird", status=418)])
def test_parity_an_unanticipated_failure_still_gets_a_category(runtime, native: NativeError) -> None:
    failure = runtime.normalise(native, NOW)
    assert failure.category in CATEGORIES and failure.message


# ---- the CLI adapters on the real CLIs' recorded output -------------------------------------------------


def replayer(tmp_path: Path, capture: str, exit_code: int) -> str:
    """An executable that prints a recorded CLI output and exits like the CLI did (arguments ignored)."""
    script = write(tmp_path, "replay-cli", f"#!/bin/sh\ncat '{CAPTURES / capture}'\nexit {exit_code}\n")
    script.chmod(0o755)
    return str(script)


def run_cli(runtime_class: type, tmp_path: Path, capture: str, exit_code: int) -> ChildProgress:
    adapter = "claude-code" if runtime_class is ClaudeCodeRuntime else "codex"
    runtime = runtime_class(registry_for("").get(adapter), {"bin": replayer(tmp_path, capture, exit_code)})
    progress = ChildProgress()
    trio.run(runtime.run, ChildJob("j", "r", "what is 6*7", adapter, "scripted-model"), progress)
    return progress


def test_claude_code_answer_session_and_usage_come_from_its_stream_json(tmp_path: Path) -> None:
    p = run_cli(ClaudeCodeRuntime, tmp_path, "claude-code_2.1.197_ok.jsonl", 0)
    assert (p.text, p.finish_reason, p.failure) == ("The answer is 42.", "stop", None)
    assert p.native_id == "218036ef-95ad-4c7e-9551-765fe2316342" and p.model == "scripted-model"
    assert (p.input_tokens, p.output_tokens) == (19038, 4)


@pytest.mark.parametrize("capture, category, retryable", [
    ("claude-code_2.1.197_429.jsonl", "capacity", True), ("claude-code_2.1.197_401.jsonl", "auth", False),
    ("claude-code_2.1.197_529.jsonl", "provider", True)])
def test_claude_code_errors_are_normalised_from_its_result_event(tmp_path: Path, capture: str, category: str,
                                                                 retryable: bool) -> None:
    p = run_cli(ClaudeCodeRuntime, tmp_path, capture, 1)
    assert (p.failure.category, p.failure.retryable, p.finish_reason) == (category, retryable, None)
    assert p.text == "", "a synthetic error message is not the child's answer"


def test_codex_answer_errors_and_work_come_from_its_json_events(tmp_path: Path) -> None:
    ok = run_cli(CodexRuntime, tmp_path, "codex_0.171.0_ok.jsonl", 0)
    assert (ok.text, ok.finish_reason) == ("The answer is 42.", "stop")
    assert ok.native_id == "01a22ccc-88c5-7733-a83d-cb5623ccaef0"
    assert (ok.input_tokens, ok.output_tokens, ok.accepted_work) == (10109, 4, False)
    limited = run_cli(CodexRuntime, tmp_path, "codex_0.171.0_429.jsonl", 1)
    assert (limited.failure.category, limited.failure.opens_breaker) == ("capacity", True)
    worked = run_cli(CodexRuntime, tmp_path, "codex_0.171.0_reconnect_then_work.jsonl", 0)
    assert worked.accepted_work and worked.failure is None
    assert worked.text.endswith("Done: I ran the tool and read its output.")


def test_cli_adapters_put_model_and_effort_in_flags_and_the_prompt_after_a_double_dash() -> None:
    job = ChildJob("j", "r", "--help me", "x", "claude-haiku-4-5", "low")
    claude = ClaudeCodeRuntime(registry_for("").get("claude-code"), {"extra_args": ["--allowedTools", "Read"]})
    assert claude.argv(job) == ["claude", "-p", "--output-format", "stream-json", "--verbose", "--model",
                                "claude-haiku-4-5", "--effort", "low", "--allowedTools", "Read", "--", "--help me"]
    codex = CodexRuntime(registry_for("").get("codex"), {"bin": "/opt/codex"})
    assert codex.argv(job) == ["/opt/codex", "exec", "--json", "--skip-git-repo-check", "--model",
                               "claude-haiku-4-5", "--config", 'model_reasoning_effort="low"', "--", "--help me"]
    assert CodexRuntime(registry_for("").get("codex"), {"bin": "no-such-cli-here"}).readiness() == \
        "'no-such-cli-here' is not on PATH"


def test_a_cli_that_cannot_start_is_an_unavailable_failure(tmp_path: Path) -> None:
    runtime = CodexRuntime(registry_for("").get("codex"), {"bin": str(tmp_path / "missing")})
    progress = ChildProgress()
    trio.run(runtime.run, ChildJob("j", "r", "hi", "codex"), progress)
    assert progress.failure.category == "unavailable" and "cannot start" in progress.failure.message


# ---- litellm, against the scripted upstream over HTTP --------------------------------------------------


async def test_litellm_streams_the_answer_and_normalises_its_exception_types(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PV_TEST_KEY", "sk-test")
    upstream = ScriptedUpstream([{"text": "hi there", "output_tokens": 2}, {"fault": {"status": 429, "retry_after": "17"}},
                                 {"fault": {"status": 529}}, {"fault": {"status": 401}},
                                 {"fault": {"first_byte_delay_s": 5}}])
    async with serve_handler(upstream) as url:
        options = {"api_base": url + "/v1", "api_key_env": "PV_TEST_KEY"}
        runtime = LiteLLMRuntime(registry_for("").get("litellm"), options)
        results = []
        for timeout_s in (30, 30, 30, 30, 0.5):
            progress = ChildProgress()
            job = ChildJob("j", "r", "hello", "litellm", "openai/scripted-model", timeout_s=timeout_s,
                           traceparent="00-" + "a" * 32 + "-" + "b" * 16 + "-01")
            await runtime.run(job, progress)
            results.append(progress)
    assert (results[0].text, results[0].finish_reason, results[0].output_tokens) == ("hi there", "stop", 2)
    assert upstream.requests[0][2]["traceparent"] == "00-" + "a" * 32 + "-" + "b" * 16 + "-01"
    assert upstream.requests[0][2]["authorization"] == "Bearer sk-test"
    got = [(p.failure.category, p.failure.retryable, p.failure.outcome, p.failure.retry_after_s) for p in results[1:]]
    assert got == [("capacity", True, "known_failed", 17), ("provider", True, "known_failed", None),
                   ("auth", False, "known_failed", None), ("timeout", True, "unknown", None)]
    assert len(upstream.requests) == 5, "no hidden SDK retries: the breaker decides"


def test_litellm_is_not_ready_without_its_key_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PV_NO_SUCH_KEY", raising=False)
    runtime = LiteLLMRuntime(registry_for("").get("litellm"), {"api_key_env": "PV_NO_SUCH_KEY"})
    assert runtime.readiness() == "$PV_NO_SUCH_KEY is not set"


def test_the_scripted_auto_mode_reads_past_proxyvisor_notes_after_a_tool_result() -> None:
    from proxyvisor.scripted.upstream import auto_turn
    from proxyvisor.proxy.formats import CHAT

    body = CHAT.request_from_chat([
        {"role": "user", "content": "List the files."},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "bash", "arguments": '{"command": "ls"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "a.py"}], "m", False, ())
    body["tools"] = [{"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}]
    assert not auto_turn(CHAT, body).tool_calls
    body["messages"].append({"role": "user", "content": '<supervisor-note signal="recite">goal</supervisor-note>'})
    assert not auto_turn(CHAT, body).tool_calls  # a note is context, not a new request
    body["messages"].append({"role": "user", "content": "Now count them."})
    assert auto_turn(CHAT, body).tool_calls
