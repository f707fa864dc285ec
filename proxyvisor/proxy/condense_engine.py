"""One condense round: the trio shell that feeds the sans-IO core and performs what it decides.

For the tool results of one request (:class:`ToolResult`, format-independent), :meth:`CondenseEngine.run_round`:

1. looks up the sticky decision of every result large enough to matter (:mod:`.decisions`);
2. takes the undecided results above the threshold (``[supervisor.condense] tokens_threshold``, never below
   512, optionally adaptive) as candidates, the largest 32 of them (the rest are left whole, for good);
3. condenses without a model (:mod:`~proxyvisor.condense.select`, the deterministic condenser) every candidate
   of a kind in ``deterministic_kinds`` (test runs, builds, installs: :func:`~proxyvisor.condense.baseline.kind_of`),
   and all of them when the round has no condenser;
4. for the others, builds their numbered views within the shared budget (:mod:`.view`) and makes **one** condenser
   call with the trusted task context and the views as untrusted JSON (:mod:`.protocol`);
5. validates the answer per result and rebuilds each narrowed result verbatim within ``budget_tokens``
   (:mod:`.reconstruct`), spills the original first (:mod:`.spill`; a failed spill keeps the original) and settles
   every decision in the cache.

A condenser that fails, times out (``timeout_s``) or answers nothing usable for a result (no verdict, bad ranges)
is no condenser for it: the deterministic condenser decides instead, so a round without a reachable model is still
condensed. A failing run whose call carries the last green run of the same command (:class:`ToolResult` ``green``)
leads with the lines new against it. Cancellation (the client hung up) propagates and settles nothing, so the next
request decides afresh. No result smaller than the threshold is ever shown to the condenser.

:meth:`CondenseEngine.recall` is the other half, for the results of earlier rounds that a request carries again:
it only looks up the decisions already made and never makes one, so a result that went upstream whole stays whole.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import trio

from ..config import CondenseConfig
from ..condense.adaptive import AdaptiveThresholds
from .condense_decisions import Decision, DecisionCache, decision_key
from ..supervisor_model import ModelAnswer, ModelCall, ReportedFailure
from ..condense.baseline import kind_of, new_lines, passed
from ..condense.protocol import AnswerError, Item, TaskContext, Verdict, build_messages, parse_answer
from ..condense.reconstruct import Baseline, Narrowed, condense, narrow
from ..condense.signals import focus_terms
from .spill import SpillStore
from ..condense.text import count_tokens, line_count, split_lines, tokens_may_exceed
from ..condense.view import MAX_CANDIDATES, allocate, build_view

log = logging.getLogger("proxyvisor.condense")

MIN_THRESHOLD = 512
"""The threshold's floor in tokens (seed 003): smaller results are never worth a model call."""
_TOKEN_MEMO = 16_384
_DECISION_MEMO = 65_536
_RECALLED = 256
"""Threads whose last recall :meth:`CondenseEngine.recall` keeps, to go on from it."""
_RECALLED_CHARS = 64 * 1024 * 1024
"""Characters of results those recalls hold at most, together (the oldest forgotten first): a thread's results are
its history's tool outputs, kept alive with it, so without this bound the recalls of threads whose bodies
``proxyvisor.proxy.bodies`` no longer keeps would hold up to :data:`_RECALLED` whole histories' outputs."""


@dataclass(frozen=True)
class ToolResult:
    """One plain-text tool result of a request: the ``call_id`` pairing it with its call, the ``tool`` name,
    its ``text``, whether it ``is_error``, the call's ``arguments`` as JSON text, and ``green``: the last green run
    of the same command in the session, as (its call id, its output), when there is one."""

    call_id: str
    tool: str
    text: str
    is_error: bool = False
    arguments: str = ""
    green: tuple[str, str] | None = None


@dataclass
class RoundReport:
    """The outcome of a round. ``decisions``: by call id, for every result that has one (cached or new);
    ``new``: how many were made now; ``condenser_called``; ``answer``: the condenser's answer, with its usage (None
    when it gave none); ``failure``: why the round gave nothing usable (empty when it did)."""

    decisions: dict[str, Decision] = field(default_factory=dict)
    new: int = 0
    fresh: set[str] = field(default_factory=set)
    """The call ids of the decisions made now (``new`` of them)."""
    condenser_called: bool = False
    answer: ModelAnswer | None = None
    failure: str = ""

    @property
    def answered(self) -> bool:
        """The condenser returned an answer."""
        return self.answer is not None

    def replacements(self) -> dict[str, str]:
        """Call id to the text the model's copy gets, for the results that change."""
        return {call_id: d.text for call_id, d in self.decisions.items() if d.text is not None}


def effective_threshold(tokens_threshold: int) -> int | None:
    """The candidate threshold in tokens for a configured ``tokens_threshold`` (None = condensing off)."""
    return None if tokens_threshold <= 0 else max(tokens_threshold, MIN_THRESHOLD)


def prepare_items(results: Sequence[tuple[ToolResult, int]], context: TaskContext, budget: int) -> list[Item]:
    """The condenser's view of ``results`` (each with its token count), ids ``r1``, ``r2``, ...: the views share
    ``budget`` tokens by size; focus terms come from the task, the round's intent and each call's arguments."""
    shared = [context.task_text(), context.intent]
    budgets = allocate([tokens for _, tokens in results], budget)
    items = []
    for n, ((result, tokens), view_budget) in enumerate(zip(results, budgets), start=1):
        terms = focus_terms([*shared, result.arguments])
        view = build_view(split_lines(result.text), view_budget, terms, tokens)
        items.append(Item(f"r{n}", result.tool, result.is_error, result.arguments, tokens, view))
    return items


class CondenseEngine:
    """Condense rounds for every session of a proxy (or one offline run).

    ``condenser`` is the model call of every round (None: each :meth:`run_round` brings its own, and a round
    without one is condensed without a model). ``cache`` None keeps no decisions (the
    offline tool). ``spill`` names and writes spill files. ``model_name`` resets adaptive state when it changes.
    """

    def __init__(self, settings: CondenseConfig, condenser: ModelCall | None, *, spill: SpillStore,
                 cache: DecisionCache | None = None, model_name: str = "") -> None:
        self.settings = settings
        self.condenser = condenser
        self.spill = spill
        self.cache = cache
        self.model_name = model_name
        self.adaptive = AdaptiveThresholds()
        # Token counts of results seen below the threshold, which get no decision but come back every request.
        self._tokens: OrderedDict[str, int] = OrderedDict()
        # Every request re-sends the session's earlier results: their decisions (None: there is none) by key, so
        # a request costs a hash per result rather than a cache read.
        self._known: OrderedDict[str, Decision | None] = OrderedDict()
        # The same by (session, call id, text): what :meth:`recall` reads first, with no hashing of the text.
        self._texts: OrderedDict[tuple[str, str, str], Decision | None] = OrderedDict()
        # The last recall of each thread (a session and the call id of its first result): the results it read, what
        # it found and the characters of their texts. The next request of the thread sends them again first, then
        # the round that was latest.
        self._recalled: OrderedDict[tuple[str, str], tuple[list[ToolResult], dict[str, Decision], int]] = \
            OrderedDict()
        self._recalled_chars = 0
        """The characters of the results :attr:`_recalled` holds (at most :data:`_RECALLED_CHARS`)."""
        self._lock = threading.Lock()

    @property
    def active(self) -> bool:
        """Whether rounds can condense at all: enabled and a threshold above 0."""
        return self.settings.enabled and effective_threshold(self.settings.tokens_threshold) is not None

    async def run_round(self, session: str, results: Sequence[ToolResult], context: TaskContext,
                        condenser: ModelCall | None = None) -> RoundReport:
        """Decide the model's copy of each of ``results`` (see the module docstring) with ``condenser`` (else the
        engine's own; without either, the deterministic condenser decides every candidate).

        Returns a :class:`RoundReport` whose ``replacements()`` are the texts to put in the model's copy. Never
        raises for a condenser, answer, spill or cache problem (the affected results stay whole); a cancellation
        of the calling task propagates, with nothing settled.
        """
        report = RoundReport()
        baseline = effective_threshold(self.settings.tokens_threshold)
        condenser = condenser or self.condenser
        if not self.active or baseline is None:
            return report
        state = self.adaptive.for_session(session, baseline, self.model_name) if self.settings.adaptive else None
        threshold = max(state.threshold, MIN_THRESHOLD) if state else baseline
        # The lowest threshold this session could ever use: a result above it that went upstream whole must
        # stay whole, so its "below the threshold" decision is recorded too (only when adaptive).
        floor = max(MIN_THRESHOLD, -(-baseline // 2)) if state else threshold
        large = [r for r in results if tokens_may_exceed(r.text, floor)]
        keys = {r.call_id: decision_key(session, r.call_id, r.text) for r in large}
        known, counts = await trio.to_thread.run_sync(self._lookup, large, keys) if large else ({}, {})
        pending: list[tuple[ToolResult, int]] = []
        hidden = False
        for result in large:
            key = keys[result.call_id]
            if key in known:
                report.decisions[result.call_id] = known[key]
                continue
            tokens = counts[key]
            if tokens > threshold:
                pending.append((result, tokens))
            elif tokens > floor:
                hidden = hidden or tokens > baseline
                report.decisions[result.call_id] = _untouched("below the session's adaptive threshold", tokens,
                                                              result.text)
        if state and hidden:
            state.reprobe()
        pending.sort(key=lambda pair: pair[1], reverse=True)
        chosen, overflow = pending[:MAX_CANDIDATES], pending[MAX_CANDIDATES:]
        for result, tokens in overflow:
            report.decisions[result.call_id] = _untouched(f"over {MAX_CANDIDATES} candidates in one round", tokens,
                                                          result.text)
        if chosen:
            report.decisions.update(await self._condense(session, chosen, context, report, keys, condenser))
            if state and report.answered:
                before = sum(tokens for _, tokens in chosen)
                after = sum(report.decisions[r.call_id].tokens_after for r, _ in chosen)
                state.observe(1 - after / before)
        fresh = {call_id: d for call_id, d in report.decisions.items() if keys[call_id] not in known}
        report.new, report.fresh = len(fresh), set(fresh)
        if self.cache is not None and fresh:
            settled = await trio.to_thread.run_sync(self._settle, {keys[c]: d for c, d in fresh.items()})
            report.decisions.update({c: settled[keys[c]] for c in fresh})
        if self.cache is not None:
            # What the cache now holds for each result read or decided here (None: nothing, or a result too small
            # to be read, which has none): the next request, which repeats them, recalls them from memory, with no
            # worker thread (a recall from before, a rewritten history's, no longer holds).
            with self._lock:
                for result in results:
                    if tokens_may_exceed(result.text, MIN_THRESHOLD):  # those recall reads (``large`` among them)
                        self._memo(session, result, report.decisions.get(result.call_id))
        return report

    async def recall(self, session: str, results: Sequence[ToolResult]) -> dict[str, Decision]:
        """The decisions already made for ``results`` (by call id), for re-applying them byte-identically;
        a result without one (it went upstream whole, or was never large enough) is absent. Makes no decision and
        calls no model; never raises for a cache problem (the result is then absent: it stays whole)."""
        if not self.active or self.cache is None or not results:
            return {}
        results = list(results)
        thread = (session, results[0].call_id)
        read, found, chars = self._recalled.pop(thread, ([], {}, 0))
        self._recalled_chars -= chars
        # Results equal to those the thread's last recall read find the same: a decision, once settled, is never
        # replaced, and one never made for an earlier result is never made later (only a latest round's are). So
        # only the results after them are read, when the history only grew; otherwise all of them, again.
        if len(read) <= len(results) and results[:len(read)] == read:
            found, start = dict(found), len(read)
        else:
            found, start, chars = {}, 0, 0
        # Shorter results cannot have had a decision.
        large = [r for r in results[start:] if tokens_may_exceed(r.text, MIN_THRESHOLD)]
        unknown = []
        with self._lock:
            for result in large:
                # By the text itself: a later request repeats the same string object, whose hash Python keeps, so
                # this costs no hashing of the text; only a result not seen yet goes to the decision key and cache.
                memo = (session, result.call_id, result.text)
                if memo not in self._texts:
                    unknown.append(result)
                elif (decision := self._texts[memo]) is not None:
                    found[result.call_id] = decision
        if unknown:
            found.update(await trio.to_thread.run_sync(self._recall, session, unknown))
            with self._lock:  # a result the cache failed to read is read again next time: nothing is kept
                read_all = all((session, r.call_id, r.text) in self._texts for r in unknown)
            if not read_all:
                return found
        chars += sum(len(r.text) for r in results[start:])
        self._recalled[thread] = (results, dict(found), chars)
        self._recalled_chars += chars
        while len(self._recalled) > _RECALLED or self._recalled_chars > _RECALLED_CHARS:
            self._recalled_chars -= self._recalled.popitem(last=False)[1][2]
        return found

    def _recall(self, session: str, results: list[ToolResult]) -> dict[str, Decision]:
        found: dict[str, Decision] = {}
        for result in results:
            key = decision_key(session, result.call_id, result.text)
            with self._lock:
                hit = key in self._known
                decision = self._known.get(key)
            if not hit:
                assert self.cache is not None
                try:
                    decision = self.cache.get(key)
                except Exception as exc:  # noqa: BLE001 - a broken cache leaves results whole, never fails a request
                    log.warning("condense cache read failed: %s", exc)
                    continue
                self._remember(key, decision)
            with self._lock:
                self._memo(session, result, decision)
            if decision is not None:
                found[result.call_id] = decision
        return found

    def _memo(self, session: str, result: ToolResult, decision: Decision | None) -> None:
        """(Under ``_lock``.) What :meth:`recall` finds for ``result`` of ``session`` from now on."""
        memo = (session, result.call_id, result.text)
        self._texts.pop(memo, None)
        self._texts[memo] = decision
        while len(self._texts) > _DECISION_MEMO:
            self._texts.popitem(last=False)

    def _remember(self, key: str, decision: Decision | None) -> None:
        with self._lock:
            self._known.pop(key, None)
            self._known[key] = decision
            while len(self._known) > _DECISION_MEMO:
                self._known.popitem(last=False)

    async def _condense(self, session: str, chosen: list[tuple[ToolResult, int]], context: TaskContext,
                        report: RoundReport, keys: dict[str, str], condenser: ModelCall | None) -> dict[str, Decision]:
        kinds = set(self.settings.deterministic_kinds)
        asked = [(r, t) for r, t in chosen if condenser is not None and kind_of(r.arguments, r.text) not in kinds]
        verdicts: dict[str, Verdict | str] = {}
        if asked and condenser is not None:
            verdicts = await self._ask(asked, context, report, condenser)
        decisions = {}
        for result, tokens in chosen:
            verdict = verdicts.get(result.call_id)
            decisions[result.call_id] = await self._decide(session, result, tokens, context,
                                                           verdict if isinstance(verdict, Verdict) else None,
                                                           keys[result.call_id])
        return decisions

    async def _ask(self, asked: list[tuple[ToolResult, int]], context: TaskContext, report: RoundReport,
                   condenser: ModelCall) -> dict[str, Verdict | str]:
        """The condenser's verdicts by call id (a string: why there is none usable) for the ``asked`` results."""
        items = await trio.to_thread.run_sync(prepare_items, asked, context, self.settings.view_budget_tokens)
        log.info("condensing %d tool result(s): %s", len(asked),
                 " · ".join(f"{r.tool} {tokens}" for r, tokens in asked))
        report.condenser_called = True
        answer: ModelAnswer | None = None
        reported = False
        with trio.move_on_after(self.settings.timeout_s) as scope:
            try:
                answer = report.answer = await condenser(build_messages(context, items))
            except Exception as exc:  # noqa: BLE001 - any failure of the model call leaves it to the deterministic one
                report.failure = f"condenser failed: {type(exc).__name__}: {_first_line(str(exc))}"
                reported = isinstance(exc, ReportedFailure)
        if scope.cancelled_caught:
            report.failure = f"condenser timed out after {self.settings.timeout_s:g} s"
        verdicts: dict[str, Verdict | str] = {}
        if answer is not None:
            try:
                verdicts = parse_answer(answer.text, items)
            except AnswerError as exc:
                report.failure = f"unusable answer: {exc}"
        if report.failure:
            (log.info if reported else log.warning)("condenser gave nothing usable (%s): condensing without a model",
                                                    report.failure)
        return {result.call_id: verdicts.get(item.id, report.failure or "no answer")
                for item, (result, _tokens) in zip(items, asked)}

    async def _decide(self, session: str, result: ToolResult, tokens: int, context: TaskContext,
                      verdict: Verdict | None, key: str) -> Decision:
        """The decision for ``result``: the model's ``verdict``, or the deterministic condenser's (None)."""
        path = self.spill.path_for(session, result.tool, key)
        narrowed, lines, green = await trio.to_thread.run_sync(self._narrow, result, tokens, context, verdict,
                                                               str(path))
        if not isinstance(narrowed, Narrowed):
            return _untouched(narrowed, tokens, result.text)
        try:
            await trio.to_thread.run_sync(self.spill.write, path, result.text)
        except OSError as exc:
            log.warning("spill failed, %s result kept whole: %s", result.tool, exc)
            return _untouched(f"spill failed: {exc.strerror or exc}", tokens, result.text)
        log.info("condensed (%s): %s %d→%d tokens", narrowed.condenser, result.tool, tokens, narrowed.tokens)
        replaced = verdict is not None and verdict.kind == "replace"
        return Decision(narrowed.text, "replaced" if replaced else "condensed", tokens, narrowed.tokens,
                        narrowed.kept_lines, lines, str(path), narrowed.condenser, tuple(narrowed.kept_ranges), green)

    def _narrow(self, result: ToolResult, tokens: int, context: TaskContext, verdict: Verdict | None,
                path: str) -> tuple[Narrowed | str, int, str]:
        """(In a worker thread.) The narrowed text or why there is none, the result's line count, and the call id
        of the green run it was compared with (empty: none)."""
        lines = split_lines(result.text)
        terms = focus_terms([context.task_text(), context.intent, result.arguments])
        budget = self.settings.budget_tokens
        if verdict is not None:
            narrowed = narrow(verdict, lines, tool=result.tool, spill_path=path, tokens_before=tokens, budget=budget,
                              terms=terms)
            return narrowed, len(lines), ""
        baseline = None
        if result.green is not None and not passed(lines, result.is_error):
            new = new_lines(lines, split_lines(result.green[1]))
            baseline = Baseline(result.green[0], tuple(new)) if new else None
        narrowed = condense(lines, spill_path=path, tokens_before=tokens, budget=budget, terms=terms,
                            baseline=baseline)
        return narrowed, len(lines), baseline.label if baseline else ""

    def _lookup(self, results: list[ToolResult], keys: dict[str, str]) -> tuple[dict[str, Decision], dict[str, int]]:
        """(In a worker thread.) The cached decisions by key, and the token counts of the other results."""
        known: dict[str, Decision] = {}
        counts: dict[str, int] = {}
        for result in results:
            key = keys[result.call_id]
            decision = self.cache.get(key) if self.cache is not None else None
            if decision is not None:
                self._remember(key, decision)
                known[key] = decision
                continue
            with self._lock:
                tokens = self._tokens.pop(key, None)
            if tokens is None:
                tokens = count_tokens(result.text)
            with self._lock:
                self._tokens[key] = tokens
                while len(self._tokens) > _TOKEN_MEMO:
                    self._tokens.popitem(last=False)
            counts[key] = tokens
        return known, counts

    def _settle(self, decisions: dict[str, Decision]) -> dict[str, Decision]:
        assert self.cache is not None
        settled = {key: self.cache.settle(key, d) for key, d in decisions.items()}
        for key, decision in settled.items():
            self._remember(key, decision)
        return settled


def _untouched(reason: str, tokens: int, text: str) -> Decision:
    total = line_count(text)
    return Decision(None, reason, tokens, tokens, total, total)


def _first_line(message: str, limit: int = 200) -> str:
    """The first line of an error message, at most ``limit`` characters (an ellipsis marks a cut): litellm's
    messages go on for lines of advice."""
    line = next((part.strip() for part in message.splitlines() if part.strip()), "")
    return line if len(line) <= limit else line[: limit - 1] + "…"
