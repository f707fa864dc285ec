"""The verify-gate's trio shell: hold a turn-ending response, ask the verifier, deliver it or continue the turn.

The rules live in the sans-IO :mod:`proxyvisor.gate` (:class:`~proxyvisor.gate.outcome.TurnGate` decides,
:mod:`~proxyvisor.gate.digest` builds the verifier's input, :mod:`~proxyvisor.gate.verdict` reads its answers);
this module feeds them and performs their decisions for one supervised request (:class:`Gating`):

- **What is gated**: a successful reply without tool calls to a request that offered the agent tools (a request
  without tools is a plain completion, such as Claude Code's title requests, not an agent's turn). Tool-call
  rounds pass untouched. Both are read by the format (``WireFormat.tools``, ``WireFormat.parse_response`` and the
  stream splice): tools wherever the client declares them, calls of every type the client runs.
- **JSON**: the reply is read; a turn-ending one is judged before it is returned.
- **Streams never fail open**: a stream's stop event (and what follows it) is never sent before the verdict.
  The format's stream splice (``WireFormat.stream_splice(..., stop=True)``) says when a tool call starts and when
  the stop comes; ``[supervisor.gate] hold`` says what waits with it. ``answer``: every event is held until the
  first tool call starts (then everything held is sent and the rest streams through) or the stream ends, and the
  continued turn's stream replaces the held one. ``stop``: the events before the stop stream through as they come,
  the stop is kept back, and the continued turn's stream is spliced into the same message (blocks, deltas and
  output items carried on). A stream that ended without a tool call is judged while the client gets a keep-alive
  (``WireFormat.keepalive``: an SSE comment, Anthropic's ``ping``) every
  :data:`~proxyvisor.proxy.continuation.KEEPALIVE_S` seconds; a pass sends what was held byte for byte.
- **Notice**: an answer delivered not passed under ``fail_closed`` gets ``[supervisor.gate] unverified_notice``
  appended, naming the first standing gap when there is one (``Deliver.notice``; ``WireFormat.append_text`` for
  JSON, the splice's ``add_text`` before the stop in a stream); the warning logged names that gap too.
- **Read-back**: a verifier answer that asks to read lines of recorded outputs (``gate.verdict.ReadRequest``) is
  answered once per verification, within a quarter of ``digest_budget_tokens``, and the verifier asked again.
- **Nudge / re-entry**: the held answer (self-report stripped) and a user note (the nudge, or the advisory
  listing the gaps) continue the turn upstream through the exchange's
  :class:`~proxyvisor.proxy.continuation.Continuation` (delegation's, when it made one), so they are re-inserted
  into the thread's later requests like any continued turn. The continued reply is the agent's answer: judged
  again when it ends the turn, passed on when it calls tools (the gate's budget then carries over to the turn's
  next stop, in a later request).
- **Plan**: a plan signal in the held answer's self-report is reconciled first (``proxyvisor.proxy.planning``),
  the live plan goes into the digest, and a passed completion clears it.
- **Never lose the answer**: a verifier that fails or times out is ``Unavailable`` to the state machine (the
  answer is delivered, labelled ``unverified``); a continuation that fails delivers the held answer, labelled
  ``unverified``.
- **Cut off mid-verdict** (the client left, the proxy stopped): the verdict is cancelled, the turn recorded
  ``unverified`` (:data:`ABANDONED`) and the thread's gate forgotten, so that no saved state waits for a verdict
  that never comes; a held stream awaits that clean-up before its end is accounted for and saved.

What happened goes into the request's ledger line as ``gate`` (``RequestRecord.gate``)::

    {"verdicts": ["gaps", "pass"],  # each pass: pass | gaps | malformed | unavailable
     "decided_by": ["evidence", "model"],  # per pass: the free evidence pre-check or a verifier model call
     "nudges": 0, "reentries": 1, "refuted": 0,
     "readbacks": 0,                # verifier read-backs of clipped tool outputs (at most one per verification)
     "outcome": "verified",         # when the turn ended here: verified | unknown | failed | unverified
     "passed": true, "reason": "...", "gaps": ["..."],
     "digest_tokens": 1234,         # the latest verifier input's size (cl100k tokens), once one was built
     "route": "session", "model": "..."}  # once a verifier call was made: the route and model that judged
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
import trio

from .. import wirejson
from ..condense.text import count_tokens, encoding
from ..config import GateConfig
from ..detectors.selfreport import outcome as report_outcome
from ..detectors.selfreport import strip
from ..gate import digest
from ..gate.outcome import (DONE, EVIDENCE, MODEL, UNKNOWN, UNVERIFIED, VERIFIED, Deliver, GatePolicy, Nudge, Reenter,
                            Refute, Refuted, Stop, TurnGate, Unavailable, Verify, answer_event, gap_line)
from ..gate.plan import render_text
from ..gate.prohibitions import forbids_checks
from ..gate.verdict import (FORMAT_RETRY, GAPS, READBACK_SHARE, REFUTER_INSTRUCTIONS, VERIFIER_INSTRUCTIONS, Malformed,
                            ReadRequest, parse, refutation_input, refute)
from ..rules import HOLD_ANSWER
from ..supervisor_model import ModelAnswer, ModelCall, ReportedFailure
from ..transcript import own_words
from . import planning, tokenizers
from .continuation import Job, Resend, of_turn, rewritable
from .relay import UpstreamError, UpstreamReply
from .closing import close
from .reply import Edit, Item, ReplyStream, blocks, off_loop, scanned
from .sse import Block
from .supervise import Exchange

log = logging.getLogger("proxyvisor.gate")

EMPTY_ANSWER = "(no answer text)"
"""Stands in for a held answer with no text when it is carried on upstream (providers refuse empty text)."""
ABANDONED = "verdict abandoned: the request ended before it (the client left, or the proxy stopped)"
"""The gate's ``reason`` in the ledger line of a request that ended while its verdict was awaited: the turn is
``unverified``."""


@dataclass
class GateTurn:
    """One turn's gate, kept in the thread (``Thread.gate_turn``) across the turn's requests: its state machine,
    the genuine user turn it belongs to (history position) and the turn's final answers so far, oldest first, each
    its last :data:`~proxyvisor.gate.digest.FINAL_CHARS` characters (all of it the digest can show)."""

    turn_start: int | None
    gate: TurnGate
    finals: list[str] = field(default_factory=list)


def _outputs(actions: list[digest.Action]) -> dict[int, str]:
    """The recorded output text of each action by its number in the digest (1-based), for a read-back."""
    return {n: a.output.text for n, a in enumerate(actions, 1) if a.output is not None}


def eligible(exchange: Exchange, config: GateConfig) -> bool:
    """Whether the request's reply goes through the gate: the gate on, a supervisor model call for the request
    (``Exchange.model``), agent tools offered."""
    return config.enabled and exchange.model is not None and bool(exchange.tools)


class Gating:
    """The gate for one supervised request (module docstring), judged by the request's supervisor model call
    (``Exchange.model``). ``resend`` sends a body the way the request went; ``background`` runs the verdict of a
    held stream while keep-alives go out (None: inline, no keep-alives)."""

    def __init__(self, exchange: Exchange, config: GateConfig, resend: Resend,
                 mutating_tools: frozenset[str] = frozenset(), background: trio.Nursery | None = None) -> None:
        assert exchange.model is not None
        self.exchange = exchange
        self.fmt = exchange.fmt
        self.config = config
        self.model: ModelCall = exchange.model
        self.failure: str | None = None
        """Why the latest model call gave no answer (None: it answered)."""
        self.reported = False
        """A model call failed on a route that reports its failures once (``ReportedFailure``): the turn's own
        label is then logged at info level, not warned about on every turn."""
        self.resend = resend
        self.mutating_tools = mutating_tools
        self.background = background
        self.cut = exchange.cut
        self.policy = GatePolicy(config.reentry_budget, config.failure_policy, config.headless,
                                 config.unverified_notice)
        self.record: dict[str, Any] | None = None
        self.notice: str | None = None
        """The line appended to the delivered answer (``Deliver.notice``), once the turn ended with one."""

    # ---- the reply ----------------------------------------------------------------------------------------------
    async def reply(self, reply: UpstreamReply) -> UpstreamReply:
        """The reply for the agent: ``reply`` itself, or the turn's continued reply (module docstring). Never
        raises for a verifier or upstream failure; cancellation propagates."""
        if not rewritable(reply):
            return reply
        if reply.streaming:
            return reply.with_body(GatedStream(self, reply.body))
        first_s = reply.upstream_s
        while True:
            assert isinstance(reply.body, bytes)
            try:
                response = reply.json()
            except orjson.JSONDecodeError:
                return reply
            if not isinstance(response, dict) or self._calls_tools(response):
                return reply
            # The judge strips the held answer for the continuation: it gets a copy, the delivered answer stays.
            items = await self.judged(functools.partial(wirejson.loads, reply.body))
            if items is None:
                return self._noticed(reply)
            continued = await self.carry_on(items)
            if continued is None:
                return self._noticed(reply)
            reply = dataclasses.replace(continued, upstream_s=first_s + self._waited())
            if reply.streaming:  # an upstream that streamed unasked: pass it on as it is
                return reply

    def _noticed(self, reply: UpstreamReply) -> UpstreamReply:
        """The delivered JSON ``reply`` with :attr:`notice` appended to its answer (``reply`` itself without one).
        The object is the reply's own: changed, it is written once and travels with the new reply."""
        if self.notice is None:
            return reply
        response = reply.json()  # read once already: valid JSON
        self.fmt.append_text(response, self.notice)
        return dataclasses.replace(reply, body=wirejson.dumps(response), decoded=response)

    def _waited(self) -> float:
        cont = self.exchange.continuation
        return cont.waited_s if cont is not None else 0.0

    def _calls_tools(self, response: dict[str, Any]) -> bool:
        try:
            return bool(self.fmt.parse_response(response).tool_calls)
        except (AttributeError, IndexError, KeyError, TypeError):  # not a response this format reads: not ours
            return True

    # ---- judging one held answer -----------------------------------------------------------------------------------
    def _turn(self) -> GateTurn:
        thread = self.exchange.thread
        start = thread.tracker.turn_start
        turn = thread.gate_turn
        if turn is None or turn.turn_start != start or turn.gate.state == DONE:
            turn = thread.gate_turn = GateTurn(start, TurnGate(self.policy))
        return turn

    def _ledger(self) -> dict[str, Any]:
        if self.record is None:
            self.record = {"verdicts": [], "nudges": 0, "reentries": 0, "refuted": 0, "readbacks": 0}
            self.exchange.record.gate = self.record
        return self.record

    def _actions(self, start: int | None) -> list[digest.Action]:
        ex = self.exchange
        items = ex.items[start + 1:] if start is not None else ex.items
        if ex.continuation is not None:
            items = items + ex.continuation.items
        return digest.turn_actions([self.fmt.message(i) for i in items], ex.schemas, self.mutating_tools,
                                   ex.thread.tracker.reader.turn_receipts)

    async def judged(self, held: Callable[[], dict[str, Any]]) -> list[Any] | None:
        """:meth:`judge` of the response ``held()`` builds, with a failure of the gate's own code (reading the
        held response included) delivering the answer unverified."""
        try:
            return await self.judge(held())
        except Exception as exc:  # noqa: BLE001 - the agent's answer must never be lost to a supervisor bug
            log.exception("the verify-gate failed; delivering the answer unverified")
            self.abandon(f"the verify-gate failed ({type(exc).__name__})")
            return None
        except trio.Cancelled:
            # The request ended before its verdict (the client left, the proxy stopped): the turn is unverified, as
            # its ledger line says, and its gate is forgotten, so that no save keeps a state machine waiting for a
            # verdict that never comes (its retry, here or on another replica, would be refused its stop).
            self.abandon(ABANDONED, logging.INFO)
            raise

    async def judge(self, response: dict[str, Any]) -> list[Any] | None:
        """Run the gate on a held turn-ending ``response`` (a non-streaming response body). Returns None to
        deliver it, or the history items to continue the turn with (the held answer, then a user note)."""
        turn = self._turn()
        record = self._ledger()
        text = self.fmt.parse_response(response).text
        clean, bodies = await off_loop(len(text), strip, text)  # an answer of megabytes is read off the loop
        report = report_outcome(bodies).report
        turn.finals.append(clean[-digest.FINAL_CHARS:])  # kept in the session's state: what the digest can show
        await planning.reconcile(self.exchange, report)  # the plan as the turn left it, before it is judged
        actions = self._actions(turn.turn_start)
        # The prohibitions in force, as the digest shows them: "do not run the tests" makes a missing check compliance.
        forbidden = forbids_checks([p.text for p in self.exchange.thread.planning.rules])
        ev = digest.evidence(actions)
        decision: Any = turn.gate.handle(Stop(report.state if report else None, ev, forbidden))
        if isinstance(decision, (Reenter, Deliver)) and decision.decided_by == EVIDENCE:
            record["verdicts"].append(GAPS)
            record.setdefault("decided_by", []).append(EVIDENCE)
        document: str | None = None
        previous: str | None = None
        read = False  # this verification's read-back was used
        while True:
            if isinstance(decision, Nudge):
                record["nudges"] += 1
                return await self._carried(response, len(text), decision.note)
            if isinstance(decision, Verify):
                if document is None:
                    await tokenizers.loaded(encoding)  # the digest counts its blocks: not a load on the loop
                    document = self._digest(turn, actions, ev, report, decision)
                answer = await self._ask("verify", VERIFIER_INSTRUCTIONS, document,
                                         previous if decision.format_retry else None)
                record.setdefault("decided_by", []).append(MODEL)
                parsed = parse(answer.text, decision.handback, may_read=not read) if answer is not None else None
                if isinstance(parsed, ReadRequest):  # the one read-back, then a verdict is due
                    read = True
                    record["readbacks"] += 1
                    document += "\n" + digest.readback(parsed, _outputs(actions),
                                                        self.config.digest_budget_tokens // READBACK_SHARE)
                    answer = await self._ask("verify", VERIFIER_INSTRUCTIONS, document)
                    parsed = parse(answer.text, decision.handback) if answer is not None else None
                if answer is None or parsed is None:
                    record["verdicts"].append("unavailable")
                    decision = turn.gate.handle(Unavailable(self.failure or "the verifier call failed or timed out"))
                    continue
                assert not isinstance(parsed, ReadRequest)
                previous = answer.text
                record["verdicts"].append("malformed" if isinstance(parsed, Malformed) else parsed.outcome)
                decision = turn.gate.handle(answer_event(parsed))
            elif isinstance(decision, Refute):
                assert document is not None
                answer = await self._ask("refute", REFUTER_INSTRUCTIONS, refutation_input(document, decision.gaps))
                result = refute(decision.gaps, answer.text if answer is not None else None)
                record["refuted"] += len(result.refuted)
                decision = turn.gate.handle(Refuted(result.kept))
            elif isinstance(decision, Reenter):
                record["reentries"] += 1
                record["gaps"] = [g.text for g in decision.gaps]
                log.info("session turn gated: %d gap(s); continuing the turn upstream", len(decision.gaps))
                return await self._carried(response, len(text), decision.advisory)
            else:
                assert isinstance(decision, Deliver)
                self._deliver(decision)
                if decision.passed and decision.outcome in (VERIFIED, UNKNOWN) and not turn.gate.handback:
                    planning.clear(self.exchange.thread)  # a passed completion closes the plan (reference 4)
                return None

    def _digest(self, turn: GateTurn, actions: list[digest.Action], ev: digest.Evidence, report: Any,
                decision: Verify) -> str:
        ex = self.exchange
        start = turn.turn_start
        # What the user wrote, without the harness's <system-reminder> blocks (Claude Code adds them).
        task = own_words(ex.parts[1])
        request = own_words(self.fmt.message(ex.items[start]).text) \
            if start is not None and start < len(ex.items) else task
        plan = ex.thread.plan
        document = digest.build(request, turn.finals, actions, instructions=ex.parts[0],
                                plan=render_text(plan) if plan is not None else None,
                                state=report.state if report else None, claim=report.focus if report else "",
                                task=task,
                                previous_gaps=[g.text for g in decision.previous_gaps],
                                prohibitions=ex.thread.planning.rules, budget=self.config.digest_budget_tokens,
                                ev=ev)
        self._ledger()["digest_tokens"] = count_tokens(document)
        return document

    def _deliver(self, decision: Deliver) -> None:
        record = self._ledger()
        record.update(outcome=decision.outcome, passed=decision.passed, reason=decision.reason)
        self.notice = decision.notice
        if decision.gaps:
            record["gaps"] = [g.text for g in decision.gaps]
        named = f": {gap_line(decision.gaps[0])}" if decision.gaps else ""  # what stands, not only that a gap does
        (log.info if decision.passed or self.reported else log.warning)("turn %s: %s%s", decision.outcome,
                                                                        decision.reason, named)

    def abandon(self, reason: str, level: int = logging.WARNING) -> None:
        """The turn could not be continued or judged: the held answer is delivered, labelled ``unverified``
        (``reason`` in the ledger, logged at ``level``), and the thread's gate is forgotten."""
        record = self._ledger()
        record.update(outcome=UNVERIFIED, passed=False, reason=reason)
        self.notice = self.policy.notice_for(False)
        self.exchange.thread.gate_turn = None
        log.log(level, "turn unverified: %s", reason)

    async def _ask(self, purpose: str, system: str, document: str, retry_of: str | None = None) -> ModelAnswer | None:
        """The supervisor model's answer to one gate call, or None (the reason in :attr:`failure`) when it failed
        or took longer than ``[supervisor.gate] timeout_s``; counted in the request's record either way, and the
        route and model that judged named in its gate object (``route``, ``model``)."""
        messages = [{"role": "system", "content": system}, {"role": "user", "content": document}]
        if retry_of is not None:
            messages += [{"role": "assistant", "content": retry_of}, {"role": "user", "content": FORMAT_RETRY}]
        answer: ModelAnswer | None = None
        self.failure = f"the {purpose} call timed out after {self.config.timeout_s:g} s"
        with trio.move_on_after(self.config.timeout_s):
            try:
                answer = await self.model(messages)
                self.failure = None
            except ReportedFailure as exc:  # reported once by the route: the reason goes to the turn's label
                self.failure, self.reported = str(exc), True
                log.debug("the %s call failed: %s", purpose, exc)
            except Exception as exc:  # noqa: BLE001 - any failure of the verifier is "unavailable", never fatal
                self.failure = f"the {purpose} call failed ({type(exc).__name__})"
                log.warning("the %s call failed: %s: %s", purpose, type(exc).__name__, exc)
        use = self.exchange.record.model
        use.record(purpose, answer)
        self._ledger().update(use.route)
        return answer

    async def _carried(self, response: dict[str, Any], size: int, note: str) -> list[Any]:
        """The held answer (of ``size`` characters) as history items (self-report stripped), then ``note`` as a user
        message."""
        await off_loop(size, self.fmt.edit_response, response, lambda text: strip(text)[0].strip() or EMPTY_ANSWER)
        return self.fmt.assistant_items(response, lambda _name: False) + [self.fmt.user_item(note)]

    async def carry_on(self, items: list[Any], stream: bool = False) -> UpstreamReply | None:
        """Continue the turn upstream with ``items``; None (after :meth:`abandon`) when that failed or, for a
        ``stream``, when upstream answered without one. A failed continuation is also taken back from what the
        thread's later requests get re-inserted: the agent receives the held answer itself."""
        ex = self.exchange
        cont = of_turn(ex, self.resend, self.background)
        before = cont.items
        reason = ""
        try:
            reply = await cont.send(items)
            if reply.status >= 400 or not rewritable(reply):
                await close(reply.body)
                reason = f"upstream refused to continue the turn ({reply.status})"
            elif stream and not reply.streaming:
                reason = "upstream continued the turn without a stream"
            elif ex.delegation is not None:  # the continued answer may call delegation tools in turn
                reply = await cont.reply(reply)
        except UpstreamError as exc:
            reason = f"continuing the turn upstream failed ({exc.status}): {exc.message}"
        except Exception as exc:  # noqa: BLE001 - the agent's answer must never be lost to a supervisor bug
            log.exception("continuing a gated turn failed; delivering the held answer")
            reason = f"continuing the turn failed ({type(exc).__name__})"
        if not reason:
            return reply
        cont.take_back(before)
        self.abandon(reason)
        return None


def _never(_name: str) -> bool:
    return False


class GatedStream(ReplyStream):
    """The agent's stream of a gated request (module docstring). A :class:`~.reply.ReplyStream`."""

    def __init__(self, gating: Gating, first: Any) -> None:
        self.gating = gating
        self.first = first

    async def __aiter__(self) -> AsyncIterator[list[Item]]:
        g = self.gating
        whole = g.config.hold == HOLD_ANSWER  # hold the whole answer, not only its stop
        # .calling turns True when a tool call starts; .stopped when the answer's stop event comes (kept back).
        splice = g.fmt.stream_splice(_never, stop=True)
        stream = blocks(self.first)
        job: Job | None = None
        continuing = False  # the gate sent the turn back and its continued answer is coming
        try:
            while True:
                held: list[Item] = []  # with hold = "answer": what came before the stop
                stop: list[Item] = []  # the stop's blocks as they came
                events: list[tuple[str | None, str]] = []
                passing = False
                iterator = aiter(stream)
                try:
                    async for batch in iterator:
                        if passing:
                            yield batch
                            continue
                        out: list[Item] = []
                        items = await scanned(batch)
                        for n, block in enumerate(items):
                            if block.is_bytes(g.fmt.keepalive):
                                # A keep-alive of proxyvisor's own (a delegation's child at work) belongs to no
                                # message: it goes out at once, held answer or not, so the client never idles out.
                                out.append(block)
                                continue
                            if splice.calling and not splice.continuing:
                                # A tool-call round nothing rewrites: the rest streams through as it comes.
                                out += items[n:]
                                passing = True
                                break
                            stopped, replaced = splice.stopped, None
                            if block.event is not None:
                                event = block.event
                                events.append((event.event, event.data))
                                replaced = await off_loop(block.size, splice.event, event.event, event.data)
                            if splice.stopped:
                                stop.append(block)
                                if stopped:
                                    continue
                                piece: Item = Edit(replaced or [])  # what the block that stops lets through now
                            else:
                                piece = block if replaced is None else Edit(replaced)
                            if whole and not splice.calling:
                                held.append(piece)
                            else:
                                out += held + [piece]
                                held = []
                        if out:
                            yield out
                finally:
                    await close(iterator)
                continuing = False
                self._error = stream.error
                if passing:
                    return
                if self._error is not None:
                    # A broken stream is not judged: the agent gets what came and the error.
                    released = splice.release()
                    out = held + (stop if released is None else [Edit(released)])
                    if out:
                        yield out
                    return
                items_, response = None, None
                size = sum(len(data) for _name, data in events)  # a big answer is read off the event loop
                try:
                    if not splice.calling:
                        response = await off_loop(size, g.fmt.stream_response, events)
                    calls = splice.calling or await off_loop(size, g._calls_tools, response)
                except Exception:  # noqa: BLE001 - a stream the gate cannot read is delivered unjudged
                    log.exception("reading a held stream failed; delivering it unjudged")
                    calls = True
                if not calls:
                    job = Job(g.judged, lambda response=response: response)
                    async for keepalive in job.keepalives(g.fmt, g.background, g.cut):
                        yield [Block(keepalive, None)]
                    items_ = job.result  # judged() never raises but for cancellation; None: deliver
                reply = await g.carry_on(items_, stream=True) if items_ is not None else None
                if reply is None:
                    notice = splice.add_text(g.notice) if g.notice else []
                    released = splice.release()
                    out = held + [Edit(notice)] + (stop if released is None else [Edit(released)])
                    yield out
                    return
                if whole:  # the continued answer replaces the held one, which the agent never saw
                    splice = g.fmt.stream_splice(_never, stop=True)
                else:  # the continued answer goes on in the message the agent is reading
                    splice.next_response()
                stream = blocks(reply.body)
                continuing = True
        except BaseException:
            if continuing:
                # Cut (the client left, the proxy stopped) before the continued answer's verdict, as a verdict's
                # wait can be (Gating.judged): no save keeps the turn's gate with its re-entries spent.
                g.abandon(ABANDONED, logging.INFO)
            raise
        finally:
            if job is not None and not job.done.is_set():
                # Its end awaited: the verdict abandoned (Gating.judged) is in the thread before the stream's end is
                # accounted for and saved.
                await job.stop()
