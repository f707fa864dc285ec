"""The detectors: loop, no-progress, recovery, alternation and monologue, over rounds, with no model call.

Thresholds are fixed constants (seed 003 "Detectors"; OpenHands' stuck detector for alternation and monologue,
``reference/peer-systems.md`` section 2). A round is **novel** when one of its receipts was not among the last
:data:`SEEN_CAP` observations, or is a successful declared mutation (a guessed one earns novelty only when its
receipt is new); a round without tool calls is never novel.

- **loop**: the round is not novel and the last :data:`LOOP_ROUNDS` rounds are tool rounds with the same calls and
  the same results. An identical call whose result changed is novel, so polling a job that advances is no loop.
- **alternation**: the round is not novel and the last :data:`ALTERNATION_ROUNDS` tool rounds alternate between
  two different rounds (A-B-A-B-A-B), the last four of them not novel.
- **monologue**: the last :data:`MONOLOGUE_ROUNDS` rounds have no tool call and the same text (or are turns the
  client dropped, see ``RoundReader``).
- **no_progress**: none of the last :data:`NO_PROGRESS_ROUNDS` rounds was novel.
- **recovery**: a command execution failed again without having succeeded since its previous failure, and either
  its last two failures gave the same output (the same error again: nothing changed) or it has failed
  :data:`RECOVERY_FAILURES` times (the errors change, but it keeps failing). A success of the same command, with
  no failure of it in the same round, clears its record; at most :data:`FAILED_CAP` commands are remembered.

Windows (and the failure records) start afresh at each genuine user turn; the novelty memory does not.
:class:`HistoryTracker` keeps one agent thread's state up to date from each request's history incrementally, and
rebuilds it when the history was rewritten.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Generator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..transcript import Message, fingerprint
from .receipts import DECLARED, ReceiptCache, Round, RoundReader, UserTurn

LOOP_ROUNDS = 3
NO_PROGRESS_ROUNDS = 5
ALTERNATION_ROUNDS = 6
MONOLOGUE_ROUNDS = 3
RECOVERY_FAILURES = 4
SEEN_CAP = 128
FAILED_CAP = 64

LOOP, ALTERNATION, MONOLOGUE, NO_PROGRESS, RECOVERY = "loop", "alternation", "monologue", "no_progress", "recovery"
SIGNALS = (LOOP, ALTERNATION, MONOLOGUE, NO_PROGRESS, RECOVERY)
"""Every signal, highest priority first (a steer note names one signal per round)."""
DESCRIPTIONS = {
    LOOP: "the same calls with the same results, three tool rounds in a row",
    ALTERNATION: "two rounds alternating, with the same results, over six tool rounds",
    MONOLOGUE: "three turns in a row without a tool call, saying the same",
    NO_PROGRESS: "five rounds without a new result or a successful change",
    RECOVERY: "a command failing again without a success since",
}
"""One line per signal, for people reading a timeline."""


@dataclass(frozen=True, slots=True)
class _Seen:
    key: bytes
    novel: bool
    tools: bool
    text_key: bytes | None


class Detectors:
    """Detector state for one agent thread: feed rounds in order with :meth:`observe`, user turns with
    :meth:`user_turn`. Memory is bounded (:data:`SEEN_CAP`, :data:`FAILED_CAP`, a 6-round window)."""

    def __init__(self) -> None:
        self._seen: OrderedDict[bytes, None] = OrderedDict()
        self._window: deque[_Seen] = deque(maxlen=max(ALTERNATION_ROUNDS, NO_PROGRESS_ROUNDS, LOOP_ROUNDS))
        self._failed: OrderedDict[bytes, list[bytes]] = OrderedDict()

    def user_turn(self) -> None:
        self._window.clear()
        self._failed.clear()

    def _novel(self, round_: Round) -> bool:
        novel = False
        for r in round_.receipts:
            if r.mutation == DECLARED and not r.error:
                novel = True
            if r.observation in self._seen:
                self._seen.move_to_end(r.observation)
            else:
                novel = True
                self._seen[r.observation] = None
                if len(self._seen) > SEEN_CAP:
                    self._seen.popitem(last=False)
        return novel

    def _recovery(self, round_: Round) -> bool:
        failed_now = {r.call_key: r.result_key for r in round_.receipts if r.command is not None and r.error}
        fired = False
        for r in round_.receipts:
            if r.command is not None and not r.error and r.call_key not in failed_now:
                self._failed.pop(r.call_key, None)
        for command, result in failed_now.items():
            history = self._failed.pop(command, [])
            history.append(result)
            self._failed[command] = history[-RECOVERY_FAILURES:]
            if len(self._failed) > FAILED_CAP:
                self._failed.popitem(last=False)
            if len(history) >= RECOVERY_FAILURES or (len(history) >= 2 and history[-1] == history[-2]):
                fired = True
        return fired

    def observe(self, round_: Round) -> tuple[str, ...]:
        """The signals that fire at this round, highest priority first (empty when none)."""
        novel = self._novel(round_)
        tools = bool(round_.receipts)
        self._window.append(_Seen(round_.key, novel, tools, None if tools else round_.text_key))
        window = list(self._window)
        fired: list[str] = []
        if tools and not novel:
            last = window[-LOOP_ROUNDS:]
            if len(last) == LOOP_ROUNDS and all(s.tools and s.key == last[0].key for s in last):
                fired.append(LOOP)
            last = window[-ALTERNATION_ROUNDS:]
            if (len(last) == ALTERNATION_ROUNDS and all(s.tools for s in last) and last[0].key != last[1].key
                    and all(s.key == last[i % 2].key for i, s in enumerate(last))
                    and not any(s.novel for s in last[-4:])):
                fired.append(ALTERNATION)
        last = window[-MONOLOGUE_ROUNDS:]
        if (not tools and len(last) == MONOLOGUE_ROUNDS
                and all(not s.tools and s.text_key == last[0].text_key for s in last)):
            fired.append(MONOLOGUE)
        last = window[-NO_PROGRESS_ROUNDS:]
        if len(last) == NO_PROGRESS_ROUNDS and not any(s.novel for s in last):
            fired.append(NO_PROGRESS)
        if self._recovery(round_):
            fired.append(RECOVERY)
        return tuple(fired)


@dataclass(frozen=True, slots=True)
class Firing:
    """Signals that fired at the round starting at history position ``index``."""

    index: int
    signals: tuple[str, ...]


@dataclass
class Update:
    """What one request's history added: ``rounds`` completed, ``firings`` among them, whether the state was
    ``rebuilt`` from scratch, and how the new part ended: ``last`` is the final round or user turn (None when
    nothing completed) and ``signals`` what fired at that final round (empty after a user turn)."""

    rounds: list[Round] = field(default_factory=list)
    firings: list[Firing] = field(default_factory=list)
    rebuilt: bool = False
    last: Round | UserTurn | None = None

    @property
    def signals(self) -> tuple[str, ...]:
        if isinstance(self.last, Round) and self.firings and self.firings[-1].index == self.last.index:
            return self.firings[-1].signals
        return ()


class HistoryTracker:
    """One agent thread's detectors, kept up to date from each request's full history.

    Agents resend their whole history on every request. :meth:`update` feeds only the items after those seen
    before; it checks two anchors (the first item and the last one fed) with :func:`fingerprint`, whose cost does
    not depend on the history's length or an output's size, and when either changed, or the history got shorter,
    the history was rewritten (compaction, an edit) and the state is rebuilt from scratch. An edit strictly
    between those two anchors goes unnoticed (checking every item would make each request cost O(history)); the
    state then reflects the history as it was first seen.

    A rebuild reads the whole history again, but its receipts come from :attr:`cache` (by content), so it computes
    only those of calls not seen before; and :meth:`updating` does it a step at a time, so a shell can let other
    work run in between.
    """

    def __init__(self, mutating_tools: frozenset[str] = frozenset(), cache: ReceiptCache | None = None) -> None:
        self.mutating_tools = mutating_tools
        self.cache = cache if cache is not None else ReceiptCache(mutating_tools)
        """Receipts by content, kept across rebuilds (this process's only: it pickles empty); one given (shared with
        other trackers) must be of the same ``mutating_tools``."""
        self._reset()

    def _reset(self) -> None:
        self.reader = RoundReader(self.mutating_tools, self.cache)
        self.detectors = Detectors()
        self.fed = 0
        self.turn_start: int | None = None
        """History position of the latest genuine user turn (None before the first)."""
        self.user_turns: list[int] = []
        """History positions of every genuine user turn fed, oldest first (the last one is ``turn_start``)."""
        self._first: bytes | None = None
        self._last: bytes | None = None

    def _rewritten(self, items: Sequence[Any], message_of: Callable[[Any], Message]) -> bool:
        if not self.fed:
            return False
        if len(items) < self.fed:
            return True
        return (fingerprint(message_of(items[0])) != self._first
                or fingerprint(message_of(items[self.fed - 1])) != self._last)

    def from_start(self, items: Sequence[Any], message_of: Callable[[Any], Message]) -> bool:
        """Whether :meth:`update` would read ``items`` from the start: the thread's first history, or a rewritten
        one (class docstring). Costs two :func:`fingerprint` look-ups."""
        return not self.fed or self._rewritten(items, message_of)

    def update(self, items: Sequence[Any], message_of: Callable[[Any], Message],
               schemas: Mapping[str, Mapping[str, Any]]) -> Update:
        """Feed the new part of ``items`` (one request's history, raw format items normalised by
        ``message_of``); ``schemas`` are the request's tool argument schemas by tool name."""
        update = Update()
        for _step in self.updating(items, message_of, schemas, update):
            pass
        return update

    def go_on(self, items: Sequence[Any], message_of: Callable[[Any], Message],
              schemas: Mapping[str, Mapping[str, Any]]) -> Update:
        """:meth:`update` of ``items`` the caller found going on from what this tracker read (:meth:`from_start`
        False, with nothing fed since): its new items are fed at once, without looking at its ends again."""
        update = Update()
        self._go_on(items, message_of, schemas, update)
        return update

    def updating(self, items: Sequence[Any], message_of: Callable[[Any], Message],
                 schemas: Mapping[str, Mapping[str, Any]], update: Update) -> Generator[None, None, None]:
        """:meth:`update` as an iterator, adding what it reads to ``update`` (a new one). A history read from the
        start (:meth:`from_start`) is read into a fresh state, one item per step (it yields after each), which
        replaces this tracker's only once the last item is read: an update of this tracker made meanwhile is
        replaced whole, never mixed with it, and a reading abandoned part way changes nothing here (``update`` is
        then partial). When the tracker read the same history meanwhile (another request of the thread, its
        retry), the fresh state is dropped and ``update`` is what goes on from it, as if this reading came after.
        A history that goes on is fed at once (no steps: it adds an item or two)."""
        if not self.from_start(items, message_of):
            self._go_on(items, message_of, schemas, update)
            return
        fresh = HistoryTracker(self.mutating_tools, self.cache)
        update.rebuilt = bool(self.fed)
        for index in range(len(items)):
            fresh._feed(items, index, message_of(items[index]), schemas, update)
            yield
        if not self.from_start(items, message_of):
            vars(update).update(vars(Update()))
            self._go_on(items, message_of, schemas, update)
            return
        fresh.fed = len(items)
        vars(self).update(vars(fresh))

    def _go_on(self, items: Sequence[Any], message_of: Callable[[Any], Message],
               schemas: Mapping[str, Mapping[str, Any]], update: Update) -> None:
        """Feed the items of ``items`` past those this tracker read (it read the others), adding to ``update``."""
        for index in range(self.fed, len(items)):
            self._feed(items, index, message_of(items[index]), schemas, update)
        self.fed = len(items)

    def _feed(self, items: Sequence[Any], index: int, message: Message, schemas: Mapping[str, Mapping[str, Any]],
              update: Update) -> None:
        """Feed history item ``index`` of ``items`` (``message``), adding what it completed to ``update``."""
        if index == 0:
            self._first = fingerprint(message)
        if index == len(items) - 1:
            self._last = fingerprint(message)
        for event in self.reader.feed(index, message, schemas):
            update.last = event
            if isinstance(event, UserTurn):
                self.detectors.user_turn()
                self.turn_start = event.index
                self.user_turns.append(event.index)
                continue
            update.rounds.append(event)
            signals = self.detectors.observe(event)
            if signals:
                update.firings.append(Firing(event.index, signals))
