"""The numbered view: what the condenser sees of one tool result, within a token budget (sans-IO).

Every shown line keeps its original 1-based number, right-aligned to the width of the line count:
``  42| text``. When the whole result fits the budget it is shown whole. Otherwise lines are taken by priority
while their estimated cost fits 80% of the budget, the estimate is calibrated against the rendered view once to
fill up to 95%, and the view is shrunk, lowest priority first, until it fits. The priorities:

1. diagnostic lines (:mod:`.signals`), the first of each distinct shape (digits ignored);
2. the edges, where summaries and commands live: the last 8 lines (from the end), the first 4, then the rest of
   the last 24 and of the first 16;
3. lines containing a focus term, rarest term first; a term on more than max(8, 2%) of the lines does not
   discriminate and is skipped;
4. 2 lines of context around those diagnostics and focus matches;
5. repeated diagnostics (same shape as an earlier one), then their context;
6. evenly spaced samples of the middle, so no stretch of the output is invisible by construction: 32, or one
   per 256 tokens of budget when that is fewer (at least 4), so noise samples never crowd a small view;
7. every other line, nearest to a distinct diagnostic or focus match first; a line repeating an earlier line's
   shape counts as 8 lines further away. The view thus grows blocks around what matters, and 74 identical
   tracebacks cost less than the one that differs.

Seed 003 draws on the same sources (mechanics reference, section 5) in the order diagnostics with context, focus
matches with context, tail, head, samples, the rest from the top. Ours shows every bare diagnostic and both edges
before any context, so a small budget still holds each error and the final summary, and it fills the remainder
around the anchors instead of from the top (see bench/RESULTS.md, "Condense").

A shown line longer than the per-line cap (budget / 16, between 8 and 256 tokens) is clipped, with a note that
selecting its number keeps the whole line: a 17,000-character single line stays one selectable record. Hidden
stretches render as ``[… original lines a-b not shown in this view …]``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ..rules import DEFAULT_VIEW_BUDGET, VIEW_BUDGET
from .ranges import runs
from .signals import CONTEXT_LINES, diagnostic_lines, with_context
from .text import body_of, count_each, count_tokens, visible

ROUND_BUDGET = DEFAULT_VIEW_BUDGET
"""Nominal view tokens shared by the candidates of one round, by size."""
MIN_VIEW_TOKENS = int(VIEW_BUDGET.low)
"""Floor per candidate (the sum may exceed :data:`ROUND_BUDGET`): the least view budget the configuration
accepts, so that any budget shows at least one candidate."""
MAX_CANDIDATES = 32
"""Most candidates in one condenser call; the largest are taken."""

TAIL_LINES = 24
HEAD_LINES = 16
MIDDLE_SAMPLES = 32
ACCEPT_SHARE = 0.8
FILL_SHARE = 0.95
REPEAT_PENALTY = 16
_PREFIX_TOKENS = 3  # "1234| " and the newline, measured: 2-4 tokens
_CLIP_NOTE_TOKENS = 16
_DIGITS = re.compile(r"\d+")


@dataclass(frozen=True)
class NumberedView:
    """A rendered view. ``shown``: the 1-based numbers of the lines shown (ascending); ``text``: the rendering;
    ``tokens``: its token count; ``total_lines``: lines in the original; ``clipped``: shown lines whose text was
    cut short in the view."""

    total_lines: int
    shown: tuple[int, ...]
    text: str
    tokens: int
    clipped: tuple[int, ...] = ()

    @property
    def partial(self) -> bool:
        """Whether the condenser sees less than the whole result (a hidden line or a clipped one)."""
        return len(self.shown) < self.total_lines or bool(self.clipped)

    @property
    def visible_ranges(self) -> list[tuple[int, int]]:
        """The shown lines as inclusive ``(first, last)`` runs."""
        return runs(self.shown)


def allocate(sizes: list[int], total: int = ROUND_BUDGET, floor: int = MIN_VIEW_TOKENS) -> list[int]:
    """View budgets in tokens for candidates of ``sizes`` tokens: ``total`` shared in proportion, each at least
    ``floor`` (seed 003's rule)."""
    whole = sum(sizes) or 1
    return [max(floor, total * size // whole) for size in sizes]


def build_view(lines: list[str], budget: int, terms: Sequence[str] = (),
               text_tokens: int | None = None) -> NumberedView:
    """The numbered view of ``lines`` (from :func:`~.text.split_lines`) in at most ``budget`` tokens.

    ``terms`` are lowercase focus terms (:func:`~.signals.focus_terms`); ``text_tokens`` is the token count of the
    lines' text when the caller has it (else it is counted). The whole text is shown when it fits; otherwise see
    the module docstring. A view always shows at least one line.
    """
    total = len(lines)
    width = len(str(max(total, 1)))
    if (count_tokens("".join(lines)) if text_tokens is None else text_tokens) <= budget:
        full = _render(lines, list(range(total)), width, None)
        tokens = count_tokens(full)
        if tokens <= budget:
            return NumberedView(total, tuple(range(1, total + 1)), full, tokens)
    cap = min(256, max(8, budget // 16))
    sizes = count_each([body_of(line) for line in lines])
    costs = [min(size, cap) + _PREFIX_TOKENS + (_CLIP_NOTE_TOKENS if size > cap else 0) for size in sizes]
    order = priority_order(lines, terms, samples=min(MIDDLE_SAMPLES, max(4, budget // 256)))
    accepted, estimate = _accept(order, costs, budget * ACCEPT_SHARE)
    text = _render(lines, sorted(accepted), width, (cap, sizes))
    tokens = count_tokens(text)
    # The estimate ignores gap markers and how line bodies merge into tokens; one calibrated second pass uses
    # the measured ratio to fill the budget instead of stopping at a guess.
    if tokens < budget * FILL_SHARE and len(accepted) < total:
        accepted, _ = _accept(order, costs, budget * FILL_SHARE * estimate / max(tokens, 1))
        text = _render(lines, sorted(accepted), width, (cap, sizes))
        tokens = count_tokens(text)
    while tokens > budget and len(accepted) > 1:
        del accepted[len(accepted) - max(1, len(accepted) // 10):]
        text = _render(lines, sorted(accepted), width, (cap, sizes))
        tokens = count_tokens(text)
    shown = sorted(accepted)
    clipped = tuple(i + 1 for i in shown if sizes[i] > cap)
    return NumberedView(total, tuple(i + 1 for i in shown), text, tokens, clipped)


def _accept(order: list[int], costs: list[int], limit: float) -> tuple[list[int], int]:
    """The lines of ``order`` that fit ``limit`` estimated tokens, in priority order, and their estimate."""
    accepted: list[int] = []
    used = 0
    for i in order:
        if used + costs[i] <= limit:
            accepted.append(i)
            used += costs[i]
    return (accepted or order[:1]), used


def priority_order(lines: list[str], terms: Sequence[str] = (), samples: int = MIDDLE_SAMPLES) -> list[int]:
    """Every 0-based line index once, most important first (see the module docstring); ``samples`` evenly
    spaced lines of the middle come before the fill."""
    total = len(lines)
    order: list[int] = []
    seen: set[int] = set()

    def push(indexes: Iterable[int]) -> None:
        for i in indexes:
            if 0 <= i < total and i not in seen:
                seen.add(i)
                order.append(i)

    shape = [_DIGITS.sub("#", line.strip()) for line in lines]
    first_of: dict[str, int] = {}
    for i, key in enumerate(shape):
        first_of.setdefault(key, i)
    diagnostics = diagnostic_lines(lines)
    distinct = [i for i in diagnostics if first_of[shape[i]] == i]
    repeats = [i for i in diagnostics if first_of[shape[i]] != i]
    push(distinct)
    # The very edges first (the summary is last, the command first), then the rest of the tail and head.
    push(range(total - 1, total - TAIL_LINES // 3 - 1, -1))
    push(range(HEAD_LINES // 4))
    push(range(total - 1, total - TAIL_LINES - 1, -1))
    push(range(HEAD_LINES))

    lower = [line.lower() for line in lines]
    hits = {term: [i for i, line in enumerate(lower) if term in line] for term in terms}
    rare = max(8, total // 50)
    focus: list[int] = []
    for term in sorted((t for t in terms if 0 < len(hits[t]) <= rare), key=lambda t: len(hits[t])):
        focus.extend(hits[term])
    push(focus)
    push(sorted(with_context(distinct + focus, total, CONTEXT_LINES)))
    push(repeats)
    push(sorted(with_context(repeats, total)))

    middle = range(HEAD_LINES, max(HEAD_LINES, total - TAIL_LINES))
    if len(middle) > 0:
        step = len(middle) / samples
        push(sorted({middle[int(k * step + step / 2)] for k in range(min(samples, len(middle)))}))

    distance = _distance_to(set(distinct) | set(focus) or seen, total)
    rest = [i for i in range(total) if i not in seen]
    push(sorted(rest, key=lambda i: (distance[i] + (REPEAT_PENALTY if first_of[shape[i]] != i else 0), i)))
    return order


def _distance_to(anchors: set[int], total: int) -> list[int]:
    """For each index, the distance to the nearest anchor (``total`` when there is none)."""
    distance = [total] * total
    last = None
    for i in range(total):
        if i in anchors:
            last = i
        if last is not None:
            distance[i] = i - last
    last = None
    for i in range(total - 1, -1, -1):
        if i in anchors:
            last = i
        if last is not None:
            distance[i] = min(distance[i], last - i)
    return distance


def _render(lines: list[str], shown: list[int], width: int, clip: tuple[int, list[int]] | None) -> str:
    out: list[str] = []
    previous = -1
    for i in shown:
        if i > previous + 1:
            out.append(_gap(previous + 2, i))
        body = visible(body_of(lines[i]))
        if clip is not None and clip[1][i] > clip[0]:
            keep = max(1, len(body) * clip[0] // clip[1][i])
            body = (body[:keep] + f" …[line clipped: {len(body) - keep} more characters; selecting line {i + 1} "
                    "keeps all of it]")
        out.append(f"{i + 1:>{width}}| {body}")
        previous = i
    if previous < len(lines) - 1:
        out.append(_gap(previous + 2, len(lines)))
    return "\n".join(out) + "\n"


def _gap(first: int, last: int) -> str:
    span = f"line {first}" if first == last else f"lines {first}-{last}"
    return f"[… original {span} not shown in this view …]"
