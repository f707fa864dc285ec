"""Which lines of an oversized tool result the model gets, within a token budget (sans-IO).

One selection serves both condensers. Each line gets a rank and a class; :func:`accept` takes lines in rank order
while their estimated costs fit the result's budget (``[supervisor.condense] budget_tokens``), first each class
within its share of the budget (:data:`SHARES`), then whatever still fits; :mod:`.reconstruct` renders them and
trims the latest taken until the measured text fits.

**The deterministic condenser** (no model) ranks, highest first (each line once, at its highest rank):

1. ``lead``: the lines new against the last green run of the same command (:mod:`.baseline`), when given;
2. ``edge``: the last 3 non-blank lines (the runner's verdict) and the first 2 (the command);
3. ``diagnostic``: the first line of each diagnostic template (:mod:`.signals`, :mod:`.mask`), alternating from
   the start and the end of the output (a build's first error is its cause, a test run's end its summary); the
   last occurrence of each repeated template; the command line (``+ cmd``, ``$ cmd``) heading each diagnostic's
   region; the failure sections holding diagnostics, smallest first, whole when at most :data:`SECTION_LINES`
   lines (a section runs from a rule line such as ``____ test_x ____``, ``=====`` or ``-----`` at the start of a
   line to the next, a short one before it being its heading; sections whose diagnostics and the lines before them
   have the same templates count once), else their outline (head, and the lines around pytest's ``_ _ _`` frame
   rules); the lines indented under each distinct diagnostic (a stack trace, a compiler's source excerpt);
4. ``focus``: per task or argument term found on at most max(8, 2%) of the lines, rarest first, its matches and the
   indented blocks they open (a definition in a file dump);
5. ``context``: 2 lines around each distinct diagnostic and focus match; the last 12 and first 6 lines; the lines
   within :data:`NEAR` lines of them, nearest first;
6. ``fill``: the rest, two from the head for each from the tail, as a truncating tool would keep them.

**A model's** ``extract`` verdict ranks its ``chosen`` lines first, then the distinct diagnostics, the last
occurrences and 2 lines of context around the distinct ones: the diagnostics share the budget with its choice.

Repeats of a diagnostic template other than the first and last are taken only inside a failure section shown
whole: the rendering notes their count and line numbers instead (:class:`Group`). Lines longer than
:data:`CLIP_CHARS` cost what their clipped rendering costs.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from .mask import template
from .signals import diagnostic_lines
from .text import body_of, count_each

T = TypeVar("T")
CLIP_CHARS = 500
"""Lines longer than this many characters are clipped in the rendering (head and tail, the cut marked)."""
CLIP_HEAD = 240
CLIP_TAIL = 120
SECTION_LINES = 60
HEADING_LINES = 6
CONTINUATION_LINES = 12
NEAR = 12
MASK_CHARS = 2_000
"""Only a line's first characters make its template: it bounds the cost of a 1 MB line."""
_EDGE_TAIL = 3
_EDGE_HEAD = 2
_MARKER_TOKENS = 16
GAP_MARKER_TOKENS = 16
GROUP_NOTE_TOKENS = 32
"""Tokens of one ``[… N lines omitted: original lines A-B …]`` marker (measured: 12-16), and of one repeated
diagnostic's note (measured: about 32)."""

_PREFIX = re.compile(r"^(?:\d{4}-\d\d-\d\dT[\d:.]+Z? |\[[A-Za-z]+\] ?)")
_RULE = re.compile(r"^([=_\-*~#])\1{4,}(?:.*\1{4,})?\s*$")
_COMMAND = re.compile(r"^[+$] \S")
_SPACED_RULE = re.compile(r"^([=_\-*~#]) (?:\1 ){3,}\1?\s*$")
_NUMBERED = re.compile(r"^\s*\d+(?:\t|\| |: )")


@dataclass(frozen=True)
class Group:
    """A repeated diagnostic ``template`` and every 1-based line it occurs on (at least two)."""

    template: str
    lines: tuple[int, ...]


@dataclass(frozen=True)
class Facts:
    """What the selection knows about each line (0-based lists over the result's lines): ``bodies`` (without
    terminators), ``templates`` (:func:`~.mask.template`), ``tokens`` of each body, the ``diagnostics``' indexes and
    the repeated diagnostic ``groups``."""

    bodies: list[str]
    templates: list[str]
    tokens: list[int]
    diagnostics: list[int]
    groups: dict[str, Group] = field(default_factory=dict)
    noted: frozenset[int] = frozenset()
    """The first lines of the ``groups`` (0-based): a note follows each in the rendering."""

    @classmethod
    def of(cls, lines: Sequence[str]) -> Facts:
        """The facts of ``lines`` (from :func:`~.text.split_lines`)."""
        bodies = [body_of(line) for line in lines]
        templates = [template(body[:MASK_CHARS]) for body in bodies]
        diagnostics = diagnostic_lines(list(lines))
        by_template: dict[str, list[int]] = {}
        for i in diagnostics:
            by_template.setdefault(templates[i], []).append(i + 1)
        groups = {t: Group(t, tuple(found)) for t, found in by_template.items() if len(found) > 1}
        return cls(bodies, templates, count_each(bodies), diagnostics, groups,
                   frozenset(g.lines[0] - 1 for g in groups.values()))

    def cost(self, i: int) -> int:
        """Estimated tokens of line ``i`` in the rendering (clipped when long, plus its newline, plus the note
        that follows the first occurrence of a repeated diagnostic)."""
        length = len(self.bodies[i])
        note = GROUP_NOTE_TOKENS if i in self.noted else 0
        if length <= CLIP_CHARS:
            return self.tokens[i] + 1 + note
        return self.tokens[i] * (CLIP_HEAD + CLIP_TAIL) // length + _MARKER_TOKENS + note


SHARES = {"lead": 0.5, "chosen": 0.7, "diagnostic": 0.7, "focus": 0.3, "context": 0.15, "fill": 0.0}
"""The most of the budget each class of lines may take before every class has had its turn (module docstring)."""


@dataclass(frozen=True)
class Ranked:
    """The lines of a result in rank order (0-based, each once), each with its class (``lead``, ``edge``,
    ``chosen``, ``diagnostic``, ``focus``, ``context``, ``fill``)."""

    order: list[int]
    classes: list[str]


def rank(facts: Facts, terms: Sequence[str] = (), *, chosen: Iterable[int] | None = None,
         lead: Sequence[int] = ()) -> Ranked:
    """The rank order of the module docstring. ``terms``: lowercase focus terms; ``chosen``: the 1-based lines a
    model chose (None: the deterministic condenser); ``lead``: 0-based lines new against the last green run."""
    total = len(facts.bodies)
    order: list[int] = []
    classes: list[str] = []
    seen: set[int] = set()

    def push(kind: str, indexes: Iterable[int]) -> None:
        for i in indexes:
            if 0 <= i < total and i not in seen:
                seen.add(i)
                order.append(i)
                classes.append(kind)

    first_of: dict[str, int] = {}
    for i, key in enumerate(facts.templates):
        first_of.setdefault(key, i)
    repeated = {n - 1 for g in facts.groups.values() for n in g.lines[1:-1]}
    distinct = [i for i in facts.diagnostics if first_of[facts.templates[i]] == i]
    if chosen is not None:
        picked = sorted(n - 1 for n in chosen)
        push("chosen", picked)
        push("diagnostic", _alternate(distinct))
        push("diagnostic", (g.lines[-1] - 1 for g in facts.groups.values()))
        push("context", (i for i in sorted(_around(distinct, total, 2)) if i not in repeated))
        return Ranked(order, classes)

    diagnostic = set(facts.diagnostics)
    push("lead", sorted(lead, key=lambda i: (i not in diagnostic, i)))
    nonblank = [i for i in range(total) if facts.bodies[i].strip()]
    push("edge", reversed(nonblank[-_EDGE_TAIL:]))
    push("edge", range(_EDGE_HEAD))
    push("diagnostic", _alternate(distinct))
    push("diagnostic", (g.lines[-1] - 1 for g in facts.groups.values()))
    push("diagnostic", _commands(facts, distinct))
    for unit in _units(facts, distinct):
        push("diagnostic", unit)
    focus: list[int] = []
    for hits in _focus(facts, terms):
        # Each term's matches, then the blocks they open, before the next (commoner) term's.
        push("focus", hits)
        for block in _blocks(facts, hits):
            push("focus", block)
        focus.extend(hits)
    anchors = sorted(set(distinct) | set(focus) | set(lead))
    push("context", (i for i in sorted(_around(anchors, total, 2)) if i not in repeated))
    push("edge", (i for i in range(total - 1, max(-1, total - 13), -1) if i not in repeated))
    push("edge", (i for i in range(min(6, total)) if i not in repeated))
    near = sorted((distance, i) for i, distance in _distances(anchors, total) if i not in seen and i not in repeated)
    push("context", (i for _, i in near))
    # Nothing left that the output itself points at: the head and the tail, as a truncating tool would (2:1).
    rest = [i for i in range(total) if i not in seen and i not in repeated]
    cut = (2 * len(rest) + 2) // 3
    push("fill", _interleave(rest[:cut], rest[cut:][::-1]))
    return Ranked(order, classes)


def accept(facts: Facts, ranked: Ranked, budget: int) -> list[int]:
    """The lines of ``ranked`` whose estimated costs fit ``budget`` tokens, in the order taken: first each class
    within its share (:data:`SHARES`), in rank order, then whatever still fits, in rank order. A line's cost counts
    the gap marker it adds (or saves) next to the lines taken before it. A line that does not fit is skipped; later
    smaller ones may still fit. Trimming from the end drops the latest taken first."""
    used = 0
    spent: dict[str, int] = {}
    taken: dict[int, None] = {}
    for capped in (True, False):
        for i, kind in zip(ranked.order, ranked.classes):
            if i in taken:
                continue
            # A line opening a run of its own adds a gap marker; one joining two runs saves one.
            runs = 1 - (i - 1 in taken) - (i + 1 in taken)
            cost = max(0, facts.cost(i) + runs * GAP_MARKER_TOKENS)
            share = SHARES.get(kind)
            if capped and share is not None and spent.get(kind, 0) + cost > budget * share:
                continue
            if used + cost <= budget:
                taken[i] = None
                used += cost
                spent[kind] = spent.get(kind, 0) + cost
    return list(taken)


def _alternate(indexes: list[T]) -> list[T]:
    """``indexes`` from both ends inwards: first, last, second, second-to-last, ..."""
    out: list[T] = []
    low, high = 0, len(indexes) - 1
    while low <= high:
        out.append(indexes[low])
        if high != low:
            out.append(indexes[high])
        low, high = low + 1, high - 1
    return out


def _interleave(first: list[int], second: list[int]) -> list[int]:
    """Two items of ``first`` for each of ``second``, then what remains of either."""
    out: list[int] = []
    a = b = 0
    while a < len(first) or b < len(second):
        out.extend(first[a:a + 2])
        a += 2
        out.extend(second[b:b + 1])
        b += 1
    return out


def _stripped(body: str) -> str:
    return _PREFIX.sub("", body, count=1)


def _commands(facts: Facts, distinct: list[int]) -> list[int]:
    """The nearest command line (``+ cmd``, ``$ cmd``) before each of ``distinct``, first diagnostic first."""
    commands = [i for i, body in enumerate(facts.bodies) if _COMMAND.match(_stripped(body))]
    out: list[int] = []
    position = 0
    for i in sorted(distinct):
        while position < len(commands) and commands[position] < i:
            position += 1
        if position and commands[position - 1] not in out:
            out.append(commands[position - 1])
    return out


def _focus(facts: Facts, terms: Sequence[str]) -> list[list[int]]:
    """The lines matching each discriminating term (at most max(8, 2%) of the lines), rarest term first."""
    if not terms:
        return []
    lower = [body[:MASK_CHARS].lower() for body in facts.bodies]
    hits = {term: [i for i, line in enumerate(lower) if term in line] for term in terms}
    rare = max(8, len(lower) // 50)
    return [hits[t] for t in sorted((t for t in terms if 0 < len(hits[t]) <= rare), key=lambda t: len(hits[t]))]


def _units(facts: Facts, distinct: list[int]) -> list[list[int]]:
    """The failure sections, then the continuations of ``distinct`` diagnostics (module docstring, rank 6), each
    list from both ends of the output inwards."""
    continuations = [unit for unit in (_continuation(facts, i) for i in distinct) if unit]
    return _sections(facts) + _alternate(continuations)


def _sections(facts: Facts) -> list[list[int]]:
    rules = [i for i, body in enumerate(facts.bodies) if _RULE.match(_stripped(body))]
    if not rules:
        return []
    diagnostic, ruled = set(facts.diagnostics), set(rules)
    out: list[list[int]] = []
    large: list[list[int]] = []
    signatures: set[frozenset[str]] = set()
    bounds = [*rules, len(facts.bodies)]
    spans = list(zip(bounds, bounds[1:]))
    start = None
    for k, (first, end) in enumerate(spans):
        start = first if start is None else start
        # A short section is the heading of the next (unittest's "FAIL: test_x" between "====" and "----").
        if end - first <= HEADING_LINES and k + 1 < len(spans):
            continue
        inside = [i for i in range(start, end) if i in diagnostic and i not in ruled]
        if inside and end - start > SECTION_LINES:
            large.append(_outline(facts, start, end))
        elif inside:
            # The line before a diagnostic is its site (the failing assertion, the raising call): it tells apart
            # two failures whose messages mask alike, where the sections' titles (test names) would group none.
            signature = frozenset(facts.templates[j] for i in inside for j in (i - 1, i) if j >= start)
            if signature not in signatures:
                signatures.add(signature)
                out.append(list(range(start, end)))
        start = None
    return sorted(out, key=len) + large


def _outline(facts: Facts, start: int, end: int) -> list[int]:
    """The outline of a failure section too long to show whole: its first :data:`HEADING_LINES` lines and the
    lines around each spaced rule inside it (pytest's ``_ _ _ _`` between the frames of a traceback, where each
    frame's failing line and locals are)."""
    out = list(range(start, min(end, start + HEADING_LINES)))
    for i in range(start, end):
        if _SPACED_RULE.match(facts.bodies[i]):
            out.extend(range(max(start, i - HEADING_LINES), min(end, i + HEADING_LINES + 1)))
    return sorted(set(out))


def _indent(body: str) -> int:
    stripped = _stripped(body)
    return len(stripped) - len(stripped.lstrip())


def _continuation(facts: Facts, i: int) -> list[int]:
    """The lines indented deeper than diagnostic ``i`` right after it (a stack trace, a compiler's source excerpt),
    at most :data:`CONTINUATION_LINES`; empty when there are none."""
    depth = _indent(facts.bodies[i])
    out: list[int] = []
    for j in range(i + 1, min(len(facts.bodies), i + 1 + CONTINUATION_LINES)):
        body = facts.bodies[j]
        if not _stripped(body).strip() or _indent(body) <= depth:
            break
        out.append(j)
    return [i, *out] if out else []


def _blocks(facts: Facts, focus: list[int]) -> list[list[int]]:
    """For each focus match that opens an indented block (a definition in a file dump, a YAML key), the block:
    the lines after it up to the next non-blank line at its own depth or above it twice in a row, at most
    :data:`SECTION_LINES`. A single shallower line amid deeper ones (a broken indentation) does not end it."""
    out = []
    total = len(facts.bodies)
    for i in focus:
        depth = _code_indent(facts.bodies[i])
        block: list[int] = []
        j = i + 1
        while j < total and len(block) < SECTION_LINES:
            body = facts.bodies[j]
            if _code_text(body).strip():
                level = _code_indent(body)
                if level == depth or (level < depth and not _deeper_next(facts, j, depth)):
                    break
            block.append(j)
            j += 1
        if any(_code_text(facts.bodies[k]).strip() and _code_indent(facts.bodies[k]) > depth for k in block):
            out.append(block)
    return out


def _deeper_next(facts: Facts, j: int, depth: int) -> bool:
    for k in range(j + 1, min(len(facts.bodies), j + 4)):
        if _code_text(facts.bodies[k]).strip():
            return _code_indent(facts.bodies[k]) > depth
    return False


def _code_text(body: str) -> str:
    """``body`` without a line-number prefix of ``cat -n``, ``nl`` or a numbered view (``  42\t``, ``42| ``)."""
    return _NUMBERED.sub("", body, count=1)


def _code_indent(body: str) -> int:
    text = _code_text(body).expandtabs(4)
    return len(text) - len(text.lstrip())


def _around(anchors: Iterable[int], total: int, context: int) -> set[int]:
    out: set[int] = set()
    for i in anchors:
        out.update(range(max(0, i - context), min(total, i + context + 1)))
    return out


def _distances(anchors: list[int], total: int) -> list[tuple[int, int]]:
    """(index, distance to the nearest anchor) for every index within :data:`NEAR` of one."""
    best: dict[int, int] = {}
    for a in anchors:
        for i in range(max(0, a - NEAR), min(total, a + NEAR + 1)):
            d = abs(i - a)
            if d < best.get(i, NEAR + 1):
                best[i] = d
    return sorted(best.items())
