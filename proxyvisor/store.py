"""The state directory: private folders and files (:func:`atomic_write`), and the per-session JSONL ledger.

Layout under the state directory (``Config.state_dir()``), folders 0700 and files 0600:

- ``ledger/{session}.jsonl``: one JSON object per line per request (see :func:`ledger_record`);

A ledger line is written with a single ``write`` on a file opened with ``O_APPEND``, so concurrent writers never
interleave and a crash leaves at most one incomplete last line, which :func:`read_ledger` skips. Nothing here
ever receives request headers, so credentials cannot reach the ledger.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import orjson

from .proxy.sessions import SESSION_ID


def private_dir(path: Path) -> Path:
    """Create ``path`` (and parents) with mode 0700 and tighten it if it already existed."""
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(path, 0o700)
    return path


def atomic_write(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` atomically: a temporary file in the same folder, fsynced, renamed into
    place, then the folder fsynced, so a reader (or a crash) sees the old bytes or the new, never part. The
    file's mode is kept; a new file is 0600.

    Raises:
        OSError: the folder is missing or the file cannot be written.
    """
    try:
        mode = path.stat().st_mode & 0o777
    except FileNotFoundError:
        mode = 0o600
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


class Store:
    """The state directory. Nothing is created until the first write."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def ledger_path(self, session_id: str) -> Path:
        if not SESSION_ID.match(session_id):
            raise ValueError(f"invalid session id {session_id!r}")
        return self.root / "ledger" / f"{session_id}.jsonl"

    def append_ledger(self, session_id: str, record: dict[str, Any]) -> None:
        """Append one record to the session's ledger (one ``write``; creates the file 0600)."""
        path = self.ledger_path(session_id)
        private_dir(self.root)  # mkdir(parents=True) gives missing parents the umask's mode, not 0700
        private_dir(path.parent)
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, orjson.dumps(record) + b"\n")
        finally:
            os.close(fd)

    def read_ledger(self, session_id: str) -> list[dict[str, Any]]:
        """All complete records of a session's ledger; an incomplete or corrupt line is skipped."""
        try:
            lines = self.ledger_path(session_id).read_bytes().splitlines()
        except FileNotFoundError:
            return []
        out = []
        for line in lines:
            try:
                record = orjson.loads(line)
            except orjson.JSONDecodeError:
                continue
            if isinstance(record, dict):
                out.append(record)
        return out

    def sessions(self) -> list[str]:
        folder = self.root / "ledger"
        if not folder.is_dir():
            return []
        return sorted((p.stem for p in folder.glob("*.jsonl")), key=lambda s: (folder / f"{s}.jsonl").stat().st_mtime)
