"""The web view: a page that shows the sessions, each session's timeline and the pools, updated live.

The page (``GET /proxyvisor/ui``, with ``app.js`` and ``app.css`` beside it) is static: three files shipped in the
package (``proxyvisor/proxy/webui``), no build step, nothing fetched from elsewhere, so it works offline. It holds
no data; what it shows it reads from the JSON endpoints below, which follow the same rules as every other
proxyvisor endpoint: ``[proxy] auth_token`` in ``x-proxyvisor-auth`` when one is configured, and the session
model of ``proxyvisor.proxy.commands`` (the listing and whatever spans sessions need ``[proxy] admin_token`` in
``x-proxyvisor-admin``; a session's own data needs only its id, which is a capability). A browser cannot put a
header on a page it navigates to, so the page takes the tokens from the URL's fragment (``#admin=...&auth=...``,
never sent to the server, removed from the address bar once read) and sends them as those headers.

Endpoints (JSON; errors in the OpenAI error shape, as ``/proxyvisor/sessions``):

- ``GET /proxyvisor/ui/api/sessions`` (admin): ``{"sessions": [row], "omitted": n}``, most recent first, a row
  per session (``proxyvisor.proxy.info.session_row`` plus ``in_memory``), at most :data:`LISTED` of them;
- ``GET /proxyvisor/ui/api/sessions/{id}``: ``{"session", "in_memory", "info": the /info object, "timeline":
  [entry], "omitted": n, "plan": the /plan object}``: a step per ledger line (``proxyvisor.proxy.info.
  timeline_entry``), the latest :data:`TIMELINE` of them;
- ``GET /proxyvisor/ui/api/overview`` (admin): ``{"supervision", "breakers", "upstreams", "health", "routing"}``:
  each pool's breaker (``proxyvisor.adapters.overview.health_json``) and the routing policy with each adapter's
  readiness (``routing_json``, as ``proxyvisor routing show --json``);
- ``GET /proxyvisor/ui/api/events`` (admin) and ``GET /proxyvisor/ui/api/sessions/{id}/events``: Server-Sent
  Events, ``text/event-stream``: ``ready`` once connected, then ``ledger`` (``{"session", "time", "status",
  "local"}``) for each ledger line written (of every session, or of that one, which need not have started yet),
  ``resync`` when the listener fell
  behind and missed some, and a comment every :data:`KEEPALIVE_S` seconds. An event says what changed; the page
  then reads the endpoints above again, so what it shows always comes from the ledgers: after a restart of the
  proxy it shows the same, rebuilt from the state directory (on Redis, from every replica's lines; the events
  announce only the lines of the replica the page is connected to).

Every answer carries ``cache-control: no-store`` and ``x-content-type-options: nosniff``; the page is served with a
content security policy that allows only its own script and style (no inline script, no other origin).
"""

from __future__ import annotations

import functools
import importlib.resources
import re
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
import trio

from ..adapters.descriptors import registry_for
from ..adapters.health_store import HealthStore, routing_health
from ..adapters.state import StateBackend
from ..adapters.overview import health_json, routing_json
from ..config import Config
from ..store import SESSION_ID, LedgerError, Store, StoreUnusable
from .commands import live, recent, session_plan, sessions_json
from .formats import CHAT
from .info import info_object, session_row, timeline_entry
from .server import ALLOW_GET, Headers, Response
from .session_state import SessionStates
from .sessions import SessionTable

PAGE = "/proxyvisor/ui"
API = PAGE + "/api/"
LISTED = 200
"""Sessions the listing sums (each is its ledger read whole): the most recent ones."""
TIMELINE = 500
"""Steps of a session's timeline served: its latest ledger lines."""
KEEPALIVE_S = 15.0
LISTENERS = 64
"""Event streams open at once; one more is refused (503)."""
_BACKLOG = 256
"""Events held for a listener that has not read them; past it they are dropped and it gets ``resync``."""
_SECURITY: Headers = [(b"cache-control", b"no-store"), (b"x-content-type-options", b"nosniff"),
                      (b"referrer-policy", b"no-referrer")]
_CSP = (b"default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self'; "
        b"base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
_FILES = {"": ("index.html", b"text/html; charset=utf-8"), "/": ("index.html", b"text/html; charset=utf-8"),
          "/app.js": ("app.js", b"text/javascript; charset=utf-8"),
          "/app.css": ("app.css", b"text/css; charset=utf-8")}
_SESSION = re.compile(r"^sessions/([^/]*)(/events)?$")


def _json(status: int, body: Any) -> Response:
    return Response(status, [(b"content-type", b"application/json"), *_SECURITY], orjson.dumps(body))


def _error(status: int, message: str, headers: Headers | None = None) -> Response:
    return Response(status, [(b"content-type", b"application/json"), *_SECURITY, *(headers or [])],
                    CHAT.error_body(status, message))


def _admin_only(admin: bool | None) -> Response:
    return _error(403, "this needs the admin token: " + (
        "send [proxy] admin_token in the x-proxyvisor-admin header (the page: /proxyvisor/ui#admin=TOKEN)"
        if admin is False else "set [proxy] admin_token in the proxy's configuration and send it in "
        "x-proxyvisor-admin") + "; a session's own view needs only its id: /proxyvisor/ui#session=ID")


def page(method: str, path: str) -> Response | None:
    """The static file of the page at ``path`` (``/proxyvisor/ui``, ``.../app.js``, ``.../app.css``), or None
    when ``path`` is none of them."""
    if not path.startswith(PAGE):
        return None
    found = _FILES.get(path[len(PAGE):])
    if found is None:
        return None
    if method not in ("GET", "HEAD"):
        return _error(405, f"{path} takes GET", ALLOW_GET)
    name, kind = found
    headers = [(b"content-type", kind), *_SECURITY]
    if name == "index.html":
        headers.append((b"content-security-policy", _CSP))
    return Response(200, headers, _static(name))


@functools.cache
def _static(name: str) -> bytes:
    return importlib.resources.files(__package__).joinpath("webui", name).read_bytes()


@dataclass
class _Listener:
    session: str | None
    send: trio.MemorySendChannel[bytes]
    lagged: bool = False


@dataclass
class LedgerFeed:
    """Hands each ledger line written to the event streams listening: :meth:`publish` never waits (a listener
    that does not keep up loses events and is told to resync), so writing the ledger never slows a request."""

    listeners: list[_Listener] = field(default_factory=list)

    def publish(self, session: str, record: dict[str, Any]) -> None:
        """Tell the listeners of ``session`` (and those of every session) that ``record`` was written."""
        if not self.listeners:
            return
        event = b"event: ledger\ndata: " + orjson.dumps(
            {"session": session, "time": record.get("time"), "status": record.get("status"),
             "local": record.get("local")}) + b"\n\n"
        for listener in self.listeners:
            if listener.session is None or listener.session == session:
                try:
                    listener.send.send_nowait(event)
                except trio.WouldBlock:
                    listener.lagged = True

    def stream(self, session: str | None) -> Response:
        """An event stream (module docstring) of ``session``'s lines, or every session's for None; 503 when
        :data:`LISTENERS` are open already."""
        if len(self.listeners) >= LISTENERS:
            return _error(503, f"too many event streams open ({LISTENERS}); close one")
        return Response(200, [(b"content-type", b"text/event-stream"), *_SECURITY], self._events(session))

    async def _events(self, session: str | None) -> AsyncIterator[bytes]:
        # Listening starts with the first read of the body, inside its try: a body never read (the client left
        # before the head went out) never listens, so nothing is left behind.
        send, receive = trio.open_memory_channel[bytes](_BACKLOG)
        listener = _Listener(session, send)
        self.listeners.append(listener)
        try:
            yield b"retry: 2000\nevent: ready\ndata: {}\n\n"
            while True:
                with trio.move_on_after(KEEPALIVE_S):
                    event = await receive.receive()
                    if listener.lagged:
                        listener.lagged = False
                        event = b"event: resync\ndata: {}\n\n"
                    yield event
                    continue
                yield b": keep-alive\n\n"
        finally:
            self.listeners.remove(listener)
            receive.close()


class WebView:
    """The JSON endpoints and event streams of the web view (module docstring) over one proxy's session table,
    state directory (``store``; None: nothing recorded), state backend (``backend``: pool health), sessions'
    stored supervision states (``states``: the plan of a session another replica serves) and configuration;
    ``clock`` is the session table's."""

    def __init__(self, config: Config, sessions: SessionTable, store: Store | None, clock: Callable[[], float],
                 backend: StateBackend | None = None, states: SessionStates | None = None) -> None:
        self.config = config
        self.states = states
        self.sessions = sessions
        self.store = store
        self.clock = clock
        self.feed = LedgerFeed()
        self._summed: dict[str, tuple[float, dict[str, Any]]] = {}
        """The listing's rows by session, with the wall time of the ledger's last line they were summed from: the
        latest listing's sessions only."""
        self.health: HealthStore | None = routing_health(backend, config.model_routing.cooldown) \
            if store is not None and backend is not None else None

    def close(self) -> None:
        if self.health is not None:
            self.health.close()

    async def api(self, method: str, path: str, admin: bool | None) -> Response:
        """Answer ``path`` under ``/proxyvisor/ui/api/``; ``admin``: whether the request carries the admin token
        (None: no admin token is configured)."""
        if method not in ("GET", "HEAD"):
            return _error(405, f"{path} takes GET", ALLOW_GET)
        rest = path[len(API):]
        if rest == "sessions":
            return await self._sessions() if admin else _admin_only(admin)
        if rest == "overview":
            return await self._overview() if admin else _admin_only(admin)
        if rest == "events":
            return self.feed.stream(None) if admin else _admin_only(admin)
        match = _SESSION.match(rest)
        if match is None:
            return _error(404, f"no such endpoint: {path}. The web view reads {API}sessions, {API}sessions/ID, "
                               f"{API}sessions/ID/events, {API}overview and {API}events")
        session_id, events = match.groups()
        if not SESSION_ID.match(session_id):
            return _error(400, "invalid session id: use 1-128 of [A-Za-z0-9._-], starting with a letter or digit")
        if events:  # a session not seen yet too: a page may open before the agent's first request
            return self.feed.stream(session_id)
        return await self._session(session_id)

    def _row(self, session_id: str, store: Store, version: float) -> dict[str, Any]:
        """The listing's row of a session with a ledger (:func:`~proxyvisor.proxy.info.session_row`), summed again
        only when its ledger's last line (``version``: its wall time, :func:`~.commands.recent`) changed since the
        last listing (a page that follows every session asks often).

        Raises:
            LedgerError: the ledger exists but cannot be read."""
        kept = self._summed.get(session_id)
        if kept is not None and kept[0] == version:
            return kept[1]
        row = session_row(session_id, store.read_ledger(session_id))
        self._summed[session_id] = (version, row)
        return row

    async def _sessions(self) -> Response:
        clock = self.clock()
        ledgers = await recent(self.store)
        versions = dict(ledgers)
        listed = sessions_json(self.sessions, ledgers, clock)["sessions"]
        counters = {sid: live(self.sessions.get(sid), clock) for sid in
                    (s["id"] for s in listed[:LISTED] if s["in_memory"])}
        store = self.store

        def rows() -> list[dict[str, Any]]:
            out, summed = [], {}
            for s in listed[:LISTED]:
                try:
                    base = self._row(s["id"], store, versions[s["id"]]) \
                        if store is not None and s["id"] in versions else session_row(s["id"], [])
                except LedgerError as exc:
                    out.append({"id": s["id"], "error": str(exc), "last_activity": s["last_activity"],
                                "in_memory": s["in_memory"]})
                    continue
                summed[s["id"]] = self._summed.get(s["id"])
                row = {**base, "in_memory": s["in_memory"], "last_activity": base["last_activity"] or s["last_activity"]}
                if not base["requests"] and (mem := counters.get(s["id"])) is not None:
                    row.update(requests=mem["requests"], errors=mem["errors"], input_tokens=mem["input_tokens"],
                               output_tokens=mem["output_tokens"])
                out.append(row)
            self._summed = {sid: entry for sid, entry in summed.items() if entry is not None}
            return out

        return _json(200, {"sessions": await trio.to_thread.run_sync(rows),
                           "omitted": max(0, len(listed) - LISTED)})

    async def _session(self, session_id: str) -> Response:
        session = self.sessions.get(session_id)
        counters = live(session, self.clock())
        store = self.store

        def read() -> dict[str, Any] | None:
            lines, only_here = store.ledger(session_id) if store is not None else ([], False)
            if not lines and session is None and (store is None or not store.known(session_id)):
                return None  # the file is looked for only when no line was read (off the event loop)
            shown = lines[-TIMELINE:]
            first = len(lines) - len(shown) + 1
            return {"session": session_id, "in_memory": session is not None,
                    "info": info_object(session_id, lines, counters, only_here),
                    "timeline": [timeline_entry(first + i, line) for i, line in enumerate(shown)],
                    "omitted": first - 1}

        try:
            body = await trio.to_thread.run_sync(read)
        except LedgerError as exc:
            return _error(500, str(exc))
        if body is None:
            return _error(404, f"no session {session_id!r}: it is neither in memory nor in the ledger")
        body["plan"] = await session_plan(session_id, session, self.states)
        return _json(200, body)

    async def _overview(self) -> Response:
        config, health, root = self.config, self.health, self.store.root if self.store is not None else None

        def read() -> dict[str, Any]:
            registry = registry_for(config.model_routing.adapters_dir)
            return {"supervision": config.supervisor.enabled,
                    "breakers": config.supervisor.enabled and config.supervisor.breakers.enabled,
                    "upstreams": [{"name": u.name, "formats": list(u.formats), "fallback": list(u.fallback),
                                   "scripted": u.scripted} for u in config.upstreams],
                    "health": health_json(health.all() if health is not None else [], time.time()),
                    "routing": routing_json(config, registry, root)}

        try:
            return _json(200, await trio.to_thread.run_sync(read))
        except StoreUnusable as exc:
            return _error(500, str(exc))
