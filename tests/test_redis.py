"""Shared state on a real Redis (``[state] backend = "redis"``, ``proxyvisor.adapters.state``): the key-value
contract (first writer wins, atomic read-modify-write across threads, every key with a time to live), one probe
lease fleet-wide, a clear startup error when Redis is unreachable and degradation (no lost answer) when it goes
away mid-run; and two ``proxyvisor serve`` replicas (real processes) on one Redis: a session's requests alternating
between them see one detector state and byte-stable notes, a pool cooling on one replica refuses on the other, and
a ``kill -9`` of one replica loses nothing the other needs; a gate turn begun on one proxy goes on, as one turn, on
another (two proxies in this process, with a scripted verifier), and a history read in steps on one proxy while the
other's state of the session is loaded counts its firings once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from types import SimpleNamespace

import orjson
import pytest
import redis
import trio

from proxyvisor.adapters.failures import Failure
from proxyvisor.adapters.health import COOLING_DOWN, Cooldown
from proxyvisor.adapters.health_store import HealthStore
from proxyvisor.adapters import state
from proxyvisor.adapters.state import REDIS_PREFIX, RedisBackend, StateUnavailable, open_backend
from proxyvisor.cli import main
from proxyvisor.config import Config, GateConfig
from proxyvisor.proxy.formats import BY_NAME, ToolSpec
from proxyvisor.proxy.server import Request
from proxyvisor.proxy.service import RunningProxy, running
from proxyvisor.scripted.upstream import ScriptedUpstream
from proxyvisor.store import Store

from helpers import http_client, request_body, serve_handler
from redis_support import free_port, redis_server
from test_recite_prefix import RECITED, Agent, Model, report, verdict
from test_reliability_crash import start_serve
from test_rewritten_history import RUNNER, paused_reading, polling

LOOP_NOTE = b'signal=\\"loop\\"'


@pytest.fixture
def redis_url(tmp_path: Path) -> Iterator[str]:
    with redis_server(tmp_path / "redis") as url:
        yield url


def test_the_key_value_contract_on_redis(redis_url: str) -> None:
    backend = RedisBackend(redis_url)
    kv = backend.kv("t")
    try:
        assert kv.get("a") is None and kv.add("a", b"1", 60) and not kv.add("a", b"2", 60) and kv.get("a") == b"1"

        def bump(value: bytes | None) -> bytes:
            return str(int(value or b"0") + 1).encode()

        def worker() -> None:
            for _ in range(50):
                kv.update("n", bump, 60)

        threads = [threading.Thread(target=worker) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert kv.get("n") == b"400", "no lost update among 8 threads"
        assert kv.update("n", lambda _v: None, 60) is None and kv.get("n") is None
        kv.set("b:1", b"x", 60)
        assert kv.keys("b:") == ["b:1"] and sorted(kv.keys()) == ["a", "b:1"]
        kv.set_many({"c": b"3"}, 60, delete=["b:1"])
        assert kv.get_many(["c", "b:1"]) == [b"3", None], "set and removed in one step"
        raw = redis.Redis.from_url(redis_url)
        keys = raw.keys("*")
        assert keys and all(k.startswith(REDIS_PREFIX.encode() + b"t:") for k in keys)
        assert all(0 < raw.pttl(k) <= 60_000 for k in keys), "every key expires"
        raw.close()
    finally:
        backend.close()


def test_one_probe_lease_across_the_fleet(redis_url: str) -> None:
    """Four replicas' worth of clients on one cooling pool whose cooldown is over: exactly one gets the probe."""
    backends = [RedisBackend(redis_url) for _ in range(4)]
    stores = [HealthStore(b.kv("health"), Cooldown()) for b in backends]
    try:
        stores[0].settle_sync("p", 1000.0, Failure("capacity", True, "known_failed", retry_after_s=5))
        assert stores[1].get("p").state == COOLING_DOWN
        probes = []

        def client(store: HealthStore) -> None:
            for _ in range(10):
                admission = store.admit_sync("p", 2000.0, 60.0)
                if admission.probe:
                    probes.append(admission)

        threads = [threading.Thread(target=client, args=(s,)) for s in stores for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert len(probes) == 1
    finally:
        for b in backends:
            b.close()


def test_every_pools_health_is_read_in_one_round_trip(redis_url: str) -> None:
    backend = RedisBackend(redis_url)
    store = HealthStore(backend.kv("health"), Cooldown())
    raw = redis.Redis.from_url(redis_url)
    try:
        for n in range(20):
            store.settle_sync(f"p{n:02d}", 1000.0, Failure("capacity", True, "known_failed", retry_after_s=5))
        assert backend.kv("health").get_many(["pool:p00", "absent"])[1] is None
        raw.config_resetstat()
        pools = store.all()
        stats = raw.info("commandstats")
        assert [p.pool for p in pools] == [f"p{n:02d}" for n in range(20)] and pools[0].state == COOLING_DOWN
        assert "cmdstat_get" not in stats and stats["cmdstat_mget"]["calls"] == 1
    finally:
        raw.close()
        backend.close()


def test_an_unreachable_redis_is_a_clear_startup_error(tmp_path: Path) -> None:
    port = free_port()
    with pytest.raises(StateUnavailable, match=f"cannot reach Redis at redis://127.0.0.1:{port}/0"):
        open_backend("redis", f"redis://:hunter2@127.0.0.1:{port}/0", tmp_path)
    config = tmp_path / "config.toml"
    config.write_text(f'[state]\nbackend = "redis"\nurl = "redis://:hunter2@127.0.0.1:{port}/0"\n')
    done = subprocess.run([sys.executable, "-m", "proxyvisor", "serve", "--config", str(config), "--port", "0"],
                          capture_output=True, timeout=60)
    assert done.returncode == 2
    assert b"cannot reach Redis at redis://127.0.0.1:" in done.stderr and b"hunter2" not in done.stderr
    assert b"Traceback" not in done.stderr


@pytest.mark.parametrize("password", ["hunter2/x", "hunter2#x", "hunter2?x"])
def test_a_password_that_breaks_the_url_is_never_echoed(tmp_path: Path, password: str) -> None:
    # A reserved character not percent-encoded ends the URL's authority inside the password: the rest is read as
    # a port, and the parser's message quotes it.
    with pytest.raises(StateUnavailable) as raised:
        open_backend("redis", f"redis://:{password}@127.0.0.1:{free_port()}/0", tmp_path)
    assert "not a Redis URL" in str(raised.value) and "hunter2" not in str(raised.value)


def test_a_hung_redis_costs_one_timeout_then_calls_fail_at_once_until_it_answers(
        redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Redis that hangs (stopped, not gone: its socket accepts and never answers) would make every call wait out
    the timeout, several per request; after one timeout every call fails at once, and one short ping a period
    finds it back."""
    monkeypatch.setattr(state, "_TIMEOUT_S", 0.5)
    monkeypatch.setattr(state, "_DOWN_S", 1.0)
    backend = RedisBackend(redis_url)
    kv = backend.kv("hung")
    kv.set("k", b"v", 60)
    pid = redis.Redis.from_url(redis_url).info()["process_id"]
    os.kill(pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        with pytest.raises(StateUnavailable):
            kv.get("k")  # waits out the timeout once
        assert time.monotonic() - started < 3
        started = time.monotonic()
        for _ in range(20):
            with pytest.raises(StateUnavailable, match="down since a call failed"):
                kv.get("k")
        assert time.monotonic() - started < 0.5
        time.sleep(1.1)
        started = time.monotonic()
        with pytest.raises(StateUnavailable):
            kv.get("k")  # the period's one ping, which times out sooner than a call
        assert time.monotonic() - started < 2
    finally:
        os.kill(pid, signal.SIGCONT)
    time.sleep(1.1)
    assert kv.get("k") == b"v"
    backend.close()


async def test_redis_going_away_mid_run_loses_no_answer(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with ExitStack() as stack:
        url = stack.enter_context(redis_server(tmp_path / "redis"))
        config = Config().with_overrides(state={"backend": "redis", "url": url})
        async with running(config, port=0, store=Store(tmp_path / "state"),
                           scripted={"scripted": ScriptedUpstream()}) as proxy:
            agent = Agent(proxy, BY_NAME["chat"], False)
            await agent.turn(agent.step("Reading. " + report()))
            raw = redis.Redis.from_url(url)
            assert raw.exists(f"{REDIS_PREFIX}sessions:prefix"), "the session's state is in Redis"
            raw.close()
            stack.close()  # Redis stops; the proxy answers on, from the state it holds
            for _ in range(2):
                await agent.turn(agent.step("Going on. " + report()))
            agent.assert_prefix_stable()
            assert agent.bodies()[-1].count(RECITED) == 1
    assert "session states: Redis at" in caplog.text and "pool health: Redis at" in caplog.text
    assert "Traceback" not in caplog.text


# ---- two replicas ------------------------------------------------------------------------------------------------

def _replica_config(path: Path, state: Path, redis_url: str, upstream_url: str) -> Path:
    path.write_text(f'[state]\ndir = "{state}"\nbackend = "redis"\nurl = "{redis_url}"\n\n'
                    f'[upstreams.scripted]\nurl = "{upstream_url}"\n\n'
                    '[supervisor.gate]\nenabled = false\n')
    return path


async def test_two_replicas_on_one_redis_serve_one_session_as_one(tmp_path: Path, redis_url: str) -> None:
    script = ScriptedUpstream()
    async with serve_handler(script) as upstream_url:
        procs, urls = [], []
        try:
            for name in ("a", "b"):
                proc, url = await trio.to_thread.run_sync(start_serve, _replica_config(
                    tmp_path / f"{name}.toml", tmp_path / f"state-{name}", redis_url, upstream_url),
                    tmp_path / f"serve-{name}.log")
                procs.append(proc)
                urls.append(url)
            assert f"shared state: Redis at {redis_url}" in (tmp_path / "serve-a.log").read_text()
            replicas = [SimpleNamespace(url=u, scripted={"scripted": script}) for u in urls]
            agent = Agent(replicas[0], BY_NAME["chat"], False)

            # Alternating replicas: the loop detector counts across both (its state is one), the note lands once
            # and stays where it was, and each upstream request extends the one before.
            await agent.list_again(tuple(replicas))
            bodies = agent.bodies()
            # What one proxy does (tests/test_steer.py): a note at the loop's first and second firing, then back-off.
            assert [b.count(LOOP_NOTE) for b in bodies] == [0, 0, 0, 1, 2, 2], "one detector state across replicas"
            assert all(b.count(RECITED) == 1 for b in bodies[1:])
            agent.assert_prefix_stable()

            # A pool cooling on replica a refuses on replica b: b sends nothing upstream.
            others = len(script.requests)
            script.queue({"fault": {"status": 429, "retry_after": "30"}})
            async with http_client(urls[0]) as client:
                assert (await client.post("/s/cool/v1/chat/completions", json=request_body("chat"))).status_code == 429
            sent = len(script.requests)
            async with http_client(urls[1]) as client:
                refused = await client.post("/s/cool2/v1/chat/completions", json=request_body("chat"))
            assert refused.status_code == 429 and refused.headers.get("x-proxyvisor-breaker") == "open"
            assert len(script.requests) == sent
            raw = redis.Redis.from_url(redis_url)
            raw.delete(*raw.keys(f"{REDIS_PREFIX}health:*"))  # the pool is healthy again
            raw.close()
            del script.requests[others:]  # other sessions' requests: the agent's prefix check reads its own only

            # kill -9 of replica a mid-session: b goes on with the session as it was.
            await agent.list_again((replicas[0],), turns=1)
            procs[0].send_signal(signal.SIGKILL)
            procs[0].wait(10)
            await agent.list_again((replicas[1],), turns=2)
            agent.assert_prefix_stable()
            assert agent.bodies()[-1].count(LOOP_NOTE) >= 1 and agent.bodies()[-1].count(RECITED) == 1
            # Every request has its ledger line, in the state directory of the replica that served it.
            lines = [orjson.loads(line) for name in ("a", "b")
                     for line in (tmp_path / f"state-{name}" / "ledger" / "prefix.jsonl").read_bytes().splitlines()]
            assert len(lines) == 9
        finally:
            for proc in procs:
                proc.kill()
                proc.wait()


async def test_a_gate_turn_begun_on_one_replica_goes_on_on_the_other(tmp_path: Path, redis_url: str) -> None:
    """With a re-entry budget of 1 and a verifier that always finds a gap: the first stop, on replica a, is
    continued upstream; the next stop of the same turn, on replica b, finds the budget spent (one gate turn, as one
    proxy would have it) and is delivered without another continuation."""
    model = Model()
    model.verdicts = [verdict(True)] * 4
    config = Config().with_overrides(state={"backend": "redis", "url": redis_url},
                                     supervisor={"gate": GateConfig(reentry_budget=1)})
    script = ScriptedUpstream()
    async with running(config, port=0, store=Store(tmp_path / "a"), scripted={"scripted": script},
                       model=model) as a, \
            running(config, port=0, store=Store(tmp_path / "b"), scripted={"scripted": script}, model=model) as b:
        agent = Agent(a, BY_NAME["chat"], False)
        await agent.turn(agent.step("Reading. " + report()))
        await agent.turn({"text": "Done: the parser is split. " + report("done")},
                         agent.step("Checking the split. " + report()))
        first = a.pipeline.store.read_ledger("prefix")[-1]["gate"]
        assert first["reentries"] == 1 and len(agent.bodies()) == 3
        agent.proxy = b
        await agent.turn({"text": "Done, really. " + report("done")})
        last = b.pipeline.store.read_ledger("prefix")[-1]["gate"]
        assert last["reentries"] == 0 and last["verdicts"] == ["gaps"] and not last.get("passed")
        assert len(agent.bodies()) == 4, "no second continuation: the turn's budget was spent on replica a"


async def test_a_stepped_catch_up_whose_thread_another_replicas_state_replaced_counts_no_firing_twice(
        tmp_path: Path, redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A history read from the start in steps (``Supervisor.catch_up``) on proxy a while the session's state another
    proxy (b) stored meanwhile, its thread having read the same history, is loaded on a (another request of the
    session): the request's firings are b's, counted once in the session and in no second ledger line, as when the
    request came after the load."""
    body = orjson.dumps(BY_NAME["chat"].request_from_chat(polling(), "m", False, (ToolSpec("Bash", RUNNER),)))
    title = orjson.dumps(BY_NAME["chat"].request_from_chat(
        [{"role": "system", "content": "You write titles."}, {"role": "user", "content": "A title."}], "m", False, ()))
    paused, released = paused_reading(monkeypatch)  # a's reading pauses part way: b's and a's requests run
    config = Config().with_overrides(state={"backend": "redis", "url": redis_url},
                                     supervisor={"gate": GateConfig(enabled=False)})
    script = ScriptedUpstream()
    script.queue({"text": "Still building."}, {"text": "A title."}, {"text": "Still building."})
    headers = [(b"content-type", b"application/json"), (b"x-proxyvisor-session", b"stepped")]

    async def call(proxy: RunningProxy, content: bytes) -> None:
        response = await proxy.pipeline(Request("POST", BY_NAME["chat"].path, headers, content, time.perf_counter()))
        assert response.status == 200 and isinstance(response.body, bytes)

    async with running(config, port=0, store=Store(tmp_path / "a"), scripted={"scripted": script}) as a, \
            running(config, port=0, store=Store(tmp_path / "b"), scripted={"scripted": script}) as b:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(call, a, body)
            with trio.fail_after(10):
                await paused.wait()
            await call(b, body)  # b reads the whole history and stores the session's state
            await call(a, title)  # another request of the session on a: it loads b's state
            released.set()
        states = [proxy.pipeline.sessions.get("stepped").supervision for proxy in (a, b)]
        lines = a.pipeline.store.read_ledger("stepped")  # both proxies' lines
    assert states[1].signals["loop"] > 0
    assert states[0].signals == states[1].signals, "the firings b counted, counted again on a"
    assert len(lines) == 3 and len([line for line in lines if line.get("signals")]) == 1


async def test_plan_on_another_replica_shows_the_plan_made_on_the_first(
        tmp_path: Path, redis_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    config = Config().with_overrides(state={"backend": "redis", "url": redis_url})
    script = ScriptedUpstream()
    async with running(config, port=0, store=Store(tmp_path / "a"), scripted={"scripted": script},
                       model=Model()) as a, \
            running(config, port=0, store=Store(tmp_path / "b"), scripted={"scripted": script}, model=Model()) as b:
        agent = Agent(a, BY_NAME["chat"], False)
        await agent.turn(agent.step("Reading. " + report()))
        await agent.turn(agent.step("Planning. " + report(plan="request")))
        await agent.turn(agent.step("Split under way. " + report()))  # the planner is called on this request
        async with http_client(b.url) as client:  # b does not hold the session: it reads the stored state
            for shown in ((await client.get("/proxyvisor/sessions/prefix/plan")).json(),
                          (await client.get("/proxyvisor/ui/api/sessions/prefix")).json()["plan"]):
                assert shown["plan"] is not None and "Split the parser" in shown["text"], shown
                assert "live only in the memory" not in shown["text"]
        assert b.pipeline.sessions.get("prefix") is None, "a reader does not take the session in"
        capsys.readouterr()
        assert await trio.to_thread.run_sync(main, ["plan", "--json", "--url", b.url, "prefix"]) == 0
        assert "Split the parser" in orjson.loads(capsys.readouterr().out)["text"]
        body = BY_NAME["chat"].request_from_chat(agent.history + [{"role": "user", "content": "/plan"}], "m", False)
        async with http_client(b.url) as client:
            reply = await client.post("/s/prefix/v1/chat/completions", json=body)
        assert reply.status_code == 200
        assert "Split the parser" in BY_NAME["chat"].parse_response(reply.json()).text
