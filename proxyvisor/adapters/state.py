"""Where shared state lives: one small key-value interface (:class:`KV`), two backends (:class:`StateBackend`).

- ``diskcache`` (:class:`DiskBackend`, the default): each namespace is a diskcache folder under the state
  directory (``<state dir>/<namespace>/``, 0700, files 0600), made on the first write. SQLite serialises writers
  across threads and processes, so every proxy sharing the state directory shares the state.
- ``redis`` (:class:`RedisBackend`): each namespace is a key prefix ``proxyvisor:<namespace>:`` in one Redis
  database, shared by every replica that names it in ``[state] url``.

The stores built on it (pool health, claim checks, condense decisions, sessions' supervision state) see only
:class:`KV`: which backend serves them is chosen once, at startup (:func:`open_backend`).

Every call is blocking (SQLite, or one Redis round trip on redis-py's synchronous client): trio code runs them in
a worker thread (``trio.to_thread.run_sync``), the CLI calls them directly. Values are bytes; every key written
by the proxy has a time to live, so nothing grows without bound. :meth:`KV.update` is the one read-modify-write:
atomic across every process and replica (a SQLite transaction; on Redis a compare-and-set Lua script, retried when
another writer came first), which is what makes a cooling pool's single probe lease single fleet-wide.

A backend that stops answering (Redis down, a network cut) raises :class:`StateUnavailable` from every call; the
stores' callers degrade (the feature off for that request, with a warning), and no agent's answer is lost.
"""

from __future__ import annotations

import functools
import logging
import sqlite3
import threading
import time
import urllib.parse
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import diskcache

from ..config import Config, ConfigError
from ..store import damaged, database_error, unusable
from .cache import LazyCache

log = logging.getLogger("proxyvisor.state")

DISKCACHE = "diskcache"
REDIS = "redis"
BACKENDS = (DISKCACHE, REDIS)
REDIS_PREFIX = "proxyvisor:"
"""The prefix of every key proxyvisor writes to Redis (then the namespace and ``:``)."""
_CAS_ATTEMPTS = 64
"""Compare-and-set rounds :meth:`RedisKV.update` tries before giving up (each lost round means another writer
changed the key in between: only under heavy contention on one key)."""
_TIMEOUT_S = 5.0
"""Seconds a Redis connection or command may take before it counts as unavailable."""
_DOWN_S = 5.0
"""Seconds after a failed call during which every call fails at once (:meth:`RedisBackend.call`)."""
_PROBE_TIMEOUT_S = 0.5
"""Seconds the ping that ends a down period may take."""
COMMAND_TIMEOUT_S = 1.0
"""Seconds a Redis connection or command of a command line may take (someone waits for its answer; a proxy waits
:data:`_TIMEOUT_S`)."""


class StateUnavailable(Exception):
    """The state backend cannot serve a call (Redis unreachable, refused, timed out, out of memory; a diskcache
    folder that cannot be written). The message says which backend and why; it never holds a password."""


class Outage:
    """A store's outages, each warned about once: :meth:`failed` when a call raised :class:`StateUnavailable`
    (``"<what>: <why>; <meanwhile>"``, the first time), :meth:`up` when a call succeeded (``"<what>: <back>"``, the
    first time after a failure)."""

    def __init__(self, log: logging.Logger, what: str, meanwhile: str,
                 back: str = "the state backend answers again") -> None:
        self.log = log
        self.what = what
        self.meanwhile = meanwhile
        self.back = back
        self.down = False

    def failed(self, exc: StateUnavailable) -> None:
        if not self.down:
            self.log.warning("%s: %s; %s", self.what, exc, self.meanwhile)
        self.down = True

    def up(self) -> None:
        if self.down:
            self.down = False
            self.log.warning("%s: %s", self.what, self.back)


Step = Callable[[bytes | None], bytes | None]
"""A read-modify-write step: the current value (None: absent) to the new one (None: delete)."""


class KV(Protocol):
    """One namespace of state: bytes by string key. All calls block; all raise :class:`StateUnavailable` when the
    backend cannot serve them. ``ttl_s``: seconds until the key expires (None: never; a store that has no natural
    end passes one)."""

    local: bool
    """Whether the namespace is this machine's files (a diskcache folder): a small :meth:`get` of a store already
    opened takes microseconds and never waits on a network or a lock (SQLite's readers do not wait for its
    writers), so trio code may make it on the event loop rather than pay a worker thread's round trip, which costs
    more than the read. Everything else still goes to a worker thread (a write may wait for SQLite's lock)."""

    def get(self, key: str) -> bytes | None: ...

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        """The values of ``keys``, in their order (None: absent), read in one step (one Redis round trip)."""
        ...

    def set(self, key: str, value: bytes, ttl_s: float | None) -> None: ...

    def set_many(self, items: dict[str, bytes], ttl_s: float | None, delete: Sequence[str] = ()) -> None:
        """Set every key of ``items`` and remove the keys ``delete`` in one step: a reader sees all of it or
        none."""
        ...

    def add(self, key: str, value: bytes, ttl_s: float | None) -> bool:
        """Store ``value`` unless ``key`` holds one; whether it was stored (the first writer wins)."""
        ...

    def update(self, key: str, step: Step, ttl_s: float | None) -> bytes | None:
        """Apply ``step`` to the key's value atomically (no other writer in between, in any process or replica) and
        return the value it made. ``step`` may run more than once (on Redis, when another writer came first), so it
        must be a pure function of its argument. A step returning the value it was given writes nothing."""
        ...

    def delete(self, key: str) -> None: ...

    def keys(self, prefix: str = "") -> list[str]:
        """The keys that start with ``prefix``, sorted.

        Raises:
            StoreUnusable: a diskcache folder that cannot be used (:meth:`~.cache.LazyCache.readable`), rather
                than reading as empty.
        """
        ...

    def exists(self) -> bool:
        """Whether the namespace may hold anything (a diskcache folder that was never made holds nothing)."""
        ...

    def close(self) -> None: ...


class StateBackend(Protocol):
    """Where the namespaces live (module docstring)."""

    name: str
    """``diskcache`` or ``redis``."""

    def kv(self, namespace: str, **settings: Any) -> KV:
        """The namespace's store; ``settings`` go to diskcache (``size_limit``), Redis ignores them."""
        ...

    def unusable(self, namespace: str) -> str | None:
        """Why the namespace cannot work, found without writing (:func:`proxyvisor.store.unusable`; for a damaged
        database, with what to do about it, for the proxy's warning as it starts), or None."""
        ...

    def describe(self) -> str:
        """Where the state is, in a few words, without a password."""
        ...

    def close(self) -> None: ...


def _as_bytes(value: Any) -> bytes | None:
    """A value read from diskcache as :class:`KV` returns it (None: absent or not a value of this interface)."""
    if isinstance(value, str):  # a condense decision stored before this interface (JSON text): still the same
        return value.encode()
    return value if isinstance(value, bytes) else None


_REWRITE = ("UPDATE Cache SET store_time = ?, expire_time = ?, access_time = ?, access_count = 0, tag = NULL,"
            " size = 0, mode = 1, filename = NULL, value = ? WHERE key = ? AND raw = 1 AND filename IS NULL")
"""What diskcache's ``Cache.set`` writes into the row of a string key whose value is kept in the database (mode 1:
raw bytes), the key's row alone (no file to remove, no search for expired keys): diskcache's own schema, read with
its ``get``."""


class DiskKV(LazyCache):
    """A namespace in a diskcache folder (module docstring), opened on the first call that needs it; reading an
    absent folder creates nothing."""

    local = True

    def get(self, key: str) -> bytes | None:
        if self._absent():
            return None
        return _as_bytes(self._call(lambda db: db.get(key)))

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        if not keys or self._absent():
            return [None] * len(keys)
        return [_as_bytes(v) for v in self._call(lambda db: [db.get(key) for key in keys])]

    def set(self, key: str, value: bytes, ttl_s: float | None) -> None:
        self._call(lambda db: db.set(key, value, expire=ttl_s))

    def set_many(self, items: dict[str, bytes], ttl_s: float | None, delete: Sequence[str] = ()) -> None:
        """One SQLite transaction. A key that holds a value in the database is rewritten by one ``UPDATE`` of its
        row (:data:`_REWRITE`), the others by diskcache's ``set`` (a new key, or one whose value is a file of its
        own), which also drops a few expired keys: a session state's save, two rows rewritten on every request,
        runs 4 statements rather than 12 (about half the CPU)."""
        def transact(db: Any) -> None:
            with self._lock, db.transact():
                now = time.time()
                expire = None if ttl_s is None else now + ttl_s
                for key, value in items.items():
                    if len(value) >= db.disk.min_file_size or db._con.execute(
                            _REWRITE, (now, expire, now, value, key)).rowcount != 1:
                        db.set(key, value, expire=ttl_s)
                for key in delete:
                    db.delete(key)

        self._call(transact)

    def add(self, key: str, value: bytes, ttl_s: float | None) -> bool:
        return bool(self._call(lambda db: db.add(key, value, expire=ttl_s)))

    def update(self, key: str, step: Step, ttl_s: float | None) -> bytes | None:
        def transact(db: Any) -> bytes | None:
            with self._lock, db.transact():
                current = db.get(key)
                current = current if isinstance(current, bytes) else None
                new = step(current)
                if new != current:
                    if new is None:
                        db.delete(key)
                    else:
                        db.set(key, new, expire=ttl_s)
                return new

        result: bytes | None = self._call(transact)
        return result

    def delete(self, key: str) -> None:
        if not self._absent():
            self._call(lambda db: db.delete(key))

    def keys(self, prefix: str = "") -> list[str]:
        if not self.readable():  # a store that cannot be used raises StoreUnusable rather than reading as empty
            return []
        return sorted(k for k in self._call(lambda db: list(db.iterkeys()))
                      if isinstance(k, str) and k.startswith(prefix))

    def _absent(self) -> bool:
        """Whether the folder was never made (nothing to read), looked up on disk until the store is open: an open
        store's folder was there (a session state's load reads a key on every request, where the look-up cost a
        third of the read)."""
        return self._cache is None and not self.exists()

    def _call(self, fn: Callable[[Any], Any]) -> Any:
        # SQLite's own errors (a damaged database file, a disk full or failing) and diskcache's lock timeout are
        # the folder being unusable too: callers degrade on StateUnavailable alone.
        try:
            return fn(self._db())
        except (OSError, sqlite3.Error, diskcache.Timeout) as exc:
            if isinstance(exc, sqlite3.Error) and damaged(exc):  # with what to do about it
                raise StateUnavailable(database_error(self.root / diskcache.core.DBNAME, exc, True)) from None
            reason = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
            raise StateUnavailable(f"the state folder {self.root} cannot be used: {reason}") from None


class DiskBackend:
    """Namespaces as diskcache folders under ``root`` (the state directory)."""

    name = DISKCACHE

    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def kv(self, namespace: str, **settings: Any) -> KV:
        return DiskKV(self.root / namespace, **settings)

    def unusable(self, namespace: str) -> str | None:
        return unusable(self.root / namespace, diskcache.core.DBNAME, advise=True)

    def describe(self) -> str:
        return f"diskcache under {self.root}"

    def close(self) -> None:
        pass


# KEYS[1]: the key. ARGV[1]: "1" when the caller read a value, then ARGV[2] that value; ARGV[3]: "1" to delete,
# else ARGV[4] the new value and ARGV[5] its time to live in ms ("0": none). 1 when set, 0 when the key changed.
_CAS = """
local current = redis.call('GET', KEYS[1])
if ARGV[1] == '1' then
  if current ~= ARGV[2] then return 0 end
elseif current then
  return 0
end
if ARGV[3] == '1' then
  redis.call('DEL', KEYS[1])
elseif ARGV[5] == '0' then
  redis.call('SET', KEYS[1], ARGV[4])
else
  redis.call('SET', KEYS[1], ARGV[4], 'PX', ARGV[5])
end
return 1
"""


def _ms(ttl_s: float | None) -> int | None:
    return None if ttl_s is None else max(1, round(ttl_s * 1000))


class RedisKV:
    """A namespace as the keys ``proxyvisor:<namespace>:*`` of the backend's Redis (module docstring)."""

    local = False

    def __init__(self, backend: RedisBackend, namespace: str) -> None:
        self.backend = backend
        self.prefix = f"{REDIS_PREFIX}{namespace}:"

    def get(self, key: str) -> bytes | None:
        value = self.backend.call(lambda r: r.get(self.prefix + key))
        return value if isinstance(value, bytes) else None

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        if not keys:
            return []
        values = self.backend.call(lambda r: r.mget([self.prefix + key for key in keys]))
        return [v if isinstance(v, bytes) else None for v in values]

    def set(self, key: str, value: bytes, ttl_s: float | None) -> None:
        self.backend.call(lambda r: r.set(self.prefix + key, value, px=_ms(ttl_s)))

    def set_many(self, items: dict[str, bytes], ttl_s: float | None, delete: Sequence[str] = ()) -> None:
        def transaction(r: Any) -> None:
            pipe = r.pipeline(transaction=True)
            for key, value in items.items():
                pipe.set(self.prefix + key, value, px=_ms(ttl_s))
            if delete:
                pipe.delete(*[self.prefix + key for key in delete])
            pipe.execute()

        self.backend.call(transaction)

    def add(self, key: str, value: bytes, ttl_s: float | None) -> bool:
        return bool(self.backend.call(lambda r: r.set(self.prefix + key, value, px=_ms(ttl_s), nx=True)))

    def update(self, key: str, step: Step, ttl_s: float | None) -> bytes | None:
        full = self.prefix + key
        for _ in range(_CAS_ATTEMPTS):
            current = self.get(key)
            new = step(current)
            if new == current:
                return new
            args = ["0" if current is None else "1", current or b"", "1" if new is None else "0", new or b"",
                    str(_ms(ttl_s) or 0)]
            if self.backend.call(functools.partial(self.backend.cas, keys=[full], args=args)):
                return new
        raise StateUnavailable(f"Redis key {full}: another writer changed it {_CAS_ATTEMPTS} times in a row")

    def delete(self, key: str) -> None:
        self.backend.call(lambda r: r.delete(self.prefix + key))

    def keys(self, prefix: str = "") -> list[str]:
        def scan(r: Any) -> list[bytes]:
            return list(r.scan_iter(match=_glob(self.prefix + prefix) + "*", count=1000))

        return sorted(k.decode()[len(self.prefix):] for k in self.backend.call(scan))

    def exists(self) -> bool:
        return True

    def close(self) -> None:
        pass


def _glob(text: str) -> str:
    """``text`` with Redis glob characters escaped."""
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


class RedisBackend:
    """Namespaces in the Redis at ``url`` (``redis://[:password@]host:port/db``, ``rediss://`` for TLS,
    ``unix://``). One connection pool for the process, safe across worker threads. A connection or command may
    take ``timeout_s`` seconds (None: :data:`_TIMEOUT_S`) before Redis counts as unavailable.

    Raises (constructor):
        StateUnavailable: Redis cannot be reached or refuses the connection (the message names the address,
            never the password).
    """

    name = REDIS

    def __init__(self, url: str, timeout_s: float | None = None) -> None:
        import redis  # only with this backend: the embedded default never imports it

        timeout_s = timeout_s or _TIMEOUT_S
        self._errors = (redis.RedisError, OSError)
        self.where = redacted(url)
        self._down_until = 0.0  # time.monotonic() until which calls fail at once; 0: up
        self._probing = threading.Lock()
        try:
            self.client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                               health_check_interval=30)
            self._probe = redis.Redis.from_url(url, socket_timeout=_PROBE_TIMEOUT_S,
                                               socket_connect_timeout=_PROBE_TIMEOUT_S)
            self.client.ping()
            self._cas = self.client.register_script(_CAS)
        except self._errors as exc:
            raise StateUnavailable(f"cannot reach Redis at {self.where}: {_reason(exc)}") from None
        except ValueError:  # an URL redis-py cannot read; its message may quote a piece of the password
            raise StateUnavailable("[state] url is not a Redis URL: use redis://[:PASSWORD@]HOST:PORT/DB, rediss:// "
                                   "or unix://PATH, with a password's reserved characters (/ # ? @ :) "
                                   "percent-encoded") from None

    def call(self, fn: Callable[[Any], Any]) -> Any:
        """``fn(client)``; raises :class:`StateUnavailable` for any Redis or connection error.

        A failed call makes Redis *down* for :data:`_DOWN_S`: every call meanwhile raises at once, so a Redis that
        hangs (its every command waiting out :data:`_TIMEOUT_S`) costs the requests one timeout, not one per call.
        Then one caller at a time pings it (at most :data:`_PROBE_TIMEOUT_S`) before its call; the others keep
        failing at once until a ping answers."""
        if self._down_until:
            if time.monotonic() < self._down_until or not self._probing.acquire(blocking=False):
                raise StateUnavailable(f"Redis at {self.where}: down since a call failed; retried every {_DOWN_S:g} s")
            try:
                self._probe.ping()
            except self._errors as exc:
                self._down_until = time.monotonic() + _DOWN_S
                raise StateUnavailable(f"Redis at {self.where}: {_reason(exc)}") from None
            finally:
                self._probing.release()
            self._down_until = 0.0
        try:
            result = fn(self.client)
        except self._errors as exc:
            self._down_until = time.monotonic() + _DOWN_S
            raise StateUnavailable(f"Redis at {self.where}: {_reason(exc)}") from None
        return result

    def cas(self, client: Any, keys: list[str], args: list[Any]) -> Any:
        """Run the compare-and-set script (cached in Redis by its digest) on ``client``."""
        return self._cas(keys=keys, args=args, client=client)

    def kv(self, namespace: str, **settings: Any) -> KV:
        return RedisKV(self, namespace)

    def unusable(self, namespace: str) -> str | None:
        return None  # reachable: checked when the backend was opened

    def describe(self) -> str:
        return f"Redis at {self.where}"

    def close(self) -> None:
        self.client.close()
        self._probe.close()


def _reason(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__


def redacted(url: str) -> str:
    """``url`` without its user and password (what may be logged)."""
    try:
        parts = urllib.parse.urlsplit(url)
        host = parts.hostname or ""
        port = f":{parts.port}" if parts.port else ""
    except ValueError:
        return "(an invalid URL)"
    return f"{parts.scheme}://{host}{port}{parts.path}"


def open_backend(backend: str, url: str, root: Path, timeout_s: float | None = None) -> StateBackend:
    """The backend named ``backend`` (:data:`BACKENDS`): diskcache under ``root``, or Redis at ``url`` (its calls'
    ``timeout_s``: :class:`RedisBackend`).

    Raises:
        StateUnavailable: Redis cannot be reached.
        ValueError: an unknown backend name.
    """
    if backend == DISKCACHE:
        return DiskBackend(root)
    if backend == REDIS:
        return RedisBackend(url, timeout_s)
    raise ValueError(f"unknown state backend {backend!r}: use one of {', '.join(BACKENDS)}")



def backend_of(config: Config, root: Path | None = None) -> StateBackend:
    """The backend ``[state]`` of ``config`` names (its diskcache in ``root``, by default ``config.state_dir()``).

    Raises:
        ConfigError: ``backend = "redis"`` and the Redis at ``url`` cannot be reached (naming its address, never the
            password).
    """
    try:
        return open_backend(config.state.backend, config.state.url, root or config.state_dir())
    except StateUnavailable as exc:
        raise ConfigError(f"{config.source}: [state] backend = \"redis\": {exc}") from None
