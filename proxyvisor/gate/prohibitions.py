"""The user's explicit prohibitions, taken verbatim from their messages: they bind the verifier and are recited.

Rules (``reference/in-session-supervisor-mechanics.md`` section 4, "Recitation", the "Constraints from the
request" list; seed 003 "Verify-gate": "a forbidden check's absence is compliance, not a gap", and "a standing
verification prohibition persists until you explicitly change it"):

- A message is cut into **units**: lines, then sentences (ending in ``.``, ``!`` or ``;``).
- A unit is a prohibition when it holds (case-insensitive) a **marker** (:data:`_FORBIDDING`) of one of these
  shapes, whatever it forbids (changing, running, touching a path, an action such as pushing or installing):

  - a negation before the forbidden action: ``do not``, ``don't``, ``dont``, ``never``, ``must not``,
    ``mustn't``, ``not to`` ("make sure not to push"), ``refrain from``; or after it: ``not allowed``,
    ``not permitted``, ``forbidden``;
  - ``no`` before an action noun (edits, changes, modifications, writes, commits, pushes, installs, deletions, new
    files, refactoring...), at the start of a unit, after ``:``, ``;`` or a dash, or after ``please``, ``just``,
    ``make``: "read-only: no edits", "No changes to the public API", "make no commits" (a fact such as "it ran
    but no changes were made" or "(no writes found)" holds no marker);
  - ``without`` or ``avoid`` before an action's gerund: "fix it without modifying the tests", "avoid touching
    the CI config" (``without running``/``executing`` too; "avoid running out of memory" is no rule);
  - a **change mode**, forbidding any change to what it names (or to anything): ``read-only``, ``readonly``,
    ``read only`` (at a clause's end or after ``is``, ``as``, ``stay``...: "I read only the first file" states no
    rule), ``leave X alone``/``untouched``/``unchanged``/``as is``, ``keep X unchanged``/``untouched``/``intact``,
    ``hands off``, ``stay out of``. Such a rule forbids what editing tools and writing commands do: its words
    (:func:`forbidden_words`) include the change actions (edit, modify, change, write, touch).
- Skipped: lines inside code fences, blockquotes (``>``), box-drawing UI lines (U+2500-U+257F), ``NN:`` excerpts
  (a line number and a colon, as tools print file lines), log lines (:data:`_LOG`: a level such as ``WARNING:``,
  ``[error]`` or ``INFO``, a timestamp, or a ``path:line`` first: a program's words pasted, in a message of any
  length), questions (ending in ``?``) and quote-led units (they quote someone else's words).
- A marker inside a quoted span (straight ``"..."`` or typographic double quotes, backticks) is someone else's
  words, not the user's rule: ``The README says "do not edit generated files".`` states no prohibition.
- At most :data:`MAX_ITEMS` (8) items of at most :data:`MAX_CHARS` (200) characters each, first ones kept,
  duplicates dropped.

**Standing prohibitions** (:func:`standing`): every genuine user turn of a thread is read, in order (harness
re-prompts and tool results are not user turns; the caller passes only genuine ones). A prohibition stays in
force, with its source turn, until a later turn lifts it with an explicit **permission**:

- a permission is a *clause* (a unit cut at ``,``, ``:`` and ``but``) without a prohibition marker that either
  holds a permission marker (:data:`PERMISSION_MARKERS`: ``you can``, ``you may``, ``feel free to``, ``go ahead``,
  ``allowed to``, ``it's fine to``, ...; what it allows is the text after the marker), or is an imperative of the
  prohibition's own action: it starts, after interjections such as ``ok``, ``now``, ``please``, with the word that
  follows the prohibition's marker (``run`` in "do not run the tests": "ok, now run them"), or, for a change mode,
  with a change action ("ok, edit it now" after "read-only");
- the clause lifts a prohibition when they name the same thing, by **content words** (lowercase words without
  stop words, lightly stemmed: ``tests``/``test``, ``running``/``run``, ``migrations/``/``migration``; the words
  after the prohibition's marker, or all its words when nothing follows the marker; a change mode's words but its
  markers', with the change actions): either every content word of
  the prohibition is in the permission ("you can run the tests now" lifts "do not run the tests"; "feel free to
  edit migrations/" lifts "do not edit migrations/"), or the permission names the prohibition's action and
  nothing the prohibition does not ("go ahead and push" lifts "never push to main"; "ok, now run them" lifts "do
  not run the tests", "them" being no content word; "you can edit src/ now" lifts "treat src/ as read-only"). A
  permission naming something else ("you can run the linter")
  lifts nothing; one that names nothing ("go ahead.") lifts nothing. When in doubt the prohibition stays: a
  prohibition wrongly kept costs a missing check, one wrongly lifted lets the agent do what the user forbade;
- a turn's permissions lift only earlier turns' prohibitions (one message saying "do not run the tests, you can
  run the linter" keeps its own); then the turn's own prohibitions are added; one already in force keeps its
  first source turn; at most :data:`MAX_ITEMS` stay in force, the most recently stated kept.

Pure functions; no I/O.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

MAX_ITEMS = 8
MAX_CHARS = 200
_CHANGE_NOUNS = (r"edits?|editing|changes|modifications?|writes|writing|commits?|committing|push(?:es|ing)?|"
                 r"force[- ]push(?:es|ing)?|installs?|installing|deletions?|deleting|new files?|refactors?|refactoring")
_CHANGE_GERUNDS = (r"modifying|editing|changing|touching|writing|committing|pushing|deleting|removing|installing|"
                   r"renaming|moving|overwriting|reformatting|refactoring")
_FORBIDDING = re.compile(
    r"\b(?:do not|don'?t|never|must not|mustn'?t|not to|refrain from)\s+"
    r"|\bnot (?:allowed|permitted)\b|\bforbidden\b"
    rf"|(?:^|[:;\u2013\u2014]\s*|\b(?:please|just|make)\s+)no\s+(?:more\s+|further\s+)?"
    rf"(?=(?:{_CHANGE_NOUNS})\b)"
    rf"|\bwithout\s+(?=(?:{_CHANGE_GERUNDS}|running|executing)\b)|\bavoid\s+(?=(?:{_CHANGE_GERUNDS})\b)"
    r"|(?P<change>\bread-only\b|\breadonly\b|\bread only(?=\s*(?:[:;,.!)]|$))"
    r"|\b(?:be|is|are|as|stay|remain|strictly|keep it) read only\b|\bhands off\b|\bstay out of\b"
    r"|\b(?:leave|keep)\s+(?=.{1,80}?\s(?:alone|untouched|unchanged|intact|as[- ]is)\b))")
"""The markers of a prohibition (module docstring), searched in lowercased text whose typographic apostrophes
became ``'`` and whose quoted spans are blanked (:func:`_unquoted`). A match ends where the forbidden action's
words begin; the ``change`` group is a change mode."""
PERMISSION_MARKERS = (
    "you can ", "you may ", "you're allowed to ", "you are allowed to ", "allowed to ", "you're free to ",
    "you are free to ", "feel free to ", "go ahead", "permission to ", "it's ok to ", "it's okay to ",
    "it's fine to ", "it is ok to ", "it is okay to ", "it is fine to ", "is allowed", "are allowed", "is fine now",
    "is ok now", "is okay now")
"""Phrases that make a clause a permission (matched in lowercased text whose typographic apostrophes became
``'``); what the clause allows is the text
after them (before them for ``is allowed``-style endings: "running the tests is allowed now")."""
_SENTENCE = re.compile(r"(?<=[.!;])\s+")
_CLAUSE = re.compile(r"[,:]\s*|\s+but\s+", re.IGNORECASE)
_BOX = re.compile("[\u2500-\u257f]")
_EXCERPT = re.compile(r"^\s*\d+\s*:")
_LOG = re.compile(
    r"\[?(?:(?i:trace|debug|info|notice|warn|warning|error|err|critical|fatal|severe|panic)(?:\]|:)"
    r"|(?:TRACE|DEBUG|INFO|NOTICE|WARN|WARNING|ERROR|ERR|CRITICAL|FATAL|SEVERE|PANIC)\b)"
    r"|\[?\d{4}-\d\d-\d\d[T ]\d\d:\d\d|\[?\d\d:\d\d:\d\d"
    r"|\[?(?i:jan|feb|mar|apr|may|jun|jul|aug|sep|oct|nov|dec)[a-z]* +\d{1,2},? +(?:\d{4} +)?\d\d:\d\d"
    r"|(?:[\w.~-]*/)*[\w.-]+\.[A-Za-z]\w*:\d+|File \"[^\"]+\", line \d+")
"""The start of a log line (a stripped line, matched at its start): a level (``WARNING:``, ``[error]``, ``ERROR``
in capitals), a timestamp (``2026-12-04 20:06:45``, ``20:06:45``, ``Dec  4 20:06``) or a source position
(``src/app.py:12``, ``File "x.py", line 3``)."""
_QUOTES = "\"'\u201c\u2018`"
_QUOTED = re.compile('"[^"]*"|\u201c[^\u201d]*\u201d|`[^`]*`')
"""Quoted spans within a unit; single quotes are left alone, being apostrophes as often as quotes."""
_WORD = re.compile(r"[a-z0-9_]+")
_INTERJECTIONS = frozenset(
    "ok okay alright right sure yes yeah great good fine thanks now please then so and also just".split())
_STOP = _INTERJECTIONS | frozenset("""
    a an the this that these those it its them they their there here i me my myself we us our you your yourself
    he she him her his is are was were be been being am do does did done don doesn didn t s not no never must
    should shall will would can could may might cannot won isn aren wasn to of in on at by for with from into
    onto about over under as or if any all some more anymore yet again ahead go feel free allowed permitted
    permission ok fine forbidden let lets what which who when until before after than too very really one
    alone untouched unchanged intact
    """.split())


@dataclass(frozen=True, slots=True)
class Standing:
    """A prohibition in force: ``text``, verbatim (trimmed, at most :data:`MAX_CHARS` characters), and ``turn``,
    the source turn's id as the caller numbered the turns (``proxyvisor.proxy.planning``: the 1-based ordinal of the
    genuine user turn in the thread)."""

    text: str
    turn: int


SCAN_CHARS = 8_000
"""A request longer than twice this is read at its first and last this many characters (:func:`units`)."""


def _read(request: str) -> str:
    """What :func:`units` reads of ``request``: all of it, or, past ``2 * SCAN_CHARS``, its first and last lines
    within ``SCAN_CHARS`` each. A person's instruction opens or closes what they typed; the middle of a pasted log
    or file is data, and reading megabytes of it cost seconds per request. A code fence opened in the part left
    out stays open in the part read after it."""
    if len(request) <= 2 * SCAN_CHARS:
        return request
    cut = request.rfind("\n", 0, SCAN_CHARS)
    head = request[:cut if cut > 0 else SCAN_CHARS]
    start = request.find("\n", len(request) - SCAN_CHARS)
    tail = request[start + 1 if start >= 0 else len(request) - SCAN_CHARS:]
    middle = request[len(head):len(request) - len(tail)]
    fences = sum(middle.count(mark) for mark in ("\n```", "\n~~~", "\n ```", "\n ~~~"))
    return head + ("\n```\n" if fences % 2 else "\n") + tail


def units(request: str) -> Iterator[str]:
    """The units of ``request`` that may state a rule: not skipped (module docstring), not questions or quotes;
    of a long request, those in its first and last :data:`SCAN_CHARS` characters (:func:`_read`)."""
    fenced = False
    for line in _read(request).splitlines():
        stripped = line.strip()
        if stripped.startswith(("```", "~~~")):
            fenced = not fenced
            continue
        if fenced or stripped.startswith(">") or _BOX.search(stripped) or _EXCERPT.match(stripped) \
                or _LOG.match(stripped):
            continue
        for unit in _SENTENCE.split(stripped):
            unit = unit.strip()
            if unit and not unit.endswith("?") and unit[0] not in _QUOTES:
                yield unit


def _norm(text: str) -> str:
    return text.lower().replace("\u2019", "'") + " "


def _unquoted(text: str) -> str:
    """``text`` lowered (:func:`_norm`) with its quoted spans blanked (same length, so offsets hold): where
    markers are looked for."""
    return _QUOTED.sub(lambda m: " " * len(m.group()), _norm(text))


def _forbids(text: str) -> bool:
    return _FORBIDDING.search(_unquoted(text)) is not None


def prohibitions(request: str) -> tuple[str, ...]:
    """The prohibitions stated in ``request``, verbatim (trimmed, clipped to :data:`MAX_CHARS` characters)."""
    found: list[str] = []
    for unit in units(request):
        if not _forbids(unit):
            continue
        unit = unit if len(unit) <= MAX_CHARS else unit[:MAX_CHARS - 1] + "\u2026"
        if unit not in found:
            found.append(unit)
        if len(found) == MAX_ITEMS:
            break
    return tuple(found)


def _stem(word: str) -> str:
    """A light English stem, enough to match one word's forms across two messages (not a linguistic stemmer)."""
    for suffix in ("ing", "ed"):
        if word.endswith(suffix) and len(word) - len(suffix) >= 3:
            word = word[:-len(suffix)]
            if word[-1] == word[-2] and word[-1] not in "lsz":  # running -> run, committed -> commit
                word = word[:-1]
            break
    else:
        if word.endswith("ies") and len(word) > 4:
            word = word[:-3] + "y"
        elif word.endswith(("ches", "shes", "sses", "xes", "zes")):
            word = word[:-2]
        elif word.endswith("s") and not word.endswith(("ss", "us", "is")) and len(word) > 3:
            word = word[:-1]
    return word[:-1] if word.endswith("e") and len(word) > 4 else word


def _words(text: str) -> list[str]:
    return _WORD.findall(_norm(text))


def _content(words: Iterable[str]) -> frozenset[str]:
    return frozenset(_stem(w) for w in words if len(w) > 1 and w not in _STOP)


def content_words(text: str) -> frozenset[str]:
    """The content words of ``text`` as prohibitions and permissions are matched by (module docstring): lowercase,
    stop words dropped, lightly stemmed."""
    return _content(_words(text))


_CHANGES = ("edit", "modify", "change", "write", "touch")
"""The actions a change mode forbids (module docstring), as content words."""
_FILLERS = ("to", "be", "ever", "even", "please", "no", "any", "make")
"""Words between a marker and the forbidden action ("do not ever run", "make no edits")."""


@dataclass(frozen=True, slots=True)
class _Rule:
    """A prohibition as :func:`_lifts` reads it: its content words, its actions as content words and the words an
    imperative of its action starts with (a negation's: the word after its marker; a change mode's: the change
    actions)."""

    words: frozenset[str]
    actions: frozenset[str]
    verbs: frozenset[str]


def _marked(text: str) -> tuple[str, str, bool]:
    """(``text`` lowered, the same with its markers blanked, whether one of them is a change mode)."""
    found = list(_FORBIDDING.finditer(_unquoted(text)))
    blanked = list(_norm(text))
    for match in found:
        start, end = match.span()
        blanked[start:end] = " " * (end - start)
    return _norm(text), "".join(blanked), any(match.group("change") for match in found)


def forbidden_words(text: str) -> frozenset[str]:
    """The content words of what the prohibition ``text`` forbids: its words but its markers' (a rule
    "read-only" names no reading), with the change actions for a change mode (module docstring). What the
    authorizer's pre-screen looks for in a tool call."""
    _lowered, blanked, change = _marked(text)
    words = _content(_words(blanked))
    return words | content_words(" ".join(_CHANGES)) if change else words


def _rule(text: str) -> _Rule:
    lowered, blanked, change = _marked(text)
    found = _FORBIDDING.search(_unquoted(text))
    after = [w for w in _words(lowered[found.end():]) if w not in _FILLERS] if found else []
    if change:
        return _Rule(forbidden_words(text), content_words(" ".join(_CHANGES)), frozenset(_CHANGES))
    lead = after[:1]
    return _Rule(_content(after) or _content(_words(blanked)), frozenset(map(_stem, lead)), frozenset(lead))


def _clauses(request: str) -> Iterator[str]:
    for unit in units(request):
        for clause in _CLAUSE.split(unit):
            if clause.strip() and not _forbids(clause):
                yield clause.strip()


def _lifts(clause: str, rule: _Rule) -> bool:
    """Whether the permission ``clause`` lifts ``rule`` (module docstring)."""
    lowered = _norm(clause)
    marked = [m for m in PERMISSION_MARKERS if m in lowered]
    if marked:
        marker = marked[0]
        at = lowered.find(marker)
        after = _content(_words(lowered[at + len(marker):]))
        allowed = after or (_content(_words(lowered[:at])) if marker.startswith(("is ", "are ")) else frozenset())
    else:
        words = _words(lowered)
        while words and words[0] in _INTERJECTIONS:
            words.pop(0)
        if not words or words[0] not in rule.verbs:
            return False
        allowed = _content(words)
    if not allowed or not rule.words:
        return False
    return rule.words <= allowed or (allowed <= rule.words and not allowed.isdisjoint(rule.actions))


def standing(turns: Iterable[tuple[int, str]], prior: Sequence[Standing] = ()) -> tuple[Standing, ...]:
    """The prohibitions in force after the user turns ``turns`` (``(turn id, text)``, oldest first, genuine user
    turns only), starting from those in force before them, ``prior`` (module docstring), oldest first."""
    force = list(prior)
    for turn, text in turns:
        clauses = list(_clauses(text))
        if clauses and force:
            force = [s for s in force if not any(_lifts(c, _rule(s.text)) for c in clauses)]
        held = {s.text for s in force}
        force += [Standing(p, turn) for p in prohibitions(text) if p not in held]
    return tuple(force[-MAX_ITEMS:])


_RUN = re.compile(r"\b(?:run|running|rerun|re-run|execute|executing|invoke|launch|start|trigger)\b", re.I)
_CHECK = re.compile(r"\b(?:tests?|test suite|suite|pytest|unittest|checks?|linters?|lint|build|builds|ci|tox|"
                    r"npm test|go test|cargo test|make)\b", re.I)


def forbids_checks(found: tuple[str, ...] | list[str]) -> bool:
    """Whether any of the prohibitions ``found`` (:func:`prohibitions`' items) forbids running the project's checks:
    it names a way of running (run, execute, invoke...) and a check (tests, a build, a linter...). "Do not modify
    the tests" forbids no run."""
    return any(_RUN.search(p) and _CHECK.search(p) for p in found)
