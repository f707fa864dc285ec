"""Per-pool breakers for the agent's own requests, and fallbacks to other upstreams.

With supervision on (``[supervisor.breakers] enabled``), every model request of the agent goes through the breaker
(:mod:`proxyvisor.adapters.health`, persisted in the state dir's ``health`` store that children use too, so every
proxy process sharing the state dir sees the same pools) of its pool ``upstream:<upstream>:<model>``:

- a 429, a 529 or other 5xx, and a connection failure (refused, reset, timed out) trip the pool: it cools down for
  ``cooldown_s``, doubling on each trip in a row up to ``maximum_cooldown_s``, with the upstream's ``Retry-After``
  as the floor; a 401, 400 or another 4xx says nothing about capacity and trips nothing, nor does a 429 whose body
  asks for billing action (a quota: no wait ends it, and the agent gets the upstream's own error, which tells
  its SDK not to retry), though it is tried on a fallback;
- while the pool cools, a request for it is not sent: the agent gets a 429 in its own format at once, with the
  remaining ``Retry-After`` (1 s while the recovery probe is in flight);
- once the cooldown is over, exactly one request (in the whole fleet of proxies) is the half-open probe; its lease
  lasts the request's own timeouts; its success makes the pool healthy again, another trip cools it longer;
- ``[upstreams.NAME] fallback = ["OTHER", ...]``: while the pool cools, or when the upstream trips before any
  byte of its reply reached the agent, the same request goes to the next fallback (relayed when it speaks the
  client's format, else translated), each under its own pool. A stream that has started is never retried: its
  failure ends the agent's stream with the format's error event. Fallbacks are not transitive.

The ledger line of the request says which upstream answered and why (:meth:`Dispatch.evidence`). A supervised
request's further bodies on its route (supervisor model calls, continued turns) pass the same pool's breaker
without fallbacks (``Pipeline._sender``).
With supervision off none of this exists: the byte relay sends every request as it came.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import AsyncIterable, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import trio

from ..adapters.failures import CAPACITY, KNOWN_FAILED, PROVIDER, TIMEOUT, UNAVAILABLE, Failure, from_http
from ..adapters.health import HALF_OPEN, Admission, Cooldown
from ..adapters.health_store import NAMESPACE as HEALTH, HealthStore
from ..adapters.state import StateBackend
from ..config import BreakersConfig, Config, UpstreamConfig
from .formats import WireFormat
from .relay import UpstreamError, UpstreamReply

log = logging.getLogger("proxyvisor.breakers")

OPENS = frozenset({CAPACITY, PROVIDER, TIMEOUT, UNAVAILABLE})
"""The failures that trip one of the agent's pools (retryable ones only: a 429 asking for billing action does not)."""
_WORDING_BYTES = 4096
"""The head of an error body searched for a quota's wording."""
PREFIX = "upstream"
"""The first part of every agent pool's name (``proxyvisor health clear upstream`` clears them all)."""
LONG_WAIT_S = 10
"""A cooldown with at least this many seconds left is a wait a user notices (and may not have caused: the state is
shared by every proxy on the state dir, so another's 429 can hold this one's requests): proxyvisor's 429 then says
how to reset the pool, and :attr:`Breakers.on_long_wait` hears of it."""


def pool_of(upstream: str, model: str) -> str:
    """The health key of the agent's requests for ``model`` on ``upstream``."""
    return f"{PREFIX}:{upstream}:{model or '-'}"


def failure_of_reply(status: int, headers: Sequence[tuple[bytes, bytes]], body: bytes | AsyncIterable[Any],
                     now: float) -> Failure | None:
    """The normalised failure of an upstream reply (None below 400); ``now``: the wall clock (Unix s). An error
    body (read whole by the relay) is read for its wording, so that a 429 asking for billing action (OpenAI's
    ``insufficient_quota``) is a quota, not a rate limit: no wait ends it."""
    if status < 400:
        return None
    found = {k.lower(): v.decode("latin-1") for k, v in headers if k.lower() in (b"retry-after", b"retry-after-ms")}
    text = body[:_WORDING_BYTES].decode("utf-8", "replace") if isinstance(body, bytes) else ""
    failure = from_http(status, text, now, found.get(b"retry-after"), found.get(b"retry-after-ms"))
    # The body only classifies: what the upstream wrote is the agent's to read, not proxyvisor's logs'.
    return dataclasses.replace(failure, message=f"HTTP {status}" + (" (a quota)" if failure.quota else ""))


def failure_of_error(exc: UpstreamError, now: float) -> Failure:
    """The normalised failure of an upstream that gave no reply: 502 is a connection failure (refused, reset, a
    name that does not resolve, a body cut short), any other status (504: a timeout) as :func:`from_http` has it."""
    if exc.status == 502:
        return Failure(UNAVAILABLE, True, KNOWN_FAILED, None, exc.message)
    return from_http(exc.status, exc.message, now)


@dataclass
class Dispatch:
    """What happened to one request under the breakers: each upstream tried, in order, with its pool, the
    breaker's state at dispatch, whether it was the probe, and its outcome (``answered``, ``refused``: cooling,
    not sent; ``failed``: tripped, with its status and category; ``cancelled``: the client left first)."""

    attempts: list[dict[str, Any]] = field(default_factory=list)

    def evidence(self) -> dict[str, Any]:
        """The ledger's ``upstream`` object: the upstream that answered (or was tried last), its pool, the breaker
        state at dispatch and whether it was the probe; ``tried`` lists the attempts before it, when any."""
        last = self.attempts[-1]
        out = {"name": last["upstream"], "pool": last["pool"], "health_state": last["health_state"],
               "health_probe": last["health_probe"], "outcome": last["outcome"]}
        if len(self.attempts) > 1:
            out["tried"] = self.attempts[:-1]
        return out


Send = Callable[[UpstreamConfig], Awaitable[UpstreamReply]]
"""Sends the agent's request to one upstream (relayed or translated), as ``HttpRelay.send`` does."""


class Breakers:
    """The breakers of one proxy over the health store in ``backend``. ``now``: the wall clock (Unix seconds),
    which deadlines are kept in; tests pass their own."""

    def __init__(self, config: BreakersConfig, upstreams: Sequence[UpstreamConfig], backend: StateBackend,
                 now: Callable[[], float] = time.time) -> None:
        self.config = config
        self.upstreams = {u.name: u for u in upstreams}
        self.store = HealthStore(backend.kv(HEALTH), Cooldown(config.cooldown_s, config.maximum_cooldown_s, OPENS,
                                                           retry_after_floor=True))
        self.now = now
        self.on_long_wait: Callable[[str, float], None] | None = None
        """Called with (pool, the end of its cooldown, Unix s) when a request is refused by a pool cooling for
        :data:`LONG_WAIT_S` or more: once per pool and deadline, not per request (``wrap`` says so on stderr)."""
        self._told: dict[str, float] = {}

    def close(self) -> None:
        self.store.close()

    def chain(self, upstream: str) -> list[UpstreamConfig]:
        """The upstream named ``upstream`` and its fallbacks, in the order they are tried."""
        first = self.upstreams[upstream]
        return [first, *(self.upstreams[name] for name in first.fallback)]

    async def send(self, fmt: WireFormat, model: str, upstream: str, send: Send,
                   dispatch: Dispatch, fallbacks: bool = True) -> UpstreamReply:
        """Send the agent's request for ``model`` to the upstream named ``upstream`` or its fallbacks under their
        pools' breakers (module docstring) and return the reply (the last failure when every upstream failed;
        proxyvisor's own 429 when every pool is cooling); what happened goes to ``dispatch``, whether it returns
        or raises. A healthy pool's success costs one read of the store (the admission) and writes nothing.
        ``fallbacks`` False: ``upstream`` alone is tried (a body bound to its route: a supervisor model call, a
        continued turn).

        Raises:
            UpstreamError: the last upstream tried gave no reply (as ``send`` raised it).
            trio.Cancelled: the caller left; a probe lease held was given back first.
        """
        refusals: list[Admission] = []
        chain = self.chain(upstream) if fallbacks else [self.upstreams[upstream]]
        for index, target in enumerate(chain):
            pool = pool_of(target.name, model)
            lease_s = target.connect_timeout_s + target.first_byte_timeout_s + target.idle_timeout_s
            admission = await self.store.admit(pool, self.now(), lease_s)
            attempt: dict[str, Any] = {"upstream": target.name, "pool": pool, "health_state": admission.state,
                                       "health_probe": admission.probe}
            dispatch.attempts.append(attempt)
            if not admission.admitted:
                attempt["outcome"] = "refused"
                refusals.append(admission)
                continue
            raised: UpstreamError | None = None
            try:
                reply = await send(target)
                status, failure = reply.status, failure_of_reply(reply.status, reply.headers, reply.body,
                                                                  self.now())
            except UpstreamError as exc:
                raised, status, failure = exc, exc.status, failure_of_error(exc, self.now())
            except BaseException:  # cancelled (or proxyvisor failed) before an answer: only a lease is given back
                attempt["outcome"] = "cancelled"
                if admission.probe:
                    with trio.CancelScope(shield=True):
                        await self.store.release(pool, self.now(), admission.lease_id)
                raise
            if failure is not None or admission.probe or admission.failure_count:
                await self._settle(pool, failure, admission)
            if failure is None:
                attempt["outcome"] = "answered"
            else:
                self._failed(attempt, status, failure)
                # An error that opens nothing (a 401, a body that cannot be checked for the key) would fare no
                # better on a fallback; a quota is the account's, and a fallback is another upstream.
                if index < len(chain) - 1 and (self.store.cooldown.opens_on(failure) or failure.quota):
                    log.warning("upstream %r failed (%s); trying its fallback", target.name, failure.message)
                    continue
            if raised is not None:
                raise raised
            return reply
        return self._cooling(fmt, refusals)

    async def _settle(self, pool: str, failure: Failure | None, admission: Admission) -> None:
        with trio.CancelScope(shield=True):  # a result known is recorded even if the client leaves now
            await self.store.settle(pool, self.now(), failure, admission.lease_id)

    @staticmethod
    def _failed(attempt: dict[str, Any], status: int, failure: Failure) -> None:
        attempt.update(outcome="failed", status=status, error_category=failure.category)
        if failure.retry_after_s:
            attempt["retry_after_s"] = failure.retry_after_s

    def _cooling(self, fmt: WireFormat, refusals: list[Admission]) -> UpstreamReply:
        """Proxyvisor's own 429 in ``fmt`` for a request every pool of which refused: ``Retry-After`` is the
        soonest recovery (1 s while a probe is in flight: it settles as soon as the probe is answered). When that
        is :data:`LONG_WAIT_S` or more, the message names the command that resets the cooling pools, and
        :attr:`on_long_wait` hears of each one not told of yet at its deadline."""
        now = self.now()
        waits, cooling = [], []
        for refusal in refusals:
            if refusal.state == HALF_OPEN:
                waits.append((1, refusal.pool, "waiting for its recovery probe"))
            else:
                until = refusal.recovery_at or now
                waits.append((max(1, math.ceil(until - now)), refusal.pool, "cooling down"))
                cooling.append((refusal.pool, until))
        seconds = min(w[0] for w in waits)
        parts = "; ".join(f"{pool} is {why} (retry in {s} s)" for s, pool, why in waits)
        message = (f"proxyvisor: not sent upstream: {parts}. The upstream rate-limited or failed recently; "
                   f"retry after {seconds} s")
        if seconds >= LONG_WAIT_S:
            message += (". The pools' state is shared by every proxy using this state directory; to send now "
                        "anyway, reset " + " and ".join(f"`proxyvisor health clear {pool}`" for pool, _ in cooling))
            for pool, until in cooling:
                if self.on_long_wait is not None and self._told.get(pool) != until:
                    self._told[pool] = until
                    self.on_long_wait(pool, until)
        headers = [(b"content-type", b"application/json"), (b"retry-after", str(seconds).encode()),
                   (b"x-proxyvisor-breaker", b"open")]
        return UpstreamReply(429, headers, fmt.error_body(429, message))


def breakers_for(config: Config, backend: StateBackend | None) -> Breakers | None:
    """The proxy's breakers over the health in ``backend``, or None: supervision or ``[supervisor.breakers]`` is
    off, nothing may be written (``backend`` None), or the health store cannot work (logged once, naming why)."""
    if not (config.supervisor.enabled and config.supervisor.breakers.enabled) or backend is None:
        return None
    reason = backend.unusable(HEALTH)
    if reason is not None:
        log.warning("state directory: rate-limit protection is off (every request goes upstream, whatever its "
                    "pool's health): %s", reason)
        return None
    return Breakers(config.supervisor.breakers, config.upstreams, backend)
