"""Delegation in the proxy: one tool per role offered to the model, run by proxyvisor, never by the agent.

With supervision on and ``[model_routing] enabled`` (both gates, seed 000), :class:`ProxyDelegation` serves:

- **the delegation tools** (seed 001): each role the conversation's agent may delegate to (a role no other role
  supervises, seed 004) becomes one tool named after the role, described by the role's ``description``, whose
  input is ``{"prompt": string}`` and nothing else: no parent context passes through. They are added after the
  agent's own tools on a request that offers tools, ends with a user message or tool results, and to which the
  policy applies (:func:`~proxyvisor.adapters.routing.is_supervised`: a proxied request carries no complexity,
  so under ``adaptive`` none is offered). A role named like one of the agent's tools is not offered (logged
  once): the agent's tool wins.
- **the turn** (:class:`DelegationTurn`): when the model calls a delegation tool, proxyvisor runs the child
  itself (:class:`~proxyvisor.adapters.delegate.Delegator`: route, breaker, clocks, claim check, evidence), one
  child per call, the calls of one response in parallel under one budget, and continues the turn upstream with
  the shaped results (:mod:`proxyvisor.proxy.continuation`). The agent sees only the model's continued answer.
  Ordinary tool calls in the same response as a delegation call are left out of the continuation (the model
  calls them again if it still needs them); on a stream, those that reached the agent before the delegation call
  stay in its answer, and the agent runs them. What the upstream saw beyond the agent's history is re-inserted
  at the same place in the agent's later requests (``Delegated``, :mod:`proxyvisor.proxy.supervise`), so the
  upstream prefix stays stable. Every child shares one trace with the request (``Exchange.trace``: a span under
  the agent's W3C ``traceparent`` header when it sends one, else a fresh trace).
- **``POST /proxyvisor/delegate``**: ``{"role", "prompt"}`` (optional ``complexity``, ``caller`` (the delegating
  role, for nested delegation along the supervision graph), ``adapter``/``model``/``effort`` overrides) runs one
  child and answers :meth:`~proxyvisor.adapters.delegate.Delegation.as_dict`; a ``traceparent`` header makes
  the child join that trace (a nested proxyvisor, a child agent). Status: 200 when a result is given (including
  a failed child's, ``skipped`` and ``unsupervised``), 400 invalid, 429 with ``Retry-After`` when every pool is
  cooling, 503 for the parallel cap or the budget.

Each delegation's status, record id, dead letter (a hand-off that failed transiently on every attempt,
:mod:`proxyvisor.adapters.retry`; its error result names it) and evidence attributes, each attempt included, go
into the request's ledger line.
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson
import trio

from ..adapters.state import StateBackend
from ..adapters.children import Budget
from ..adapters.delegate import INVALID_STATUS, REFUSED, Delegator
from ..adapters.failures import CAPACITY
from ..adapters.graph import ROOT, may_delegate
from ..adapters.results import child_traceparent
from ..adapters.routing import is_supervised
from ..config import Config, RoleConfig, RouteTarget
from ..rules import COMPLEXITY
from .continuation import Continuation, Resend
from .formats import CHAT, ToolSpec, WireFormat
from .formats.base import CallResult
from .server import Request, Response
from .telemetry import Tracing

if TYPE_CHECKING:  # supervision holds the delegation turn of its exchange
    from .supervise import Exchange

log = logging.getLogger("proxyvisor.delegation")

ROUNDS = 4
"""Times one agent request's turn may be continued after delegations (each round: the calls of one response)."""
PROMPT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"prompt": {"type": "string", "description": "The complete task for the sub-agent: everything "
                                                               "it needs to know, since it sees nothing else."}},
    "required": ["prompt"],
    "additionalProperties": False,
}
_JSON = [(b"content-type", b"application/json")]


def tool_for(role: RoleConfig) -> ToolSpec:
    """The delegation tool of ``role`` (seed 001: named after the role, described by its description)."""
    about = role.description.strip() or f"The {role.name} sub-agent."
    return ToolSpec(role.name, PROMPT_SCHEMA,
                    f"{about}\n\nDelegates a task to the '{role.name}' sub-agent, which works on it alone and returns "
                    "its answer. It sees nothing of this conversation: put everything it needs in `prompt`.")


class ProxyDelegation:
    """Delegation for one proxy (module docstring). ``backend`` holds pool health and claim checks, ``state_dir``
    the dead letters."""

    def __init__(self, config: Config, state_dir: Path | None = None, tracing: Tracing | None = None,
                 backend: StateBackend | None = None) -> None:
        self.routing = config.model_routing
        self.tracing = tracing
        """Where the endpoint's delegations go as spans (``proxyvisor.proxy.telemetry``); None: tracing off."""
        self.delegator = Delegator(config, state_dir=state_dir, backend=backend)
        edges = {r.name: r.supervises for r in self.routing.roles}
        self.tools = [tool_for(r) for r in self.routing.roles if may_delegate(edges, ROOT, r.name)]
        self.names = frozenset(t.name for t in self.tools)
        self.offered = bool(self.tools) and is_supervised(self.routing)
        self._clashes: set[str] = set()

    def close(self) -> None:
        self.delegator.close()

    def turn(self, exchange: Exchange) -> DelegationTurn | None:
        """Offer the delegation tools on ``exchange.body`` (in place) and return the request's turn, or None when
        this request gets none (module docstring)."""
        if not self.offered or exchange.tail is None or exchange.tail.role not in ("user", "tool"):
            return None
        own = exchange.tools
        if not own:
            return None
        tools = [t for t in self.tools if t.name not in own]
        for clash in self.names & own - self._clashes:
            self._clashes.add(clash)
            log.warning("the agent has a tool named %r: the delegation tool of role %r is not offered to it",
                        clash, clash)
        if not tools:
            return None
        exchange.fmt.add_tools(exchange.body, tools)
        return DelegationTurn(self, exchange, frozenset(t.name for t in tools))

    async def endpoint(self, request: Request) -> Response:
        """``POST /proxyvisor/delegate`` (module docstring)."""
        try:
            data = orjson.loads(request.body)
        except orjson.JSONDecodeError as exc:
            return _error(400, f"request body is not valid JSON: {exc}")
        if not isinstance(data, dict):
            return _error(400, "request body must be a JSON object")
        strings = ("role", "prompt", "complexity", "caller", "adapter", "model", "effort")
        bad = [k for k in strings if k in data and not isinstance(data[k], str)]
        unknown = sorted(set(data) - set(strings))
        if bad or unknown or not data.get("role") or not data.get("prompt"):
            return _error(400, f"expected {{\"role\": ..., \"prompt\": ...}} with optional {', '.join(strings[2:])} "
                               f"(strings); got {'unknown keys ' + ', '.join(unknown) if unknown else 'bad values'}")
        if data.get("complexity") and data["complexity"] not in COMPLEXITY:
            return _error(400, f"complexity must be one of {', '.join(COMPLEXITY)}")
        start = time.time_ns()
        result = await self.delegator.delegate(
            data["role"], data["prompt"], caller=data.get("caller") or ROOT, complexity=data.get("complexity") or None,
            override=RouteTarget(data.get("adapter", ""), data.get("model", ""), data.get("effort", "")),
            traceparent=request.header("traceparent"))
        if self.tracing is not None and result.evidence:
            self.tracing.delegation({"role": data["role"], "status": result.status, "record_id": result.record_id,
                                     **result.evidence}, start, time.time_ns(), request.header("traceparent"))
        status, headers = 200, list(_JSON)
        if result.status == INVALID_STATUS:
            status = 400
        elif result.status == REFUSED:
            status = 429 if result.evidence.get("error_category") == CAPACITY else 503
            wait = result.evidence.get("retry_after_s")
            if status == 429:
                headers.append((b"retry-after", str(max(1, math.ceil(wait or 1))).encode()))
        return Response(status, headers, orjson.dumps(result.as_dict()))


def _error(status: int, message: str) -> Response:
    return Response(status, list(_JSON), CHAT.error_body(status, message))


class DelegationTurn:
    """The delegations of one agent request: runs the children the model asks for and builds the items the turn
    continues with. ``results`` holds, per delegation, its status, record id and evidence (for the ledger), and
    ``times`` its wall times (ns since the epoch, for the trace)."""

    def __init__(self, owner: ProxyDelegation, exchange: Exchange, names: frozenset[str]) -> None:
        self.owner = owner
        self.exchange = exchange
        self.fmt: WireFormat = exchange.fmt
        self.names = names
        self.trace = exchange.trace or child_traceparent(None)
        """This request's span, which the children's spans go under."""
        self.budget = Budget(owner.routing.children.budget_tokens)
        self.results: list[dict[str, Any]] = []
        self.times: list[tuple[int, int]] = []

    def continuation(self, resend: Resend, background: trio.Nursery | None = None) -> Continuation:
        """The turn's :class:`~proxyvisor.proxy.continuation.Continuation`: it holds the delegation tools' calls,
        and what it sends beyond the agent's history is re-inserted into later requests (``Exchange.remember``)."""
        self.exchange.continuation = Continuation(self.fmt, self.exchange.body, resend, self.names.__contains__,
                                                  self.step, ROUNDS, background, self.exchange.remember,
                                                  self.exchange.cut)
        return self.exchange.continuation

    async def step(self, response: dict[str, Any]) -> list[Any]:
        """Run every delegation call of ``response`` (in parallel, one budget) and return the items that carry
        the response and the results on."""
        calls = [c for c in self.fmt.parse_response(response).tool_calls if c.name in self.names]
        results: list[CallResult] = [CallResult(c.id, "") for c in calls]

        async def run(index: int) -> None:
            results[index] = await self._delegate(calls[index].name, calls[index].id, calls[index].arguments)

        async with trio.open_nursery() as nursery:
            for index in range(len(calls)):
                nursery.start_soon(run, index)
        return self.fmt.assistant_items(response, self.names.__contains__) + self.fmt.tool_results(results)

    async def _delegate(self, role: str, call_id: str, arguments: dict[str, Any]) -> CallResult:
        prompt = arguments.get("prompt")
        start = time.time_ns()
        if not isinstance(prompt, str) or not prompt.strip():
            self.results.append({"role": role, "call_id": call_id, "status": INVALID_STATUS})
            self.times.append((start, start))
            return CallResult(call_id, f"Tool '{role}' failed: invalid: the input must be {{\"prompt\": \"...\"}} "
                                       "with the whole task as a non-empty string", True)
        done = await self.owner.delegator.delegate(role, prompt, traceparent=self.trace, budget=self.budget)
        self.results.append({"role": role, "call_id": call_id, "status": done.status, "record_id": done.record_id,
                             **done.evidence})
        self.times.append((start, time.time_ns()))
        log.info("delegated to %s (%s): %s on %s", role, call_id, done.status,
                 done.evidence.get("capacity_scope") or "-")
        return CallResult(call_id, done.result.as_text(), done.result.is_error)
