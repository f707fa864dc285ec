"""The model's copy of a condensed tool result: kept lines verbatim, gaps counted, within a budget (sans-IO).

:func:`condense` takes the selection of :mod:`.select` (the deterministic condenser's, or a model's ``extract``
with the diagnostics sharing its budget) and renders it:

- kept lines are copied byte for byte from the original, terminators included (CRLF stays CRLF, a stray ``\\r``
  stays inside its line), except that a line over :data:`~.select.CLIP_CHARS` characters keeps its first
  :data:`~.select.CLIP_HEAD` and last :data:`~.select.CLIP_TAIL` around ``[… 4,812 characters of line 812 cut …]``;
- each run of omitted lines becomes one marker naming the count and the original line numbers,
  ``[… 40 lines omitted: original lines 20-59 …]``, so the agent can read exactly that span back from the spill
  file, whose line numbers are the same;
- after the first occurrence of a repeated diagnostic, a note gives its count and its first and last line
  (``[… this line occurs 700 times once numbers, ids, paths and timestamps are masked: first at line 12, last
  at line 3,981 …]``); the repeats in between are omitted;
- with lines new against the last green run, a leading section shows them first (``[… new since ...: original
  lines 812-819 …]`` before each run) and the body leaves them out;
- a notice closes the result: fixed text with numbers, who chose the lines, how many distinct diagnostics did not
  fit (and the first line numbers of those) and the spill path, never words from a model.

The rendering is measured with tiktoken and the lowest-ranked lines are dropped until it fits ``budget``
tokens. A ``replace`` verdict is one fixed notice. If the result does not save at least :data:`MIN_SAVING` of the
tokens, the original is worth more than the cut: the result stays unchanged.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from .protocol import Verdict
from .ranges import runs
from .select import CLIP_CHARS, CLIP_HEAD, CLIP_TAIL, GAP_MARKER_TOKENS, Facts, accept, rank
from .text import count_tokens, newline_of

TAG = "📎 CONDENSED by proxyvisor"
MIN_SAVING = 0.05
"""Least share of tokens a narrowed result must save; below it a cut costs the agent a read-back for nothing."""
DETERMINISTIC, MODEL = "deterministic", "model"
"""Who chose the kept lines: proxyvisor's deterministic condenser, or the supervisor model."""
_NOTICE_TOKENS = 160
_SLACK_TOKENS = 50
UNSHOWN_LISTED = 10
"""Line numbers of distinct diagnostics left out that the notice lists (it counts them all)."""


@dataclass(frozen=True)
class Narrowed:
    """The model's copy of a result: ``text``, its ``tokens``, the 1-based original lines it keeps (``kept``;
    clipped ones included) and who chose them (``condenser``)."""

    text: str
    tokens: int
    kept: tuple[int, ...]
    condenser: str

    @property
    def kept_lines(self) -> int:
        return len(self.kept)

    @property
    def kept_ranges(self) -> list[tuple[int, int]]:
        """The kept lines as inclusive ``(first, last)`` runs."""
        return runs(self.kept)


@dataclass(frozen=True)
class Baseline:
    """The last green run of the same command: its ``label`` (how the notice names it, e.g. ``call_7``) and the
    0-based ``new`` lines of this result whose templates it lacks (:mod:`.baseline`)."""

    label: str
    new: tuple[int, ...]


def narrow(verdict: Verdict, lines: list[str], *, tool: str, spill_path: str, tokens_before: int, budget: int,
           terms: Sequence[str] = (), facts: Facts | None = None) -> Narrowed | str:
    """The narrowed result for a model's valid ``verdict`` on ``lines`` (from :func:`~.text.split_lines`), within
    ``budget`` tokens, or the reason the original stays (``keep``, or too small a saving)."""
    if verdict.kind == "keep":
        return "kept in full"
    if verdict.kind == "replace":
        text = (f"{TAG}: omitted the complete {len(lines)}-line successful `{tool}` result because none of it "
                f"advances the current task; nothing summarized; full original at {spill_path}{newline_of(lines)}")
        tokens = count_tokens(text)
        if tokens > tokens_before * (1 - MIN_SAVING):
            return f"no saving ({tokens_before} -> {tokens} tokens)"
        return Narrowed(text, tokens, (), MODEL)
    return condense(lines, spill_path=spill_path, tokens_before=tokens_before, budget=budget, terms=terms,
                    chosen=verdict.lines, facts=facts)


def condense(lines: list[str], *, spill_path: str, tokens_before: int, budget: int, terms: Sequence[str] = (),
             chosen: Iterable[int] | None = None, baseline: Baseline | None = None,
             facts: Facts | None = None) -> Narrowed | str:
    """``lines`` condensed within ``budget`` tokens (module docstring): by the deterministic condenser, or around
    the 1-based lines a model ``chose``; ``terms`` are the focus terms; ``baseline`` the comparison with the last
    green run. Returns the reason the original stays when every line would be kept or the saving is too small."""
    facts = facts or Facts.of(lines)
    ranked = rank(facts, terms, chosen=chosen, lead=baseline.new if baseline else ())
    taken = accept(facts, ranked, max(1, budget - _NOTICE_TOKENS))
    if len(taken) == len(lines) and all(len(body) <= CLIP_CHARS for body in facts.bodies):
        return "every line kept"
    who = MODEL if chosen is not None else DETERMINISTIC
    lead = {i for i, kind in zip(ranked.order, ranked.classes) if kind == "lead"} & set(taken)
    label = baseline.label if baseline else ""
    text = render(lines, facts, set(taken), lead, spill_path, who, label)
    tokens = count_tokens(text)
    if budget - tokens > _SLACK_TOKENS and len(taken) < len(lines):
        # The estimate is conservative (markers and line bodies merge into fewer tokens): once, the measured
        # room is handed back to the selection.
        wider = accept(facts, ranked, max(1, budget - _NOTICE_TOKENS) + budget - tokens)
        wider_lead = lead | ({i for i, kind in zip(ranked.order, ranked.classes) if kind == "lead"} & set(wider))
        wider_text = render(lines, facts, set(wider), wider_lead, spill_path, who, label)
        wider_tokens = count_tokens(wider_text)
        if wider_tokens <= budget:
            taken, lead, text, tokens = wider, wider_lead, wider_text, wider_tokens
    while tokens > budget and len(taken) > 1:
        # Drop the latest taken lines whose estimated cost covers the overshoot, then measure again.
        over = tokens - budget
        while len(taken) > 1 and over > 0:
            over -= max(1, facts.cost(taken.pop()) - GAP_MARKER_TOKENS)
        lead &= set(taken)
        text = render(lines, facts, set(taken), lead, spill_path, who, label)
        tokens = count_tokens(text)
    if tokens > tokens_before * (1 - MIN_SAVING):
        return f"no saving ({tokens_before} -> {tokens} tokens)"
    return Narrowed(text, tokens, tuple(sorted(i + 1 for i in taken)), who)


def render(lines: list[str], facts: Facts, kept: set[int], lead: set[int], spill_path: str, who: str,
           baseline: str = "") -> str:
    """The text of a condensed result keeping the 0-based ``kept`` lines, ``lead`` (a subset) shown first."""
    total = len(lines)
    newline = newline_of(lines)
    out: list[str] = []
    if lead:
        out.append(f"[… {len(lead):,} line{'s' if len(lead) != 1 else ''} new against the last successful run of "
                   f"this command ({baseline}), once numbers, ids, paths and timestamps are masked; they come first "
                   f"and are not repeated below …]{newline}")
        for first, last in runs(lead):
            out.append(f"[… new: original {_span(first + 1, last + 1)} …]{newline}")
            out.extend(_line(lines, facts, i, newline) for i in range(first, last + 1))
        out.append(f"[… the rest of the condensed output, in order …]{newline}")
    firsts = {g.lines[0] - 1: g for g in facts.groups.values()}
    body = kept - lead
    gap_start = None
    for i in range(total):
        if i in body:
            if gap_start is not None:
                out.append(_marker(gap_start, i - 1, newline))
                gap_start = None
            out.append(_line(lines, facts, i, newline))
            group = firsts.get(i)
            if group is not None:
                out.append(f"[… this line occurs {len(group.lines):,} times once numbers, ids, paths and timestamps "
                           f"are masked: first at line {group.lines[0]}, last at line {group.lines[-1]} …]"
                           f"{newline}")
        elif gap_start is None:
            gap_start = i
    if gap_start is not None:
        out.append(_marker(gap_start, total - 1, newline))
    clipped = sum(1 for i in kept if len(facts.bodies[i]) > CLIP_CHARS)
    seen: set[str] = set()
    unshown = []
    for i in facts.diagnostics:
        if facts.templates[i] not in seen:
            seen.add(facts.templates[i])
            if i not in kept:
                unshown.append(i + 1)
    chooser = ("the supervisor model chose line numbers and proxyvisor added the diagnostics" if who == MODEL else
               "chosen without a model from the output's own signals (diagnostics grouped by template, failure "
               "sections, task terms, the first and last lines)")
    out.append("---" + newline)
    out.append(f"{TAG}: kept {len(kept):,} of {total:,} original lines ({chooser}); kept lines are copied verbatim"
               + (f", except {clipped:,} long line{'s' if clipped != 1 else ''} clipped where marked" if clipped
                  else "")
               + (f"; {len(unshown):,} more distinct diagnostic line{'s are' if len(unshown) != 1 else ' is'} not "
                  f"shown (line{'s' if len(unshown) != 1 else ''} {', '.join(map(str, unshown[:UNSHOWN_LISTED]))}"
                  f"{', …' if len(unshown) > UNSHOWN_LISTED else ''})" if unshown else "")
               + f"; full original at {spill_path} (the markers give the original line numbers: read lines A-B "
               f"with sed -n 'A,Bp' on it); read a cut span there, and re-run the tool only if the underlying state "
               f"may have changed, not to recover omitted text{newline}")
    return "".join(out)


def _line(lines: list[str], facts: Facts, i: int, newline: str) -> str:
    """Line ``i`` as rendered: verbatim, or clipped when long; always terminated."""
    body = facts.bodies[i]
    if len(body) > CLIP_CHARS:
        cut = len(body) - CLIP_HEAD - CLIP_TAIL
        terminator = lines[i][len(body):] or newline
        return f"{body[:CLIP_HEAD]}[… {cut:,} characters of line {i + 1} cut …]{body[-CLIP_TAIL:]}{terminator}"
    line = lines[i]
    return line if line.endswith("\n") else line + newline


def _span(first: int, last: int) -> str:
    # Line numbers without thousands separators: the agent copies them into sed -n 'A,Bp'.
    return f"line {first}" if first == last else f"lines {first}-{last}"


def _marker(first: int, last: int, newline: str) -> str:
    """The marker of the omitted 0-based lines ``first..last``."""
    count = last - first + 1
    return f"[… {count} line{'s' if count != 1 else ''} omitted: original {_span(first + 1, last + 1)} …]{newline}"
