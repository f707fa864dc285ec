"""The verifier's input: a compact, bounded digest of one turn, never the whole transcript.

:func:`build` renders one ``<verification_request>`` document from plain data. Its contract:

- **Never over budget**: the result has at most ``budget`` tokens (counted with
  :func:`proxyvisor.condense.text.count_tokens`, cl100k_base). Blocks are filled in priority order, each clipped
  to its own cap and to what is left; whatever does not fit is clipped (head 2/3, tail 1/3, with an omission
  marker) or dropped. :data:`~proxyvisor.rules.DEFAULT_DIGEST_BUDGET` (16,384) is proxyvisor's own bound: the reference bounds each block
  but not their sum, which can reach about 20k tokens.
- **Untrusted text stays data**: every inserted text is XML-escaped (``&``, ``<``, ``>``), so no tool output or
  model text can close a block or open one (DESIGN.md principle 6; reference section 3, "untrusted text
  XML-escaped"). Blocks with agent-produced content carry ``trust="untrusted"``.

Blocks, in priority order (reference ``in-session-supervisor-mechanics.md`` section 3, "Verifier input"):

=============================== =====================================================================================
``<current_user_turn>``         the latest genuine user turn, authority; at most 16,000 characters
                                (:data:`REQUEST_CHARS`; head 2/3 and tail 1/3 of a longer one) and a quarter of the
                                budget.
``<original_task>``             the thread's first user message, when the turn's request is another one (a follow-up
                                such as "yes" or "test it", or a harness's re-prompt): what the follow-up refers to
                                (a stand-in for the reference's task resolution); same limits, an eighth of the
                                budget.
``<agent_final_result>``        all finals of the turn joined by a "continued after supervisor feedback" separator,
                                filled newest first, at most 8,192 tokens (the supervisor profile's ``max_tokens``)
                                and a quarter of the budget.
``<prohibitions>``              the user's prohibitions in force (:func:`.prohibitions.standing`: stated in any user
                                turn of the thread, not lifted since by a permission), binding on the verifier, one
                                line each with its source turn: ``- [turn 2] Do not run the tests.``
``<agent_state>``               the self-report state and ``focus`` (the stated claim), at most 500 characters.
``<previously_flagged_gaps>``   the previous pass's gaps, at most a sixteenth of the budget.
``<active_plan>``               only when given; at most an eighth of the budget.
``<standing_instructions>``     the system prompt, truncated to 4,000 characters (reference) and an eighth of the
                                budget.
``<recorded_actions>``          one line per action, ``#N [mut|read] tool args → ok|ERROR (N chars) ×K``, arguments
                                at most 120 characters, at most 128 lines (newest kept); an identical successful
                                consecutive call collapses into ``×K``, errors never do (reference). At most a quarter
                                of the budget.
``<provenance>``                whether the turn changed state and the latest check after its last change, passed or
                                failed, with its summary line (:func:`provenance`; reference).
``<tool_outputs>``              result heads (1,000 characters) and tails (2,000, the reference's command-output
                                tail) of at most 8 actions, one per distinct call (its latest run): failures first,
                                then command executions, then the rest, each newest first, while they fit; shown in
                                action order.
=============================== =====================================================================================

Pure functions over plain data; no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from xml.sax.saxutils import escape

import orjson

from .. import wirejson
from ..condense.ranges import RangeError, lines_in, parse_ranges, runs
from ..condense.text import clip_chars, clip_tokens, count_each, count_tokens, encoding, tokens_may_exceed
from ..detectors import checks
from ..detectors.checks import words
from ..detectors.receipts import NONE, Receipt, receipt, writes
from ..rules import DEFAULT_DIGEST_BUDGET, DIGEST_BUDGET
from ..transcript import Message, ToolOutput, ToolUse
from .prohibitions import Standing, standing
from .verdict import MAX_READS, READBACK_DONE, ReadRequest

REQUEST_CHARS = 16_000
"""The request's clip (head 2/3, tail 1/3). Twice the reference's 8,000 for a *resolved* request: ours is the raw
message, which a harness may prefix with pages of context (SWE-agent's demonstration, 19k characters, merged with
the task into one Messages user message); the block's token cap (a quarter of the budget) still bounds it."""
INSTRUCTIONS_CHARS = 4_000
FINAL_TOKENS = 8_192
TOKEN_CHARS = 128
"""The most characters one ``cl100k_base`` token spans (its longest token is 128 bytes): a text's suffix of N
tokens lies within its last 128 N characters."""
FINAL_CHARS = TOKEN_CHARS * FINAL_TOKENS
"""The most of the turn's final answers' end that ``<agent_final_result>`` can show: a caller keeping finals across
requests needs no more of each."""
CLAIM_CHARS = 500
ARG_CHARS = 120
MAX_ACTION_LINES = 128
HEAD_CHARS = 1_000
TAIL_CHARS = 2_000
MAX_OUTPUTS = 8
CONTINUED = "\n--- continued after supervisor feedback ---\n"

DOC_SUFFIXES = (".md", ".markdown", ".rst", ".txt", ".adoc")
"""Files of prose: a change to them alone has no behaviour for a check to exercise."""
BOOKKEEPING = frozenset({"todo", "todos"})
"""Words of a tool's name that mark the agent's own bookkeeping (Claude Code's ``TodoWrite``): not a change."""
_COMMAND_CHARS = 120


@dataclass(frozen=True, slots=True)
class Action:
    """One tool call of the turn: the call, its result (None if it never arrived) and its receipt."""

    use: ToolUse
    output: ToolOutput | None
    receipt: Receipt


@dataclass(frozen=True, slots=True)
class Check:
    """One check of the turn (:mod:`proxyvisor.detectors.checks`): its 1-based action number, command, outcome
    (``passed`` or ``failed``) and the runner summary line its output ends with ("" when it printed none)."""

    number: int
    command: str
    outcome: str
    summary: str

    @property
    def passed(self) -> bool:
        return self.outcome == checks.PASSED

    def quote(self) -> str:
        """The check in one line: its command and summary line, or its command and exit status (no action number,
        so the same failure quoted twice reads the same: the gate's stall rule compares gap texts)."""
        command = clip_chars(" ".join(self.command.split()), _COMMAND_CHARS)
        if self.summary:
            return f"`{command}` reported \"{self.summary}\""
        return f"`{command}` exited {'0' if self.passed else 'with a failure'}"


@dataclass(frozen=True, slots=True)
class Evidence:
    """What the turn's actions establish (:func:`evidence`). ``changed``: a change succeeded. ``latest``: the
    latest check after the last change (when nothing changed, the turn's latest check), None when no check ran
    there; ``before``: the latest check before the last change, None when none. ``seq``: the number of actions,
    the ledger sequence whose movement between passes is "new evidence" (reference section 3, stall)."""

    changed: bool = False
    latest: Check | None = None
    before: Check | None = None
    seq: int = 0
    last_change: int = 0
    """The 1-based number of the action that made the last change, 0 when nothing changed."""

    @property
    def checked(self) -> bool:
        """A change succeeded and the latest check after the last change passed: what ``verified`` needs."""
        return self.changed and self.latest is not None and self.latest.passed

    @property
    def check_failed(self) -> bool:
        """A change succeeded and the latest check after the last change failed."""
        return self.changed and self.latest is not None and not self.latest.passed

    @property
    def unchecked(self) -> bool:
        """A change succeeded and no check ran after the last change."""
        return self.changed and self.latest is None


def turn_actions(messages: Sequence[Message], schemas: Mapping[str, Mapping[str, Any]] | None = None,
                 mutating_tools: frozenset[str] = frozenset(),
                 known: Mapping[str, Receipt] | None = None) -> list[Action]:
    """The tool calls in ``messages`` (one turn's history, after its user message) paired with their results by
    id, in call order, each with its :func:`~proxyvisor.detectors.receipts.receipt`; ``known`` receipts by call id
    (``RoundReader.turn_receipts``, already computed from the same history) are used as they are."""
    uses: list[ToolUse] = []
    outputs: dict[str, ToolOutput] = {}
    for message in messages:
        uses += message.tool_uses
        for result in message.tool_outputs:
            outputs.setdefault(result.call_id, result)
    schemas = schemas or {}
    known = known or {}
    return [Action(u, outputs.get(u.id), known.get(u.id) or receipt(u, outputs.get(u.id), schemas.get(u.name),
                                                                     mutating_tools))
            for u in uses]


def _kind(action: Action, created: set[str]) -> tuple[str, tuple[str, ...], tuple[str, ...]]:
    """How one successful mutation counts: ``("aside", (), ())`` for bookkeeping or prose only, ``("create",
    paths, ())`` when it only creates files, ``("remove", removed, created)`` when it only removes or renames files
    the turn created, else ``("change", (), ())``."""
    r = action.receipt
    if words(r.tool) & BOOKKEEPING:
        return "aside", (), ()
    if r.command is None:
        if r.target and all(t.lower().endswith(DOC_SUFFIXES) for t in r.target):
            return "aside", (), ()
        said = words(r.tool) | {str(action.use.arguments.get(k, "")).strip().lower() for k in ("command", "action")}
        if r.target and said & {"write", "create"}:
            return "create", r.target, ()
        if r.target and said & {"delete", "remove"} and set(r.target) <= created:
            return "remove", r.target, ()
        return "change", (), ()
    made: list[str] = []
    gone: list[str] = []
    known = set(created)
    for part in checks.parts(r.command):
        if not writes(part) or checks.is_inspection(part):
            continue
        new = checks.created_paths(part)
        if new is not None:
            made += new
            known.update(new)
            continue
        moved = checks.removed_paths(part)
        if moved is None or not set(moved[0]) <= known:
            return "change", (), ()
        gone += moved[0]
        made += moved[1]
        known.update(moved[1])
    if gone:
        return "remove", tuple(gone), tuple(made)
    return ("create", tuple(made), ()) if made else ("change", (), ())


def evidence(actions: Sequence[Action]) -> Evidence:
    """The :class:`Evidence` of a turn's actions. A change is a successful mutation, except (the agent's own
    scratch work leaves the result as it was): removing or renaming files the turn created, creating files the
    turn removes again later, the agent's bookkeeping (:data:`BOOKKEEPING`) and edits of prose alone
    (:data:`DOC_SUFFIXES`). A command that changes and then checks (``sed -i ... && pytest``) is a check after its
    change."""
    created: set[str] = set()
    kinds: list[tuple[int, str, tuple[str, ...]]] = []
    last_removal: dict[str, int] = {}
    for i, a in enumerate(actions):
        if a.receipt.mutation == NONE or a.receipt.error:
            continue
        kind, paths, made = _kind(a, created)
        if kind == "create":
            created.update(paths)
        elif kind == "remove":
            last_removal.update((p, i) for p in paths)
            created.update(made)
        kinds.append((i, kind, paths))
    changes = [i for i, kind, paths in kinds if kind == "change"
               or (kind == "create" and not all(last_removal.get(p, -1) > i for p in paths))]
    last = max(changes, default=-1)
    found = [Check(i + 1, a.receipt.command or "", a.receipt.check, a.receipt.summary)
             for i, a in enumerate(actions) if a.receipt.check != checks.NONE]
    after = [c for c in found if c.number - 1 >= last]
    before = [c for c in found if c.number - 1 < last]
    return Evidence(bool(changes), after[-1] if after else None, before[-1] if before else None, len(actions),
                    last + 1)


def _arguments(use: ToolUse) -> str:
    text = wirejson.dumps(use.arguments, option=orjson.OPT_SORT_KEYS).decode() if use.arguments else ""
    return clip_chars(" ".join(text.split()), ARG_CHARS)


def action_lines(actions: Sequence[Action]) -> list[str]:
    """The ledger lines of ``actions`` (module docstring, ``<recorded_actions>``), unescaped, oldest first."""
    lines: list[tuple[int, Action, int]] = []
    for number, action in enumerate(actions, 1):
        previous = lines[-1][1] if lines else None
        r = action.receipt
        if (previous is not None and not r.error and not previous.receipt.error
                and previous.receipt.call_key == r.call_key and previous.receipt.result_key == r.result_key):
            first, _, repeats = lines[-1]
            lines[-1] = (first, previous, repeats + 1)
            continue
        lines.append((number, action, 1))
    out = []
    for number, action, repeats in lines:
        r = action.receipt
        size = f"{len(action.output.text)} chars" if action.output is not None else "no result"
        kind = "mut" if r.mutation != NONE else "read"
        out.append(f"#{number} [{kind}] {r.tool} {_arguments(action.use)} → {'ERROR' if r.error else 'ok'} "
                   f"({size})" + (f" ×{repeats}" if repeats > 1 else ""))
    return out


def provenance(ev: Evidence) -> str:
    """The provenance sentences (reference section 3): whether the turn changed state, and the latest check after
    its last change, passed or failed, with its summary line."""
    if not ev.changed:
        text = "No state change was recorded in this turn (documentation, todo lists and the agent's own scratch " \
               "files aside)."
        return text + (f" The latest check {ev.latest.outcome}: {_cited(ev.latest)}." if ev.latest else "")
    if ev.latest is not None:
        if ev.latest.passed:
            return f"A check passed after the last change: {_cited(ev.latest)}."
        return f"The latest check after the last change FAILED: {_cited(ev.latest)}."
    text = "No check ran after the last change; anything after it was cleared only by re-reading the artifact: " \
           "content only, not behavior."
    return text + (f" The latest check, before the last change, {ev.before.outcome}: {_cited(ev.before)}."
                   if ev.before else "")


def _cited(check: Check) -> str:
    return f"action #{check.number} {check.quote()}"


def _head_tail(text: str) -> str:
    """``text``'s head and tail around a marker naming the lines (1-based, split on ``\\n``, the first and last
    partly shown) the verifier may read back (:func:`~.verdict.readback`)."""
    if len(text) <= HEAD_CHARS + TAIL_CHARS:
        return text
    first, last = text.count("\n", 0, HEAD_CHARS) + 1, text.count("\n", 0, len(text) - TAIL_CHARS) + 1
    total = text.count("\n") + 1
    return (text[:HEAD_CHARS] + f"\n[... {len(text) - HEAD_CHARS - TAIL_CHARS} chars omitted: lines {first}-{last} "
            f"of {total} ...]\n" + text[-TAIL_CHARS:])


def _picked_outputs(actions: Sequence[Action]) -> list[int]:
    """Indexes of actions whose outputs are shown, in priority order (module docstring)."""
    latest: dict[bytes, int] = {}
    for i, action in enumerate(actions):
        if action.output is not None:
            latest[action.receipt.call_key] = i
    newest = sorted(latest.values(), reverse=True)
    failed = [i for i in newest if actions[i].receipt.error]
    commands = [i for i in newest if actions[i].receipt.command is not None and i not in failed]
    return (failed + commands + [i for i in newest if i not in failed and i not in commands])[:MAX_OUTPUTS]


def _fit(text: str, tokens: int) -> str:
    """``text`` clipped so that it has at most ``tokens`` tokens (empty when ``tokens`` < 1)."""
    if tokens < 1:
        return ""
    if count_tokens(text) <= tokens:
        return text
    target = tokens - 16  # room for clip_tokens' omission marker
    while target > 0:
        clipped = clip_tokens(text, target)
        over = count_tokens(clipped) - tokens
        if over <= 0:
            return clipped
        target -= over
    return ""


def _element(tag: str, attrs: str, body: str) -> str:
    return f"<{tag}{attrs}>\n{body}\n</{tag}>"


@dataclass(frozen=True)
class _Block:
    tag: str
    attrs: str
    cap: int
    render: Callable[[int], str]
    """Escaped body fitting the given number of tokens (empty when nothing fits)."""


OMITTED = "[... earlier text omitted ...]\n"


def fit_tail(text: str, tokens: int, whole: bool = True) -> str:
    """The longest suffix of ``text`` that fits ``tokens`` tokens behind an omission marker, about (a few
    characters either way where tokens meet the cut), or ``text`` itself when it fits and is ``whole`` (not the
    tail of a longer text already). Costs what encoding about twice the suffix does, whatever the text's length:
    its end is read in windows doubling from 8 characters a token, until one holds more tokens than fit."""
    if tokens < 1:
        return ""
    if whole and not tokens_may_exceed(text, tokens):
        return text
    codec = encoding()
    room = tokens - count_tokens(OMITTED)
    limit = tokens if whole else room  # (a whole text may still fit as it is, with no marker)
    size = 8 * tokens
    while True:
        window = text[len(text) - size:] if size < len(text) else text
        ids = codec.encode_ordinary(window)
        if window is text and len(ids) <= limit:
            return text if whole else OMITTED + text
        if len(ids) > limit:
            break
        size *= 2
    if room < 1:
        return ""
    suffix = window[len(window) - len(codec.decode(ids[len(ids) - room:])):]
    while suffix and (over := count_tokens(OMITTED + suffix) - tokens) > 0:
        suffix = suffix[4 * over:]  # tokens met differently at the cut: a few more characters off
    return OMITTED + suffix if suffix else ""


def _text_block(tag: str, attrs: str, text: str, cap: int, newest_first: bool = False) -> _Block:
    if newest_first:
        # Only a tail of at most ``cap`` tokens is shown: escaping and counting read no more of a long text (an
        # answer of megabytes) than such a tail can span. Escaping only lengthens it.
        tail = text[len(text) - TOKEN_CHARS * cap:] if len(text) > TOKEN_CHARS * cap else text
        body = escape(tail)
        return _Block(tag, attrs, cap, lambda tokens: fit_tail(body, tokens, tail is text))
    body = escape(text)
    return _Block(tag, attrs, cap, lambda tokens: _fit(body, tokens))


def _lines_block(tag: str, attrs: str, lines: list[str], cap: int) -> _Block:
    escaped = [escape(line) for line in lines[-MAX_ACTION_LINES:]]
    dropped = len(lines) - len(escaped)

    sizes = count_each(escaped)

    def body(start: int) -> str:
        omitted = dropped + start
        return (f"[{omitted} earlier lines omitted]\n" if omitted else "") + "\n".join(escaped[start:])

    def render(tokens: int) -> str:
        # Counting each line once estimates every suffix (a line and its newline); the estimate only picks where
        # to start, and exact counts settle the first suffix that fits, as dropping line by line would.
        start, estimate = 0, sum(sizes) + len(sizes)
        while start < len(escaped) and estimate + (8 if dropped + start else 0) > tokens:
            estimate -= sizes[start] + 1
            start += 1
        while start > 0 and count_tokens(body(start - 1)) <= tokens:
            start -= 1
        while start < len(escaped) and count_tokens(body(start)) > tokens:
            start += 1
        return body(start) if start < len(escaped) else ""

    return _Block(tag, attrs, cap, render)


def _outputs_block(actions: Sequence[Action], cap: int) -> _Block:
    picked = _picked_outputs(actions)

    def one(i: int) -> str:
        a = actions[i]
        assert a.output is not None
        return (f'<output action="{i + 1}" tool={orjson.dumps(escape(a.receipt.tool)).decode()} '
                f'status="{"ERROR" if a.receipt.error else "ok"}">\n{escape(_head_tail(a.output.text))}\n</output>')

    def render(tokens: int) -> str:
        chosen: dict[int, str] = {}
        left = tokens
        for i in picked:
            text = one(i)
            size = count_tokens(text) + 1
            if size > left:
                if not chosen and left > 64:  # the most urgent output is shown clipped rather than not at all
                    chosen[i] = _fit(text, left - 1)
                continue
            chosen[i] = text
            left -= size
        return "\n".join(chosen[i] for i in sorted(chosen) if chosen[i])

    return _Block("tool_outputs", ' trust="untrusted"', cap, render)


def build(request: str, finals: Sequence[str], actions: Sequence[Action] = (), *, instructions: str = "",
          plan: str | None = None, state: str | None = None, claim: str = "", task: str = "",
          previous_gaps: Sequence[str] = (), prohibitions: Sequence[Standing] | None = None,
          budget: int = DEFAULT_DIGEST_BUDGET, ev: Evidence | None = None) -> str:
    """The verifier's input document for one turn, at most ``budget`` tokens.

    ``request``: the latest genuine user turn; ``finals``: the turn's final answers, oldest first (one per
    re-entry); ``actions``: :func:`turn_actions`; ``task``: the thread's first user message (shown only when it is
    not ``request``); ``instructions``: the agent's system prompt; ``plan``: the
    rendered live plan, or None; ``state``/``claim``: the self-report state (None when absent) and ``focus``;
    ``previous_gaps``: the previous pass's gaps; ``prohibitions``: the prohibitions in force (the session's,
    ``proxyvisor.proxy.planning``), or None to read them from ``task`` (turn 1) and ``request`` (turn 2 when it is
    another message) alone; ``ev``: :func:`evidence` of ``actions`` when the caller has it. Raises ValueError for a
    ``budget`` outside :data:`~proxyvisor.rules.DIGEST_BUDGET`.
    """
    if not DIGEST_BUDGET.admits(budget):
        raise ValueError(f"digest budget must be {DIGEST_BUDGET} tokens, got {budget}")
    follow_up = bool(task.strip()) and task.strip() != request.strip()
    if prohibitions is None:
        prohibitions = standing([(1, task), (2, request)] if follow_up else [(1, request)])
    ev = ev if ev is not None else evidence(actions)
    blocks = [
        _text_block("current_user_turn", ' authority="true"', clip_chars(request, REQUEST_CHARS), budget // 4),
        _text_block("agent_final_result", ' trust="untrusted"', CONTINUED.join(finals),
                    min(FINAL_TOKENS, budget // 4), newest_first=True),
    ]
    if follow_up:
        blocks.insert(1, _text_block("original_task", ' authority="true"', clip_chars(task, REQUEST_CHARS),
                                     budget // 8))
    if prohibitions:
        blocks.append(_lines_block("prohibitions", ' authority="user"',
                                   [f"- [turn {p.turn}] {p.text}" for p in prohibitions], budget // 8))
    blocks.append(_text_block("agent_state", ' trust="untrusted"',
                              f"state: {state or 'none'}" + (f"\nclaim: {claim[:CLAIM_CHARS]}" if claim else ""),
                              budget // 16))
    if previous_gaps:
        blocks.append(_lines_block("previously_flagged_gaps", "", [f"- {g}" for g in previous_gaps], budget // 16))
    if plan:
        blocks.append(_text_block("active_plan", "", plan, budget // 8))
    if instructions:
        blocks.append(_text_block("standing_instructions", "", instructions[:INSTRUCTIONS_CHARS], budget // 8))
    blocks.append(_lines_block("recorded_actions", ' trust="untrusted"', action_lines(actions) or ["(none)"],
                               budget // 4))
    blocks.append(_text_block("provenance", "", provenance(ev), 256))
    if any(a.output is not None for a in actions):
        blocks.append(_outputs_block(actions, budget))
    return _assemble(blocks, budget)


def _assemble(blocks: list[_Block], budget: int) -> str:
    open_tag, close_tag = "<verification_request>", "</verification_request>"
    slack = 8
    while True:
        left = budget - count_tokens(open_tag + "\n" + close_tag) - slack
        parts = [open_tag]
        for block in blocks:
            overhead = count_tokens(_element(block.tag, block.attrs, "")) + 1
            body = block.render(min(block.cap, left - overhead))
            if not body:
                continue
            element = _element(block.tag, block.attrs, body)
            left -= count_tokens(element) + 1
            parts.append(element)
        parts.append(close_tag)
        text = "\n".join(parts)
        over = count_tokens(text) - budget
        if over <= 0:
            return text
        # Tokens can merge or split across block boundaries; retry with the overflow reserved.
        slack += over + 8


def readback(request: ReadRequest, outputs: Mapping[int, str], budget: int) -> str:
    """The ``<readback>`` block answering the verifier's ``request`` (:mod:`.verdict`, "Read-back") from ``outputs`` (the recorded output
    text by action number), at most ``budget`` tokens of numbered lines, followed by :data:`READBACK_DONE`.
    Lines past the budget are named, not shown."""
    parts: list[str] = []
    left = budget
    for n, entry in enumerate(request.reads):
        action = entry.get("action") if isinstance(entry, dict) else None
        if n >= MAX_READS:
            parts.append(f"<lines>not read: at most {MAX_READS} entries per read</lines>")
            continue
        if not isinstance(action, int) or isinstance(action, bool) or action not in outputs:
            parts.append(f"<lines>not read: no recorded output for action {escape(str(action))}</lines>")
            continue
        lines = outputs[action].split("\n")
        wanted = entry.get("lines")
        try:
            chosen = lines_in(parse_ranges(wanted if isinstance(wanted, list) else [wanted], len(lines)))
        except RangeError as exc:
            parts.append(f'<lines action="{action}">not read: {escape(str(exc))} (the output has {len(lines)} '
                         "lines)</lines>")
            continue
        numbers = sorted(chosen)
        shown = [f"{k}| {escape(lines[k - 1])}" for k in numbers[:max(left, 0)]]  # a line costs 1 token or more
        kept = 0
        for size in count_each(shown):
            if size + 1 > left:
                break
            left -= size + 1
            kept += 1
        body = shown[:kept]
        if kept < len(numbers):
            skipped = ", ".join(f"{a}-{b}" if a != b else str(a) for a, b in runs(numbers[kept:]))
            body.append(f"[... lines {skipped} not shown: the read-back budget is spent ...]")
        ranges = ",".join(f"{a}-{b}" if a != b else str(a) for a, b in runs(numbers))
        parts.append(f'<lines action="{action}" range="{ranges}" of="{len(lines)}">\n' + "\n".join(body)
                     + "\n</lines>")
    return '<readback trust="untrusted">\n' + "\n".join(parts) + "\n</readback>\n" + READBACK_DONE
