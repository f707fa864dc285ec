"""Per-pool breakers for the agent's own requests, and fallbacks (``proxyvisor.proxy.breakers``).

The proxy tests set the breakers' wall clock (``pipeline.breakers.now``) to a :class:`Clock` they move by hand,
so a Retry-After of 3 s is tested without waiting; one test waits a real second.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio

from proxyvisor.adapters.failures import RETRY_AFTER_CAP_S, Failure, from_http
from proxyvisor.adapters.litellm_bridge import import_litellm
from proxyvisor.cli import main
from proxyvisor.adapters.health import COOLING_DOWN, HALF_OPEN, HEALTHY, Cooldown, PoolHealth, admit, settle
from proxyvisor.config import Config, ConfigError, GateConfig, UpstreamConfig, parse
from proxyvisor.proxy.breakers import OPENS, failure_of_error, pool_of
from proxyvisor.proxy.info import render_text
from proxyvisor.proxy.relay import UpstreamError
from proxyvisor.proxy.service import RunningProxy, running
from proxyvisor.scripted.upstream import ScriptedUpstream

from helpers import (FORMATS, MODEL, TEXT_STEP, assert_ends_with_error_event, assert_error_shape, closed_port,
                     http_client, raw_stream, request_body)

T0 = 1_800_000_000.0
AGENT = Cooldown(1.0, 60.0, OPENS, retry_after_floor=True)
ALL_FORMATS = pytest.mark.parametrize("fmt", FORMATS)
SESSION = {"x-proxyvisor-session": "limited"}


class Clock:
    """A wall clock (Unix seconds) that moves only when told."""

    def __init__(self, now: float = T0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


# ---- the core: the agent's cooldown policy ------------------------------------------------------------------


@pytest.mark.parametrize("failure, opens", [
    (from_http(429, "slow down", T0), True),
    (from_http(529, "Overloaded", T0), True),
    (from_http(500, "boom", T0), True),
    (from_http(503, "unavailable", T0), True),
    (failure_of_error(UpstreamError(502, "upstream 'a' unreachable: connection refused"), T0), True),
    (failure_of_error(UpstreamError(504, "upstream 'a' sent no response within 600 s"), T0), True),
    (from_http(429, "insufficient_quota: check your plan and billing", T0), False),
    (from_http(401, "bad key", T0), False),
    (from_http(400, "invalid request", T0), False),
])
def test_the_agents_pools_trip_on_429_5xx_and_connection_failures_not_on_other_4xx(failure: Failure,
                                                                                      opens: bool) -> None:
    health = settle(PoolHealth("upstream:a:m"), T0, failure, AGENT)
    assert health.state == (COOLING_DOWN if opens else HEALTHY)
    # Children keep seed 000's rule: only a retryable capacity failure opens their breaker.
    assert settle(PoolHealth("x:y"), T0, failure, Cooldown()).state == (
        COOLING_DOWN if opens and failure.category == "capacity" else HEALTHY)


def test_retry_after_is_the_floor_of_an_escalating_cooldown() -> None:
    """A 429 with Retry-After 3 cools the pool 3 s; each failed probe doubles the cooldown from 1 s, never below
    the provider's wait, up to the maximum; a successful probe starts again from the first trip."""
    health, now, cooldowns = PoolHealth("upstream:a:m"), T0, []
    for retry_after in (3, 3, 3, None, None, None, None, None, None, 3):
        health = settle(health, now, Failure("capacity", True, "known_failed", retry_after), AGENT)
        cooldowns.append(health.cooldown_until - now)
        now = health.cooldown_until
        admission, health = admit(health, now, 30)
        assert admission.probe
    assert cooldowns == [3, 3, 4, 8, 16, 32, 60, 60, 60, 60]
    health = settle(health, now, None, AGENT, admission.lease_id)
    assert (health.state, health.failure_count) == (HEALTHY, 0)
    assert settle(health, now, Failure("capacity", True, "known_failed", 3), AGENT).cooldown_until == now + 3


def test_a_new_failure_while_cooling_extends_the_cooldown_and_never_shortens_it() -> None:
    health = settle(PoolHealth("upstream:a:m"), T0, Failure("capacity", True, "known_failed", 30), AGENT)
    assert settle(health, T0 + 1, Failure("capacity", True, "known_failed", 3), AGENT).cooldown_until == T0 + 30
    assert settle(health, T0 + 1, Failure("capacity", True, "known_failed", 60), AGENT).cooldown_until == T0 + 61


# ---- configuration -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("upstreams, message", [
    ({"a": {"fallback": ["nope"]}}, "[upstreams.a] fallback names 'nope', which is not another configured"),
    ({"a": {"fallback": ["a"]}}, "[upstreams.a] fallback names 'a'"),
    ({"a": {"fallback": ["b", "b"]}, "b": {}}, "[upstreams.a] fallback names an upstream twice"),
    ({"a": {"url": "https://api.example.com", "script": "steps.json"}},
     "[upstreams.a] script and chunk_delay_ms are for the scripted upstream"),
    ({"a": {"url": "https://api.example.com", "chunk_delay_ms": 5}},
     "[upstreams.a] script and chunk_delay_ms are for the scripted upstream"),
])
def test_a_fallback_must_name_another_configured_upstream_once(upstreams: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace(".", r"\.")):
        parse({"upstreams": upstreams}, "my.toml")


def test_the_breakers_cooldowns_must_be_in_order() -> None:
    with pytest.raises(ConfigError, match=r"\[supervisor\.breakers\] needs cooldown_s <= maximum_cooldown_s"):
        parse({"supervisor": {"breakers": {"cooldown_s": 10, "maximum_cooldown_s": 5}}}, "my.toml")


# ---- through the proxy -------------------------------------------------------------------------------------


@asynccontextmanager
async def proxy(tmp_path: Path, *upstreams: UpstreamConfig, clock: Clock | None = None,
                supervised: bool = True) -> AsyncIterator[RunningProxy]:
    """A proxy over scripted upstreams (one per ``upstreams``; the first named ``a`` by default) whose breakers
    read ``clock``."""
    upstreams = upstreams or (UpstreamConfig(name="a"),)
    config = Config(upstreams=upstreams).with_overrides(
        supervisor={"enabled": supervised, "gate": GateConfig(enabled=False)}, state={"dir": str(tmp_path / "state")})
    scripted = {u.name: ScriptedUpstream() for u in upstreams if u.scripted}
    async with running(config, port=0, scripted=scripted) as rp:
        if clock is not None:
            assert rp.pipeline.breakers is not None
            rp.pipeline.breakers.now = clock
        yield rp


def sent(rp: RunningProxy, name: str = "a") -> int:
    """Model requests upstream ``name`` received."""
    return len(rp.scripted[name].requests)


@ALL_FORMATS
@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
async def test_a_429_with_retry_after_3_answers_the_next_requests_with_a_429_and_no_upstream_call(
        fmt: str, stream: bool, tmp_path: Path) -> None:
    clock = Clock()
    async with proxy(tmp_path, clock=clock) as rp:
        rp.scripted["a"].queue({"fault": {"status": 429, "retry_after": "3"}})
        reply, data = await raw_stream(rp.url, fmt, request_body(fmt, stream), SESSION)
        assert (reply.status_code, reply.headers["retry-after"], sent(rp)) == (429, "3", 1)
        for elapsed, remaining in ((0.0, "3"), (1.0, "2"), (2.5, "1")):
            clock.now = T0 + elapsed
            reply, data = await raw_stream(rp.url, fmt, request_body(fmt, stream), SESSION)
            assert (reply.status_code, reply.headers["retry-after"]) == (429, remaining)
            assert "cooling down" in assert_error_shape(fmt, 429, data)["message"]
            assert sent(rp) == 1  # not one request upstream during the cooldown
        clock.now = T0 + 3
        reply, data = await raw_stream(rp.url, fmt, request_body(fmt, stream), SESSION)
        assert (reply.status_code, sent(rp)) == (200, 2)  # the probe
        reply, data = await raw_stream(rp.url, fmt, request_body(fmt, stream), SESSION)
        assert (reply.status_code, sent(rp)) == (200, 3)  # healthy again
        lines = rp.pipeline.store.read_ledger("limited")
    pool = pool_of("a", MODEL)
    assert [line["upstream"]["outcome"] for line in lines] == ["failed"] + ["refused"] * 3 + ["answered"] * 2
    assert [line["upstream"]["health_state"] for line in lines] == [
        HEALTHY, COOLING_DOWN, COOLING_DOWN, COOLING_DOWN, HALF_OPEN, HEALTHY]
    assert [line["upstream"]["health_probe"] for line in lines] == [False] * 4 + [True, False]
    assert {line["upstream"]["pool"] for line in lines} == {pool}
    assert [line["status"] for line in lines] == [429] * 4 + [200] * 2


@pytest.mark.parametrize("fault, cools_s", [
    ({"retry_after": "1e400"}, 1.0), ({"retry_after": "-5"}, 1.0), ({"retry_after_ms": "inf"}, 1.0),
    ({"retry_after": "99999999999"}, RETRY_AFTER_CAP_S), ({"retry_after_ms": "9" * 400}, RETRY_AFTER_CAP_S),
], ids=["1e400", "negative", "ms-inf", "1e11", "ms-400-digits"])
async def test_a_retry_after_the_upstream_controls_reaches_the_agent_and_cools_the_pool_a_day_at_most(
        fault: dict[str, str], cools_s: float, tmp_path: Path) -> None:
    """The upstream's 429 reaches the agent as the upstream sent it, whatever its Retry-After; a wait that is no
    number leaves the pool its own cooldown (1 s), one past a day cools it a day."""
    clock = Clock()
    async with proxy(tmp_path, clock=clock) as rp:
        rp.scripted["a"].queue({"fault": {"status": 429, **fault}})
        reply, data = await raw_stream(rp.url, "messages", request_body("messages"))
        assert reply.status_code == 429 and assert_error_shape("messages", 429, data)["message"] == "scripted 429"
        health = rp.pipeline.breakers.store.get(pool_of("a", MODEL))
        assert (health.state, health.cooldown_until) == (COOLING_DOWN, T0 + cools_s)


async def test_a_long_cooldown_names_the_command_that_resets_it_and_is_told_once_per_deadline(tmp_path: Path) -> None:
    """A wait of 10 s or more may not be the user's doing (another proxy on the state dir can have started it):
    the 429 names the reset, and ``on_long_wait`` (wrap's stderr line) hears of it once per pool and deadline."""
    clock, told = Clock(), []
    pool = pool_of("a", MODEL)
    async with proxy(tmp_path, clock=clock) as rp:
        rp.pipeline.breakers.on_long_wait = lambda name, until: told.append((name, until))
        rp.scripted["a"].queue({"fault": {"status": 429, "retry_after": "9"}}, TEXT_STEP,
                               {"fault": {"status": 429, "retry_after": "600"}})
        await raw_stream(rp.url, "chat", request_body("chat"))
        reply, data = await raw_stream(rp.url, "chat", request_body("chat"))
        assert (reply.status_code, reply.headers["retry-after"]) == (429, "9")
        assert "health clear" not in assert_error_shape("chat", 429, data)["message"] and told == []
        clock.now = T0 + 9
        assert (await raw_stream(rp.url, "chat", request_body("chat")))[0].status_code == 200  # the probe
        assert (await raw_stream(rp.url, "chat", request_body("chat")))[0].status_code == 429  # 600 s now
        for elapsed in (1, 2, 3):
            clock.now = T0 + 9 + elapsed
            reply, data = await raw_stream(rp.url, "chat", request_body("chat"))
            assert (reply.status_code, reply.headers["retry-after"]) == (429, str(600 - elapsed))
            assert assert_error_shape("chat", 429, data)["message"].endswith(
                "The pools' state is shared by every proxy using this state directory; to send now anyway, reset "
                f"`proxyvisor health clear {pool}`")
        assert told == [(pool, T0 + 9 + 600)], "once, not per request"
        assert sent(rp) == 3


@ALL_FORMATS
async def test_after_the_cooldown_exactly_one_request_is_the_probe(fmt: str, tmp_path: Path) -> None:
    """While the probe is in flight every other request is refused with Retry-After 1, and no request but the
    probe reaches the upstream."""
    clock = Clock()
    async with proxy(tmp_path, clock=clock) as rp:
        rp.scripted["a"].queue({"fault": {"status": 429, "retry_after": "3"}},
                               {"fault": {"first_byte_delay_s": 0.3}}, TEXT_STEP)
        await raw_stream(rp.url, fmt, request_body(fmt))
        clock.now = T0 + 3
        statuses: list[int] = []

        async def probe() -> None:
            statuses.append((await raw_stream(rp.url, fmt, request_body(fmt)))[0].status_code)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(probe)
            with trio.fail_after(10):
                while sent(rp) < 2:
                    await trio.sleep(0.01)
            others = [await raw_stream(rp.url, fmt, request_body(fmt)) for _ in range(3)]
        assert [(r.status_code, r.headers["retry-after"]) for r, _ in others] == [(429, "1")] * 3
        assert "recovery probe" in assert_error_shape(fmt, 429, others[0][1])["message"]
        assert (statuses, sent(rp)) == ([200], 2)
        reply, _ = await raw_stream(rp.url, fmt, request_body(fmt))
        assert (reply.status_code, sent(rp)) == (200, 3)


async def test_a_real_retry_after_of_one_second_expires(tmp_path: Path) -> None:
    async with proxy(tmp_path) as rp:
        rp.scripted["a"].queue({"fault": {"status": 429, "retry_after": "1"}})
        assert (await raw_stream(rp.url, "messages", request_body("messages")))[0].status_code == 429
        reply, _ = await raw_stream(rp.url, "messages", request_body("messages"))
        assert (reply.status_code, reply.headers["retry-after"], sent(rp)) == (429, "1", 1)
        await trio.sleep(1.2)
        reply, _ = await raw_stream(rp.url, "messages", request_body("messages"))
        assert (reply.status_code, sent(rp)) == (200, 2)


@ALL_FORMATS
async def test_connection_refused_trips_the_pool(fmt: str, tmp_path: Path) -> None:
    clock = Clock()
    async with proxy(tmp_path, UpstreamConfig(name="a", url=f"http://127.0.0.1:{closed_port()}"),
                     clock=clock) as rp:
        reply, data = await raw_stream(rp.url, fmt, request_body(fmt))
        assert reply.status_code == 502 and "unreachable" in assert_error_shape(fmt, 502, data)["message"]
        reply, data = await raw_stream(rp.url, fmt, request_body(fmt))
        assert (reply.status_code, reply.headers["retry-after"]) == (429, "1")
        health = rp.pipeline.breakers.store.get(pool_of("a", MODEL))
        assert (health.state, health.last_category) == (COOLING_DOWN, "unavailable")


@pytest.mark.parametrize("status", [500, 529])
async def test_a_5xx_trips_the_pool_for_the_short_cooldown(status: int, tmp_path: Path) -> None:
    clock = Clock()
    async with proxy(tmp_path, clock=clock) as rp:
        rp.scripted["a"].queue({"fault": {"status": status}})
        assert (await raw_stream(rp.url, "chat", request_body("chat")))[0].status_code == status
        assert (await raw_stream(rp.url, "chat", request_body("chat")))[0].status_code == 429
        clock.now = T0 + 1
        assert (await raw_stream(rp.url, "chat", request_body("chat")))[0].status_code == 200
        assert sent(rp) == 2


async def test_other_4xx_trip_nothing(tmp_path: Path) -> None:
    async with proxy(tmp_path, clock=Clock()) as rp:
        rp.scripted["a"].queue({"fault": {"status": 400}}, {"fault": {"status": 401}})
        statuses = [(await raw_stream(rp.url, "chat", request_body("chat")))[0].status_code for _ in range(3)]
        assert (statuses, sent(rp)) == ([400, 401, 200], 3)


async def test_a_probe_failing_otherwise_keeps_the_count_and_the_next_success_resets_it(tmp_path: Path) -> None:
    """A 400 answering the probe says nothing about capacity: the pool is healthy again but keeps its trip, so a
    new 429 would cool it longer; the next success (settled although the pool was admitted healthy) clears it."""
    clock = Clock()
    async with proxy(tmp_path, clock=clock) as rp:
        rp.scripted["a"].queue({"fault": {"status": 429, "retry_after": "3"}}, {"fault": {"status": 400}})
        store, pool = rp.pipeline.breakers.store, pool_of("a", MODEL)
        assert (await raw_stream(rp.url, "chat", request_body("chat")))[0].status_code == 429
        clock.now = T0 + 3
        assert (await raw_stream(rp.url, "chat", request_body("chat")))[0].status_code == 400
        assert (store.get(pool).state, store.get(pool).failure_count) == (HEALTHY, 1)
        assert (await raw_stream(rp.url, "chat", request_body("chat")))[0].status_code == 200
        assert (store.get(pool).state, store.get(pool).failure_count) == (HEALTHY, 0)


async def test_pools_are_per_model(tmp_path: Path) -> None:
    async with proxy(tmp_path, clock=Clock()) as rp:
        rp.scripted["a"].queue({"fault": {"status": 429, "retry_after": "30"}})
        assert (await raw_stream(rp.url, "chat", request_body("chat")))[0].status_code == 429
        assert (await raw_stream(rp.url, "chat", request_body("chat")))[0].status_code == 429
        other = request_body("chat", model="another-model")
        assert (await raw_stream(rp.url, "chat", other))[0].status_code == 200
        assert sent(rp) == 2


async def test_supervision_off_runs_no_breaker(tmp_path: Path) -> None:
    async with proxy(tmp_path, supervised=False) as rp:
        assert rp.pipeline.breakers is None
        rp.scripted["a"].queue({"fault": {"status": 429, "retry_after": "30"}})
        statuses = [(await raw_stream(rp.url, "chat", request_body("chat")))[0].status_code for _ in range(2)]
        assert (statuses, sent(rp)) == ([429, 200], 2)
    assert not (tmp_path / "state").exists()


async def test_the_breakers_can_be_turned_off(tmp_path: Path) -> None:
    config = Config(upstreams=(UpstreamConfig(name="a"),)).with_overrides(
        supervisor={"breakers": parse({"supervisor": {"breakers": {"enabled": False}}}).supervisor.breakers})
    async with running(config, port=0, scripted={"a": ScriptedUpstream()}) as rp:
        assert rp.pipeline.breakers is None


async def test_the_state_is_shared_by_every_proxy_on_the_state_dir(tmp_path: Path) -> None:
    clock = Clock()
    async with proxy(tmp_path, clock=clock) as first, proxy(tmp_path, clock=clock) as second:
        first.scripted["a"].queue({"fault": {"status": 429, "retry_after": "5"}})
        assert (await raw_stream(first.url, "chat", request_body("chat")))[0].status_code == 429
        reply, _ = await raw_stream(second.url, "chat", request_body("chat"))
        assert (reply.status_code, reply.headers["retry-after"], sent(second)) == (429, "5", 0)


# ---- fallbacks ---------------------------------------------------------------------------------------------


def with_fallback(*formats: str) -> tuple[UpstreamConfig, UpstreamConfig]:
    b = UpstreamConfig(name="b", formats=formats) if formats else UpstreamConfig(name="b")
    return UpstreamConfig(name="a", fallback=("b",)), b


QUOTA = {"fault": {"status": 429, "message": "You exceeded your current quota, please check your plan and billing "
                                           "details. (insufficient_quota)"}}


@ALL_FORMATS
async def test_a_quota_429_reaches_the_agent_as_the_upstream_sent_it_and_cools_nothing(fmt: str,
                                                                                      tmp_path: Path) -> None:
    """No wait ends a quota: proxyvisor's own 429 with a Retry-After would only make the agent's SDK retry."""
    async with proxy(tmp_path, clock=Clock()) as rp:
        rp.scripted["a"].queue(QUOTA, QUOTA)
        for _ in range(2):
            reply, data = await raw_stream(rp.url, fmt, request_body(fmt), SESSION)
            assert reply.status_code == 429 and "x-proxyvisor-breaker" not in reply.headers
            assert "insufficient_quota" in assert_error_shape(fmt, 429, data)["message"]
        assert sent(rp) == 2, "each request went upstream: the pool never cooled"
        assert rp.pipeline.breakers.store.get(pool_of("a", MODEL)).state == HEALTHY
        lines = rp.pipeline.store.read_ledger("limited")
    assert [(u["upstream"]["outcome"], u["upstream"]["health_state"]) for u in lines] == [("failed", HEALTHY)] * 2


async def test_a_quota_429_is_tried_on_the_fallback(tmp_path: Path) -> None:
    async with proxy(tmp_path, *with_fallback(), clock=Clock()) as rp:
        rp.scripted["a"].queue(QUOTA)
        reply, _ = await raw_stream(rp.url, "chat", request_body("chat"), SESSION)
        assert (reply.status_code, sent(rp, "a"), sent(rp, "b")) == (200, 1, 1)
        (line,) = rp.pipeline.store.read_ledger("limited")
        assert rp.pipeline.breakers.store.get(pool_of("a", MODEL)).state == HEALTHY
    assert [(t["upstream"], t["outcome"], t["error_category"]) for t in line["upstream"]["tried"]] == [
        ("a", "failed", "capacity")]
    assert (line["upstream"]["name"], line["upstream"]["outcome"]) == ("b", "answered")


@ALL_FORMATS
async def test_a_fallback_answers_while_the_primary_cools(fmt: str, tmp_path: Path) -> None:
    clock = Clock()
    async with proxy(tmp_path, *with_fallback(), clock=clock) as rp:
        rp.scripted["a"].queue({"fault": {"status": 429, "retry_after": "30"}})
        for stream in (False, True, False):
            reply, _ = await raw_stream(rp.url, fmt, request_body(fmt, stream), SESSION)
            assert reply.status_code == 200
        assert (sent(rp, "a"), sent(rp, "b")) == (1, 3)
        first, *rest = [line["upstream"] for line in rp.pipeline.store.read_ledger("limited")]
    assert (first["name"], first["outcome"]) == ("b", "answered")
    assert [(t["upstream"], t["outcome"], t.get("status"), t.get("retry_after_s")) for t in first["tried"]] == [
        ("a", "failed", 429, 30)]
    assert [[(t["upstream"], t["outcome"], t["health_state"]) for t in u["tried"]] for u in rest] == [
        [("a", "refused", COOLING_DOWN)]] * 2


async def test_every_pool_cooling_gives_the_soonest_retry_after(tmp_path: Path) -> None:
    clock = Clock()
    async with proxy(tmp_path, *with_fallback(), clock=clock) as rp:
        rp.scripted["a"].queue({"fault": {"status": 429, "retry_after": "30"}})
        rp.scripted["b"].queue({"fault": {"status": 503, "retry_after": "4"}})
        reply, data = await raw_stream(rp.url, "messages", request_body("messages"))
        assert reply.status_code == 503  # the last upstream's own failure
        reply, data = await raw_stream(rp.url, "messages", request_body("messages"))
        assert (reply.status_code, reply.headers["retry-after"]) == (429, "4")
        message = assert_error_shape("messages", 429, data)["message"]
        assert pool_of("a", MODEL) in message and pool_of("b", MODEL) in message
        assert (sent(rp, "a"), sent(rp, "b")) == (1, 1)


async def test_a_connection_failure_falls_back(tmp_path: Path) -> None:
    a = UpstreamConfig(name="a", url=f"http://127.0.0.1:{closed_port()}", fallback=("b",))
    async with proxy(tmp_path, a, UpstreamConfig(name="b"), clock=Clock()) as rp:
        for _ in range(2):
            reply, _ = await raw_stream(rp.url, "responses", request_body("responses", stream=True))
            assert reply.status_code == 200
        assert sent(rp, "b") == 2


@ALL_FORMATS
async def test_a_stream_failing_mid_way_is_not_retried(fmt: str, tmp_path: Path) -> None:
    async with proxy(tmp_path, *with_fallback(), clock=Clock()) as rp:
        rp.scripted["a"].queue({"fault": {"reset_after_events": 3}})
        with trio.fail_after(10):
            reply, data = await raw_stream(rp.url, fmt, request_body(fmt, stream=True))
        assert reply.status_code == 200
        assert_ends_with_error_event(fmt, data)
        assert (sent(rp, "a"), sent(rp, "b")) == (1, 0)


async def test_a_fallback_in_another_format_is_reached_through_translation(tmp_path: Path) -> None:
    await trio.to_thread.run_sync(import_litellm)  # seconds, once: before the client's timeout starts
    async with proxy(tmp_path, *with_fallback("chat"), clock=Clock()) as rp:
        rp.scripted["a"].queue({"fault": {"status": 529}})
        with trio.fail_after(60):
            reply, data = await raw_stream(rp.url, "messages", request_body("messages"))
        assert reply.status_code == 200 and b'"type":"message"' in data.replace(b" ", b"")
        assert (sent(rp, "a"), sent(rp, "b")) == (1, 1)
        assert rp.scripted["b"].requests[0][0] == "/v1/chat/completions"


# ---- health show and /info ----------------------------------------------------------------------------------


async def test_health_show_and_info_include_the_agents_pools(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    clock = Clock(time.time())  # health show reads the real clock
    async with proxy(tmp_path, *with_fallback(), clock=clock) as rp:
        rp.scripted["a"].queue({"fault": {"status": 429, "retry_after": "30"}})
        for _ in range(2):
            assert (await raw_stream(rp.url, "chat", request_body("chat"), SESSION))[0].status_code == 200
        async with http_client(rp.url) as client:
            info = (await client.get("/proxyvisor/sessions/limited/info")).json()
    a, b = pool_of("a", MODEL), pool_of("b", MODEL)
    assert info["breakers"] == {"pools": {a: {"answered": 0, "refused": 1, "failed": 1},
                                          b: {"answered": 2, "refused": 0, "failed": 0}}, "fallbacks": 2}
    assert f"{a}: answered 0 · refused 1 · failed 1" in render_text(info)
    monkeypatch.setenv("PROXYVISOR_STATE_DIR", str(tmp_path / "state"))
    assert main(["health", "show"]) == 0
    out = capsys.readouterr().out
    assert f"{a}: cooling_down, recovers in " in out and "last failure: capacity" in out
    assert main(["health", "show", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["adapters"]["upstream:a"]["limited_pools"] == [a]
    assert main(["health", "clear", "upstream:a"]) == 0
    assert capsys.readouterr().out == f"cleared 1 pool(s): {a}\n"
