"""The tool authorizer's trio shell: hold a reply's tool calls until the batch is admitted, keep a confirmed
conflict from the agent and continue the turn upstream with its tool error.

The rules live in the sans-IO :mod:`proxyvisor.gate.authorize`; this module feeds them and performs their
decisions for one supervised request (:class:`Authorizing`):

- **What is checked**: with ``[supervisor.authorizer] enabled``, a supervisor model call for the request
  (``Exchange.model``) and at least one prohibition the user stated in force (``PlanningState.rules``). Without a
  prohibition the stage is not installed at all: nothing is held. Otherwise every tool call the client would run
  (``WireFormat.parse_response``: calls of every type) is pre-screened for free and only the calls a prohibition
  could concern go to the judge.
- **JSON**: the reply is read and its calls judged before it is returned.
- **Streams**: events stream through until the first tool call starts (the format's stream splice says when);
  from there the stream is held until it ends (tool calls, the stop), the batch is judged (keep-alives meanwhile)
  and what was held is sent byte for byte when everything is admitted.
- **A confirmed block** (``mode = "block"``): when every call of the batch is blocked, the turn is continued
  upstream through the exchange's :class:`~proxyvisor.proxy.continuation.Continuation` with the response and a
  tool error per call (``gate.authorize.error_text``), and the continued reply is checked the same way (at most
  :data:`ROUNDS` times; then the turn ends with a note). When only some are, the agent gets the rest of the batch
  (JSON: the response without the blocked calls; a stream: the admitted calls, of every call type, rendered as
  they came and spliced in its place) and the blocked calls with their errors go back into the agent's own copy
  of the batch in every later request (``Exchange.graft``, ``WireFormat.graft``: byte-stable), each call beside
  the calls it came with and its error beside their results, so the model sees its turn as it made it (one
  assistant message, its results answering it: the shape every API requires; a separate assistant message would
  repeat the response's thinking or reasoning items and put the calls out of order).
- **``mode = "advise"``**: nothing is kept from the agent; a confirmed conflict is recorded and a note for the
  model is added after the agent's last item (re-inserted like every note).
- **Never lose the answer**: a judgment that fails, times out (``timeout_s``), is malformed or whose call's whole
  input (its instructions and its document) is over ``budget_tokens`` allows; a continuation that fails delivers
  the reply as it came.

Counted in the request's ledger line as ``authorizer`` (``RequestRecord.authorizer``; summed for ``/info``)::

    {"batches": 1, "prescreened": 0,   # batches seen, and admitted by the pre-screen with no model call
     "checked": 1, "blocked": 1, "cached": 0, "unavailable": 0,   # calls
     "decisions": [{"call": "toolu_1", "tool": "Bash", "decision": "block", "by": "confirmed",
                    "source": "user:1", "quote": "Do not run the tests.", "path": "/command",
                    "value": "\\"pytest -q\\""}]}
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import orjson
import trio

from .. import wirejson
from ..condense.text import count_tokens, encoding
from ..config import AuthorizerConfig
from ..gate import authorize as rules
from ..gate import digest
from ..rules import ADVISE
from ..supervisor_model import ModelAnswer, ModelCall
from ..transcript import own_words
from . import tokenizers
from .closing import close
from .continuation import Continuation, Job, of_turn, rewritable
from .formats import AssistantTurn, WireFormat
from .formats.base import CallResult
from .relay import UpstreamError, UpstreamReply
from .reply import Edit, Item, ReplyStream, blocks, off_loop, scanned
from .sse import Block, SSEScanner
from .supervise import Exchange, Note, NOTES

log = logging.getLogger("proxyvisor.authorizer")

ROUNDS = 4
"""Times one request's turn may be continued after blocked calls."""
ADVICE = ("[proxyvisor authorizer] Your call {call} ({tool}) conflicts with the user's restriction: user source "
          "{source}: \"{quote}\". Stay within what the user allowed.")
_JSON = [(b"content-type", b"application/json")]


Stage = Callable[[UpstreamReply], Awaitable[UpstreamReply]]
"""A reply stage of the pipeline: the reply for the agent, given the upstream's."""


class Authorizer:
    """The process's authorizer: its settings and the denial cache (process-local, bounded) shared by requests."""

    def __init__(self, config: AuthorizerConfig) -> None:
        self.config = config
        self.cache = rules.DenialCache()

    def turn(self, exchange: Exchange, background: trio.Nursery | None = None,
             then: Stage | None = None) -> Authorizing | None:
        """The request's authorizing stage, or None when nothing can be blocked (module docstring). ``then``: the
        stages a reply passes before this one (the verify-gate), which a turn continued after a block passes too."""
        if not self.config.enabled or exchange.model is None or not exchange.tools or exchange.send is None:
            return None
        if not exchange.thread.planning.rules:
            return None
        return Authorizing(self, exchange, background, then)


def _sources(exchange: Exchange) -> rules.Sources:
    """The judge's sources for ``exchange`` (``gate.authorize`` module docstring)."""
    ex = exchange
    planning = ex.thread.planning
    positions = [i for i in ex.thread.tracker.user_turns if i < len(ex.items)]
    # The latest user turn is numbered planning.turns; the ones before it count down (planning's numbering).
    first = planning.turns - len(positions) + 1
    messages = [ex.fmt.message(i) for i in ex.items]
    users = tuple((first + n, own_words(messages[i].text)) for n, i in enumerate(positions))
    actions = tuple(rules.Completed(a.use.name, a.use.arguments,
                                    None if a.output is None else not a.receipt.error)
                    for a in digest.turn_actions(messages, ex.schemas)
                    if a.output is not None)[-rules.MAX_ACTIONS:]
    return rules.Sources(users, planning.rules, ex.parts[0], actions, ex.schemas)


class Authorizing:
    """The authorizer for one supervised request (module docstring)."""

    def __init__(self, owner: Authorizer, exchange: Exchange, background: trio.Nursery | None,
                 then: Stage | None = None) -> None:
        self.owner = owner
        self.then = then
        self.config = owner.config
        self.exchange = exchange
        self.fmt = exchange.fmt
        assert exchange.model is not None
        self.model: ModelCall = exchange.model
        self.background = background
        self.cut = exchange.cut
        self.record: dict[str, Any] = {"batches": 0, "prescreened": 0, "checked": 0, "blocked": 0, "cached": 0,
                                       "unavailable": 0, "decisions": []}
        exchange.record.authorizer = self.record
        self._sources: rules.Sources | None = None

    @property
    def sources(self) -> rules.Sources:
        if self._sources is None:
            self._sources = _sources(self.exchange)
        return self._sources

    # ---- deciding one batch ---------------------------------------------------------------------------------------
    async def decide(self, turn: AssistantTurn) -> dict[str, rules.Denial]:
        """The confirmed denials of ``turn``'s calls by call id (empty: the batch is admitted). Never raises but
        for cancellation: a failure of the authorizer's own code allows."""
        try:
            return self._applied(await self._decide(turn), turn)
        except Exception:  # noqa: BLE001 - the judge failing is no evidence against the tool
            log.exception("the authorizer failed; admitting the batch")
            self.record["unavailable"] += 1
            return {}

    def _decision(self, call: rules.Call, decision: str, by: str, found: rules.Denial | None = None) -> None:
        entry: dict[str, Any] = {"call": call.id, "tool": call.name, "decision": decision, "by": by}
        if found is not None:
            entry.update(source=found.source, quote=found.quote, path=found.path, value=found.value)
        self.record["decisions"].append(entry)

    async def _decide(self, turn: AssistantTurn) -> dict[str, rules.Denial]:
        calls = [rules.Call(c.id, c.name, c.arguments) for c in turn.tool_calls]
        self.record["batches"] += 1
        concerned = rules.concerned(self.exchange.thread.planning.rules, calls)
        if not concerned:
            self.record["prescreened"] += 1
            return {}
        sources = self.sources
        context = rules.context_key(sources)
        denials: dict[str, rules.Denial] = {}
        fresh: list[rules.Call] = []
        for call in concerned:
            cached = self.owner.cache.get(context, call)
            if cached is None:
                fresh.append(call)
                continue
            denials[call.id] = cached
            self.record["cached"] += 1
            self.record["blocked"] += 1
            self._decision(call, self._verb(), "cache", cached)
        if not fresh:
            return denials
        self.record["checked"] += len(fresh)
        document = rules.document(sources, fresh)
        await tokenizers.loaded(encoding)  # the budget is counted in tokens: not a load on the event loop
        if self._over_budget(rules.JUDGE_INSTRUCTIONS, document):
            self.record["unavailable"] += 1
            for call in fresh:
                self._decision(call, "allow", "over_budget")
            return denials
        confirmed: dict[str, rules.Denial] | None = None
        with trio.move_on_after(self.config.timeout_s):
            confirmed = await self._judge(sources, fresh, document)
        if confirmed is None:  # timed out or the judge failed: allow
            self.record["unavailable"] += 1
            for call in fresh:
                self._decision(call, "allow", "unavailable")
            return denials
        for call in fresh:
            found = confirmed.get(call.id)
            if found is None:
                continue
            self.owner.cache.put(context, call, found)
            denials[call.id] = found
            self.record["blocked"] += 1
            self._decision(call, self._verb(), "confirmed", found)
        return denials

    def _verb(self) -> str:
        return "advise" if self.config.mode == ADVISE else "block"

    def _applied(self, denials: dict[str, rules.Denial], turn: AssistantTurn) -> dict[str, rules.Denial]:
        """``denials`` of ``turn``'s calls as the mode applies them: advise keeps no call from the agent, it notes
        the conflicts."""
        if self.config.mode != ADVISE or not denials:
            return denials
        ex = self.exchange
        if ex.anchor is not None:
            tools = {c.id: c.name for c in turn.tool_calls}
            for call_id, found in denials.items():
                tool = tools.get(call_id, "")
                text = ADVICE.format(call=call_id, tool=tool, source=found.source, quote=found.quote)
                ex.thread.notes = (ex.thread.notes + [Note(ex.anchor.position, ex.anchor.fingerprint, "authorizer",
                                                           text)])[-NOTES:]
        return {}

    async def _judge(self, sources: rules.Sources, calls: list[rules.Call],
                     document: str) -> dict[str, rules.Denial] | None:
        """The judge, shown ``document`` (``rules.document`` of ``sources`` and ``calls``), then a confirmation per
        proposed block: the confirmed denials by call id, or None when the judge gave no answer."""
        answer = await self._ask("authorize", rules.JUDGE_INSTRUCTIONS, document)
        if answer is None:
            return None
        judgment = rules.read_judgment(answer.text, sources, calls)
        if judgment.malformed:
            for call in calls:
                self._decision(call, "allow", "malformed")
            return {}
        proposed = {p.call.id: p for p in judgment.proposals}
        out: dict[str, rules.Denial] = {}
        for call in calls:
            proposal = proposed.get(call.id)
            if proposal is None:
                self._decision(call, "allow", "judge")
                continue
            confirming = rules.confirmation_input(proposal, sources)
            if self._over_budget(rules.CONFIRM_INSTRUCTIONS, confirming):
                self.record["unavailable"] += 1
                self._decision(call, "allow", "over_budget")
                continue
            check = await self._ask("authorize_confirm", rules.CONFIRM_INSTRUCTIONS, confirming)
            if check is not None and rules.read_confirmation(check.text):
                out[call.id] = rules.denial(proposal)
            else:
                self._decision(call, "allow", "unconfirmed" if check is not None else "unavailable")
        return out

    def _over_budget(self, system: str, document: str) -> bool:
        """Whether a judgment call's whole input, its instructions and its document (:meth:`_ask`'s messages),
        exceeds ``budget_tokens``: then the call is not made and the call it judges is allowed."""
        return count_tokens(system) + count_tokens(document) > self.config.budget_tokens

    async def _ask(self, purpose: str, system: str, document: str) -> ModelAnswer | None:
        messages = [{"role": "system", "content": system}, {"role": "user", "content": document}]
        answer: ModelAnswer | None = None
        try:
            answer = await self.model(messages)
        except Exception as exc:  # noqa: BLE001 - any failure of the judge allows
            log.warning("the %s call failed: %s: %s", purpose, type(exc).__name__, exc)
        use = self.exchange.record.model
        use.record(purpose, answer)
        return answer

    # ---- continuing -------------------------------------------------------------------------------------------------
    def _continuation(self) -> Continuation:
        assert self.exchange.send is not None  # Authorizer.turn makes no stage without it
        return of_turn(self.exchange, self.exchange.send, self.background)

    @staticmethod
    def _errors(denials: dict[str, rules.Denial]) -> list[CallResult]:
        return [CallResult(call_id, found.error_text(), True) for call_id, found in denials.items()]

    def blocked_items(self, response: dict[str, Any], denials: dict[str, rules.Denial]) -> list[Any]:
        """The history items that continue a turn whose every call was blocked: the whole ``response`` and an
        error per call."""
        return self.fmt.assistant_items(response, lambda _name: True) + self.fmt.tool_results(self._errors(denials))

    def part_blocked(self, response: dict[str, Any], denials: dict[str, rules.Denial]) -> None:
        """Record the blocked calls of a batch whose other calls the agent gets, with their errors, for the
        thread's later requests: the model sees them in the agent's own copy of the batch, beside the other calls,
        their errors beside the other results (``Exchange.graft``), as it made them."""
        self.exchange.graft(response, self._errors(denials))

    def _stopped(self) -> str:
        return (f"[proxyvisor authorizer] The model kept proposing tool calls the user prohibited ({ROUNDS} rounds); "
                "the turn stops here.")

    async def reply(self, reply: UpstreamReply) -> UpstreamReply:
        """The reply for the agent (module docstring). Never raises for a judge or upstream failure; cancellation
        propagates."""
        if not rewritable(reply):
            return reply
        if reply.streaming:
            return reply.with_body(AuthorizedStream(self, reply.body))
        rounds = 0
        while True:
            assert isinstance(reply.body, bytes)
            try:
                response = reply.json()
                turn = self.fmt.parse_response(response)
            except (orjson.JSONDecodeError, AttributeError, IndexError, KeyError, TypeError):
                return reply
            if not isinstance(response, dict) or not turn.tool_calls:
                return reply
            denials = await self.decide(turn)
            if not denials:
                return reply
            if len(denials) < len(turn.tool_calls):
                self.part_blocked(response, denials)
                kept = self.fmt.without_calls(response, denials)
                return reply.with_body(wirejson.dumps(kept), kept)
            if rounds >= ROUNDS:
                ended = self.fmt.render(AssistantTurn(self._stopped()), str(response.get("model") or ""))
                return reply.with_body(wirejson.dumps(ended), ended, _JSON)
            continued = await self._carry_on(self.blocked_items(response, denials))
            if continued is None:
                return reply
            rounds += 1
            reply = continued
            if reply.streaming or not rewritable(reply):
                return reply

    async def _carry_on(self, items: list[Any]) -> UpstreamReply | None:
        """Continue the turn upstream with ``items``; None when that failed (taken back from what later requests
        get re-inserted: the agent then receives the reply as it came)."""
        cont = self._continuation()
        before = cont.items
        try:
            reply = await cont.send(items)
            if reply.status < 400 and rewritable(reply):
                # The continued turn is a reply like the first: an answer that ends the turn is gated, too.
                return reply if self.then is None else await self.then(reply)
            await close(reply.body)
            log.warning("upstream refused to continue a turn after a blocked call (%d)", reply.status)
        except UpstreamError as exc:
            log.warning("continuing a turn after a blocked call failed (%d): %s", exc.status, exc.message)
        cont.take_back(before)
        return None


def _read(fmt: WireFormat, events: list[tuple[str | None, str]]) -> tuple[dict[str, Any], AssistantTurn]:
    """The response a held stream's ``events`` make, and its turn."""
    response = fmt.stream_response(events)
    return response, fmt.parse_response(response)


class AuthorizedStream(ReplyStream):
    """The agent's stream of an authorized request (module docstring). A :class:`~.reply.ReplyStream`."""

    def __init__(self, authorizing: Authorizing, first: Any) -> None:
        self.authorizing = authorizing
        self.first = first

    async def __aiter__(self) -> AsyncIterator[list[Item]]:
        a = self.authorizing
        fmt = a.fmt
        holding = True  # the splice holds every tool call from its start (the rendered rest of a batch: none)
        splice = fmt.stream_splice(lambda _name: holding)
        stream = blocks(self.first)
        job: Job | None = None
        rounds = 0
        try:
            while True:
                events: list[tuple[str | None, str]] = []
                held: list[Item] = []
                iterator = aiter(stream)
                try:
                    async for batch in iterator:
                        out: list[Item] = []
                        for block in await scanned(batch):
                            if block.event is None:
                                # A keep-alive of proxyvisor's own (a delegation's child at work) belongs to no
                                # message: it goes out at once, held calls or not, so the client never idles out.
                                (held if splice.held and not block.is_bytes(fmt.keepalive) else out).append(block)
                                continue
                            events.append((block.event.event, block.event.data))
                            # A big event is read off the event loop, as every stage reads it (reply.off_loop).
                            replaced = await off_loop(block.size, splice.event, block.event.event, block.event.data)
                            if splice.held:
                                held.append(block)
                            else:
                                out.append(block if replaced is None else Edit(replaced))
                        if out:
                            yield out
                finally:
                    await close(iterator)
                if stream.error is not None:
                    self._error = stream.error
                    return
                if not splice.held:
                    return
                try:
                    response, turn = await off_loop(sum(len(data) for _name, data in events), _read, fmt, events)
                except Exception:  # noqa: BLE001 - a stream the authorizer cannot read is delivered as it came
                    log.exception("reading a held tool-call stream failed; delivering it unchecked")
                    yield held
                    return
                job = Job(a.decide, turn)
                async for keepalive in job.keepalives(fmt, a.background, a.cut):
                    yield [Block(keepalive, None)]
                denials: dict[str, rules.Denial] = job.result or {}
                if not denials:
                    yield held
                    return
                admitted = tuple(c for c in turn.tool_calls if c.id not in denials)
                if admitted:  # rendered as they came (ToolCall.item), of whatever call type
                    a.part_blocked(response, denials)
                    holding = False
                    splice.next_response()
                    yield [Edit(self._spliced(splice, AssistantTurn("", admitted), response))]
                    return
                if rounds >= ROUNDS:
                    splice.next_response()
                    yield [Edit(self._spliced(splice, AssistantTurn(a._stopped()), response))]
                    return
                reply = await a._carry_on(a.blocked_items(response, denials))
                if reply is None or not reply.streaming:
                    if reply is not None:
                        await close(reply.body)
                    yield held  # the agent gets the reply as it came: the continuation failed
                    return
                rounds += 1
                splice.next_response()
                stream = blocks(reply.body)
        finally:
            if job is not None:
                await job.stop()

    def _spliced(self, splice: Any, turn: AssistantTurn, response: dict[str, Any]) -> list[bytes]:
        """``turn`` rendered as a stream and spliced into the message the agent is reading."""
        fmt = self.authorizing.fmt
        scanner = SSEScanner()
        out: list[bytes] = []
        for raw in fmt.render_stream(turn, str(response.get("model") or ""), self.authorizing.exchange.body):
            for block in scanner.feed(raw):
                if block.event is None:
                    continue
                replaced = splice.event(block.event.event, block.event.data)
                out += [block.raw] if replaced is None else replaced
        return out
