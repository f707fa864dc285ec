"""Session identity and the bounded in-memory session table.

Identity, first match wins (DESIGN.md, "Sessions"):

1. the path prefix ``/s/{session}/v1/...`` (what ``proxyvisor wrap`` hands the agent);
2. the header ``x-proxyvisor-session``;
3. the client's own ids: ``X-Claude-Code-Session-Id``, ``session-id`` (Codex), ``x-session-id`` (opencode);
4. ids in the body: Anthropic ``metadata.user_id`` (Claude Code's JSON string gives its ``session_id``), OpenAI
   ``user``, Responses ``prompt_cache_key``;
5. a hash of the system prompt and the first user message.

Ids from paths and headers must match :data:`SESSION_ID` (letters, digits, ``.``, ``_``, ``-``; at most 128
characters); anything else is refused, so an id can never walk out of the state directory. An id taken from a
body is used as it is when it matches :data:`SESSION_ID`, and hashed otherwise (never refused).
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from typing import Any

from .formats import WireFormat

SESSION_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}\Z")  # \Z: "$" would accept a trailing newline
_PREFIX = re.compile(r"^/s/([^/]*)(/.*)?$")
_OURS = "x-proxyvisor-session"
_HEADERS = (_OURS, "x-claude-code-session-id", "session-id", "x-session-id")


class InvalidSession(ValueError):
    """A session id from the path or a header is not a valid id; the message says what is allowed."""


def split_prefix(path: str) -> tuple[str | None, str]:
    """(session id from ``/s/{id}/...`` or None, the path without that prefix).

    Raises:
        InvalidSession: the prefix is present but the id is not valid.
    """
    match = _PREFIX.match(path)
    if not match:
        return None, path
    session, rest = match.group(1), match.group(2) or "/"
    if not SESSION_ID.match(session):
        raise InvalidSession("invalid session id in path: use 1-128 of [A-Za-z0-9._-], starting with a letter or digit")
    return session, rest


def _hashed(kind: str, value: str) -> str:
    return kind + "-" + hashlib.sha256(value.encode("utf-8", "surrogatepass")).hexdigest()[:24]


def identify(path_session: str | None, header: Any, fmt: WireFormat, body: dict[str, Any]) -> tuple[str, str]:
    """(session id, where it came from: ``path``, ``header:NAME``, ``body`` or ``hash``).

    ``header`` is a callable ``name -> str | None``.

    A client's own session header (Claude Code's, Codex's, opencode's) holding a value that is not a valid id is
    hashed into one (it is the client's format, not a request to proxyvisor); ``x-proxyvisor-session`` and the
    path prefix are proxyvisor's own and must be valid.

    Raises:
        InvalidSession: ``x-proxyvisor-session`` holds an invalid id.
    """
    if path_session:
        return path_session, "path"
    for name in _HEADERS:
        value = header(name)
        if value:
            if SESSION_ID.match(value):
                return value, "header:" + name
            if name == _OURS:
                raise InvalidSession(f"invalid session id in header {name}: use 1-128 of [A-Za-z0-9._-], "
                                     "starting with a letter or digit")
            # A client's own header (a timestamp, "sess:123") is its business: hashed, never refused.
            return _hashed("c", value), "header:" + name
    hint = fmt.session_hint(body)
    if hint:
        return (hint if SESSION_ID.match(hint) else _hashed("b", hint)), "body"
    system, first_user = fmt.fingerprint_parts(body)
    return _hashed("h", system + "\x00" + first_user), "hash"


@dataclass
class Session:
    """What proxyvisor keeps in memory about one agent session (more is added by the supervisor features)."""

    id: str
    created: float
    last_seen: float
    requests: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    errors: int = 0
    overhead_ms: float = 0.0
    unrecorded: int = 0
    """Requests of the session whose ledger line could not be written (``proxyvisor.store.Store.append_ledger``)."""
    formats: set[str] = field(default_factory=set)
    supervision: Any = None
    """Per-session supervisor state (``proxyvisor.proxy.supervise.SessionSupervision``), made on first use."""


class SessionTable:
    """Sessions by id, bounded: idle ones are evicted after ``idle_s`` and the least recently seen beyond ``max``.

    Time is passed in (``now``, seconds on any monotonic clock) so the table is testable without a clock.
    """

    def __init__(self, idle_s: float, max_sessions: int) -> None:
        self.idle_s = idle_s
        self.max_sessions = max_sessions
        self._sessions: dict[str, Session] = {}

    def __len__(self) -> int:
        return len(self._sessions)

    def get(self, session_id: str) -> Session | None:
        return self._sessions.get(session_id)

    def touch(self, session_id: str, now: float) -> Session:
        session = self._sessions.pop(session_id, None)
        if session is None:
            session = Session(session_id, now, now)
        session.last_seen = now
        self._sessions[session_id] = session  # dict order = least recently seen first
        self.evict(now)
        return session

    def evict(self, now: float) -> list[Session]:
        """Drop idle sessions and the oldest beyond the bound; returns what was dropped."""
        dropped = []
        for sid in list(self._sessions):
            s = self._sessions[sid]
            if now - s.last_seen > self.idle_s or len(self._sessions) > self.max_sessions:
                dropped.append(self._sessions.pop(sid))
            else:
                break
        return dropped

    def all(self) -> list[Session]:
        return list(self._sessions.values())
