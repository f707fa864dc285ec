"""The per-session JSONL ledger: one line per request, private files, tolerant reading."""

from __future__ import annotations

import logging
import os
import shutil
import stat
import time
from datetime import datetime

import orjson
import pytest

from proxyvisor.config import Config, UpstreamConfig
from proxyvisor.proxy.pipeline import Pipeline
from proxyvisor.proxy.relay import HttpRelay
from proxyvisor.proxy.server import Request
from proxyvisor.store import KEPT_FILES, LedgerError, Store

from helpers import TEXT_STEP, TOOL_STEP, closed_port, files_under, raw_stream, request_body

FIELDS = {"time", "format", "model", "stream", "status", "input_tokens", "output_tokens", "latency_ms",
          "overhead_ms"}


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


async def test_one_line_per_request_with_what_happened(start_proxy, state_dir) -> None:
    steps = [TOOL_STEP, TEXT_STEP, {"fault": {"status": 429, "retry_after": "2"}}, TOOL_STEP]
    async with start_proxy(steps, breakers=False) as rp:
        secret = {"authorization": "Bearer sk-secret-abc123", "x-api-key": "sk-secret-abc123"}
        requests = [("chat", request_body("chat"), 200), ("messages", request_body("messages", stream=True), 200),
                    ("responses", request_body("responses", stream=True), 429),
                    ("chat", request_body("chat", stream=True, stream_options={"include_usage": True}), 200)]
        for fmt, body, status in requests:
            reply, _ = await raw_stream(rp.url + "/s/led-1", fmt, body, headers=secret)
            assert reply.status_code == status
        lines = rp.pipeline.store.read_ledger("led-1")
    assert [(r["format"], r["stream"], r["status"]) for r in lines] == [
        ("chat", False, 200), ("messages", True, 200), ("responses", True, 429), ("chat", True, 200)]
    assert [(r["input_tokens"], r["output_tokens"]) for r in lines] == [(120, 17), (200, 9), (None, None), (120, 17)]
    for record in lines:
        assert FIELDS <= set(record)
        assert record["model"] == "scripted-model"
        assert datetime.fromisoformat(record["time"]).tzinfo is not None
        assert 0 <= record["overhead_ms"] <= record["latency_ms"]
    ledger = state_dir / "ledger" / "led-1.jsonl"
    assert b"sk-secret" not in ledger.read_bytes()
    assert mode(ledger) == 0o600
    for folder in (state_dir, state_dir / "ledger"):
        assert mode(folder) == 0o700, folder
    # Beside the ledger, only the sessions' supervision state (``proxyvisor.proxy.session_state``), private too.
    assert [p for p in files_under(state_dir) if "sessions" not in p.parts] == [state_dir / "ledger", ledger]
    assert all(mode(p) == (0o700 if p.is_dir() else 0o600) for p in files_under(state_dir / "sessions"))


async def test_a_failed_upstream_is_accounted_with_its_error(start_proxy, state_dir) -> None:
    async with start_proxy(upstream_url=f"http://127.0.0.1:{closed_port()}") as rp:
        reply, _ = await raw_stream(rp.url + "/s/down", "messages", request_body("messages"))
        assert reply.status_code == 502
        (record,) = rp.pipeline.store.read_ledger("down")
    assert record["status"] == 502 and "unreachable" in record["error"]


async def test_a_broken_state_dir_does_not_break_requests(start_proxy, state_dir) -> None:
    state_dir.write_text("not a folder")
    async with start_proxy([TOOL_STEP]) as rp:
        reply, _ = await raw_stream(rp.url, "chat", request_body("chat"))
        assert reply.status_code == 200


def test_truncated_or_corrupt_lines_are_skipped_and_counted_in_the_log(tmp_path, caplog) -> None:
    store = Store(tmp_path / "st")
    store.append_ledger("s1", {"n": 1})
    path = store.ledger_path("s1")
    with open(path, "ab") as f:
        f.write(b'not json\n[1, 2]\n')
    store.append_ledger("s1", {"n": 2})
    with open(path, "ab") as f:
        f.write(b'{"n": 3, "trunc')  # a crash in the middle of the last write
    with caplog.at_level(logging.WARNING, "proxyvisor.store"):
        assert [line["n"] for line in store.read_ledger("s1")] == [1, 2]
    assert f"ledger {path}: 3 of 5 lines skipped" in caplog.text
    assert store.read_ledger("never-written") == []
    assert store.sessions() == ["s1"]


def test_a_ledger_with_lines_and_no_record_is_an_error_naming_it(tmp_path) -> None:
    store = Store(tmp_path / "st")
    store.append_ledger("s1", {"n": 1})
    path = store.ledger_path("s1")
    path.write_bytes(b"\x00\xff\xfe\n{garbage\n")
    with pytest.raises(LedgerError, match=f"the ledger {path} holds no record: not one of its 2 lines"):
        store.read_ledger("s1")
    path.write_bytes(b"")  # empty: a session with nothing recorded yet
    assert store.read_ledger("s1") == []


def test_store_creates_nothing_until_the_first_write(tmp_path) -> None:
    root = tmp_path / "deep" / "state"
    store = Store(root)
    assert store.read_ledger("x") == [] and store.sessions() == []
    assert not (tmp_path / "deep").exists()
    store.append_ledger("x", {"ok": True})
    assert mode(root) == 0o700 and mode(root / "ledger") == 0o700 and mode(store.ledger_path("x")) == 0o600


def test_existing_loose_folders_are_tightened(tmp_path) -> None:
    root = tmp_path / "state"
    (root / "ledger").mkdir(parents=True, mode=0o755)
    os.chmod(root, 0o755)
    os.chmod(root / "ledger", 0o777)
    Store(root).append_ledger("x", {})
    assert mode(root) == 0o700 and mode(root / "ledger") == 0o700


def open_ledgers(store: Store) -> list[str]:
    """The ledger files this process has open (their paths, one per descriptor)."""
    folder = str(store.root / "ledger")
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # the listing's own descriptor, closed by now
        if target.startswith(folder + "/"):
            found.append(target)
    return found


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc to list the open files")
def test_the_last_sessions_files_stay_open_bounded_and_close_closes_them(tmp_path) -> None:
    store = Store(tmp_path / "state")
    for n in range(KEPT_FILES + 5):
        assert store.append_ledger(f"s{n}", {"n": n})
    assert store.append_ledger("s1", {"n": 1})  # closed as the least recent: opened again
    kept = open_ledgers(store)
    assert len(kept) == KEPT_FILES and str(store.ledger_path("s1")) in kept
    assert str(store.ledger_path("s0")) not in kept
    store.close()
    assert open_ledgers(store) == []
    assert store.append_ledger("s1", {"n": 2})  # still usable
    assert [r["n"] for r in store.read_ledger("s1")] == [1, 1, 2]
    store.close()


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc to list the open files")
async def test_a_session_that_ends_and_a_proxy_that_stops_close_their_ledger_files(start_proxy) -> None:
    async with start_proxy([TEXT_STEP, TEXT_STEP]) as rp:
        store = rp.pipeline.store
        for sid in ("one", "two"):
            reply, _ = await raw_stream(rp.url + f"/s/{sid}", "chat", request_body("chat"))
            assert reply.status_code == 200
        assert sorted(open_ledgers(store)) == [str(store.ledger_path("one")), str(store.ledger_path("two"))]
        pipeline = rp.pipeline
        pipeline.sessions.touch("two", pipeline.clock() + 1e9)  # "one" idle past session_idle_s: evicted
        assert open_ledgers(store) == [str(store.ledger_path("two"))]
    assert open_ledgers(store) == []
    assert [r["status"] for r in store.read_ledger("two")] == [200]


def test_each_line_goes_to_the_file_the_path_names_now(tmp_path) -> None:
    store = Store(tmp_path / "state")
    assert store.append_ledger("s1", {"n": 1})
    path = store.ledger_path("s1")
    path.unlink()  # deleted while its file is open here: the next line makes it again
    assert store.append_ledger("s1", {"n": 2})
    assert [r["n"] for r in store.read_ledger("s1")] == [2] and mode(path) == 0o600
    aside = tmp_path / "aside.jsonl"
    path.rename(aside)  # moved aside: it keeps what it had
    assert store.append_ledger("s1", {"n": 3})
    assert [r["n"] for r in store.read_ledger("s1")] == [3]
    assert aside.read_bytes().count(b"\n") == 1
    path.write_bytes(b'{"n": 0}\n')  # replaced by another file
    assert store.append_ledger("s1", {"n": 4})
    assert [r["n"] for r in store.read_ledger("s1")] == [0, 4]
    shutil.rmtree(store.root)  # the whole state folder gone: made again, private
    assert store.append_ledger("s1", {"n": 5})
    assert [r["n"] for r in store.read_ledger("s1")] == [5]
    assert mode(store.root) == 0o700 and mode(path.parent) == 0o700 and mode(path) == 0o600
    store.close()


def test_a_folder_that_became_a_file_is_a_line_not_recorded_and_the_ledger_resumes(tmp_path) -> None:
    store = Store(tmp_path / "state")
    assert store.append_ledger("s1", {"n": 1})
    folder = store.root / "ledger"
    shutil.rmtree(folder)
    folder.write_text("not a folder")
    assert not store.append_ledger("s1", {"n": 2})
    assert store.unrecorded == 1
    folder.unlink()
    assert store.append_ledger("s1", {"n": 3})
    assert [r["n"] for r in store.read_ledger("s1")] == [3]
    store.close()


@pytest.mark.parametrize("bad", ["../escape", "a/b", ".x"])
def test_ledger_paths_stay_inside_the_state_dir(tmp_path, bad: str) -> None:
    root = tmp_path / "a" / "state"
    with pytest.raises(ValueError):
        Store(root).append_ledger(bad, {})
    assert files_under(tmp_path / "a") == []


async def test_a_model_name_of_any_size_is_kept_clipped(start_proxy, state_dir) -> None:
    """A client may name a model of megabytes: the ledger keeps its first 200 characters, so no view of the
    session (/info, the web view, MCP) carries the rest."""
    from proxyvisor.proxy.info import MODEL_CHARS

    async with start_proxy([TEXT_STEP], breakers=False) as rp:
        reply, _ = await raw_stream(rp.url + "/s/big-model", "chat", request_body("chat", model="Q" * 1_000_000))
        assert reply.status_code == 200
        (record,) = rp.pipeline.store.read_ledger("big-model")
    assert record["model"] == "Q" * (MODEL_CHARS - 1) + "\u2026"
    assert (state_dir / "ledger" / "big-model.jsonl").stat().st_size < 20_000


async def test_a_format_no_upstream_speaks_without_translation_is_a_501_with_its_ledger_line(tmp_path) -> None:
    """The 501 proxyvisor answers when no upstream speaks the client's format and no translator is configured
    is accounted like every other answer: one ledger line with its status and why, the error counted."""
    config = Config(upstreams=(UpstreamConfig(name="up", formats=("chat",)),))
    store = Store(tmp_path)
    pipeline = Pipeline(config, {"up": HttpRelay(config.upstreams[0], f"http://127.0.0.1:{closed_port()}")},
                        store)  # and no translator
    request = Request("POST", "/v1/messages", [(b"content-type", b"application/json"),
                                              (b"x-proxyvisor-session", b"no-route")],
                      orjson.dumps(request_body("messages")), received_at=time.perf_counter())
    response = await pipeline(request)
    assert response.status == 501
    (record,) = store.read_ledger("no-route")
    assert FIELDS <= set(record)
    assert (record["format"], record["status"]) == ("messages", 501)
    assert "translation is unavailable" in record["error"]
    assert pipeline.sessions.get("no-route").errors == 1


@pytest.mark.parametrize("step", ["load", "command"])
async def test_a_request_cut_off_while_its_state_loads_or_its_command_reads_the_ledger_has_its_line(
        tmp_path, monkeypatch: pytest.MonkeyPatch, step: str) -> None:
    """The client leaves while its session's stored state is read, or while proxyvisor reads the ledger to answer
    its ``/info``: the request's one ledger line says so (499), as for a request cut off in a later step."""
    import trio

    from proxyvisor.proxy import commands
    from proxyvisor.proxy.service import running
    from proxyvisor.proxy.session_state import SessionStates
    from proxyvisor.scripted.upstream import ScriptedUpstream

    paused = trio.Event()

    async def pause(*_args: object) -> None:
        paused.set()
        await trio.sleep_forever()

    if step == "load":
        monkeypatch.setattr(SessionStates, "load", pause)
    else:
        monkeypatch.setattr(commands, "answer", pause)
    body = request_body("chat", messages=[{"role": "user", "content": "/info"}]) if step == "command" \
        else request_body("chat")
    headers = [(b"content-type", b"application/json"), (b"x-proxyvisor-session", b"cut")]
    async with running(Config(), port=0, store=Store(tmp_path / "state"),
                       scripted={"scripted": ScriptedUpstream()}) as proxy:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(proxy.pipeline, Request("POST", "/v1/chat/completions", headers, orjson.dumps(body),
                                                       time.perf_counter()))
            with trio.fail_after(10):
                await paused.wait()
            nursery.cancel_scope.cancel()  # the client leaves
        assert proxy.pipeline.store is not None
        lines = proxy.pipeline.store.read_ledger("cut")
    assert [(line["status"], line["error"], line.get("local")) for line in lines] == [
        (499, "cancelled before the answer: the client left", "/info" if step == "command" else None)]
