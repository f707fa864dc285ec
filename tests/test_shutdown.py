"""Graceful shutdown of a real ``proxyvisor serve``: after SIGTERM it accepts no connection and closes idle
keep-alive ones, lets a stream in flight finish within ``[proxy] shutdown_grace_s``, and ends one that outlasts
the grace with the format's error event and a ledger line that says the proxy stopped."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from contextlib import ExitStack, suppress
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import trio

from helpers import (FORMATS, assert_ends_with_error_event, assert_error_shape, http_client, json_events, path_of, request_body,
                     scripted_proxy)
from proxyvisor.config import Config
from proxyvisor.proxy import continuation
from proxyvisor.proxy.client import Cut
from proxyvisor.proxy.formats import BY_NAME
from test_gate_proxy import DONE, Verifier
from test_reliability_crash import start_serve

CHUNK_DELAY_MS = 10.0
"""Between two events of the scripted upstream's stream: a step of N words streams for about N * 10 ms."""


def _config(tmp_path: Path, steps: list[dict[str, Any]], grace_s: float = 10) -> Path:
    """A configuration whose scripted upstream plays ``steps`` (events ``CHUNK_DELAY_MS`` apart)."""
    script = tmp_path / "script.jsonl"
    script.write_text("".join(json.dumps(step) + "\n" for step in steps))
    config = tmp_path / "config.toml"
    config.write_text(f'[proxy]\nshutdown_grace_s = {grace_s}\n\n[state]\ndir = "{tmp_path / "state"}"\n\n'
                      f'[upstreams.scripted]\nchunk_delay_ms = {CHUNK_DELAY_MS}\nscript = "{script}"\n')
    return config


def _serve(tmp_path: Path, words: int, grace_s: float, idle: bool = True) -> tuple[subprocess.Popen[bytes], str]:
    """A proxy whose stream answers ``words`` words, after a short answer to the ``idle`` connection's request."""
    config = _config(tmp_path, [{"text": "done"}] * idle + [{"text": "word " * words}], grace_s)
    return start_serve(config, tmp_path / "serve.log")


def _address(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


def _stream_until_sigterm(proc: subprocess.Popen[bytes], url: str) -> tuple[list[str], float, socket.socket]:
    """Open an idle keep-alive connection (one answered request), start a stream, SIGTERM the proxy at its first
    event, and check new connections are refused and the idle one is closed; (the stream's lines to its end, the
    time of the signal, the idle connection)."""
    idle = socket.create_connection(_address(url), timeout=5)
    body = orjson.dumps(request_body("messages"))
    idle.sendall(b"POST /s/idle/v1/messages HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                 b"content-length: %d\r\n\r\n%s" % (len(body), body))
    head = b""
    while b"\r\n\r\n" not in head:
        head += idle.recv(65536)
    with httpx.Client(base_url=url, timeout=15, trust_env=False) as client, \
            client.stream("POST", "/s/drain/v1/messages", json=request_body("messages", stream=True)) as reply:
        assert reply.status_code == 200
        lines = reply.iter_lines()
        first = [next(lines)]
        proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        refused = False
        while not refused and time.monotonic() < signalled + 2:
            try:
                socket.create_connection(_address(url), timeout=1).close()
                time.sleep(0.02)
            except ConnectionRefusedError:
                refused = True
        assert refused, "the proxy still accepts connections 2 s after SIGTERM"
        rest = list(lines)
    return first + rest, signalled, idle


def _idle_closed(idle: socket.socket) -> None:
    idle.settimeout(3)
    with idle:
        data = b""
        while chunk := idle.recv(65536):
            data += chunk
        assert b"HTTP/1.1" not in data  # closed: nothing more, no second response


def _ledger_line(tmp_path: Path, session: str) -> dict[str, Any]:
    lines = (tmp_path / "state" / "ledger" / f"{session}.jsonl").read_bytes().splitlines()
    assert len(lines) == 1
    line: dict[str, Any] = orjson.loads(lines[0])
    return line


def test_a_stream_in_flight_at_sigterm_completes_within_the_grace(tmp_path: Path) -> None:
    proc, url = _serve(tmp_path, words=100, grace_s=5)
    try:
        lines, signalled, idle = _stream_until_sigterm(proc, url)
        _idle_closed(idle)
        assert proc.wait(6) == 0
    finally:
        proc.kill()
    events = [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]
    assert events[-1] == "message_stop" and "error" not in events
    assert sum(line.count("word") for line in lines if line.startswith("data: ")) == 100
    line = _ledger_line(tmp_path, "drain")
    assert line["status"] == 200 and not line.get("error"), line


def test_a_stream_outlasting_the_grace_ends_with_the_error_event(tmp_path: Path) -> None:
    proc, url = _serve(tmp_path, words=1000, grace_s=0.5)
    try:
        lines, signalled, idle = _stream_until_sigterm(proc, url)
        _idle_closed(idle)
        proc.wait(max(0.0, signalled + 0.5 + 1 - time.monotonic()))
    finally:
        proc.kill()
    assert proc.returncode == 0, "the proxy did not exit within grace + 1 s"
    events = [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]
    assert events[-1] == "error" and "message_stop" not in events
    assert "the proxy stopped" in "\n".join(lines[-3:])
    line = _ledger_line(tmp_path, "drain")
    assert line["status"] == 503 and "the proxy stopped" in line["error"], line
    assert "client disconnected" not in (tmp_path / "serve.log").read_text()


def test_a_second_signal_stops_at_once(tmp_path: Path) -> None:
    proc, url = _serve(tmp_path, words=1000, grace_s=30, idle=False)
    try:
        with httpx.Client(base_url=url, timeout=15, trust_env=False) as client, \
                client.stream("POST", "/s/drain/v1/messages", json=request_body("messages", stream=True)) as reply:
            lines = reply.iter_lines()
            next(lines)
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.3)
            assert proc.poll() is None  # draining: the stream goes on
            proc.send_signal(signal.SIGINT)
            signalled = time.monotonic()
            assert proc.wait(5) == 0
            assert time.monotonic() - signalled < 1
    finally:
        proc.kill()
    assert "stopping at once" in (tmp_path / "serve.log").read_text()
    assert "the proxy stopped" in _ledger_line(tmp_path, "drain")["error"]


def test_streams_whose_upstream_sends_nothing_end_with_the_error_event_when_the_grace_ends(tmp_path: Path) -> None:
    grace_s = 0.5
    config = _config(tmp_path, [{"fault": {"stall_after_events": 2}}] * len(FORMATS), grace_s)
    proc, url = start_serve(config, tmp_path / "serve.log")
    data: dict[str, bytes] = {}
    try:
        with httpx.Client(base_url=url, timeout=15, trust_env=False) as client, ExitStack() as streams:
            replies = {fmt: streams.enter_context(client.stream(
                "POST", f"/s/silent-{fmt}{path_of(fmt)}", json=request_body(fmt, stream=True))) for fmt in FORMATS}
            chunks = {fmt: reply.iter_raw() for fmt, reply in replies.items()}
            for fmt in FORMATS:
                data[fmt] = next(chunks[fmt])  # the stream has begun; its upstream then sends nothing
            proc.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            for fmt in FORMATS:
                data[fmt] += b"".join(chunks[fmt])
            ended = time.monotonic() - signalled
        assert proc.wait(5) == 0
    finally:
        proc.kill()
    # Cut with no event at grace + CUT_S (0.5 s) before: each now ends at the grace's end, whatever its upstream.
    assert ended < grace_s + 2, ended
    for fmt in FORMATS:
        assert_ends_with_error_event(fmt, data[fmt])
        error = json_events(data[fmt])[-1][1]
        assert "the proxy stopped" in data[fmt].decode(), (fmt, error)
        line = _ledger_line(tmp_path, f"silent-{fmt}")
        assert line["status"] == 503 and "the proxy stopped" in line["error"], line
    assert json_events(data["messages"])[-1][1]["error"]["type"] == "api_error"  # a 503: not overloaded_error (529)


@pytest.mark.parametrize("fmt", FORMATS)
async def test_a_stream_the_gate_holds_ends_with_the_error_event_when_the_grace_ends(tmp_path: Path, fmt: str) -> None:
    """The verify-gate holds the turn's end while its verifier never answers: the drain's grace runs out between
    two keep-alives (10 s apart), and the stream ends then, with its format's error event and the ledger line a
    stream cut by the proxy's stop gets."""
    grace_s = 0.3
    verifier = Verifier()
    verifier.release = trio.Event()  # never set: the verdict never comes
    async with scripted_proxy(tmp_path, Config(), [DONE], verifier) as run:
        got = b""
        async with http_client() as client, client.stream(
                "POST", run.proxy.url + path_of(fmt), json=request_body(fmt, stream=True),
                headers={"x-proxyvisor-session": "held"}) as reply:
            chunks = reply.aiter_raw()
            with trio.fail_after(5):
                while not verifier.calls:  # the answer came; the gate holds it
                    await trio.sleep(0.01)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(run.proxy.drain, grace_s)
                started = trio.current_time()
                with trio.fail_after(grace_s + 3):
                    async for chunk in chunks:
                        got += chunk
                ended = trio.current_time() - started
        line = run.ledger()[-1]
    assert grace_s <= ended < grace_s + 1, ended
    assert_ends_with_error_event(fmt, got)
    assert "the proxy stopped" in orjson.dumps(json_events(got)[-1][1]).decode()
    assert line["status"] == 503 and "the proxy stopped" in line["error"], line


@pytest.mark.parametrize("fmt", FORMATS)
async def test_a_json_answer_the_gate_holds_is_a_503_when_the_grace_ends(tmp_path: Path, fmt: str) -> None:
    """Not streamed, the same held turn's end gets, when the grace runs out, a 503 in the client's format (the
    client is still there and retries it), and the ledger line of a request cut by the proxy's stop."""
    grace_s = 0.3
    verifier = Verifier()
    verifier.release = trio.Event()  # never set: the verdict never comes
    async with scripted_proxy(tmp_path, Config(), [DONE], verifier) as run:
        replies: list[httpx.Response] = []

        async def ask() -> None:
            async with http_client() as client:
                replies.append(await client.post(run.proxy.url + path_of(fmt), json=request_body(fmt),
                                                 headers={"x-proxyvisor-session": "held-json"}))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(ask)
            with trio.fail_after(5):
                while not verifier.calls:  # the answer came; the gate holds it
                    await trio.sleep(0.01)
            nursery.start_soon(run.proxy.drain, grace_s)
            started = trio.current_time()
            with trio.fail_after(grace_s + 3):
                while not replies:
                    await trio.sleep(0.01)
            ended = trio.current_time() - started
        line = run.ledger()[-1]
    assert grace_s <= ended < grace_s + 1, ended
    assert replies[0].status_code == 503, replies[0].text
    assert "the proxy stopped" in assert_error_shape(fmt, 503, replies[0].content)["message"]
    assert line["status"] == 503 and "the proxy stopped" in line["error"], line


def test_wrap_records_a_stream_it_cuts_as_cut_by_the_proxys_stop(tmp_path: Path) -> None:
    """The wrapped agent ends while a stream of its (here a child it left running) still relays: wrap's proxy stops
    with it and cuts the stream; the ledger says so, not that the client left, and wrap's summary counts it."""
    config = _config(tmp_path, [{"text": "word " * 1000}])
    started = tmp_path / "started"
    holder = textwrap.dedent(f"""
        import os, sys, urllib.request, json
        body = json.dumps({request_body("messages", stream=True)!r}).encode()
        request = urllib.request.Request(os.environ["ANTHROPIC_BASE_URL"] + "/v1/messages", body,
                                         {{"content-type": "application/json"}})
        with urllib.request.urlopen(request, timeout=15) as reply:
            reply.readline()
            open({str(started)!r}, "w").close()
            try:
                reply.read()
            except Exception:
                pass
    """)
    agent = textwrap.dedent(f"""
        import os, subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c", {holder!r}], start_new_session=True,
                                 stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        open({str(tmp_path / "holder.pid")!r}, "w").write(str(child.pid))
        deadline = time.monotonic() + 15
        while not os.path.exists({str(started)!r}) and time.monotonic() < deadline:
            time.sleep(0.02)
    """)
    try:
        done = subprocess.run([sys.executable, "-m", "proxyvisor", "wrap", "--config", str(config), "--session",
                               "cut", "--", sys.executable, "-c", agent], capture_output=True, text=True,
                              timeout=60)
    finally:
        pid = tmp_path / "holder.pid"
        if pid.exists():
            with suppress(ProcessLookupError):
                os.kill(int(pid.read_text()), signal.SIGKILL)
    assert done.returncode == 0, done.stderr
    assert started.exists(), "the agent's stream did not start"
    line = _ledger_line(tmp_path, "cut")
    assert "the proxy stopped" in line["error"] and "client" not in line["error"], line
    assert "1 model request" in done.stderr, done.stderr


async def test_a_held_streams_keepalive_goes_out_at_the_stop_and_the_next_ones_keep_their_pace(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(continuation, "KEEPALIVE_S", 0.5)
    cut = Cut()
    job = continuation.Job(lambda _arg: trio.sleep_forever(), None)
    keepalive = BY_NAME["messages"].keepalive
    times: list[float] = []
    async with trio.open_nursery() as nursery:
        keepalives = job.keepalives(BY_NAME["messages"], nursery, cut)
        start = trio.current_time()
        nursery.start_soon(_cut_after, cut, 0.1)
        with trio.fail_after(5):
            async for sent in keepalives:
                assert sent == keepalive
                times.append(trio.current_time() - start)
                if len(times) == 2:
                    break
        await keepalives.aclose()
        job.scope.cancel()
    assert times[0] < 0.4 and times[1] - times[0] >= 0.45, times  # at the cut, then a whole interval later


async def _cut_after(cut: Cut, seconds: float) -> None:
    await trio.sleep(seconds)
    cut.cut()
