"""What replicas on one Redis share besides the key-value namespaces of :mod:`proxyvisor.adapters.state`: the
sessions' ledgers, the index of sessions, and the conversation links of clients that send no session id. Only
with ``[state] backend = "redis"``; on diskcache the replicas of one host share the state directory itself.

Keys (all under ``proxyvisor:``, each with a time to live refreshed by every write):

- ``ledger:<session>``: a Redis stream, one entry per ledger line (field ``l``: the line's JSON), the latest
  :data:`LEDGER_LINES` kept (``XADD ... MAXLEN ~``), expiring ``ttl_s`` after the session's last line. A stream
  rather than a list: appends from any replica are ordered by Redis and trimmed in the same command.
- ``ledger-index``: a sorted set of sessions by the wall time of their last line (``ZADD GT``: a send that reaches
  Redis after a later line's never moves it back), so listing the sessions reads one key instead of every ledger;
  members older than ``ttl_s`` are dropped as lines are added.
- ``links:<hex>``: which session a conversation link (``proxyvisor.proxy.sessions.Conversations``) belongs to
  (empty: to two sessions, so to none), expiring ``link_ttl_s`` after it was last written. A link written for a
  session while it belongs to another one becomes empty (:data:`_SET_LINKS`): two replicas that each delivered the
  same answer text to a session of their own learn it when they ask, as one replica knows it at once.

:meth:`RedisShare.write` sends what a batch of requests adds in one pipeline (one round trip). Every call blocks
(redis-py's synchronous client, as the rest of the backend): trio code runs it in a worker thread. Writes raise
:class:`~proxyvisor.adapters.state.StateUnavailable` when Redis does not answer; the readers for the ledger store
(:meth:`lines`, :meth:`recent`, :meth:`known`) answer "not shared" instead (warned once per outage), so a reader
falls back to the local ledger files.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import Any

from ..config import Config
from .state import COMMAND_TIMEOUT_S, REDIS, REDIS_PREFIX, Outage, RedisBackend, StateUnavailable

log = logging.getLogger("proxyvisor.state")

LEDGER_LINES = 10_000
"""Ledger lines of one session a stream keeps (its latest): some 10-30 MB at the most for one session, far more
requests than a session makes; the local JSONL ledger keeps them all."""
_LEDGER = REDIS_PREFIX + "ledger:"
_INDEX = REDIS_PREFIX + "ledger-index"
_LINKS = REDIS_PREFIX + "links:"
_SET_LINKS = """
local session, current
for i, key in ipairs(KEYS) do
  session = ARGV[i + 1]
  if session ~= '' then
    current = redis.call('GET', key)
    if current and current ~= session then session = '' end
  end
  redis.call('SET', key, session, 'PX', ARGV[1])
end
return #KEYS
"""
"""Set each link ``KEYS[i]`` to its session ``ARGV[i + 1]`` for ``ARGV[1]`` ms, or to ``''`` (ambiguous) when it is
stored for another session (:meth:`~proxyvisor.proxy.sessions.Conversations.answered`'s rule, fleet-wide)."""


class RedisShare:
    """The shared ledgers, session index and conversation links (module docstring) in ``backend``'s Redis."""

    def __init__(self, backend: RedisBackend, ttl_s: float, link_ttl_s: float) -> None:
        self.backend = backend
        self.ttl_ms = max(1, round(ttl_s * 1000))
        self.ttl_s = ttl_s
        self.link_ttl_ms = max(1, round(link_ttl_s * 1000))
        self._set_links = backend.client.register_script(_SET_LINKS)
        self._outage = Outage(log, "reading shared ledgers", "each replica reads its own ledger files until it answers")

    def write(self, lines: Iterable[tuple[str, bytes, float]], links: dict[bytes, str]) -> None:
        """Append ``lines`` (session, the line's JSON, its wall time) to their sessions' streams, move the sessions
        in the index, and set ``links`` (key to session; ``""``: ambiguous, as is a link stored for another
        session): one pipeline.

        Raises:
            StateUnavailable: Redis does not answer (what was not sent is not written).
        """
        def send(r: Any) -> None:
            pipe = r.pipeline(transaction=False)
            latest: dict[str, float] = {}
            for session, line, wall in lines:
                pipe.xadd(_LEDGER + session, {"l": line}, maxlen=LEDGER_LINES, approximate=True)
                latest[session] = max(wall, latest.get(session, 0.0))
            for session in latest:
                pipe.pexpire(_LEDGER + session, self.ttl_ms)
            if latest:
                pipe.zadd(_INDEX, latest, gt=True)  # another replica's send of a later line may come first
                pipe.zremrangebyscore(_INDEX, "-inf", time.time() - self.ttl_s)
                pipe.pexpire(_INDEX, self.ttl_ms)
            if links:
                self._set_links(keys=[_LINKS + key.hex() for key in links], args=[self.link_ttl_ms, *links.values()],
                                client=pipe)
            pipe.execute()

        self.backend.call(send)

    def links(self, keys: list[bytes]) -> dict[bytes, str]:
        """The sessions of the conversation links ``keys`` that are stored (``""``: ambiguous).

        Raises:
            StateUnavailable: Redis does not answer.
        """
        if not keys:
            return {}
        values = self.backend.call(lambda r: r.mget([_LINKS + k.hex() for k in keys]))
        return {k: v.decode() for k, v in zip(keys, values) if isinstance(v, bytes)}

    def lines(self, session_id: str) -> list[bytes] | None:
        """The session's shared ledger lines, oldest first (none when it has none); None when Redis does not
        answer."""
        entries = self._read(lambda r: r.xrange(_LEDGER + session_id))
        if entries is None:
            return None
        return [fields[b"l"] for _id, fields in entries if b"l" in fields]

    def recent(self) -> dict[str, float]:
        """Each session of the index with the wall time of its last line (empty when Redis does not answer)."""
        found = self._read(lambda r: r.zrangebyscore(_INDEX, time.time() - self.ttl_s, "+inf", withscores=True))
        return {member.decode(): float(score) for member, score in found or ()}

    def known(self, session_id: str) -> bool:
        """Whether the session has shared ledger lines (False when Redis does not answer)."""
        return bool(self._read(lambda r: r.exists(_LEDGER + session_id)))

    def _read(self, fn: Any) -> Any:
        try:
            found = self.backend.call(fn)
        except StateUnavailable as exc:
            self._outage.failed(exc)
            return None
        self._outage.up()
        return found


def shared_ledgers(config: Config) -> RedisShare | None:
    """The shared ledgers of ``config`` for a command that reads them without a proxy (``proxyvisor info``): None
    unless ``[state] backend = "redis"``, or when that Redis cannot be reached (warned, naming its address, never
    the password: the command reads this machine's ledger files, as a proxy's readers do in an outage). Its
    connection lives as long as the process."""
    if config.state.backend != REDIS:
        return None
    try:
        backend = RedisBackend(config.state.url, COMMAND_TIMEOUT_S)
    except StateUnavailable as exc:
        log.warning("shared ledgers: %s; reading this machine's ledger files only", exc)
        return None
    return RedisShare(backend, config.state.session_ttl_s, config.state.session_idle_s)
