"""Writing a benchmark's figures into its own section of bench/RESULTS.md, leaving the other sections alone."""

from __future__ import annotations

import re
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
_TITLE = "# Benchmark results\n\nEach section is written by the benchmark named in it; rerun its command to refresh it.\n"


def write_section(title: str, body: str, path: Path = RESULTS) -> None:
    """Replace (or append) the section headed ``## {title}`` with ``body``."""
    text = path.read_text(encoding="utf-8") if path.exists() else _TITLE
    section = f"## {title}\n\n{body.rstrip()}\n"
    pattern = re.compile(rf"^## {re.escape(title)}\n.*?(?=^## |\Z)", re.S | re.M)
    if pattern.search(text):
        text = pattern.sub(lambda _m: section + "\n", text, count=1)
    else:
        text = text.rstrip() + "\n\n" + section
    path.write_text(text.rstrip() + "\n", encoding="utf-8")
