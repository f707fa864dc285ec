"""Dead letters: delegation hand-offs that still failed transiently when their attempts or wall clock ran out.

Kept in a diskcache under the state directory (``<state dir>/dead_letters/``, folder 0700, files 0600), created on
the first dead letter. Bounded: each record expires after ``retention_s`` and at most ``kept`` are kept, the oldest
removed first. A record holds what is needed to see and re-run the hand-off: the role, the prompt (at most
:data:`PROMPT_CHARS` characters of it), the route, each attempt's evidence and the last failure, normalised (a
short message, never a provider payload); never a credential: every text of it, the prompt included, is stored
with its secret-looking values replaced by ``[redacted]`` (``proxyvisor.redact``).
"""

from __future__ import annotations

import secrets
import time
from pathlib import Path
from typing import Any

from ..redact import redact, redact_cut
from .cache import LazyCache

PROMPT_CHARS = 100_000
"""A longer prompt is kept cut to this many characters (``prompt_chars`` says how long it was)."""
_PREFIX = "dl_"


class DeadLetterStore(LazyCache):
    """The dead letters under ``root`` (the state dir's ``dead_letters`` folder)."""

    def __init__(self, root: Path, retention_s: float, kept: int) -> None:
        super().__init__(root)
        self.retention_s = retention_s
        self.kept = kept

    def put(self, role: str, prompt: str, record: dict[str, Any]) -> str:
        """Store a dead letter of ``role`` for ``prompt`` with the fields of ``record`` (route, attempts,
        failure, reason...), secrets redacted (module docstring); returns its id (``dl_`` + 20 hex digits). The oldest beyond ``kept`` are removed."""
        letter_id = _PREFIX + secrets.token_hex(10)
        letter = {"id": letter_id, "created_at": time.time(), "role": role,
                  "prompt": redact_cut(prompt, PROMPT_CHARS), "prompt_chars": len(prompt),
                  **_redacted(record)}
        with self._lock:
            db = self._db()
            with db.transact():
                db.set(letter_id, letter, expire=self.retention_s)
                letters = self._letters()
                for old in letters[: max(0, len(letters) - self.kept)]:
                    db.delete(old["id"])
        return letter_id

    def _letters(self) -> list[dict[str, Any]]:
        db = self._db()
        found = (db.get(k) for k in list(db.iterkeys()) if isinstance(k, str) and k.startswith(_PREFIX))
        return sorted((v for v in found if isinstance(v, dict)), key=lambda v: (v.get("created_at", 0), v["id"]))

    def all(self) -> list[dict[str, Any]]:
        """Every dead letter not expired, oldest first; creates nothing if the store does not exist.

        Raises:
            StoreUnusable: the store cannot be used (:meth:`~proxyvisor.adapters.cache.LazyCache.readable`).
        """
        if not self.readable():
            return []
        with self._lock:
            self._db().expire()
            return self._letters()


def _redacted(value: Any) -> Any:
    """``value`` (a record's JSON-like fields) with every string in it redacted."""
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, dict):
        return {k: _redacted(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_redacted(v) for v in value]
    return value
