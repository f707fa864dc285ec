"""Session identity and the bounded in-memory session table.

Identity, first match wins (DESIGN.md, "Sessions"):

1. the path prefix ``/s/{session}/v1/...`` (what ``proxyvisor wrap --session NAME`` hands the agent);
2. the header ``x-proxyvisor-session``;
3. the client's own ids: ``X-Claude-Code-Session-Id``, ``session-id`` (Codex), ``x-session-id`` (opencode);
4. ids in the body: Anthropic ``metadata.user_id`` (Claude Code's JSON string gives its ``session_id``), OpenAI
   ``user``, Responses ``prompt_cache_key``;
5. the run prefix ``/r/{run}/v1/...`` (what ``proxyvisor wrap`` hands the agent): a request of a run that names
   no session of its own belongs to session ``{run}``. The run is recorded whatever the session (each ledger line's
   ``run``, and :meth:`SessionTable.sessions_of`), so a client that resumes its own session in another run (``claude
   --resume``: the same session id) goes on in that session, and each run can still tell its own requests;
   ``/r/{run}/s/{session}/...`` records the run and forces the session;
6. the conversation: a client that sends no id (aider, the SDKs) sends its whole history with every request, so
   a request whose history extends (or repeats) the history of a live session's earlier request belongs to that
   session, and so does one whose history holds an answer proxyvisor delivered to that session (its tool-call
   ids, or its text: a client that reorders its history, such as aider moving the chat files after the turns
   done, extends no earlier request but carries the answers it got) (:class:`Conversations`). One whose history
   continues no live session starts a new one (with a new id, ``h-`` and 24 hex digits). Two runs of a harness
   with the same system prompt and canned example messages are two sessions; the system prompt alone never
   identifies one. A request repeated exactly (a client's retry) stays in its session.

Ids from paths (runs too) and headers must match :data:`SESSION_ID` (letters, digits, ``.``, ``_``, ``-``; at most 128
characters); anything else is refused, so an id can never walk out of the state directory. An id taken from a
body is used as it is when it matches :data:`SESSION_ID`, and hashed otherwise (never refused).
"""

from __future__ import annotations

import functools
import hashlib
import re
from collections import OrderedDict
from dataclasses import dataclass, field
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

from ..store import SESSION_ID
from .formats import WireFormat
from .formats.base import derived, keep_scan, resumed
from ..transcript import Message, fingerprint

if TYPE_CHECKING:  # supervision imports this module
    from .supervise import SessionSupervision

_PREFIX = re.compile(r"^(?:/r/([^/]*))?(?:/s/([^/]*))?(/.*)?$")
_OURS = "x-proxyvisor-session"
_HEADERS = (_OURS, "x-claude-code-session-id", "session-id", "x-session-id")
_ENDS_PER_SESSION = 16
"""Conversation links kept per session of the table's bound: the history ends of a session's recent requests (for
clients that retry or branch from an earlier point) and the keys of the answers it was delivered."""
SESSIONS_PER_RUN = 64
"""Sessions a run's requests went to that :meth:`SessionTable.sessions_of` names, the least recently used dropped
first (an agent's subagents with threads of their own are a few)."""


class InvalidSession(ValueError):
    """A session or run id from the path or a header is not a valid id; the message says what is allowed."""


class Prefix(NamedTuple):
    """A request path's session and run prefixes (module docstring, 1 and 5) and the path without them."""

    session: str | None
    """From ``/s/{session}/``: the session, forced."""
    path: str
    run: str | None = None
    """From ``/r/{run}/``: the run the request came through."""


UNVERSIONED = {path.removeprefix("/v1"): path for path in (
    "/v1/chat/completions", "/v1/messages", "/v1/messages/count_tokens", "/v1/responses", "/v1/models")}
"""The model API's paths as a client whose base URL lacks the API version sends them, each to the path it means.
The AI SDK's providers (opencode's) take ``ANTHROPIC_BASE_URL`` as ending in ``/v1`` and append ``/messages``,
where Anthropic's SDKs and Claude Code append ``/v1/messages`` to the same variable: under ``wrap``, which sets it
for both, each gets the API it asks for."""


@functools.lru_cache(maxsize=64)
def split_prefix(path: str) -> Prefix:
    """The prefix of ``path``: ``/r/{run}/``, ``/s/{session}/`` or both, in that order, each optional, and the path
    after it, a model API path sent without its version made whole (:data:`UNVERSIONED`). Read once
    per request, as it arrives (the proxy passes the result down); kept for the 64 paths seen last (each at most a
    request head's size): an agent's requests repeat a few, and a hit (60-75 ns) costs a fraction of a split
    (0.4 us without a prefix, 1.3-1.6 us with a run's).

    Raises:
        InvalidSession: a run or session id is present but not valid.
    """
    match = _prefixed(path)
    if match is None:
        return Prefix(None, UNVERSIONED.get(path, path))
    run, session, rest = match.groups()
    for kind, value in (("run", run), ("session", session)):
        if value is not None and not SESSION_ID.match(value):
            raise InvalidSession(f"invalid {kind} id in path: use 1-128 of [A-Za-z0-9._-], starting with a letter "
                                 "or digit")
    return Prefix(session, UNVERSIONED.get(rest, rest) if rest else "/", run)


def unprefixed(path: str) -> str:
    """``path`` without its run and session prefixes, their ids valid or not, as :func:`split_prefix` reads it."""
    match = _prefixed(path)
    rest = path if match is None else match.group(3) or "/"
    return UNVERSIONED.get(rest, rest)


def _prefixed(path: str) -> re.Match[str] | None:
    # (skipped for a path with no prefix: the common one under serve)
    return _PREFIX.match(path) if path.startswith(("/r/", "/s/")) else None


def _hashed(kind: str, value: str) -> str:
    return kind + "-" + hashlib.sha256(value.encode("utf-8", "surrogatepass")).hexdigest()[:24]


def identify(path_session: str | None, header: Any, fmt: WireFormat, body: dict[str, Any],
             conversations: Conversations | None = None, now: float = 0.0,
             run: str | None = None) -> tuple[str, str]:
    """(session id, where it came from: ``path``, ``header:NAME``, ``body``, ``run`` or ``hash``).

    ``header`` is a callable ``name -> str | None``; ``run`` the request's run prefix (:class:`Prefix`). ``conversations`` holds the live conversations of clients
    that send no id (the hash fallback; without it, every such request starts a new session) and records this
    request's history in them; ``now`` is seconds on its clock.

    A client's own session header (Claude Code's, Codex's, opencode's) holding a value that is not a valid id is
    hashed into one (it is the client's format, not a request to proxyvisor); ``x-proxyvisor-session`` and the
    path prefix are proxyvisor's own and must be valid.

    Raises:
        InvalidSession: ``x-proxyvisor-session`` holds an invalid id.
    """
    explicit = explicit_id(path_session, header, fmt, body, run)
    if explicit is not None:
        return explicit
    return (conversations or Conversations(0.0, 1)).session_for(fmt, body, now), "hash"


def explicit_id(path_session: str | None, header: Any, fmt: WireFormat, body: dict[str, Any],
                run: str | None = None) -> tuple[str, str] | None:
    """:func:`identify`'s answer when the request names its session (the path, a header, the body) or came through
    a run (module docstring, 1-5); None when only its conversation can tell (6).

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
    return (run, "run") if run else None


class Conversations:
    """Which session a request of a client that sends no id continues, from its history (module docstring, 5).

    Two kinds of link are kept, each with its session and the time it was last used:

    - history ends: a request's history is read as a hash chain (a seed of the format and the system prompt, then
      one link per history item, :func:`~proxyvisor.transcript.fingerprint`: role, ids, lengths, start and end of
      each text; not ``cache_control`` marks, which clients move), and the chain's end of each request is kept;
    - answers (:meth:`answered`): the tool-call ids of an answer delivered to the session, and a digest of its
      text without whitespace (so a client's trimming or re-joining of text parts does not matter). An answer
      text that the request's own history already holds as an assistant message (a harness's canned example
      repeated by the model) is not kept: every run of that harness would carry it.

    A later request belongs to the session of the link nearest the end of its history: at each history item from
    the last back, the chain's link through that item, then the item's answer keys. A link older than ``idle_s``
    counts for nothing; so does an answer key that two sessions were delivered (a short stock answer such as
    "Done."), and the search goes on to earlier items. At most ``max_ends`` links are kept, the least recently
    used dropped first. Time is passed in (seconds on any monotonic clock), so this is testable without a clock.
    """

    def __init__(self, idle_s: float, max_ends: int) -> None:
        self.idle_s = idle_s
        self.max_ends = max_ends
        self._ends: OrderedDict[bytes, tuple[str | None, float]] = OrderedDict()
        """Link -> (session, last used); session None: an answer key delivered to two sessions."""
        self._started = 0
        self.on_keep: Callable[[bytes, str | None], None] | None = None
        """Called with each link recorded here (not those :meth:`learn` takes in): replicas share them
        (``proxyvisor.proxy.sharing``)."""

    def _steps(self, fmt: WireFormat, body: dict[str, Any]) -> tuple[bytes, list[Any], Callable[[int], _Step]]:
        seed = _seed(fmt.name, fmt.fingerprint_parts(body)[0])
        items = fmt.history(body)
        return seed, items, _chain(fmt, items, seed)

    def _search(self, items: list[Any], steps: Callable[[int], _Step], now: float) -> tuple[str | None, int]:
        """(the session of the live link nearest the end of the history, the index of its item); (None, the index
        of the last conversing item's predecessor) when none is."""
        for index in range(len(items) - 1, -1, -1):  # the links nearest the end first
            step = steps(index)
            if not step.conversing:
                return None, index  # only system messages from here back
            for key in (step.link, *step.keys):
                kept = self._ends.get(key)
                if kept is not None and kept[0] is not None and now - kept[1] <= self.idle_s:
                    return kept[0], index
        return None, -1

    def wanted(self, fmt: WireFormat, body: dict[str, Any], now: float) -> list[bytes]:
        """The links of the request ``body`` worth asking the other replicas about: those of the history items
        nearer its end than the nearest link known here (at most the last :data:`SHARED_ITEMS` items). None when a
        link is known here and no answer follows it in the history: the latest answer the client got was
        delivered here (or is known here), so this replica served the request before and no other one can know a
        nearer link. A link known here that is only an answer's text digest counts as none: another replica may
        have delivered the same text (a stock "Done.") to a session of its own, which makes it no one's."""
        _seed, items, steps = self._steps(fmt, body)
        session, found = self._search(items, steps, now)
        if session is not None and self._text_only(fmt, items[found], steps(found), now):
            found = -1
        later = [steps(index) for index in range(max(found + 1, len(items) - SHARED_ITEMS), len(items))]
        if session is not None and not any(step.keys for step in later):
            return []
        return [key for step in later if step.conversing for key in (step.link, *step.keys)]

    def _text_only(self, fmt: WireFormat, item: Any, step: _Step, now: float) -> bool:
        """Whether the one live link of history item ``item`` (at ``step``) known here is its text digest."""
        live = [key for key in (step.link, *step.keys)
                if (kept := self._ends.get(key)) is not None and kept[0] is not None and now - kept[1] <= self.idle_s]
        return len(live) == 1 and live == step.keys[-1:] and live[0] == _text_key(fmt.message(item).text)

    def learn(self, links: dict[bytes, str], now: float) -> None:
        """Take in ``links`` the other replicas recorded (key to session, ``""``: ambiguous), as used ``now``."""
        for key, session in links.items():
            self._ends[key] = (session or None, now)
            self._ends.move_to_end(key)
        self._bound()

    def session_for(self, fmt: WireFormat, body: dict[str, Any], now: float) -> str:
        """The session id of the request ``body`` in ``fmt``, and its history's end recorded for it."""
        seed, items, steps = self._steps(fmt, body)
        session, _index = self._search(items, steps, now)
        last = steps(len(items) - 1) if items else None
        if session is None:
            # Unique, not the history's hash: the same first request made again after idle_s (a harness run
            # twice with the same prompt) is another run.
            self._started += 1
            session = _hashed("h", f"{(last.link if last else seed).hex()}:{now!r}:{self._started}:{id(self)}")
        if last is not None and last.conversing:
            self._keep(last.link, session, now)
        return session

    def answered(self, fmt: WireFormat, body: dict[str, Any], session: str, text: str, call_ids: list[str],
                 now: float) -> None:
        """Record the answer delivered to ``session`` for the request ``body`` in ``fmt``: ``text`` as the client
        got it (self-report stripped) and the ids of its tool calls (the first :data:`_CALLS_PER_ANSWER` kept;
        one is enough to recognise the answer in a later history)."""
        keys = [_call_key(i) for i in dict.fromkeys(call_ids) if i][:_CALLS_PER_ANSWER]
        if (key := _text_key(text)) is not None and key not in _history_keys(fmt, fmt.history(body)):
            keys.append(key)
        for key in keys:
            kept = self._ends.get(key)
            if kept is not None and kept[0] != session and now - kept[1] <= self.idle_s:
                self._keep(key, None, now)  # delivered to two live sessions: identifies neither
            else:
                self._keep(key, session, now)

    def _keep(self, key: bytes, session: str | None, now: float) -> None:
        self._ends[key] = (session, now)
        self._ends.move_to_end(key)
        self._bound()
        if self.on_keep is not None:
            self.on_keep(key, session)

    def _bound(self) -> None:
        while len(self._ends) > self.max_ends:
            self._ends.popitem(last=False)


@functools.lru_cache(maxsize=32)
def _seed(format_name: str, system: str) -> bytes:
    """The start of the hash chain of a history in format ``format_name`` under system prompt ``system``. Kept for
    the prompts seen last: a session's requests repeat the same prompt, most often the very same string object
    (whose hash Python keeps), so finding it costs far less than hashing it again. The prompts are kept alive
    with it: at most 32."""
    return hashlib.blake2b(b"\x00".join([format_name.encode(), system.encode("utf-8", "surrogatepass")]),
                           digest_size=16).digest()


_CALLS_PER_ANSWER = 4
SHARED_ITEMS = 32
"""History items, from the end, whose links :meth:`Conversations.wanted` asks the other replicas about: a
request adds a few items to the one before it, which some replica recorded."""


def _call_key(call_id: str) -> bytes:
    return hashlib.blake2b(b"call\x00" + call_id.encode("utf-8", "surrogatepass"), digest_size=16).digest()


def _text_key(text: str) -> bytes | None:
    """The digest of ``text`` without any whitespace, or None for a text that is only whitespace."""
    digest = hashlib.blake2b(b"text\x00", digest_size=16)
    empty = True
    for start in range(0, len(text), _TEXT_SLICE):  # whitespace is dropped character by character: any cut works
        part = text[start:start + _TEXT_SLICE]
        bare = part.encode().translate(None, _ASCII_SPACE) if part.isascii() else \
            "".join(part.split()).encode("utf-8", "surrogatepass")
        if bare:
            empty = False
            digest.update(bare)
    return None if empty else digest.digest()


_TEXT_SLICE = 1024 * 1024
_ASCII_SPACE = bytes(c for c in range(128) if chr(c).isspace())
"""What ``str.split()`` splits an ASCII text at."""


@dataclass(frozen=True, slots=True)
class _Step:
    """A history item's place in the conversation's hash chain: the chain's ``link`` through it, whether the
    history holds more than system messages up to it (``conversing``), its answer keys; for the history at
    ``index`` in a chain started from ``seed``."""

    seed: bytes
    index: int
    link: bytes
    conversing: bool
    keys: list[bytes]


def _chain(fmt: WireFormat, items: list[Any], seed: bytes) -> Callable[[int], _Step]:
    """The chain steps of ``items`` from ``seed``, by position. Those of the items an earlier request of the same
    body lineage had (:class:`~.formats.base.Item`, kept on them for their place) are not computed again: the
    chain goes on from the last of them, so a request costs what is new in it."""
    start, resumed = len(items), None
    while start:
        kept = derived(items[start - 1])
        step = kept.get("chain") if kept is not None else None
        if isinstance(step, _Step) and step.seed == seed and step.index == start - 1:
            resumed = step
            break
        start -= 1
    link, conversing = (resumed.link, resumed.conversing) if resumed is not None else (seed, False)
    made: dict[int, _Step] = {}
    for index in range(start, len(items)):
        item = items[index]
        message = fmt.message(item)
        link = hashlib.blake2b(link + fingerprint(message), digest_size=16).digest()
        conversing = conversing or message.role != "system"
        made[index] = new = _Step(seed, index, link, conversing, _item_keys(fmt, item))
        if (kept := derived(item)) is not None:
            kept["chain"] = new

    def at(index: int) -> _Step:
        found = made.get(index)
        if found is None:
            found = derived(items[index])["chain"]  # type: ignore[index]
        return found

    return at


def _item_keys(fmt: WireFormat, item: Any) -> list[bytes]:
    """:func:`_answer_keys` of history item ``item``, kept on an :class:`~.formats.base.Item`."""
    kept = derived(item)
    keys: list[bytes] | None = kept.get("answer_keys") if kept is not None else None
    if keys is None:
        keys = _answer_keys(fmt.message(item))
        if kept is not None:
            kept["answer_keys"] = keys
    return keys


def _history_keys(fmt: WireFormat, items: list[Any]) -> set[bytes]:
    """The :func:`_item_keys` of all of history ``items``; a history that only grew since the last request is read
    from its new items on (:func:`~.formats.base.resumed`)."""
    start, found = resumed(items, "history_keys")
    keys: set[bytes] = found if found is not None else set()
    for item in items[start:]:
        keys.update(_item_keys(fmt, item))
    keep_scan(items, "history_keys", keys)
    return keys


def _answer_keys(message: Message) -> list[bytes]:
    """The answer keys of a history item: its tool-call ids and text digest when it is an assistant message."""
    if message.role != "assistant":
        return []
    keys = [_call_key(use.id) for use in message.tool_uses if use.id]
    if (key := _text_key(message.text)) is not None:
        keys.append(key)
    return keys


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
    unshared: int = 0
    """Ledger lines of the session written to this replica's file but not to the shared ledger (Redis down;
    ``proxyvisor.proxy.sharing``)."""
    formats: set[str] = field(default_factory=set)
    identified: str = ""
    """Where the id of the session's latest request came from (:func:`identify`'s source; ``hash``: from the
    conversation, so proxyvisor records the answers it delivers, :meth:`Conversations.answered`)."""
    supervision: SessionSupervision | None = None
    """Per-session supervisor state, made on first use."""
    learning: Any = None
    """Per-session learning state (``proxyvisor.proxy.learning.SessionLearning``), made on first use."""
    state_version: bytes = b""
    """The version of :attr:`supervision` this process last loaded or saved (``proxyvisor.proxy.session_state``);
    empty: none yet."""
    state_chunks: frozenset[bytes] = frozenset()
    """The receipt chunks that version refers to (their digests, each thread's end to end:
    ``session_state.Encoded.chunks``): a later save removes those it no longer does."""


class SessionTable:
    """Sessions by id, bounded: idle ones are evicted after ``idle_s`` and the least recently seen beyond ``max``.

    Time is passed in (``now``, seconds on any monotonic clock) so the table is testable without a clock.
    """

    def __init__(self, idle_s: float, max_sessions: int) -> None:
        self.idle_s = idle_s
        self.max_sessions = max_sessions
        self._sessions: dict[str, Session] = {}
        self.on_end: Callable[[Session], None] | None = None
        """Called with each session :meth:`evict` drops (its end: ``proxyvisor.proxy.learning``)."""
        self.conversations = Conversations(idle_s, _ENDS_PER_SESSION * max_sessions)
        """The live conversations of clients that send no session id (:func:`identify`)."""
        self._runs: OrderedDict[str, dict[str, None]] = OrderedDict()
        """Run -> the sessions its requests went to, least recently used first (runs likewise): at most
        ``max_sessions`` runs, kept apart from the sessions, whose eviction they outlive."""

    def __len__(self) -> int:
        return len(self._sessions)

    def get(self, session_id: str) -> Session | None:
        return self._sessions.get(session_id)

    def touch(self, session_id: str, now: float, run: str | None = None) -> Session:
        """The session ``session_id``, made if new, seen ``now``; a request of it came through ``run`` (None: no
        run), which :meth:`sessions_of` then names it for."""
        if run is not None:
            self._ran(run, session_id)
        session = self._sessions.pop(session_id, None)
        if session is None:
            session = Session(session_id, now, now)
        session.last_seen = now
        self._sessions[session_id] = session  # dict order = least recently seen first
        self.evict(now)
        return session

    def _ran(self, run: str, session_id: str) -> None:
        sessions = self._runs.setdefault(run, {})
        self._runs.move_to_end(run)
        sessions.pop(session_id, None)
        sessions[session_id] = None
        if len(sessions) > SESSIONS_PER_RUN:
            del sessions[next(iter(sessions))]
        while len(self._runs) > self.max_sessions:
            self._runs.popitem(last=False)

    def sessions_of(self, run: str) -> list[str]:
        """The sessions the requests of ``run`` went to (at most :data:`SESSIONS_PER_RUN`), the one its latest
        request went to last; empty for a run this table has not seen (or has dropped: at most ``max_sessions``
        runs are kept, the least recently used dropped first)."""
        return list(self._runs.get(run, ()))

    def evict(self, now: float) -> list[Session]:
        """Drop idle sessions and the oldest beyond the bound; returns what was dropped."""
        dropped = []
        for sid in list(self._sessions):
            s = self._sessions[sid]
            if now - s.last_seen > self.idle_s or len(self._sessions) > self.max_sessions:
                dropped.append(self._sessions.pop(sid))
            else:
                break
        if self.on_end is not None:
            for session in dropped:
                self.on_end(session)
        return dropped

    def all(self) -> list[Session]:
        return list(self._sessions.values())
