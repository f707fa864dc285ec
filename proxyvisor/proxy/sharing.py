"""The trio shell of what replicas on one Redis share besides the key-value state
(``proxyvisor.adapters.replicas``): each ledger line a replica writes to its own file also goes to the session's
shared stream, with the session index; and the conversation links of clients that send no id.

What a request adds is queued on the event loop (:meth:`Sharing.line`, :meth:`Sharing.link`: a list append) and
sent by :meth:`Sharing.flush`, one pipeline in a worker thread for everything queued, once the request's answer is
through and before the client has all of it, so the client's next request, on any replica, finds it. Flushes
take turns (a lock): one waiting for another sends what was queued meanwhile, so under load one round trip carries
the lines of many requests. A Redis that does not answer loses no ledger line (each is in the local file); the
lines not shared are counted per session (``/info``'s live ``unshared``) and the outage is warned once.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import orjson
import trio

from ..adapters.replicas import RedisShare
from ..adapters.state import Outage, StateUnavailable
from .sessions import Session

log = logging.getLogger("proxyvisor.sessions")


class Sharing:
    """Queues and sends what the replicas share (module docstring) to ``share``."""

    def __init__(self, share: RedisShare) -> None:
        self.share = share
        self.pending: list[tuple[Session, dict[str, Any], float]] = []
        self.links: dict[bytes, str] = {}
        self._lock = trio.Lock()
        self._outage = Outage(log, "shared ledgers", "ledger lines go only to each replica's own files "
                                                     "(counted: /info's live 'unshared')", "sharing ledger lines again")

    def line(self, session: Session, record: dict[str, Any]) -> None:
        """Queue ``record``, the session's ledger line just written to its file (not changed after)."""
        self.pending.append((session, record, time.time()))

    def link(self, key: bytes, session: str | None) -> None:
        """Queue a conversation link (``proxyvisor.proxy.sessions.Conversations.on_keep``) of ``session`` (None:
        ambiguous)."""
        self.links[key] = session or ""

    async def flush(self) -> None:
        """Send what is queued (module docstring). Never raises but for cancellation (the send, once started in
        its thread, completes): a send that fails for any reason counts its lines unshared."""
        async with self._lock:
            if not self.pending and not self.links:
                return
            pending, self.pending = self.pending, []
            links, self.links = self.links, {}
            try:
                await trio.to_thread.run_sync(self._send, pending, links)
            except Exception as exc:  # noqa: BLE001 - it runs in the background too: it must not stop the proxy
                for session, _record, _wall in pending:
                    session.unshared += 1
                self._outage.failed(exc if isinstance(exc, StateUnavailable) else StateUnavailable(
                    f"{self.share.backend.describe()}: {type(exc).__name__}"))
                return
            self._outage.up()

    def _send(self, pending: list[tuple[Session, dict[str, Any], float]], links: dict[bytes, str]) -> None:
        # Serialised here, off the event loop: a line can be some KB.
        self.share.write([(s.id, orjson.dumps(record), wall) for s, record, wall in pending], links)

    async def lookup(self, keys: list[bytes]) -> dict[bytes, str]:
        """The stored sessions of the conversation links ``keys`` (one ``MGET`` in a worker thread); empty when
        Redis does not answer (warned once per outage)."""
        try:
            found = await trio.to_thread.run_sync(self.share.links, keys)
        except StateUnavailable as exc:
            self._outage.failed(exc)
            return {}
        return found
