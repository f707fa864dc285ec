"""The request pipeline: route a request, identify its session, forward it, and account for it.

Two paths (DESIGN.md, principles 3 and 4):

- **disabled supervision, same format upstream**: the byte relay. The body is not parsed, nothing is written,
  and the only addition to the reply is the ``x-proxyvisor-overhead-ms`` header; a request under a session or run
  prefix is counted in memory only (requests, errors, overhead: what ``wrap`` sums up at exit).
- **otherwise**: the body is parsed (malformed input gets a 4xx in the client's format), the session is
  identified, the request is forwarded (relayed, or translated through litellm when no upstream speaks the
  client's format), usage is read from the reply, and one ledger line is written per request (with the ``run``
  the request came through, if any: ``proxyvisor.proxy.sessions``). The answer the
  client got is recorded with the conversation of a session identified by its history
  (``Conversations.answered``), so that its next request, which carries the answer, finds the session. The
  request goes upstream under its pool's breaker, with the upstream's fallbacks (``proxyvisor.proxy.breakers``).

The proxy overhead of a request (the header, the ledger's ``overhead_ms``) is the wall time proxyvisor itself added
before the reply's headers: the request's time so far less the time waiting for the upstream (continued turns
included) and for supervisor model calls (condenser, verifier, refuter, planner alike; their time is the ledger's
``supervisor_model.time_ms``). With
  ``[model_routing] enabled`` too, the model is offered delegation tools and the turn may be continued upstream
  after the children ran (``proxyvisor.proxy.delegation``); ``POST /proxyvisor/delegate`` runs one child.
  A request whose last user message is ``/plan`` or ``/info`` is answered by proxyvisor itself, and earlier such
  exchanges are kept from the upstream (``proxyvisor.proxy.commands``, which also serves
  ``GET /proxyvisor/sessions...``). ``/proxyvisor/ui`` is the web view (``proxyvisor.proxy.web``): its static page
  is served before any authentication, as it holds no data; each ledger line written is told to its event streams.

A failure inside proxyvisor's own code never becomes a lost response: the handler turns it into a 500 in the
client's format and logs the reason.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import time
from collections.abc import AsyncGenerator, Awaitable, Iterable
from datetime import datetime, timezone
from typing import Any

import orjson
import trio

from .. import bigtext, wirejson
from ..adapters.health_store import NAMESPACE as HEALTH
from ..adapters.results import ClaimStore
from ..adapters.replicas import RedisShare
from ..adapters.state import DiskBackend, RedisBackend, StateBackend
from ..condense import text as condense_text
from ..config import Config, UpstreamConfig
from ..schema import json_kind
from ..detectors.selfreport import strip
from ..store import LedgerError, Store, unusable
from ..supervisor_model import ModelAnswer, ModelCall
from .formats import BY_PATH, CHAT, MESSAGES, AssistantTurn, Usage, WireFormat
from .formats.base import event_object
from .client import Cut
from .codings import UndecodableBody, decode
from .relay import STOPPED_MID_STREAM, HttpRelay, UpstreamError, UpstreamReply, upstream_headers
from .session_model import Send, SupervisorRoutes, secrets_of
from .server import ALLOW_GET, ALLOW_POST, Headers, Request, Response
from .bodies import BodyCache
from .sessions import (InvalidSession, Prefix, Session, SessionTable, explicit_id, identify, split_prefix,
                       unprefixed)
from .condensing import request_condenser
from .condense_decisions import DecisionCache
from .session_state import NAMESPACE as SESSIONS, SETTINGS as SESSION_SETTINGS, SessionStates
from .sharing import Sharing
from . import commands, estimate, tokenizers, web
from .web import WebView
from .info import agent_of, ledger_fields, model_name
from .delegation import ProxyDelegation
from ..adapters.results import child_traceparent
from . import telemetry
from .authorizing import Authorizer
from .breakers import Dispatch, breakers_for
from .gating import Gating, eligible
from .learning import Learning, memory_store
from .supervise import Exchange, ModelCallTime, ModelUse, Supervisor
from .closing import close
from .sse import EventTooLarge, SSEParser, at_event_end, feed_cost, last_event_start
from .reply import Encoded, ReplyStream, off_loop

log = logging.getLogger("proxyvisor.pipeline")

_JSON: Headers = [(b"content-type", b"application/json")]
OVERHEAD_HEADER = b"x-proxyvisor-overhead-ms"
_CANCELLED = "cancelled before the answer: the client left"
"""The ledger's error for a request cut off while upstream; its status is 499 (nginx's "client closed request").
One the proxy's stop cut off (:attr:`Pipeline.stopped`) is recorded with :data:`_STOPPED` and status 503."""
_STOPPED = "cancelled before the answer: the proxy stopped ([proxy] shutdown_grace_s)"
AUTH_HEADER = "x-proxyvisor-auth"
ADMIN_HEADER = "x-proxyvisor-admin"
_HEAD = 4096
"""Bytes of a stream's last event looked at for the marks of an event that ends the stream (they come first in
it, or it is small)."""
_KEPT_FOR_ESTIMATE = 8 * 1024 * 1024
"""Characters of stream event data kept to estimate the output tokens of a stream that reports no usage."""


def format_for_path(path: str) -> WireFormat:
    """The format whose errors a path should get: Anthropic for ``/v1/messages...``, OpenAI otherwise.

    A run prefix ``/r/{id}`` and a session prefix ``/s/{id}`` (``proxyvisor.proxy.sessions.split_prefix``) are
    skipped first, valid or not, so a bad id is reported in the client's format.
    """
    return _format_for(unprefixed(path))


def _format_for(path: str) -> WireFormat:
    """:func:`format_for_path` of a path without its prefixes (split from them already)."""
    return MESSAGES if path.startswith("/v1/messages") else BY_PATH.get(path, CHAT)


def error(fmt: WireFormat, status: int, message: str, headers: Iterable[tuple[bytes, bytes]] = ()) -> Response:
    extra = list(headers)
    if status == 429 and not any(k == b"retry-after" for k, _ in extra):
        extra.append((b"retry-after", b"1"))
    return Response(status, _JSON + extra, fmt.error_body(status, message))


def _not_json(body: bytes, exc: orjson.JSONDecodeError) -> str:
    """Why ``body`` is not a JSON request, in words: orjson calls any byte that is not UTF-8 a surrogate."""
    try:
        body.decode("utf-8")
    except UnicodeDecodeError as bad:
        return f"request body is not valid UTF-8 (byte {bad.start}: 0x{body[bad.start]:02x})"
    return f"request body is not valid JSON: {exc}"


def _overhead(request: Request, upstream_s: float, exchange: Exchange | None) -> float:
    """The proxy overhead of ``request`` until now, in seconds: its time since its body was whole less
    ``upstream_s`` (seconds waiting for the upstream) and its supervisor model calls' time."""
    waited = upstream_s + (exchange.record.model.time_s if exchange is not None else 0.0)
    return max(0.0, request.since_body - waited)


def _ms(seconds: float) -> bytes:
    return b"%.3f" % (seconds * 1000)


def check_state(config: Config, store: Store | None, backend: StateBackend | None) -> tuple[bool, bool, bool]:
    """Check, without writing, the stores the enabled features need (in ``store``'s state directory, and the
    namespaces of ``backend``), and turn off each feature whose store cannot work, with one warning naming the path
    and why: the ledger (``store.ledger_off``: requests are then counted in memory only), condensing (its decisions
    and spill files), delegation (pool health and claim checks) and the sessions' stored supervision state; a
    dead-letter store that cannot work is only warned about (a dead letter not stored is said in the parent's
    error). Every store is optional: none of them is needed to relay an answer. Returns whether condensing,
    delegation and session states may run."""
    if store is None or backend is None:
        return True, True, True
    root = store.root

    def problem(feature: str, consequence: str, *stores: str | None) -> str | None:
        reason = next(filter(None, stores), None)
        if reason is not None:
            log.warning("state directory: %s is off (%s): %s", feature, consequence, reason)
        return reason

    store.ledger_off = problem("the ledger", "requests are counted in memory only, for /info",
                               unusable(root / "ledger"))
    condense = not (config.supervisor.condense.enabled and problem(
        "condensing", "tool results go upstream whole", backend.unusable(DecisionCache.NAMESPACE),
        unusable(root / "spill")))
    delegate = not (config.model_routing.enabled and problem(
        "delegation", "the model is offered no delegation tools", backend.unusable(HEALTH),
        backend.unusable(ClaimStore.NAMESPACE)))
    if config.model_routing.enabled and delegate:
        problem("keeping dead letters", "a hand-off that fails on every attempt is still reported to the model, but "
                "not kept for 'proxyvisor delegate --dead-letters'", unusable(root / "dead_letters", "cache.db", advise=True))
    states = not problem("stored session state", "a restart starts every session afresh",
                         backend.unusable(SESSIONS))
    return condense, delegate, states


class Pipeline:
    """The proxy's request handler (a :data:`proxyvisor.proxy.server.Handler`).

    ``relays`` maps each configured upstream's name to its :class:`HttpRelay`. ``store`` is None when nothing
    may be written. ``translator`` serves formats no upstream speaks (see ``proxyvisor.proxy.translate``).
    ``routes`` gives each supervised request its supervisor model call (``proxyvisor.proxy.session_model``; None:
    the session's own route with ``[supervisor.model]``). ``backend`` holds the shared state (pool health, claim
    checks, condense decisions, sessions' supervision state; ``proxyvisor.adapters.state``); by default a diskcache
    in ``store``'s state directory.
    """

    def __init__(self, config: Config, relays: dict[str, HttpRelay], store: Store | None,
                 translator: Any = None, clock: Any = time.monotonic, routes: SupervisorRoutes | None = None,
                 backend: StateBackend | None = None) -> None:
        self.config = config
        self.relays = relays
        self.store = store
        self.translator = translator
        self.clock = clock
        self.sessions = SessionTable(config.state.session_idle_s, config.state.max_sessions)
        self.bodies = BodyCache()
        self.stopped = False
        """The proxy stops (:meth:`stop`)."""
        self.cut = Cut()
        """Ends, at :meth:`stop`, the waits of streams held while proxyvisor works (``Exchange.cut``)."""
        if backend is None and store is not None:
            backend = DiskBackend(store.root)
        self.backend = backend
        condense, delegate, states = check_state(config, store, backend)
        self.supervisor = Supervisor(config.supervisor, request_condenser(
            config.supervisor, store.root if store is not None and condense else None, backend))
        self.states = SessionStates(backend.kv(SESSIONS, **SESSION_SETTINGS), config.state.session_ttl_s) \
            if backend is not None and states and self.supervised else None
        """The sessions' stored supervision state (``proxyvisor.proxy.session_state``); None: memory only."""
        self.save_after = self.states is not None and self.states.kv.local
        """Whether a request's session state is stored after the client has the whole answer (its response's
        ``after`` step) rather than before: when the store is this machine's (no replica reads it before the
        client's next request; this process reads it only for a session it does not hold, and after
        :meth:`settle`)."""
        self._unsaved: dict[str, Session] = {}
        """The sessions whose state waits for the end of a response to be stored, by id (:meth:`_persisted`)."""
        self.sharing: Sharing | None = None
        """What the replicas on one Redis share besides the key-value state: ledger lines, conversation links
        (``proxyvisor.proxy.sharing``); None: not on Redis."""
        if isinstance(backend, RedisBackend) and store is not None and self.supervised:
            share = RedisShare(backend, config.state.session_ttl_s, config.state.session_idle_s)
            store.shared = share  # every reader of the ledgers reads the replicas' lines
            self.sharing = Sharing(share)
            self.sessions.conversations.on_keep = self.sharing.link
        self.routes = routes or SupervisorRoutes(config.supervisor.model)
        # Both gates (seed 000): with either off, nothing of delegation exists, so nothing can be spent or written.
        self.telemetry = telemetry.tracing(config.telemetry) if self.supervised else None
        self.delegation = ProxyDelegation(config, store.root if store is not None else None,
                                          self.telemetry, backend) \
            if config.supervisor.enabled and config.model_routing.enabled and delegate else None
        self.authorizer = Authorizer(config.supervisor.authorizer)
        self.learning = Learning(config.supervisor.learning, memory_store(
            config.supervisor.learning, store.root if store is not None and self.supervised else None, backend),
                                 self.supervisor.mutating_tools)
        self.sessions.on_end = self._ended
        self.breakers = breakers_for(config, backend if store is not None else None)
        self.web = WebView(config, self.sessions, store if self.supervised else None, self.clock, backend,
                           self.states)
        self.background: trio.Nursery | None = None
        """A nursery for work that outlives one step of a response stream (``proxyvisor.proxy.continuation``);
        set by ``proxyvisor.proxy.service.running``."""
        self.started = time.time()
        if self.supervised:
            # Condensing's, the memory recall's and the gate digest's encoding first: a session's first request
            # may count with it before it is forwarded; the usage estimate's only at an answer's end.
            tokenizers.warm(condense_text.encoding, estimate.encoding)

    def stop(self) -> None:
        """The proxy stops (its shutdown grace ran out: ``RunningProxy.drain``; or the ``running`` block exits, as
        ``wrap``'s does when its agent ends): each stream still relaying ends with the format's error event and
        status 503 at its next piece, or at once when it waits for its upstream's next piece or is held while
        proxyvisor works (a verdict of the verify-gate: ``Exchange.cut``); what is cut before its end is recorded as
        cut by the proxy's stop, not as a client that left."""
        self.stopped = True
        self.cut.cut()
        for relay in self.relays.values():
            relay.cut.cut()

    def close(self) -> None:
        """End the sessions' learning (``proxyvisor.proxy.learning``) and release what the pipeline holds open
        (the delegation state stores, the ledger files kept open)."""
        self.background = None  # cancelled by now: the sessions' last saves are made here, one after the other
        for session in self.sessions.all():
            self._end_learning(session)
        if self.delegation is not None:
            self.delegation.close()
        if self.breakers is not None:
            self.breakers.close()
        self.web.close()
        if self.telemetry is not None:
            self.telemetry.close()
        if self.backend is not None:
            self.backend.close()
        if self.store is not None:
            self.store.close()

    def _ended(self, session: Session) -> None:
        """The session left the session table (idle, or the oldest beyond its bound): its ledger file closed, its
        learning ended."""
        if self.store is not None:
            self.store.release(session.id)
        if self.learning.on:
            self._end_learning(session)

    def _end_learning(self, session: Session) -> None:
        """The session ended (evicted, ``wrap``'s agent exited, the proxy stopping): its learning's last distill,
        saved in the background (an eviction happens on the event loop, in a request). A failure is logged, never
        raised."""
        try:
            self.learning.end(session, self.background)
        except Exception:  # noqa: BLE001 - learning must never cost a request or the shutdown
            log.exception("distilling the end of session %s failed", session.id)

    @property
    def supervised(self) -> bool:
        return self.config.supervisor.enabled

    async def __call__(self, request: Request) -> Response:
        try:
            response = await self._route(request)
        except Exception as exc:  # noqa: BLE001 - the last line of defence: answer, log, keep serving
            log.exception("internal error on %s %s", request.method, request.path)
            response = error(format_for_path(request.path), 500, f"proxyvisor internal error "
                             f"({type(exc).__name__}); see the proxyvisor log")
        if not any(name == OVERHEAD_HEADER for name, _ in response.headers):
            # An answer proxyvisor made itself (an error, health) spent all its time here. A new list: the
            # headers may be a shared constant.
            response.headers = response.headers + [(OVERHEAD_HEADER, _ms(request.since_body))]
        return response

    async def _route(self, request: Request) -> Response:
        try:
            prefix = split_prefix(request.path)
        except InvalidSession as exc:
            return error(format_for_path(request.path), 400, str(exc))
        path = prefix.path
        if request.too_slow:
            return error(_format_for(path), 408, "request body not received in time: a body must arrive whole "
                         f"within {self.config.proxy.request_body_deadline_s:g} s ([proxy] request_body_deadline_s)")
        if path == "/" and request.method in ("HEAD", "GET"):
            return Response(200, _JSON, orjson.dumps({"name": "proxyvisor", "status": "ok"}))
        if path == "/healthz" and request.method in ("GET", "HEAD"):
            return Response(200, _JSON, orjson.dumps({"status": "ok", "sessions": len(self.sessions),
                                                      "supervision": self.supervised}))
        if path in ("/", "/healthz"):
            return error(_format_for(path), 405, f"{path} takes GET", ALLOW_GET)
        if (shown := web.page(request.method, path)) is not None:  # static, holding no data (proxyvisor.proxy.web)
            return shown
        fmt = _format_for(path)
        token = self.config.proxy.auth_token
        if token and not request.header_is(AUTH_HEADER, token):
            return error(fmt, 401, f"the '{AUTH_HEADER}' header does not hold this proxy's auth_token"
                         if request.header(AUTH_HEADER) else
                         f"proxyvisor requires the '{AUTH_HEADER}' header on this address")
        model_format = BY_PATH.get(path)
        if model_format is not None:
            if request.method != "POST":
                if "websocket" in (request.header("upgrade") or "").lower():
                    # Codex (0.171.0) first asks for the Responses API over a WebSocket. 426 is the one answer it
                    # takes as "plain HTTP only" and falls back at once, for the whole session (codex-rs
                    # core/src/client.rs: `UPGRADE_REQUIRED => FallbackToHttp`); any other status it retries 5
                    # times with backoff, about 6 s, first (both observed). No Upgrade header: the only protocol
                    # on offer, HTTP, is the one in use.
                    log.info("refused a WebSocket upgrade on %s (426): the client falls back to POST", path)
                    return error(fmt, 426, f"proxyvisor serves {path} over HTTP only: POST it; WebSocket "
                                           "upgrade refused")
                return error(fmt, 405, f"{path} takes POST", ALLOW_POST)
            return await self._model(request, model_format, prefix)
        if path == "/v1/models":
            if request.method not in ("GET", "HEAD"):
                return error(fmt, 405, f"{path} takes GET", ALLOW_GET)
            return await self._forward_plain(request, "chat", path, fmt)
        if path == "/v1/messages/count_tokens":
            if request.method != "POST":
                return error(fmt, 405, f"{path} takes POST", ALLOW_POST)
            return await self._forward_plain(request, "messages", path, fmt)
        if path == "/proxyvisor/delegate":
            if request.method != "POST":
                return error(fmt, 405, f"{path} takes POST", ALLOW_POST)
            if self.delegation is None:
                return error(fmt, 409, "delegation is off: it needs supervision on and [model_routing] enabled = true "
                                       "(proxyvisor routing enable)")
            if bad := self._check_body(request, fmt):
                return bad
            return await self.delegation.endpoint(request)
        admin = self.config.proxy.admin_token
        if path.startswith(("/proxyvisor/sessions", web.API)):
            await self.settle()  # they read a stored state of a session no longer in memory (its plan)
        if path.startswith("/proxyvisor/sessions"):
            return await commands.endpoint(request.method, path, self.sessions, self.store, self.clock(),
                                           request.header_is(ADMIN_HEADER, admin) if admin else None, self.states)
        if path.startswith(web.API):
            return await self.web.api(request.method, path, request.header_is(ADMIN_HEADER, admin) if admin else None)
        return error(fmt, 404, f"no such endpoint: {request.method} {path}. proxyvisor serves POST "
                               "/v1/chat/completions, /v1/messages, /v1/responses, /v1/messages/count_tokens, "
                               "/proxyvisor/delegate, GET /v1/models, /proxyvisor/sessions[/{id}/info|plan], "
                               "/proxyvisor/ui (the web view) and /healthz")

    def _target(self, request: Request, path: str) -> str:
        return path + ("?" + request.query if request.query else "")

    def _check_body(self, request: Request, fmt: WireFormat) -> Response | None:
        if request.too_large:
            return error(fmt, 413, f"request body exceeds the limit of {self.config.proxy.max_body_bytes} bytes "
                                   "([proxy] max_body_bytes)")
        ctype = (request.header("content-type") or "application/json").split(";")[0].strip().lower()
        if ctype != "application/json" and not ctype.endswith("+json"):
            return error(fmt, 415, f"content-type must be application/json, got {ctype!r}")
        return None

    def _decoded(self, request: Request, coding: str) -> Request:
        """``request`` with its body's content coding undone, for a path that reads the body (supervised or
        translated): what goes upstream is then proxyvisor's own serialisation, sent without a coding. The byte
        relay forwards a coded body as it came.

        Raises:
            UndecodableBody: an unknown coding, data invalid for it, or more than ``[proxy] max_body_bytes``.
        """
        content = decode(request.body, coding, self.config.proxy.max_body_bytes)
        return dataclasses.replace(request, content=content,
                                   headers=[(k, v) for k, v in request.headers if k != b"content-encoding"])

    async def _forward_plain(self, request: Request, fmt_name: str, path: str, fmt: WireFormat) -> Response:
        if request.method == "POST" and (bad := self._check_body(request, fmt)):
            return bad
        upstream, _native = self.config.upstream_for(fmt_name)
        relay = self.relays[upstream.name]
        try:
            reply = await relay.send(request.method, self._target(request, path),
                                     upstream_headers(request.headers, relay.api_key, _key_header(fmt_name)),
                                     request.content)
        except UpstreamError as exc:
            return error(fmt, exc.status, exc.message)
        assert isinstance(reply.body, bytes)
        return Response(reply.status, reply.headers, reply.body, reply.reason)

    # ---- model requests ------------------------------------------------------------------------------------
    async def _model(self, request: Request, fmt: WireFormat, prefix: Prefix) -> Response:
        if bad := self._check_body(request, fmt):
            return bad
        path = prefix.path
        upstream, native = self.config.upstream_for(fmt.name)
        if not self.supervised and native:
            return await self._relay(request, fmt, prefix, upstream.name, None, self._counted(prefix))
        if (coding := request.header("content-encoding")) and coding.strip().lower() not in ("", "identity"):
            try:
                request = self._decoded(request, coding)
            except UndecodableBody as exc:
                return error(fmt, 415, f"request body in content-encoding {coding!r} cannot be read: {exc}; "
                                       "send it uncompressed, or in gzip, deflate or br")
        try:
            # Supervised, a body that extends an earlier one is read from its new bytes only.
            body = self.bodies.loads(fmt.history_field, fmt.name, request.body) if self.supervised \
                else wirejson.loads(request.body)
        except orjson.JSONDecodeError as exc:
            return error(fmt, 400, _not_json(request.body, exc))
        if not isinstance(body, dict):
            return error(fmt, 400, f"request body must be a JSON object, got {json_kind(body)}")
        try:
            if self.sharing is not None and explicit_id(prefix.session, request.header, fmt, body,
                                                        prefix.run) is None:
                await self._shared_links(fmt, body)
            session_id, source = identify(prefix.session, request.header, fmt, body, self.sessions.conversations,
                                          self.clock(), prefix.run)
        except InvalidSession as exc:
            return error(fmt, 400, str(exc))
        session = self.sessions.touch(session_id, self.clock(), prefix.run) if self.supervised \
            else self._counted(prefix)
        exchange = None
        if self.supervised:
            assert session is not None  # touched above
            session.identified = source
            if self.states is not None:  # the session as the replica that served it last left it (/plan too)
                try:
                    await self.settle(session.id)  # an answer of its whose state is not stored yet (another connection)
                    await self.states.load(session)
                except trio.Cancelled:
                    # Its line, but no save: what this process holds may be older than the state it was reading.
                    await self._cut(session, fmt, body, request, prefix.run, None, save=False)
                    raise
            if command := commands.command_of(fmt, body):
                return await self._command(request, fmt, body, session, command, prefix.run)
            commands.strip_exchanges(fmt, body)
        try:
            if self.supervised:
                assert session is not None  # touched above
                # The steps before forwarding take their time: a history read from the start in steps
                # (Supervisor.catch_up), condensing's and the planner's model calls.
                try:
                    exchange = await self._supervise(session, fmt, body, request.header("traceparent"),
                                                     self._sender(request, fmt, path, upstream, native))
                    if exchange is not None:
                        await exchange.before_forward()
                except trio.Cancelled:
                    await self._cut(session, fmt, body, request, prefix.run, exchange)
                    raise
            if not native:
                if self.translator is None:  # answered here, so accounted here
                    message = f"no upstream speaks {fmt.label} and translation is unavailable"
                    self._account(session, fmt, body, request, prefix.run, 501, Usage(),
                                  _overhead(request, 0.0, exchange), message, exchange)
                    return error(fmt, 501, message)
                return await self._translate(request, fmt, prefix, upstream, body, session, exchange)
            return await self._relay(request, fmt, prefix, upstream.name, body, session, exchange)
        except BaseException:
            # Failed (or cut: its ledger line closed it already, and closing again does nothing).
            if exchange is not None:
                exchange.close()
            raise

    async def _shared_links(self, fmt: WireFormat, body: dict[str, Any]) -> None:
        """A request of a client that sends no session id: the conversation links the other replicas recorded for
        its latest history items, taken into this replica's table (one ``MGET``; none when the latest answer in
        the history was delivered here), so the request continues the session whichever replica served the one
        before."""
        assert self.sharing is not None
        conversations = self.sessions.conversations
        if keys := conversations.wanted(fmt, body, self.clock()):
            conversations.learn(await self.sharing.lookup(keys), self.clock())

    def _counted(self, prefix: Prefix) -> Session | None:
        """With supervision off, the in-memory session that counts a request under a session or run prefix (the
        session, else the run's own; None without either): requests, errors and overhead only, as nothing of the
        request or reply is read."""
        session_id = prefix.session or prefix.run
        return self.sessions.touch(session_id, self.clock(), prefix.run) if session_id else None

    async def _command(self, request: Request, fmt: WireFormat, body: dict[str, Any], session: Session,
                       command: str, run: str | None) -> Response:
        """Answer ``/plan`` or ``/info`` without the model (``proxyvisor.proxy.commands``) for a request that came
        through ``run``; one ledger line. A ledger that cannot be read is a 500 in the client's format naming the
        file."""
        status, failure = 200, None
        try:
            response = await commands.answer(command, fmt, body, session, self.store, self.clock(), run)
        except LedgerError as exc:
            status, failure = 500, str(exc)
            response = error(fmt, status, f"proxyvisor {command}: {exc}")
        except trio.Cancelled:  # cut while the ledger was read
            await self._cut(session, fmt, body, request, run, None, save=False, local=command)
            raise
        self._account(session, fmt, body, request, run, status, Usage(0, 0), request.since_body,
                      failure, local=command)
        return response

    def _sender(self, request: Request, fmt: WireFormat, path: str, upstream: Any,
                native: bool) -> tuple[Send, Any, list[str], bool]:
        """How a supervised request's further bodies (continued turns, supervisor model calls) go upstream: the
        way the request itself goes (relayed with its headers, or translated), under the breaker of the pool
        they name on that upstream (no fallback: a body is bound to its route), as (send, upstream config, the
        credentials it carries, whether it is translated). So a cooling pool gets none of them, and their
        429s and 5xx cool it as the agent's own do."""
        relay = self.relays[upstream.name]
        secrets = secrets_of(request.headers, relay.api_key)
        if not native:
            async def send(new: dict[str, Any]) -> UpstreamReply:
                reply: UpstreamReply = await self.translator.send(fmt, upstream, new, request.headers)
                return reply
        else:
            headers = self._headers(request, fmt, relay, True)
            target = self._target(request, path)

            async def send(new: dict[str, Any]) -> UpstreamReply:
                return await relay.send("POST", target, headers, wirejson.dumps(new))

        breakers = self.breakers
        if breakers is None or upstream.name not in breakers.upstreams:
            return send, upstream, secrets, not native

        async def guarded(new: dict[str, Any]) -> UpstreamReply:
            model = new.get("model")
            return await breakers.send(fmt, model if isinstance(model, str) else "", upstream.name,
                                       lambda _target: send(new), Dispatch(), fallbacks=False)

        return guarded, upstream, secrets, not native

    @staticmethod
    def _headers(request: Request, fmt: WireFormat, relay: HttpRelay, supervised: bool) -> Headers:
        return upstream_headers(request.headers, relay.api_key, _key_header(fmt.name), accept_identity=supervised)

    async def _supervise(self, session: Session, fmt: WireFormat, body: dict[str, Any],
                         traceparent: str | None, sender: tuple[Send, Any, list[str], bool]) -> Exchange | None:
        """The supervised path's hook (``proxyvisor.proxy.supervise``): rewrites ``body`` for upstream (but for
        its steps that need I/O, such as condensing: the caller runs ``Exchange.before_forward``; the delegation
        tools, ``proxyvisor.proxy.delegation``) and returns the exchange that rewrites the reply. A failure in it is logged and the request goes up
        unsupervised. ``traceparent``: the client's W3C trace context, which delegated children join;
        ``sender``: :meth:`_sender`, the request's route, which its supervisor model calls take too."""
        try:
            send, upstream, secrets, translated = sender
            reading = await self.supervisor.catch_up(session, fmt, body)
            model, route = self.routes.for_request(fmt, body, send, upstream, secrets, translated)
            exchange = self.supervisor.begin(session, fmt, body, model, route, reading)
            exchange.secrets = secrets
            self.learning.begin(session, exchange, self.background)
            if exchange.model is not None:
                exchange.model = _timed(exchange.model, exchange.record.model, self.telemetry is not None)
            exchange.send = send
            exchange.cut = self.cut
            if self.delegation is not None or self.telemetry is not None:
                exchange.trace = child_traceparent(traceparent)
            if self.delegation is not None:
                exchange.delegation = self.delegation.turn(exchange)
        except Exception:  # noqa: BLE001 - supervision must never cost the agent its request
            log.exception("supervision failed for session %s; forwarding the request unsupervised", session.id)
            return None
        return exchange

    async def _relay(self, request: Request, fmt: WireFormat, prefix: Prefix, upstream_name: str,
                     body: dict[str, Any] | None, session: Session | None,
                     exchange: Exchange | None = None) -> Response:
        content = request.content  # as it arrived: an unsupervised body goes up without a copy
        if exchange is not None:
            try:
                content = exchange.upstream_chunks()
            except TypeError as exc:  # nested past what wirejson writes (it reads 1024 levels): go up as received
                log.warning("cannot serialise the supervised body of session %s (%s); forwarding it unsupervised",
                            session.id if session else "-", exc)
                exchange = None

        # The call, not awaited yet (no closure: this is the disabled path's too).
        path = prefix.path
        sent = self._relayed(request, fmt, path, upstream_name, content) if self.breakers is None or body is None \
            else self._upstream(request, fmt, path, upstream_name, body, content, exchange)
        return await self._answered(request, fmt, prefix.run, body, session, exchange, sent)

    async def _translate(self, request: Request, fmt: WireFormat, prefix: Prefix, upstream: Any,
                         body: dict[str, Any], session: Session | None, exchange: Exchange | None = None) -> Response:
        sent = self.translator.send(fmt, upstream, body, request.headers) if self.breakers is None \
            else self._upstream(request, fmt, prefix.path, upstream.name, body, None, exchange)
        return await self._answered(request, fmt, prefix.run, body, session, exchange, sent)

    async def _answered(self, request: Request, fmt: WireFormat, run: str | None, body: dict[str, Any] | None,
                        session: Session | None, exchange: Exchange | None,
                        sent: Awaitable[UpstreamReply]) -> Response:
        """The response to a model request that came through ``run`` (its ``/r/{run}/`` prefix, split as it
        arrived; None: none) whose upstream call is ``sent``: its reply through ``exchange``'s stages
        (a continued turn, the verify-gate, the tool authorizer), its session's state stored (:meth:`_persisted`).
        Its one ledger line says how it ended: the answer (:meth:`_respond`, or a stream's end), an upstream error,
        or a cut before the answer, upstream or in a stage (the verify-gate's verdict awaited): the client's
        leaving, or the proxy's stop (:meth:`_cut`; a stream cut later is accounted at its end). The proxy's stop
        (:meth:`stop`) cuts a wait in a stage at once (the upstream's wait is its relay's to cut), and the client,
        still there, gets a 503 in its format, as a stream gets its error event."""
        stages: trio.CancelScope | None = None  # a scope costs 4.5 us: none on the byte relay's path
        try:
            reply = await sent
            if exchange is not None:
                with trio.CancelScope() as stages:
                    reply = await self.cut.during(stages, self._staged(exchange, reply))
        except UpstreamError as exc:
            self._account(session, fmt, body, request, run, exc.status, Usage(), 0.0, exc.message, exchange)
            return error(fmt, exc.status, exc.message)
        except trio.Cancelled:
            await self._cut(session, fmt, body, request, run, exchange)
            raise
        if stages is not None and stages.cancelled_caught:
            await self._cut(session, fmt, body, request, run, exchange)
            return error(fmt, 503, _STOPPED)
        return await self._persisted(await self._respond(request, fmt, run, reply, body, session, exchange), session)

    async def _staged(self, exchange: Exchange, reply: UpstreamReply) -> UpstreamReply:
        """``reply`` through ``exchange``'s stages: a continued turn, the verify-gate, the tool authorizer."""
        return exchange.reply(await self._authorized(exchange, await self._gated(
            exchange, await self._continued(exchange, reply))))

    async def _cut(self, session: Session | None, fmt: WireFormat, body: dict[str, Any] | None, request: Request,
                   run: str | None, exchange: Exchange | None, save: bool = True, local: str | None = None) -> None:
        """Record a request cut off before its answer (in a step before forwarding, upstream, or in a stage on the
        reply; ``local``: a command proxyvisor answers itself): by the client's leaving, or by the proxy's stop;
        and, with ``save``, store its session's state as the cut left it, shielded, as a stream's end does
        (:meth:`_persist`): a save another request of the session made meanwhile may hold the request's thread
        mid-way (a gate waiting for its verdict), which a restart or another replica would restore."""
        self._account(session, fmt, body, request, run, 503 if self.stopped else 499, Usage(), 0.0,
                      _STOPPED if self.stopped else _CANCELLED, exchange, local=local)
        if save and session is not None and self.supervised:
            with trio.CancelScope(shield=True):
                await self._persist(session)

    async def _upstream(self, request: Request, fmt: WireFormat, path: str, upstream: str, body: dict[str, Any],
                        content: bytes | tuple[bytes, ...] | None, exchange: Exchange | None) -> UpstreamReply:
        """The agent's supervised request under the breakers of the upstream named ``upstream`` and its fallbacks
        (``proxyvisor.proxy.breakers``), whose account goes to ``exchange``'s ledger line: each upstream tried is
        relayed to (``content``: the bytes to send, else ``body``'s JSON) when it speaks ``fmt``, else translated.

        Raises:
            UpstreamError: as ``HttpRelay.send``.
        """
        assert self.breakers is not None  # the callers send straight up without them

        async def send(target: UpstreamConfig) -> UpstreamReply:
            if fmt.name not in target.formats:
                reply: UpstreamReply = await self.translator.send(fmt, target, body, request.headers)
                return reply
            return await self._relayed(request, fmt, path, target.name,
                                       content if content is not None else wirejson.dumps(body))

        model = body.get("model")
        dispatch = Dispatch()
        try:
            return await self.breakers.send(fmt, model if isinstance(model, str) else "", upstream, send, dispatch)
        finally:
            if exchange is not None and dispatch.attempts:
                exchange.record.upstream = dispatch.evidence()

    async def _relayed(self, request: Request, fmt: WireFormat, path: str, upstream: str,
                       content: bytes | tuple[bytes, ...]) -> UpstreamReply:
        """``content`` relayed to the upstream named ``upstream`` with the request's headers."""
        relay = self.relays[upstream]
        return await relay.send("POST", self._target(request, path),
                                self._headers(request, fmt, relay, self.supervised), content)

    async def _continued(self, exchange: Exchange, reply: UpstreamReply) -> UpstreamReply:
        """``reply``, or, when the model called delegation tools, the turn continued upstream after the children
        ran (``proxyvisor.proxy.continuation``), through ``exchange.send``."""
        if exchange.delegation is None:
            return reply
        assert exchange.send is not None  # set with the delegation turn (_supervise)
        return await exchange.delegation.continuation(exchange.send, self.background).reply(reply)

    async def _authorized(self, exchange: Exchange, reply: UpstreamReply) -> UpstreamReply:
        """``reply``, or, when it makes tool calls a prohibition the user stated in force could concern, what the
        tool authorizer makes of it (``proxyvisor.proxy.authorizing``). Outside the gate: a tool call the gate's
        continued turn makes is checked too, and an answer a turn continued after a block gives is gated."""

        async def gated(continued: UpstreamReply) -> UpstreamReply:
            return await self._gated(exchange, continued)

        stage = self.authorizer.turn(exchange, self.background, gated)
        return reply if stage is None else await stage.reply(reply)

    async def _gated(self, exchange: Exchange, reply: UpstreamReply) -> UpstreamReply:
        """``reply``, or, when it ends the agent's turn, what the verify-gate makes of it
        (``proxyvisor.proxy.gating``)."""
        gate = self.config.supervisor.gate
        if not eligible(exchange, gate):
            return reply
        assert exchange.send is not None  # set before the request went up (_supervise)
        return await Gating(exchange, gate, exchange.send, self.supervisor.mutating_tools,
                            self.background).reply(reply)

    async def _respond(self, request: Request, fmt: WireFormat, run: str | None, reply: UpstreamReply,
                       body: dict[str, Any] | None, session: Session | None,
                       exchange: Exchange | None = None) -> Response:
        overhead = _overhead(request, reply.upstream_s, exchange)
        headers = reply.headers + [(OVERHEAD_HEADER, _ms(overhead))]
        if not reply.streaming:
            assert isinstance(reply.body, bytes)
            if session is not None:
                usage = Usage()
                model = None
                if reply.status < 400 and self.supervised:
                    try:
                        answer = reply.json()
                        model = telemetry.response_model(answer) if self.telemetry is not None else None
                        turn = fmt.parse_response(answer)
                        reported = self._ledger_usage(fmt, fmt.usage(answer))
                        usage = await estimate.completed_off_loop(reported, fmt, body, turn)
                        self._delivered(session, fmt, body, turn)
                    except (orjson.JSONDecodeError, AttributeError, TypeError):
                        pass
                self._account(session, fmt, body, request, run, reply.status, usage, overhead, exchange=exchange,
                              response_model=model)
            return Response(reply.status, headers, reply.body, reply.reason)
        stream = self._stream(request, fmt, run, reply, body, session, overhead, exchange)
        # Started up to its first yield (an empty piece): an async generator closed before it started runs none of
        # its code, and the server closes the body of a response whose head could not go out (the client gone as
        # the answer began), which would leave the request with no ledger line, its state not stored.
        await stream.asend(None)
        return Response(reply.status, headers, stream, reply.reason)

    async def _stream(self, request: Request, fmt: WireFormat, run: str | None, reply: UpstreamReply,
                      body: dict[str, Any] | None, session: Session | None, overhead: float,
                      exchange: Exchange | None = None) -> AsyncGenerator[bytes, None]:
        assert not isinstance(reply.body, bytes)
        stream = Encoded(reply.body) if isinstance(reply.body, ReplyStream) else reply.body
        usage = Usage()
        events: list[tuple[str | None, str]] = []
        kept = unread = 0

        def read_usage(name: str | None, data: str) -> None:
            nonlocal kept, unread
            found = _event_usage(fmt, name, data)
            if found:
                usage.add(found)
            # The answer, should the stream report no usage (its own data strings); an event past the cap is only
            # counted: reading a big one again at the end would cost what relaying it did.
            if kept + len(data) <= _KEPT_FOR_ESTIMATE:
                events.append((name, data))
                kept += len(data)
            else:
                unread += len(data)

        parser = None
        edited = stream.edited if isinstance(stream, Encoded) else None
        if edited is not None:
            edited.observe = read_usage  # the stripper reads every event already: read usage there, not twice
        elif session is not None and self.supervised:
            parser = SSEParser()
        failure: UpstreamError | None = None
        last = b""
        numbered = b""  # the last chunk with an event in it: a Responses error event is numbered after it
        ended = False
        limit = self.config.proxy.max_stream_s
        deadline = trio.current_time() + limit if limit > 0 else math.inf
        final = b""  # the head of the stream's last event that is not a comment (what decides it ended whole)
        growing = False  # ... and that event may still be coming in
        chunks = aiter(stream)
        try:
            yield b""  # (_respond starts the stream here: closed from now on, its end below runs)
            async for chunk in chunks:
                # Checked per piece, not with a cancel scope per wait (which cost ~10 us a piece): a stream kept
                # alive by pings ends at the first piece past the deadline, and a silent one at idle_timeout_s.
                if trio.current_time() > deadline or self.stopped:
                    failure = UpstreamError(503, STOPPED_MID_STREAM) if self.stopped else \
                        UpstreamError(504, f"stream exceeded {limit:g} s ([proxy] max_stream_s)")
                    await close(chunks)  # the upstream's connection is closed, not left to the collector
                    break
                if parser is not None:
                    try:
                        parsed = await off_loop(feed_cost(parser.pending(), chunk), parser.feed, chunk)
                    except EventTooLarge as exc:
                        # Only the usage is read from a stream relayed as it comes: the client loses nothing.
                        parsed, parser = exc.complete, None
                        log.warning("stream usage not read past an event over %d bytes", exc.limit)
                    for event in parsed:
                        read_usage(event.event, event.data)
                yield chunk
                if fmt.stream_end:
                    start = last_event_start(chunk)
                    if start < 0 and (not last or at_event_end(last)):
                        start = 0  # the chunk holds one event from its first byte
                    if start >= 0:
                        growing = chunk[start:start + 1] != b":"
                        final = chunk[start:start + _HEAD] if growing else final
                    elif growing and len(final) < _HEAD:
                        final += chunk[:_HEAD - len(final)]
                last = chunk if len(chunk) > 3 else last[-3:] + chunk
                if chunk[:1] != b":" or b"data:" in chunk:  # not a keep-alive comment (": ping")
                    numbered = chunk
            failure = failure or getattr(stream, "error", None)
            mid_event = bool(last) and not at_event_end(last)
            if failure is None and mid_event:
                # A clean end of the body in the middle of an event (an upstream framing the stream by closing
                # the connection): SDKs drop an unfinished event silently, so the client would take a cut-short
                # answer for a complete one.
                failure = UpstreamError(502, "upstream stream ended in the middle of an event")
            elif failure is None and fmt.stream_end and not fmt.ends_stream(final) and reply.status < 400:
                # Between events, but the last is not one that ends the format's stream: the SDKs would return
                # what came as a whole answer.
                failure = UpstreamError(502, "upstream stream ended before its last event")
            if failure is not None:
                log.warning("%s stream of session %s ended early: %s", fmt.label, session.id if session else "-",
                            failure.message)
                # Blank lines first: the error must not join the unfinished event's last line.
                yield (b"\n\n" if mid_event else b"") + fmt.stream_error(failure.status, failure.message, numbered)
            ended = True
        finally:
            # Closed before the stream's end is accounted for and saved: a stage cut short (the verify-gate's held
            # verdict) leaves the thread as its clean-up says, not waiting on (GatedStream), and the upstream
            # connection goes back now, not when the collector finds it.
            await close(chunks)
            if session is not None:
                message = failure.message if failure else None if ended else \
                    "the proxy stopped mid-stream" if self.stopped else "client disconnected mid-stream"
                turn, shown = None, None
                # Unsupervised, nothing of the stream was read: there is no answer to estimate or record.
                if reply.status < 400 and self.supervised:
                    usage = self._ledger_usage(fmt, usage)
                    # The answer is assembled again only when something needs it: an output count the stream did
                    # not report, or the conversation of a session known by its history (_delivered).
                    if usage.output_tokens is None or session.identified == "hash":
                        with trio.CancelScope(shield=True):  # a big answer is read off the loop, even at a disconnect
                            turn, shown = await off_loop(kept, _answer, fmt, events, edited is not None)
                    usage = await estimate.completed_off_loop(usage, fmt, body, turn, unread)
                self._account(session, fmt, body, request, run, reply.status if failure is None else failure.status,
                              usage, overhead, message, exchange, response_model=telemetry.response_model(
                                  event_object(events[0][1])) if self.telemetry is not None and events else None)
                self._delivered(session, fmt, body, shown)
                if self.save_after:
                    self._unsaved[session.id] = session  # stored after the stream's end (_persisted)
                else:
                    with trio.CancelScope(shield=True):  # before the stream's end reaches the client
                        await self._persist(session)

    async def _persisted(self, response: Response, session: Session | None) -> Response:
        """``response``, the answer of a request of ``session``, with its state stored as :meth:`_persist` says:
        a JSON answer's now, or, with :attr:`save_after`, once the client has the whole answer (``response.after``:
        :meth:`settle`); a stream's as it ends (:meth:`_stream`), and then in its ``after`` step too."""
        if session is None:
            return response
        if self.save_after:
            if isinstance(response.body, bytes):
                self._unsaved[session.id] = session
            response.after = functools.partial(self.settle, session.id)
        elif isinstance(response.body, bytes):
            await self._persist(session)
        return response

    async def settle(self, session_id: str | None = None) -> None:
        """Store the states waiting for the end of a response (:attr:`save_after`): session ``session_id``'s, or
        every one. Awaited by each response's ``after`` step, before this process reads a stored state (a
        request's :meth:`SessionStates.load`, the session endpoints and the web view) and as the proxy stops, so
        that nothing in this process reads a state older than the one it holds."""
        if not self._unsaved:
            return
        if session_id is None:
            sessions, self._unsaved = list(self._unsaved.values()), {}
        else:
            sessions = [found] if (found := self._unsaved.pop(session_id, None)) is not None else []
        for session in sessions:
            await self._persist(session)

    async def _persist(self, session: Session) -> None:
        """Store the session's supervision state (``proxyvisor.proxy.session_state``) once the request's answer
        is through, with the ledger lines and conversation links to share (``proxyvisor.proxy.sharing``): before
        the client has all of it, so its next request, on any replica, finds it; or, with :attr:`save_after` (a
        local store, nothing shared), right after (:meth:`_persisted`); a request cut off before its answer, at
        once (:meth:`_cut`). A backend that hangs
        costs a request at most its timeouts (``proxyvisor.adapters.state``); the state then stays in memory."""
        if self.states is not None and self.sharing is not None:
            async with trio.open_nursery() as both:  # two worker threads, two round trips at once
                both.start_soon(self.states.save, session)
                both.start_soon(self.sharing.flush)
        elif self.states is not None:
            await self.states.save(session)
        elif self.sharing is not None:
            await self.sharing.flush()

    def _delivered(self, session: Session, fmt: WireFormat, body: dict[str, Any] | None,
                   turn: AssistantTurn | None) -> None:
        """Record ``turn``, the answer the client got, with the conversation of a session identified by it
        (``SessionTable.conversations``), so that the client's next request, which carries it, finds the session."""
        if turn is not None and body is not None and session.identified == "hash":
            self.sessions.conversations.answered(fmt, body, session.id, turn.text,
                                                 [call.id for call in turn.tool_calls], self.clock())

    def _ledger_usage(self, fmt: WireFormat, usage: Usage) -> Usage:
        """``usage`` as the ledger takes it: the built-in scripted model reports 0 for the counts its script does
        not set (a client prices what it is told, and no model ran), so a 0 of its is left to the estimate."""
        if not self.config.upstream_for(fmt.name)[0].scripted:
            return usage
        return Usage(usage.input_tokens or None, usage.output_tokens or None)

    def _account(self, session: Session | None, fmt: WireFormat, body: dict[str, Any] | None, request: Request,
                 run: str | None, status: int, usage: Usage, overhead_s: float, failure: str | None = None,
                 exchange: Exchange | None = None, local: str | None = None,
                 response_model: str | None = None) -> None:
        """Count the request, which came through ``run`` (its ``/r/{run}/`` prefix as :meth:`_route` split it;
        None: none), in its session and write its ledger line: with the delegations it ran and what
        supervision did (``proxyvisor.proxy.info.ledger_fields``), or, for ``local``, the command proxyvisor
        answered itself (``proxyvisor.proxy.commands``; not counted as a model request). With tracing on, the
        same record makes the request's spans (``proxyvisor.proxy.telemetry``; ``response_model``: the model the
        answer names). The request is over: its exchange is closed (``Exchange.close``)."""
        if session is None:
            return
        if exchange is not None:
            exchange.close()
        if local is None:
            session.requests += 1
            session.formats.add(fmt.name)
            session.input_tokens += usage.input_tokens or 0
            session.output_tokens += usage.output_tokens or 0
            session.overhead_ms += overhead_s * 1000
            if status >= 400:
                session.errors += 1
        if not self.supervised or (self.store is None and self.telemetry is None):
            return
        record: dict[str, Any] = {
            "time": datetime.now(timezone.utc).isoformat(timespec="milliseconds"),
            "format": fmt.name,
            "model": model_name(body.get("model")) if body else None,
            **({"agent": agent} if (agent := agent_of(request.header("user-agent"))) else {}),
            "stream": bool(body.get("stream")) if body else None,
            "status": status,
            "input_tokens": usage.input_tokens,
            "output_tokens": usage.output_tokens,
            **({"usage_estimated": True} if usage.estimated else {}),
            "latency_ms": round((time.perf_counter() - request.received_at) * 1000, 3),
            "overhead_ms": round(overhead_s * 1000, 3),
        }
        if run is not None:
            record["run"] = run
        if local is None and self.config.upstream_for(fmt.name)[0].scripted:
            record["scripted"] = True
        if failure:
            record["error"] = failure
        if exchange is not None and exchange.delegation is not None and exchange.delegation.results:
            record["delegations"] = exchange.delegation.results
        if local is not None:
            record["local"] = local
        elif exchange is not None:
            self._learn(session, exchange)  # first: what it stores and asks goes in the record
            record.update(ledger_fields(exchange.record, exchange.tail is not None and exchange.tail.role == "tool"))
        elif body is not None:
            record["tool_round"] = fmt.ends_with_tool_result(body)
        if self.telemetry is not None:
            self._trace(record, session, request, exchange, response_model)
        if self.store is None:
            return
        if self.store.append_ledger(session.id, record):
            self.web.feed.publish(session.id, record)
        else:
            session.unrecorded += 1
        if self.sharing is not None:
            self.sharing.line(session, record)
            if self.background is not None:  # sent now also on the paths that do not persist (errors, commands)
                self.background.start_soon(self.sharing.flush)

    def _trace(self, record: dict[str, Any], session: Session, request: Request, exchange: Exchange | None,
               response_model: str | None) -> None:
        """Export the spans of the request whose ledger line is ``record`` (``proxyvisor.proxy.telemetry``); a
        supervisor model call that ends later (learning's distill) is exported as it ends, under the same span."""
        tracing = self.telemetry
        assert tracing is not None  # the caller checked
        parent = request.header("traceparent")
        use = exchange.record.model if exchange is not None else None
        turn = exchange.delegation if exchange is not None else None
        trace = exchange.trace if exchange is not None and exchange.trace else child_traceparent(parent)
        tracing.request(
            record, session_id=session.id, trace=trace, parent=parent, start_ns=telemetry.wall_ns(request.received_at),
            end_ns=time.time_ns(), response_model=response_model, model_route=use.route if use else None,
            model_calls=[_call_span(t) for t in (use.timeline if use else ())],
            delegations=[telemetry.DelegationSpan(result, start, end) for result, (start, end)
                         in zip(turn.results, turn.times)] if turn is not None else ())
        if use is not None:
            route, provider = use.route, telemetry.provider_name(record["format"])
            use.late = lambda timed: tracing.model_call(_call_span(timed, "distill"), trace, provider, route)

    def _learn(self, session: Session, exchange: Exchange) -> None:
        """Hand the finished ``exchange`` to learning (credit, distill); a failure is logged, never raised."""
        try:
            self.learning.ended(session, exchange, exchange.secrets, self.background)
        except Exception:  # noqa: BLE001 - learning must never cost the agent its answer
            log.exception("learning from a request of session %s failed", session.id)


def _timed(call: ModelCall, use: ModelUse, traced: bool = True) -> ModelCall:
    """``call``, adding to ``use.time_s`` the wall time during which at least one of its calls was under way
    (concurrent calls count once), which the proxy overhead leaves out, and, when ``traced``, each call's times to
    ``use.timeline`` (the trace's spans)."""
    busy = 0
    since = 0.0

    async def timed(messages: list[dict[str, str]]) -> ModelAnswer:
        nonlocal busy, since
        if busy == 0:
            since = time.perf_counter()
        busy += 1
        start, answer, failure = time.time_ns(), None, "Cancelled"
        try:
            answer = await call(messages)
            return answer
        except Exception as exc:
            failure = type(exc).__name__
            raise
        finally:
            busy -= 1
            if busy == 0:
                use.time_s += time.perf_counter() - since
            if traced:
                timed = ModelCallTime(start, time.time_ns(), answer, None if answer else failure)
                use.timeline.append(timed)
                if use.late is not None:
                    use.late(timed)

    return timed


def _call_span(timed: ModelCallTime, purpose: str = "") -> telemetry.ModelCallSpan:
    """The span of a supervisor model call; ``purpose`` when it was not recorded with one."""
    answer = timed.answer
    return telemetry.ModelCallSpan(timed.start_ns, timed.end_ns, timed.purpose or purpose,
                                   answer.input_tokens if answer else None, answer.output_tokens if answer else None,
                                   timed.error)


def _key_header(fmt_name: str) -> bytes:
    """Where a configured key goes: Anthropic's ``x-api-key`` for its endpoints, else ``authorization``."""
    return b"x-api-key" if fmt_name == "messages" else b"authorization"


def _assembled(fmt: WireFormat, events: list[tuple[str | None, str]]) -> Any:
    """The answer streamed in ``events`` (an ``AssistantTurn``), or None when they do not assemble into one."""
    try:
        return fmt.assemble(events)
    except Exception as exc:  # noqa: BLE001 - a stream cut anywhere: no estimate rather than a lost ledger line
        log.debug("cannot assemble the streamed answer for a usage estimate (%s)", type(exc).__name__)
        return None


def _answer(fmt: WireFormat, events: list[tuple[str | None, str]],
            edited: bool) -> tuple[AssistantTurn | None, AssistantTurn | None]:
    """(the answer streamed in ``events``, the answer as the client got it) (:func:`_assembled`); with
    ``edited`` the events are the upstream's and the client got their text without the self-report."""
    turn = _assembled(fmt, events)
    if turn is None or not edited:
        return turn, turn
    return turn, dataclasses.replace(turn, text=strip(turn.text)[0])


def _event_usage(fmt: WireFormat, name: str | None, data: str) -> Usage | None:
    obj = event_object(data) if bigtext.contains(data, '"usage"') else None
    return fmt.stream_usage(name, obj) if obj is not None else None
