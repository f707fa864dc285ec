"""The /info counters of a session, summed from its ledger: the ledger is the source of /info.

Every supervised request writes one ledger line (``Pipeline._account``, ``proxyvisor.store``), so what /info,
``GET /proxyvisor/sessions/{id}/info`` and ``proxyvisor info`` show survives a restart of the proxy and never
mixes sessions. The fields of a ledger line read here (all optional but ``status``):

- ``status``: HTTP status of the answer (499: the client left before it); ``format``: ``chat``, ``messages`` or
  ``responses``; ``model``: the model the request named (str, or None); ``agent``: the client program, the first
  product token of its ``User-Agent`` (``claude-cli/2.0.1``, :func:`agent_of`; absent when it sent none);
- ``input_tokens``, ``output_tokens``: upstream tokens the answer reported (int, or None when it reported none);
  ``usage_estimated``: true when proxyvisor counted them itself, the answer having reported none
  (``proxyvisor.proxy.estimate``);
- ``scripted``: true when the request went to the built-in scripted model (its tokens are never priced), error
  answers included;
- ``run``: the run the request came through (the ``/r/{run}/`` prefix: a ``proxyvisor wrap`` run; absent without
  one): a session the agent resumes in a later run (its own id) holds lines of each run;
- ``line_id``: the line's identity across replicas (``proxyvisor.store.Store.append_ledger``), not summed;
- ``overhead_ms``: the proxy overhead of the request (ms): the wall time proxyvisor itself added before the reply's
  headers, that is the request's time less the time waiting for the upstream and for supervisor model calls;
- ``local``: ``"/info"`` or ``"/plan"``: answered by proxyvisor itself (``proxyvisor.proxy.commands``), no model
  call; such a line is counted under ``local`` and nowhere else;
- ``tool_round``: true when the agent's history ended with tool results (as the agent sent it, before notes);
- ``report``: the reply's self-report, ``{"status": "ok"|"missing"|"malformed", "state": str|None}`` (absent for an
  error reply or one cut short);
- ``signals``: the detector signals that fired on this request's history (list of str); ``steer``: the signal of
  the steer note added to this request (str), ``steer_note``: that note's text, as the model read it (str);
- ``condensed``: ``{"results": n, "saved_tokens": n, "items": [...]}``: tool results narrowed for the first time
  on this request, the tokens the narrowed results (new and earlier ones) saved in its upstream body, and for each
  newly narrowed result ``{"call_id", "tool", "condenser", "tokens_before", "tokens_after", "spill_path"}`` (exact
  tiktoken ``cl100k_base`` counts of the original and of the model's copy; ``condenser``: ``deterministic`` or
  ``model``; ``spill_path``: the file holding the full original, which the model's copy names);
- ``upstream``: under the breakers (``proxyvisor.proxy.breakers``), which upstream answered and why:
  ``{"name", "pool", "health_state", "health_probe", "outcome", "tried": [...]}``; ``outcome`` is ``answered``,
  ``refused`` (the pool was cooling: proxyvisor answered 429, nothing was sent), ``failed`` or ``cancelled`` (the
  client left before the answer); ``tried`` lists
  the upstreams tried before it (each with its ``status``, ``error_category`` and ``retry_after_s``);
- ``delegations``: the children run for the request (``proxyvisor.proxy.delegation``), each ``{"role", "call_id",
  "status", "record_id", "dead_letter", ...evidence}``; the evidence's ``attempts`` lists each child run of the
  hand-off (``{"attempt": n, "capacity_scope", "outcome": "answered"|"failed"|"refused", "error_category", ...}``,
  ``attempt`` above 1 for a retry) and ``dead_letter`` is the id of the dead letter an exhausted hand-off became;
- ``supervisor_model``: ``{"calls": {purpose: n}, "input_tokens", "output_tokens", "cost_usd", "time_ms", "route",
  "model"}``: the supervisor model's calls for the request by purpose (``condense``, ``verify``, ``refute``,
  ``plan``), only when it made any; ``time_ms``: the wall time spent waiting for them (ms); the route and model they
  took (``route``: ``session``, ``litellm`` or ``supplied``, a call given to ``proxyvisor.proxy.service.running``;
  ``model``: the model named, empty when the route names none);
- ``gate``: what the verify-gate did (``proxyvisor.proxy.gating``): ``verdicts`` (list of ``pass``, ``gaps``,
  ``malformed``, ``unavailable``), ``decided_by`` (per verdict: ``evidence``, the free pre-check, or ``model``),
  ``nudges``, ``reentries``, ``refuted`` (ints), ``outcome`` (``verified``, ``unknown``, ``failed``,
  ``unverified``), ``passed`` (bool), ``reason`` (str), ``gaps`` (list of str), ``digest_tokens`` (int: the size
  of the latest verifier input, in tokens), and once a verifier call was made, the ``route`` and ``model`` that
  judged the turn (as in ``supervisor_model``);
- ``authorizer``: what the tool authorizer did (``proxyvisor.proxy.authorizing``): ``batches`` of tool calls seen,
  ``prescreened`` (of them admitted with no model call), and over calls ``checked`` (put to the judge), ``blocked``
  (confirmed conflicts, reused ones included), ``cached`` (blocked by a reused denial), ``unavailable`` (judgments
  that failed, timed out or were over budget, so allowed); ``decisions``: per call decided, ``{"call", "tool",
  "decision": "allow"|"block"|"advise", "by", "source", "quote", "path", "value"}`` (the last four for a conflict);
- ``learning``: on a request at which learning did something (``proxyvisor.proxy.learning``): ``recalled``
  (``[record id]``) and ``tokens``, the records of the Active Memory Pack it recalled and its size; ``stored``,
  the records a distill at it stored; ``distill_calls``, 1 when it started a distill call (whose own records
  come after the line is written: only the live counters have them). Each key only when it applies.

The summary (:func:`summarize`), a JSON object; counts are ints, tokens are tokens, money is USD (float), times
are milliseconds:

- ``requests``: model requests (lines without ``local``); ``errors``: of them answered with status >= 400;
  ``tool_rounds``: of them whose history ended with tool results; ``local``: ``{command: n}`` answered locally;
  ``first``, ``last``: the times (ISO 8601) of the first and last line, or None; ``runs``: the runs the lines
  came through (their distinct ``run``), and the run of the ``/info`` request asking, whose line comes after;
- ``self_report``: ``{"by_status": {status: n}, "by_state": {state: n}}``;
- ``detectors``: ``{"fires": {signal: n}, "steers": {signal: n}}``;
- ``gate``: ``{"runs", "passes", "gaps", "malformed", "unavailable", "nudges", "reentries", "refuted",
  "outcomes": {label: n}, "last_outcome": label or None, "judges": {"ROUTE: MODEL": n}, "last_judge": {"route",
  "model"} or None, "decided_by": {"evidence": n, "model": n}}``: ``runs`` counts requests the gate checked,
  ``passes`` those it passed, ``gaps`` / ``malformed`` / ``unavailable`` verdicts of that kind, ``judges`` the
  gated requests each route and model judged, ``decided_by`` the turns that ended by what decided their last pass;
- ``condense``: ``{"results", "saved_tokens", "tokens_before", "tokens_after", "by_condenser", "recent"}``:
  ``saved_tokens`` sums every request's saving, i.e. the input tokens not sent upstream over the session;
  ``tokens_before`` / ``tokens_after`` sum the narrowed results' own counts (each counted once); ``by_condenser``
  counts them by who chose the lines; ``recent`` lists the last :data:`RECENT_CONDENSED` of them as the ledger
  holds them;
- ``authorizer``: ``{"checked", "blocked", "cached", "unavailable", "batches", "prescreened"}`` summed;
- ``planner_calls``: supervisor model calls for the plan (``supervisor_model.calls["plan"]``);
- ``breakers``: ``{"pools": {pool: {"answered", "refused", "failed"}}, "fallbacks"}``: each of the agent's pools
  the session's requests were tried on, how often each answered, was refused while cooling and failed; and the
  requests a fallback answered;
- ``delegations``: ``{"runs", "by_status": {status: n}, "child_runs", "retries", "dead_letters",
  "recent_dead_letters"}``: the delegations the session's requests made, by status; the child runs they took (a
  retry or a fallback is one more, a refusal by a cooling pool none); the retries (attempts after a hand-off's
  first); the hand-offs that became dead letters, and the ids of the last :data:`RECENT_DEAD_LETTERS` of them;
- ``supervisor_model``: ``{"calls": {purpose: n}, "total_calls", "input_tokens", "output_tokens", "cost_usd",
  "unpriced_calls", "time_ms"}`` (cost as priced when the call was made, over the priced answers;
  ``unpriced_calls``: answers not priced, those of the scripted upstream or of a model litellm's cost map lacks;
  ``time_ms``: the wall time of the calls, which the overhead leaves out);
- ``upstream``: ``{"input_tokens", "output_tokens", "cost_usd", "cost_known", "unpriced": [model],
  "scripted_requests", "estimated_requests"}``: ``estimated_requests`` counts the requests whose tokens are
  proxyvisor's estimate; the cost is litellm's cost map (``proxyvisor.pricing``) applied per request when the
  summary is made; a model the map does not price (a local model) adds nothing to ``cost_usd``, is listed in
  ``unpriced`` and makes ``cost_known`` false; the answers of the built-in scripted model are never priced, and
  those that succeeded (status below 400) are counted in ``scripted_requests``;
- ``learning``: ``{"recalls", "recalled_items", "recalled_tokens", "stored", "distill_calls"}`` summed over the
  lines' ``learning``;
- ``overhead_ms``: ``{"total", "mean", "p50", "max"}`` over model requests (0 without any).
"""

from __future__ import annotations

import re
import statistics
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ..pricing import price as cost_map_price

if TYPE_CHECKING:
    from .supervise import RequestRecord

RECENT_CONDENSED = 20
RECENT_DEAD_LETTERS = 20
_AUTHORIZER = ("checked", "blocked", "cached", "unavailable", "batches", "prescreened")
_LEARNING = ("recalls", "recalled_items", "recalled_tokens", "stored", "distill_calls")
Price = Callable[[str, int, int], "float | None"]
"""The cost in USD of one request to a model, given (model, input tokens, output tokens); None: not priced."""


def ledger_fields(record: RequestRecord, tool_round: bool) -> dict[str, Any]:
    """The ledger fields (module docstring) for what supervision did for one request, from its ``record``
    (``proxyvisor.proxy.supervise.RequestRecord``, complete once the reply is through); ``tool_round``: the
    agent's history ended with tool results. Fields with nothing to say are left out."""
    out: dict[str, Any] = {"tool_round": tool_round}
    if record.report is not None:
        out["report"] = {"status": record.report.status,
                         "state": record.report.report.state if record.report.report is not None else None}
    signals = [signal for _index, fired in record.firings for signal in fired]
    if signals:
        out["signals"] = signals
    if record.note is not None:
        out["steer"] = record.note
        if record.note_text is not None:
            out["steer_note"] = record.note_text
    if record.condense is not None:
        # A retried request recalls its round's decisions: only those made now count as newly narrowed.
        narrowed = [c for c in record.condense.round if c.decision.text is not None]
        out["condensed"] = {"results": min(record.condense.new, len(narrowed)),
                            "saved_tokens": record.condense.saved_tokens}
        items = [{"call_id": c.call_id, "tool": c.tool, "condenser": c.decision.condenser,
                  "tokens_before": c.decision.tokens_before, "tokens_after": c.decision.tokens_after,
                  **({"spill_path": c.decision.spill_path} if c.decision.spill_path else {})}
                 for c in narrowed if c.new]
        if items:
            out["condensed"]["items"] = items
    model = record.model
    if model.calls:
        out["supervisor_model"] = {"calls": dict(model.calls), "input_tokens": model.input_tokens,
                                   "output_tokens": model.output_tokens, "cost_usd": model.cost_usd,
                                   "time_ms": _ms(model.time_s * 1000), **model.route}
        if model.unpriced:
            out["supervisor_model"]["unpriced"] = model.unpriced
    if record.gate is not None:
        out["gate"] = record.gate
    if record.authorizer is not None and record.authorizer["batches"]:
        out["authorizer"] = record.authorizer
    if record.upstream is not None:
        out["upstream"] = record.upstream
    if record.learning is not None:
        out["learning"] = record.learning
    return out


_AGENT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+/-]{0,63}")


def agent_of(user_agent: str | None) -> str | None:
    """The client program a ``User-Agent`` names: its first product token (``name/version``), at most 64 of
    ``[A-Za-z0-9._+/-]``; None when it names none. Only this token is kept: the rest of the header may describe
    the user's machine."""
    match = _AGENT.match(user_agent.strip()) if user_agent else None
    return match.group(0) if match else None


MODEL_CHARS = 200
"""A model name recorded in the ledger is clipped to this many characters (:func:`model_name`)."""


def model_name(value: object) -> str | None:
    """A request's ``model`` as the ledger keeps it: a string clipped to :data:`MODEL_CHARS` characters (a client
    may send any size; a megabyte name would fill every view of the session), None for anything else."""
    if not isinstance(value, str):
        return None
    return value if len(value) <= MODEL_CHARS else value[:MODEL_CHARS - 1] + "\u2026"


def judge_label(route: Mapping[str, Any]) -> str:
    """``session: MODEL`` (or ``litellm: ...``): a gate object's ``route`` and ``model`` as /info counts them."""
    return f"{route.get('route')}: {route.get('model') or '(no model named)'}"


def _num(value: Any) -> float:
    """A number from a ledger field; anything else (None, a string, a bool) counts as 0."""
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0.0


def _int(value: Any) -> int:
    return int(_num(value))


def _dict(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, dict) else {}


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _ms(value: float) -> float:
    return round(value, 3)


def summarize(lines: Iterable[Mapping[str, Any]], price: Price | None = None,
              run: str | None = None) -> dict[str, Any]:
    """The /info object (module docstring) of one session's ledger ``lines`` (in ledger order).

    ``price`` prices the upstream tokens (default :func:`proxyvisor.pricing.price`, only called for a line with
    tokens that the scripted model did not answer); each model is asked once per line until it proves unpriced.
    ``run`` is the run of the request asking (its ``/r/{run}/`` prefix; None: none), whose own line is written
    after its answer: counted among ``runs``, and in nothing else. Odd field values count as absent; never raises
    for a line's content.
    """
    requests = errors = tool_rounds = 0
    local: Counter[str] = Counter()
    runs: set[str] = {run} if run is not None else set()
    first = last = None
    by_status: Counter[str] = Counter()
    by_state: Counter[str] = Counter()
    fires: Counter[str] = Counter()
    steers: Counter[str] = Counter()
    gate: Counter[str] = Counter()
    outcomes: Counter[str] = Counter()
    decided: Counter[str] = Counter()
    last_outcome = None
    judges: Counter[str] = Counter()
    last_judge = None
    authorizer: Counter[str] = Counter()
    condensed: Counter[str] = Counter()
    condensers: Counter[str] = Counter()
    recent: list[dict[str, Any]] = []
    calls: Counter[str] = Counter()
    sup_in = sup_out = sup_unpriced = 0
    sup_cost = sup_ms = 0.0
    tokens_in = tokens_out = scripted = estimated = 0
    cost = 0.0
    unpriced: set[str] = set()
    overheads: list[float] = []
    pools: dict[str, Counter[str]] = {}
    fallbacks = 0
    delegations: Counter[str] = Counter()
    by_delegation_status: Counter[str] = Counter()
    dead_letters: list[str] = []
    learning: Counter[str] = Counter()
    price = price or cost_map_price
    for line in lines:
        first = first or line.get("time")
        last = line.get("time") or last
        if isinstance(line.get("run"), str):
            runs.add(line["run"])
        if isinstance(line.get("local"), str):
            local[line["local"]] += 1
            continue
        requests += 1
        errors += _int(line.get("status")) >= 400
        tool_rounds += line.get("tool_round") is True
        overheads.append(_num(line.get("overhead_ms")))
        report = _dict(line.get("report"))
        if isinstance(report.get("status"), str):
            by_status[report["status"]] += 1
        if isinstance(report.get("state"), str):
            by_state[report["state"]] += 1
        fires.update(s for s in _list(line.get("signals")) if isinstance(s, str))
        up = _dict(line.get("upstream"))
        tried = [_dict(t) for t in _list(up.get("tried"))]
        for attempt in [*tried, up]:
            if isinstance(attempt.get("pool"), str) and isinstance(attempt.get("outcome"), str):
                pools.setdefault(attempt["pool"], Counter())[attempt["outcome"]] += 1
        fallbacks += bool(tried) and up.get("outcome") == "answered"
        for d in (_dict(d) for d in _list(line.get("delegations"))):
            delegations["runs"] += 1
            if isinstance(d.get("status"), str):
                by_delegation_status[d["status"]] += 1
            attempts = [_dict(a) for a in _list(d.get("attempts"))]
            delegations["child_runs"] += sum(a.get("outcome") in ("answered", "failed") for a in attempts)
            delegations["retries"] += max((_int(a.get("attempt")) for a in attempts), default=1) - 1
            if isinstance(d.get("dead_letter"), str):
                dead_letters = (dead_letters + [d["dead_letter"]])[-RECENT_DEAD_LETTERS:]
                delegations["dead_letters"] += 1
        learnt = _dict(line.get("learning"))
        if recalled := _list(learnt.get("recalled")):
            learning["recalls"] += 1
            learning["recalled_items"] += len(recalled)
            learning["recalled_tokens"] += _int(learnt.get("tokens"))
        learning["stored"] += _int(learnt.get("stored"))
        learning["distill_calls"] += _int(learnt.get("distill_calls"))
        if isinstance(line.get("steer"), str):
            steers[line["steer"]] += 1
        g = line.get("gate")
        if isinstance(g, dict):
            gate["runs"] += 1
            gate["passes"] += g.get("passed") is True
            verdicts = [v for v in _list(g.get("verdicts")) if isinstance(v, str)]
            for kind in ("gaps", "malformed", "unavailable"):
                gate[kind] += verdicts.count(kind)
            for key in ("nudges", "reentries", "refuted"):
                gate[key] += _int(g.get(key))
            if isinstance(g.get("outcome"), str):
                outcomes[g["outcome"]] += 1
                last_outcome = g["outcome"]
                by = [d for d in _list(g.get("decided_by")) if d in ("evidence", "model")]
                if by:
                    decided[by[-1]] += 1
            if isinstance(g.get("route"), str) and isinstance(g.get("model"), str):
                last_judge = {"route": g["route"], "model": g["model"]}
                judges[judge_label(last_judge)] += 1
        a = _dict(line.get("authorizer"))
        for key in _AUTHORIZER:
            authorizer[key] += _int(a.get(key))
        c = _dict(line.get("condensed"))
        condensed["results"] += _int(c.get("results"))
        condensed["saved_tokens"] += _int(c.get("saved_tokens"))
        for item in _list(c.get("items")):
            if isinstance(item, dict):
                condensed["tokens_before"] += _int(item.get("tokens_before"))
                condensed["tokens_after"] += _int(item.get("tokens_after"))
                if isinstance(item.get("condenser"), str):
                    condensers[item["condenser"]] += 1
                recent = (recent + [item])[-RECENT_CONDENSED:]
        m = _dict(line.get("supervisor_model"))
        calls.update({k: _int(v) for k, v in _dict(m.get("calls")).items()})
        sup_in += _int(m.get("input_tokens"))
        sup_out += _int(m.get("output_tokens"))
        sup_cost += _num(m.get("cost_usd"))
        sup_unpriced += _int(m.get("unpriced"))
        sup_ms += _num(m.get("time_ms"))
        t_in, t_out = _int(line.get("input_tokens")), _int(line.get("output_tokens"))
        tokens_in += t_in
        tokens_out += t_out
        estimated += line.get("usage_estimated") is True
        if line.get("scripted") is True:
            scripted += _int(line.get("status")) < 400  # an error (a 429, 529, 502) is no answer of the model's
        elif t_in or t_out:
            model = line.get("model")
            usd = price(model, t_in, t_out) if isinstance(model, str) and model not in unpriced else None
            if usd is None:
                unpriced.add(model if isinstance(model, str) else "(no model)")
            else:
                cost += usd
    return {
        "requests": requests,
        "errors": errors,
        "tool_rounds": tool_rounds,
        "local": dict(local),
        "first": first,
        "last": last,
        "runs": len(runs),
        "self_report": {"by_status": dict(by_status), "by_state": dict(by_state)},
        "detectors": {"fires": dict(fires), "steers": dict(steers)},
        "gate": {**{k: gate[k] for k in ("runs", "passes", "gaps", "malformed", "unavailable", "nudges",
                                         "reentries", "refuted")},
                 "outcomes": dict(outcomes), "last_outcome": last_outcome, "judges": dict(judges),
                 "last_judge": last_judge,
                 "decided_by": {"evidence": decided["evidence"], "model": decided["model"]}},
        "authorizer": {k: authorizer[k] for k in _AUTHORIZER},
        "condense": {"results": condensed["results"], "saved_tokens": condensed["saved_tokens"],
                     "tokens_before": condensed["tokens_before"], "tokens_after": condensed["tokens_after"],
                     "by_condenser": dict(condensers), "recent": recent},
        "planner_calls": calls["plan"],
        "supervisor_model": {"calls": {k: n for k, n in calls.items() if n}, "total_calls": sum(calls.values()),
                             "input_tokens": sup_in, "output_tokens": sup_out, "cost_usd": sup_cost,
                             "unpriced_calls": sup_unpriced, "time_ms": _ms(sup_ms)},
        "upstream": {"input_tokens": tokens_in, "output_tokens": tokens_out, "cost_usd": cost,
                     "cost_known": not unpriced, "unpriced": sorted(unpriced), "scripted_requests": scripted,
                     "estimated_requests": estimated},
        "breakers": {"pools": {pool: {k: counts[k] for k in ("answered", "refused", "failed")}
                               for pool, counts in sorted(pools.items())}, "fallbacks": fallbacks},
        "delegations": {"runs": delegations["runs"], "by_status": dict(by_delegation_status),
                        "child_runs": delegations["child_runs"], "retries": delegations["retries"],
                        "dead_letters": delegations["dead_letters"], "recent_dead_letters": dead_letters},
        "learning": {k: learning[k] for k in _LEARNING},
        "overhead_ms": {"total": _ms(sum(overheads)), "mean": _ms(statistics.fmean(overheads)) if overheads else 0.0,
                        "p50": _ms(statistics.median(overheads)) if overheads else 0.0,
                        "max": _ms(max(overheads, default=0.0))},
    }


def info_object(session: str, lines: Iterable[Mapping[str, Any]], live: dict[str, Any] | None,
                only_here: bool = False, run: str | None = None, ledger_off: bool = False) -> dict[str, Any]:
    """What ``/info`` answers for ``session``: ``{"session", **summarize(lines, run=run), "live",
    "only_this_replica", "ledger_off"}``, where ``live`` is the proxy's in-memory counters
    (``proxyvisor.proxy.commands.live``) or None (not in memory, or read offline), ``only_this_replica``
    (``only_here``) says that ``lines`` are this replica's own though the replicas share their ledgers (Redis does
    not answer: the other replicas' lines are missing), and ``run`` is the run of the ``/info`` asking
    (:func:`summarize`). With ``ledger_off`` (the proxy writes no ledger) the model requests, errors, upstream tokens
    and overhead are the ``live`` counters: what the proxy counts in memory."""
    info = {"session": session, **summarize(lines, run=run), "live": live, "only_this_replica": only_here,
            "ledger_off": ledger_off and live is not None}
    if info["ledger_off"]:
        assert live is not None
        info.update(requests=live["requests"], errors=live["errors"])
        info["upstream"] = {**info["upstream"], "input_tokens": live["input_tokens"],
                            "output_tokens": live["output_tokens"]}
        total = live["overhead_ms"]
        info["overhead_ms"] = {**info["overhead_ms"], "total": _ms(total),
                               "mean": _ms(total / live["requests"]) if live["requests"] else 0.0}
    return info


def _str(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _strs(value: Any) -> list[str]:
    return [v for v in _list(value) if isinstance(v, str)]


def _int_or_none(value: Any) -> int | None:
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _child_run(attempt: Mapping[str, Any]) -> dict[str, Any]:
    return {"attempt": _int(attempt.get("attempt")) or 1, "outcome": _str(attempt.get("outcome")),
            "pool": _str(attempt.get("capacity_scope")), "error_category": _str(attempt.get("error_category"))}


def timeline_entry(n: int, line: Mapping[str, Any]) -> dict[str, Any]:
    """One ledger ``line`` (the ``n``-th of its session, from 1) as a step of the session's timeline: what the
    request was and what supervision did for it, every field typed (odd values count as absent, as in
    :func:`summarize`): ``time``, ``local`` (a command proxyvisor answered, else None), ``status``, ``error``,
    ``model``, ``agent``, ``stream``, ``tool_round``, ``input_tokens``, ``output_tokens``, ``latency_ms``,
    ``overhead_ms``, ``report`` (``{"status", "state"}`` or None), ``signals`` (detector fires), ``steer``
    (``{"signal", "note"}`` or None), ``condensed`` (``{"results", "saved_tokens", "items": [{"call_id", "tool",
    "condenser", "tokens_before", "tokens_after", "spill_path"}]}`` or None), ``gate`` (``{"verdicts",
    "decided_by", "outcome", "passed", "reason", "gaps", "nudges", "reentries", "refuted", "model"}`` or None),
    ``delegations`` (``[{"role", "status", "adapter", "model", "pool", "error_category", "dead_letter",
    "input_tokens", "output_tokens", "duration_s", "runs": [{"attempt", "outcome", "pool", "error_category"}]}]``:
    each child and its runs), ``upstream`` (``{"name", "pool", "outcome", "health_state", "tried"}`` or None),
    ``authorizer`` (its counts, or None) and ``supervisor_calls`` (``{purpose: n}``). Never raises."""
    report = _dict(line.get("report"))
    steer = _str(line.get("steer"))
    condensed = line.get("condensed")
    gate = line.get("gate")
    up = line.get("upstream")
    authorizer = line.get("authorizer")
    return {
        "n": n, "time": _str(line.get("time")), "local": _str(line.get("local")),
        "status": _int(line.get("status")), "error": _str(line.get("error")),
        "model": _str(line.get("model")), "agent": _str(line.get("agent")), "stream": line.get("stream") is True,
        "tool_round": line.get("tool_round") is True,
        "input_tokens": _int_or_none(line.get("input_tokens")), "output_tokens": _int_or_none(line.get("output_tokens")),
        "latency_ms": _num(line.get("latency_ms")), "overhead_ms": _num(line.get("overhead_ms")),
        "report": {"status": _str(report.get("status")), "state": _str(report.get("state"))} if report else None,
        "signals": _strs(line.get("signals")),
        "steer": {"signal": steer, "note": _str(line.get("steer_note"))} if steer else None,
        "condensed": {
            "results": _int(condensed.get("results")), "saved_tokens": _int(condensed.get("saved_tokens")),
            "items": [{"call_id": _str(i.get("call_id")), "tool": _str(i.get("tool")),
                       "condenser": _str(i.get("condenser")), "tokens_before": _int(i.get("tokens_before")),
                       "tokens_after": _int(i.get("tokens_after")), "spill_path": _str(i.get("spill_path"))}
                      for i in map(_dict, _list(condensed.get("items")))]}
        if isinstance(condensed, dict) and (_int(condensed.get("results")) or _int(condensed.get("saved_tokens")))
        else None,
        "gate": {"verdicts": _strs(gate.get("verdicts")), "decided_by": _strs(gate.get("decided_by")),
                 "outcome": _str(gate.get("outcome")), "passed": gate.get("passed") is True,
                 "reason": _str(gate.get("reason")), "gaps": _strs(gate.get("gaps")),
                 "nudges": _int(gate.get("nudges")), "reentries": _int(gate.get("reentries")),
                 "refuted": _int(gate.get("refuted")), "model": _str(gate.get("model"))}
        if isinstance(gate, dict) else None,
        "delegations": [{"role": _str(d.get("role")), "status": _str(d.get("status")),
                         "adapter": _str(d.get("gen_ai.provider.name")), "model": _str(d.get("gen_ai.request.model")),
                         "pool": _str(d.get("capacity_scope")), "error_category": _str(d.get("error_category")),
                         "dead_letter": _str(d.get("dead_letter")),
                         "input_tokens": _int_or_none(d.get("gen_ai.usage.input_tokens")),
                         "output_tokens": _int_or_none(d.get("gen_ai.usage.output_tokens")),
                         "duration_s": _num(d.get("duration_s")),
                         "runs": [_child_run(_dict(a)) for a in _list(d.get("attempts"))]}
                        for d in map(_dict, _list(line.get("delegations")))],
        "upstream": {"name": _str(up.get("name")), "pool": _str(up.get("pool")), "outcome": _str(up.get("outcome")),
                     "health_state": _str(up.get("health_state")),
                     "tried": [{"name": _str(t.get("upstream")), "pool": _str(t.get("pool")),
                                "status": _int_or_none(t.get("status")),
                                "error_category": _str(t.get("error_category"))}
                               for t in map(_dict, _list(up.get("tried")))]}
        if isinstance(up, dict) else None,
        "authorizer": {k: _int(authorizer.get(k)) for k in _AUTHORIZER} if isinstance(authorizer, dict) else None,
        "supervisor_calls": {k: _int(v) for k, v in _dict(_dict(line.get("supervisor_model")).get("calls")).items()},
    }


def session_row(session: str, lines: Sequence[Mapping[str, Any]], price: Price | None = None) -> dict[str, Any]:
    """A session as one row of a listing, from its ledger ``lines``: ``id``, ``agent`` and ``model`` (of its
    latest request naming one), ``requests``, ``errors``, ``input_tokens``, ``output_tokens``, ``cost`` (the
    :func:`upstream_cost` text) and ``cost_usd``, ``first`` / ``last_activity`` (ISO 8601), ``state`` (the
    latest self-reported state), ``gate_outcomes`` (``{label: n}``) and ``last_outcome``, ``fires`` and
    ``steers`` (``{signal: n}``), ``condensed`` and ``saved_tokens``: sums of :func:`summarize`."""
    info = summarize(lines, price)
    latest = {key: next((v for line in reversed(lines) if isinstance(v := line.get(key), str)), None)
              for key in ("agent", "model")}
    state = next((s for line in reversed(lines) if (s := _str(_dict(line.get("report")).get("state")))), None)
    up = info["upstream"]
    return {"id": session, **latest, "requests": info["requests"], "errors": info["errors"],
            "input_tokens": up["input_tokens"], "output_tokens": up["output_tokens"], "cost_usd": up["cost_usd"],
            "cost": upstream_cost(up), "first": info["first"], "last_activity": info["last"], "state": state,
            "gate_outcomes": info["gate"]["outcomes"], "last_outcome": info["gate"]["last_outcome"],
            "fires": info["detectors"]["fires"], "steers": info["detectors"]["steers"],
            "condensed": info["condense"]["results"], "saved_tokens": info["condense"]["saved_tokens"]}


def counts_text(counts: Mapping[str, int]) -> str:
    """``a 3 · b 1``, largest first; ``none`` when empty."""
    items = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    return " · ".join(f"{k} {v:,}" for k, v in items) or "none"


def plural(count: int, noun: str, nouns: str | None = None) -> str:
    """``1 call``, ``2 calls``: ``count`` (with thousands separators) and ``noun``, or its plural ``nouns``
    (default ``noun + "s"``) for any count but 1."""
    return f"{count:,} {noun if count == 1 else nouns or noun + 's'}"


def usd(value: float) -> str:
    return f"${value:,.4f}"


def upstream_cost(up: Mapping[str, Any]) -> str:
    """What the upstream tokens of a :func:`summarize` object's ``upstream`` cost, as text: ``$0.0123``;
    ``price unknown (local-llm)`` when no priced model had tokens, else ``$0.0123 + price unknown for local-llm``;
    with the scripted model's answers, that they are not priced; empty when there were no tokens to price."""
    unknown = ", ".join(up.get("unpriced") or ())
    scripted = up.get("scripted_requests") or 0
    parts = []
    tokens = up["input_tokens"] or up["output_tokens"]
    if up["cost_usd"] > 0 or (tokens and not (unknown or scripted)):
        parts.append(usd(up["cost_usd"]) + (f" + price unknown for {unknown}" if unknown else ""))
    elif unknown:
        parts.append(f"price unknown ({unknown})")
    if scripted:
        parts.append(f"{plural(scripted, 'answer')} of the built-in scripted model, not priced")
    return "; ".join(parts)


def supervisor_text(sup: Mapping[str, Any]) -> str:
    """A :func:`summarize` object's ``supervisor_model`` as text: ``2 calls (verify 2) · 500 in / 30 out tokens ·
    $0.0015 · 1,234.0 ms``."""
    if not sup["total_calls"]:
        return "no calls"
    unpriced = sup.get("unpriced_calls") or 0
    cost = usd(sup["cost_usd"]) if not unpriced else "not priced" if not sup["cost_usd"] else \
        f"{usd(sup['cost_usd'])} + {plural(unpriced, 'answer')} not priced"
    return (f"{plural(sup['total_calls'], 'call')} ({counts_text(sup['calls'])}) · {sup['input_tokens']:,} in / "
            f"{sup['output_tokens']:,} out tokens · {cost} · {sup.get('time_ms', 0.0):,.1f} ms")


def authorizer_text(authz: Mapping[str, int]) -> str:
    """A :func:`summarize` object's ``authorizer`` counts, as text."""
    return (f"checked {authz['checked']:,} · blocked {authz['blocked']:,} · cached {authz['cached']:,} · "
            f"unavailable {authz['unavailable']:,} · batches {authz['batches']:,} (pre-screened "
            f"{authz['prescreened']:,})")


def pools_text(breakers: Mapping[str, Any]) -> str:
    """A :func:`summarize` object's ``breakers``, as text: each pool's counts, and the answers a fallback gave."""
    pools = "; ".join(f"{pool}: answered {c['answered']:,} · refused {c['refused']:,} · failed {c['failed']:,}"
                      for pool, c in breakers["pools"].items()) or "none"
    return pools + (f"; answered by a fallback {breakers['fallbacks']:,}" if breakers["fallbacks"] else "")


def delegations_text(dl: Mapping[str, Any]) -> str:
    """A :func:`summarize` object's ``delegations``, as text; empty when it made none."""
    if not dl.get("runs"):
        return ""
    return (f"runs {dl['runs']:,} ({counts_text(dl['by_status'])}) · child runs {dl['child_runs']:,} · retries "
            f"{dl['retries']:,} · dead letters {dl['dead_letters']:,}"
            + (f" (last: {dl['recent_dead_letters'][-1]})" if dl["recent_dead_letters"] else ""))


def memory_text(learning: Mapping[str, Any]) -> str:
    """What learning did, as text; empty when it did nothing. ``learning`` is a :func:`summarize` object's
    ``learning`` (from the ledger) or the live counters (``proxyvisor.proxy.learning.SessionLearning.info``),
    which add the scope, its records, the distills the pre-screen left without a call, the records a distill call
    stored and credit moves."""
    if not (learning.get("recalled_items") or learning.get("stored") or learning.get("distill_calls")
            or "records" in learning):
        return ""
    parts = [f"{plural(learning['records'], 'record')} ({learning['archived']:,} archived) for {learning['scope']}"
             ] if "records" in learning else []
    parts.append(f"recalled {plural(learning['recalled_items'], 'item')}, "
                 f"{plural(learning['recalled_tokens'], 'token')}")
    if "distills" in learning:
        parts.append(f"distills {learning['distills']:,} (calls {learning['distill_calls']:,}, pre-screened out "
                     f"{learning['distill_skipped']:,})")
    else:
        parts.append(f"distill calls {learning['distill_calls']:,}")
    parts.append(f"stored {learning['stored']:,}")
    if "credit_positive" in learning:
        parts.append(f"credit +{learning['credit_positive']:,} / -{learning['credit_negative']:,}")
    return " · ".join(parts)


def render_text(info: Mapping[str, Any]) -> str:
    """``info`` (a :func:`summarize` object, with ``session`` when known) as a compact Markdown table that reads
    as plain text too: the text of proxyvisor's /info answer and of ``proxyvisor info``."""
    gate, up, sup, over = info["gate"], info["upstream"], info["supervisor_model"], info["overhead_ms"]
    report = info["self_report"]
    local = sum(info["local"].values())
    rows = [
        ("model requests", f"{info['requests']:,} (tool rounds {info['tool_rounds']:,}, errors {info['errors']:,})"
                           + (f"; {local:,} answered by proxyvisor" if local else "")
                           + (f"; in {info['runs']:,} wrap runs" if info.get("runs", 0) > 1 else "")),
        ("self-reports", counts_text(report["by_status"])),
        ("reported states", counts_text(report["by_state"])),
        ("detector fires", counts_text(info["detectors"]["fires"])),
        ("steer notes", counts_text(info["detectors"]["steers"])),
        ("gate", (f"runs {gate['runs']:,} · passes {gate['passes']:,} · gaps {gate['gaps']:,} · nudges "
                  f"{gate['nudges']:,} · re-entries {gate['reentries']:,} · refuted {gate['refuted']:,} · "
                  f"unavailable {gate['unavailable']:,}")),
        ("gate outcomes", counts_text(gate["outcomes"])
         + (f" (last: {gate['last_outcome']})" if gate["last_outcome"] else "")
         + (f" · decided by evidence {gate['decided_by']['evidence']:,}, by the model "
            f"{gate['decided_by']['model']:,}" if gate["outcomes"] else "")),
        ("gate judged by", counts_text(gate.get("judges") or {})),
        ("condensed", f"results {info['condense']['results']:,}"
                      + (f" ({counts_text(info['condense']['by_condenser'])})"
                         if info["condense"].get("by_condenser") else "")
                      + (f" · {info['condense']['tokens_before']:,} -> {info['condense']['tokens_after']:,} tokens"
                         if info["condense"].get("tokens_before") else "")
                      + f" · saved {plural(info['condense']['saved_tokens'], 'token')}"),
        *([("authorizer", authorizer_text(authz))] if (authz := info.get("authorizer") or {}).get("batches") else []),
        ("planner calls", f"{info['planner_calls']:,}"),
        ("supervisor model", supervisor_text(sup)),
        ("upstream", f"{up['input_tokens']:,} in / {up['output_tokens']:,} out tokens"
                     + (f" (estimated for {plural(up['estimated_requests'], 'request')})"
                        if up.get("estimated_requests") else "")
                     + (f" · {cost}" if (cost := upstream_cost(up)) else "")),
        ("upstream pools", pools_text(info["breakers"])),
        *([("delegations", dl)] if (dl := delegations_text(info.get("delegations") or {})) else []),
        ("proxy overhead", f"total {over['total']:,.1f} ms · mean {over['mean']:,.1f}"
                           + ("" if info.get("ledger_off") else f" · p50 {over['p50']:,.1f} · max {over['max']:,.1f}")
                           + " ms"),
    ]
    memory = memory_text((info.get("live") or {}).get("learning") or info.get("learning") or {})
    if memory:
        rows.append(("memory", memory))
    unrecorded = (info.get("live") or {}).get("unrecorded")
    if info.get("ledger_off"):
        rows.append(("ledger", "off (see the proxyvisor log as it started): the model requests, errors, upstream "
                               "tokens and overhead above are counted in memory, the rest is not recorded"))
    elif unrecorded:
        rows.append(("not in the ledger", f"{unrecorded:,} request{'' if unrecorded == 1 else 's'} (the ledger "
                                          "could not be written: see the proxyvisor log); the counts above miss "
                                          f"{'it' if unrecorded == 1 else 'them'}"))
    unshared = (info.get("live") or {}).get("unshared")
    if unshared:
        rows.append(("not shared", f"{unshared:,} ledger line{'' if unshared == 1 else 's'} of this replica did "
                                   "not reach Redis (see the proxyvisor log): other replicas' counts miss "
                                   f"{'it' if unshared == 1 else 'them'}"))
    if info.get("only_this_replica"):
        rows.append(("replicas", "Redis does not answer: these counts are this replica's ledger lines only, the "
                                 "other replicas' requests are missing"))
    width = max(len(name) for name, _ in rows)
    head = "proxyvisor /info" + (f" · session {info['session']}" if info.get("session") else "")
    lines = [f"**{head}**", "", f"| {'counter'.ljust(width)} | value |", f"|{'-' * (width + 2)}|-------|"]
    lines += [f"| {name.ljust(width)} | {value} |" for name, value in rows]
    return "\n".join(lines)
