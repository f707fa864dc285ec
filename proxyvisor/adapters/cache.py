"""diskcache stores under the state directory, private to the user (folders 0700, files 0600; DESIGN.md).

Nothing is created until :func:`open_cache` is called, so a disabled feature writes nothing.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import diskcache

from ..store import StoreUnusable, private_dir, unusable


def open_cache(path: Path, **settings: Any) -> diskcache.Cache:
    """Open (creating if needed) the diskcache at ``path`` with private permissions; ``settings`` go to
    ``diskcache.Cache`` (e.g. ``size_limit``).

    SQLite serialises writers across threads and processes; a write waits up to 30 s for the lock. SQLite gives
    its journal files the database file's mode, so they stay private too.
    """
    private_dir(path)
    cache = diskcache.Cache(str(path), timeout=30, **settings)
    for file in path.iterdir():
        if file.is_file():
            os.chmod(file, 0o600)
    return cache


class LazyCache:
    """A diskcache at ``root``, opened on first use by :meth:`_db` (so reading an absent store creates nothing)
    with ``settings`` (:func:`open_cache`); ``_lock`` (re-entrant) also serves subclasses' read-modify-write
    sections."""

    def __init__(self, root: Path, **settings: Any) -> None:
        self.root = Path(root)
        self._settings = settings
        self._cache: diskcache.Cache | None = None
        self._lock = threading.RLock()

    def _db(self) -> diskcache.Cache:
        with self._lock:
            if self._cache is None:
                self._cache = open_cache(self.root, **self._settings)
            return self._cache

    def exists(self) -> bool:
        return self.root.is_dir()

    def readable(self) -> bool:
        """Whether the store holds anything to read: False while it does not exist (nothing was ever written).
        Checked without creating or changing anything (:func:`proxyvisor.store.unusable`).

        Raises:
            StoreUnusable: the store cannot be used (a file where its folder should be, a folder proxyvisor may not
                write, a ``cache.db`` that is not a database), rather than reading as empty.
        """
        reason = unusable(self.root, "cache.db")
        if reason is not None:
            raise StoreUnusable(self.root.name.replace("_", " "), reason)
        return self.exists()

    def close(self) -> None:
        if self._cache is not None:
            self._cache.close()
            self._cache = None
