"""Sessions' supervision state survives a restart of the proxy (``proxyvisor.proxy.session_state``): the notes and
recitations go back byte for byte where they were, the plan is the same plan (no second planner call), so the
request after the restart extends the one before it as it would without the restart; a stored state can only
build proxyvisor's own objects."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import orjson
import pytest

from proxyvisor.adapters.state import DiskBackend
from proxyvisor.config import Config
from proxyvisor.detectors.checks import PASSED
from proxyvisor.detectors.receipts import Receipt
from proxyvisor.proxy.formats import BY_NAME
from proxyvisor.proxy.formats.base import shared_prefix
from proxyvisor.proxy.service import running
from proxyvisor.proxy.session_state import NAMESPACE, SETTINGS, SessionStates, _source_digest, decode, encode
from proxyvisor.proxy.sessions import Session
from proxyvisor.proxy.supervise import SessionSupervision
from proxyvisor.scripted.upstream import ScriptedUpstream
from proxyvisor.store import Store

from test_recite_prefix import RECITED, Agent, Model, report

LOOP_NOTE = b'signal=\\"loop\\"'


async def _turns(agent: Agent, plan_at: int, count: int) -> None:
    for _ in range(count):
        await agent.turn(agent.step(f"Step {agent.n}. " + report(plan="request" if agent.n == plan_at else None)))


@pytest.mark.parametrize(("fmt", "stream"), [("chat", False), ("messages", True)], ids=["chat-json", "messages-sse"])
async def test_a_restart_keeps_the_notes_the_plan_and_the_upstream_prefix(tmp_path: Path, fmt: str,
                                                                          stream: bool) -> None:
    model = Model()
    bodies: list[bytes] = []
    async with running(Config(), port=0, store=Store(tmp_path / "state"), scripted={"scripted": ScriptedUpstream()},
                       model=model) as proxy:
        agent = Agent(proxy, BY_NAME[fmt], stream)
        await _turns(agent, plan_at=2, count=4)  # a recitation, then a plan made and recited at the tail
        bodies += agent.bodies()
    assert model.purposes == ["plan"] and bodies[-1].count(RECITED) == 2
    # The same state directory, a new process's worth of memory: nothing of the first proxy is left but its files.
    async with running(Config(), port=0, store=Store(tmp_path / "state"), scripted={"scripted": ScriptedUpstream()},
                       model=model) as proxy:
        agent.proxy, agent.upstream = proxy, proxy.scripted["scripted"]
        await _turns(agent, plan_at=-1, count=2)
        bodies += agent.bodies()
    assert model.purposes == ["plan"], "the plan came back from the store: no planner call after the restart"
    fmt_ = BY_NAME[fmt]
    prompts = [fmt_.prompt(orjson.loads(body)) for body in bodies]
    for i in range(1, len(prompts)):
        assert shared_prefix(prompts[i - 1], prompts[i]) == sum(map(len, prompts[i - 1])), f"request {i} breaks it"
    assert bodies[-1].count(RECITED) == 2 and b"Live plan (0/2 done)" in bodies[-1]


async def test_two_proxies_on_one_state_directory_serve_one_session_as_one(tmp_path: Path) -> None:
    """Each proxy reads the version of a session it already knows on its event loop (a diskcache store is local):
    a newer state the other proxy stored is still found and used, so a session alternating between them sees one
    detector state and notes that stay where they were, as with one proxy."""
    script = ScriptedUpstream()
    async with running(Config(), port=0, store=Store(tmp_path / "state"), scripted={"scripted": script},
                       model=Model()) as a, \
            running(Config(), port=0, store=Store(tmp_path / "state"), scripted={"scripted": script},
                    model=Model()) as b:
        agent = Agent(a, BY_NAME["chat"], False)
        await agent.list_again((a, b))
    bodies = agent.bodies()
    # What one proxy does (tests/test_steer.py): a note at the loop's first and second firing.
    assert [body.count(LOOP_NOTE) for body in bodies] == [0, 0, 0, 1, 2, 2], "one detector state across proxies"
    agent.assert_prefix_stable()


def _receipts_state(count: int) -> SessionSupervision:
    """A state whose one thread holds ``count`` receipts in its current turn."""
    state = SessionSupervision()
    state.thread(b"key", frozenset()).tracker.reader.turn_receipts = {
        f"call_{i}": Receipt("Bash", b"c%d" % i, ("src/a.py",), b"r", i % 2 == 0, "", f"pytest -k {i}", b"i", b"o",
                             PASSED, f"{i} passed") for i in range(count)}
    return state


def test_a_state_of_slotted_dataclasses_round_trips_and_names_their_classes() -> None:
    """Receipts (dataclasses with slots, hundreds in a long turn) are pickled as their fields' values and come
    back equal; the state's format names every proxyvisor class it holds."""
    state = _receipts_state(300)
    value = encode(state, os.urandom(16))
    back, _ = decode(value)
    assert back.threads[b"key"].tracker.reader.turn_receipts == state.threads[b"key"].tracker.reader.turn_receipts
    header = orjson.loads(value[20:20 + int.from_bytes(value[16:20], "big")])
    assert {"proxyvisor.detectors.receipts:Receipt", "proxyvisor.proxy.supervise:Thread",
            "proxyvisor.detectors.detectors:HistoryTracker"} <= set(header["classes"])


async def test_a_large_state_is_a_row_of_the_database_and_another_process_reads_it(tmp_path: Path) -> None:
    """A state over diskcache's 32 KB file threshold (a long turn's receipts) is stored in the database, not as a
    file made and removed on every save; another process (another store on the folder) reads it back."""
    backend = DiskBackend(tmp_path)
    session = Session("s", 0.0, 0.0, supervision=_receipts_state(600))
    await SessionStates(backend.kv(NAMESPACE, **SETTINGS), 60).save(session)
    assert len(encode(session.supervision, session.state_version)) > 32 * 1024
    assert sorted(p.name for p in (tmp_path / NAMESPACE).iterdir() if not p.name.startswith("cache.db")) == []
    other = Session("s", 0.0, 0.0)
    await SessionStates(backend.kv(NAMESPACE, **SETTINGS), 60).load(other)
    assert other.state_version == session.state_version
    assert other.supervision is not None and other.supervision.threads[b"key"].tracker.reader.turn_receipts == \
        session.supervision.threads[b"key"].tracker.reader.turn_receipts


def test_a_stored_state_round_trips_and_builds_nothing_but_proxyvisor_objects() -> None:
    state = SessionSupervision()
    state.notes["loop"] += 2
    version = os.urandom(16)
    back, got = decode(encode(state, version))
    assert got == version and back.notes == state.notes and isinstance(back, SessionSupervision)

    class Evil:
        def __reduce__(self) -> tuple[object, tuple[str]]:
            return (os.system, ("touch pwned",))

    def forged(payload: bytes, digest: str | None = None) -> bytes:
        names: tuple[str, ...] = ()
        header = orjson.dumps({"classes": names, "digest": digest or _source_digest(names).hex()})
        return version + len(header).to_bytes(4, "big") + header + payload

    with pytest.raises(ValueError, match="may not hold"):
        decode(forged(pickle.dumps(Evil())))
    with pytest.raises(ValueError):
        decode(b"short")
    # A state whose classes' source differs from this proxyvisor's (another version wrote it) is not used.
    with pytest.raises(ValueError, match="classes differ"):
        decode(forged(pickle.dumps(SessionSupervision()), digest="00" * 16))
