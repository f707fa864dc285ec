"""``/plan`` and ``/info``: questions to proxyvisor that the agent's user types in the chat, and the session
endpoints that answer the same as JSON.

A model request whose **last user message** is exactly ``/plan`` or ``/info`` is answered by proxyvisor itself,
in the request's format, streamed or not, without calling the model (issue 4, "/plan and /info"; seed 003's
``commands/plan.rs`` and ``commands/info.rs``):

- "last user message": the history's last item that is not a system message (Claude Code puts one after the
  prompt) must be a user message, not tool results; its text, without the harness's
  ``<system-reminder>...</system-reminder>`` blocks (Claude Code sends its context as such a block in the same
  message) and surrounding whitespace, must be the command alone on its first line; what follows that line is
  text a harness appended (aider adds its format reminder to the user's message) and is ignored, so
  ``/info\n\nReply in this format...`` asks ``/info`` but ``/info please`` does not; of a message in several
  text parts, the last part with words of the user's own is read (the parts before it are earlier input a
  harness merged into the message: Claude Code resumed after answering ``/info`` itself);
- ``/info``: the session's counters, summed from its ledger (``proxyvisor.proxy.info``);
- ``/plan``: the plan of the request's thread with phase status (``proxyvisor.gate.plan.render_text``), or "no
  plan"; the user's prohibitions in force, each with the user turn that stated it (``- [turn 2] Do not run the
  tests.``; ``proxyvisor.proxy.planning``, "Standing prohibitions"), when there are any; and the retained critical
  knowledge: the ``carry`` items of the thread's latest valid self-report. The
  thread is the one the request's history belongs to, else the session's most recently used one (a new
  conversation asking ``/plan`` in the same session).

The answer reports zero usage (no model ran: a client that prices usage must see no cost) and is one ledger line
with ``"local": COMMAND``, status 200 and 0 tokens, which ``/info`` does not count as a model request. Earlier
command exchanges (the command message and the assistant message right after it) are removed from the history of every later request before supervision reads it (:func:`strip_exchanges`), so
the model never sees them; the agent keeps them in its own history. With supervision disabled (the byte relay)
nothing is parsed, so commands are not intercepted: the model gets them like any other message.

Agents that run slash commands themselves (Claude Code answers an unknown ``/info`` with "Unknown command"
without any request) need the command sent as a message, e.g. ``claude -p " /info"`` (a leading space reaches the
API verbatim, and is stripped here).

Endpoints (:func:`endpoint`), JSON, errors in the OpenAI error shape:

- ``GET /proxyvisor/sessions``: ``{"sessions": [{"id", "last_activity" (ISO 8601, UTC), "in_memory"}]}``, most
  recent first: the sessions with a ledger (on Redis, every replica's: the shared index) and those in memory;
- ``GET /proxyvisor/sessions/{id}/info``: :func:`proxyvisor.proxy.info.summarize` of the session's ledger plus
  ``session`` and ``live`` (the in-memory counters, None when the session is not in memory; ``unrecorded``: its
  requests whose ledger line could not be written; ``unshared``: its lines not written to the shared ledger; ``learning``: its project memory,
  ``proxyvisor.proxy.learning.SessionLearning.info``, when it has a scope) and ``only_this_replica`` (the
  replicas share their ledgers but Redis does not answer: the sum is this replica's lines only) and ``ledger_off``
  (the proxy writes no ledger: requests, errors, upstream tokens and overhead are the in-memory counts); a ledger
  that exists but cannot be read is a 500 naming the
  file (so is ``/info``, in the request's format);
- ``GET /proxyvisor/sessions/{id}/plan``: ``{"session", "plan": the plan as JSON or None, "prohibitions":
  [{"turn": int, "text": str}] (in force, oldest first), "carry": [str], "text": the /plan answer}``; of a
  session this process does not hold, from its stored state (on Redis: as the replica that served it left it).

The id of a run (``/r/{run}/``, what ``proxyvisor wrap`` hands the agent, and ``$PROXYVISOR_SESSION`` with it) that
this process served names the session its latest request went to (``SessionTable.sessions_of``): the agent's own
session when it names one (a resumed Claude Code session), else the run's. An unknown session is a 404, an invalid
id (``proxyvisor.store.SESSION_ID``) a 400.

Who may read what: the listing names every session, so it is the admin's: it needs ``[proxy] admin_token`` in
the ``x-proxyvisor-admin`` header (403 without it, and always when no admin token is configured). A session's
own endpoints need only its id: the id is a capability, known to whoever runs the session (``wrap`` makes its run
id 128 random bits), and nothing else a client can reach names it. A run id reveals only sessions its own requests
went to, which the run's holder named itself.
"""

from __future__ import annotations

import re
import time
from collections.abc import AsyncIterator
from datetime import datetime, timezone
from typing import Any

import orjson
import trio

from ..gate import plan as plans
from ..store import SESSION_ID, LedgerError, Store
from .formats import CHAT, AssistantTurn, WireFormat
from .formats.base import derived, has_non_text
from .info import info_object, render_text
from .learning import SessionLearning
from ..transcript import own_words
from .server import ALLOW_GET, Headers, Response
from .session_state import SessionStates
from .sessions import Session, SessionTable
from .supervise import SessionSupervision, Thread, thread_key

COMMANDS = ("/plan", "/info")
_JSON: Headers = [(b"content-type", b"application/json")]
_SSE: Headers = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
_PATH = re.compile(r"^/proxyvisor/sessions(?:/([^/]*)/(info|plan))?$")


def _command(text: str) -> str | None:
    """The command ``text`` (a user message's text) asks: the whole of its first line (module docstring)."""
    first = own_words(text).partition("\n")[0].strip()
    return first if first in COMMANDS else None


def _asked(item: dict[str, Any], text: str) -> str | None:
    """The command the user message ``item`` (its whole ``text``) asks. A message of several text parts asks what
    its last part with words of the user's own asks: the parts before it are earlier input the harness merged into
    the message (Claude Code resumed after running ``/info`` itself as an unknown command sends ``/info``, its
    ``<local-command-stdout>`` and the next prompt as parts of one message, and that prompt is what was asked)."""
    content = item.get("content")
    if isinstance(content, list):
        texts = [part["text"] for part in content if isinstance(part, dict) and isinstance(part.get("text"), str)]
        text = next((part for part in reversed(texts) if own_words(part)), "")
    return _command(text)


def command_of(fmt: WireFormat, body: dict[str, Any]) -> str | None:
    """The command (``/plan`` or ``/info``) that the request ``body`` in ``fmt`` asks, or None (module docstring).
    A Responses ``input`` given as a plain string is the user message."""
    raw = body.get(fmt.history_field)
    if isinstance(raw, str):
        return _command(raw)
    for item in reversed(fmt.history(body)):
        message = fmt.message(item)
        if message.role != "system":
            return _asked(item, message.text) if message.role == "user" and isinstance(item, dict) else None
    return None


def _is_command(fmt: WireFormat, item: Any) -> bool:
    """Whether history item ``item`` is a user message holding a command."""
    # A command is an object with role "user" and text content in all three formats (an Anthropic tool result is
    # a user message too, with a non-text part): only those are read further.
    if not (isinstance(item, dict) and item.get("role") == "user") or has_non_text(item.get("content")):
        return False
    message = fmt.message(item)
    return message.role == "user" and _asked(item, message.text) is not None


def strip_exchanges(fmt: WireFormat, body: dict[str, Any]) -> int:
    """Remove every command exchange from the history of ``body`` (in place): each user message that is a
    command, and the assistant message (text only) that follows it, system messages between them aside.
    Returns how many items were removed. Call it only when the request is not itself a command.

    Reads only the items new since an earlier request of the same body lineage (:class:`~.formats.base.Item`):
    what the items up to its last one drop is kept on that item, once no command among them waits for its
    answer."""
    items = fmt.history(body)
    start, drop = _stripped(items)
    settled = True  # no command among the items read waits for an item after them
    for index in range(start, len(items)):
        item = items[index]
        kept = derived(item)  # an item repeated from an earlier request: whether it is a command is kept on it
        command = kept.get("command") if kept is not None else None
        if command is None:
            command = _is_command(fmt, item)
            if kept is not None:
                kept["command"] = command
        if not command:
            continue
        drop.add(index)
        after = index + 1
        while after < len(items) and fmt.message(items[after]).role == "system":
            after += 1
        settled = after < len(items)
        if settled:
            answer = fmt.message(items[after])
            if answer.role == "assistant" and not answer.tool_uses:
                drop.add(after)
    if settled and items and (kept := derived(items[-1])) is not None:
        kept["strip"] = (len(items), frozenset(drop))
    if drop:
        body[fmt.history_field] = [item for index, item in enumerate(items) if index not in drop]
    return len(drop)


def _stripped(items: list[Any]) -> tuple[int, set[int]]:
    """(how many of ``items`` an earlier :func:`strip_exchanges` read, the positions it dropped among them): from
    the latest item that kept them at its own place (none: (0, nothing))."""
    for start in range(len(items), 0, -1):
        kept = derived(items[start - 1])
        found = kept.get("strip") if kept is not None else None
        if found is not None and found[0] == start:
            return start, set(found[1])
    return 0, set()


# ---- answers ---------------------------------------------------------------------------------------------------

def thread_for(session: Session | None, fmt: WireFormat | None = None,
               body: dict[str, Any] | None = None) -> Thread | None:
    """The supervision thread a request ``body`` belongs to (its system prompt and first user message), else the
    session's most recently used thread; None when the session has none. Does not change the threads' order."""
    state = session.supervision if session is not None else None
    if not isinstance(state, SessionSupervision) or not state.threads:
        return None
    if fmt is not None and body is not None:
        thread = state.threads.get(thread_key(fmt, fmt.fingerprint_parts(body)))
        if thread is not None:
            return thread
    return next(reversed(state.threads.values()))


def plan_json(session_id: str, session: Session | None, thread: Thread | None) -> dict[str, Any]:
    """The ``/plan`` answer as JSON (module docstring) for ``thread`` of ``session`` (None: not in memory)."""
    plan = thread.plan if thread is not None else None
    carry = list(thread.carry) if thread is not None else []
    rules = thread.planning.rules if thread is not None else ()
    lines = [plans.render_text(plan)]
    if session is None:
        lines.append("(A plan, the prohibitions and the retained knowledge live only in the memory of the proxy "
                     "that serves the session; this proxy does not hold them.)")
    if rules:
        lines += ["", "Prohibitions in force (verbatim, with the user turn that stated each):"]
        lines += [f"- [turn {r.turn}] {r.text}" for r in rules]
    if carry:
        lines += ["", "Retained critical knowledge (from the latest self-report):"] + [f"- {c}" for c in carry]
    return {"session": session_id,
            "plan": plans.as_json(plan) if plan is not None else None,
            "prohibitions": [{"turn": r.turn, "text": r.text} for r in rules],
            "carry": carry, "text": "\n".join(lines)}


async def stored_plan(session_id: str, states: SessionStates) -> dict[str, Any] | None:
    """The ``/plan`` object (:func:`plan_json`) of session ``session_id`` from the state stored by the process that
    served it last (``SessionStates.stored``); None when none is stored, or none that can be read."""
    stored = await states.stored(session_id)
    if stored is None:
        return None
    session = Session(session_id, 0.0, 0.0, supervision=stored)  # read only, never put in a table
    return plan_json(session_id, session, thread_for(session))


async def session_plan(session_id: str, session: Session | None, states: SessionStates | None) -> dict[str, Any]:
    """The ``/plan`` object (:func:`plan_json`) of session ``session_id``: from ``session`` when this process
    holds it (None: it does not), else from the state stored by the process that served it last (``states``; None:
    no state is stored)."""
    if session is None and states is not None and (plan := await stored_plan(session_id, states)) is not None:
        return plan
    return plan_json(session_id, session, thread_for(session))


def live(session: Session | None, clock: float) -> dict[str, Any] | None:
    """The in-memory counters of ``session`` (None when it is not in memory); ``clock`` is the table's now."""
    if session is None:
        return None
    out: dict[str, Any] = {"requests": session.requests, "errors": session.errors,
                           "input_tokens": session.input_tokens, "output_tokens": session.output_tokens,
                           "overhead_ms": round(session.overhead_ms, 3), "formats": sorted(session.formats),
                           "unrecorded": session.unrecorded, "unshared": session.unshared,
                           "idle_s": round(max(0.0, clock - session.last_seen), 3)}
    state = session.supervision
    if isinstance(state, SessionSupervision):
        thread = thread_for(session)
        out.update(threads=len(state.threads), state=thread.state if thread else None,
                   self_reports=dict(state.reports), fires=dict(state.signals), steers=dict(state.notes))
    if isinstance(session.learning, SessionLearning) and session.learning.scope is not None:
        out["learning"] = session.learning.info()
    return out


async def info_json(store: Store | None, session_id: str, session: Session | None, clock: float,
                    run: str | None = None) -> dict[str, Any]:
    """The ``/info`` object of a session: its ledger summed (off the event loop: the ledger and the cost map are
    read from disk), with ``session`` and ``live`` (:func:`proxyvisor.proxy.info.info_object`); ``run``: the run
    of the ``/info`` request asking, whose line is not in the ledger yet (None: none, or an endpoint asking).

    Raises:
        LedgerError: the session's ledger exists but cannot be read.
    """
    counters = live(session, clock)
    off = store is None or store.ledger_off is not None

    def read() -> dict[str, Any]:
        lines, only_here = store.ledger(session_id) if store is not None else ([], False)
        return info_object(session_id, lines, counters, only_here, run, ledger_off=off)
    return await trio.to_thread.run_sync(read)


async def answer(command: str, fmt: WireFormat, body: dict[str, Any], session: Session, store: Store | None,
                 clock: float, run: str | None = None) -> Response:
    """The local answer to ``command`` for a request ``body`` in ``fmt`` that came through ``run`` (its
    ``/r/{run}/`` prefix; None: none): the format's response, streamed when the request asks for a stream. Its
    own ledger line is written after it: ``/info`` counts its run (:func:`info_json`), not the request."""
    if command == "/info":
        text = render_text(await info_json(store, session.id, session, clock, run))
    else:
        stripped = dict(body)
        strip_exchanges(fmt, stripped)
        text = plan_json(session.id, session, thread_for(session, fmt, stripped))["text"]
    model = body["model"] if isinstance(body.get("model"), str) else "proxyvisor"
    turn = AssistantTurn(text, input_tokens=0, output_tokens=0)  # no model ran: a client must not price it
    if not body.get("stream"):
        return Response(200, list(_JSON), orjson.dumps(fmt.render(turn, model)))
    return Response(200, list(_SSE), _play(fmt.render_stream(turn, model, body)))


async def _play(events: list[bytes]) -> AsyncIterator[bytes]:
    for event in events:
        yield event


# ---- endpoints -------------------------------------------------------------------------------------------------

def _error(status: int, message: str, headers: Headers | None = None) -> Response:
    return Response(status, [*_JSON, *(headers or [])], CHAT.error_body(status, message))


def _iso(wall: float) -> str:
    return datetime.fromtimestamp(wall, timezone.utc).isoformat(timespec="milliseconds")


async def recent(store: Store | None) -> list[tuple[str, float]]:
    """The sessions with a ledger, each with the wall time of its last line, most recent first
    (:meth:`~proxyvisor.store.Store.recent`: the shared index and the local files), read off the event loop."""
    return await trio.to_thread.run_sync(store.recent) if store is not None else []


async def _known(store: Store | None, session_id: str) -> bool:
    """Whether the session has a ledger, here or shared (off the event loop)."""
    return store is not None and await trio.to_thread.run_sync(store.known, session_id)


def sessions_json(table: SessionTable, ledgers: list[tuple[str, float]], clock: float) -> dict[str, Any]:
    """``GET /proxyvisor/sessions`` (module docstring) of the sessions with a ledger (:func:`recent`) and those in
    ``table``."""
    wall_now = time.time()
    seen = dict(ledgers)
    in_memory = set()
    for session in table.all():
        in_memory.add(session.id)
        # Its ledger's time when it has one (written with each request): derived from the clocks, the value would
        # move by the time between two samples from one listing to the next.
        seen.setdefault(session.id, wall_now - (clock - session.last_seen))
    ordered = sorted(seen.items(), key=lambda kv: kv[1], reverse=True)
    return {"sessions": [{"id": sid, "last_activity": _iso(wall), "in_memory": sid in in_memory}
                         for sid, wall in ordered]}


async def endpoint(method: str, path: str, table: SessionTable, store: Store | None, clock: float,
                   admin: bool | None, states: SessionStates | None = None) -> Response:
    """Answer a request for ``/proxyvisor/sessions...`` (module docstring); ``clock`` is the table's now; ``admin``
    whether the request carries the admin token (None: no admin token is configured); ``states`` the sessions'
    stored supervision states (None: none are stored)."""
    match = _PATH.match(path)
    if match is None:
        return _error(404, f"no such endpoint: {path}. Use GET /proxyvisor/sessions, "
                           "/proxyvisor/sessions/{id}/info or /proxyvisor/sessions/{id}/plan")
    if method not in ("GET", "HEAD"):
        return _error(405, f"{path} takes GET", ALLOW_GET)
    session_id, what = match.groups()
    if session_id is None:
        if not admin:
            return _error(403, "the session listing needs the admin token: "
                          + ("send [proxy] admin_token in the x-proxyvisor-admin header" if admin is False else
                             "set [proxy] admin_token in the proxy's configuration and send it in x-proxyvisor-admin")
                          + "; a session's own /proxyvisor/sessions/ID/info and /plan need only its id")
        return Response(200, list(_JSON), orjson.dumps(sessions_json(table, await recent(store), clock)))
    if not SESSION_ID.match(session_id):
        return _error(400, "invalid session id: use 1-128 of [A-Za-z0-9._-], starting with a letter or digit")
    if ran := table.sessions_of(session_id):
        session_id = ran[-1]
    session = table.get(session_id)
    if session is None and not await _known(store, session_id):
        return _error(404, f"no session {session_id!r}: it is neither in memory nor in the ledger")
    if what == "info":
        try:
            body = await info_json(store, session_id, session, clock)
        except LedgerError as exc:
            return _error(500, str(exc))
    else:
        body = await session_plan(session_id, session, states)
    return Response(200, list(_JSON), orjson.dumps(body))
