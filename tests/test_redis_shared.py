"""What several replicas on one Redis share beyond the sessions' supervision state (tests/test_redis.py): learning's
memories (one key per project, forgotten fleet-wide), the sessions' ledgers (a line written by any replica is
read by every one: ``/info``, the session endpoints, the web view, ``proxyvisor info``), the session listing, and
the sessions of clients that send no id. On a real ``redis-server`` (skipped outside CI when it is absent)."""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Iterator
from typing import Any
from contextlib import ExitStack, contextmanager
from pathlib import Path

import pytest
import orjson
import redis
import trio
import trio.testing

from proxyvisor.adapters import state as backends
from proxyvisor.adapters.replicas import RedisShare
from proxyvisor.adapters.state import REDIS_PREFIX, RedisBackend, backend_of
from proxyvisor.cli import main
from proxyvisor.config import Config, GateConfig, load
from proxyvisor.learning.memory import EXPERIENCE, RULE, VERIFIED, Candidate, Memory
from proxyvisor.proxy.formats import BY_NAME
from proxyvisor.proxy.learning import FOLDER, decoded, memory_store, project_root, save, scope_key
from proxyvisor.proxy.service import running
from proxyvisor.scripted.upstream import ScriptedUpstream
from proxyvisor.store import Store

from helpers import http_client, request_body
from redis_support import free_port, redis_server
from test_learning import RULE_TEXT, Agent, Model, session_one
from test_recite_prefix import Agent as PrefixAgent
from test_redis import LOOP_NOTE

ADMIN = "admin-token-0123456789"
ADMIN_HEADER = "x-proxyvisor-admin"


@pytest.fixture
def redis_url(tmp_path: Path) -> Iterator[str]:
    with redis_server(tmp_path / "redis") as url:
        yield url


def _config_file(path: Path, state: Path, redis_url: str) -> Path:
    path.write_text(f'[state]\ndir = "{state}"\nbackend = "redis"\nurl = "{redis_url}"\n')
    return path


async def test_memories_are_shared_and_a_forget_on_one_replica_holds_on_the_other(
        tmp_path: Path, redis_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    project = tmp_path / "project"
    project.mkdir()
    scope = project_root(str(project))
    config = Config().with_overrides(state={"backend": "redis", "url": redis_url})
    cli = ["--config", str(_config_file(tmp_path / "cli.toml", tmp_path / "cli-state", redis_url)),
           "--scope", str(project)]
    async with running(config, port=0, store=Store(tmp_path / "a"), scripted={"scripted": ScriptedUpstream()},
                       model=Model()) as a, \
            running(config, port=0, store=Store(tmp_path / "b"), scripted={"scripted": ScriptedUpstream()},
                    model=Model()) as b:
        await session_one(a, project, f"{RULE_TEXT} Add a flag.", "one")
        raw = redis.Redis.from_url(redis_url)
        key = f"{REDIS_PREFIX}memory:{scope_key(scope)}"
        with trio.fail_after(10):  # stored in the background, after the answer went out
            while not raw.exists(key):
                await trio.sleep(0.02)
        ttl_ms = raw.pttl(key)
        assert 0 < ttl_ms <= Config().supervisor.learning.retention_days * 86_400_000, "the memory key expires"
        assert not (tmp_path / "a" / FOLDER).exists() and not (tmp_path / "b" / FOLDER).exists(), "no file"

        two = Agent(b, "two", project, "Add a --quiet flag.")
        await two.turn(two.call("ls", "app.py"))
        assert RULE_TEXT in two.first_tail(), "replica b recalls what a session on replica a learnt"

        capsys.readouterr()
        assert main(["memory", "list", "--json", *cli]) == 0, "the command line reads the memory from Redis"
        listed = capsys.readouterr().out
        rule = next(r for r in orjson.loads(listed)["records"] if r["kind"] == RULE)["id"]
        assert main(["memory", "forget", rule, *cli]) == 0
        assert capsys.readouterr().out.startswith(f"forgot {rule}")

        three = Agent(b, "three", project, "Add a third flag.")
        await three.turn(three.call("ls", "app.py"))
        assert rule not in three.first_tail() and RULE_TEXT not in three.first_tail(), \
            "a forget is seen by a session starting on a replica, and no experience quotes the rule to it"
        four = await session_one(a, project, "Add a fourth flag.", "four")  # a judged turn end: replica a saves
        assert rule not in four.first_tail()
        with trio.fail_after(10):
            while b"fourth flag" not in (raw.get(key) or b""):
                await trio.sleep(0.02)
        raw.close()
        assert main(["memory", "list", *cli]) == 0
        assert rule not in capsys.readouterr().out, "replica a's save did not write the forgotten rule back"
        assert main(["memory", "forget", "--all", *cli]) == 0
        assert main(["memory", "list", *cli]) == 0
        assert capsys.readouterr().out.splitlines()[-1].startswith("no memory for")


async def test_a_session_alternating_over_two_replicas_shows_all_its_requests_on_either(
        tmp_path: Path, redis_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    config = Config().with_overrides(state={"backend": "redis", "url": redis_url}, proxy={"admin_token": ADMIN})
    script = ScriptedUpstream()
    async with running(config, port=0, store=Store(tmp_path / "a"), scripted={"scripted": script}) as a, \
            running(config, port=0, store=Store(tmp_path / "b"), scripted={"scripted": script}) as b:
        replicas = (a, b)
        for n in range(6):
            script.queue({"text": f"answer {n}"})
            async with http_client(replicas[n % 2].url) as client:
                reply = await client.post("/s/alt/v1/chat/completions", json=request_body("chat"))
            assert reply.status_code == 200
        async with http_client(b.url) as client:  # a session only replica a served
            script.queue({"text": "only on a"})
            assert (await client.post(f"{a.url}/s/only-a/v1/chat/completions",
                                      json=request_body("chat"))).status_code == 200
        for proxy in replicas:
            async with http_client(proxy.url) as client:
                info = (await client.get("/proxyvisor/sessions/alt/info")).json()
                assert info["requests"] == 6, "every replica's lines"
                assert (await client.get("/proxyvisor/sessions/only-a/info")).json()["requests"] == 1
                listed = (await client.get("/proxyvisor/sessions", headers={ADMIN_HEADER: ADMIN})).json()
                assert {"alt", "only-a"} <= {s["id"] for s in listed["sessions"]}
                web = (await client.get("/proxyvisor/ui/api/sessions/alt")).json()
                assert web["info"]["requests"] == 6
                assert len([step for step in web["timeline"] if not step["local"]]) == 6
                rows = (await client.get("/proxyvisor/ui/api/sessions", headers={ADMIN_HEADER: ADMIN})).json()
                assert {r["id"]: r["requests"] for r in rows["sessions"]}["alt"] == 6
                body = request_body("chat")
                body["messages"].append({"role": "user", "content": "/info"})
                answer = (await client.post("/s/alt/v1/chat/completions", json=body)).json()
                text = answer["choices"][0]["message"]["content"]
                assert re.search(r"\| model requests +\| 6\b", text), text
        # Each replica's own file holds the lines it wrote (the append-only record), no more.
        local = [len((tmp_path / name / "ledger" / "alt.jsonl").read_bytes().splitlines()) for name in "ab"]
        assert local == [4, 4], "3 requests and 1 /info each"

        # The command line, with no proxy answering at its address, reads the shared ledger too.
        cli = _config_file(tmp_path / "cli.toml", tmp_path / "elsewhere", redis_url)
        capsys.readouterr()
        assert main(["info", "--config", str(cli), "--json", "--url", "http://127.0.0.1:9", "alt"]) == 0
        assert orjson.loads(capsys.readouterr().out)["requests"] == 6

        raw = redis.Redis.from_url(redis_url)
        assert 0 < raw.pttl(f"{REDIS_PREFIX}ledger:alt") <= config.state.session_ttl_s * 1000
        assert 0 < raw.pttl(f"{REDIS_PREFIX}ledger-index") <= config.state.session_ttl_s * 1000
        raw.close()


async def test_with_redis_down_ledger_lines_go_to_the_file_and_are_counted_unshared(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with ExitStack() as stack:
        url = stack.enter_context(redis_server(tmp_path / "redis"))
        config = Config().with_overrides(state={"backend": "redis", "url": url})
        async with running(config, port=0, store=Store(tmp_path / "a"),
                           scripted={"scripted": ScriptedUpstream()}) as proxy:
            async with http_client(proxy.url) as client:
                assert (await client.post("/s/down/v1/chat/completions", json=request_body("chat"))).status_code \
                    == 200
                stack.close()  # Redis stops
                for _ in range(2):
                    assert (await client.post("/s/down/v1/chat/completions",
                                              json=request_body("chat"))).status_code == 200
                info = (await client.get("/proxyvisor/sessions/down/info")).json()
                body = request_body("chat")
                body["messages"].append({"role": "user", "content": "/info"})
                text = (await client.post("/s/down/v1/chat/completions", json=body)).json()
    assert info["requests"] == 3, "the local file, which has every line"
    assert info["live"]["unshared"] == 2
    assert "| not shared " in text["choices"][0]["message"]["content"]
    assert len((tmp_path / "a" / "ledger" / "down.jsonl").read_bytes().splitlines()) == 4, "3 requests, 1 /info"
    warned = [r for r in caplog.records if r.getMessage().startswith("shared ledgers:")]
    assert len(warned) == 1, [r.getMessage() for r in warned]
    assert "Traceback" not in caplog.text


async def test_after_an_outage_info_merges_the_shared_ledger_with_this_replicas_lines_written_meanwhile(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(backends, "_DOWN_S", 0.3)  # how long a Redis found down is left alone before a retry
    port = free_port()
    script = ScriptedUpstream()

    async def send(proxy: Any, n: int) -> None:
        script.queue({"text": f"answer {n}"})
        async with http_client(proxy.url) as client:
            assert (await client.post("/s/gap/v1/chat/completions", json=request_body("chat"))).status_code == 200

    async def info(proxy: Any) -> dict[str, Any]:
        async with http_client(proxy.url) as client:
            found: dict[str, Any] = (await client.get("/proxyvisor/sessions/gap/info")).json()
            body = request_body("chat")
            body["messages"].append({"role": "user", "content": "/info"})
            found["text"] = (await client.post("/s/gap/v1/chat/completions", json=body)).json()[
                "choices"][0]["message"]["content"]
        return found

    with ExitStack() as stack:
        url = stack.enter_context(redis_server(tmp_path / "redis", port, persist=True))
        config = Config().with_overrides(state={"backend": "redis", "url": url})
        async with running(config, port=0, store=Store(tmp_path / "a"), scripted={"scripted": script}) as a, \
                running(config, port=0, store=Store(tmp_path / "b"), scripted={"scripted": script}) as b:
            await send(a, 1)
            await send(b, 2)
            stack.close()  # Redis goes away
            await send(a, 3)
            await send(a, 4)
            down = await info(a)
            assert down["requests"] == 3 and down["only_this_replica"], "a's own file: 1, 3 and 4"
            assert "this replica's ledger lines only" in down["text"]
            stack.enter_context(redis_server(tmp_path / "redis", port, persist=True))  # back, with its data
            await trio.sleep(0.4)
            await send(b, 5)
            after_a, after_b = await info(a), await info(b)
            stack.close()
    assert not after_a["only_this_replica"] and "this replica's ledger lines only" not in after_a["text"]
    assert after_a["requests"] == 5, "the shared lines (1, 2, 5) and a's lines written during the outage (3, 4)"
    assert after_b["requests"] == 3, "b never saw a's lines of the outage: they are in a's file only"
    lines = a.pipeline.store.read_ledger("gap")
    assert [line["time"] for line in lines] == sorted(line["time"] for line in lines), "in time order"
    assert len({line["line_id"] for line in lines}) == len(lines), "each line once"


async def test_a_client_without_a_session_id_alternating_over_two_replicas_keeps_one_session(
        tmp_path: Path, redis_url: str) -> None:
    """What tests/test_redis.py checks for a session with an id, for one known only by its history: one detector
    state (the loop note at its first and second firing, then back-off), one session in every listing."""
    config = Config().with_overrides(state={"backend": "redis", "url": redis_url}, proxy={"admin_token": ADMIN},
                                     supervisor={"gate": GateConfig(enabled=False)})
    script = ScriptedUpstream()
    async with running(config, port=0, store=Store(tmp_path / "a"), scripted={"scripted": script}) as a, \
            running(config, port=0, store=Store(tmp_path / "b"), scripted={"scripted": script}) as b:
        agent = PrefixAgent(a, BY_NAME["chat"], False)
        agent.prefix = ""
        await agent.list_again((a, b))
        bodies = agent.bodies()
        assert [body.count(LOOP_NOTE) for body in bodies] == [0, 0, 0, 1, 2, 2], "one detector state"
        agent.assert_prefix_stable()
        for proxy in (a, b):
            async with http_client(proxy.url) as client:
                listed = (await client.get("/proxyvisor/sessions", headers={ADMIN_HEADER: ADMIN})).json()
                (session,) = [s["id"] for s in listed["sessions"]]
                assert session.startswith("h-")
                assert (await client.get(f"/proxyvisor/sessions/{session}/info")).json()["requests"] == 6


async def test_with_redis_down_learning_goes_on_from_the_memories_it_holds(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    project = tmp_path / "project"
    project.mkdir()
    with ExitStack() as stack:
        url = stack.enter_context(redis_server(tmp_path / "redis"))
        config = Config().with_overrides(state={"backend": "redis", "url": url})
        async with running(config, port=0, store=Store(tmp_path / "a"), scripted={"scripted": ScriptedUpstream()},
                           model=Model()) as proxy:
            await session_one(proxy, project, f"{RULE_TEXT} Add a flag.", "one")
            stack.close()  # Redis stops
            two = await session_one(proxy, project, "Add a --quiet flag.", "two")
            assert RULE_TEXT in two.first_tail(), "recalled from the memory this process holds"
            await session_one(proxy, project, "Add a --verbose flag.", "three")
    warned = [r.getMessage() for r in caplog.records if r.getMessage().startswith("memories:")]
    assert len(warned) == 1, warned
    assert "Traceback" not in caplog.text


@contextmanager
def memory_on(tmp_path: Path, redis_url: str, backend: str) -> Iterator[tuple[Path, Path, Any, Memory]]:
    """A project folder, a config file naming ``backend``, the memory store it opens (closed after) and a proxy's
    memory of the project, empty."""
    project = tmp_path / "project"
    project.mkdir()
    config_path = tmp_path / "proxyvisor.toml"
    config_path.write_text(f'[state]\ndir = "{tmp_path / "state"}"\nbackend = "{backend}"\nurl = "{redis_url}"\n')
    config = load(str(config_path))
    state = backend_of(config)
    try:
        store = memory_store(config.supervisor.learning, config.state_dir(), state)
        assert store is not None
        yield project, config_path, store, Memory(project_root(str(project)))
    finally:
        state.close()


def stored(store: Any, scope: str) -> Memory | None:
    """The memory of ``scope`` as ``store`` holds it now (None: none)."""
    found = store.look(scope, ())
    return decoded(found[1] if found else None, scope)


@pytest.mark.parametrize("backend", ["redis", "diskcache"])
def test_a_forget_all_is_not_undone_by_the_next_save_of_a_proxy_that_read_the_memory_before(
        tmp_path: Path, redis_url: str, backend: str, capsys: pytest.CaptureFixture[str]) -> None:
    with memory_on(tmp_path, redis_url, backend) as (project, config_path, store, memory):
        loaded = set[str]()
        old = memory.add(Candidate(RULE, RULE_TEXT, RULE_TEXT), 1.0, "one")
        assert old is not None and save(store, memory, loaded) is not None and loaded == {old.id}

        assert main(["memory", "forget", "--all", "--config", str(config_path), "--scope", str(project)]) == 0
        assert "forgot 1 record(s)" in capsys.readouterr().out

        new = memory.add(Candidate(RULE, "Never push to main.", "Never push to main."), 2.0, "two")
        assert new is not None and save(store, memory, loaded) is not None
        kept = stored(store, memory.scope)
        assert kept is not None and set(kept.records) == {new.id}, "the forgotten record stays forgotten"
        assert set(memory.records) == {new.id}, "and the proxy's own copy lets it go too"


@pytest.mark.parametrize("backend", ["redis", "diskcache"])
def test_forgetting_a_rule_removes_the_experiences_quoting_it_from_the_store_and_a_proxys_save_keeps_them_out(
        tmp_path: Path, redis_url: str, backend: str, capsys: pytest.CaptureFixture[str]) -> None:
    with memory_on(tmp_path, redis_url, backend) as (project, config_path, store, memory):
        loaded = set[str]()
        rule = memory.add(Candidate(RULE, RULE_TEXT, "user turn 1"), 1.0, "one")
        task = memory.add(Candidate(EXPERIENCE, f"Please list files. {RULE_TEXT.upper()}", "session one",
                                    VERIFIED), 1.0, "one")
        assert rule is not None and task is not None and save(store, memory, loaded) is not None

        assert main(["memory", "forget", rule.id, "--config", str(config_path), "--scope", str(project)]) == 0
        assert capsys.readouterr().out == f"forgot {rule.id} and the record(s) quoting it: {task.id}\n"

        # The proxy read the memory before the forget, and distils the rule's words again before it saves.
        again = memory.add(Candidate(EXPERIENCE, f"{RULE_TEXT} Add a flag.", "session one", VERIFIED), 2.0, "one")
        assert again is not None and save(store, memory, loaded) is not None
        kept = stored(store, memory.scope)
        assert kept is not None and kept.records == memory.records == {}, "no quote of the rule written back"


def _learning_on_redis(tmp_path: Path, redis_url: str) -> tuple[Path, Config, int]:
    """A project folder, a configuration whose state is on the Redis at ``redis_url``, and that Redis's process id
    (to stop it with SIGSTOP: a Redis that hangs)."""
    project = tmp_path / "project"
    project.mkdir()
    raw = redis.Redis.from_url(redis_url)
    pid = raw.info()["process_id"]
    raw.close()
    return project, Config().with_overrides(state={"backend": "redis", "url": redis_url}), pid


async def test_a_session_ending_while_redis_hangs_does_not_stop_the_event_loop(
        tmp_path: Path, redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """An idle session is ended (its learning's last distill and save) by the request that evicts it: the save
    goes to Redis in the background, not on the event loop, so a Redis that hangs stalls no request."""
    monkeypatch.setattr(backends, "_TIMEOUT_S", 2.0)
    project, config, pid = _learning_on_redis(tmp_path, redis_url)
    async with running(config, port=0, store=Store(tmp_path / "a"), scripted={"scripted": ScriptedUpstream()},
                       model=Model()) as proxy:
        agent = Agent(proxy, "one", project, "Add a flag.")
        await agent.turn(agent.call("pytest -q", "3 passed in 0.05s"))  # no turn end: material left to distill
        await trio.sleep(0.2)  # the request's background saves done
        os.kill(pid, signal.SIGSTOP)
        try:
            sessions = proxy.pipeline.sessions
            started = time.monotonic()
            assert [s.id for s in sessions.evict(proxy.pipeline.clock() + 10 * sessions.idle_s)] == ["one"]
            assert time.monotonic() - started < 2.0, "the save waits for Redis off the event loop"
        finally:
            os.kill(pid, signal.SIGCONT)


async def test_a_save_under_way_when_the_proxy_stops_ends_before_its_redis_connection_closes(
        tmp_path: Path, redis_url: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A session's last learning save, in a worker thread waiting on a Redis that hangs as the proxy stops, ends
    (Redis unavailable after the store's timeout, warned) before the proxy closes its Redis connection: the
    connection is not closed under the save, and nothing raises out of the stop."""
    monkeypatch.setattr(backends, "_TIMEOUT_S", 1.0)
    under_way, closed_under = [0], []
    call, close = RedisBackend.call, RedisBackend.close

    def counted(self: RedisBackend, fn: Any) -> Any:
        under_way[0] += 1
        try:
            return call(self, fn)
        finally:
            under_way[0] -= 1

    def closing(self: RedisBackend) -> None:
        closed_under.append(under_way[0])
        close(self)

    monkeypatch.setattr(RedisBackend, "call", counted)
    monkeypatch.setattr(RedisBackend, "close", closing)
    project, config, pid = _learning_on_redis(tmp_path, redis_url)
    try:
        async with running(config, port=0, store=Store(tmp_path / "a"), scripted={"scripted": ScriptedUpstream()},
                           model=Model()) as proxy:
            agent = Agent(proxy, "one", project, "Add a flag.")
            await agent.turn(agent.call("pytest -q", "3 passed in 0.05s"))  # no turn end: material left to distill
            await trio.testing.wait_all_tasks_blocked()
            os.kill(pid, signal.SIGSTOP)
            sessions = proxy.pipeline.sessions
            assert [s.id for s in sessions.evict(proxy.pipeline.clock() + 10 * sessions.idle_s)] == ["one"]
            await trio.sleep(0.2)  # its save waits on Redis in a worker thread as the proxy stops
    finally:
        os.kill(pid, signal.SIGCONT)
    assert closed_under == [0], "the Redis connection was closed under a call still waiting on it"
    assert "Traceback" not in caplog.text


def test_proxyvisor_info_with_redis_down_sums_this_machines_ledger(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture) -> None:
    """Without a proxy, ``proxyvisor info`` reads the shared ledgers from Redis; a Redis that does not answer leaves
    it the local files (said on stderr, without the password), as it does a running proxy's readers."""
    state_dir = tmp_path / "state"
    Store(state_dir).append_ledger("s1", {"time": "2026-01-01T00:00:00.000+00:00", "format": "chat", "status": 200,
                                          "input_tokens": 7, "output_tokens": 3})
    config = tmp_path / "proxyvisor.toml"
    config.write_text(f'[state]\ndir = "{state_dir}"\nbackend = "redis"\n'
                      f'url = "redis://:hunter2@127.0.0.1:{free_port()}/0"\n')
    capsys.readouterr()
    assert main(["info", "--json", "--config", str(config), "--url", f"http://127.0.0.1:{free_port()}"]) == 0
    out, err = capsys.readouterr()
    assert orjson.loads(out)["session"] == "s1" and orjson.loads(out)["requests"] == 1
    said = err + caplog.text
    assert "cannot reach Redis at redis://127.0.0.1:" in said and "hunter2" not in said and "Traceback" not in said


def test_the_command_line_with_a_hung_redis_answers_quickly_info_from_this_hosts_ledger_memory_refused(
        tmp_path: Path, redis_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    """A Redis that hangs (stopped: its socket accepts and never answers): ``proxyvisor info`` sums this machine's
    ledger and says it is this host's lines only; ``proxyvisor memory`` says Redis does not answer (exit 1, not a
    configuration error); each within a few seconds (a proxy's timeout is 5 s per call)."""
    state_dir = tmp_path / "state"
    Store(state_dir).append_ledger("s1", {"time": "2026-01-01T00:00:00.000+00:00", "format": "chat", "status": 200,
                                          "input_tokens": 7, "output_tokens": 3})
    config = str(_config_file(tmp_path / "proxyvisor.toml", state_dir, redis_url))
    pid = redis.Redis.from_url(redis_url).info()["process_id"]
    os.kill(pid, signal.SIGSTOP)
    try:
        capsys.readouterr()
        started = time.monotonic()
        assert main(["info", "--json", "--config", config, "--url", f"http://127.0.0.1:{free_port()}"]) == 0
        took_info = time.monotonic() - started
        out, err = capsys.readouterr()
        started = time.monotonic()
        assert main(["memory", "list", "--config", config, "--scope", str(tmp_path)]) == 1
        took_memory = time.monotonic() - started
        _, refused = capsys.readouterr()
    finally:
        os.kill(pid, signal.SIGCONT)
    assert orjson.loads(out)["requests"] == 1 and orjson.loads(out)["only_this_replica"]
    assert "this host's lines only" in err
    assert refused.startswith("proxyvisor memory: cannot reach Redis at ") and "configuration" not in refused
    assert took_info < 3 and took_memory < 3, (took_info, took_memory)


def test_the_session_index_never_goes_back_when_replicas_send_out_of_order(redis_url: str) -> None:
    """Two replicas' sends of one session's lines can reach Redis in either order (a flush waits for the one before
    it, clocks differ by some ms): the index keeps the latest line's time, which the listing and the web view's
    cached rows go by."""
    backend = RedisBackend(redis_url)
    try:
        share = RedisShare(backend, 86_400.0, 3_600.0)
        now = time.time()
        share.write([("s1", b'{"n":2}', now)], {})
        share.write([("s1", b'{"n":1}', now - 0.5)], {})
        assert share.recent() == {"s1": pytest.approx(now, abs=0.01)}
    finally:
        backend.close()


@pytest.mark.parametrize("backend", ["redis", "diskcache"])
def test_records_the_bounds_drop_stay_dropped_in_the_stored_memory(tmp_path: Path, redis_url: str,
                                                                    backend: str) -> None:
    """A save merges in what another process stored meanwhile, but not the records this process read and then
    dropped by the bounds: else the stored memory (on Redis one key) grew past max_records and max_bytes."""
    config = Config().with_overrides(state={"backend": backend, "url": redis_url, "dir": str(tmp_path / "state")})
    state = backend_of(config)
    try:
        store = memory_store(config.supervisor.learning, config.state_dir(), state)
        assert store is not None
        scope = project_root(str(tmp_path))
        memory, loaded = Memory(scope), set[str]()
        for n in range(3):
            memory.add(Candidate(RULE, f"Always run check number {n}.", f"user turn {n}"), float(n), "one")
        assert save(store, memory, loaded) is not None and len(loaded) == 3
        assert memory.bound(2, 1 << 20, 86_400.0, 3.0) == 1
        assert save(store, memory, loaded) is not None
        kept = stored(store, scope)
        assert kept is not None and len(kept.records) == 2 and set(memory.records) == set(kept.records)
    finally:
        state.close()


async def test_a_stock_answer_delivered_to_sessions_on_two_replicas_identifies_neither(
        tmp_path: Path, redis_url: str) -> None:
    """Two clients without an id, each served by its own replica, get the same answer text ("Done."): as on one
    replica, that answer identifies neither session, whichever replica serves each client's next request."""
    config = Config().with_overrides(state={"backend": "redis", "url": redis_url}, proxy={"admin_token": ADMIN},
                                     supervisor={"gate": GateConfig(enabled=False)})
    script = ScriptedUpstream()
    async with running(config, port=0, store=Store(tmp_path / "a"), scripted={"scripted": script}) as a, \
            running(config, port=0, store=Store(tmp_path / "b"), scripted={"scripted": script}) as b:
        async def sessions() -> dict[str, int]:
            async with http_client(a.url) as client:
                listed = (await client.get("/proxyvisor/sessions", headers={ADMIN_HEADER: ADMIN})).json()
                return {s["id"]: (await client.get(f"/proxyvisor/sessions/{s['id']}/info")).json()["requests"]
                        for s in listed["sessions"]}

        for first, then in ((a, b), (b, a)):  # the second replica to deliver the answer serves the next request,
            x, y = PrefixAgent(first, BY_NAME["chat"], False), PrefixAgent(then, BY_NAME["chat"], False)
            x.prefix = y.prefix = ""  # then the first
            x.history[1]["content"] += f" ({first.url})"
            y.history[1]["content"] = f"Write the changelog for the 2.0 release ({first.url})."
            before = await sessions()
            await x.turn({"text": "Done."})
            (sx,) = set(await sessions()) - set(before)
            await y.turn({"text": "Done."})
            (sy,) = set(await sessions()) - set(before) - {sx}
            x.proxy = then
            x.history.append({"role": "user", "content": "Now the tests, please."})
            await x.turn({"text": "Added."})
            found = await sessions()
            assert (found[sx], found[sy]) == (2, 1), "x's next request is x's, not y's"
