"""What several replicas on one Redis share beyond the sessions' supervision state (tests/test_redis.py): learning's
memories (one key per project, forgotten fleet-wide), the sessions' ledgers (a line written by any replica is
read by every one: ``/info``, the session endpoints, the web view, ``proxyvisor info``), the session listing, and
the sessions of clients that send no id. On a real ``redis-server`` (skipped outside CI when it is absent)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import orjson
import redis
import trio

from proxyvisor.adapters.state import REDIS_PREFIX
from proxyvisor.cli import main
from proxyvisor.config import Config
from proxyvisor.learning.memory import RULE
from proxyvisor.proxy.learning import FOLDER, project_root, scope_key
from proxyvisor.proxy.service import running
from proxyvisor.scripted.upstream import ScriptedUpstream
from proxyvisor.store import Store

from redis_support import redis_server
from test_learning import RULE_TEXT, Agent, Model, session_one


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
        assert capsys.readouterr().out == f"forgot {rule}\n"

        three = Agent(b, "three", project, "Add a third flag.")
        await three.turn(three.call("ls", "app.py"))
        assert rule not in three.first_tail(), "a forget is seen by a session starting on a replica"
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
