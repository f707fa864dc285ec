"""Delegation end to end (without the proxy): child clocks and stops, limits, breaker, fallback, shapes, evidence."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest
import trio

from proxyvisor.adapters.children import Budget, ChildHandle, ChildOutcome, run_child
from proxyvisor.adapters.delegate import Delegation
from proxyvisor.adapters.descriptors import registry_for
from proxyvisor.adapters.failures import RETRY_AFTER_CAP_S
from proxyvisor.adapters.retry import NextStart, RetryPolicy, next_start
from proxyvisor.adapters.runtime import ChildJob
from proxyvisor.scripted.upstream import ScriptedUpstream
from proxyvisor.config import ChildrenConfig, RouteTarget

from helpers import alive, files_under
from routing_support import FAST, FIXTURE_ADAPTERS, make_delegator, routing_config

ONCE = msgspec.structs.replace(FAST, attempts=1)
"""No retry: the breaker's own behaviour, one child run per hand-off."""

PARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
WORKER = {"worker": {"adapter": "fixture-cli", "model": "fixture-big", "description": "does the work"}}


@pytest.fixture
def fixture_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Every run of the fixture CLI appends ``pid prompt`` here: proof of which children ran."""
    log = tmp_path / "fixture-runs.log"
    monkeypatch.setenv("FIXTURE_LOG", str(log))
    return log


def runs(log: Path) -> list[tuple[int, str]]:
    if not log.exists():
        return []
    return [(int(pid), prompt) for pid, _, prompt in (line.partition(" ") for line in log.read_text().splitlines())]


async def delegate(tmp_path: Path, prompt: str, roles: dict[str, Any] = WORKER, role: str = "worker",
                   upstream: ScriptedUpstream | None = None, clocks: ChildrenConfig = FAST,
                   **routing: Any) -> Delegation:
    delegator = make_delegator(routing_config(roles, **routing), tmp_path / "state", upstream, clocks)
    try:
        return await delegator.delegate(role, prompt, traceparent=PARENT)
    finally:
        delegator.close()


async def fixture_child(prompt: str, clocks: ChildrenConfig = FAST, handle: ChildHandle | None = None) -> ChildOutcome:
    runtime = registry_for(str(FIXTURE_ADAPTERS)).get("fixture-cli").load_runtime({})
    job = ChildJob("child_t", "worker", prompt, "fixture-cli", "fixture-fast", stop_grace_s=clocks.stop_grace_s)
    return await run_child(runtime, job, clocks, handle)


# ---- results, shapes, evidence ---------------------------------------------------------------------------


async def test_a_finished_child_gives_its_text_with_evidence_and_the_parents_trace(tmp_path: Path,
                                                                                   fixture_log: Path) -> None:
    result = await delegate(tmp_path, "mode:echo check the tests")
    assert result.status == "ok" and not result.result.is_error
    text = result.result.content
    assert isinstance(text, str) and text.startswith("mode:echo check the tests | model=fixture-big | traceparent=00-")
    child_trace = text.rsplit("traceparent=", 1)[1]
    trace_id, span_id = child_trace.split("-")[1:3]
    assert trace_id == PARENT.split("-")[1] and span_id != PARENT.split("-")[2], "same trace, a new span"
    e = result.evidence
    assert {k: e[k] for k in ("gen_ai.provider.name", "gen_ai.agent.id", "gen_ai.request.model", "capacity_scope",
                              "health_state", "health_probe", "error_category", "retry_after_s", "trace_id")} == {
        "gen_ai.provider.name": "fixture-cli", "gen_ai.agent.id": "worker", "gen_ai.request.model": "fixture-big",
        "capacity_scope": "fixture-cli:big", "health_state": "healthy", "health_probe": False,
        "error_category": None, "retry_after_s": None, "trace_id": trace_id}
    assert e["gen_ai.conversation.id"] == f"fx-{runs(fixture_log)[0][0]}"
    assert (e["gen_ai.usage.input_tokens"], e["gen_ai.usage.output_tokens"]) == (10, 5)


async def test_a_truncated_child_is_shaped_with_its_finish_reason(tmp_path: Path, fixture_log: Path) -> None:
    result = await delegate(tmp_path, "mode:truncated")
    assert result.status == "ok"
    assert result.result.content == {"text": "half an answer", "finish_reason": "length"}


async def test_a_failing_child_is_an_error_tool_result_so_the_parent_replans(tmp_path: Path, fixture_log: Path) -> None:
    result = await delegate(tmp_path, "mode:crash")
    assert result.status == "failed" and result.result.is_error
    assert result.result.as_text().startswith("Tool 'worker' failed: ")
    assert "fixture crashed on purpose" in result.result.as_text()
    assert result.evidence["error_category"] in ("provider", "unavailable")


async def test_a_long_result_is_claim_checked_head_tail_and_record_id(tmp_path: Path, fixture_log: Path) -> None:
    delegator = make_delegator(routing_config(WORKER), tmp_path / "state")
    result = await delegator.delegate("worker", "mode:long n=10000")
    full = "".join(chr(ord("a") + i % 26) for i in range(10000))
    text = result.result.content
    assert result.record_id and result.record_id in text and len(text) < 6000
    assert text.startswith(full[:2000]) and text.endswith(full[-2000:])
    assert "6,000 characters omitted" in text
    assert delegator.claims.get(result.record_id)["text"] == full
    assert delegator.claims.get(result.record_id)["meta"]["role"] == "worker"
    short = await delegator.delegate("worker", "mode:long n=6000")
    assert short.record_id is None and len(short.result.content) == 6000
    delegator.close()


# ---- clocks and stops ------------------------------------------------------------------------------------


async def test_a_silent_child_is_cancelled_by_the_heartbeat_and_returns_what_it_had(tmp_path: Path,
                                                                                    fixture_log: Path) -> None:
    result = await delegate(tmp_path, "mode:hang")
    assert result.status == "ok"
    assert result.result.content == {"text": "thinking... ", "finish_reason": "idle_timeout"}
    assert result.evidence["error_category"] == "timeout"
    pid = runs(fixture_log)[0][0]
    assert not alive(pid)


async def test_every_event_counts_but_the_wall_clock_still_stops_a_busy_child(fixture_log: Path) -> None:
    outcome = await fixture_child(
        "mode:trickle delay=0.05",
        ChildrenConfig(wall_clock_s=1.0, idle_warn_s=0.3, idle_cancel_s=0.6, stop_grace_s=0.5))
    assert outcome.finish_reason == "timeout" and outcome.failure.outcome == "unknown"
    assert outcome.events > 5 and outcome.text.startswith("...")
    assert outcome.idle_warnings == 0
    assert not alive(runs(fixture_log)[0][0])


async def test_an_idle_spell_is_warned_about_without_stopping_the_child(fixture_log: Path,
                                                                         caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, "proxyvisor.adapters.progress"):
        outcome = await fixture_child(
            "mode:stream n=2 delay=0.5",
            ChildrenConfig(wall_clock_s=10, idle_warn_s=0.2, idle_cancel_s=5, stop_grace_s=0.5))
    assert (outcome.finish_reason, outcome.failure) == ("stop", None)
    assert outcome.idle_warnings >= 1 and "worker idle: no output for 0.2 s" in caplog.text


async def test_a_child_ignoring_sigterm_is_killed_after_the_grace(fixture_log: Path,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, "proxyvisor.adapters.progress"):
        outcome = await fixture_child(
            "mode:ignore-term", ChildrenConfig(wall_clock_s=10, idle_warn_s=0.2, idle_cancel_s=0.4, stop_grace_s=0.3))
    assert outcome.finish_reason == "idle_timeout" and outcome.text == "thinking... "
    assert "ignored SIGTERM" in caplog.text and "(killed)" in caplog.text
    assert not alive(runs(fixture_log)[0][0])


async def test_a_child_that_honours_sigterm_is_stopped_softly(fixture_log: Path,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, "proxyvisor.adapters.progress"):
        outcome = await fixture_child(
            "mode:hang", ChildrenConfig(wall_clock_s=10, idle_warn_s=0.2, idle_cancel_s=0.4, stop_grace_s=5))
    assert outcome.finish_reason == "idle_timeout"
    assert "(terminated)" in caplog.text and "ignored SIGTERM" not in caplog.text


async def test_the_parent_cancels_a_child_and_cancel_is_idempotent(fixture_log: Path) -> None:
    handle = ChildHandle()
    async with trio.open_nursery() as nursery:
        outcome: list[ChildOutcome] = []

        async def child() -> None:
            outcome.append(await fixture_child(
                "mode:hang", ChildrenConfig(wall_clock_s=10, idle_warn_s=5, idle_cancel_s=9, stop_grace_s=1), handle))

        nursery.start_soon(child)
        while not runs(fixture_log):
            await trio.sleep(0.02)
        handle.cancel()
        handle.cancel()
    assert outcome[0].finish_reason == "cancelled" and outcome[0].failure is None
    assert outcome[0].cancelled, "a cancel says nothing about the pool"
    assert not alive(runs(fixture_log)[0][0])


async def test_cancelling_the_callers_scope_stops_the_child_and_releases_its_probe_lease(tmp_path: Path,
                                                                                        fixture_log: Path) -> None:
    delegator = make_delegator(routing_config(WORKER), tmp_path / "state")
    delegator.health.settle_sync("fixture-cli:big", time.time() - 100, _capacity(1))
    with trio.move_on_after(0.5):
        await delegator.delegate("worker", "mode:hang")
    health = delegator.health.get("fixture-cli:big")
    assert (health.state, health.lease_id, health.failure_count) == ("half_open", "", 1), "the lease is released"
    assert health.last_category == "capacity", "the cancel recorded nothing of its own"
    assert not alive(runs(fixture_log)[0][0])
    again = await delegator.delegate("worker", "mode:echo next")
    assert again.status == "ok", "the next caller probes at once"
    assert delegator.health.get("fixture-cli:big").state == "healthy"
    delegator.close()


async def test_a_cancelled_delegation_records_nothing_on_a_healthy_pool(tmp_path: Path, fixture_log: Path) -> None:
    delegator = make_delegator(routing_config(WORKER), tmp_path / "state")
    handle = ChildHandle()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(lambda: delegator.delegate("worker", "mode:hang", handle=handle))
        while not runs(fixture_log):
            await trio.sleep(0.02)
        handle.cancel()
    with trio.move_on_after(0.5):
        await delegator.delegate("worker", "mode:hang")
    assert delegator.health.all() == [], "neither the parent's cancel nor the caller's scope is a pool failure"
    delegator.close()


def _capacity(retry_after_s: int | None = None) -> Any:
    from proxyvisor.adapters.failures import Failure

    return Failure("capacity", True, "known_failed", retry_after_s)


# ---- limits ---------------------------------------------------------------------------------------------


async def test_past_max_parallel_a_child_is_refused_loudly_not_queued(tmp_path: Path, fixture_log: Path) -> None:
    delegator = make_delegator(routing_config(WORKER, max_parallel=2), tmp_path / "state",
                               clocks=ChildrenConfig(wall_clock_s=10, idle_warn_s=5, idle_cancel_s=9, stop_grace_s=1))
    handles = [ChildHandle(), ChildHandle()]
    async with trio.open_nursery() as nursery:
        for handle in handles:
            nursery.start_soon(lambda h=handle: delegator.delegate("worker", "mode:hang", handle=h))
        while len(runs(fixture_log)) < 2:
            await trio.sleep(0.02)
        refused = await delegator.delegate("worker", "mode:echo third")
        for handle in handles:
            handle.cancel()
    assert refused.status == "refused" and "max_parallel = 2" in refused.result.as_text()
    assert len(runs(fixture_log)) == 2
    assert delegator.gate.live == 0
    delegator.close()


async def test_one_budget_covers_the_whole_fan_out(tmp_path: Path, fixture_log: Path) -> None:
    delegator = make_delegator(routing_config(WORKER), tmp_path / "state")
    budget = Budget(tokens=20)
    first = await delegator.delegate("worker", "mode:echo a", budget=budget)
    second = await delegator.delegate("worker", "mode:echo b", budget=budget)
    third = await delegator.delegate("worker", "mode:echo c", budget=budget)
    assert (first.status, second.status, third.status) == ("ok", "ok", "refused")
    assert "budget is spent (30 of 20)" in third.result.as_text()
    assert len(runs(fixture_log)) == 2
    delegator.close()


# ---- breaker and fallback -------------------------------------------------------------------------------


async def test_a_rate_limited_child_cools_its_pool_and_the_next_caller_learns_when(tmp_path: Path,
                                                                                   fixture_log: Path) -> None:
    delegator = make_delegator(routing_config(WORKER), tmp_path / "state", clocks=ONCE)
    limited = await delegator.delegate("worker", "mode:rate-limit")
    assert limited.status == "failed"
    assert (limited.evidence["error_category"], limited.evidence["retry_after_s"]) == ("capacity", 7)
    refused = await delegator.delegate("worker", "mode:echo again")
    assert refused.status == "refused"
    assert "soonest recovery in 7 s (fixture-cli:big)" in refused.result.as_text()
    assert (refused.evidence["health_state"], refused.evidence["retry_after_s"]) == ("cooling_down", 7)
    other_pool = await delegator.delegate("worker", "mode:echo fast pool", override=RouteTarget(model="fixture-fast"))
    assert other_pool.status == "ok", "pools are independent: one model's limit leaves the other usable"
    assert [p for _, p in runs(fixture_log)] == ["mode:rate-limit", "mode:echo fast pool"]
    delegator.close()


async def test_auth_failures_do_not_cool_the_pool(tmp_path: Path, fixture_log: Path) -> None:
    delegator = make_delegator(routing_config(WORKER), tmp_path / "state")
    result = await delegator.delegate("worker", "mode:auth")
    assert result.evidence["error_category"] == "auth"
    assert delegator.health.get("fixture-cli:big").state == "healthy"
    assert (await delegator.delegate("worker", "mode:echo x")).status == "ok"
    delegator.close()


@pytest.mark.parametrize("policy, expected", [
    ("fail_closed", None), ("same_adapter_default", "fixture-cli:fast"), ("next_eligible", "fixture-cli:fast")])
async def test_fallback_before_execution_follows_the_policy(tmp_path: Path, fixture_log: Path, policy: str,
                                                           expected: str | None) -> None:
    delegator = make_delegator(routing_config(WORKER, fallback_policy=policy), tmp_path / "state")
    delegator.health.settle_sync("fixture-cli:big", time.time(), _capacity(60))
    result = await delegator.delegate("worker", "mode:echo hi")
    if expected is None:
        assert result.status == "refused" and "fixture-cli:big (cooling_down" in result.result.as_text()
        assert runs(fixture_log) == []
    else:
        assert result.status == "ok" and result.evidence["capacity_scope"] == expected
    delegator.close()


async def test_next_eligible_moves_to_another_adapter_the_policy_names(tmp_path: Path, fixture_log: Path) -> None:
    upstream = ScriptedUpstream([{"text": "answered by the scripted adapter"}])
    roles = {**WORKER, "helper": {"adapter": "scripted"}}
    delegator = make_delegator(routing_config(roles, fallback_policy="next_eligible"), tmp_path / "state", upstream)
    for pool in ("fixture-cli:big", "fixture-cli:fast"):
        delegator.health.settle_sync(pool, time.time(), _capacity(60))
    result = await delegator.delegate("worker", "mode:echo hi")
    assert (result.status, result.result.content) == ("ok", "answered by the scripted adapter")
    assert result.evidence["gen_ai.provider.name"] == "scripted" and runs(fixture_log) == []
    delegator.close()


async def test_when_every_pool_cools_the_refusal_names_the_soonest_and_all_waiting(tmp_path: Path,
                                                                                    fixture_log: Path) -> None:
    roles = {**WORKER, "helper": {"adapter": "scripted"}}
    delegator = make_delegator(routing_config(roles, fallback_policy="next_eligible"), tmp_path / "state")
    now = time.time()
    for pool, seconds in (("fixture-cli:big", 90), ("fixture-cli:fast", 300), ("scripted:scripted", 40)):
        delegator.health.settle_sync(pool, now, _capacity(seconds))
    result = await delegator.delegate("worker", "mode:echo hi")
    text = result.result.as_text()
    assert result.status == "refused" and "(scripted:scripted)" in text.split("waiting")[0]
    assert all(pool in text for pool in ("fixture-cli:big", "fixture-cli:fast", "scripted:scripted"))
    assert 38 <= result.evidence["retry_after_s"] <= 40
    delegator.close()


async def test_a_known_failure_before_any_work_may_fall_back_an_unknown_outcome_never(tmp_path: Path,
                                                                                       fixture_log: Path) -> None:
    upstream = ScriptedUpstream([{"text": "fallback ran"}])
    roles = {**WORKER, "helper": {"adapter": "scripted"}}
    config = routing_config(roles, fallback_policy="next_eligible")
    delegator = make_delegator(config, tmp_path / "state", upstream)
    worked = await delegator.delegate("worker", "mode:work-then-reset")
    assert worked.status == "failed" and worked.evidence["gen_ai.provider.name"] == "fixture-cli"
    assert upstream.requests == [], "no fallback after a child accepted work and its outcome is unknown"
    assert [p for _, p in runs(fixture_log)] == ["mode:work-then-reset"]
    limited = await delegator.delegate("worker", "mode:rate-limit")
    assert (limited.status, limited.result.content) == ("ok", "fallback ran")
    delegator.close()


async def test_fifty_callers_at_expiry_send_exactly_one_probe_upstream(tmp_path: Path) -> None:
    upstream = ScriptedUpstream([{"fault": {"first_byte_delay_s": 0.5}}, {"text": "probe ok"}])
    roles = {"worker": {"adapter": "scripted"}}
    delegator = make_delegator(routing_config(roles, max_parallel=64), tmp_path / "state", upstream)
    delegator.health.settle_sync("scripted:scripted", time.time() - 10, _capacity(1))
    results: list[Delegation] = []

    async def caller() -> None:
        results.append(await delegator.delegate("worker", "probe?"))

    async with trio.open_nursery() as nursery:
        for _ in range(50):
            nursery.start_soon(caller)
    assert len(upstream.requests) == 1
    probes = [r for r in results if r.evidence.get("health_probe")]
    assert len(probes) == 1 and probes[0].result.content == "probe ok"
    assert probes[0].evidence["health_state"] == "half_open"
    refused = [r for r in results if r.status == "refused"]
    assert len(refused) == 49 and all("scripted:scripted (half_open" in r.result.as_text() for r in refused)
    assert delegator.health.get("scripted:scripted").state == "healthy"
    delegator.close()


# ---- retries and dead letters ------------------------------------------------------------------------------

SCRIPTED = {"worker": {"adapter": "scripted"}}
LIMITED = {"fault": {"status": 429, "retry_after": "1", "message": "rate limit exceeded"}}


def outcomes(result: Delegation) -> list[tuple[int, str, str, str | None]]:
    """Each attempt of a hand-off: (its number, pool, outcome, error category)."""
    return [(a["attempt"], a["capacity_scope"], a["outcome"], a.get("error_category"))
            for a in result.evidence["attempts"]]


async def test_a_child_failing_429_then_answering_is_retried_after_its_retry_after(tmp_path: Path) -> None:
    upstream = ScriptedUpstream([LIMITED, {"text": "reviewed"}])
    delegator = make_delegator(routing_config(SCRIPTED), tmp_path / "state", upstream)
    started = trio.current_time()
    result = await delegator.delegate("worker", "review it", traceparent=PARENT)
    waited = trio.current_time() - started
    assert (result.status, result.result.content, result.dead_letter) == ("ok", "reviewed", None)
    assert len(upstream.requests) == 2 and 1.0 <= waited < 3, "Retry-After (1 s) is the floor of the 0.05 s backoff"
    assert outcomes(result) == [(1, "scripted:scripted", "failed", "capacity"),
                                (2, "scripted:scripted", "answered", None)]
    first, second = result.evidence["attempts"]
    assert (first["health_state"], first["retry_after_s"]) == ("healthy", 1)
    # The 429 cooled the pool for its Retry-After; the retry waited it out and was the pool's half-open probe.
    assert (second["health_state"], second["health_probe"]) == ("half_open", True)
    assert delegator.health.get("scripted:scripted").state == "healthy"
    assert delegator.dead_letters.all() == []
    delegator.close()


@pytest.mark.parametrize("retry_after, cools_s", [("1e400", None), ("99999999999", RETRY_AFTER_CAP_S)])
async def test_a_childs_429_with_a_retry_after_the_upstream_controls_is_a_capacity_failure(
        tmp_path: Path, retry_after: str, cools_s: int | None) -> None:
    """Never "unavailable: adapter scripted raised OverflowError": a wait that is no number is ignored, one past a
    day counts as a day."""
    upstream = ScriptedUpstream([{"fault": {"status": 429, "retry_after": retry_after}}])
    delegator = make_delegator(routing_config(SCRIPTED), tmp_path / "state", upstream)
    with trio.fail_after(30):
        result = await delegator.delegate("worker", "review it", traceparent=PARENT)
    assert outcomes(result)[0] == (1, "scripted:scripted", "failed", "capacity")
    assert result.evidence["attempts"][0].get("retry_after_s") == cools_s
    delegator.close()


async def test_a_child_process_refused_its_connection_is_run_again(tmp_path: Path, fixture_log: Path) -> None:
    result = await delegate(tmp_path, "mode:refused fails=1")
    assert result.status == "ok" and result.result.content.startswith("mode:refused fails=1 | model=fixture-big")
    assert [p for _, p in runs(fixture_log)] == ["mode:refused fails=1"] * 2
    assert outcomes(result) == [(1, "fixture-cli:big", "failed", "unavailable"),
                                (2, "fixture-cli:big", "answered", None)]
    assert result.evidence["error_category"] is None, "the evidence's head is the attempt that answered"


async def test_a_hand_off_failing_past_the_bound_is_a_dead_letter_the_error_names(tmp_path: Path,
                                                                                  fixture_log: Path) -> None:
    delegator = make_delegator(routing_config(WORKER), tmp_path / "state")
    result = await delegator.delegate("worker", "mode:refused", traceparent=PARENT)
    assert [p for _, p in runs(fixture_log)] == ["mode:refused"] * 3, "attempts = 3 by default"
    assert result.status == "failed" and result.result.is_error
    text = result.result.as_text()
    letter = result.dead_letter
    assert letter and letter.startswith("dl_") and result.evidence["dead_letter"] == letter
    assert text.startswith("Tool 'worker' failed: unavailable: ") and "ECONNREFUSED" in text
    assert f"gave up: 3 attempts failed; dead letter {letter}" in text and "--dead-letters" in text
    assert [a["outcome"] for a in result.evidence["attempts"]] == ["failed"] * 3
    (stored,) = delegator.dead_letters.all()
    assert {k: stored[k] for k in ("id", "role", "prompt", "reason", "trace_id")} == {
        "id": letter, "role": "worker", "prompt": "mode:refused", "reason": "3 attempts failed",
        "trace_id": PARENT.split("-")[1]}
    assert stored["route"]["capacity_scope"] == "fixture-cli:big" and len(stored["attempts"]) == 3
    assert stored["failure"]["category"] == "unavailable" and "ECONNREFUSED" in stored["failure"]["message"]
    modes = {p: oct(p.stat().st_mode & 0o777) for p in files_under(tmp_path / "state" / "dead_letters")}
    assert modes and all(m == ("0o700" if p.is_dir() else "0o600") for p, m in modes.items()), modes
    delegator.close()


async def test_dead_letters_are_bounded_the_oldest_go_first(tmp_path: Path) -> None:
    upstream = ScriptedUpstream([{"fault": {"status": 503}}] * 3)
    clocks = msgspec.structs.replace(ONCE, dead_letters_kept=2)
    delegator = make_delegator(routing_config(SCRIPTED), tmp_path / "state", upstream, clocks)
    letters = [(await delegator.delegate("worker", f"task {i}")).dead_letter for i in range(3)]
    assert all(letters) and [d["id"] for d in delegator.dead_letters.all()] == letters[1:]
    delegator.close()


async def test_a_dead_letter_keeps_its_prompt_with_secrets_redacted(tmp_path: Path) -> None:
    key = "sk-proj-" + "abcdEFGH0123" * 4
    upstream = ScriptedUpstream([{"fault": {"status": 503}}])
    delegator = make_delegator(routing_config(SCRIPTED), tmp_path / "state", upstream, ONCE)
    result = await delegator.delegate("worker", f"Review app.py with key {key} and postgres://admin:Pa55word@db/x")
    (stored,) = delegator.dead_letters.all()
    assert result.dead_letter == stored["id"]
    assert stored["prompt"] == "Review app.py with key [redacted] and postgres://admin:[redacted]@db/x"
    assert key not in repr(stored) and key not in result.result.as_text()
    assert all(key.encode() not in p.read_bytes() and b"Pa55word" not in p.read_bytes()
               for p in files_under(tmp_path / "state" / "dead_letters") if p.is_file())
    delegator.close()


async def test_a_child_that_failed_after_producing_output_is_never_run_again(tmp_path: Path,
                                                                             fixture_log: Path) -> None:
    result = await delegate(tmp_path, "mode:text-then-refused")
    assert [p for _, p in runs(fixture_log)] == ["mode:text-then-refused"]
    assert result.status == "failed" and result.dead_letter is None
    assert "ECONNREFUSED" in result.result.as_text() and "gave up" not in result.result.as_text()
    assert outcomes(result) == [(1, "fixture-cli:big", "failed", "unavailable")]


async def test_a_stream_reset_after_output_is_not_retried(tmp_path: Path) -> None:
    upstream = ScriptedUpstream([{"text": "a long review of app.py", "fault": {"reset_after_events": 2}},
                                 {"text": "must not run"}])
    delegator = make_delegator(routing_config(SCRIPTED), tmp_path / "state", upstream)
    result = await delegator.delegate("worker", "review it")
    assert len(upstream.requests) == 1 and result.status == "failed" and result.dead_letter is None
    assert "connection reset" in result.result.as_text()
    delegator.close()


@pytest.mark.parametrize("fault, category", [
    ({"status": 400, "message": "invalid request"}, "invalid"),
    ({"status": 401, "message": "invalid api key"}, "auth"),
    ({"status": 429, "message": "You exceeded your current quota, please check your plan and billing details."},
     "capacity"),
])
async def test_a_non_transient_failure_is_not_retried(fault: dict[str, Any], category: str, tmp_path: Path) -> None:
    upstream = ScriptedUpstream([{"fault": fault}, {"text": "must not run"}])
    delegator = make_delegator(routing_config(SCRIPTED), tmp_path / "state", upstream)
    result = await delegator.delegate("worker", "review it")
    assert len(upstream.requests) == 1 and result.status == "failed" and result.dead_letter is None
    assert outcomes(result) == [(1, "scripted:scripted", "failed", category)]
    # A quota is capacity, but no wait ends it: it cools nothing either.
    assert delegator.health.get("scripted:scripted").state == "healthy"
    assert delegator.dead_letters.all() == []
    delegator.close()


async def test_retries_stay_inside_the_wall_clock(tmp_path: Path) -> None:
    """Wall clock 1 s, backoff 0.4 s: the second attempt starts at 0.4 s, the third could only start at 1.2 s."""
    upstream = ScriptedUpstream([{"fault": {"status": 529}}] * 2)  # a third attempt would get an answer
    clocks = msgspec.structs.replace(FAST, wall_clock_s=1.0, retry_backoff_s=0.4)
    delegator = make_delegator(routing_config(SCRIPTED), tmp_path / "state", upstream, clocks)
    started = trio.current_time()
    result = await delegator.delegate("worker", "review it")
    assert trio.current_time() - started < 1.0 and len(upstream.requests) == 2
    assert result.dead_letter and "2 attempts failed and the next could only start" in result.result.as_text()
    assert "past the wall clock" in delegator.dead_letters.all()[0]["reason"]
    # A Retry-After beyond the wall clock is not waited for at all.
    upstream.queue({"fault": {"status": 429, "retry_after": "5"}})
    started = trio.current_time()
    result = await delegator.delegate("worker", "again")
    assert trio.current_time() - started < 0.5 and len(upstream.requests) == 3
    assert [a["outcome"] for a in result.evidence["attempts"]] == ["failed"] and result.dead_letter
    delegator.close()


async def test_a_retry_skips_a_cooling_pool_for_the_fallback_instead_of_hammering_it(tmp_path: Path,
                                                                                    fixture_log: Path) -> None:
    """The fixture CLI's pools answer 429 (Retry-After 7 s, so they cool for 7 s); the scripted fallback a 529,
    which cools nothing: the retry goes to the fallback at once and skips the cooling pools."""
    upstream = ScriptedUpstream([{"fault": {"status": 529}}, {"text": "answered by the fallback"}])
    roles = {**WORKER, "helper": {"adapter": "scripted"}}
    delegator = make_delegator(routing_config(roles, fallback_policy="next_eligible"), tmp_path / "state", upstream)
    started = trio.current_time()
    result = await delegator.delegate("worker", "mode:rate-limit")
    assert (result.status, result.result.content) == ("ok", "answered by the fallback")
    assert trio.current_time() - started < 5, "the 7 s cooldown was not waited for"
    assert [p for _, p in runs(fixture_log)] == ["mode:rate-limit"] * 2, "one run per fixture pool, no more"
    assert outcomes(result) == [
        (1, "fixture-cli:big", "failed", "capacity"), (1, "fixture-cli:fast", "failed", "capacity"),
        (1, "scripted:scripted", "failed", "provider"), (2, "fixture-cli:big", "refused", None),
        (2, "fixture-cli:fast", "refused", None), (2, "scripted:scripted", "answered", None)]
    delegator.close()


async def test_a_retry_waits_for_its_cooling_pool_when_no_fallback_is_left(tmp_path: Path) -> None:
    upstream = ScriptedUpstream([{"fault": {"status": 429, "retry_after": "2"}}, {"text": "after the wait"}])
    delegator = make_delegator(routing_config(SCRIPTED), tmp_path / "state", upstream)
    started = trio.current_time()
    result = await delegator.delegate("worker", "review it")
    assert result.result.content == "after the wait" and trio.current_time() - started >= 2.0
    assert len(upstream.requests) == 2, "nothing was sent while the pool cooled"
    delegator.close()


def test_next_start_backs_off_waits_for_the_soonest_pool_and_keeps_to_the_deadline() -> None:
    policy = RetryPolicy(attempts=4, backoff_s=1.0)
    assert [policy.backoff(n) for n in (1, 2, 3)] == [1.0, 2.0, 4.0]
    assert next_start(policy, 1, 100.0, 200.0, [100.0]).at == 101.0
    assert next_start(policy, 2, 100.0, 200.0, [90.0, 150.0]).at == 102.0, "a ready fallback: the backoff only"
    assert next_start(policy, 2, 100.0, 200.0, [130.0, 150.0]).at == 130.0, "the soonest pool, not the first"
    late = next_start(policy, 1, 100.0, 120.0, [125.0])
    assert late.at is None and "past the wall clock" in late.reason
    assert next_start(policy, 4, 100.0, 200.0, [100.0]) == NextStart(None, "4 attempts failed")
    assert next_start(RetryPolicy(attempts=1), 1, 0.0, 10.0, [0.0]).reason == "1 attempt failed (no retry configured)"
    assert next_start(policy, 1, 100.0, 200.0, []).at is None


# ---- policy gates ----------------------------------------------------------------------------------------


async def test_suggest_returns_the_route_without_running_anything(tmp_path: Path, fixture_log: Path) -> None:
    result = await delegate(tmp_path, "mode:echo hi", mode="suggest")
    assert result.status == "skipped"
    route = result.proposed_route
    assert (route["adapter"], route["capacity_scope"]) == ("fixture-cli", "fixture-cli:big")
    assert route["sources"]["model"] == "role policy"
    assert runs(fixture_log) == [] and files_under(tmp_path / "state") == []


async def test_adaptive_mode_leaves_cheap_work_unsupervised(tmp_path: Path, fixture_log: Path) -> None:
    config = routing_config(WORKER, mode="adaptive", complexity_threshold="COMPLEX")
    delegator = make_delegator(config, tmp_path / "state")
    for complexity in (None, "CLEAR", "COMPLICATED"):
        assert (await delegator.delegate("worker", "mode:echo x", complexity=complexity)).status == "unsupervised"
    assert runs(fixture_log) == [] and files_under(tmp_path / "state") == []
    assert (await delegator.delegate("worker", "mode:echo y", complexity="CHAOTIC")).status == "ok"
    delegator.close()


async def test_disabled_is_free_no_child_no_probe_no_state_write(tmp_path: Path, fixture_log: Path) -> None:
    config = routing_config(WORKER, enabled=False)
    delegator = make_delegator(config, tmp_path / "state")
    result = await delegator.delegate("worker", "mode:echo x")
    assert result.status == "unsupervised" and result.evidence == {}
    assert runs(fixture_log) == [] and files_under(tmp_path / "state") == []


async def test_delegation_follows_the_supervision_graph(tmp_path: Path, fixture_log: Path) -> None:
    roles = {"lead": {"adapter": "fixture-cli", "supervises": ["worker"]}, **WORKER}
    delegator = make_delegator(routing_config(roles), tmp_path / "state")
    direct = await delegator.delegate("worker", "mode:echo x")
    assert direct.status == "invalid" and "may not delegate to 'worker'" in direct.result.as_text()
    assert (await delegator.delegate("worker", "mode:echo y", caller="lead")).status == "ok"
    assert (await delegator.delegate("lead", "mode:echo z")).status == "ok"
    unknown = await delegator.delegate("ghost", "mode:echo")
    assert unknown.status == "invalid" and "not configured" in unknown.result.as_text()
    assert [p for _, p in runs(fixture_log)] == ["mode:echo y", "mode:echo z"]
    delegator.close()


async def test_an_unsatisfiable_route_or_capability_is_invalid_not_downgraded(tmp_path: Path,
                                                                               fixture_log: Path) -> None:
    delegator = make_delegator(routing_config(WORKER), tmp_path / "state")
    effort = await delegator.delegate("worker", "x", override=RouteTarget(effort="ludicrous"))
    assert effort.status == "invalid" and "does not accept effort 'ludicrous'" in effort.result.as_text()
    schema = await delegator.delegate("worker", "x", output_schema={"type": "object"})
    assert schema.status == "invalid" and "does not declare structured_output" in schema.result.as_text()
    assert runs(fixture_log) == []
    delegator.close()


async def test_an_adapter_that_raises_is_a_crash_that_still_releases_the_probe(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    class Broken:
        descriptor = registry_for("").get("scripted")

        def readiness(self) -> None:
            return None

        async def run(self, job: Any, progress: Any) -> None:
            raise TypeError("adapter bug")

    config = routing_config({"worker": {"adapter": "scripted"}})
    delegator = make_delegator(config, tmp_path / "state")
    delegator._runtimes["scripted"] = Broken()
    delegator.health.settle_sync("scripted:scripted", time.time() - 100, _capacity(1))
    with caplog.at_level(logging.WARNING):
        result = await delegator.delegate("worker", "x")
    assert result.status == "failed" and result.evidence["error_category"] == "unavailable"
    assert result.evidence["health_probe"] is True
    assert "adapter scripted raised TypeError" in caplog.text
    health = delegator.health.get("scripted:scripted")
    assert (health.state, health.lease_id, health.failure_count) == ("healthy", "", 1)
    delegator.close()
