"""The rules of the settings that more than one module enforces: the range of each bounded number and the values
of each choice, stated once.

The configuration's schema (:mod:`proxyvisor.config`) builds its constraints from them, so a file that breaks one
is refused naming the key; the cores that take the values (:mod:`proxyvisor.gate`, :mod:`proxyvisor.condense`)
check the same rules when they are called directly. Plain values only: no I/O, no schema library, so any core may
import this module.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Literal, get_args


@dataclass(frozen=True)
class Range:
    """The values a number accepts: finite (``nan`` and ``inf`` never), at least ``low`` (above it when
    ``low_open``) and at most ``high``. The default, ``>= 0``, is the rule of every number in the configuration
    that states no other."""

    low: float = 0
    high: float = math.inf
    low_open: bool = False

    def admits(self, value: float) -> bool:
        return math.isfinite(value) and (value > self.low if self.low_open else value >= self.low) \
            and value <= self.high

    def __str__(self) -> str:
        low, high = (int(v) if float(v).is_integer() else v for v in (self.low, self.high))
        if math.isinf(self.high):
            return f"{'>' if self.low_open else '>='} {low}"
        return f"in ({low}, {high}]" if self.low_open else f"{low}-{high}"


NON_NEGATIVE = Range()
POSITIVE = Range(0, low_open=True)
"""Durations, most of all."""

REENTRY_BUDGET = Range(0, 8)
"""``[supervisor.gate] reentry_budget``: times per turn the gate may continue a turn upstream to close gaps."""
DEFAULT_REENTRIES = 2
DIGEST_BUDGET = Range(1_024)
"""``[supervisor.gate] digest_budget_tokens``: below 1,024 tokens the request and the answer could not both be
shown to the verifier."""
DEFAULT_DIGEST_BUDGET = 16_384
VIEW_BUDGET = Range(256)
"""``[supervisor.condense] view_budget_tokens`` and ``proxyvisor condense --budget``: tokens of numbered view; 256
is also each candidate's floor, so a smaller view could not show even one."""
DEFAULT_VIEW_BUDGET = 32_000
RESULT_BUDGET = Range(512)
"""``[supervisor.condense] budget_tokens``: tokens of one condensed result; below 512 the notice and the runner's
last lines would leave no room for a failure."""
DEFAULT_RESULT_BUDGET = 4_000
CondenseKind = Literal["test", "build", "install"]
CONDENSE_KINDS: tuple[CondenseKind, ...] = get_args(CondenseKind)
"""The kinds of tool run ``[supervisor.condense] deterministic_kinds`` may name (``proxyvisor.condense.baseline``)."""
AUTHORIZER_BUDGET = Range(1_024)
"""``[supervisor.authorizer] budget_tokens``: the judge's input bound; below 1,024 tokens not even one call with
its prohibition could be shown."""
DEFAULT_AUTHORIZER_BUDGET = 32_000
"""The full judgment's request budget (reference section 7, "Authorizer")."""
DEFAULT_AUTHORIZER_TIMEOUT_S = 30.0
"""The full judgment's deadline, both calls (reference section 7)."""
AuthorizerMode = Literal["block", "advise"]
AUTHORIZER_MODES: tuple[AuthorizerMode, ...] = get_args(AuthorizerMode)
BLOCK, ADVISE = AUTHORIZER_MODES
"""``[supervisor.authorizer] mode``: a confirmed conflict stops the call, or is only recorded and noted."""
LEARNING_BUDGET = Range(200, 32_000)
"""``[supervisor.learning] budget_tokens``: the Active Memory Pack's bound; below 200 tokens not one record with
its id and source would fit beside the note's header."""
DEFAULT_LEARNING_BUDGET = 1_500
"""The Active Memory Pack's default bound (seed 003, "Cross-session memory")."""
CHILD_WALL_CLOCK = Range(30, 3_600)
"""``[model_routing.children] wall_clock_s``: seconds a child run may take (seed 002)."""

Format = Literal["chat", "messages", "responses"]
FORMATS: tuple[Format, ...] = get_args(Format)
"""The three wire formats: OpenAI Chat Completions, Anthropic Messages, OpenAI Responses."""

FailurePolicy = Literal["fail_open", "fail_closed"]
FAILURE_POLICIES: tuple[FailurePolicy, ...] = get_args(FailurePolicy)
FAIL_OPEN, FAIL_CLOSED = FAILURE_POLICIES
"""``[supervisor.gate] failure_policy``: what a turn whose verifier cannot answer is labelled."""

Hold = Literal["answer", "stop"]
HOLDS: tuple[Hold, ...] = get_args(Hold)
HOLD_ANSWER, HOLD_STOP = HOLDS
"""``[supervisor.gate] hold``: what of a streamed final answer waits for the verdict."""

Complexity = Literal["CLEAR", "COMPLICATED", "COMPLEX", "CHAOTIC"]
COMPLEXITY: tuple[Complexity, ...] = get_args(Complexity)
"""Complexity ranks, lowest first (seed 000). A request with no complexity is below every gate."""
RoutingMode = Literal["explicit", "adaptive", "suggest"]
ROUTING_MODES: tuple[RoutingMode, ...] = get_args(RoutingMode)
FallbackPolicy = Literal["fail_closed", "same_adapter_default", "next_eligible"]
FALLBACK_POLICIES: tuple[FallbackPolicy, ...] = get_args(FallbackPolicy)

ROLE_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
"""A role becomes a delegation tool named after it: the tool-name rule of the model APIs."""
