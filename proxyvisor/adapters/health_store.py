"""Persisted pool health: the breaker of :mod:`proxyvisor.adapters.health` over a diskcache in the state dir.

Layout: ``<state dir>/health/`` (diskcache), one entry per pool keyed ``pool:<adapter>[:<bucket>]`` (children)
or ``pool:upstream:<upstream>:<model>`` (the agent's own requests, :mod:`proxyvisor.proxy.breakers`). Every admit
and settle is one read-modify-write inside a SQLite transaction (``BEGIN IMMEDIATE``), serialised across threads
and processes, so exactly one caller in the whole fleet of proxies sharing the state dir gets a probe lease.
The async methods run the store in a worker thread, keeping SQLite off the event loop (an admission while the
store does not exist yet, which reads nothing, is answered on the loop).

State survives restarts (wall-clock deadlines) and is cleared only by :meth:`HealthStore.clear`
(``proxyvisor health clear``); enabling supervision never clears it. Only normalised categories and numbers are
stored, never a provider payload or a credential.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio

from .cache import LazyCache
from .failures import Failure
from .health import HEALTHY, Admission, Cooldown, PoolHealth, admit, named, release, settle

_PREFIX = "pool:"


class HealthStore(LazyCache):
    """Pool health under ``root`` (the state dir's ``health`` folder), created on the first write."""

    def __init__(self, root: Path, cooldown: Cooldown) -> None:
        super().__init__(root)
        self.cooldown = cooldown
        # One worker thread at a time: the calls are serialised by SQLite anyway, and diskcache opens a connection
        # (file descriptors) per thread, so a burst of requests would otherwise open one per request.
        self._one = trio.CapacityLimiter(1)

    @staticmethod
    def _load(pool: str, value: Any) -> PoolHealth:
        if not isinstance(value, dict):
            return PoolHealth(pool)
        known = {f.name for f in dataclasses.fields(PoolHealth)}
        return PoolHealth(**{k: v for k, v in value.items() if k in known} | {"pool": pool})

    def get(self, pool: str) -> PoolHealth:
        """The pool's health (healthy when never seen). Reading creates nothing if the store does not exist."""
        if not self.exists():
            return PoolHealth(pool)
        return self._load(pool, self._db().get(_PREFIX + pool))

    def all(self) -> list[PoolHealth]:
        """Every pool with recorded health, by name.

        Raises:
            StoreUnusable: the store cannot be used (:meth:`~proxyvisor.adapters.cache.LazyCache.readable`).
        """
        if not self.readable():
            return []
        db = self._db()
        keys = sorted(k for k in db.iterkeys() if isinstance(k, str) and k.startswith(_PREFIX))
        return [self._load(k[len(_PREFIX):], db.get(k)) for k in keys]

    def admit_sync(self, pool: str, now: float, lease_s: float) -> Admission:
        """:func:`~proxyvisor.adapters.health.admit`, persisted atomically. A healthy pool costs one read, outside
        any transaction (admitting it writes nothing)."""
        if (current := self.get(pool)).state == HEALTHY:
            return admit(current, now, lease_s)[0]
        with self._lock:
            db = self._db()
            with db.transact():
                current = self._load(pool, db.get(_PREFIX + pool))
                admission, new = admit(current, now, lease_s)
                if new != current:
                    db.set(_PREFIX + pool, dataclasses.asdict(new))
        return admission

    def _update(self, pool: str, step: Callable[[PoolHealth], PoolHealth]) -> PoolHealth:
        with self._lock:
            db = self._db()
            with db.transact():
                current = self._load(pool, db.get(_PREFIX + pool))
                new = step(current)
                if new != current:
                    db.set(_PREFIX + pool, dataclasses.asdict(new))
        return new

    def settle_sync(self, pool: str, now: float, failure: Failure | None, lease_id: str = "") -> PoolHealth:
        """:func:`~proxyvisor.adapters.health.settle`, persisted atomically. Returns the new health. A success
        on a healthy pool with no failure counted changes nothing and costs one read, outside any transaction."""
        if failure is None and not lease_id:
            current = self.get(pool)
            if current.state == HEALTHY and current.failure_count == 0:
                return current
        return self._update(pool, lambda current: settle(current, now, failure, self.cooldown, lease_id))

    def release_sync(self, pool: str, now: float, lease_id: str = "") -> PoolHealth:
        """:func:`~proxyvisor.adapters.health.release`, persisted atomically. Returns the new health. Without a
        lease there is nothing to give back: one read, nothing opened or written."""
        if not lease_id:
            return self.get(pool)
        return self._update(pool, lambda current: release(current, now, lease_id))

    async def admit(self, pool: str, now: float, lease_s: float) -> Admission:
        """:meth:`admit_sync` off the event loop. While the store does not exist (no pool ever failed or held a
        probe under this state dir: nothing was ever written) every pool is healthy and admitting it writes
        nothing, so the answer is made here, after one ``stat``, without a worker thread: on a busy machine the
        thread's round trip costs more than the rest of a supervised request's own work."""
        if not self.exists():
            return admit(PoolHealth(pool), now, lease_s)[0]
        return await trio.to_thread.run_sync(self.admit_sync, pool, now, lease_s, limiter=self._one)

    async def settle(self, pool: str, now: float, failure: Failure | None, lease_id: str = "") -> PoolHealth:
        return await trio.to_thread.run_sync(self.settle_sync, pool, now, failure, lease_id, limiter=self._one)

    async def release(self, pool: str, now: float, lease_id: str = "") -> PoolHealth:
        return await trio.to_thread.run_sync(self.release_sync, pool, now, lease_id, limiter=self._one)

    async def recovery_at(self, pool: str, now: float) -> float | None:
        """:meth:`~proxyvisor.adapters.health.PoolHealth.recovery_at` of the pool (None: it admits a caller now),
        read off the event loop; writes nothing."""
        return await trio.to_thread.run_sync(lambda: self.get(pool).recovery_at(now), limiter=self._one)

    def clear(self, name: str | None = None) -> list[str]:
        """Forget the health of every pool (``name`` None), or of the pools ``name`` names
        (:func:`~proxyvisor.adapters.health.named`: one pool, an adapter's, ``upstream:NAME`` an upstream's,
        ``upstream`` the agent's). Returns the pools cleared.

        Raises:
            ValueError: ``name`` is empty or blank (never "every pool": that is None); nothing was cleared.
            StoreUnusable: the store cannot be used; nothing was cleared.
        """
        if name is not None and not name.strip():
            raise ValueError("an empty pool name names no pool")
        if not self.readable():
            return []
        cleared = []
        with self._lock:
            db = self._db()
            with db.transact():
                for health in self.all():
                    if name is None or named(health.pool, name):
                        db.delete(_PREFIX + health.pool)
                        cleared.append(health.pool)
        return cleared
