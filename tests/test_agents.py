"""``wrap`` points known agent CLIs at the proxy by argument; other commands run exactly as given.

The end-to-end proof that Codex follows these arguments is in ``test_real_clients.py``; these tests pin the
arguments themselves, without the CLI.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from proxyvisor.agents import CODEX_QUIET_WEBSOCKET, agent_command

URL = "http://127.0.0.1:4000/s/abc/v1"


def redirected(cmd: list[str], env: dict[str, str]) -> list[str]:
    return agent_command(cmd, URL, env)[0]
BUILT_IN = ["-c", f'openai_base_url="{URL}"']


def test_commands_of_unknown_agents_are_unchanged(tmp_path: Path) -> None:
    for cmd in (["claude", "-p", "hi"], ["aider", "--message", "hi"], ["env", "codex", "exec", "hi"],
                ["codex-helper", "exec"]):
        assert redirected(cmd, {"CODEX_HOME": str(tmp_path)}) == cmd


def test_codex_built_in_provider_gets_the_url_before_the_users_arguments(tmp_path: Path) -> None:
    # No config.toml at all: only the built-in provider exists. The user's own -c comes later, so it wins.
    cmd = ["/opt/bin/codex", "exec", "-c", 'openai_base_url="http://mine/v1"', "hi"]
    assert redirected(cmd, {"CODEX_HOME": str(tmp_path)}) == ["/opt/bin/codex", *BUILT_IN, *cmd[1:]]


def test_codex_providers_of_the_users_own_are_redirected(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "config.toml").write_text('model_provider = "azure"\n'
                                          '[model_providers.azure]\nname = "Azure"\nbase_url = "https://x/v1"\n'
                                          '[model_providers.local-2]\nname = "local"\n'
                                          '[model_providers."dotted.name"]\nname = "unaddressable by -c"\n')
    expected = [*BUILT_IN, "-c", f'model_providers.azure.base_url="{URL}"',
                "-c", f'model_providers.local-2.base_url="{URL}"']
    with caplog.at_level(logging.WARNING, "proxyvisor.agents"):
        assert redirected(["codex", "exec", "hi"], {"CODEX_HOME": str(tmp_path)}) == ["codex", *expected,
                                                                                            "exec", "hi"]
    # The one -c cannot name goes past the proxy: said, not silent.
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "'dotted.name'" in warning and "past proxyvisor" in warning, warning
    # Without CODEX_HOME, Codex reads ~/.codex.
    (tmp_path / ".codex").mkdir()
    (tmp_path / "config.toml").rename(tmp_path / ".codex" / "config.toml")
    assert redirected(["codex"], {"HOME": str(tmp_path)}) == ["codex", *expected]
    # Codex does not load its config.toml here, so naming one of its providers would be an error.
    cmd = ["codex", "exec", "--ignore-user-config", "hi"]
    assert redirected(cmd, {"HOME": str(tmp_path)}) == ["codex", *BUILT_IN, *cmd[1:]]


def test_codex_with_an_unreadable_config_gets_the_built_in_override_only(tmp_path: Path) -> None:
    # Codex reports the broken file itself; wrap must not fail first.
    for text in ("model_providers = [", "model_providers = 3\n"):
        (tmp_path / "config.toml").write_text(text)
        assert redirected(["codex", "exec"], {"CODEX_HOME": str(tmp_path)}) == ["codex", *BUILT_IN, "exec"]


def test_codex_exec_gets_its_websocket_log_silenced_and_nothing_else(tmp_path: Path) -> None:
    """Codex's refused WebSocket (the proxy's 426, after which it POSTs at once) would print an ERROR line on every
    ``codex exec``: wrap silences that one log target, keeping the user's RUST_LOG (default ``error``)."""
    home = {"CODEX_HOME": str(tmp_path)}
    _, env = agent_command(["codex", "exec", "hi"], URL, home)
    assert env == {**home, "RUST_LOG": f"error,{CODEX_QUIET_WEBSOCKET}"}
    _, env = agent_command(["codex", "-m", "gpt-5", "e", "hi"], URL, {**home, "RUST_LOG": "codex_core=debug"})
    assert env["RUST_LOG"] == f"codex_core=debug,{CODEX_QUIET_WEBSOCKET}"
    # The TUI logs to a file of its own, whose filter is left alone; other commands get nothing.
    assert agent_command(["codex"], URL, home)[1] == home
    assert agent_command(["claude", "-p", "exec"], URL, home)[1] == home
