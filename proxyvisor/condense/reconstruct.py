"""Rebuilding a tool result from the condenser's verdict: kept lines verbatim, gaps counted (sans-IO).

Kept lines are copied byte for byte from the original, line terminators included (CRLF stays CRLF, a stray
``\\r`` stays inside its line). Every diagnostic line with 2 lines of context is kept whatever the model chose
(seed 003's error-line retention). Each run of omitted lines becomes one marker naming the count and the original
line numbers, ``[… 40 lines omitted: original lines 20-59 …]``, so the agent can read exactly that span back from
the spill file, whose line numbers are the same. A notice closes the result; it is fixed text with numbers and
the spill path, never words from the model:

- extract: "kept K of N original lines relevant to the current task; ... full original at PATH ...";
- replace: "omitted the complete N-line successful `TOOL` result because none of it advances the current task;
  nothing summarized; full original at PATH".

If the narrowed text does not save at least :data:`MIN_SAVING` of the tokens, the original is worth more than
the cut: the result stays unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

from .protocol import Verdict
from .signals import diagnostic_lines, with_context
from .text import count_tokens, newline_of

TAG = "📎 CONDENSED by proxyvisor"
MIN_SAVING = 0.05
"""Least share of tokens a narrowed result must save; below it a cut costs the agent a read-back for nothing."""


@dataclass(frozen=True)
class Narrowed:
    """The model's copy of a result: ``text``, the original lines it keeps (``kept_lines``), its ``tokens``."""

    text: str
    kept_lines: int
    tokens: int


def retained(lines: list[str]) -> set[int]:
    """1-based numbers of the lines kept whatever the condenser chose: diagnostics and 2 lines of context."""
    return {i + 1 for i in with_context(diagnostic_lines(lines), len(lines))}


def narrow(verdict: Verdict, lines: list[str], *, tool: str, spill_path: str,
           tokens_before: int) -> Narrowed | str:
    """The narrowed result for a valid ``verdict`` on ``lines`` (from :func:`~.text.split_lines`), or the reason
    the original stays (``keep``, everything retained, or too small a saving)."""
    total = len(lines)
    if verdict.kind == "keep":
        return "kept in full"
    if verdict.kind == "replace":
        kept: set[int] = set()
        text = (f"{TAG}: omitted the complete {total}-line successful `{tool}` result because none of it advances "
                f"the current task; nothing summarized; full original at {spill_path}{newline_of(lines)}")
    else:
        kept = set(verdict.lines) | retained(lines)
        if len(kept) == total:
            return "every line kept"
        text = extract_text(lines, kept, spill_path)
    tokens = count_tokens(text)
    if tokens > tokens_before * (1 - MIN_SAVING):
        return f"no saving ({tokens_before} -> {tokens} tokens)"
    return Narrowed(text, len(kept), tokens)


def extract_text(lines: list[str], kept: set[int], spill_path: str) -> str:
    """``lines`` reduced to the 1-based numbers in ``kept``, with gap markers and the extract notice."""
    total = len(lines)
    newline = newline_of(lines)
    out: list[str] = []
    gap_start = None
    for number in range(1, total + 1):
        if number in kept:
            if gap_start is not None:
                out.append(_marker(gap_start, number - 1, newline))
                gap_start = None
            out.append(lines[number - 1])
        elif gap_start is None:
            gap_start = number
    if gap_start is not None:
        out.append(_marker(gap_start, total, newline))
    out.append("---" + newline)
    out.append(f"{TAG}: kept {len(kept)} of {total} original lines relevant to the current task; the condenser "
               "returned line numbers only, so kept lines are copied verbatim, not rewritten; full original at "
               f"{spill_path} (the markers above give the original line numbers of each cut span); read a cut span "
               "there, and re-run the tool only if the underlying state may have changed, not to recover omitted "
               f"text{newline}")
    # A kept last line without a terminator would run into the next marker.
    for i, piece in enumerate(out[:-1]):
        if not piece.endswith("\n"):
            out[i] = piece + newline
    return "".join(out)


def _marker(first: int, last: int, newline: str) -> str:
    count = last - first + 1
    span = f"line {first}" if count == 1 else f"lines {first}-{last}"
    return f"[… {count} line{'s' if count != 1 else ''} omitted: original {span} …]{newline}"
