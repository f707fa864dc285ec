"""The pool breaker: the sans-IO state machine, failure normalisation rules it relies on, and its persistence."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import threading
import time
from datetime import datetime, timedelta, timezone
from email.utils import format_datetime
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxyvisor.adapters.state import DiskKV
from proxyvisor.adapters.failures import (RETRY_AFTER_CAP_S, Failure, from_http, from_text, retry_after_header,
                                          retry_after_in_text)
from proxyvisor.adapters.health import (COOLING_DOWN, HALF_OPEN, HEALTHY, STATES, TRANSITIONS, Cooldown,
                                        PoolHealth, adapter_summary, admit, fleet_wait, release, settle)
from proxyvisor.adapters.health_store import HealthStore

T0 = 1_800_000_000.0
COOL = Cooldown(default_s=10, maximum_s=50)
CAPACITY = Failure("capacity", True, "known_failed")
OTHER = Failure("provider", True, "known_failed")


def capacity(retry_after_s: int | None = None) -> Failure:
    return Failure("capacity", True, "known_failed", retry_after_s)


def tripped(now: float = T0, retry_after_s: int | None = None) -> PoolHealth:
    return settle(PoolHealth("a:pool"), now, capacity(retry_after_s), COOL)


def probe(health: PoolHealth, now: float, lease_s: float = 30) -> tuple[str, PoolHealth]:
    admission, health = admit(health, now, lease_s)
    assert admission.admitted and admission.probe, admission
    return admission.lease_id, health


@pytest.mark.parametrize("failure, opens", [
    (capacity(), True),
    (Failure("capacity", False, "known_failed"), False),  # an account quota that needs billing action
    (from_http(529, "Overloaded", T0), False),
    (from_http(500, "boom", T0), False),
    (from_http(503, "unavailable", T0, retry_after="5"), False),
    (from_http(401, "bad key", T0), False),
    (Failure("timeout", True, "unknown"), False),
    (Failure("invalid", False, "known_failed"), False),
    (Failure("unavailable", True, "unknown"), False),
])
def test_only_a_retryable_capacity_failure_opens_the_breaker(failure: Failure, opens: bool) -> None:
    health = settle(PoolHealth("a:pool"), T0, failure, COOL)
    assert health.state == (COOLING_DOWN if opens else HEALTHY)
    assert health.last_category == failure.category


@pytest.mark.parametrize("status", [500, 502, 503, 529])
def test_overload_and_server_errors_are_provider_and_retryable_never_capacity(status: int) -> None:
    for failure in (from_http(status, "rate limit? no: overloaded", T0),
                    from_text(f"API Error: {status} Overloaded", T0)):
        assert (failure.category, failure.retryable, failure.opens_breaker) == ("provider", True, False)


def test_retry_after_wins_otherwise_exponential_from_the_default_capped_at_the_maximum() -> None:
    health, now, cooldowns = PoolHealth("a:pool"), T0, []
    for _ in range(5):
        health = settle(health, now, CAPACITY, COOL) if health.state == HEALTHY else health
        cooldowns.append(health.cooldown_until - now)
        now = health.cooldown_until
        lease, health = probe(health, now)
        health = settle(health, now, CAPACITY, COOL, lease)
        cooldowns.append(health.cooldown_until - now)
        now = health.cooldown_until
        lease, health = probe(health, now)
        health = settle(health, now, None, COOL, lease)
    assert cooldowns[:4] == [10, 20, 10, 20]  # a successful probe resets the escalation
    escalating = PoolHealth("a:pool")
    seen = []
    for _ in range(5):
        escalating = settle(escalating, now, CAPACITY, COOL, escalating.lease_id)
        seen.append(escalating.cooldown_until - now)
        now = escalating.cooldown_until
        _, escalating = probe(escalating, now)
    assert seen == [10, 20, 40, 50, 50]
    assert tripped(retry_after_s=3).cooldown_until == T0 + 3  # below the default: the provider knows best
    assert tripped(retry_after_s=7200).cooldown_until == T0 + 7200  # above the maximum: still wins


def test_a_new_capacity_failure_extends_the_cooldown_and_never_shortens_it() -> None:
    health = tripped(retry_after_s=100)
    shorter = settle(health, T0 + 10, capacity(5), COOL)
    assert shorter.cooldown_until == T0 + 100
    longer = settle(shorter, T0 + 10, capacity(200), COOL)
    assert longer.cooldown_until == T0 + 210
    burst = settle(longer, T0 + 11, CAPACITY, COOL)
    assert burst.failure_count == 1, "failures of one burst are one trip"


def test_exactly_one_caller_gets_the_probe_lease_for_the_probes_own_timeout() -> None:
    health = tripped()
    refused, same = admit(health, T0 + 9.9, 30)
    assert (refused.admitted, refused.state, refused.recovery_at, same) == (False, COOLING_DOWN, T0 + 10, health)
    first, health = admit(health, T0 + 10, lease_s=45)
    assert (first.admitted, first.probe, first.state, health.state) == (True, True, HALF_OPEN, HALF_OPEN)
    second, _ = admit(health, T0 + 54, 45)
    assert (second.admitted, second.recovery_at) == (False, T0 + 55)
    assert "probe is in flight" in second.reason
    third, taken_over = admit(health, T0 + 55, 45)  # the first probe never settled within its own timeout
    assert third.probe and third.lease_id != first.lease_id
    assert settle(taken_over, T0 + 56, None, COOL, first.lease_id) == taken_over, "a stale probe changes nothing"


def test_a_probe_success_returns_to_healthy_and_resets_the_failure_count() -> None:
    lease, health = probe(tripped(), T0 + 10)
    health = settle(health, T0 + 11, None, COOL, lease)
    assert (health.state, health.failure_count, health.lease_id) == (HEALTHY, 0, "")


@pytest.mark.parametrize("failure", [OTHER, Failure("auth", False, "known_failed"),
                                     Failure("unavailable", False, "unknown", None, "adapter raised TypeError")],
                         ids=["provider", "auth", "crash"])
def test_a_probe_failing_for_another_reason_releases_its_lease_at_once_and_keeps_the_count(failure: Failure) -> None:
    health = tripped()
    lease, health = probe(health, T0 + 10, lease_s=600)
    health = settle(health, T0 + 11, failure, COOL, lease)
    assert (health.state, health.failure_count, health.lease_id) == (HEALTHY, 1, "")
    assert admit(health, T0 + 11, 600)[0].admitted, "no caller waits for the rest of the lease"
    again = settle(health, T0 + 12, CAPACITY, COOL)
    assert again.cooldown_until == T0 + 12 + 20, "the backoff kept escalating"


def test_a_cancel_records_nothing_but_gives_a_held_probe_lease_back() -> None:
    healthy = PoolHealth("a:pool")
    assert release(healthy, T0, "") == healthy, "a cancel is no failure of a healthy pool"
    lease, health = probe(tripped(), T0 + 10, lease_s=600)
    released = release(health, T0 + 11, lease)
    assert (released.state, released.lease_id, released.failure_count) == (HALF_OPEN, "", 1)
    assert released.last_category == health.last_category, "nothing of the cancel is noted"
    assert admit(released, T0 + 11, 600)[0].probe, "the next caller probes at once"
    assert release(health, T0 + 11, "another") == health, "only the holder releases the lease"


def test_a_probe_hitting_the_limit_again_cools_down_longer() -> None:
    lease, health = probe(tripped(), T0 + 10)
    health = settle(health, T0 + 11, CAPACITY, COOL, lease)
    assert (health.state, health.failure_count, health.cooldown_until) == (COOLING_DOWN, 2, T0 + 31)


def test_results_of_calls_admitted_before_the_trip_change_nothing() -> None:
    health = tripped()
    assert settle(health, T0 + 1, None, COOL) == health
    assert settle(health, T0 + 1, OTHER, COOL).state == COOLING_DOWN


OPERATIONS = st.lists(st.tuples(st.sampled_from(["admit", "ok", "capacity", "other", "late-ok", "cancel"]),
                                st.floats(min_value=0, max_value=40), st.integers(min_value=1, max_value=30)),
                      max_size=40)


@settings(max_examples=200, deadline=None)
@given(OPERATIONS)
def test_every_state_change_is_an_entry_of_the_transition_table(operations: list) -> None:
    allowed = {(state, nxt) for (state, _), nxt in TRANSITIONS.items()} | {(s, s) for s in STATES}
    health, now, lease = PoolHealth("a:pool"), T0, ""
    for op, step, retry in operations:
        now += step
        before = health
        if op == "admit":
            admission, health = admit(health, now, 10)
            lease = admission.lease_id or lease
        elif op == "cancel":
            health = release(health, now, lease)
        else:
            failure = {"ok": None, "late-ok": None, "capacity": capacity(retry), "other": OTHER}[op]
            health = settle(health, now, failure, COOL, "" if op == "late-ok" else lease)
        assert (before.state, health.state) in allowed
        assert health.cooldown_until >= before.cooldown_until, "a cooldown is never shortened"
        assert health.state in STATES


def test_when_every_pool_refuses_the_caller_learns_the_soonest_recovery_and_who_waits() -> None:
    refusals = [admit(settle(PoolHealth(p), T0, capacity(s), COOL), T0 + 1, 10)[0]
                for p, s in (("x:a", 50), ("y", 20), ("x:b", 90))]
    wait = fleet_wait(refusals)
    assert (wait.soonest_at, wait.soonest_pool) == (T0 + 20, "y")
    assert [w[0] for w in wait.waiting] == ["y", "x:a", "x:b"]
    message = wait.message(T0 + 1)
    assert "soonest recovery in 19 s (y)" in message and "x:a" in message and "x:b" in message


def test_an_adapter_summary_is_its_most_restrictive_pool() -> None:
    pools = [PoolHealth("x:a"), tripped(retry_after_s=30), dataclasses.replace(tripped(), pool="x:c")]
    state, soonest, limited = adapter_summary(pools, T0 + 1)
    assert (state, soonest, limited) == (COOLING_DOWN, T0 + 10, ["a:pool", "x:c"])


# ---- the provider's wait, as the upstream wrote it ------------------------------------------------------------

HTTP_DATE = "Wed, 21 Oct 2015 07:28:00 GMT"
AT_HTTP_DATE = 1445412480.0


@pytest.mark.parametrize("retry_after, retry_after_ms, seconds", [
    ("3", None, 3), (" 2.5 ", None, 3), ("0.001", None, 1), ("0", None, None),
    (HTTP_DATE, None, None),  # a date in the past: no wait
    ("Wed, 21 Oct 2015 07:28:10 GMT", None, 10), ("Wed, 21 Oct 2015 07:28:10 -0000", None, 10),
    # Not a wait: ignored, so the pool cools its own cooldown.
    ("1e400", None, None), ("1e3", None, None), ("inf", None, None), ("-inf", None, None), ("nan", None, None),
    ("-5", None, None), ("+5", None, None), ("0x10", None, None), ("1_000", None, None), ("\u0663", None, None),
    ("soon", None, None), ("", None, None),
    # Longer than a day: a day.
    ("99999999999", None, RETRY_AFTER_CAP_S), ("9" * 400, None, RETRY_AFTER_CAP_S),
    ("Fri, 31 Dec 9999 23:59:59 GMT", None, RETRY_AFTER_CAP_S),
    # retry-after-ms when Retry-After holds no wait.
    (None, "1500", 2), ("soon", "1500", 2), ("1e400", "2000", 2), ("4", "1500", 4), (None, "1e400", None),
    (None, "-1", None), (None, "9" * 400, RETRY_AFTER_CAP_S),
])
def test_a_retry_after_is_a_wait_of_one_second_to_a_day_or_none(retry_after: str | None, retry_after_ms: str | None,
                                                                 seconds: int | None) -> None:
    assert retry_after_header(retry_after, AT_HTTP_DATE, retry_after_ms) == seconds
    assert from_http(429, "slow down", AT_HTTP_DATE, retry_after, retry_after_ms).retry_after_s == seconds


def test_a_wait_in_a_message_is_cut_to_a_day_too() -> None:
    assert retry_after_in_text("try again in 99999999999 hours", T0) == RETRY_AFTER_CAP_S
    assert retry_after_in_text("retry after " + "9" * 400 + " seconds", T0) == RETRY_AFTER_CAP_S
    assert retry_after_in_text("usage limit reached|9999999999", T0) == RETRY_AFTER_CAP_S


_DATES = st.builds(lambda when, minutes: format_datetime(when.replace(tzinfo=timezone(timedelta(minutes=minutes)))),
                   st.datetimes(min_value=datetime(1, 1, 2), max_value=datetime(9999, 12, 30)),
                   st.integers(-1439, 1439))
_NUMBERS = st.from_regex(r"\A\s?[-+]?[0-9]{0,400}(\.[0-9]{0,30})?(e[-+]?[0-9]{1,4})?\s?\Z")
HEADER_VALUES = st.one_of(st.none(), st.text(), _NUMBERS, _DATES,
                          st.sampled_from(["inf", "-inf", "nan", "Infinity", "1e400", "-0", "0.0"]))


@settings(max_examples=400, deadline=None)
@given(HEADER_VALUES, HEADER_VALUES, st.floats(min_value=-1e12, max_value=1e12))
def test_any_retry_after_header_is_none_or_a_wait_within_the_cap_and_never_raises(
        retry_after: str | None, retry_after_ms: str | None, now: float) -> None:
    """Whatever the upstream writes (the headers are the upstream's to choose), the wait is None or a whole number
    of seconds from 1 to the cap: never an exception, an infinite or a negative wait."""
    for wait in (retry_after_header(retry_after, now, retry_after_ms),
                 from_http(429, retry_after or "", now, retry_after, retry_after_ms).retry_after_s,
                 retry_after_in_text(retry_after or "", now)):
        assert wait is None or (isinstance(wait, int) and 1 <= wait <= RETRY_AFTER_CAP_S)


# ---- persistence ----------------------------------------------------------------------------------------


def test_the_store_persists_settles_and_clears_by_pool_or_adapter(tmp_path: Path) -> None:
    store = HealthStore(DiskKV(tmp_path / "health"), COOL)
    assert store.all() == [] and not store.kv.exists(), "reading creates nothing"
    for pool in ("cc:opus", "cc:haiku", "codex"):
        store.settle_sync(pool, T0, capacity(60))
    assert oct((tmp_path / "health").stat().st_mode & 0o777) == "0o700"
    assert all(oct(f.stat().st_mode & 0o777) == "0o600" for f in (tmp_path / "health").iterdir() if f.is_file())
    store.close()
    reopened = HealthStore(DiskKV(tmp_path / "health"), COOL)
    assert [p.pool for p in reopened.all()] == ["cc:haiku", "cc:opus", "codex"]
    assert reopened.get("cc:opus").cooldown_until == T0 + 60
    assert reopened.clear("cc") == ["cc:haiku", "cc:opus"]
    assert reopened.clear("codex") == ["codex"] and reopened.all() == []


def test_fifty_threads_at_expiry_get_exactly_one_probe_lease(tmp_path: Path) -> None:
    store = HealthStore(DiskKV(tmp_path / "health"), COOL)
    store.settle_sync("p", T0, capacity(5))
    start = threading.Barrier(50)
    admissions = []

    def caller() -> None:
        start.wait()
        admissions.append(store.admit_sync("p", T0 + 5, 30))

    threads = [threading.Thread(target=caller) for _ in range(50)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(admissions) == 50
    assert sum(a.admitted for a in admissions) == 1
    assert sum(a.probe for a in admissions) == 1


def test_a_cooldown_survives_a_process_restart_with_its_deadline(tmp_path: Path) -> None:
    state = tmp_path / "state"
    now = time.time()
    store = HealthStore(DiskKV(state / "health"), COOL)
    store.settle_sync("claude-code:opus-4x", now, capacity(900))
    store.close()
    env = {**os.environ, "PROXYVISOR_STATE_DIR": str(state)}
    shown = subprocess.run([sys.executable, "-m", "proxyvisor", "health", "show", "--json"], env=env,
                           capture_output=True, text=True, timeout=60, check=True)
    pools = json.loads(shown.stdout)["pools"]
    assert [(p["pool"], p["state"], p["recovery_at"]) for p in pools] == [
        ("claude-code:opus-4x", "cooling_down", now + 900)]
    assert json.loads(shown.stdout)["adapters"]["claude-code"]["limited_pools"] == ["claude-code:opus-4x"]
    cleared = subprocess.run([sys.executable, "-m", "proxyvisor", "health", "clear", "claude-code"], env=env,
                             capture_output=True, text=True, timeout=60, check=True)
    assert "cleared 1 pool(s): claude-code:opus-4x" in cleared.stdout
    assert HealthStore(DiskKV(state / "health"), COOL).all() == []
