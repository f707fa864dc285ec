"""Persisted pool health: the breaker of :mod:`proxyvisor.adapters.health` over a :class:`~.state.KV` namespace.

Layout: the ``health`` namespace (``<state dir>/health/``, or Redis keys ``proxyvisor:health:*``), one entry per
pool keyed ``pool:<adapter>[:<bucket>]`` (children) or ``pool:upstream:<upstream>:<model>`` (the agent's own
requests, :mod:`proxyvisor.proxy.breakers`), its value the pool's health as JSON. Every admit and settle that
changes a pool is one atomic read-modify-write (:meth:`~.state.KV.update`: a SQLite transaction, or a Redis
compare-and-set script), so exactly one caller in the whole fleet of proxies sharing the state gets a probe lease.
The async methods run the store in a worker thread, keeping SQLite and Redis off the event loop (an admission
while the diskcache folder does not exist yet, which reads nothing, is answered on the loop).

State survives restarts (wall-clock deadlines) for :data:`TTL_S` after the pool's last change, and is cleared
sooner only by :meth:`HealthStore.clear` (``proxyvisor health clear``); enabling supervision never clears it.
Only normalised categories and numbers are stored, never a provider payload or a credential.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import orjson
import trio

from .failures import Failure
from .health import HEALTHY, Admission, Cooldown, PoolHealth, admit, named, release, settle
from .state import KV, Outage, StateBackend, StateUnavailable

if TYPE_CHECKING:
    from ..config import CooldownConfig

log = logging.getLogger("proxyvisor.health")
T = TypeVar("T")

_PREFIX = "pool:"
NAMESPACE = "health"
TTL_S = 7 * 24 * 3600.0
"""Seconds a pool's recorded health is kept after its last change (far beyond any cooldown)."""


_FIELDS = frozenset(f.name for f in dataclasses.fields(PoolHealth))
"""The fields a stored health may set (others, from another version, are ignored)."""


def _encode(health: PoolHealth) -> bytes:
    return orjson.dumps({k: v for k, v in dataclasses.asdict(health).items() if k != "pool"})


def routing_health(backend: StateBackend, cooldown: CooldownConfig) -> HealthStore:
    """The pool health of model routing's children in ``backend`` (the ``health`` namespace), under
    ``[model_routing.cooldown]``'s rules: what delegation writes and ``proxyvisor health``, the web view and the MCP
    server read. Close it after use."""
    return HealthStore(backend.kv(NAMESPACE), Cooldown(cooldown.default_seconds, cooldown.maximum_seconds))


class HealthStore:
    """Pool health in ``kv`` (the ``health`` namespace), with ``cooldown`` the breaker's rules."""

    def __init__(self, kv: KV, cooldown: Cooldown) -> None:
        self.kv = kv
        self.cooldown = cooldown
        # One worker thread at a time: the calls are serialised by SQLite anyway, and diskcache opens a connection
        # (file descriptors) per thread, so a burst of requests would otherwise open one per request.
        self._one = trio.CapacityLimiter(1)
        self._outage = Outage(log, "pool health", "every request is admitted as to a healthy pool until it answers",
                              "the state backend answers again; breakers are back on")

    @staticmethod
    def _load(pool: str, value: bytes | None) -> PoolHealth:
        try:
            fields = orjson.loads(value) if value is not None else None
        except orjson.JSONDecodeError:
            fields = None
        if not isinstance(fields, dict):
            return PoolHealth(pool)
        return PoolHealth(**{k: v for k, v in fields.items() if k in _FIELDS} | {"pool": pool})

    def get(self, pool: str) -> PoolHealth:
        """The pool's health (healthy when never seen). Reading creates nothing if the store does not exist.

        Raises:
            StateUnavailable: the state backend cannot be read.
        """
        return self._load(pool, self.kv.get(_PREFIX + pool))

    def all(self) -> list[PoolHealth]:
        """Every pool with recorded health, by name.

        Raises:
            StoreUnusable: the store cannot be used (:meth:`~.state.KV.keys`); StateUnavailable: Redis is down.
        """
        keys = self.kv.keys(_PREFIX)
        return [self._load(k[len(_PREFIX):], v) for k, v in zip(keys, self.kv.get_many(keys))]

    def _update(self, pool: str, step: Callable[[PoolHealth], PoolHealth]) -> PoolHealth:
        """``step`` applied to the pool's health in one atomic read-modify-write; the new health."""
        made: list[PoolHealth] = []

        def raw(value: bytes | None) -> bytes | None:
            current = self._load(pool, value)
            made.append(new := step(current))
            return value if new == current else _encode(new)

        self.kv.update(_PREFIX + pool, raw, TTL_S)
        return made[-1]

    def admit_sync(self, pool: str, now: float, lease_s: float) -> Admission:
        """:func:`~proxyvisor.adapters.health.admit`, persisted atomically. A healthy pool costs one read, outside
        any transaction (admitting it writes nothing)."""
        if (current := self.get(pool)).state == HEALTHY:
            return admit(current, now, lease_s)[0]
        admissions: list[Admission] = []

        def step(health: PoolHealth) -> PoolHealth:
            admission, new = admit(health, now, lease_s)
            admissions.append(admission)
            return new

        self._update(pool, step)
        return admissions[-1]

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

    # The async methods run off the event loop. When the state backend fails (Redis down), the breaker is off:
    # every caller is admitted as to a healthy pool and nothing is recorded, with one warning per outage.

    async def admit(self, pool: str, now: float, lease_s: float) -> Admission:
        """:meth:`admit_sync` off the event loop. While the namespace does not exist (a diskcache folder: no pool
        ever failed or held a probe under this state dir, nothing was ever written) every pool is healthy and
        admitting it writes nothing, so the answer is made here, after one ``stat``, without a worker thread: on a
        busy machine the thread's round trip costs more than the rest of a supervised request's own work."""
        if not self.kv.exists():
            return admit(PoolHealth(pool), now, lease_s)[0]
        return await self._off_loop(lambda: admit(PoolHealth(pool), now, lease_s)[0], self.admit_sync, pool, now,
                                    lease_s)

    async def settle(self, pool: str, now: float, failure: Failure | None, lease_id: str = "") -> PoolHealth:
        return await self._off_loop(lambda: PoolHealth(pool), self.settle_sync, pool, now, failure, lease_id)

    async def release(self, pool: str, now: float, lease_id: str = "") -> PoolHealth:
        return await self._off_loop(lambda: PoolHealth(pool), self.release_sync, pool, now, lease_id)

    async def recovery_at(self, pool: str, now: float) -> float | None:
        """:meth:`~proxyvisor.adapters.health.PoolHealth.recovery_at` of the pool (None: it admits a caller now),
        read off the event loop; writes nothing."""
        return await self._off_loop(lambda: None, lambda: self.get(pool).recovery_at(now))

    async def _off_loop(self, fallback: Callable[[], T], fn: Callable[..., T], *args: Any) -> T:
        try:
            result = await trio.to_thread.run_sync(fn, *args, limiter=self._one)
        except StateUnavailable as exc:
            self._outage.failed(exc)
            return fallback()
        self._outage.up()
        return result

    def clear(self, name: str | None = None) -> list[str]:
        """Forget the health of every pool (``name`` None), or of the pools ``name`` names
        (:func:`~proxyvisor.adapters.health.named`: one pool, an adapter's, ``upstream:NAME`` an upstream's,
        ``upstream`` the agent's). Returns the pools cleared.

        Raises:
            ValueError: ``name`` is empty or blank (never "every pool": that is None); nothing was cleared.
            StoreUnusable: the store cannot be used; nothing was cleared. StateUnavailable: Redis is down.
        """
        if name is not None and not name.strip():
            raise ValueError("an empty pool name names no pool")
        cleared = []
        for key in self.kv.keys(_PREFIX):
            pool = key[len(_PREFIX):]
            if name is None or named(pool, name):
                self.kv.delete(key)
                cleared.append(pool)
        return cleared

    def close(self) -> None:
        self.kv.close()
