"""Distilling a finished turn (or a session's last one) into grounded records: the free part, the pre-screen that
decides whether one supervisor-model call could learn more, and that call's input and answer. Pure.

Each user turn is read up to ``proxyvisor.learning.memory.READ_CHARS`` characters for free rules, and up to
:data:`TURN_CHARS`, what the call is shown of it, by the pre-screen and the call's grounding.

**Free records** (:func:`free_records`, no model call):

- rules: each unit of a genuine user turn (``proxyvisor.gate.prohibitions.units``) that is a *durable*
  instruction: it, or a clause of it after a colon or a semicolon ("We switched tooling: always use pip"), opens with a marker of permanence (:data:`DURABLE`: ``always``, ``never``, ``from now on``, ``in
  this project`` ...) and it holds none of a task-local or conditional one (:data:`LOCAL`: ``this time``, ``for now``, ``in this
  task``, ``today``, ``if``, ``unless`` ...); the quote is the unit, verbatim, its source the turn;
- orientation: the turn's latest check when it passed (the command that runs the project's checks), citing the
  action;
- experience: the turn's request with the gate's label (``verified``, ``failed``, ``unknown``; the gate's
  ``unverified`` is ``unknown``), once the gate judged the turn.

**Pre-screen** (:func:`worth_asking`): the model is asked only when a user turn holds an instruction the free rules
did not take (an imperative marker, :data:`INSTRUCTIVE`, in a unit that is neither durable-marked nor local), a
successful action ran that no orientation record cites yet, or the self-report named memory candidates that are
no record's id; otherwise the call would have nothing to learn from.

**The call** (:data:`INSTRUCTIONS`, :func:`distill_input`, :func:`parse`): the user turns labelled ``user:N``, the
actions numbered, the candidates; the answer is one JSON object ``{"rules": [{"source": "user:N", "quote": "..."}],
"orientation": [{"fact": "...", "action": N}]}``. A rule is kept only when its quote is an exact substring of user
turn N and not task-local; a fact only when it cites an action that succeeded. Everything else is dropped: the
model proposes, the transcript grounds. The self-report's candidates are never records by themselves.
"""

from __future__ import annotations

import re
from collections.abc import Sequence, Set
from dataclasses import dataclass

import orjson

from ..gate.prohibitions import units
from ..gate.verdict import Malformed, json_object
from .memory import EXPERIENCE, FAILED, ORIENTATION, READ_CHARS, RULE, UNKNOWN, VERIFIED, Candidate, Memory

DURABLE = ("always ", "never ", "from now on", "in this project", "in this repo", "in this codebase",
           "every time", "each time", "whenever ", "by default", "as a rule", "going forward", "in future",
           "in the future", "don't ever", "do not ever")
"""What a durable instruction opens with (after a list bullet and a lead-in of :data:`LEAD_INS`): "Always use uv",
"From now on, run ruff", "Never push to main", or a clause after a colon or a semicolon ("We switched
tooling: always use pip"). A marker further in a clause describes rather than instructs ("Changed
``get_context()`` to always return a string")."""
LEAD_INS = ("please ", "and ", "also ", "you should ", "you must ", "we ", "remember to ", "remember: ", "note: ")
LOCAL = ("this time", "for now", "for this task", "in this task", "for this change", "this session", "right now",
         "today", "for the moment", "just this", "until ", "this once", "for this pr", "in this pr", "if ",
         "unless ", "when you're done", "when you are done", "after that")
"""Markers of a task-local or conditional instruction: it is not made permanent (seed 003: "Task-local or
conditional restrictions must not become unconditional permanent guards")."""
INSTRUCTIVE = ("use ", "prefer ", "don't ", "do not ", "make sure", "remember ", "avoid ", "must ", "should ",
               "please ")
ACTIONS = 24
"""Actions shown to the distill call (the latest kept)."""
OUTPUT_CHARS = 300
TURNS = 16
"""User turns shown to the distill call (the latest kept), each clipped to :data:`TURN_CHARS`."""
TURN_CHARS = 2_000


@dataclass(frozen=True)
class Action:
    """One tool call of the turn as distilling reads it: its 1-based ``number``, ``tool``, the ``command`` it ran
    (a command execution's; ``""`` for other tools), whether it succeeded (``ok``), whether it ran the project's
    checks (``check``: tests, a build, a linter; ``proxyvisor.detectors.checks``) with the runner's ``summary``
    line, and the head of its ``output``."""

    number: int
    tool: str
    command: str
    ok: bool
    check: bool = False
    summary: str = ""
    output: str = ""

    def cite(self) -> str:
        return f"action #{self.number}: {self.tool} `{' '.join(self.command.split())[:120]}` " \
               f"({'succeeded' if self.ok else 'failed'}{': ' + self.summary if self.summary else ''})"


@dataclass(frozen=True)
class Material:
    """What one distill reads: the genuine user ``turns`` of the thread as (ordinal, text), the turn's ``task``
    (its request), the gate's ``label`` (None: not judged), the turn's ``actions``, the latest passing check's
    number (``passed_check``; 0: none) and the self-report's ``memories`` entries."""

    session: str
    turns: tuple[tuple[int, str], ...]
    task: str = ""
    label: str | None = None
    actions: tuple[Action, ...] = ()
    passed_check: int = 0
    memories: tuple[str, ...] = ()

    def source(self, turn: int) -> str:
        return f"user turn {turn} of session {self.session[:12]}"


def _has(unit: str, markers: Sequence[str]) -> bool:
    lowered = " " + unit.lower().replace("\u2019", "'") + " "
    return any((" " + m) in lowered for m in markers)


_CLAUSE = re.compile(r"[:;]\s+")
"""Where a clause that may open with a marker starts, inside a unit: after a colon or a semicolon (not a dash: a
list item's "**Title** - Always ..." is a harness's or a document's, rarely the user's own)."""


def _opens_durable(clause: str) -> bool:
    head = clause.lower().replace("\u2019", "'").lstrip("-*\u2022 \t").lstrip("0123456789.) ")
    while (lead := next((w for w in LEAD_INS if head.startswith(w)), None)) is not None:
        head = head[len(lead):]
    return head.startswith(DURABLE)


_PROSE = re.compile(r"[A-Za-z ,'\u2019-]{1,60}")
"""What may stand before the colon or semicolon of a clause that counts: a few plain words ("We switched tooling"),
not tool output ("FAILED tests/test_x.py::test_y - AssertionError: always returns None", "Error: ...; never mind")."""


def durable(unit: str) -> bool:
    """Whether ``unit`` (one sentence of a user turn) is a durable instruction (module docstring)."""
    clauses = [unit, *(unit[m.end():] for m in _CLAUSE.finditer(unit) if _PROSE.fullmatch(unit[:m.start()]))]
    return any(map(_opens_durable, clauses)) and not _has(unit, LOCAL)


def label_of(outcome: str | None) -> str | None:
    """The experience label of a gate outcome (``proxyvisor.gate.outcome``): ``verified`` and ``failed`` as they
    are, any other judged outcome ``unknown``; None stays None (not judged)."""
    return None if outcome is None else outcome if outcome in (VERIFIED, FAILED) else UNKNOWN


def free_records(material: Material) -> list[Candidate]:
    """The records of ``material`` that need no model call (module docstring)."""
    out = [Candidate(RULE, unit, material.source(n)) for n, text in material.turns
           for unit in units(text[:READ_CHARS]) if durable(unit)]
    check = next((a for a in material.actions if a.number == material.passed_check), None)
    if check is not None:
        out.append(Candidate(ORIENTATION, f"`{' '.join(check.command.split())}` runs the project's checks (it "
                             "passed)", check.cite()))
    if material.label is not None and material.task.strip():
        out.append(Candidate(EXPERIENCE, material.task, f"session {material.session[:12]}, gate: {material.label}",
                             material.label))
    return out


def worth_asking(material: Material, memory: Memory, asked: Set[str] = frozenset()) -> frozenset[str]:
    """The free pre-screen (module docstring): what in ``material`` a distill call could learn from beyond
    :func:`free_records`, what ``memory`` holds and what earlier calls of the session were shown (``asked``), as
    keys; empty: skip the call. The caller adds the keys to ``asked`` once it asked."""
    new = {f"u:{n}:{unit}" for n, text in material.turns for unit in units(text[:TURN_CHARS])
           if _has(unit, INSTRUCTIVE) and not _has(unit, LOCAL) and not durable(unit)}
    cited = {r.source for r in memory.records.values() if r.kind == ORIENTATION}
    new |= {f"a:{a.cite()}" for a in material.actions
            if a.ok and a.command.strip() and a.number != material.passed_check and a.cite() not in cited}
    new |= {f"m:{m}" for m in material.memories if m not in memory.records}
    return frozenset(new - asked)


INSTRUCTIONS = """\
You distill what a coding agent's session established into memory records for later sessions in the same project.
You get the user's turns labelled user:N, the agent's actions numbered #N with their results, and candidate notes
the agent proposed. Answer with one JSON object and nothing else:
{"rules": [{"source": "user:N", "quote": "..."}], "orientation": [{"fact": "...", "action": N}]}
- rules: the user's DURABLE instructions about how to work in this project (tools to use or avoid, files not to
  touch, conventions). "quote" must be the user's exact words copied from turn N. Leave out instructions about
  the current task only, conditional ones and questions.
- orientation: facts about the project a later session needs (the command that runs the tests, where the entry
  point is, the build that works), each citing the number of the successful action whose result shows it. No
  secrets, no credentials, no guesses.
- Both lists may be empty. The candidate notes are hints, never evidence by themselves."""


def distill_input(material: Material) -> str:
    """The distill call's document (module docstring)."""
    turns = [{"source": f"user:{n}", "text": text[:TURN_CHARS]} for n, text in material.turns[-TURNS:]]
    actions = [{"action": a.number, "tool": a.tool, "command": a.command[:300], "ok": a.ok,
                "output": a.output[:OUTPUT_CHARS]} for a in material.actions[-ACTIONS:]]
    document = {"user_turns": turns, "actions": actions,
                "candidates": [m for m in material.memories if m.strip()][:8]}
    return orjson.dumps(document, option=orjson.OPT_INDENT_2).decode()


def parse(answer: str, material: Material) -> list[Candidate] | Malformed:
    """The grounded records of a distill ``answer`` for ``material`` (module docstring); :class:`Malformed` when
    the answer is not such an object."""
    try:
        data = json_object(answer)
    except ValueError as exc:
        return Malformed(str(exc))
    rules, facts = data.get("rules", []), data.get("orientation", [])
    if not isinstance(rules, list) or not isinstance(facts, list):
        return Malformed("rules and orientation must be lists")
    turns = dict(material.turns)
    actions = {a.number: a for a in material.actions}
    out: list[Candidate] = []
    for rule in rules:
        if not isinstance(rule, dict):
            continue
        source, quote = rule.get("source"), rule.get("quote")
        match = re.fullmatch(r"user:(\d+)", source) if isinstance(source, str) else None
        if match is None or not isinstance(quote, str) or not quote.strip():
            continue
        turn = int(match.group(1))
        if quote.strip() in turns.get(turn, "")[:TURN_CHARS] and not _has(quote, LOCAL) and not quote.strip().endswith("?"):
            out.append(Candidate(RULE, quote.strip(), material.source(turn)))
    for fact in facts:
        if not isinstance(fact, dict):
            continue
        text, number = fact.get("fact"), fact.get("action")
        action = actions.get(number) if isinstance(number, int) and not isinstance(number, bool) else None
        if isinstance(text, str) and text.strip() and action is not None and action.ok:
            out.append(Candidate(ORIENTATION, text.strip(), action.cite()))
    return out
