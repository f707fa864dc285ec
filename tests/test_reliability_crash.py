"""Crash safety with real processes (issue 7, item 4): ``kill -9`` in the middle of writes leaves every file
readable, no record half-written, and the next process carries on.

Each writer runs in its own process and is killed with SIGKILL while it writes: the ledger under a real
``proxyvisor serve`` with load on it; the condense decision cache (diskcache) and the pool-health breaker store
(diskcache) under a writer loop, as the proxy does not write them yet (when it does, drive them through
``serve`` as the ledger test does); the configuration under ``proxyvisor routing set`` in a loop.
"""

from __future__ import annotations

import re
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import orjson
import trio

from proxyvisor.adapters.state import DiskKV
from proxyvisor.adapters.health import COOLING_DOWN, Cooldown
from proxyvisor.adapters.health_store import HealthStore
from proxyvisor.proxy.condense_decisions import DecisionCache
from proxyvisor.config import load

from helpers import FORMATS, http_client, path_of, request_body

_LISTENING = re.compile(rb"listening on (http://127\.0\.0\.1:\d+)")


def start_serve(config: Path, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    """``proxyvisor serve --config CONFIG --port 0`` in its own process; (process, its URL). Its stderr goes to
    ``log`` (a pipe nobody reads could fill and stall it)."""
    proc = subprocess.Popen([sys.executable, "-m", "proxyvisor", "serve", "--config", str(config), "--port", "0"],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log.open("wb"))
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        found = _LISTENING.search(log.read_bytes())
        if found:
            return proc, found.group(1).decode()
        if proc.poll() is not None:
            break
        time.sleep(0.02)
    proc.kill()
    raise AssertionError(f"proxyvisor serve did not start: {log.read_text(errors='replace')}")


def whole_lines(folder: Path) -> dict[str, int]:
    """Lines per ledger file, after checking every file ends with a newline and every line is a JSON object."""
    counts = {}
    for path in sorted(folder.glob("*.jsonl")):
        data = path.read_bytes()
        assert data.endswith(b"\n"), f"{path.name} ends in a half-written line: {data[-80:]!r}"
        lines = data.split(b"\n")[:-1]
        for line in lines:
            assert isinstance(orjson.loads(line), dict), (path.name, line)
        counts[path.stem] = len(lines)
    return counts


def newlines(folder: Path) -> int:
    return sum(p.read_bytes().count(b"\n") for p in folder.glob("*.jsonl"))


async def test_kill_9_of_serve_during_ledger_appends_leaves_every_line_whole(tmp_path: Path) -> None:
    state = tmp_path / "state"
    config = tmp_path / "config.toml"
    config.write_text(f'[state]\ndir = "{state}"\n\n[upstreams.scripted]\nchunk_delay_ms = 1.0\n')
    proc, url = start_serve(config, tmp_path / "serve-1.log")
    killed = trio.Event()
    sent = 0

    async def agent(i: int) -> None:
        nonlocal sent
        fmt, stream = FORMATS[i % 3], i % 2 == 0
        async with http_client(url) as client:
            while not killed.is_set():
                try:
                    async with client.stream("POST", f"/s/crash-{i % 8}" + path_of(fmt),
                                             json=request_body(fmt, stream)) as reply:
                        await reply.aread()
                    sent += 1
                except httpx.HTTPError:
                    return

    try:
        async with trio.open_nursery() as nursery:
            for i in range(24):
                nursery.start_soon(agent, i)
            with trio.fail_after(60):
                while newlines(state / "ledger") < 300:
                    await trio.sleep(0.02)
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            killed.set()
    finally:
        proc.kill()
    assert proc.returncode == -signal.SIGKILL
    before = whole_lines(state / "ledger")
    assert sum(before.values()) >= 300 and len(before) == 8

    proc, url = start_serve(config, tmp_path / "serve-2.log")
    try:
        async with http_client(url) as client:
            for session in before:
                reply = await client.post(f"/s/{session}/v1/messages", json=request_body("messages"))
                assert reply.status_code == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
    finally:
        proc.kill()
    assert whole_lines(state / "ledger") == {session: n + 1 for session, n in before.items()}


def run_until_killed(code: str, progress_lines: int) -> list[str]:
    """Run ``code`` in a new Python process, let it print ``progress_lines`` lines (one per committed write),
    SIGKILL it at once, and return what it printed."""
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    lines: list[str] = []
    try:
        while len(lines) < progress_lines:
            line = proc.stdout.readline()
            if not line:
                raise AssertionError(f"the writer stopped: {proc.stderr.read().decode(errors='replace')}")
            lines.append(line.decode().strip())
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    lines += [line.strip() for line in proc.stdout.read().decode().splitlines()]
    assert proc.returncode == -signal.SIGKILL
    return lines


def sqlite_is_whole(path: Path) -> None:
    with sqlite3.connect(path) as db:
        assert db.execute("PRAGMA integrity_check").fetchone() == ("ok",)


def test_kill_9_during_decision_cache_writes_leaves_every_decision_whole(tmp_path: Path) -> None:
    """Decisions small (in SQLite) and large (in their own file: diskcache keeps values over 32 KiB outside)."""
    folder = tmp_path / "decisions"
    code = f"""
        from proxyvisor.adapters.state import DiskKV
        from proxyvisor.proxy.condense_decisions import Decision, DecisionCache
        cache = DecisionCache(DiskKV({str(folder)!r}))
        for i in range(100000):
            text = str(i) * (1 + (i % 3) * 20000)
            cache.settle(f"k{{i}}", Decision(text, "condensed", 10 * i, i, i, 2 * i))
            print(i, flush=True)
    """
    done = run_until_killed(code, 200)
    cache = DecisionCache(DiskKV(folder))
    try:
        found = 0
        for i in range(int(done[-1]) + 2):
            decision = cache.get(f"k{i}")
            if decision is None:
                assert i > int(done[-1]), i  # only the write in flight may be missing
                continue
            assert decision.text == str(i) * (1 + (i % 3) * 20000) and decision.tokens_before == 10 * i
            found += 1
        assert found >= len(done)
        cache.settle("after", cache.get("k0"))  # the next process writes on
        assert cache.get("after") == cache.get("k0")
    finally:
        cache.close()
    sqlite_is_whole(folder / "cache.db")


def test_kill_9_during_breaker_writes_leaves_the_breaker_state_intact(tmp_path: Path) -> None:
    """Each write trips a pool's breaker with the provider's wait set to the write's number, so a surviving
    record shows which write it is and that it is whole."""
    root = tmp_path / "health"
    code = f"""
        from proxyvisor.adapters.failures import Failure
        from proxyvisor.adapters.health import Cooldown
        from proxyvisor.adapters.health_store import HealthStore
        from proxyvisor.adapters.state import DiskKV
        store = HealthStore(DiskKV({str(root)!r}), Cooldown())
        for i in range(1, 100000):
            store.settle_sync(f"scripted:p{{i % 4}}", 1000.0 + i,
                              Failure("capacity", True, "known_failed", retry_after_s=i))
            print(i, flush=True)
    """
    done = run_until_killed(code, 120)
    last = int(done[-1])
    store = HealthStore(DiskKV(root), Cooldown())
    try:
        pools = {p.pool: p for p in store.all()}
        assert set(pools) == {f"scripted:p{k}" for k in range(4)}
        for health in pools.values():
            i = health.retry_after_s
            assert health.pool == f"scripted:p{i % 4}" and health.state == COOLING_DOWN
            assert last - 4 < i <= last + 1 and health.cooldown_until == 1000.0 + i + i and health.failure_count >= 1
        store.clear()  # the next process writes on
        assert store.all() == []
    finally:
        store.close()
    sqlite_is_whole(root / "cache.db")


def test_kill_9_during_routing_set_leaves_a_whole_configuration(tmp_path: Path) -> None:
    config = tmp_path / "config.toml"
    config.write_text("# my settings\n[proxy]\nport = 9001  # keep this\n\n[model_routing]\nmax_parallel = 1\n")
    code = f"""
        import contextlib, io, sys
        from proxyvisor.cli import main
        for i in range(100000):
            with contextlib.redirect_stdout(io.StringIO()):  # the command's own report
                assert main(["routing", "set", "--config", {str(config)!r}, "--max-parallel", str(i % 7 + 1)]) == 0
            print(i % 7 + 1, flush=True)
    """
    done = run_until_killed(code, 25)
    last = int(done[-1])
    loaded = load(str(config))  # parses and validates
    assert loaded.model_routing.max_parallel in (last, last % 7 + 1)  # the last write, or the one in flight
    assert loaded.proxy.port == 9001
    text = config.read_text()
    assert text.startswith("# my settings\n") and "port = 9001  # keep this" in text
    # The lock died with the writer: the next write goes through at once.
    done = subprocess.run([sys.executable, "-m", "proxyvisor", "routing", "set", "--config", str(config),
                           "--max-parallel", "5"], capture_output=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert load(str(config)).model_routing.max_parallel == 5


def test_kill_9_during_spill_writes_leaves_only_whole_spill_files(tmp_path: Path) -> None:
    """A spill file is written to a temporary name and renamed: a reader sees the whole original or nothing."""
    root = tmp_path / "spill"
    code = f"""
        from pathlib import Path
        from proxyvisor.proxy.spill import SpillStore
        store = SpillStore(Path({str(root)!r}))
        for i in range(100000):
            store.write(store.path_for("s1", "Bash", f"{{i:016x}}"), f"line {{i}}\\n" * (1 + i % 5000))
            print(i, flush=True)
    """
    done = run_until_killed(code, 300)
    files = sorted((root / "s1").glob("Bash-*.txt"))
    assert len(done) <= len(files) <= len(done) + 1
    for path in files:
        i = int(path.stem.split("-")[1], 16)
        assert path.read_text() == f"line {i}\n" * (1 + i % 5000), path.name
