"""The adaptive condense threshold: a per-session multiplier between 0.5x and 2x, learned from realized savings.

Off by default (``[supervisor.condense] adaptive = false``). The rule is seed 003's (mechanics reference,
section 5): ``q`` is an exponentially weighted mean of the share of tokens each condensed round saved (alpha
0.25, prior 0.5; an unusable condenser answer counts as 0). The multiplier is ``m = 2^(1 - 2q)``, so ``q = 0``
doubles the threshold (condensing has not paid off: try it less), ``q = 0.5`` leaves it and ``q = 1`` halves it.
The threshold is ``round(baseline * m)`` clamped to ``[ceil(baseline / 2), 2 * baseline]``. When a raised
threshold hid results that the baseline would have sent to the condenser, ``q`` drifts back toward 0.5 (alpha
0.1) so a bad start cannot lock condensing out for good.

State is per session, process-local, and starts over when the baseline or the supervisor model changes.
"""

from __future__ import annotations

import math
from collections import OrderedDict

ALPHA = 0.25
PRIOR = 0.5
REPROBE_ALPHA = 0.1


class AdaptiveThreshold:
    """One session's multiplier over ``baseline`` tokens (see the module docstring)."""

    def __init__(self, baseline: int) -> None:
        self.baseline = baseline
        self.q = PRIOR

    @property
    def multiplier(self) -> float:
        return min(2.0, max(0.5, math.pow(2.0, 1.0 - 2.0 * self.q)))

    @property
    def threshold(self) -> int:
        """The session's current threshold in tokens."""
        value = math.floor(self.baseline * self.multiplier + 0.5)
        return min(2 * self.baseline, max(math.ceil(self.baseline / 2), value))

    def observe(self, saved: float) -> None:
        """Account one condensed round that saved the share ``saved`` (clamped to 0..1) of its candidates' tokens."""
        self.q += ALPHA * (min(1.0, max(0.0, saved)) - self.q)

    def reprobe(self) -> None:
        """A raised threshold hid results the baseline would have condensed: drift back toward neutral."""
        self.q += REPROBE_ALPHA * (PRIOR - self.q)


class AdaptiveThresholds:
    """The multipliers of the most recently seen ``max_sessions`` sessions."""

    def __init__(self, max_sessions: int = 1024) -> None:
        self.max_sessions = max_sessions
        self._states: OrderedDict[str, tuple[tuple[int, str], AdaptiveThreshold]] = OrderedDict()

    def for_session(self, session: str, baseline: int, model: str) -> AdaptiveThreshold:
        """The session's state, new when unseen or when ``baseline`` or ``model`` changed."""
        entry = self._states.pop(session, None)
        if entry is None or entry[0] != (baseline, model):
            entry = ((baseline, model), AdaptiveThreshold(baseline))
        self._states[session] = entry
        while len(self._states) > self.max_sessions:
            self._states.popitem(last=False)
        return entry[1]
