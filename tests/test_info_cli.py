"""``proxyvisor info`` and ``proxyvisor plan``: from a running proxy, and from the ledger when none answers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import trio

from proxyvisor.cli import main
from proxyvisor.gate import plan as plans
from proxyvisor.store import Store

from helpers import closed_port, http_client, request_body

REPORT = '<sup>{"state":"exploring","focus":"look","next":null,"carry":["config in etc/app.toml"],"plan":null}</sup>'
PLAN = plans.Plan("Ship it", (plans.Phase("Build", "make succeeds", plans.IN_PROGRESS),
                              plans.Phase("Test", "make test passes")))


async def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """``proxyvisor ARGV`` in a thread (it blocks on HTTP to a proxy served by this test's event loop)."""
    code = await trio.to_thread.run_sync(main, list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def rows(text: str) -> dict[str, str]:
    return {row[1].strip(): row[2].strip() for row in (line.split("|") for line in text.splitlines()[4:])}


async def test_info_and_plan_ask_the_running_proxy(start_proxy, capsys) -> None:
    async with start_proxy([{"text": f"Looking.\n{REPORT}", "input_tokens": 50, "output_tokens": 5}] * 2) as rp:
        async with http_client(rp.url) as client:
            for session in ("older", "newer"):
                reply = await client.post(f"/s/{session}/v1/chat/completions", json=request_body("chat"))
                assert reply.status_code == 200
        code, out, err = await cli(capsys, "info", "--url", rp.url)
        assert (code, err) == (0, "")
        assert out.startswith("**proxyvisor /info · session newer**")  # the most recently active session
        assert rows(out)["model requests"] == "1 (tool rounds 0, errors 0)"
        assert rows(out)["upstream"].startswith("50 in / 5 out tokens")

        code, out, _ = await cli(capsys, "info", "older", "--url", rp.url, "--json")
        info = json.loads(out)
        assert code == 0 and (info["session"], info["requests"], info["live"]["requests"]) == ("older", 1, 1)
        assert info["self_report"]["by_state"] == {"exploring": 1}

        thread = next(iter(rp.pipeline.sessions.get("older").supervision.threads.values()))
        thread.plan = PLAN
        code, out, _ = await cli(capsys, "plan", "older", "--url", rp.url)
        assert code == 0
        assert out == (plans.render_text(PLAN) + "\n\nRetained critical knowledge (from the latest self-report):\n"
                       "- config in etc/app.toml\n")
        code, out, _ = await cli(capsys, "plan", "older", "--url", rp.url, "--json")
        got = json.loads(out)
        assert (got["plan"]["plan_title"], got["carry"]) == ("Ship it", ["config in etc/app.toml"])

        code, out, err = await cli(capsys, "info", "nobody", "--url", rp.url)
        assert (code, out) == (1, "") and "no session 'nobody'" in err


async def test_the_configured_address_and_token_are_used(start_proxy, capsys, tmp_path: Path) -> None:
    async with start_proxy(proxy={"auth_token": "tok-123"}) as rp:
        async with http_client(rp.url) as client:
            await client.post("/s/guarded/v1/messages", json=request_body("messages"),
                              headers={"x-proxyvisor-auth": "tok-123"})
        config = tmp_path / "config.toml"
        config.write_text(f'[proxy]\nhost = "127.0.0.1"\nport = {rp.port}\nauth_token = "tok-123"\n')
        code, out, _ = await cli(capsys, "info", "--config", str(config), "--json")
        assert code == 0 and json.loads(out)["session"] == "guarded"
        config.write_text(f'[proxy]\nport = {rp.port}\nauth_token = "wrong-1"\n')
        code, out, err = await cli(capsys, "info", "--config", str(config))
        assert code == 1 and "x-proxyvisor-auth" in err


async def test_the_listing_is_asked_with_the_admin_token_and_without_it_the_latest_ledger_names_the_session(
        start_proxy, capsys, tmp_path: Path) -> None:
    async with start_proxy(proxy={"admin_token": "adm-123"}) as rp:
        async with http_client(rp.url) as client:
            await client.post("/s/listed/v1/messages", json=request_body("messages"))
        config, empty = tmp_path / "config.toml", tmp_path / "empty-state"
        config.write_text(f'[proxy]\nport = {rp.port}\nadmin_token = "adm-123"\n')
        code, out, _ = await cli(capsys, "info", "--config", str(config), "--state-dir", str(empty), "--json")
        assert code == 0 and json.loads(out)["session"] == "listed"  # from the listing: no ledger here
        config.write_text(f'[proxy]\nport = {rp.port}\n')
        code, out, err = await cli(capsys, "plan", "--config", str(config), "--state-dir", str(empty))
        assert code == 1 and "admin_token" in err and "name the session" in err
        code, out, _ = await cli(capsys, "plan", "--config", str(config), "--json")  # the ledger written last
        assert code == 0 and json.loads(out)["session"] == "listed"
        code, out, _ = await cli(capsys, "plan", "listed", "--config", str(config), "--state-dir", str(empty))
        assert code == 0 and out.startswith(plans.NO_PLAN)


def _ledger(state: Path, session: str, lines: list[dict[str, Any]]) -> None:
    store = Store(state)
    for line in lines:
        store.append_ledger(session, line)


async def test_without_a_proxy_info_sums_the_ledger_and_plan_says_no_state_is_stored(capsys, tmp_path: Path) -> None:
    state, url = tmp_path / "state", f"http://127.0.0.1:{closed_port()}"
    _ledger(state, "first", [{"status": 200, "model": "m", "input_tokens": 1, "output_tokens": 1}])
    _ledger(state, "second", [{"status": 200, "tool_round": True, "signals": ["loop"], "steer": "loop",
                               "report": {"status": "ok", "state": "progressing"}, "overhead_ms": 2.5},
                              {"status": 500, "error": "upstream", "overhead_ms": 0.5}])
    code, out, err = await cli(capsys, "info", "--url", url, "--state-dir", str(state))
    assert code == 0 and f"no proxy answers at {url}" in err
    assert out.startswith("**proxyvisor /info · session second**")  # the ledger written last
    assert rows(out)["model requests"] == "2 (tool rounds 1, errors 1)"
    assert rows(out)["steer notes"] == "loop 1"
    assert rows(out)["proxy overhead"] == "total 3.0 ms · mean 1.5 · p50 1.5 · max 2.5 ms"

    code, out, _ = await cli(capsys, "info", "first", "--url", url, "--state-dir", str(state), "--json")
    info = json.loads(out)
    assert code == 0 and (info["session"], info["requests"], info["live"]) == ("first", 1, None)

    code, out, err = await cli(capsys, "info", "third", "--url", url, "--state-dir", str(state))
    assert code == 1 and out == "" and "no ledger for session 'third'" in err

    # Ledgers written by hand: no proxy stored a supervision state for them.
    code, out, err = await cli(capsys, "plan", "--url", url, "--state-dir", str(state))
    assert code == 1 and out == "" and f"no supervision state of session second is stored (diskcache under {state})" \
        in err and "Start the proxy that serves it, or give its address with --url." in err
    assert err.startswith(f"proxyvisor plan: no proxy answers at {url}")  # worded as info words it
    code, out, _ = await cli(capsys, "plan", "--url", url, "--state-dir", str(state), "--json")
    assert code == 1 and json.loads(out)["plan"] is None


async def test_without_a_proxy_plan_reads_the_sessions_stored_state(start_proxy, capsys, state_dir: Path) -> None:
    """The proxy that served the session is gone (a wrap that ended): its stored state has the plan."""
    url = f"http://127.0.0.1:{closed_port()}"
    async with start_proxy([{"text": f"Looking.\n{REPORT}"}] * 2) as rp, http_client(rp.url) as client:
        assert (await client.post("/s/planned/v1/chat/completions", json=request_body("chat"))).status_code == 200
        thread = next(iter(rp.pipeline.sessions.get("planned").supervision.threads.values()))
        thread.plan = PLAN  # as the planner would set it; the session's next request stores it
        assert (await client.post("/s/planned/v1/chat/completions", json=request_body("chat"))).status_code == 200
    code, out, err = await cli(capsys, "plan", "planned", "--url", url)
    assert code == 0 and out == (plans.render_text(PLAN) + "\n\nRetained critical knowledge (from the latest "
                                 "self-report):\n- config in etc/app.toml\n")
    assert err == (f"proxyvisor plan: no proxy answers at {url}; reading session planned's stored state (diskcache "
                   f"under {state_dir})\n")
    code, out, _ = await cli(capsys, "plan", "--url", url, "--json")  # the session whose ledger was written last
    got = json.loads(out)
    assert code == 0 and (got["session"], got["plan"]["plan_title"], got["carry"]) == \
        ("planned", "Ship it", ["config in etc/app.toml"])
    code, out, err = await cli(capsys, "plan", "nobody", "--url", url)
    assert code == 1 and out == "" and "no supervision state of session nobody is stored" in err


async def test_without_a_proxy_a_runs_id_names_the_session_its_latest_line_went_to(capsys, tmp_path: Path) -> None:
    state, url = tmp_path / "state", f"http://127.0.0.1:{closed_port()}"
    _ledger(state, "resumed", [{"time": "2026-01-01T00:00:01.000+00:00", "status": 200, "run": "run1"},
                               {"time": "2026-01-01T00:00:03.000+00:00", "status": 200, "run": "run2"}])
    _ledger(state, "subagent", [{"time": "2026-01-01T00:00:02.000+00:00", "status": 200, "run": "run1"},
                                {"time": "2026-01-01T00:00:04.000+00:00", "status": 200, "run": "run3",
                                 "delegations": [{"run": "run2"}]}])  # a field of another object: no line of run2
    for run, session in (("run1", "subagent"), ("run2", "resumed"), ("run3", "subagent")):
        code, out, err = await cli(capsys, "info", run, "--url", url, "--state-dir", str(state), "--json")
        assert code == 0 and json.loads(out)["session"] == session, (run, err)
        assert f"summing the ledger of session {session} (where run {run}'s latest request went)" in err
    code, out, err = await cli(capsys, "info", "run4", "--url", url, "--state-dir", str(state))
    assert code == 1 and "no ledger for session 'run4'" in err
    assert Store(state).session_of_run("run4") is None


async def test_something_else_on_the_port_counts_as_no_proxy(capsys, tmp_path: Path, scripted_server) -> None:
    """A server that is not proxyvisor (here the scripted upstream, which 404s the path) is not asked further."""
    _ledger(tmp_path / "state", "only", [{"status": 200}])
    code, out, err = await cli(capsys, "info", "--url", scripted_server.url, "--state-dir", str(tmp_path / "state"))
    assert code == 0 and "summing the ledger" in err and "session only" in out


def _help(command: str) -> str:
    from proxyvisor.cli import build_parser

    return build_parser()._subparsers._group_actions[0].choices[command].format_help()  # noqa: SLF001


def test_info_and_plan_each_document_their_own_fallback_and_exit_status() -> None:
    info, plan = _help("info"), _help("plan")
    assert "which is all /info needs" in info and "no plan to show" not in info
    assert "which is all /info needs" not in plan and "plan exits 1" in plan
    assert "1 no proxy answers" in plan and "1 no proxy answers" not in info
    for text in (info, plan):  # the options point at a section that is there
        assert "(see 'files and environment' below)" in text and "\nfiles and environment:\n" in text


@pytest.mark.parametrize("argv", [["info", "--bogus"], ["plan", "--url", "notaurl"], ["info", "--url", "ftp://h"],
                                  ["info", "--url", "http://h:99999"], ["info", "--url", "http://h/path"]])
def test_bad_options_get_the_commands_own_usage(capsys, argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.startswith(f"usage: proxyvisor {argv[0]} ")
    assert ("unrecognized arguments: --bogus" if "--bogus" in argv else "expected http://HOST[:PORT]") in err


def test_a_url_with_a_port_and_a_trailing_slash_is_accepted() -> None:
    from proxyvisor.info_cli import _url_arg

    for url in ("http://127.0.0.1:8377", "https://proxy.example/", "http://[::1]:8377"):
        assert _url_arg(url) == url


def test_one_check_for_the_proxys_address_in_url_and_in_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from proxyvisor.info_cli import proxy_origin
    from proxyvisor.mcp_server import _wrapped

    assert proxy_origin("http://127.0.0.1:8377/") == "http://127.0.0.1:8377"
    assert proxy_origin("http://127.0.0.1:8377/s/abc") is None
    assert proxy_origin("http://127.0.0.1:8377/s/abc", session_path=True) == "http://127.0.0.1:8377"
    for bad in ("http://user:secret@127.0.0.1:8377/s/abc", "http://127.0.0.1:99999/s/abc", "ftp://host/s/abc",
                "http:///s/abc", "http://127.0.0.1:8377/s/abc?x=1"):
        assert proxy_origin(bad, session_path=True) is None, bad
        monkeypatch.setenv("PROXYVISOR_URL", bad)
        assert _wrapped()[0] is None, bad
    monkeypatch.setenv("PROXYVISOR_URL", "http://127.0.0.1:8377/s/abc")
    assert _wrapped()[0] == "http://127.0.0.1:8377"
