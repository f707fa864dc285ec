"""The command line of routing: ``routing show|enable|disable|set`` (and ``supervision``, its deprecated name),
``delegate`` and ``health``."""

from __future__ import annotations

import json
import re
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from proxyvisor.adapters.state import DiskKV
from proxyvisor.adapters import settings
from proxyvisor.adapters.descriptors import registry_for
from proxyvisor.adapters.failures import Failure
from proxyvisor.adapters.health import Cooldown
from proxyvisor.adapters.health_store import HealthStore
from proxyvisor.cli import main
from proxyvisor.config import load

from helpers import files_under
from routing_support import FIXTURE_ADAPTERS

HEADER = f'''# my proxy settings: keep this comment
[proxy]
port = 9000   # a trailing comment

[upstreams.main]
# where models live
url = "http://127.0.0.1:1/v1"

[model_routing]
# routing notes the operator wrote
adapters_dir = "{FIXTURE_ADAPTERS}"
'''


@pytest.fixture
def config_file(tmp_path: Path) -> Path:
    path = tmp_path / "etc" / "config.toml"
    path.parent.mkdir()
    path.write_text(HEADER)
    return path


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_set_writes_the_policy_and_keeps_every_comment_and_unrelated_section(config_file: Path, capsys) -> None:
    code, out, err = cli(capsys, "routing", "set", "--config", str(config_file), "--role", "reviewer",
                         "--role-model", "claude-haiku-4-5", "--role-effort", "low", "--max-parallel", "3",
                         "--mode", "adaptive", "--complexity-threshold", "COMPLEX")
    assert code == 0, err
    text = config_file.read_text()
    assert text.startswith(HEADER.split("[model_routing]")[0]), "unrelated sections are byte-identical"
    assert "# routing notes the operator wrote" in text and "# a trailing comment" in text
    routing = load(str(config_file)).model_routing
    assert (routing.mode, routing.complexity_threshold, routing.max_parallel) == ("adaptive", "COMPLEX", 3)
    reviewer = routing.role("reviewer")
    assert (reviewer.adapter, reviewer.model, reviewer.effort) == ("claude-code", "claude-haiku-4-5", "low"), \
        "the adapter is named from the catalog that declares the model"
    code, _, _ = cli(capsys, "routing", "set", "--config", str(config_file), "--role", "reviewer",
                     "--role-effort", "")
    assert code == 0 and load(str(config_file)).model_routing.role("reviewer").effort == ""


@pytest.mark.parametrize("argv, reason", [
    (["--role", "r", "--role-adapter", "ghost"], "unknown adapter 'ghost'"),
    (["--role", "r", "--role-adapter", "fixture-cli", "--role-model", "gpt-x"], "does not declare model 'gpt-x'"),
    (["--role", "r", "--role-adapter", "no-effort", "--role-effort", "high"], "does not declare effort_selection"),
    (["--role", "r", "--role-adapter", "fixture-cli", "--role-effort", "max"], "does not accept effort 'max'"),
    (["--role", "r", "--role-model", "unknown-model"], "declared by no adapter"),
    (["--orchestrator-adapter", "codex", "--orchestrator-effort", "warp"], "does not accept effort 'warp'"),
    (["--role", "r", "--role-adapter", "fixture-cli", "--role-supervises", "r"], "cannot supervise itself"),
    (["--wall-clock", "5"], "wall_clock_s must be 30-3600"),
    (["--remove-role", "nobody"], "role 'nobody' is not configured"),
])
def test_a_write_the_dispatcher_could_never_satisfy_is_refused_with_the_reason(config_file: Path, capsys,
                                                                                argv: list[str], reason: str) -> None:
    before = config_file.read_bytes()
    code, _, err = cli(capsys, "routing", "set", "--config", str(config_file), *argv)
    assert code == 2 and reason in err and "refused" in err
    assert config_file.read_bytes() == before


def test_a_cycle_is_refused_at_write_time_with_a_readable_message(config_file: Path, capsys) -> None:
    for role, subs in (("leaf", ""), ("mid", "leaf"), ("lead", "mid")):
        assert cli(capsys, "routing", "set", "--config", str(config_file), "--orchestrator-adapter",
                   "fixture-cli", "--role", role, "--role-supervises", subs)[0] == 0
    before = config_file.read_bytes()
    code, _, err = cli(capsys, "routing", "set", "--config", str(config_file), "--role", "leaf",
                       "--role-supervises", "lead")
    assert code == 2 and "this would make a cycle: mid -> leaf -> lead -> mid" in err
    assert config_file.read_bytes() == before


def test_a_malformed_file_fails_closed(config_file: Path, capsys) -> None:
    config_file.write_text(HEADER + "[model_routing.roles\nadapter = ")
    before = config_file.read_bytes()
    code, _, err = cli(capsys, "routing", "enable", "--config", str(config_file))
    assert code == 2 and "not valid TOML" in err
    with pytest.raises(settings.SettingsError, match="cannot read it as TOML.*nothing written"):
        settings.update(config_file, lambda doc, current: (set(), False), registry_for(""))
    assert config_file.read_bytes() == before
    config_file.write_text(HEADER + 'mode = "sometimes"\n')
    invalid = config_file.read_bytes()
    with pytest.raises(settings.SettingsError, match="mode must be one of.*nothing written"):
        settings.update(config_file, lambda doc, current: (set(), False), registry_for(""))
    assert config_file.read_bytes() == invalid, "never replaced with defaults"


def test_writes_are_serialised_by_a_lock_and_replace_the_file_atomically(config_file: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    config_file.chmod(0o640)
    registry = registry_for(str(FIXTURE_ADAPTERS))

    def add_role(name: str):
        def change(doc, current):
            settings.routing_table(doc, "roles", name)["adapter"] = "fixture-cli"
            return {name}, False
        return change

    threads = [threading.Thread(target=settings.update, args=(config_file, add_role(f"r{i}"), registry))
               for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(r.name for r in load(str(config_file)).model_routing.roles) == [f"r{i}" for i in range(8)]
    assert oct(config_file.stat().st_mode & 0o777) == "0o640"
    assert sorted(p.name for p in config_file.parent.iterdir()) == ["config.toml"], "the lock leaves no file"
    monkeypatch.setattr(settings, "LOCK_TIMEOUT_S", 0.2)
    with settings.locked(config_file):
        with pytest.raises(settings.SettingsError, match="another writer"):
            settings.update(config_file, add_role("late"), registry)


def test_enable_show_and_disable_round_trip_the_complete_shape(tmp_path: Path, capsys,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    path = Path(os.environ["XDG_CONFIG_HOME"]) / "proxyvisor" / "config.toml"
    assert not path.exists()
    health = HealthStore(DiskKV(Path(os.environ["PROXYVISOR_STATE_DIR"]) / "health"), Cooldown())
    health.settle_sync("codex", time.time(), Failure("capacity", True, "known_failed", 600))
    assert cli(capsys, "routing", "enable")[0] == 0
    assert path.read_text() == "[model_routing]\nenabled = true\n", "a new file holds only what was set"
    code, out, _ = cli(capsys, "routing", "show", "--json")
    shown = json.loads(out)
    assert code == 0 and shown["enabled"] is True and shown["source"] == str(path)
    assert shown["policy"]["cooldown"] == {"default_seconds": 300.0, "maximum_seconds": 3600.0}
    assert shown["policy"]["children"]["wall_clock_s"] == 600.0 and shown["policy"]["roles"] == {}
    assert set(shown["adapters"]) == {"claude-code", "codex", "litellm", "scripted"}
    assert health.get("codex").state == "cooling_down", "enabling delegation never clears health"
    assert cli(capsys, "routing", "disable")[0] == 0
    assert load(str(path)).model_routing.enabled is False


def test_a_missing_config_file_named_by_config_is_created_by_every_writer(tmp_path: Path, capsys) -> None:
    for argv in (["enable"], ["disable"], ["set", "--max-parallel", "3"]):
        path = tmp_path / argv[0] / "config.toml"
        code, out, err = cli(capsys, "routing", *argv, "--config", str(path))
        assert (code, err) == (0, ""), err
        assert out.startswith(f"{path}: written")
        assert [p.name for p in path.parent.iterdir()] == ["config.toml"], "nothing is left beside the file"
    assert load(str(tmp_path / "enable" / "config.toml")).model_routing.enabled is True
    assert load(str(tmp_path / "set" / "config.toml")).model_routing.max_parallel == 3
    code, _, err = cli(capsys, "routing", "show", "--config", str(tmp_path / "nothing.toml"))
    assert code == 2 and "cannot read" in err, "a reader still names a missing file"


def test_routing_names_delegation_and_supervision_is_its_deprecated_alias(config_file: Path, capsys) -> None:
    """``routing`` edits [model_routing] and says "delegation"; ``supervision`` (the old name, kept one release)
    does the same with a one-line notice on stderr."""
    code, out, err = cli(capsys, "routing", "show", "--config", str(config_file))
    assert code == 0 and err == ""
    assert out.startswith("delegation: disabled (turn on: proxyvisor routing enable)") and "supervision" not in out
    code, out, err = cli(capsys, "supervision", "enable", "--config", str(config_file))
    assert code == 0 and out == f"{config_file}: written; delegation is enabled\n"
    assert err.count("\n") == 1 and "'supervision' is deprecated" in err and "proxyvisor routing enable" in err
    assert load(str(config_file)).model_routing.enabled is True
    code, out, err = cli(capsys, "supervision", "show", "--config", str(config_file))
    assert code == 0 and out.startswith("delegation: enabled") and "deprecated" in err
    code, out, err = cli(capsys, "routing", "disable", "--config", str(config_file))
    assert (code, err) == (0, "") and out.endswith("delegation is disabled\n")
    with pytest.raises(SystemExit):
        main(["--help"])
    listing = capsys.readouterr().out
    assert "routing" in listing and "deprecated name of 'routing'" in listing


def test_a_saved_target_whose_adapter_is_gone_is_shown_not_blanked(config_file: Path, capsys) -> None:
    config_file.write_text(HEADER + '[model_routing.roles.old]\nadapter = "retired-cli"\nmodel = "m"\n')
    code, out, _ = cli(capsys, "routing", "show", "--config", str(config_file))
    assert code == 0
    assert "old: UNAVAILABLE: unknown adapter 'retired-cli'" in out and "saved: adapter=retired-cli model=m" in out
    assert cli(capsys, "routing", "disable", "--config", str(config_file))[0] == 0, "never blocks disabling"
    code, _, err = cli(capsys, "routing", "enable", "--config", str(config_file))
    assert code == 2 and "role 'old': unknown adapter 'retired-cli'" in err


# ---- delegate and health ----------------------------------------------------------------------------------


def _enabled(config_file: Path, extra: str = "") -> None:
    config_file.write_text(HEADER + "enabled = true\n" + extra + '[model_routing.roles.helper]\nadapter = "scripted"\n')


def test_delegate_runs_a_child_and_prints_its_result_and_evidence(config_file: Path, tmp_path: Path, capsys,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    _enabled(config_file)
    code, out, _ = cli(capsys, "delegate", "--config", str(config_file), "--role", "helper", "say hello")
    assert (code, out) == (0, "Hello from the scripted upstream.\n")
    monkeypatch.setenv("TRACEPARENT", "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
    code, out, _ = cli(capsys, "delegate", "--config", str(config_file), "--role", "helper", "--json", "again")
    result = json.loads(out)
    assert result["status"] == "ok" and result["evidence"]["trace_id"] == "4bf92f3577b34da6a3ce929d0e0e4736"
    assert result["evidence"]["gen_ai.provider.name"] == "scripted"
    code, _, err = cli(capsys, "delegate", "--config", str(config_file), "--role", "nobody", "x")
    assert code == 2 and err.startswith("proxyvisor: nothing ran: role 'nobody' is not configured (configured: ")
    assert "Tool '" not in err


def test_delegate_claim_checks_a_long_result_and_prints_the_record_later(config_file: Path, tmp_path: Path,
                                                                          capsys) -> None:
    script = tmp_path / "long.json"
    long_text = "".join(f"line {i}\n" for i in range(2000))
    script.write_text(json.dumps([{"text": long_text}]))
    _enabled(config_file, f'[model_routing.adapter_options.scripted]\nscript = "{script}"\n')
    code, out, _ = cli(capsys, "delegate", "--config", str(config_file), "--role", "helper", "--json", "go")
    result = json.loads(out)
    record = result["record_id"]
    assert code == 0 and record and record in result["result"] and len(result["result"]) < 6000
    code, out, _ = cli(capsys, "delegate", "--config", str(config_file), "--record", record)
    assert (code, out) == (0, long_text)
    code, _, err = cli(capsys, "delegate", "--config", str(config_file), "--record", "clm_nothing")
    assert code == 1 and "no stored result" in err


def test_delegate_retries_a_transient_failure_and_lists_what_became_a_dead_letter(config_file: Path, tmp_path: Path,
                                                                                   capsys) -> None:
    script = tmp_path / "overloaded.json"
    unavailable = {"fault": {"status": 503, "message": "unavailable"}}
    script.write_text(json.dumps([unavailable] * 3))
    _enabled(config_file, f'[model_routing.children]\nretry_backoff_s = 0.05\n'
                          f'[model_routing.adapter_options.scripted]\nscript = "{script}"\n')
    assert cli(capsys, "delegate", "--config", str(config_file), "--dead-letters")[1] == (
        "no dead letters: no hand-off failed on every attempt\n")
    assert files_under(Path(os.environ["PROXYVISOR_STATE_DIR"]) / "dead_letters") == [], "listing creates nothing"
    code, out, err = cli(capsys, "delegate", "--config", str(config_file), "--role", "helper", "first task")
    assert (code, out) == (1, "")
    letter = re.search(r"dead letter (dl_[0-9a-f]{20})", err).group(1)
    assert re.search(r"helper failed \(provider: HTTP 503: unavailable\): attempt 2 of 3 in 0\.\d s", err)
    assert err.rstrip().endswith(f"gave up: 3 attempts failed; dead letter {letter} (`proxyvisor delegate "
                                 "--dead-letters` lists it)")
    script.write_text(json.dumps([unavailable, {"text": "ok now"}]))  # this hand-off survives on its retry
    code, out, err = cli(capsys, "delegate", "--config", str(config_file), "--role", "helper", "--json", "second")
    result = json.loads(out)
    assert code == 0 and result["result"] == "ok now" and result["dead_letter"] is None
    assert [a["outcome"] for a in result["evidence"]["attempts"]] == ["failed", "answered"]
    code, out, _ = cli(capsys, "delegate", "--config", str(config_file), "--dead-letters")
    assert code == 0 and out.startswith(f"{letter}  ") and out.count("dl_") == 1
    assert "prompt (10 characters): first task" in out


def test_delegate_does_nothing_while_delegation_is_disabled(config_file: Path, capsys) -> None:
    config_file.write_text(HEADER + '[model_routing.roles.helper]\nadapter = "scripted"\n')
    code, _, err = cli(capsys, "delegate", "--config", str(config_file), "--role", "helper", "hi")
    assert code == 2 and "delegation is disabled" in err and "proxyvisor routing enable" in err
    assert files_under(Path(os.environ["PROXYVISOR_STATE_DIR"])) == []


def test_health_show_and_clear(capsys) -> None:
    state = Path(os.environ["PROXYVISOR_STATE_DIR"])
    assert cli(capsys, "health", "show")[1] == "no pool has recorded health: every pool is healthy\n"
    assert files_under(state) == [], "showing health creates nothing"
    store = HealthStore(DiskKV(state / "health"), Cooldown())
    store.settle_sync("claude-code:opus-4x", time.time(), Failure("capacity", True, "known_failed", 120))
    store.settle_sync("claude-code:haiku-4-5", time.time(), Failure("auth", False, "known_failed"))
    store.close()
    code, out, _ = cli(capsys, "health", "show")
    assert code == 0 and "claude-code:opus-4x: cooling_down, recovers in 1" in out
    assert "claude-code:haiku-4-5: healthy; failures in a row: 0 (last failure: auth)" in out
    code, out, _ = cli(capsys, "health", "clear", "claude-code:opus-4x")
    assert out == "cleared 1 pool(s): claude-code:opus-4x\n"
    assert [p["pool"] for p in json.loads(cli(capsys, "health", "show", "--json")[1])["pools"]] == [
        "claude-code:haiku-4-5"]


def _two_upstreams_cooling(state: Path) -> list[str]:
    store = HealthStore(DiskKV(state / "health"), Cooldown())
    pools = ["upstream:a:m1", "upstream:a:m2", "upstream:ab:m1", "claude-code:opus-4x"]
    for pool in pools:
        store.settle_sync(pool, time.time(), Failure("capacity", True, "known_failed", 120))
    store.close()
    return pools


@pytest.mark.parametrize("name", ["", " ", "\t"], ids=["empty", "space", "tab"])
@pytest.mark.parametrize("action", ["clear", "show"])
def test_an_empty_pool_name_is_an_error_never_every_pool(capsys, action: str, name: str) -> None:
    """A script's unset "$POOL" (``health clear "$POOL"``) clears nothing: every pool takes no name at all."""
    state = Path(os.environ["PROXYVISOR_STATE_DIR"])
    pools = _two_upstreams_cooling(state)
    code, out, err = cli(capsys, "health", action, name)
    done = "cleared" if action == "clear" else "shown"
    assert (code, out) == (2, "")
    assert err == (f"proxyvisor: health {action}: the pool name is empty; nothing {done} (name a pool or an adapter "
                   "as 'health show' lists them, 'upstream' for every pool of the agent, or give no name for every "
                   "pool)\n")
    assert sorted(p.pool for p in HealthStore(DiskKV(state / "health"), Cooldown()).all()) == sorted(pools)
    with pytest.raises(ValueError, match="an empty pool name names no pool"):
        HealthStore(DiskKV(state / "health"), Cooldown()).clear(name)
    assert cli(capsys, "health", "clear")[:2] == (0, f"cleared 4 pool(s): {', '.join(sorted(pools))}\n")


def test_health_show_takes_a_pool_an_upstream_or_an_adapter_as_clear_does(config_file: Path, capsys) -> None:
    state = Path(os.environ["PROXYVISOR_STATE_DIR"])
    _two_upstreams_cooling(state)

    def shown(*name: str) -> list[str]:
        code, out, err = cli(capsys, "health", "show", *name, "--json", "--config", str(config_file))
        assert (code, err) == (0, "")
        return [row["pool"] for row in json.loads(out)["pools"]]

    assert shown("upstream:a") == ["upstream:a:m1", "upstream:a:m2"], "not upstream:ab's"
    assert shown("upstream:a:m2") == ["upstream:a:m2"]
    assert shown("upstream") == ["upstream:a:m1", "upstream:a:m2", "upstream:ab:m1"]
    assert shown("claude-code") == ["claude-code:opus-4x"]
    assert len(shown()) == 4
    code, out, _ = cli(capsys, "health", "show", "upstream:a", "--config", str(config_file))
    assert code == 0 and out.startswith("upstream:a:m1: cooling_down, recovers in ") and "upstream:ab" not in out
    # A configured upstream with nothing recorded is healthy, not unknown; a name nothing has is an error.
    code, out, _ = cli(capsys, "health", "show", "upstream:main", "--config", str(config_file))
    assert (code, out) == (0, "upstream:main: healthy (no pool of it has recorded health)\n")
    assert cli(capsys, "health", "clear", "upstream:main:m9", "--config", str(config_file))[:2] == (
        0, "cleared 0 pool(s)\n")
    code, out, err = cli(capsys, "health", "show", "upstream:nosuch", "--config", str(config_file))
    assert (code, out) == (1, "") and "no pool or adapter is named 'upstream:nosuch'; nothing shown" in err
    assert "upstream:main" in err.split("known pools: ", 1)[1]


def _garbage_databases(state: Path, store: str) -> tuple[Path, str]:
    (state / store).mkdir(parents=True)
    (state / store / "cache.db").write_text("garbage\n")
    return state / store / "cache.db", "cannot be read as a database (file is not a database)"


def _file_in_place(state: Path, store: str) -> tuple[Path, str]:
    state.mkdir(parents=True)
    (state / store).write_text("x\n")
    return state / store, "is not a folder"


@pytest.mark.parametrize("make_bad", [_garbage_databases, _file_in_place], ids=["garbage-database", "file-in-place"])
@pytest.mark.parametrize("store, argv", [
    ("health", ["health", "show"]), ("health", ["health", "show", "--json"]),
    ("health", ["health", "clear"]), ("health", ["health", "clear", "upstream"]),
    ("dead_letters", ["delegate", "--dead-letters"]), ("dead_letters", ["delegate", "--dead-letters", "--json"]),
], ids=["show", "show-json", "clear", "clear-upstream", "dead-letters", "dead-letters-json"])
def test_a_store_that_cannot_be_used_is_one_line_naming_it_never_a_traceback_or_all_healthy(
        tmp_path: Path, capsys, make_bad, store: str, argv: list[str]) -> None:
    state = tmp_path / "state"
    culprit, reason = make_bad(state, store)
    before = files_under(state)
    code, out, err = cli(capsys, *argv, "--state-dir", str(state))
    assert (code, out) == (1, ""), "no listing, no 'every pool is healthy', no 'cleared 0 pool(s)'"
    assert err == (f"proxyvisor: the {store.replace('_', ' ')} store cannot be used: {culprit} {reason}; nothing was "
                   "read or changed (move it aside or fix its permissions, and proxyvisor starts the store again, "
                   "empty; or use another state directory)\n")
    assert files_under(state) == before


def test_delegate_shows_progress_as_plain_lines_and_logger_detail_only_when_asked(tmp_path: Path, capsys) -> None:
    config = tmp_path / "config.toml"
    config.write_text(f'[model_routing]\nenabled = true\nadapters_dir = "{FIXTURE_ADAPTERS}"\n'
                      '[model_routing.roles.worker]\nadapter = "fixture-cli"\n')
    code, out, err = cli(capsys, "delegate", "--config", str(config), "--role", "worker", "mode:echo hi")
    assert code == 0 and out.startswith("mode:echo hi")
    assert err == "proxyvisor: worker started on fixture-cli (model fixture-fast)\n"
    detail = subprocess.run([sys.executable, "-m", "proxyvisor", "delegate", "--config", str(config), "--role",
                             "worker", "--log-level", "info", "mode:echo hi"], capture_output=True, text=True,
                            env={**os.environ, "FIXTURE_LOG": str(tmp_path / "runs.log")}, timeout=60)
    assert detail.returncode == 0, detail.stderr
    assert "proxyvisor INFO proxyvisor.adapters.progress: worker started on fixture-cli" in detail.stderr
    assert "proxyvisor INFO proxyvisor.adapters.process: child pid" in detail.stderr, "the logger detail"
    quiet = subprocess.run([sys.executable, "-m", "proxyvisor", "delegate", "--config", str(config), "--role",
                            "worker", "--log-level", "error", "mode:echo hi"], capture_output=True, text=True,
                           env={**os.environ, "FIXTURE_LOG": str(tmp_path / "runs.log")}, timeout=60)
    assert (quiet.returncode, quiet.stderr) == (0, "")


def test_health_clear_names_an_unknown_pool_and_lists_the_known_ones(config_file: Path, capsys) -> None:
    state = Path(os.environ["PROXYVISOR_STATE_DIR"])
    store = HealthStore(DiskKV(state / "health"), Cooldown())
    store.settle_sync("claude-code:opus-4x", time.time(), Failure("capacity", True, "known_failed", 120))
    store.close()
    code, out, err = cli(capsys, "health", "clear", "nosuch", "--config", str(config_file))
    assert (code, out) == (1, "")
    assert "no pool or adapter is named 'nosuch'; nothing cleared" in err
    known = err.split("known pools: ", 1)[1]
    assert "claude-code:opus-4x" in known, "a recorded pool"
    assert "fixture-cli:fast" in known and "fixture-cli:big" in known, "the pools the descriptors declare"
    code, out, err = cli(capsys, "health", "clear", "fixture-cli:fast", "--config", str(config_file))
    assert (code, out, err) == (0, "cleared 0 pool(s)\n", ""), "a declared pool with nothing recorded is no error"
    code, out, _ = cli(capsys, "health", "clear", "claude-code", "--config", str(config_file))
    assert (code, out) == (0, "cleared 1 pool(s): claude-code:opus-4x\n"), "an adapter clears its pools"


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_delegate_stops_its_child_on_a_signal_before_it_exits(tmp_path: Path, signum: int) -> None:
    """The child (here one that ignores SIGTERM, so the hard stop is needed too) runs in a session of its own:
    only ``delegate`` can stop it. It does, within the grace, and says on stderr what happened."""
    grace = 1.0
    config = tmp_path / "config.toml"
    config.write_text(f'[model_routing]\nenabled = true\nadapters_dir = "{FIXTURE_ADAPTERS}"\n'
                      '[model_routing.roles.worker]\nadapter = "fixture-cli"\n'
                      f'[model_routing.children]\nstop_grace_s = {grace}\nidle_warn_s = 0.3\nidle_cancel_s = 60.0\n')
    runs = tmp_path / "runs.log"
    env = {**os.environ, "FIXTURE_LOG": str(runs)}
    process = subprocess.Popen([sys.executable, "-m", "proxyvisor", "delegate", "--config", str(config), "--role",
                                "worker", "mode:ignore-term"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
    child = 0
    try:
        deadline = time.monotonic() + 20
        while not (runs.exists() and runs.read_text().endswith("\n")):
            assert process.poll() is None and time.monotonic() < deadline, process.communicate()
            time.sleep(0.05)
        child = int(runs.read_text().split()[0])
        time.sleep(0.6)  # past idle_warn_s: the idle warning comes first
        sent = time.monotonic()
        process.send_signal(signum)
        out, err = process.communicate(timeout=grace + 5)
        survived = _alive(child)
    finally:
        process.kill()
        if child and _alive(child):  # a failed test leaves no orphan behind
            os.killpg(child, signal.SIGKILL)
    assert time.monotonic() - sent < grace + 3
    assert not survived, "the child outlived delegate"
    assert process.returncode == 128 + signum and out == ""
    name = signal.Signals(signum).name
    expected = ["worker started on fixture-cli (model fixture-fast)", "worker idle: no output for 0.3 s",
                f"{name}: stopping the child", "the child ignored SIGTERM for 1 s: killing it",
                "the child stopped (killed)", f"delegate stopped by {name}"]
    lines = err.splitlines()
    assert len(lines) == len(expected) and all(line.startswith("proxyvisor: " + text)
                                               for line, text in zip(lines, expected)), err
    assert "proxyvisor." not in err and "INFO" not in err and "WARNING" not in err, "no logger detail"
    store = HealthStore(DiskKV(Path(os.environ["PROXYVISOR_STATE_DIR"]) / "health"), Cooldown())
    pools = store.all()
    store.close()
    assert [(p.pool, p.last_category) for p in pools if p.last_category or p.failure_count] == [], \
        "the user's own cancel is no failure of the pool"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
