"""Command line of ``proxyvisor memory list|show|forget`` (registered by cli.py): a project's memory, read and
changed where the proxies keep it (``proxyvisor.proxy.learning.memory_store``: its file under the state directory,
or with ``[state] backend = "redis"`` its Redis key), in one atomic change, without a proxy. A running proxy (every
replica) reads the changed memory at its next session's start and at its next save: a forgotten record stays
forgotten. A memory that cannot be read (or holds another folder's memory) is only ever removed, by
``forget --all``."""

from __future__ import annotations

import argparse
import os
import shlex
import time
import sys
import textwrap
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .cli import _FILES
from .config import Config

if TYPE_CHECKING:
    from .learning.memory import Memory
    from .proxy.learning import MemoryStore

_HELP = textwrap.dedent("""\
    Show or forget what proxyvisor learnt in a project ([supervisor.learning]). Each project folder (a
    folder inside a git repository counts as the repository's root) has one memory file under the state
    directory, STATE/memory/HASH.json (0600), or with [state] backend = "redis" one Redis key,
    proxyvisor:memory:HASH, shared by every replica; it holds three kinds of record, each with an id
    (M and 8 hex digits, as the recalled note names it):

      rule         the user's durable instruction, an exact quote, with its source turn
      orientation  a fact a session established, citing the action whose result showed it
      experience   a finished task with the gate's label: verified, failed or unknown

    and its credit (0-1; a record a verified turn used gains 0.05, a failed one costs 0.15; below 0.25
    it is archived: kept and listed, never recalled).

    subcommands:
      list              the scope's records: id, kind, label, credit, archived, text
      show ID           one record in full: source, when it was stored and last seen (UTC), the
                        session that stored it, how many sessions it was recalled to and how many
                        times a status line named it as used
      forget ID         remove one record (a rule: with the experience and orientation records
                        quoting its words, so that no model is told them again)
      forget --all      remove the scope's whole memory (also one that cannot be read)

    The scope is --scope DIR, else [supervisor.learning] scope, else the current folder.
    """)
_COUNTS = {"used": "times a session's status line named it as used", "recalled": "sessions it was recalled to"}
_EXIT = textwrap.dedent("""\
    exit status:
      0 done (list: also when the scope has no memory yet, saying so); 1 no memory for the
      scope (show, forget), no such record, or the memory cannot be read or written (Redis down);
      2 bad usage or configuration.
    """)


def register(commands: Any, common: Callable[[argparse.ArgumentParser], None], formatter: type) -> None:
    """Add ``memory`` to the ``proxyvisor`` subparsers; it sets ``handler(args, config)``."""
    parser = commands.add_parser(
        "memory", help="list, show or forget what proxyvisor learnt in a project", formatter_class=formatter,
        description=_HELP, epilog=textwrap.dedent("""\
            examples:
              proxyvisor memory list
              proxyvisor memory show M1a2b3c4d --scope ~/src/app
              proxyvisor memory forget M1a2b3c4d
              proxyvisor memory forget --all --scope ~/src/app
            """) + "\n" + _EXIT + "\n" + _FILES)
    parser.add_argument("action", choices=["list", "show", "forget"], metavar="list|show|forget",
                        help="what to do (see subcommands above)")
    parser.add_argument("id", nargs="?", metavar="ID", help="the record (show, forget)")
    parser.add_argument("--all", action="store_true", help="forget: remove every record of the scope")
    parser.add_argument("--scope", metavar="DIR", help="the project folder (default: [supervisor.learning] scope, "
                                                       "else the current folder)")
    parser.add_argument("--json", action="store_true", help="list, show: print JSON instead of text")
    common(parser)
    parser.set_defaults(handler=_run)


class _Refused(Exception):
    """A ``forget`` that changes nothing: the message says why."""


def _run(args: argparse.Namespace, config: Config) -> int:
    # Imported here: every proxyvisor command builds this parser, and the shell's modules take a while to load.
    import msgspec
    import orjson

    from .adapters.state import COMMAND_TIMEOUT_S, StateUnavailable, open_backend
    from .proxy.learning import decoded, memory_store, project_root

    if args.action != "forget" and args.all or args.action == "list" and args.id \
            or args.action == "forget" and args.json:
        given = "--all" if args.action != "forget" and args.all else args.id if args.action == "list" else "--json"
        print(f"proxyvisor memory {args.action}: unexpected {given}", file=sys.stderr)
        return 2
    if args.action in ("show", "forget") and not args.id and not (args.action == "forget" and args.all):
        print(f"proxyvisor memory {args.action}: needs an ID" + (" or --all" if args.action == "forget" else ""),
              file=sys.stderr)
        return 2
    if args.id and args.all:
        print("proxyvisor memory forget: give an ID or --all, not both", file=sys.stderr)
        return 2
    scope = project_root(args.scope or config.supervisor.learning.scope or os.getcwd())
    backend = None
    try:  # a Redis that does not answer is no configuration error: the memory cannot be read now (exit 1)
        backend = open_backend(config.state.backend, config.state.url, config.state_dir(), COMMAND_TIMEOUT_S)
        store = memory_store(config.supervisor.learning, config.state_dir(), backend)
        assert store is not None  # a state directory is given
        if args.action == "forget":
            return _forget(store, scope, args.id)
        try:
            found = store.look(scope, ())
            memory = decoded(found[1] if found else None, scope)
        except (OSError, ValueError) as exc:
            print(_unreadable(store, scope, exc), file=sys.stderr)
            return 1
    except StateUnavailable as exc:
        print(f"proxyvisor memory: {exc}", file=sys.stderr)
        return 1
    finally:
        if backend is not None:
            backend.close()
    if args.action == "list":
        return _list(memory, scope, args.json)
    record = memory.records.get(args.id) if memory is not None else None
    if record is None:
        print(f"proxyvisor memory: no record {args.id} in the memory of {scope}" if memory is not None
              else f"proxyvisor memory: no memory for {scope}", file=sys.stderr)
        return 1
    if args.json:
        print(orjson.dumps(msgspec.to_builtins(record), option=orjson.OPT_INDENT_2).decode())
        return 0
    for name in record.__struct_fields__:
        value = getattr(record, name)
        if name in ("created", "seen"):
            value = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(value))
        elif name in _COUNTS:
            value = f"{value} ({_COUNTS[name]})"
        print(f"{name}: {value}")
    return 0


def _unreadable(store: MemoryStore, scope: str, exc: BaseException) -> str:
    return (f"proxyvisor memory: {store.where(scope)} cannot be read: {exc}; learning is off for {scope} until "
            f"`proxyvisor memory forget --all --scope {shlex.quote(scope)}` removes it")


def _forget(store: MemoryStore, scope: str, rid: str | None) -> int:
    """Forget record ``rid`` of ``scope``, or (None) its whole memory, readable or not, in one atomic change of the
    store (so a running proxy's save cannot write the record back).

    Raises:
        StateUnavailable: the shared state backend does not answer.
    """
    from .proxy.learning import decoded

    said: list[str] = []

    def step(current: bytes | None) -> bytes | None:
        said.clear()
        if current is None:
            raise _Refused(f"proxyvisor memory: no memory for {scope}")
        try:
            memory = decoded(current, scope)
        except ValueError as exc:
            if rid is not None:
                raise _Refused(_unreadable(store, scope, exc)) from None
            said.append(f"removed {store.where(scope)} of {scope}, which could not be read ({exc})")
            return None
        assert memory is not None
        if rid is None:
            said.append(f"forgot {len(memory.records)} record(s) of {scope}")
            return None
        gone = memory.forget(rid)
        if not gone:
            raise _Refused(f"proxyvisor memory: no record {rid} in the memory of {scope}")
        said.append(f"forgot {rid}" + (f" and the record(s) quoting it: {' '.join(gone[1:])}" if gone[1:] else ""))
        return memory.encode()

    try:
        if store.look(scope, ()) == (None, None):  # nothing stored: say so without making the folder
            raise _Refused(f"proxyvisor memory: no memory for {scope}")
        store.update(scope, step)
    except _Refused as exc:
        print(exc, file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"proxyvisor memory: cannot change {store.where(scope)}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    print(*said)
    return 0


def _list(memory: Memory | None, scope: str, as_json: bool) -> int:
    import msgspec
    import orjson

    records = list(memory.records.values()) if memory is not None else []
    if as_json:
        print(orjson.dumps({"scope": scope, "records": msgspec.to_builtins(records)},
                           option=orjson.OPT_INDENT_2).decode())
        return 0
    if memory is None:
        print(f"no memory for {scope}: nothing learnt there yet")
        return 0
    print(f"memory of {memory.scope}: {len(records)} record(s)")
    for r in records:
        flags = (r.label + " " if r.label else "") + ("archived " if r.archived else "")
        text = r.text if len(r.text) <= 80 else r.text[:79] + "\u2026"
        print(f"{r.id}  {r.kind:<11} {flags}credit {r.credit:.2f}  {text}")
    return 0
