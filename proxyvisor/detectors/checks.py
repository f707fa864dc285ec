"""Checks: which commands run the project's checks, which only inspect, and what a runner's output says.

Two tables, read by receipts (:mod:`.receipts`) and the verify-gate's evidence (:mod:`proxyvisor.gate.digest`):

- **Runner summaries** (:data:`SUMMARIES`): one pattern per summary line that test runners, build tools and
  linters print at the end of a run (pytest, unittest and Django's ``runtests.py``, doctest, tox, nox, jest, vitest, mocha,
  go test, cargo test and nextest, Maven, Gradle, ctest, rspec, minitest, npm/yarn/pnpm, make, mypy, ruff, tsc,
  eslint), each with its outcome. :func:`summary` reads the last :data:`TAIL_LINES` lines of an output (at most
  :data:`TAIL_CHARS` characters) from the bottom up: the latest summary line wins, as a runner's final line does.
  A runner that prints one line per unit (go packages, cargo test binaries, tox and nox environments, Maven test
  classes) fails when any of those lines in the tail failed. A line that counts only skipped, pending or warned
  tests says nothing and is passed over.
- **Commands** (:func:`is_inspection`, :func:`is_check_command`): a command is cut into parts at ``&&``, ``||``,
  ``;``, ``|`` and newlines (heredoc bodies removed first); leading ``NAME=value`` assignments and wrappers
  (``timeout 60``, ``time``, ``env``, ``sudo``, ``nice``, ``uv run``, ``poetry run``, ``pipenv run``, ``npx``,
  ``bundle exec``...) are skipped. Read-only inspection (:data:`INSPECTION_COMMANDS`, ``sed`` without ``-i``,
  ``git`` :data:`GIT_READS`, editors' view commands) is never a check; a compound command is inspection only when
  every part is, and a part that redirects its output into a file is not inspection. Read tools (Claude Code's
  ``Read``, ``Glob``, ``Grep``) pass no command text and are never checks either. A check command
  (:data:`CHECK_COMMANDS`) is a part that runs tests, a build or a linter (``node --test`` too). A plain script
  run (``python reproduce.py``, ``python -c ...``) is not a check by its command: it counts only when its output
  carries a runner summary (a script that calls ``unittest.main()``). :func:`is_search` tells a search, whose exit
  status 1 means "nothing found"; a check command whose runner could not start (:func:`runner_missing`: ``pytest:
  command not found``, ``No module named pytest``, exit status 127) ran no check, and :func:`piped_check` tells a
  check whose exit status a pipe hides; :func:`created_paths` and :func:`removed_paths` read the commands that only
  create, or only remove or rename, files (the agent's scratch work).

Pure functions; no I/O.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

PASSED, FAILED, NONE = "passed", "failed", "none"
"""Check outcomes: a check that passed, one that failed, no check."""

TAIL_LINES = 200
TAIL_CHARS = 20_000
LINE_CHARS = 300
"""A quoted summary line is clipped to this many characters."""

INSPECTION_COMMANDS = frozenset({
    "ls", "cat", "nl", "head", "tail", "less", "more", "grep", "egrep", "fgrep", "rg", "ag", "ack", "find", "fd",
    "pwd", "echo", "printf", "wc", "which", "type", "file", "stat", "tree", "du", "df", "awk", "diff", "cd", "true",
    "realpath", "readlink", "basename", "dirname", "sort", "uniq", "cut", "tr", "column", "xxd", "od", "hexdump",
    "jq", "bat", "view", "open", "goto", "scroll_up", "scroll_down", "search_file", "search_dir", "find_file"})
"""First words of commands that only read state (shell commands and SWE-agent's view commands); ``sed`` without
``-i`` and ``git`` :data:`GIT_READS` are inspection as well."""
GIT_READS = frozenset({"status", "diff", "log", "show", "blame", "grep", "ls-files", "rev-parse", "branch"})
SEARCH_COMMANDS = frozenset({"grep", "egrep", "fgrep", "rg", "ag", "ack"})
"""Searches whose exit status 1 means "nothing found", not a failure (``git grep`` as well)."""

_WRAPPERS = frozenset({"time", "env", "sudo", "nice", "nohup", "command", "exec", "xvfb-run", "stdbuf"})
_RUN_WRAPPERS = {"uv": "run", "poetry": "run", "pipenv": "run", "pdm": "run", "hatch": "run", "rye": "run",
                 "conda": "run", "bundle": "exec", "pnpm": "exec", "yarn": "exec"}
_PYTHON = re.compile(r"^(?:python|pypy)(?:\d(?:\.\d+)?)?$")
_CHECK_MODULES = frozenset({"pytest", "unittest", "doctest", "tox", "nox", "mypy", "ruff", "flake8", "pylint",
                            "pyright", "nose", "nose2", "django", "black", "isort", "compileall"})
CHECK_COMMANDS = frozenset({
    "pytest", "py.test", "tox", "nox", "nosetests", "nose2", "jest", "vitest", "mocha", "ava", "tap", "karma",
    "playwright", "cypress", "ctest", "rspec", "rake", "ruff", "mypy", "pyright", "flake8", "pylint", "eslint",
    "tsc", "phpunit", "runtests.py", "runtests"})
"""First words (file names, for scripts such as ``./tests/runtests.py``) of check commands; the tools below need
their sub-command."""
_TEST_SCRIPTS = frozenset({"test", "tests", "runtests", "run_tests", "run-tests", "test.sh", "run_tests.sh"})
"""Names of a project's own test scripts, run by a path (``bin/test``, ``./run_tests.sh``: the shell's ``test``
builtin is no check)."""
_SUB_CHECKS = {
    "go": {"test", "vet", "build"}, "cargo": {"test", "nextest", "build", "check", "clippy"},
    "mvn": {"test", "verify", "package", "install", "compile"}, "mvnw": {"test", "verify", "package", "install",
                                                                        "compile"},
    "gradle": {"test", "check", "build", "verify"}, "gradlew": {"test", "check", "build", "verify"},
    "make": {"test", "tests", "check", "lint"}, "npm": {"test", "t"}, "yarn": {"test"}, "pnpm": {"test"},
    "bun": {"test"}, "deno": {"test", "check", "lint"}, "dotnet": {"test", "build"}, "swift": {"test", "build"},
    "mix": {"test"}, "ninja": {"test", "check"}, "bazel": {"test", "build"}, "rails": {"test"},
}
_SCRIPT_CHECKS = re.compile(r"^(?:test|tests|lint|check|typecheck|ci)(?:[:\-_]\w+)*$")
"""``npm run NAME`` / ``yarn NAME`` scripts that are checks."""

_CAMEL = re.compile(r"(?<=[a-z0-9])(?=[A-Z])")
_NON_WORD = re.compile(r"[^A-Za-z0-9]+")
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
_LEADING, _TRAILING = "=-_*!#>.~", "=-_*!#<.~"
"""Decoration around a line, with whitespace: a leading run of the first set, a trailing run of the second."""
_LEVEL = re.compile(r"^\[(?:INFO|ERROR|WARNING|WARN|DEBUG)\]\s*")
_COUNT = re.compile(
    r"(\d(?<!\d\d)\d*+)\s++("
    r"(?-i:[fF])(?:ailed|ailing|ailures?|laky|iltered out)|(?-i:[eE])(?:rrors?|rrored|xamples?)"
    r"|(?-i:[pP])(?:assed|assing|asses|ending)|(?-i:[oO])k|(?-i:[sS\u017f])(?:ucceeded|kipped|kips?|pecs?|uites?)"
    r"|(?-i:[xX])(?:failed|passed)|(?-i:[dD])eselected|(?-i:[wW])arnings?"
    r"|(?-i:[tT])(?:odo|otal|ests? completed|ests? run|ests?)|(?-i:[bB])roken|(?-i:[iI\u0130\u0131])gnored"
    r"|(?-i:[mM])easured|(?-i:[rR])(?:erun|uns)|(?-i:[aA])ssertions"
    r")\b", re.I)
"""A count and what it counts (failed, failing, failures, errors, errored, passed, passing, passes, ok, succeeded,
skipped, skips, pending, xfailed, xpassed, deselected, warnings, todo, broken, flaky, ignored, measured, filtered
out, rerun, total, examples, runs, assertions, tests completed, tests run, tests, specs, suites: any case);
possessive and not after a digit, so that a line number followed by indentation (``2455\t    code``) is given up
at once rather than tried at every split of its digits and spaces. The pattern starts with the digit, the
lookbehind after it, so that the regex engine skips to the next digit in C rather than trying the lookbehind at
every character of the line (half the cost of reading a line). The words are grouped by their first letter, each
group led by that letter's case-exact class (every character ``re.I`` equates with it: the long s ``\u017f``, the
dotted and dotless i ``\u0130`` ``\u0131``): the engine rejects a group on that one character in C, where it
entered each of the 33 case-insensitive words in turn (most counts a line number is followed by: two thirds of
the pattern's cost). Within a group the words keep their order, so the same word is found."""
_FAIL_WORDS = ("fail", "error", "broken")
_PASS_WORDS = ("pass", "ok", "succeeded")
_TOTAL_WORDS = ("total", "example", "run", "test", "spec", "suite", "completed")
_OUTCOME_WORDS = _FAIL_WORDS + _PASS_WORDS
_TIMING = re.compile(r"\(\s*[\d:.]+\s*\w*\s*\)|\bin\s+[\d.]+\s*\w*|\b[\d.]+\s*m?s\b", re.I)
_SEPARATED = re.compile(r"(?:\band\b|[\s,;|()])*", re.I)
"""Nothing but separators (the word "and", whitespace, commas, semicolons, bars, parentheses). Matched whole, it
gives up at a line's first other character (removing the separators and looking at what was left read it all)."""
_LABEL = re.compile(r"^(?:[^:\d][^:]{0,39}:\s*|(?:test files|test suites|tests?)\s{2,})", re.I)
"""A count line's label: up to a colon ("Tests:", "test result:"), or vitest's column labels ("Test Files  ")."""


def words(text: str) -> set[str]:
    """Lowercase words of ``text`` with camelCase split (``SetCookie`` gives ``set`` and ``cookie``)."""
    return set(_NON_WORD.sub(" ", _CAMEL.sub(" ", text)).lower().split())


@dataclass(frozen=True, slots=True)
class Summary:
    """A runner's summary line (clipped to :data:`LINE_CHARS`) and its outcome, :data:`PASSED` or
    :data:`FAILED`."""

    outcome: str
    line: str


def _above_zero(number: str) -> bool:
    """Whether ``number`` (decimal digits, of any script) is above zero. Read digit by digit: int() refuses a number
    of more than 4,300 digits, which an output can show."""
    return any(unicodedata.decimal(digit) for digit in number)


def _counts(line: str) -> str | None:
    """The outcome of a count line ("1 failed, 2 passed in 0.3s", "Tests: 1 failed, 3 total", "5 examples, 0
    failures"), None when the line is not one or counts neither passes nor failures."""
    # Not pytest's xfailed / xpassed: expected outcomes, neither a pass nor a failure.
    found = [(number, word.lower()) for number, word in _COUNT.findall(line) if word[0] not in "xX"]
    # Only a count of failures or passes gives an outcome (below): a line without one (a line number before prose
    # that starts with "example" or "todo") is none, whatever else is on it, and need not be read further.
    if not any(w in word for _, word in found for w in _OUTCOME_WORDS):
        return None
    if not _SEPARATED.fullmatch(_TIMING.sub(" ", _COUNT.sub(" ", _LABEL.sub("", line)))):
        return None
    failed = passed = total = False
    fail_word = False
    for number, word in found:
        if any(w in word for w in _FAIL_WORDS):
            fail_word = True
            failed = failed or _above_zero(number)
        elif any(w in word for w in _PASS_WORDS):
            passed = passed or _above_zero(number)
        elif any(w in word for w in _TOTAL_WORDS):
            total = total or _above_zero(number)
    if failed:
        return FAILED
    if passed or (total and fail_word):
        return PASSED
    return None


Rule = Callable[[re.Match[str]], "str | None"]
"""An outcome read from a summary line's match: :data:`PASSED`, :data:`FAILED` or None (the line says nothing)."""


def _fixed(outcome: str) -> Rule:
    return lambda _match: outcome


def _by_group(failing: str) -> Rule:
    """An outcome read from a match's first group: ``failing`` (case-insensitive) means failed."""
    return lambda match: FAILED if match.group(1).lower() == failing else PASSED


def _nonzero(match: re.Match[str]) -> str:
    return FAILED if any(_above_zero(g) for g in match.groups() if g and g.isdigit()) else PASSED


SUMMARIES: tuple[tuple[str, re.Pattern[str], Rule, str | None], ...] = (
    # (runner, pattern on the cleaned line, outcome rule, unit kind for runners that print a line per unit)
    ("pytest", re.compile(r"^no tests ran\b", re.I), _fixed(FAILED), None),
    ("doctest", re.compile(r"^Test Failed\**\s*\d+ failures?"), _fixed(FAILED), None),
    ("doctest", re.compile(r"^Test passed$"), _fixed(PASSED), None),
    ("pytest", re.compile(r"^Interrupted: \d+ errors? during collection", re.I), _fixed(FAILED), None),
    ("unittest", re.compile(r"^FAILED \((?:\w+=\d+(?:, )?)+\)$"), _fixed(FAILED), None),
    ("unittest", re.compile(r"^OK(?: \((?:\w+=\d+(?:, )?)+\))?$"), _fixed(PASSED), "unittest-ok"),
    ("tox", re.compile(r"^(?:ERROR:\s+)?[\w.\-]+: (commands failed|commands succeeded|OK|FAIL\b)"),
     lambda m: PASSED if m.group(1) in ("commands succeeded", "OK") else FAILED, "tox"),
    ("tox", re.compile(r"^congratulations :\)"), _fixed(PASSED), None),
    ("tox", re.compile(r"^evaluation failed :\("), _fixed(FAILED), None),
    ("nox", re.compile(r"^nox > (?:\* [\w.\-()]+: (success|failed|skipped)|Session [\w.\-()]+ (was successful|"
                       r"failed|was skipped))", re.I),
     lambda m: None if "skip" in (m.group(1) or m.group(2) or "") else
     PASSED if (m.group(1) or m.group(2)) in ("success", "was successful") else FAILED, "nox"),
    ("go", re.compile(r"^(ok|FAIL)\s+\S+\s+(?:[\d.]+s|\(cached\)|\[(?:build|setup) failed\]|\[no test files\])"),
     _by_group("fail"), "go"),
    ("go", re.compile(r"^(?:--- )?(FAIL|PASS)(?::\s+\S+.*)?$"), _by_group("fail"), None),
    ("cargo", re.compile(r"^test result: (ok|FAILED)\. \d+ passed; \d+ failed"), _by_group("failed"), "cargo"),
    ("cargo", re.compile(r"^error: (?:test failed|\d+ targets? failed|could not compile)"), _fixed(FAILED), None),
    ("maven", re.compile(r"^Tests run: \d+, Failures: (\d+), Errors: (\d+)"), _nonzero, "maven"),
    ("maven", re.compile(r"^BUILD (SUCCESS|SUCCESSFUL|FAILURE|FAILED)\b"),
     lambda m: PASSED if m.group(1).startswith("SUCCESS") else FAILED, None),
    ("gradle", re.compile(r"^FAILURE: Build failed"), _fixed(FAILED), None),
    ("ctest", re.compile(r"^\d+% tests passed, (\d+) tests? failed out of \d+"), _nonzero, None),
    ("ctest", re.compile(r"^Errors while running CTest"), _fixed(FAILED), None),
    ("npm", re.compile(r"^(?:npm ERR!|npm error|ERR_PNPM_\w+|\S*ELIFECYCLE\b)"), _fixed(FAILED), None),
    ("yarn", re.compile(r"^error Command failed with exit code \d+"), _fixed(FAILED), None),
    ("make", re.compile(r"^(?:g?make)(?:\[\d+\])?: \*\*\* .*Error \d+"), _fixed(FAILED), None),
    ("mypy", re.compile(r"^Success: no issues found"), _fixed(PASSED), None),
    ("linter", re.compile(r"^Found (\d+) errors?\b"), _nonzero, None),
    ("ruff", re.compile(r"^All checks passed!?$"), _fixed(PASSED), None),
    ("eslint", re.compile(r"^[✖x] \d+ problems? \((\d+) errors?"), _nonzero, None),
    # TAP's closing counts (node --test, tap, prove): "# fail 1" (the "#" is cleaned off).
    ("tap", re.compile(r"^(?:fail|failed|not ok) (\d+)$", re.I), _nonzero, None),
)
"""The summary-line table (module docstring). The plain count line ("N passed, N failed", and pytest's, jest's,
vitest's, mocha's, rspec's, minitest's, nextest's and Gradle's forms) is read by :func:`_counts` after these."""

_RAN = re.compile(r"^Ran \d+ tests? in ")


def _clean(line: str) -> str:
    """``line`` without ANSI codes, its leading and trailing decoration (:data:`_LEADING`, :data:`_TRAILING`) and a
    log level prefix. String methods, not one regex substitution: the regex tried the trailing run at every
    character of the line (most of a long output's summary cost)."""
    plain = line.strip()
    if plain and plain[0] not in _LEADING and plain[-1] not in _TRAILING and plain[0] != "[" and "\x1b" not in line:
        return plain  # most lines: nothing around them but whitespace
    if "\x1b" in line:
        line = _ANSI.sub("", line)
    head = _until_fixed(line, lambda text: text.lstrip().lstrip(_LEADING))
    body = _until_fixed(head, lambda text: text.rstrip().rstrip(_TRAILING))
    if not body and len(head) < len(line) and _trailing(line[len(line) - len(head) - 1]):
        body = head  # a trailing run is decoration only after a character that is none ("==<" keeps its "<")
    if body.startswith("["):
        body = _LEVEL.sub("", body)
    return body.strip()


def _until_fixed(text: str, strip: Callable[[str], str]) -> str:
    """``text`` with ``strip`` applied until it removes nothing (whitespace and decoration may alternate)."""
    while len(stripped := strip(text)) < len(text):
        text = stripped
    return text


def _trailing(char: str) -> bool:
    return char.isspace() or char in _TRAILING


LINTERS = frozenset({"mypy", "linter", "ruff", "eslint"})
"""Rows of :data:`SUMMARIES` read only for a check command: their lines ("All checks passed!", "Found 2 errors")
are plain enough for any script to print."""


def _scoped(pattern: re.Pattern[str]) -> str:
    """A row's pattern without its leading ``^``, with its flags scoped to it. Both uses put it where a line starts
    (a match at the start of a line; a look-ahead after a newline), so the anchor says nothing, and without it most
    rows start with a literal the engine rejects a line's first character on in C, where each row was entered in
    turn (a third of the search's cost)."""
    body = pattern.pattern.removeprefix("^")
    return f"(?i:{body})" if pattern.flags & re.I else f"(?:{body})"


_ROWS = re.compile("|".join(_scoped(row[1]) for row in SUMMARIES))
"""Any row's pattern, to match at a line's start: a line it does not match, holding no count either, is no summary
line, found with one match (most lines of an output are none) instead of one search per row."""


_ROW_AT = re.compile("\n(?=" + _ROWS.pattern + ")", re.M)
"""In lines joined by newlines, with one before the first: the newline before each line :data:`_ROWS` matches.
The look-ahead may run on past the line's end, so it finds at least those lines (and is checked line by line)."""


def _candidates(lines: list[str]) -> list[int]:
    """The positions in ``lines`` (cleaned lines) of those that may be summary lines, descending: every line
    :data:`_ROWS` matches or :data:`_COUNT` finds a count in, and maybe a few more (each goes to
    :func:`_classify`). Two searches over the lines joined, instead of two per line: a match in one line is
    a match in the joined text (where ``\\s`` may also run on over a newline into the next line, and so find more)."""
    text = "\n" + "\n".join(lines)
    found = set(_line_numbers(text, _ROW_AT.finditer(text)))
    found.update(_line_numbers(text, _COUNT.finditer(text)))
    return sorted(found, reverse=True)


def _line_numbers(text: str, matches: Iterable[re.Match[str]]) -> Iterator[int]:
    """The line (0 for the first, after the newline ``text`` starts with) each of ``matches`` (in ``text``, in order)
    starts in: the newlines up to its first character, counted on from the previous match's (a few matches in
    most outputs: no table of every line's start)."""
    line, counted = -1, 0
    for match in matches:
        start = match.start() + 1
        line += text.count("\n", counted, start)
        counted = start
        yield line


def _classify(line: str, linters: bool = True) -> tuple[str, str | None] | None:
    """(outcome, unit kind) of one cleaned line, or None when it is no summary line; ``linters``: read the
    :data:`LINTERS` rows too."""
    if _ROWS.match(line):  # some row's pattern matches (each is anchored at the start): the first one decides
        for runner, pattern, rule, unit in SUMMARIES:
            if runner in LINTERS and not linters:
                continue
            match = pattern.match(line)
            if match:
                outcome = rule(match)
                return (outcome, unit) if outcome else None
    outcome = _counts(line)
    return (outcome, "counts") if outcome else None


def _clip(line: str) -> str:
    return line if len(line) <= LINE_CHARS else line[:LINE_CHARS - 1] + "\u2026"


def summary(output: str, check_command: bool = False) -> Summary | None:
    """The latest runner summary in the tail of ``output`` (module docstring), or None when it shows none.
    ``check_command``: the output is a check command's (:func:`is_check_command`), whose linter lines count."""
    tail = output[-TAIL_CHARS:].splitlines()[-TAIL_LINES:]
    lines = [_clean(line) for line in tail]
    candidates = _candidates(lines)  # any other line is no summary line
    for place, n in enumerate(candidates):
        found = _classify(lines[n], check_command)
        if found is None:
            continue
        outcome, unit = found
        if unit == "unittest-ok":
            # A bare "OK" is unittest's only after its "Ran N tests" line (a blank line between them).
            if not any(_RAN.match(lines[k]) for k in range(max(0, n - 4), n)):
                continue
            unit = None
        if unit is not None and unit != "counts":
            for k in candidates[place + 1:]:
                other = _classify(lines[k], check_command)
                if other is not None and other[1] == unit and other[0] == FAILED:
                    return Summary(FAILED, _clip(lines[k]))
        return Summary(outcome, _clip(lines[n]))
    return None


_TAG_ONLY = re.compile(r"^</?[A-Za-z_][\w-]*>$")


def last_line(output: str) -> str:
    """The last line of ``output`` that says something (harness wrapper tags such as ``</output>`` skipped),
    cleaned and clipped to :data:`LINE_CHARS`; "" when there is none."""
    for line in reversed(output[-TAIL_CHARS:].splitlines()):
        cleaned = _clean(line)
        if cleaned and not _TAG_ONLY.match(cleaned) and not _TAG_ONLY.match(line.strip()):
            return _clip(cleaned)
    return ""


# ---- commands --------------------------------------------------------------------------------------------------
_HEREDOC = re.compile(r"<<-?\s*(['\"]?)([A-Za-z_][\w]*)\1")
_COMPOUND = re.compile(r"&&|\|\||\|&|(?<![>&<])&(?![>&])|[;|\n]")
_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
_REDIRECT = re.compile(r"(?<![0-9&>])>>?\s*(?!&|/dev/null\b)[^\s&|;>]")


def strip_heredocs(command: str) -> str:
    """``command`` without the bodies of its heredocs (``<<EOF ... EOF``), which are data, not commands."""
    lines = command.split("\n")
    out: list[str] = []
    end: str | None = None
    for line in lines:
        if end is not None:
            if line.strip() == end:
                end = None
            continue
        out.append(line)
        match = _HEREDOC.search(line)
        if match:
            end = match.group(2)
    return "\n".join(out)


def parts(command: str) -> list[str]:
    """The simple commands of ``command`` (module docstring), heredoc bodies removed, empty parts dropped."""
    return [p.strip() for p in _COMPOUND.split(strip_heredocs(command)) if p.strip()]


def argv(part: str) -> list[str]:
    """The words of one simple command with assignments and wrappers (module docstring) skipped."""
    words = part.split()
    while words:
        head = words[0].rsplit("/", 1)[-1]
        if _ASSIGNMENT.match(words[0]) or head in _WRAPPERS:
            words.pop(0)
        elif head == "timeout":
            words.pop(0)
            while words and (words[0].startswith("-") or words[0][:1].isdigit()):
                words.pop(0)
        elif head in ("npx", "bunx", "pnpx") or (head in _RUN_WRAPPERS and words[1:2] == [_RUN_WRAPPERS[head]]):
            del words[:1 if head in ("npx", "bunx", "pnpx") else 2]
            while words and words[0].startswith("-"):
                words.pop(0)
        else:
            break
    return words


def _name(word: str) -> str:
    return word.rsplit("/", 1)[-1]


def _inspects(part: str) -> bool:
    words = argv(part)
    if not words:
        return True
    if _REDIRECT.search(part):
        return False
    head = _name(words[0])
    if head == "git":
        rest = [w for w in words[1:] if not w.startswith("-")]
        return bool(rest) and rest[0] in GIT_READS
    if head == "sed":
        return not any(w.startswith("-i") or w == "--in-place" or (w.startswith("-") and not w.startswith("--")
                                                                     and "i" in w) for w in words[1:])
    return head in INSPECTION_COMMANDS


def is_inspection(command: str) -> bool:
    """Whether ``command`` only reads state: every part is inspection (module docstring)."""
    return all(_inspects(p) for p in parts(command))


def _checks(part: str) -> bool:
    words = argv(part)
    if not words:
        return False
    head = _name(words[0])
    rest = [w for w in words[1:] if not w.startswith("-")]
    if _PYTHON.match(head):
        if "-m" in words:
            module = words[words.index("-m") + 1:words.index("-m") + 2]
            return bool(module) and module[0].split(".")[0] in _CHECK_MODULES
        script = next((w for w in words[1:] if not w.startswith("-")), "")
        return _name(script) in CHECK_COMMANDS or (_name(script) == "manage.py" and rest[1:2] == ["test"])
    if head in CHECK_COMMANDS or ("/" in words[0] and head in _TEST_SCRIPTS):
        return True
    if head in ("node", "deno", "bun") and any(w == "--test" or w.startswith("--test=") for w in words[1:]):
        return True
    if head.endswith(".py") and head[:-3] in ("runtests", "run_tests", "test", "tests"):
        return True
    subs = _SUB_CHECKS.get(head.removeprefix("./"))
    if subs is not None:
        if rest and rest[0] in subs:
            return True
        if head in ("npm", "yarn", "pnpm", "bun") and rest:
            script = rest[1] if rest[0] == "run" and len(rest) > 1 else rest[0]
            return bool(_SCRIPT_CHECKS.match(script))
    return False


def is_check_command(command: str) -> bool:
    """Whether some part of ``command`` runs tests, a build or a linter (:data:`CHECK_COMMANDS`)."""
    return any(_checks(p) for p in parts(command))


_PIPE = re.compile(r"(?<![|>])\|(?!\|)")


def piped_check(command: str) -> bool:
    """Whether a check in ``command`` writes into a pipe (``pytest | tail -3``): the pipe's exit status is its
    last command's, so the check's own outcome shows only in its output."""
    segments = _PIPE.split(strip_heredocs(command))
    return any(is_check_command(segment) for segment in segments[:-1])


_RUNNER_MISSING = re.compile(
    r"command not found|: not found\s*$|No module named '?(?:pytest|tox|nox|mypy|ruff|flake8|pylint|nose2?)\b"
    r"|is not recognized as an internal or external command|can't open file|^(?:\S*sh|/bin/\S+): .*No such file or "
    r"directory|Unknown command|"
    r"Missing script: |exit(?:ed)?(?: with)?(?: status| code)\s*[:=]?\s*127\b", re.I | re.M)


def runner_missing(output: str) -> bool:
    """Whether a check command's ``output`` (one without a runner summary) says its runner could not start: the
    command or module is missing, or the shell's exit status 127. Such a run did not check anything, for or
    against the change."""
    return _RUNNER_MISSING.search(output[-TAIL_CHARS:]) is not None


def is_search(command: str) -> bool:
    """Whether the last part of ``command`` is a search (:data:`SEARCH_COMMANDS`, ``git grep``), whose exit status
    1 means it found nothing."""
    found = parts(command)
    words = argv(found[-1]) if found else []
    if not words:
        return False
    head = _name(words[0])
    return head in SEARCH_COMMANDS or (head == "git" and words[1:2] == ["grep"])


_CREATORS = frozenset({"cat", "echo", "printf", "tee", "touch", "create", "mkdir", "cp"})
_REDIRECT_TARGET = re.compile(r"(?<![0-9&>])>>?\s*(?!&|/dev/null\b)([^\s&|;>]+)")


def _path(word: str) -> str:
    word = word.strip("'\"")
    return word[2:] if word.startswith("./") else word


def created_paths(part: str) -> tuple[str, ...] | None:
    """The files a simple command creates when that is all it does (``cat > f <<EOF``, ``echo ... > f``, ``touch
    f``, ``tee f``, ``mkdir d``, SWE-agent's ``create f``), else None."""
    words = argv(part)
    if not words or _name(words[0]) not in _CREATORS:
        return None
    head = _name(words[0])
    found = [_path(m) for m in _REDIRECT_TARGET.findall(part)]
    if head in ("touch", "tee", "create", "mkdir"):
        found += [_path(w) for w in words[1:] if not w.startswith("-") and not w.startswith(">")]
    elif head == "cp":
        operands = [w for w in words[1:] if not w.startswith("-")]
        found += [_path(operands[-1])] if len(operands) >= 2 else []
    return tuple(found) if found else None


def removed_paths(part: str) -> tuple[tuple[str, ...], tuple[str, ...]] | None:
    """(removed, created) paths of a simple command that only removes or renames files (``rm``, ``rmdir``,
    ``unlink``, ``git rm``: their operands removed; ``mv SRC... DST``: the sources removed, DST created), else
    None."""
    words = argv(part)
    if not words:
        return None
    head = _name(words[0])
    if head == "git" and words[1:2] == ["rm"]:
        head, words = "rm", words[1:]
    operands = [_path(w) for w in words[1:] if not w.startswith("-")]
    if head in ("rm", "rmdir", "unlink") and operands:
        return tuple(operands), ()
    if head == "mv" and len(operands) >= 2:
        return tuple(operands[:-1]), (operands[-1],)
    return None
