"""A real ``redis-server`` for the tests (Debian package ``redis-server``): its own instance on a free loopback port,
no persistence (``--save '' --appendonly no``), in the test's temporary folder. Absent, the tests that need it skip
on a developer machine and fail in CI (``CI`` set), where ``.ci/run`` installs it."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

_IN_CI = os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def redis_server_path() -> str:
    """The ``redis-server`` binary; skips the test (outside CI) or fails it (in CI) when it is absent."""
    found = shutil.which("redis-server") or next(
        (p for p in ("/usr/bin/redis-server", "/usr/sbin/redis-server") if os.access(p, os.X_OK)), None)
    if found:
        return found
    reason = "redis-server is not installed (Debian: apt-get install redis-server)"
    if _IN_CI:
        pytest.fail(f"{reason} (CI is set, so it must be installed)")
    pytest.skip(reason)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@contextmanager
def redis_server(folder: Path, port: int | None = None, persist: bool = False) -> Iterator[str]:
    """A ``redis-server`` on ``port`` (default: a free one) of loopback with its files in ``folder``; yields its
    URL. Stopped (and waited for) at the end. ``persist``: with an append-only file in ``folder``, so a server
    started again on that folder has the data of the one before (a Redis that went away and came back)."""
    binary = redis_server_path()
    folder.mkdir(parents=True, exist_ok=True)
    port = port or free_port()
    log = folder / "redis.log"
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "yes" if persist else "no",
                             "--dir", str(folder), "--logfile", str(log)],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 15
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.5) as conn:
                    conn.sendall(b"PING\r\n")
                    if conn.recv(16).startswith(b"+PONG"):
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"redis-server did not start: {log.read_text(errors='replace') if log.exists() else ''}")
            time.sleep(0.02)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
