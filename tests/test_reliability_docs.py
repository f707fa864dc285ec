"""``docs/reliability.md`` names, for each promise, the test that pins it: every name must exist, and every test
of the reliability, security and hostile-input files must be named there."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "reliability.md"
_REFERENCE = re.compile(r"`(?:(test_\w+\.py))?::(test_\w+)`")
_DEFINED = re.compile(r"^(?:async )?def (test_\w+)", re.MULTILINE)


def references() -> list[tuple[str, str]]:
    """(file, test) for each ```file.py::test``` and ```::test``` (the file of the reference before it)."""
    found, current = [], None
    for match in _REFERENCE.finditer(DOC.read_text(encoding="utf-8")):
        current = match.group(1) or current
        assert current is not None, f"{match.group(0)} names no file"
        found.append((current, match.group(2)))
    return found


def defined(file: str) -> set[str]:
    return set(_DEFINED.findall((ROOT / "tests" / file).read_text(encoding="utf-8")))


def test_every_test_the_document_names_exists() -> None:
    missing = [f"{file}::{name}" for file, name in references()
               if not (ROOT / "tests" / file).exists() or name not in defined(file)]
    assert missing == []


def test_every_reliability_security_and_hostile_input_test_is_in_the_document() -> None:
    named = set(references())
    files = sorted(p.name for pattern in ("test_reliability_*.py", "test_security*.py", "test_hostile*.py")
                   for p in (ROOT / "tests").glob(pattern) if p.name != Path(__file__).name)
    assert files
    absent = [f"{file}::{name}" for file in files for name in sorted(defined(file)) if (file, name) not in named]
    assert absent == []
