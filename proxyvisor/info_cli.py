"""Command line of ``proxyvisor info`` and ``proxyvisor plan`` (registered by cli.py).

Both ask the running proxy first (``GET /proxyvisor/sessions...``, ``proxyvisor.proxy.commands``) and, when none
answers, both read the state directory themselves: ``info`` sums the session's ledger (``proxyvisor.proxy.info``),
``plan`` reads the session's stored supervision state (``proxyvisor.proxy.session_state``), and exits 1 when none
is stored. Exit codes: :data:`_INFO_EXIT` and
:data:`_PLAN_EXIT`. :func:`session_info` and :func:`session_plan` are those answers for any caller (``proxyvisor
mcp`` too), without printing.
"""

from __future__ import annotations

import argparse
import functools
import http.client
import sys
import textwrap
import urllib.parse
from collections.abc import Callable
from typing import Any

import orjson

from .cli import _FILES, session_id_arg
from .config import Config

_TIMEOUT_S = 5.0
"""How long to wait for the proxy (seconds) to connect and for each read of its answer."""

_ASKED = """\
where the answer comes from:
  First the proxy at --url, else http://[proxy] host:port of the configuration (default
  http://127.0.0.1:8377; a wildcard host is asked on loopback, with [proxy] auth_token sent
  as x-proxyvisor-auth and [proxy] admin_token as x-proxyvisor-admin when set). A proxy run by
  'proxyvisor wrap' listens on a random port, printed nowhere: ask it with --url.
"""
_INFO_FALLBACK = """\
  When no proxy answers there, the state directory ([state] dir, --state-dir, else
  $PROXYVISOR_STATE_DIR, else ~/.local/state/proxyvisor) is read directly: its
  ledger/SESSION.jsonl holds one line per request, which is all /info needs (a wrapped agent's
  ledger is written as it works, so no --url is needed for it either).
"""
_PLAN_FALLBACK = """\
  When no proxy answers there, the session's supervision state stored in the state directory
  ([state] dir, --state-dir, else $PROXYVISOR_STATE_DIR, else ~/.local/state/proxyvisor: its
  sessions/ store; with [state] backend = "redis", Redis) is read directly: the proxy stores it
  as the session works, so a wrap that has ended needs no --url. With no state stored for the
  session, plan exits 1.
"""
_SESSION = """\
SESSION:
  A session id as 'wrap --session', the /s/SESSION/ prefix or the agent's own header set it
  (or a wrap run's id, $PROXYVISOR_SESSION, naming the session its latest request went to: to
  the wrap's proxy while it runs, and to 'info' and 'plan' from this host's ledgers afterwards).
  GET /proxyvisor/sessions lists the ids to the admin ([proxy] admin_token){listed}.
  Default: the session with the most recent activity ({latest}).
"""
_INFO_EXIT = """\
exit status:
  0 the counters were shown; 1 no such session (neither the proxy nor, without one, the ledgers
  know it) or the proxy refused (e.g. a wrong auth token); 2 bad usage or configuration.
"""
_PLAN_EXIT = """\
exit status:
  0 the plan (or "No plan") was shown; 1 no proxy answers and no state of the session is stored,
  the proxy knows no such session, or it refused (e.g. a wrong auth token); 2 bad usage or
  configuration.
"""


def _epilog(name: str, example: str) -> str:
    """The help's epilog of ``info`` or ``plan``: the parts they share, and each one's own."""
    info = name == "info"
    session = _SESSION.format(listed=", and so does STATE_DIR/ledger/" if info else "",
                              latest="the proxy's list with the admin token, else the ledger written last")
    examples = textwrap.dedent(f"""\
        examples:
          proxyvisor {name}                 the most recently active session
          proxyvisor {name} my-session
          {example}
        """)
    return "\n".join((_ASKED + (_INFO_FALLBACK if info else _PLAN_FALLBACK), session,
                      _INFO_EXIT if info else _PLAN_EXIT, examples, _FILES))


_INFO_HELP = textwrap.dedent("""\
    Show a session's counters, the same as the agent gets by sending the message /info: model
    requests, tool rounds and errors; self-reports by status and reported state; detector fires and
    steer notes by signal; verify-gate runs, passes, gaps, nudges, re-entries, refutations and turn
    outcomes (verified, unknown, failed, unverified); condensed tool results and the input tokens they
    saved; planner calls; supervisor model calls by purpose with their tokens and cost; upstream tokens
    and their cost (litellm's cost map, priced when shown; a model it does not price is named, "price
    unknown", and the built-in scripted model's answers are never priced); and the proxy overhead per
    request (total, mean, median, max; milliseconds): the time proxyvisor itself added, without the
    time spent waiting for the upstream and for supervisor model calls.

    Everything is summed from the session's ledger, so a session of a stopped proxy shows the same.
    --json prints the object that GET /proxyvisor/sessions/SESSION/info returns (the schema is in
    proxyvisor/proxy/info.py), with "live" (the proxy's in-memory counters) null when it came from the
    ledger or the session is no longer in the proxy's memory.
    """)
_PLAN_HELP = textwrap.dedent("""\
    Show a session's plan, the same as the agent gets by sending the message /plan: the
    supervisor-owned plan of the session's latest thread with each phase's status ([x] done, [>] in
    progress, [ ] pending) and its done-when condition, or "No plan" when the work has not needed one;
    then the user's prohibitions in force, verbatim, each with the user turn that stated it (a
    prohibition stated in any turn stands until a later turn explicitly permits it: "do not run the
    tests", then "you can run the tests now"); then the retained critical knowledge: the carry items
    of the latest self-report.

    A plan is read from a running proxy: the one that serves the session or, with [state]
    backend = "redis", any replica (it reads the session's stored state); without one, from the
    session's state stored in the state directory (or Redis). --json prints the object that
    GET /proxyvisor/sessions/SESSION/plan returns: session, plan (phases and status, or null),
    prohibitions (list of {turn, text}), carry (list of strings), text (what is shown without --json).
    """)


def register(commands: Any, common: Callable[[argparse.ArgumentParser], None], formatter: type) -> None:
    """Add ``info`` and ``plan`` to the ``proxyvisor`` subparsers; each sets ``handler(args, config)``."""
    for name, short, help_text, handler, example in (
            ("info", "show a session's counters (requests, detectors, gate, tokens, cost, overhead)", _INFO_HELP,
             _info, "proxyvisor info --json | jq .gate.outcomes"),
            ("plan", "show a session's plan, prohibitions in force and retained critical knowledge", _PLAN_HELP, _plan,
             "proxyvisor plan --url http://127.0.0.1:8377 my-session")):
        parser = commands.add_parser(name, help=short, formatter_class=formatter, description=help_text,
                                     epilog=_epilog(name, example))
        parser.add_argument("session", nargs="?", metavar="SESSION", type=session_id_arg,
                            help="the session (default: the most recently active one)")
        parser.add_argument("--json", action="store_true", help="print the JSON object instead of the text")
        parser.add_argument("--url", metavar="URL", type=_url_arg,
                            help="the proxy to ask, http(s)://HOST[:PORT] (default: http://[proxy] host:port)")
        common(parser)
        parser.set_defaults(handler=functools.partial(_run, name, handler))


def proxy_origin(value: str, session_path: bool = False) -> str | None:
    """The proxy's ``http(s)://HOST[:PORT]`` that ``value`` names, or None when it names none: another scheme, no
    host, a port that is no number in 0-65535, a user or password (a proxy is asked without credentials, and they
    would be echoed in messages), a query or fragment, or a path other than ``/``; with ``session_path``, any path
    (``PROXYVISOR_URL`` is the session's or run's base, ``http://HOST:PORT/r/RUN``, ``.../s/SESSION``)."""
    try:
        url = urllib.parse.urlsplit(value)
        url.port  # noqa: B018 - raises ValueError for a port that is not a number in 0-65535
    except ValueError:
        return None
    if url.scheme not in ("http", "https") or not url.hostname or url.query or url.fragment \
            or url.username is not None or not session_path and url.path not in ("", "/"):
        return None
    return f"{url.scheme}://{url.netloc}"


def _url_arg(value: str) -> str:
    """``--url``: an ``http(s)://HOST[:PORT]`` address (a trailing ``/`` allowed; :func:`proxy_origin`), else
    ArgumentTypeError."""
    if proxy_origin(value) is None:
        raise argparse.ArgumentTypeError(f"expected http://HOST[:PORT] or https://HOST[:PORT], got {value!r}")
    return value


def proxy_url(config: Config, url: str | None = None) -> str:
    """The proxy to ask: ``url`` (``http(s)://HOST[:PORT]``) without a trailing ``/``, else ``[proxy] host:port``
    (a wildcard host on loopback)."""
    if url:
        return url.rstrip("/")
    host = config.proxy.host
    host = "127.0.0.1" if host in ("", "0.0.0.0") else "::1" if host == "::" else host
    return f"http://[{host}]:{config.proxy.port}" if ":" in host else f"http://{host}:{config.proxy.port}"


class Refused(Exception):
    """No answer can be given: the proxy refused or knows no such session, or (``info``) neither a proxy nor the
    ledgers know it; the message says why, for a person."""


class _Proxy:
    """The running proxy's session endpoints; :meth:`get` returns None when nothing (or no proxyvisor) answers.
    http.client, not an HTTP library: a command that must answer in a fraction of a second cannot spend a fifth of
    one importing it; and never through a proxy of the environment (the address is the proxy's own)."""

    def __init__(self, url: str, config: Config) -> None:
        self.url = url
        self.headers = {name: token for name, token in (("x-proxyvisor-auth", config.proxy.auth_token),
                                                        ("x-proxyvisor-admin", config.proxy.admin_token)) if token}

    def get(self, path: str) -> tuple[int, dict[str, Any]] | None:
        """(status, JSON object) of the proxy's answer at ``path``; None when nothing answers or what answers is
        not proxyvisor (every answer of proxyvisor's carries ``x-proxyvisor-overhead-ms``)."""
        url = urllib.parse.urlsplit(self.url)
        kind = http.client.HTTPSConnection if url.scheme == "https" else http.client.HTTPConnection
        connection = kind(url.hostname or "", url.port, timeout=_TIMEOUT_S)
        try:
            connection.request("GET", path, headers=self.headers)
            reply = connection.getresponse()
            status, body = reply.status, orjson.loads(reply.read())
            ours = reply.getheader("x-proxyvisor-overhead-ms") is not None
        except (OSError, http.client.HTTPException, orjson.JSONDecodeError):
            return None
        finally:
            connection.close()
        if not isinstance(body, dict) or not ours:
            return None
        return status, body


def _refusal(status: int, body: dict[str, Any]) -> Refused:
    error = body.get("error")
    return Refused(error.get("message") if isinstance(error, dict) else f"HTTP {status}")


def _ask(config: Config, what: str, named: str | None, url: str) -> tuple[str | None, dict[str, Any] | None]:
    """(session, the proxy's answer for it or None when no proxy answers) of ``GET
    /proxyvisor/sessions/SESSION/{what}`` at ``url``.

    Without a session ``named``, the proxy's listing gives the most recent one; a proxy that lists its sessions
    only to the admin (``[proxy] admin_token``, not configured here) is asked for the session of the ledger written
    last.

    Raises:
        Refused: the proxy refused, or it knows no session to show.
    """
    proxy = _Proxy(url, config)
    session = named
    if session is None:
        listing = proxy.get("/proxyvisor/sessions")
        if listing is None:
            return None, None
        status, body = listing
        if status == 403 and not config.proxy.admin_token:
            session = _latest(config)[1]
            if session is None:
                raise Refused(f"the proxy at {url} lists its sessions only with [proxy] admin_token, and no "
                               "ledger names one here: name the session")
        elif status != 200 or not isinstance(body.get("sessions"), list):
            raise _refusal(status, body)
        else:
            session = next((s.get("id") for s in body["sessions"] if isinstance(s, dict)), None)
            if session is None:
                raise Refused(f"the proxy at {url} has no sessions yet")
    answer = proxy.get(f"/proxyvisor/sessions/{session}/{what}")
    if answer is None:
        if named is not None:
            return session, None
        raise Refused(f"the proxy at {url} stopped answering")
    status, body = answer
    if status != 200:
        raise _refusal(status, body)
    return session, body


def session_info(config: Config, session: str | None = None, url: str | None = None) -> tuple[dict[str, Any], str]:
    """The ``/info`` object of ``session`` (default: the most recently active one) and where it came from: ``""``
    from the proxy at ``url`` (:func:`proxy_url`), else a note that no proxy answers and the ledger in the state
    directory was summed (then ``live`` is None). Blocks on HTTP for up to :data:`_TIMEOUT_S` per read.

    Raises:
        Refused: the proxy refused or knows no such session, or no proxy answers and no ledger holds the session
            (or it cannot be read).
    """
    from .adapters.state import REDIS
    from .proxy.info import info_object

    url = proxy_url(config, url)
    session, info = _ask(config, "info", session, url)
    if info is not None:
        return info, ""
    store, session, ran, lines, only_here = _offline(config, session)
    if not lines:
        where = f"no ledger for session {session!r}" if session else "no session ledgers"
        raise Refused(f"no proxy answers at {url}, and {where} in {store.root}")
    assert session is not None  # its ledger's lines were read
    only_here = only_here or (config.state.backend == REDIS and store.shared is None)
    return info_object(session, lines, None, only_here), (
        f"no proxy answers at {url}; summing the ledger of session {session}{ran} in {store.root}"
        + (" (this host's lines only: Redis does not answer, the other replicas' lines are missing)"
           if only_here else ""))


def session_plan(config: Config, session: str | None = None, url: str | None = None,
                 url_option: str = "--url") -> tuple[dict[str, Any] | None, str | None, str]:
    """``(the /plan object, its session, note)`` of ``session`` (default: the most recently active one): from the
    proxy at ``url`` (:func:`proxy_url`), the note then ``""``; else from the session's supervision state stored in
    the state directory (``[state]``: on Redis, where the replicas keep it), the note saying so. ``(None, the
    session or None, why)`` when no proxy answers and no state of the session is stored (``why`` names
    ``url_option`` as the way to give an address). Blocks on HTTP for up to :data:`_TIMEOUT_S` per read.

    Raises:
        Refused: the proxy refused or knows no such session, or a ledger naming the session cannot be read.
        ConfigError: ``[state] backend = "redis"`` and Redis cannot be reached.
    """
    import trio

    from .adapters.state import backend_of
    from .proxy.commands import stored_plan
    from .proxy.session_state import NAMESPACE, SETTINGS, SessionStates

    url = proxy_url(config, url)
    session, plan = _ask(config, "plan", session, url)
    if plan is not None:
        return plan, session, ""
    store, session, ran, _, _ = _offline(config, session)
    if session is None:
        return None, None, f"no proxy answers at {url}, and no session ledgers in {store.root}"
    backend = backend_of(config, store.root)
    states = SessionStates(backend.kv(NAMESPACE, **SETTINGS), config.state.session_ttl_s)
    try:
        plan = trio.run(stored_plan, session, states)
        where = backend.describe()
    finally:
        states.close()
        backend.close()
    if plan is None:
        return None, session, (f"no proxy answers at {url}, and no supervision state of session {session}{ran} is "
                               f"stored ({where}). Start the proxy that serves it, or give its address with "
                               f"{url_option}.")
    return plan, session, f"no proxy answers at {url}; reading session {session}{ran}'s stored state ({where})"


def _offline(config: Config, named: str | None) -> tuple[Any, str | None, str, list[dict[str, Any]], bool]:
    """Without a proxy: the state directory's store, the session ``named`` names (default: the one whose ledger was
    written last; a run's id: the session its latest request went to), a note naming that run (else ``""``), the
    session's ledger lines and whether they are this host's only.

    Raises:
        Refused: the session's ledger cannot be read.
    """
    from .store import LedgerError

    store, latest = _latest(config)
    session = named or latest
    ran = ""
    try:
        lines, only_here = store.ledger(session) if session else ([], False)
        if not lines and named and (found := store.session_of_run(named)) is not None:
            ran, session = f" (where run {named}'s latest request went)", found
            lines, only_here = store.ledger(session)
    except LedgerError as exc:
        raise Refused(str(exc)) from None
    return store, session, ran, lines, only_here


def _print(args: argparse.Namespace, obj: dict[str, Any], text: str, markdown: bool = False) -> None:
    """``obj`` as JSON with --json, else ``text``; ``markdown`` text is rendered by rich on a terminal."""
    if args.json:
        sys.stdout.write(orjson.dumps(obj, option=orjson.OPT_INDENT_2).decode() + "\n")
    elif markdown and sys.stdout.isatty():
        from rich.console import Console
        from rich.markdown import Markdown

        Console().print(Markdown(text))
    else:
        sys.stdout.write(text + "\n")


def _latest(config: Config) -> tuple[Any, str | None]:
    from .adapters.replicas import shared_ledgers
    from .store import Store

    store = Store(config.state_dir(), shared_ledgers(config))  # on Redis, every replica's lines
    sessions = store.sessions()
    return store, sessions[-1] if sessions else None


def _run(name: str, handler: Callable[[argparse.Namespace, Config], int], args: argparse.Namespace,
         config: Config) -> int:
    """``handler`` of command ``name``; a refusal (:class:`Refused`) is printed on stderr and exits 1."""
    try:
        return handler(args, config)
    except Refused as exc:
        print(f"proxyvisor {name}: {exc}", file=sys.stderr)
        return 1


def _info(args: argparse.Namespace, config: Config) -> int:
    from .proxy.info import render_text

    info, note = session_info(config, args.session, args.url)
    if note:
        print(f"proxyvisor info: {note}", file=sys.stderr)
    _print(args, info, render_text(info), markdown=True)
    return 0


def _plan(args: argparse.Namespace, config: Config) -> int:
    plan, session, text = session_plan(config, args.session, args.url)
    if plan is not None and text:
        print(f"proxyvisor plan: {text}", file=sys.stderr)
    if plan is None:
        if args.json:
            _print(args, {"session": session, "plan": None, "prohibitions": [], "carry": [], "text": text}, text)
        else:
            print(f"proxyvisor plan: {text}", file=sys.stderr)
        return 1
    _print(args, plan, plan["text"])
    return 0
