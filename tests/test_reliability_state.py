"""A full disk, a bad state directory and an unreadable ledger: the ledger holds only whole lines, the requests it
misses are counted, a store that cannot work turns its feature off with one warning naming the path and why, and
no traceback, no "cannot listen" and no 500 of proxyvisor's own reaches anyone."""

from __future__ import annotations

import errno
import logging
import os
import signal
import stat
import sys
from pathlib import Path

import httpx
import orjson
import pytest
import trio

from proxyvisor.adapters.state import DiskBackend
from proxyvisor.config import Config
from proxyvisor.proxy.pipeline import check_state
from proxyvisor.serve import stop_notices
from proxyvisor.store import Store

from helpers import TEXT_STEP, assert_error_shape, closed_port, files_under, http_client, path_of, raw_stream, request_body
from test_reliability_crash import start_serve, whole_lines

_REAL_WRITE = os.write


def _full_disk(monkeypatch: pytest.MonkeyPatch, room: int) -> None:
    """From now on the disk takes ``room`` more bytes of regular files (a short write), then refuses with ENOSPC.
    Sockets and pipes are not files: they write on."""
    left = [room]

    def write(fd: int, data: bytes) -> int:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return _REAL_WRITE(fd, data)
        if left[0] <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        n = _REAL_WRITE(fd, bytes(data)[:left[0]])
        left[0] -= n
        return n

    monkeypatch.setattr(os, "write", write)


def test_a_full_disk_never_leaves_a_half_line_and_counts_what_it_could_not_record(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    store = Store(tmp_path / "state")
    assert store.append_ledger("s1", {"n": 1, "pad": "x" * 40})
    path = store.ledger_path("s1")
    _full_disk(monkeypatch, room=20)  # a record is longer: its write is cut short
    with caplog.at_level(logging.WARNING, logger="proxyvisor.store"):
        assert not store.append_ledger("s1", {"n": 2, "pad": "x" * 40})
        assert not store.append_ledger("s1", {"n": 3, "pad": "x" * 40})
        assert whole_lines(path.parent) == {"s1": 1}
        monkeypatch.undo()
        assert store.append_ledger("s1", {"n": 4})
    assert [r["n"] for r in store.read_ledger("s1")] == [1, 4]
    assert whole_lines(path.parent) == {"s1": 2}
    assert store.unrecorded == 2
    failures = [r.getMessage() for r in caplog.records if "cannot write" in r.getMessage()]
    assert len(failures) == 1 and str(path) in failures[0] and os.strerror(errno.ENOSPC) in failures[0], failures
    assert any("writing again" in r.getMessage() and r.getMessage().endswith(": 2") for r in caplog.records)


def test_a_torn_last_line_is_skipped_and_the_next_record_starts_on_its_own_line(tmp_path: Path) -> None:
    store = Store(tmp_path / "state")
    store.append_ledger("s1", {"n": 1})
    with open(store.ledger_path("s1"), "ab") as f:
        f.write(b'{"n": 2, "torn')  # a power cut in the middle of a write
    assert store.append_ledger("s1", {"n": 3})
    assert [line["n"] for line in store.read_ledger("s1")] == [1, 3]


async def test_requests_the_ledger_misses_are_counted_in_info_and_in_the_exit_summary(
        start_proxy, monkeypatch: pytest.MonkeyPatch) -> None:
    async with start_proxy([TEXT_STEP, TEXT_STEP]) as rp:
        first, _ = await raw_stream(rp.url + "/s/full", "chat", request_body("chat"))
        _full_disk(monkeypatch, room=0)
        second, _ = await raw_stream(rp.url + "/s/full", "chat", request_body("chat"))
        monkeypatch.undo()
        assert (first.status_code, second.status_code) == (200, 200)  # the answer never pays for the disk
        async with http_client() as client:
            info = (await client.get(rp.url + "/proxyvisor/sessions/full/info")).json()
        _, text = await raw_stream(rp.url + "/s/full", "chat", {
            "model": "m", "messages": [{"role": "user", "content": "/info"}]})
        notices = stop_notices(rp)
    assert info["requests"] == 1 and info["live"]["requests"] == 2 and info["live"]["unrecorded"] == 1
    answer = orjson.loads(text)["choices"][0]["message"]["content"]
    assert "not in the ledger" in answer and "| 1 request (" in answer, answer
    assert notices == ["proxyvisor: 1 request not recorded in the ledger (see the warnings above)"]


_BIG_TOOL_RESULT = "".join(f"{i:05d} INFO worker {i % 7}: step finished in {i % 13} ms\n" for i in range(6000))


def _condensable() -> dict:
    """A chat request whose tool result is far over the condense threshold, from an agent with a shell."""
    return {**request_body("chat"), "messages": [
        {"role": "user", "content": "Run the build."},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "Bash", "arguments": '{"command": "make"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": _BIG_TOOL_RESULT}]}


def _corrupt_databases(state: Path) -> tuple[Path, str]:
    for store in ("condense", "health"):
        (state / store).mkdir(parents=True)
        (state / store / "cache.db").write_bytes(b"this is not SQLite\x00" * 64)
    return state / "condense" / "cache.db", "cannot be read as a database"


def _file_in_place(state: Path) -> tuple[Path, str]:
    state.write_text("a file where the state folder should be\n")
    return state, "is not a folder"


def _read_only(state: Path) -> tuple[Path, str]:
    state.mkdir()
    state.chmod(0o500)
    return state, "is not writable"


@pytest.mark.parametrize("make_bad", [
    _corrupt_databases, _file_in_place,
    pytest.param(_read_only, marks=pytest.mark.skipif(
        os.geteuid() == 0, reason="root may write into a read-only folder, so this test needs another user")),
], ids=["corrupt-databases", "file-in-place", "read-only"])
def test_serve_with_a_bad_state_dir_names_the_cause_and_serves_on(tmp_path: Path, make_bad) -> None:
    state = tmp_path / "state"
    culprit, reason = make_bad(state)
    before = files_under(state) if state.is_dir() else None
    config = tmp_path / "config.toml"
    config.write_text(f'[state]\ndir = "{state}"\n\n[model_routing]\nenabled = true\n'
                      '[model_routing.roles.helper]\nadapter = "claude-code"\ndescription = "does small tasks"\n')
    log = tmp_path / "serve.log"
    proc, url = start_serve(config, log)
    try:
        with httpx.Client(base_url=url, timeout=30) as client:
            for body in (request_body("chat"), _condensable(), _condensable()):
                reply = client.post("/s/bad/v1/chat/completions", json=body)
                assert reply.status_code == 200, reply.text
            info = client.post("/s/bad/v1/chat/completions",
                               json={"model": "m", "messages": [{"role": "user", "content": "/info"}]})
            assert info.status_code == 200 and "proxyvisor /info" in info.text, info.text
            endpoint = client.get("/proxyvisor/sessions/bad/info")
            assert endpoint.status_code == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(20)
        state.chmod(0o700) if state.is_dir() else None
    text = log.read_text()
    assert proc.returncode == 0, text
    assert "Traceback" not in text and "cannot listen" not in text and "ERROR" not in text, text
    warnings = [line for line in text.splitlines() if str(culprit) in line and reason in line]
    assert len(warnings) == len(set(warnings)) >= 1, text  # each store's warning once, not once per request
    assert all("is off" in line for line in warnings), warnings
    if make_bad is _corrupt_databases:  # with what to do about it
        assert all(line.endswith(f"move the folder {culprit.parent} aside (or delete it: proxyvisor runs without what "
                                  "it held) and start proxyvisor again") for line in warnings), warnings
    else:
        assert "not recorded in the ledger (the ledger is off" in text, text
        # Without a ledger, /info counts from memory: the three model requests, not the none a ledger would hold.
        answer = info.json()["choices"][0]["message"]["content"]
        assert "| model requests   | 3 (tool rounds 0, errors 0) |" in answer, answer
        assert "| ledger           | off (see the proxyvisor log as it started)" in answer, answer
        assert "not in the ledger" not in answer, answer
        assert (endpoint.json()["requests"], endpoint.json()["ledger_off"]) == (3, True)
        assert (files_under(state) if state.is_dir() else None) == before  # nothing written where it cannot be


@pytest.mark.parametrize("bad", ["file-in-place", "garbage-database"])
def test_a_dead_letter_store_that_cannot_work_is_named_once_as_serve_starts_and_delegation_stays_on(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, bad: str) -> None:
    state = tmp_path / "state"
    state.mkdir()
    if bad == "file-in-place":
        (state / "dead_letters").write_text("x\n")
        culprit, reason = state / "dead_letters", "is not a folder"
    else:
        (state / "dead_letters").mkdir()
        (state / "dead_letters" / "cache.db").write_text("garbage\n")
        culprit, reason = state / "dead_letters" / "cache.db", "cannot be read as a database (file is not a database)"
    config = Config().with_overrides(model_routing={"enabled": True})
    with caplog.at_level(logging.WARNING, logger="proxyvisor.pipeline"):
        assert check_state(config, Store(state), DiskBackend(state)) == (True, True, True)
    [warning] = [r.getMessage() for r in caplog.records]
    assert warning.startswith("state directory: keeping dead letters is off (") and f"): {culprit} {reason}" in warning
    if bad == "garbage-database":  # what to do about it
        assert warning.endswith(f"; to start it afresh, stop proxyvisor, move the folder {culprit.parent} aside (or "
                                "delete it: proxyvisor runs without what it held) and start proxyvisor again")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="proxyvisor.pipeline"):
        check_state(Config(), Store(state), DiskBackend(state))
    assert not caplog.records, "delegation off: its dead letters are not checked"


async def test_a_ledger_that_cannot_be_read_is_an_error_naming_the_file(start_proxy, state_dir: Path) -> None:
    folder = state_dir / "ledger" / "dirled.jsonl"
    folder.mkdir(parents=True)
    async with start_proxy([TEXT_STEP]) as rp:
        async with http_client() as client:
            reply = await client.get(rp.url + "/proxyvisor/sessions/dirled/info")
        error = assert_error_shape("chat", 500, reply.content)
        assert reply.status_code == 500 and str(folder) in error["message"] and "internal error" not in error["message"]
        for fmt in ("chat", "messages", "responses"):
            body = request_body(fmt)
            key = "input" if fmt == "responses" else "messages"
            body[key] = [{"role": "user", "content": "/info"}]
            async with http_client() as client:
                reply = await client.post(rp.url + "/s/dirled" + path_of(fmt), json=body)
            error = assert_error_shape(fmt, 500, reply.content)
            assert reply.status_code == 500 and str(folder) in error["message"], error


async def test_proxyvisor_info_names_an_unreadable_ledger_and_exits_1(start_proxy, state_dir: Path) -> None:
    folder = state_dir / "ledger" / "dirled.jsonl"
    folder.mkdir(parents=True)
    command = [sys.executable, "-m", "proxyvisor", "info", "dirled", "--state-dir", str(state_dir), "--url"]
    async with start_proxy([TEXT_STEP]) as rp:
        asked = await trio.run_process(command + [rp.url], capture_stdout=True, capture_stderr=True, check=False)
    offline = await trio.run_process(command + [f"http://127.0.0.1:{closed_port()}"], capture_stdout=True,
                                     capture_stderr=True, check=False)
    for done in (asked, offline):
        stderr = done.stderr.decode()
        assert done.returncode == 1 and str(folder) in stderr and "Traceback" not in stderr, stderr
