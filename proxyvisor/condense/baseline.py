"""What a tool run is: its command, its kind (test run, build, install), whether it passed, and what a failing run
says that the last green run of the same command did not (sans-IO).

**The command** of a call is read from its arguments (JSON text): the ``command`` or ``cmd`` value (a string, or
a list of strings joined by spaces), else the whole text when it is not JSON (a freeform tool). Its key is the
command with whitespace runs collapsed and ``2>&1`` dropped, plus the working directory when the call names one
(``cwd``, ``workdir``, ``working_directory``, ``dir``, ``directory``): two calls are runs of the same command when
their keys are equal.

**The kind** (:func:`kind_of`): ``test``, ``build`` or ``install`` from the command's words (a runner, build tool
or package manager and its verb: ``pytest``, ``go test``, ``cargo build``, ``mvn package``, ``npm ci``, ...), else
from the output's own shape (a runner's banner or summary line); ``""`` when neither says.

**Green** (:func:`passed`): the result is not flagged as an error and none of its last :data:`TAIL_LINES` lines is
a diagnostic (:mod:`.signals`): the runner's verdict is at the end.

**New lines** (:func:`new_lines`): the lines of a run whose template (:mod:`.mask`: timestamps, ids, hex, paths
and numbers masked) occurs nowhere in the green run's output, blank lines aside: the idea of cidiff
(https://github.com/labri-progress/cidiff), with templates for its token-level alignment.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import orjson

from .mask import template
from .select import MASK_CHARS
from .signals import is_diagnostic
from .text import body_of

TAIL_LINES = 30
SAMPLE_CHARS = 32_768
"""The output's shape is read from its first and last this many characters."""
CWD_KEYS = ("cwd", "workdir", "working_directory", "dir", "directory")

_WORDS = re.compile(r"[\w.+-]+")
_COMMAND_KINDS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("test", re.compile(
        r"\b(?:py\.?test|pytest|tox|nox|jest|vitest|mocha|ava|karma|rspec|phpunit|ctest|runtests(?:\.py)?|"
        r"unittest|nosetests|bin/test|(?:go|cargo|npm|yarn|pnpm|bun|deno|dotnet|mix|swift|bazel|mvn|\./mvnw|"
        r"gradle|\./gradlew|make|sbt|lein|stack|cabal|zig)\s+(?:run\s+)?(?:test|tests|check|verify|spec)\w*)\b")),
    ("build", re.compile(
        r"\b(?:make|ninja|cmake|tsc|gcc|g\+\+|clang\+*|javac|rustc|msbuild|webpack|esbuild|idf\.py|scons|meson|"
        r"(?:go|cargo|npm|yarn|pnpm|bun|dotnet|bazel|swift|zig|sbt|stack|cabal)\s+(?:run\s+)?"
        r"(?:build|check|clippy|vet|compile|assemble)\w*|(?:mvn|\./mvnw|gradle|\./gradlew)\b[^|;&]*?"
        r"\b(?:compile|package|install|build|assemble|deploy|verify))\b")),
    ("install", re.compile(
        r"\b(?:(?:pip3?|uv(?:\s+pip)?|poetry|pipenv|conda|mamba|micromamba|npm|yarn|pnpm|bun|apt-get|apt|dnf|yum|"
        r"apk|brew|gem|bundle|composer|cargo|go|dotnet)\s+(?:-\S+\s+)*(?:install|add|sync|ci|i|get|restore|"
        r"create|update)|pip3?\s+download)\b")),
)
_OUTPUT_KINDS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("test", re.compile(r"test session starts|^Ran \d+ tests? in|^Tests run: \d+|\d+ (?:passed|failed)\b|"
                        r"^(?:---|===) (?:FAIL|PASS|RUN)\b|^test result: |tests? finished: ", re.M)),
    ("build", re.compile(r"BUILD (?:SUCCESS|FAILURE|SUCCESSFUL|FAILED)|^ninja: |^\[\d+/\d+\] |^\s*Compiling \S+ v\d|"
                         r"^make(?:\[\d+\])?: |COMPILATION ERROR", re.M)),
    ("install", re.compile(r"^Successfully installed |^Collecting \S|^added \d+ packages?|^Setting up \S+ \(|"
                           r"^Installing collected packages", re.M)),
)


def command_of(arguments: str) -> str:
    """The command a call ran (module docstring), or ``""`` when its arguments name none."""
    document = _document(arguments)
    if document is None:
        return arguments.strip() if arguments.strip() and not arguments.lstrip().startswith(("{", "[")) else ""
    for key in ("command", "cmd"):
        value = document.get(key)
        if isinstance(value, str):
            return value
        if isinstance(value, list) and all(isinstance(part, str) for part in value):
            return " ".join(value)
    return ""


def command_key(arguments: str) -> str:
    """The key of the command a call ran (module docstring), ``""`` when it ran none."""
    command = " ".join(command_of(arguments).replace("2>&1", " ").split())
    if not command:
        return ""
    document = _document(arguments) or {}
    cwd = next((v for k in CWD_KEYS if isinstance(v := document.get(k), str)), "")
    return f"{cwd.rstrip('/')}\0{command}"


def kind_of(arguments: str, text: str) -> str:
    """``test``, ``build``, ``install`` or ``""`` for a result ``text`` of a call with ``arguments``."""
    command = command_of(arguments)
    for kind, pattern in _COMMAND_KINDS:
        if pattern.search(command):
            return kind
    sample = text[:SAMPLE_CHARS] + "\n" + text[-SAMPLE_CHARS:]
    for kind, pattern in _OUTPUT_KINDS:
        if pattern.search(sample):
            return kind
    return ""


def passed(lines: Sequence[str], is_error: bool) -> bool:
    """Whether a run with output ``lines`` passed (module docstring)."""
    return not is_error and not any(is_diagnostic(line) for line in lines[-TAIL_LINES:])


def new_lines(lines: Sequence[str], green: Sequence[str]) -> list[int]:
    """0-based indexes of the non-blank ``lines`` whose template the ``green`` run's lines lack."""
    known = {template(body_of(line)[:MASK_CHARS]) for line in green}
    return [i for i, line in enumerate(lines)
            if line.strip() and template(body_of(line)[:MASK_CHARS]) not in known]


def _document(arguments: str) -> dict[str, object] | None:
    try:
        document = orjson.loads(arguments) if arguments.lstrip().startswith("{") else None
    except orjson.JSONDecodeError:
        return None
    return document if isinstance(document, dict) else None
