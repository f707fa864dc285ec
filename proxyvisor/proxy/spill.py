"""Spill files: the full original of every narrowed tool result, where the agent can read it back.

Layout: ``{root}/{session}/{tool}-{hash}.txt`` (folders 0700, files 0600; ``root`` is ``spill/`` in the state
directory). The file holds the original text exactly, UTF-8 (lone surrogates written as-is with
``surrogatepass``), so its line numbers are the ones the gap markers name. The write is atomic
(:func:`~proxyvisor.store.atomic_write`): a reader never sees half a spill, and a result spilled twice is written
once.
"""

from __future__ import annotations

import re
from pathlib import Path

from ..store import atomic_write, private_dir

_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]+")


class SpillStore:
    """Spill files under ``root``. :meth:`path_for` names a file without touching the disk; :meth:`write`
    creates it."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def path_for(self, session: str, tool: str, digest: str) -> Path:
        """The absolute spill path for a result of ``tool`` whose content hash is ``digest`` (hex)."""
        folder = _UNSAFE.sub("_", session)[:128].lstrip(".") or "_"  # never "." or "..": stay under root
        name = (_UNSAFE.sub("_", tool).strip("._")[:40] or "tool") + f"-{digest[:16]}.txt"
        return self.root.resolve() / folder / name

    def write(self, path: Path, text: str) -> None:
        """Write ``text`` to ``path`` (0600, atomic), unless the file already exists.

        Raises:
            OSError: the folder or file cannot be created or written.
        """
        if path.exists():
            return
        private_dir(self.root)
        private_dir(path.parent)
        atomic_write(path, text.encode("utf-8", "surrogatepass"))
