"""/info counters: the ledger fields a supervised request writes, and their sum (``proxyvisor.proxy.info``)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import orjson
import pytest

from proxyvisor.scripted.upstream import ScriptedUpstream
from proxyvisor.proxy.condense_decisions import Decision
from proxyvisor.config import Config, ModelConfig
from proxyvisor.detectors.detectors import LOOP
from proxyvisor.detectors.selfreport import ReportOutcome, SelfReport
from proxyvisor.proxy.condensing import Condensed, CondenseRecord
from proxyvisor.proxy.formats import BY_NAME, ToolSpec
from proxyvisor.proxy.info import (agent_of, ledger_fields, render_text, session_row, summarize,
                                   timeline_entry, upstream_cost)
from proxyvisor.proxy.service import running
from proxyvisor.proxy.supervise import ModelUse, RequestRecord
from proxyvisor.store import Store

from helpers import FORMATS, MODEL, http_client, request_body, sse_events

REPORT = '<sup>{"state":"progressing","focus":"poll","next":"poll again","carry":["build id 42"],"plan":null}</sup>'
GATE = {"verdicts": ["gaps", "pass"], "decided_by": ["evidence", "model"], "nudges": 1, "reentries": 1,
        "refuted": 0, "outcome": "verified", "passed": True, "reason": "", "gaps": [], "route": "session",
        "model": "local-llm"}

LINES: list[dict[str, Any]] = [
    {"time": "2026-01-01T00:00:00.000+00:00", "format": "chat", "model": "gpt-4o-mini", "status": 200,
     "input_tokens": 1000, "output_tokens": 100, "overhead_ms": 1.0, "tool_round": False,
     "report": {"status": "ok", "state": "exploring"}},
    {"time": "2026-01-01T00:00:01.000+00:00", "format": "chat", "model": "gpt-4o-mini", "status": 200,
     "input_tokens": 2000, "output_tokens": 50, "overhead_ms": 3.0, "tool_round": True,
     "report": {"status": "ok", "state": "progressing"}, "signals": ["loop", "no_progress"], "steer": "loop",
     "condensed": {"results": 1, "saved_tokens": 900, "items": [
         {"call_id": "c1", "tool": "Bash", "condenser": "deterministic", "tokens_before": 9300, "tokens_after": 3900}]},
     "supervisor_model": {"calls": {"condense": 1}, "input_tokens": 400, "output_tokens": 20, "cost_usd": 0.01,
                          "time_ms": 120.0}},
    {"time": "2026-01-01T00:00:02.000+00:00", "format": "chat", "model": "local-llm", "status": 200,
     "input_tokens": 10, "output_tokens": 5, "overhead_ms": 2.0, "tool_round": True,
     "report": {"status": "ok", "state": "done"}, "signals": ["loop"], "condensed": {"results": 0, "saved_tokens": 900},
     "gate": GATE,
     "supervisor_model": {"calls": {"verify": 2, "plan": 1}, "input_tokens": 100, "output_tokens": 10,
                          "cost_usd": 0.005, "unpriced": 1, "time_ms": 30.5}},
    {"time": "2026-01-01T00:00:03.000+00:00", "format": "chat", "model": "gpt-4o-mini", "status": 529,
     "input_tokens": None, "output_tokens": None, "overhead_ms": 0.5, "error": "overloaded",
     "gate": {"verdicts": ["unavailable"], "decided_by": ["model"], "outcome": "unverified", "passed": False}},
    {"time": "2026-01-01T00:00:04.000+00:00", "format": "chat", "model": "gpt-4o-mini", "status": 200,
     "input_tokens": 0, "output_tokens": 0, "overhead_ms": 40.0, "local": "/info"},
    {"time": "2026-01-01T00:00:05.000+00:00", "format": "chat", "status": 200, "overhead_ms": 9,
     "report": {"status": "missing", "state": None}, "signals": "not a list", "condensed": "odd",
     "input_tokens": "many"},
]
PRICES = {"gpt-4o-mini": (1e-6, 2e-6)}


def price(model: str, tokens_in: int, tokens_out: int) -> float | None:
    rates = PRICES.get(model)
    return None if rates is None else tokens_in * rates[0] + tokens_out * rates[1]


def test_summarize_sums_every_counter_of_a_session() -> None:
    info = summarize(LINES, price)
    assert (info["requests"], info["errors"], info["tool_rounds"], info["local"]) == (5, 1, 2, {"/info": 1})
    assert (info["first"], info["last"]) == (LINES[0]["time"], LINES[-1]["time"])
    assert info["self_report"] == {"by_status": {"ok": 3, "missing": 1},
                                   "by_state": {"exploring": 1, "progressing": 1, "done": 1}}
    assert info["detectors"] == {"fires": {"loop": 2, "no_progress": 1}, "steers": {"loop": 1}}
    assert info["gate"] == {"runs": 2, "passes": 1, "gaps": 1, "malformed": 0, "unavailable": 1, "nudges": 1,
                            "reentries": 1, "refuted": 0, "outcomes": {"verified": 1, "unverified": 1},
                            "last_outcome": "unverified", "judges": {"session: local-llm": 1},
                            "last_judge": {"route": "session", "model": "local-llm"},
                            "decided_by": {"evidence": 0, "model": 2}}
    assert info["condense"] == {"results": 1, "saved_tokens": 1800, "tokens_before": 9300, "tokens_after": 3900,
                                "by_condenser": {"deterministic": 1}, "recent": [
                                    {"call_id": "c1", "tool": "Bash", "condenser": "deterministic",
                                     "tokens_before": 9300, "tokens_after": 3900}]}
    assert info["planner_calls"] == 1
    assert info["supervisor_model"] == {"calls": {"condense": 1, "verify": 2, "plan": 1}, "total_calls": 4,
                                        "input_tokens": 500, "output_tokens": 30, "cost_usd": pytest.approx(0.015),
                                        "unpriced_calls": 1, "time_ms": 150.5}
    up = info["upstream"]
    assert (up["input_tokens"], up["output_tokens"]) == (3010, 155)
    assert up["cost_usd"] == pytest.approx(3000e-6 + 150 * 2e-6)  # local-llm is not priced: 0, and named
    assert (up["cost_known"], up["unpriced"]) == (False, ["local-llm"])
    # Model requests only: the local answer's 40 ms is not proxy overhead on a model request.
    assert info["overhead_ms"] == {"total": 15.5, "mean": 3.1, "p50": 2.0, "max": 9.0}


def test_an_empty_ledger_sums_to_zero_and_prices_nothing() -> None:
    def no_price(*_: Any) -> float:
        raise AssertionError("nothing to price")

    info = summarize([], no_price)
    assert info["requests"] == 0 and info["first"] is None
    assert info["upstream"] == {"input_tokens": 0, "output_tokens": 0, "cost_usd": 0.0, "cost_known": True,
                                "unpriced": [], "scripted_requests": 0, "estimated_requests": 0}
    assert info["overhead_ms"] == {"total": 0.0, "mean": 0.0, "p50": 0.0, "max": 0.0}
    assert "none" in render_text(info)
    assert "$" not in render_text(info)  # no tokens: nothing priced, not "$0.0000"


def test_only_the_scripted_models_successful_answers_count_as_its_answers() -> None:
    lines = [{"status": 200, "scripted": True, "input_tokens": 10, "output_tokens": 2},
             *({"status": status, "scripted": True, "error": "upstream"} for status in (429, 529, 502, 400))]
    info = summarize(lines)
    assert (info["requests"], info["errors"], info["upstream"]["scripted_requests"]) == (5, 4, 1)
    assert upstream_cost(info["upstream"]) == "1 answer of the built-in scripted model, not priced"
    refused = summarize(lines[1:])
    assert refused["upstream"]["scripted_requests"] == 0 and upstream_cost(refused["upstream"]) == ""


def test_an_unpriced_model_is_asked_once() -> None:
    asked: Counter[str] = Counter()

    def counting(model: str, tokens_in: int, tokens_out: int) -> float | None:
        asked[model] += 1
        return price(model, tokens_in, tokens_out)

    summarize(LINES + [LINES[2]] * 3, counting)
    assert asked == {"gpt-4o-mini": 2, "local-llm": 1}


def test_turns_are_counted_by_what_decided_their_last_pass() -> None:
    lines = [{"gate": {"verdicts": ["gaps"], "decided_by": ["evidence"], "reentries": 1}},  # the turn goes on
             {"gate": {"verdicts": ["gaps", "gaps"], "decided_by": ["evidence", "evidence"], "outcome": "failed",
                       "passed": False}},
             {"gate": {"verdicts": ["gaps", "pass"], "decided_by": ["evidence", "model"], "outcome": "verified",
                       "passed": True}},
             {"gate": {"verdicts": ["pass"], "outcome": "unknown", "passed": True}}]  # a ledger from before
    assert summarize(lines)["gate"]["decided_by"] == {"evidence": 1, "model": 1}


def test_the_run_of_the_request_asking_is_counted_among_the_runs_and_nothing_else() -> None:
    lines = [{"status": 200, "run": "r1"}, {"status": 200, "run": "r1"}]
    assert summarize(lines)["runs"] == 1
    asked = summarize(lines, run="r2")
    assert (asked["runs"], asked["requests"], asked["local"]) == (2, 2, {})
    assert summarize(lines, run="r1")["runs"] == 1
    assert summarize([], run="r1")["runs"] == 1  # the first request of a session: one run, its own


def test_render_text_is_a_table_with_every_counter() -> None:
    text = render_text({"session": "s-1", **summarize(LINES, price)})
    lines = text.splitlines()
    assert lines[0] == "**proxyvisor /info · session s-1**"
    rows = {line.split("|")[1].strip(): line.split("|")[2].strip() for line in lines[4:]}
    assert len({line.index("|", 1) for line in lines[2:]}) == 1  # the value column lines up, header included
    assert rows["model requests"] == "5 (tool rounds 2, errors 1); 1 answered by proxyvisor"
    assert rows["self-reports"] == "ok 3 · missing 1"
    assert rows["detector fires"] == "loop 2 · no_progress 1"
    assert rows["steer notes"] == "loop 1"
    assert rows["gate"].startswith("runs 2 · passes 1 · gaps 1 · nudges 1 · re-entries 1")
    assert rows["gate outcomes"] == ("unverified 1 · verified 1 (last: unverified) · decided by evidence 0, by the "
                                     "model 2")
    assert rows["condensed"] == "results 1 (deterministic 1) · 9,300 -> 3,900 tokens · saved 1,800 tokens"
    assert rows["planner calls"] == "1"
    assert rows["supervisor model"].startswith("4 calls (verify 2 · condense 1 · plan 1) · 500 in / 30 out tokens · "
                                               "$0.0150 + 1 answer not priced")
    assert rows["upstream"] == "3,010 in / 155 out tokens · $0.0033 + price unknown for local-llm"
    assert rows["proxy overhead"] == "total 15.5 ms · mean 3.1 · p50 2.0 · max 9.0 ms"


def test_ledger_fields_of_a_request_record() -> None:
    record = RequestRecord([(3, (LOOP,)), (5, (LOOP, "no_progress"))], note=LOOP, note_index=5,
                           report=ReportOutcome("ok", SelfReport("done", "x", None, ("a",))))
    whole = Decision(None, "below threshold", 10, 10, 1, 1)
    narrowed = Decision("short", "condensed", 900, 100, 3, 90, condenser="model")
    record.condense = CondenseRecord([Condensed("c1", "bash", narrowed, True), Condensed("c2", "bash", whole, True)],
                                     new=2, applied=2, saved_tokens=1500)
    record.model = ModelUse(Counter({"verify": 1}), 100, 20, 0.5, time_s=0.25)
    record.gate = GATE
    assert ledger_fields(record, True) == {
        "tool_round": True, "report": {"status": "ok", "state": "done"}, "signals": [LOOP, LOOP, "no_progress"],
        "steer": LOOP, "condensed": {"results": 1, "saved_tokens": 1500, "items": [
            {"call_id": "c1", "tool": "bash", "condenser": "model", "tokens_before": 900, "tokens_after": 100}]},
        "supervisor_model": {"calls": {"verify": 1}, "input_tokens": 100, "output_tokens": 20, "cost_usd": 0.5,
                             "time_ms": 250.0},
        "gate": GATE}
    # Nothing to say: only the tool round; a malformed report has no state.
    bare = RequestRecord(report=ReportOutcome("malformed", error="bad"))
    assert ledger_fields(bare, False) == {"tool_round": False, "report": {"status": "malformed", "state": None}}
    # A retry recalls its round's decisions: none of them is new.
    record.condense.new = 0
    record.condense.round = [Condensed("c1", "bash", narrowed), Condensed("c2", "bash", whole)]
    assert ledger_fields(record, True)["condensed"] == {"results": 0, "saved_tokens": 1500}


def _poll(fmt_name: str, rounds: int, stream: bool) -> dict[str, Any]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are an agent."},
                                      {"role": "user", "content": "Wait for the build."}]
    for n in range(rounds):
        messages.append({"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": f"c{n}", "type": "function", "function": {"name": "Bash", "arguments": '{"command":"cat s"}'}}]})
        messages.append({"role": "tool", "tool_call_id": f"c{n}", "content": "building: 3 of 7"})
    return BY_NAME[fmt_name].request_from_chat(messages, MODEL, stream, (ToolSpec("Bash", {}),))


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("fmt", FORMATS)
async def test_a_real_run_writes_what_supervision_did_and_info_sums_it(tmp_path: Path, fmt: str,
                                                                        stream: bool) -> None:
    """A polling agent through the proxy: the loop detector fires and steers, the reports are read (at the end
    of the stream for streams), and the ledger says so line by line."""
    poll = {"text": f"Still building.\n{REPORT}", "tool_calls": [{"name": "Bash", "arguments": {"command": "cat s"}}],
            "input_tokens": 100, "output_tokens": 10}
    store = Store(tmp_path / "state")
    async with running(Config(), port=0, store=store, scripted={"scripted": ScriptedUpstream([poll] * 4)}) as rp, \
            http_client() as client:
        for rounds in range(4):
            reply = await client.post(f"{rp.url}/s/poller{BY_NAME[fmt].path}", json=_poll(fmt, rounds, stream))
            assert reply.status_code == 200
        listing = (await client.get(f"{rp.url}/proxyvisor/sessions/poller/info")).json()
    lines = store.read_ledger("poller")
    assert [line["tool_round"] for line in lines] == [False, True, True, True]
    assert [line["report"] for line in lines] == [{"status": "ok", "state": "progressing"}] * 4
    assert [line.get("signals") for line in lines] == [None, None, None, [LOOP]]
    assert [line.get("steer") for line in lines] == [None, None, None, LOOP]
    assert not any("gate" in line or "supervisor_model" in line or "local" in line for line in lines)
    info = summarize(lines)
    assert (info["requests"], info["tool_rounds"], info["errors"]) == (4, 3, 0)
    assert info["detectors"] == {"fires": {LOOP: 1}, "steers": {LOOP: 1}}
    assert info["self_report"]["by_state"] == {"progressing": 4}
    # The built-in scripted model answered: its tokens count, and are never priced under the client's model name.
    assert all(line["scripted"] is True for line in lines)
    assert info["upstream"] == {"input_tokens": 400, "output_tokens": 40, "cost_usd": 0.0, "cost_known": True,
                                "unpriced": [], "scripted_requests": 4, "estimated_requests": 0}
    # The endpoint gives the same sum, with the in-memory counters.
    assert {k: v for k, v in listing.items() if k not in ("session", "live", "only_this_replica", "ledger_off")} \
            == orjson.loads(orjson.dumps(info))
    assert listing["session"] == "poller" and listing["live"]["requests"] == 4
    assert listing["live"]["steers"] == {LOOP: 1} and listing["live"]["state"] == "progressing"


@pytest.mark.parametrize("fmt,stream", [("chat", False), ("messages", True), ("responses", True)])
async def test_the_gate_and_the_supervisor_model_reach_the_ledger_and_info(tmp_path: Path, fmt: str,
                                                                           stream: bool) -> None:
    """A turn-ending answer goes through the verify-gate (the scripted verifier); its line says so."""
    config = Config().with_overrides(supervisor={"model": ModelConfig(name="openai/scripted-model",
                                                                      api_base="scripted:")})
    done = '<sup>{"state":"done","focus":"answer","next":null,"carry":[],"plan":null}</sup>'
    store = Store(tmp_path / "state")
    f = BY_NAME[fmt]
    async with running(config, port=0, store=store,
                       scripted={"scripted": ScriptedUpstream([{"text": f"Three files.\n{done}"}])}) as rp, \
            http_client(rp.url) as client:
        reply = await client.post(f"/s/gated{f.path}", json=request_body(fmt, stream))
        assert reply.status_code == 200
        turn = f.assemble([(e.event, e.data) for e in sse_events(reply.content)]) if stream \
            else f.parse_response(reply.json())
        assert turn.text == "Three files."
    (line,) = store.read_ledger("gated")
    assert line["gate"]["verdicts"] == ["pass"] and line["gate"]["passed"] is True
    assert line["supervisor_model"]["calls"] == {"verify": 1}
    assert line["report"] == {"status": "ok", "state": "done"}
    info = summarize([line])
    assert (info["gate"]["runs"], info["gate"]["passes"], info["gate"]["last_outcome"]) == \
        (1, 1, line["gate"]["outcome"])
    assert info["supervisor_model"]["calls"] == {"verify": 1} and info["planner_calls"] == 0
    # The scripted upstream's answers are never priced, whatever model name they go by.
    assert line["supervisor_model"]["unpriced"] == 1 and line["supervisor_model"]["cost_usd"] == 0
    assert "· not priced ·" in render_text(info)


def test_a_timeline_step_has_every_field_typed_whatever_the_line_holds() -> None:
    odd = {"status": "200", "signals": "loop", "steer": 3, "condensed": {"results": 1, "items": ["x", {"tool": 5}]},
           "gate": {"verdicts": ["gaps", 7], "gaps": "one", "reentries": "2"}, "delegations": [None, {"attempts": 3}],
           "upstream": {"tried": [{}]}, "report": [], "input_tokens": True}
    step = timeline_entry(4, odd)
    assert (step["n"], step["status"], step["signals"], step["steer"], step["report"]) == (4, 0, [], None, None)
    assert step["input_tokens"] is None
    assert step["condensed"]["items"][1] == {"call_id": None, "tool": None, "condenser": None, "tokens_before": 0,
                                             "tokens_after": 0, "spill_path": None}
    assert (step["gate"]["verdicts"], step["gate"]["gaps"], step["gate"]["reentries"]) == (["gaps"], [], 0)
    assert [d["runs"] for d in step["delegations"]] == [[], []]
    assert step["upstream"]["tried"] == [{"name": None, "pool": None, "status": None, "error_category": None}]
    steered = timeline_entry(1, {"status": 200, "signals": ["loop"], "steer": "loop", "steer_note": "<note/>"})
    assert steered["steer"] == {"signal": "loop", "note": "<note/>"}


def test_a_session_row_sums_its_ledger() -> None:
    row = session_row("s1", LINES)
    info = summarize(LINES)
    assert (row["id"], row["requests"], row["errors"]) == ("s1", info["requests"], info["errors"])
    assert row["gate_outcomes"] == info["gate"]["outcomes"] and row["fires"] == info["detectors"]["fires"]
    assert row["last_activity"] == info["last"] and row["state"] == "done"


@pytest.mark.parametrize("header,agent", [
    ("claude-cli/2.0.14 (external, cli)", "claude-cli/2.0.14"), ("OpenAI/Python 1.99.0", "OpenAI/Python"),
    ("codex_cli_rs/0.171.0 (Debian 12; x86_64) xterm", "codex_cli_rs/0.171.0"), ("", None), (None, None),
    ("<script>", None), ("a" * 100, "a" * 64)])
def test_the_agent_is_the_first_product_token_of_the_user_agent(header: str | None, agent: str | None) -> None:
    assert agent_of(header) == agent


def test_info_from_the_ledger_says_what_learning_and_delegation_did() -> None:
    lines = [{"status": 200, "learning": {"recalled": ["M1", "M2"], "tokens": 120}},
             {"status": 200, "learning": {"stored": 2, "distill_calls": 1},
              "delegations": [{"role": "reviewer", "status": "answered", "attempts": [
                  {"attempt": 1, "outcome": "failed"}, {"attempt": 2, "outcome": "answered"}]},
                  {"role": "reviewer", "status": "failed", "dead_letter": "dl-1",
                   "attempts": [{"attempt": 1, "outcome": "failed"}]}]},
             {"status": 200, "learning": {"recalled": ["M1"], "tokens": 60, "stored": "odd"}}]
    info = summarize(lines)
    assert info["learning"] == {"recalls": 2, "recalled_items": 3, "recalled_tokens": 180, "stored": 2,
                                "distill_calls": 1}
    rows = {line.split("|")[1].strip(): line.split("|")[2].strip() for line in render_text(info).splitlines()[4:]}
    assert rows["memory"] == "recalled 3 items, 180 tokens · distill calls 1 · stored 2"
    assert rows["delegations"] == ("runs 2 (answered 1 · failed 1) · child runs 3 · retries 1 · dead letters 1 "
                                   "(last: dl-1)")
    assert "memory" not in render_text(summarize(LINES, price))  # learning did nothing: no row
    live = {"scope": "/p", "records": 4, "archived": 1, "recalled_items": 2, "recalled_tokens": 120, "recalls": 1,
            "distills": 3, "distill_calls": 1, "distill_skipped": 2, "stored": 5, "credit_positive": 1,
            "credit_negative": 0, "archived_now": 0}
    rows = {line.split("|")[1].strip(): line.split("|")[2].strip()
            for line in render_text({**info, "live": {"learning": live}}).splitlines()[4:]}
    assert rows["memory"] == ("4 records (1 archived) for /p · recalled 2 items, 120 tokens · distills 3 (calls 1, "
                              "pre-screened out 2) · stored 5 · credit +1 / -0")
