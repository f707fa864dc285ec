"""The state directory: private folders and files (:func:`atomic_write`), and the per-session JSONL ledger.

Layout under the state directory (``Config.state_dir()``), folders 0700 and files 0600:

- ``ledger/{session}.jsonl``: one JSON object per line per request (``proxyvisor.proxy.info`` lists the fields);

A ledger line is written whole or not at all: with a single ``write`` on a file opened with ``O_APPEND``, so
concurrent writers never interleave; a write the disk cuts short (full, over quota) is truncated back, and a line
always starts after a newline, so a torn last line (a power cut) stays a line of its own, which
:meth:`Store.read_ledger` skips. The files of the sessions written last stay open (:meth:`Store.append_ledger`);
each line still goes to the file at the session's path, whatever was done to it meanwhile (deleted, moved aside). Nothing here ever receives request headers, so credentials cannot reach the
ledger. With replicas on Redis, each line also goes to the session's shared ledger
(``proxyvisor.adapters.replicas``), which the readers here read too (:class:`SharedLedgers`).

Every store in the state directory is optional: the ledger, the condense decisions and spill files, the
sessions' supervision state, and delegation's pool health, claim checks and dead letters (the condense decisions,
session states, pool health and claim checks are namespaces of the state backend, ``proxyvisor.adapters.state``).
:func:`unusable` tells, without writing, why one cannot work; the proxy then runs with the feature that needs it off
(``proxyvisor.proxy.pipeline``), and a command reading it stops with :class:`StoreUnusable`.
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
import re
import sqlite3
import stat
import tempfile
import urllib.parse
from collections import OrderedDict
from contextlib import closing, suppress
from pathlib import Path
from typing import Any, Protocol

import orjson

log = logging.getLogger("proxyvisor.store")

# A session id: also the name of its files in the state folder, so nothing that could climb out of it.
SESSION_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}\Z")  # \Z: "$" would accept a trailing newline


class LedgerError(Exception):
    """A session's ledger exists but cannot be read (a folder in its place, no permission, an I/O error); the
    message names the file and why."""


def private_dir(path: Path) -> Path:
    """Create ``path`` (and missing parents) with mode 0700; an existing folder loses its group and other
    permissions but gains none (a folder its owner made read-only stays read-only).

    Raises:
        OSError: a component is not a folder, or a folder cannot be made or changed.
    """
    try:  # the folder exists on every call but the first: one stat, no exception
        return _tightened(path, path.stat().st_mode)
    except FileNotFoundError:
        pass
    try:
        path.mkdir(mode=0o700)
    except FileNotFoundError:
        private_dir(path.parent)
        return private_dir(path)  # made by another thread meanwhile, or by us now
    except FileExistsError:
        return _tightened(path, path.stat().st_mode)
    os.chmod(path, 0o700)  # mkdir's mode is masked by the umask
    return path


def _tightened(path: Path, mode: int) -> Path:
    """``path``, an existing file of ``mode``, once it is known to be a folder without group or other permissions.
    Raises NotADirectoryError, or OSError when its mode cannot be changed."""
    if not stat.S_ISDIR(mode):
        raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(path))
    if stat.S_IMODE(mode) & 0o077:
        os.chmod(path, stat.S_IMODE(mode) & 0o700)
    return path


def private_opener(path: str, flags: int) -> int:
    """An ``opener`` for :func:`open` whose new files are 0600 (the umask may only remove more)."""
    return os.open(path, flags, 0o600)


class StoreUnusable(Exception):
    """A store in the state directory cannot be read: the message names the store, the path at fault and why
    (:func:`unusable`), and what to do; nothing was read or changed."""

    def __init__(self, store: str, reason: str) -> None:
        super().__init__(f"the {store} store cannot be used: {reason}; nothing was read or changed (move it aside or "
                         f"fix its permissions, and proxyvisor starts the store again, empty; or use another state "
                         f"directory)")


def unusable(folder: Path, database: str = "", advise: bool = False) -> str | None:
    """Why a store kept in ``folder`` cannot work, found without creating or changing anything: a component of
    the path is not a folder, the folder (or, while it does not exist, its nearest existing parent) cannot be
    written, or ``folder/database`` (an SQLite file) exists but cannot be opened as a database. None when it can.
    The reason names the path at fault; with ``advise`` (a proxy's warning, where :class:`StoreUnusable` does not
    say it), what to do about a damaged database too (:func:`database_error`)."""
    for candidate in (folder, *folder.parents):
        try:
            mode = candidate.stat().st_mode
        except (FileNotFoundError, NotADirectoryError):
            continue
        except OSError as exc:
            return f"{candidate}: {exc.strerror or exc}"
        if not stat.S_ISDIR(mode):
            return f"{candidate} is not a folder"
        if not os.access(candidate, os.R_OK | os.W_OK | os.X_OK):
            return f"{candidate} is not writable"
        break
    path = folder / database
    if database and os.path.lexists(path):
        try:
            with closing(sqlite3.connect(f"file:{urllib.parse.quote(str(path))}?mode=ro", uri=True)) as db:
                db.execute("SELECT count(*) FROM sqlite_master").fetchone()
        except sqlite3.Error as exc:
            return database_error(path, exc, advise)
    return None


_DAMAGED = (sqlite3.SQLITE_CORRUPT, sqlite3.SQLITE_NOTADB)
"""SQLite's primary result codes for a file that is not a database, or one whose content is damaged."""


def damaged(exc: sqlite3.Error) -> bool:
    """Whether ``exc`` says its SQLite file is not a database or is damaged (not busy, full or unreadable)."""
    return exc.sqlite_errorcode & 0xFF in _DAMAGED  # an extended code's low byte is its primary code


def database_error(path: Path, exc: sqlite3.Error, advise: bool = False) -> str:
    """Why the SQLite file ``path`` of a store cannot be used, as ``exc`` says (its message holds no data of the
    file); with ``advise``, for a :func:`damaged` file also what to do about it. Every store kept in such a file is
    one proxyvisor runs without and makes again when its folder is missing, so moving the folder aside (the
    database's journal files with it) or deleting it, then restarting, starts the store afresh."""
    reason = f"{path} cannot be read as a database ({exc})"
    if advise and damaged(exc):
        reason += (f"; to start it afresh, stop proxyvisor, move the folder {path.parent} aside (or delete it: "
                   "proxyvisor runs without what it held) and start proxyvisor again")
    return reason


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


class SharedLedgers(Protocol):
    """The ledgers every replica writes to (``proxyvisor.adapters.replicas.RedisShare``), as the readers of a
    :class:`Store` see them. Every call blocks; none raises: a backend that does not answer reads as holding
    nothing, and the readers fall back to the local files."""

    def lines(self, session_id: str) -> list[bytes] | None:
        """The session's shared ledger lines (JSON objects), oldest first (none: none shared); None: the backend
        does not answer."""
        ...

    def recent(self) -> dict[str, float]:
        """The sessions with shared lines, each with the wall time of its last line."""
        ...

    def known(self, session_id: str) -> bool:
        """Whether the session has shared lines."""
        ...


class Store:
    """The state directory. Nothing is created until the first write.

    ``unrecorded``: records :meth:`append_ledger` could not write, in this process. ``ledger_off``: why the ledger
    is not written at all (set when the proxy starts and finds it unusable), or None. ``shared``: the ledgers the
    replicas on one Redis share (None: each process's files only); the readers (:meth:`read_ledger`,
    :meth:`recent`, :meth:`known`) then read them too.
    """

    def __init__(self, root: Path, shared: SharedLedgers | None = None) -> None:
        self.root = Path(root)
        self.shared = shared
        self.unrecorded = 0
        self.ledger_off: str | None = None
        self._failing: set[int | str] = set()
        self._writer = os.urandom(6).hex()
        self._written = itertools.count(1)
        self._open: OrderedDict[str, _Kept] = OrderedDict()

    def ledger_path(self, session_id: str) -> Path:
        if not SESSION_ID.match(session_id):
            raise ValueError(f"invalid session id {session_id!r}")
        return self.root / "ledger" / f"{session_id}.jsonl"

    def append_ledger(self, session_id: str, record: dict[str, Any]) -> bool:
        """Append ``record`` to the session's ledger as one whole line, or nothing (module docstring); creates the
        file 0600, and the folders 0700 (or tightens them) as it opens the file. Returns whether it was written.
        Adds to ``record`` its ``line_id``, unique across processes (this store's random id and a count), by which
        a reader knows the line in the shared ledgers too.

        The files of the last :data:`KEPT_FILES` sessions written stay open until :meth:`release` or :meth:`close`,
        so a line costs a
        ``stat`` of its path and a ``write``; the file is opened again (and the folders made or tightened again)
        when the path no longer names it (deleted, moved aside, replaced), and after a line that could not be
        written. One thread at a time (the proxy writes from its event loop).

        A record not written (the disk full, the folder unusable, :attr:`ledger_off`) is counted in
        :attr:`unrecorded`. The first failure of each kind (errno) is logged as a warning, the next ones only
        counted, until a write succeeds again (logged too, with the count).

        Raises:
            ValueError: an invalid session id.
        """
        kept = self._open.get(session_id)  # its id was checked as it was opened
        path = kept.path if kept is not None else self.ledger_path(session_id)
        if self.ledger_off is not None:
            self.unrecorded += 1
            return False
        record["line_id"] = f"{self._writer}:{next(self._written)}"
        line = orjson.dumps(record) + b"\n"
        try:
            self._kept(session_id, path, kept).append(line)
        except OSError as exc:
            self.release(session_id)  # the next line opens the file again, the folders checked again
            self.unrecorded += 1
            kind = exc.errno if exc.errno is not None else type(exc).__name__
            if kind not in self._failing:
                self._failing.add(kind)
                log.warning("ledger: cannot write %s: %s; the request is not recorded (nothing of it is written), "
                            "and later failures like this one are counted, not logged (/info: not in the ledger)",
                            path, exc.strerror or exc)
            return False
        if self._failing:
            self._failing.clear()
            log.warning("ledger: writing again (%s); requests of this process not recorded: %d", path,
                        self.unrecorded)
        return True

    def _kept(self, session_id: str, path: Path, kept: _Kept | None) -> _Kept:
        """The open ledger file of ``session_id``, the file ``path`` names now: ``kept``, the one open, when it is
        still that file, else the file opened (the least recently written one closed beyond :data:`KEPT_FILES`).

        Raises:
            OSError: the path cannot be read, or the file cannot be opened.
        """
        if kept is not None:
            try:
                now = os.stat(path)
            except FileNotFoundError:
                now = None
            if now is not None and (now.st_dev, now.st_ino) == kept.identity:
                self._open.move_to_end(session_id)
                kept.size = now.st_size
                return kept
            self.release(session_id)
        private_dir(self.root)  # tightened when it exists: the ledger folder's parents are not walked
        private_dir(path.parent)
        fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            opened = os.fstat(fd)
        except OSError:
            os.close(fd)
            raise
        self._open[session_id] = kept = _Kept(path, fd, (opened.st_dev, opened.st_ino), opened.st_size)
        while len(self._open) > KEPT_FILES:
            _close(self._open.popitem(last=False)[1].fd)
        return kept

    def release(self, session_id: str) -> None:
        """Close the ledger file of ``session_id`` kept open, if one is (the session ended: its file, deleted
        meanwhile, is not held)."""
        kept = self._open.pop(session_id, None)
        if kept is not None:
            _close(kept.fd)

    def close(self) -> None:
        """Close the ledger files kept open. The store stays usable: the next line opens its file again."""
        while self._open:
            _close(self._open.popitem()[1].fd)

    def read_ledger(self, session_id: str) -> list[dict[str, Any]]:
        """The records of :meth:`ledger`.

        Raises:
            LedgerError: as :meth:`ledger`.
        """
        return self.ledger(session_id)[0]

    def ledger(self, session_id: str) -> tuple[list[dict[str, Any]], bool]:
        """(all complete records of a session's ledger, whether they are this process's file alone though the
        ledgers are :attr:`shared`: the shared ledgers do not answer). No records when it has none; an incomplete
        or corrupt line is skipped, and how many were is logged (a warning naming the file). With :attr:`shared`
        ledgers: the shared lines (every replica's) and the local lines they lack (written while Redis was down),
        in time order; a line is known in both by its ``line_id`` (a line written before there was one: by its
        JSON).

        Raises:
            LedgerError: the ledger exists but cannot be read, or holds lines and not one record; the message
                names the file.
        """
        path = self.ledger_path(session_id)
        try:
            lines = path.read_bytes().splitlines()
        except (FileNotFoundError, NotADirectoryError):
            lines = []
        except OSError as exc:
            raise LedgerError(f"cannot read the ledger {path}: {exc.strerror or exc}") from None
        records = _records(lines, str(path))
        if self.shared is None:
            return records, False
        shared = self.shared.lines(session_id)
        if shared is None:
            return records, True
        merged = _records(shared, f"the shared ledger of {session_id}")
        known = {_identity(record) for record in merged}
        if missing := [record for record in records if _identity(record) not in known]:
            merged = sorted(merged + missing, key=lambda r: r["time"] if isinstance(r.get("time"), str) else "")
        return merged, False

    def recent(self) -> list[tuple[str, float]]:
        """The sessions with a ledger, each with the wall time of its last line (the file's modification time, or
        the shared index's when later), most recent first. Blocks on one stat per ledger file: off the event loop."""
        seen = dict(self.shared.recent()) if self.shared is not None else {}
        folder = self.root / "ledger"
        for path in folder.glob("*.jsonl") if folder.is_dir() else ():
            try:
                mtime = path.stat().st_mtime
            except OSError:
                continue
            if mtime > seen.get(path.stem, 0.0):
                seen[path.stem] = mtime
        return sorted(seen.items(), key=lambda kv: kv[1], reverse=True)

    def sessions(self) -> list[str]:
        """The sessions with a ledger, the most recently active last (:meth:`recent`)."""
        return [sid for sid, _wall in reversed(self.recent())]

    def session_of_run(self, run: str) -> str | None:
        """The session the latest ledger line of run ``run`` (a line's ``run``: a ``proxyvisor wrap`` run) went to,
        from this host's ledger files, after the run's proxy is gone; None when no line has it. A file is parsed
        only when its bytes hold the run's field (``"run":"RUN"``, as the ledger writes it); every file is read.
        Blocks: for a reader outside the proxy (``proxyvisor info RUN``).

        Raises:
            ValueError: an invalid run id.
        """
        if not SESSION_ID.match(run):
            raise ValueError(f"invalid run id {run!r}")
        field = b'"run":' + orjson.dumps(run)
        latest: tuple[str, str] | None = None  # (the time of the run's latest line, its session)
        folder = self.root / "ledger"
        for path in folder.glob("*.jsonl") if folder.is_dir() else ():
            try:
                data = path.read_bytes()
            except OSError:
                continue  # a ledger that cannot be read (or parsed) names no run here; read as a session, it says why
            if field not in data:
                continue
            try:
                records = _records(data.splitlines(), str(path))
            except LedgerError:
                continue
            for record in records:
                when = found if isinstance(found := record.get("time"), str) else ""
                if record.get("run") == run and (latest is None or when > latest[0]):
                    latest = (when, path.stem)
        return latest[1] if latest is not None else None

    def known(self, session_id: str) -> bool:
        """Whether the session has a ledger, here or shared. Blocks: off the event loop.

        Raises:
            ValueError: an invalid session id.
        """
        return self.ledger_path(session_id).exists() or (self.shared is not None and self.shared.known(session_id))


def _identity(record: dict[str, Any]) -> str | bytes:
    """What tells a ledger line from every other (:meth:`Store.ledger`)."""
    found = record.get("line_id")
    return found if isinstance(found, str) else orjson.dumps(record)


def _records(lines: list[bytes], where: str) -> list[dict[str, Any]]:
    """The JSON objects of ledger ``lines`` read from ``where`` (module docstring, :meth:`Store.read_ledger`)."""
    out = []
    for line in lines:
        try:
            record = orjson.loads(line)
        except orjson.JSONDecodeError:
            continue
        if isinstance(record, dict):
            out.append(record)
    if (skipped := len(lines) - len(out)) and not out:
        raise LedgerError(f"the ledger {where} holds no record: not one of its {len(lines):,} "
                          f"line{'s' if len(lines) > 1 else ''} is a JSON object (not a ledger, or corrupt)")
    if skipped:
        log.warning("ledger %s: %d of %d lines skipped (not a JSON object: a torn or corrupt line)", where,
                    skipped, len(lines))
    return out


def _append(fd: int, data: bytes) -> None:
    """Write all of ``data`` at the end of ``fd`` (``O_APPEND``), or none of it.

    Raises:
        OSError: the disk refused it; whatever part of ``data`` was written has been truncated away again.
    """
    written = 0
    try:
        while written < len(data):
            n = os.write(fd, data[written:])
            if n <= 0:
                raise OSError(errno.EIO, "the write took no byte")
            written += n
    except OSError:
        if written:
            os.ftruncate(fd, os.lseek(fd, 0, os.SEEK_CUR) - written)
        raise


KEPT_FILES = 32
"""Ledger files a :class:`Store` keeps open: those of the sessions written last."""


class _Kept:
    """A ledger file kept open: its path, its descriptor (``O_APPEND``), its identity (device, inode) and its size
    when last seen, and where its last line written here ended (-1: none yet)."""

    __slots__ = ("path", "fd", "identity", "size", "end")

    def __init__(self, path: Path, fd: int, identity: tuple[int, int], size: int) -> None:
        self.path = path
        self.fd = fd
        self.identity = identity
        self.size = size
        self.end = -1

    def append(self, line: bytes) -> None:
        """Append ``line`` on a line of its own: after a newline when the file does not end with one (a torn last
        line, left by a power cut), so the torn line is skipped on reading and never glued to this one. A file
        that ends where this one's last line ended (nobody wrote to it since) is known to end with a newline.

        Raises:
            OSError: as :func:`_append`.
        """
        size = self.size
        whole = size == 0 or size == self.end or os.pread(self.fd, 1, size - 1) == b"\n"
        data = line if whole else b"\n" + line
        _append(self.fd, data)
        self.end = size + len(data)


def _close(fd: int) -> None:
    """Close a ledger file kept open; what it wrote was written when its ``write`` returned, so an error closing
    it (a network file system's late one) loses nothing this store could still save."""
    with suppress(OSError):
        os.close(fd)
