"""Writing the ``[model_routing]`` policy into ``config.toml``: validated, locked, atomic, comment-preserving.

One service behind every writer (``proxyvisor routing enable|disable|set``; seed 000, "Control surfaces"):

- the file is edited with tomlkit, so comments, formatting and every unrelated or unknown section stay as they
  were; a missing file is created with only what was set;
- a file that is not valid TOML, or not a valid configuration, **fails closed**: the write is refused and the
  file left untouched, never replaced with defaults;
- the result is validated as a whole (types, ranges, the supervision graph) and the targets the write touches
  are checked against the adapter descriptors (unknown adapter, undeclared model, effort without
  ``effort_selection``), so a policy the dispatcher can never satisfy is rejected with the reason at write time;
- writers are serialised by an exclusive ``flock`` on the file's folder (the file itself is replaced, and a
  lock file would be left behind), and the new text replaces the file atomically (a temporary file in the same folder, fsynced, then ``os.replace``), keeping the file's mode.
"""

from __future__ import annotations

import fcntl
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import tomlkit
from tomlkit.exceptions import TOMLKitError

from ..config import Config, ConfigError, ModelRoutingConfig, RouteTarget, parse
from ..store import atomic_write
from .descriptors import Registry, TargetError
from .routing import resolve

LOCK_TIMEOUT_S = 10.0


class SettingsError(ValueError):
    """A policy write was refused; the message says why. The configuration file was not changed."""


@contextmanager
def locked(path: Path, timeout_s: float | None = None) -> Iterator[None]:
    """Hold an exclusive lock for writing ``path`` for the block: a ``flock`` on its folder, created if missing,
    which leaves no file behind.

    Raises:
        SettingsError: another writer held it for ``timeout_s`` seconds (default :data:`LOCK_TIMEOUT_S`).
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        deadline = time.monotonic() + (LOCK_TIMEOUT_S if timeout_s is None else timeout_s)
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise SettingsError(f"{path}: another writer is changing it; nothing written") from None
                time.sleep(0.05)
        yield
    finally:
        os.close(fd)


def read_document(path: Path) -> tuple[tomlkit.TOMLDocument, Config]:
    """The file as an editable document (empty if the file does not exist) and the configuration it holds.

    Raises:
        SettingsError: the file is unreadable, not TOML, or not a valid configuration (fail closed).
    """
    try:
        doc = tomlkit.parse(path.read_text(encoding="utf-8")) if path.exists() else tomlkit.document()
    except (OSError, UnicodeDecodeError, TOMLKitError) as exc:
        raise SettingsError(f"{path}: cannot read it as TOML ({exc}); fix the file first, nothing written") from None
    try:
        return doc, parse(doc.unwrap(), source=str(path))
    except ConfigError as exc:
        raise SettingsError(f"the configuration is invalid ({exc}); fix it first, nothing written") from None


def routing_table(doc: tomlkit.TOMLDocument, *names: str) -> Any:
    """The (sub-)table ``[model_routing.<names...>]`` of ``doc``, created if missing."""
    table: Any = doc
    for name in ("model_routing",) + names:
        if name not in table:
            table[name] = tomlkit.table()
        table = table[name]
    return table


def check_targets(routing: ModelRoutingConfig, registry: Registry, roles: set[str] | None = None,
                  orchestrator: bool = True) -> None:
    """Check the orchestrator target (when ``orchestrator``) and each role of ``roles`` (None: every role)
    against the descriptors, as the dispatcher will resolve them.

    Raises:
        TargetError: the first target that cannot be satisfied, with the reason.
    """
    o = routing.orchestrator
    if orchestrator and o != RouteTarget():
        if not o.adapter:
            raise TargetError("[model_routing.orchestrator] sets a model or effort but no adapter")
        registry.get(o.adapter).check(o.model, o.effort)
    for role in routing.roles:
        if roles is None or role.name in roles:
            try:
                resolve(routing, registry, role.name)
            except TargetError as exc:
                raise TargetError(f"role {role.name!r}: {exc}") from None


def update(path: Path, change: Callable[[tomlkit.TOMLDocument, ModelRoutingConfig], tuple[set[str] | None, bool]],
           registry: Registry) -> Config:
    """Apply ``change`` to the file under the lock, validate, and write it atomically.

    ``change(doc, current)`` edits the document and returns which targets to check against the descriptors: the
    role names (None: all) and whether the orchestrator.

    Returns:
        The new configuration.

    Raises:
        SettingsError: the file is malformed, the result is invalid, a target is rejected by the descriptors, or
            the lock could not be taken; nothing was written.
    """
    with locked(path):
        doc, current = read_document(path)
        roles, orchestrator = change(doc, current.model_routing)
        try:
            config = parse(doc.unwrap(), source=str(path))
            check_targets(config.model_routing, registry, roles, orchestrator)
        except (ConfigError, TargetError) as exc:
            raise SettingsError(f"{exc}; nothing written") from None
        atomic_write(path, tomlkit.dumps(doc).encode("utf-8"))
    return config
