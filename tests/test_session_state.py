"""Sessions' supervision state survives a restart of the proxy (``proxyvisor.proxy.session_state``): the notes and
recitations go back byte for byte where they were, the plan is the same plan (no second planner call), so the
request after the restart extends the one before it as it would without the restart; a stored state can only
build proxyvisor's own objects."""

from __future__ import annotations

import logging
import os
import pickle
import time
from collections import Counter
from contextlib import ExitStack
from pathlib import Path
from collections.abc import Sequence
from typing import Any

import orjson
import pytest

from proxyvisor.adapters.state import DiskBackend
from proxyvisor.config import Config
from proxyvisor.detectors.checks import PASSED
from proxyvisor.detectors.receipts import Receipt, RoundReader
from proxyvisor.proxy.formats import BY_NAME
from proxyvisor.proxy.formats.base import shared_prefix
from proxyvisor.proxy.service import running
from proxyvisor.gate import digest
from proxyvisor.proxy import session_state
from proxyvisor.proxy.session_state import (_CHUNKS, CHUNK, NAMESPACE, SETTINGS, SessionStates, _source_digest, decode,
                                            encode)
from proxyvisor.proxy.sessions import Session
from proxyvisor.proxy.supervise import SessionSupervision
from proxyvisor.scripted.upstream import ScriptedUpstream
from proxyvisor.store import Store
from proxyvisor.transcript import Message, ToolOutput, ToolUse

from redis_support import redis_server
from test_recite_prefix import RECITED, Agent, Model, report, verdict

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


@pytest.mark.parametrize("backend", ["diskcache", "redis"])
async def test_a_turns_receipts_reach_the_gate_on_another_proxy_through_their_chunks(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, backend: str) -> None:
    """With chunks of 2 receipts: a turn's tool rounds on proxy a, its stop on proxy b (one state directory, or
    one Redis): the verify-gate on b is given the receipt of every call of the turn, those proxy a stored in chunks
    included (none computed again)."""
    with ExitStack() as stack:
        config = Config() if backend == "diskcache" else Config().with_overrides(
            state={"backend": "redis", "url": stack.enter_context(redis_server(tmp_path / "redis"))})
        await _gate_on_another_proxy(tmp_path, monkeypatch, config)


async def _gate_on_another_proxy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, config: Config) -> None:
    monkeypatch.setattr(session_state, "CHUNK", 2)
    given: list[list[str]] = []
    turn_actions = digest.turn_actions

    def spy(messages: Any, schemas: Any = None, mutating_tools: frozenset[str] = frozenset(),
            known: dict[str, Receipt] | None = None) -> list[digest.Action]:
        given.append(sorted(known or {}))
        return turn_actions(messages, schemas, mutating_tools, known)

    monkeypatch.setattr(digest, "turn_actions", spy)
    model = Model()
    model.verdicts = [verdict(False)]
    script = ScriptedUpstream()
    async with running(config, port=0, store=Store(tmp_path / "state"), scripted={"scripted": script},
                       model=model) as a, \
            running(config, port=0, store=Store(tmp_path / "state"), scripted={"scripted": script},
                    model=model) as b:
        agent = Agent(a, BY_NAME["chat"], False)
        for _ in range(5):
            await agent.turn(agent.step("Reading. " + report()))
        assert a.pipeline.states is not None and [k for k in a.pipeline.states.kv.keys() if ":r:" in k], "chunks"
        agent.proxy = b
        await agent.turn({"text": "Done: the parser is split. " + report("done")})
    assert model.purposes == ["verify"]
    assert given[-1] == [f"call_{i}" for i in range(1, 6)]


def _receipts_state(count: int) -> SessionSupervision:
    """A state whose one thread holds ``count`` receipts in its current turn."""
    state = SessionSupervision()
    state.thread(b"key", frozenset()).tracker.reader.turn_receipts = {
        f"call_{i}": Receipt("Bash", b"c%d" % i, ("src/a.py",), b"r", i % 2 == 0, "", f"pytest -k {i}", b"i", b"o",
                             PASSED, f"{i} passed") for i in range(count)}
    return state


def _receipts_state_turn(state: SessionSupervision, count: int, prefix: str) -> None:
    """A new turn in ``state``'s thread (a new dict) with ``count`` receipts."""
    receipts = _receipts(state)
    state.threads[b"key"].tracker.reader.turn_receipts = {f"{prefix}{i}": receipts["call_1"] for i in range(count)}
    state.threads[b"key"].changes += 1  # as a request taking it counts it


def _receipts(state: SessionSupervision) -> dict[str, Receipt]:
    return state.threads[b"key"].tracker.reader.turn_receipts


def _stored(backend: DiskBackend) -> dict[str, bytes]:
    kv = backend.kv(NAMESPACE, **SETTINGS)
    return {key: value for key in kv.keys() if (value := kv.get(key)) is not None}


async def test_a_long_turns_receipts_come_back_from_chunks_each_written_once(tmp_path: Path) -> None:
    """A turn's receipts (dataclasses with slots, hundreds in a long turn) are stored in chunks of CHUNK, each
    written once: the state itself stays the size of a chunk or so however long the turn, a save writes only what
    is new, and another process (another store on the folder) reads every receipt back equal and in order. The
    state's format names every proxyvisor class it holds, the chunks' too."""
    backend = DiskBackend(tmp_path)
    states = SessionStates(backend.kv(NAMESPACE, **SETTINGS), 60)
    session = Session("s", 0.0, 0.0, supervision=_receipts_state(600))
    await states.save(session)
    assert session.supervision is not None
    stored = _stored(backend)
    chunks = {key for key in stored if key.startswith("s:r:")}
    assert len(chunks) == 600 // CHUNK and len(stored["s"]) < 4 * 1024
    header = orjson.loads(stored["s"][20:20 + int.from_bytes(stored["s"][16:20], "big")])
    assert {"proxyvisor.detectors.receipts:Receipt", "proxyvisor.detectors.receipts:RoundReader",
            "proxyvisor.proxy.supervise:Thread",
            "proxyvisor.detectors.detectors:HistoryTracker"} <= set(header["classes"])
    receipts = _receipts(session.supervision)
    extra = {f"more_{i}": receipts["call_1"] for i in range(CHUNK)}
    receipts.update(list(extra.items())[:1])
    session.supervision.threads[b"key"].changes += 1  # as a request taking it counts it
    assert encode(session.supervision, os.urandom(16)).unstored == [], "one more receipt: no chunk to write"
    receipts.update(extra)
    session.supervision.threads[b"key"].changes += 1
    await states.save(session)
    last = _CHUNKS[session.supervision.threads[b"key"].tracker.reader].chunks[-1]
    assert set(_stored(backend)) - set(stored) == {f"s:r:{last.digest.hex()}"}, "the chunk it filled, alone"
    other = Session("s", 0.0, 0.0)
    await SessionStates(backend.kv(NAMESPACE, **SETTINGS), 60).load(other)
    assert other.state_version == session.state_version and other.supervision is not None
    assert list(_receipts(other.supervision).items()) == list(receipts.items())
    # Read back whole: its next save writes no chunk again.
    assert encode(other.supervision, os.urandom(16)).unstored == []
    assert sorted(p.name for p in (tmp_path / NAMESPACE).iterdir() if not p.name.startswith("cache.db")) == [], \
        "every key a row of the database (over diskcache's 32 KB file threshold or not)"
    # A new user turn: the next save (here by the process that loaded it) removes the ended turn's chunks.
    _receipts_state_turn(other.supervision, 2 * CHUNK + 1, "next_")
    await SessionStates(backend.kv(NAMESPACE, **SETTINGS), 60).save(other)
    assert len([key for key in _stored(backend) if key.startswith("s:r:")]) == 2


class _Unread(list[Any]):
    """A turn's chunks that fail the test when read one by one."""

    def __iter__(self) -> Any:
        raise AssertionError("a save read the turn's earlier chunks")

    def __getitem__(self, index: Any) -> Any:
        raise AssertionError("a save read the turn's earlier chunks")


async def test_a_save_in_a_long_turn_reads_only_the_receipts_added_since_the_last(tmp_path: Path) -> None:
    """A turn of 600 receipts, saved: the saves after it, each of one more receipt, read none of the turn's chunks
    (the cost of a save does not grow with the turn), write the one chunk filled on the way and remove none, and
    another process reads every receipt back in order."""
    backend = DiskBackend(tmp_path)
    states = SessionStates(backend.kv(NAMESPACE, **SETTINGS), 60)
    session = Session("s", 0.0, 0.0, supervision=_receipts_state(600))
    await states.save(session)
    assert session.supervision is not None
    thread = session.supervision.threads[b"key"]
    known = _CHUNKS[thread.tracker.reader]
    known.chunks = _Unread(known.chunks)
    receipts = _receipts(session.supervision)
    for n in range(CHUNK + 1):
        receipts[f"more_{n}"] = receipts["call_1"]
        thread.changes += 1  # as a request taking it counts it
        await states.save(session)
    assert len([key for key in _stored(backend) if key.startswith("s:r:")]) == (600 + CHUNK + 1) // CHUNK
    other = Session("s", 0.0, 0.0)
    await SessionStates(backend.kv(NAMESPACE, **SETTINGS), 60).load(other)
    assert other.supervision is not None and list(_receipts(other.supervision).items()) == list(receipts.items())


async def test_a_session_back_from_another_process_reads_only_the_chunks_it_lacks(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks are named by their content: of a newer state another process stored, a process that holds the session
    reads only the chunks it does not have (a session going back and forth between replicas reads what the other
    one added, not the whole turn again)."""
    backend = DiskBackend(tmp_path)
    mine = backend.kv(NAMESPACE, **SETTINGS)
    read: list[list[str]] = []
    get_many = mine.get_many

    def spy(keys: Sequence[str]) -> list[bytes | None]:
        read.append(list(keys))
        return get_many(keys)

    monkeypatch.setattr(mine, "get_many", spy)
    other, here = SessionStates(backend.kv(NAMESPACE, **SETTINGS), 60), SessionStates(mine, 60)
    theirs = Session("s", 0.0, 0.0, supervision=_receipts_state(3 * CHUNK))
    await other.save(theirs)
    session = Session("s", 0.0, 0.0)
    await here.load(session)
    assert [len(keys) for keys in read] == [3]
    assert theirs.supervision is not None
    receipts = _receipts(theirs.supervision)
    receipts.update({f"more_{i}": receipts["call_1"] for i in range(CHUNK)})
    theirs.supervision.threads[b"key"].changes += 1
    await other.save(theirs)
    await here.load(session)
    assert [len(keys) for keys in read] == [3, 1], "the chunk the other process added, alone"
    assert session.supervision is not None and list(_receipts(session.supervision).items()) == list(receipts.items())


async def test_a_session_back_from_another_process_unpickles_only_the_threads_it_changed(tmp_path: Path) -> None:
    """Each thread is a pickle of its own in the state: a process that holds the session takes the threads whose
    pickle is the one it holds as they are (the same objects), and unpickles the ones the other process changed;
    the pickles it read are kept, so its next save pickles only what changes after."""
    backend = DiskBackend(tmp_path)
    other, here = (SessionStates(backend.kv(NAMESPACE, **SETTINGS), 60) for _ in range(2))
    theirs = Session("s", 0.0, 0.0, supervision=SessionSupervision())
    assert theirs.supervision is not None
    for key in (b"a", b"b", b"c"):
        theirs.supervision.thread(key, frozenset()).state = "progressing"
    await other.save(theirs)
    session = Session("s", 0.0, 0.0)
    await here.load(session)
    assert session.supervision is not None
    before = dict(session.supervision.threads)
    assert all(session_state._PICKLED.get(t.tracker) is not None for t in before.values()), "kept as read"
    changed = theirs.supervision.threads[b"b"]
    changed.state = "blocked"
    await other.save(theirs)
    await here.load(session)
    after = session.supervision.threads
    assert list(after) == [b"a", b"b", b"c"] and after[b"a"] is before[b"a"] and after[b"c"] is before[b"c"]
    assert after[b"b"] is not before[b"b"] and after[b"b"].state == "blocked"


async def test_a_receipt_replaced_or_a_chunk_lost_never_restores_a_wrong_receipt(tmp_path: Path) -> None:
    """A call id used again in a turn gives the reader a new dict (``RoundReader.turn_receipts``), cut into
    chunks afresh: the restored turn has the new receipt. A chunk that is gone (expired) or not a chunk (forged:
    it may not build anything but proxyvisor's objects) leaves only its receipts out; they are computed again
    when read."""
    backend = DiskBackend(tmp_path)
    kv = backend.kv(NAMESPACE, **SETTINGS)
    states = SessionStates(kv, 60)
    session = Session("s", 0.0, 0.0, supervision=_receipts_state(3 * CHUNK))
    assert session.supervision is not None
    await states.save(session)
    reader = session.supervision.threads[b"key"].tracker.reader
    replaced = dict(reader.turn_receipts)
    replaced["call_0"] = replaced["call_1"]
    reader.turn_receipts = replaced
    session.supervision.threads[b"key"].changes += 1
    assert len(encode(session.supervision, os.urandom(16)).unstored) == 1, "the chunks after the first: as stored"
    await states.save(session)
    other = Session("s", 0.0, 0.0)
    await SessionStates(kv, 60).load(other)
    assert other.supervision is not None and _receipts(other.supervision) == replaced
    first, second = (c.digest.hex() for c in _CHUNKS[reader].chunks[:2])
    kv.delete(f"s:r:{first}")
    kv.set(f"s:r:{second}", pickle.dumps(os.system), 60)
    lost = Session("s", 0.0, 0.0)
    await SessionStates(kv, 60).load(lost)
    assert lost.supervision is not None
    assert _receipts(lost.supervision) == dict(list(replaced.items())[2 * CHUNK:])


def test_a_value_rewritten_in_its_row_reads_as_diskcache_wrote_it(tmp_path: Path) -> None:
    """``DiskKV.set_many`` rewrites a key's row in place (the session state's every save) as diskcache's ``set``
    would: diskcache reads the value, its new time to live holds, another store on the folder sees it; a new key,
    or a key whose value was a file of its own (over diskcache's threshold), goes through diskcache, which removes
    the file; the keys it is told to remove go in the same step."""
    kv = DiskBackend(tmp_path).kv("t")
    big = os.urandom(64 * 1024)
    kv.set_many({"a": b"1", "b": big}, 60)
    assert [p for p in (tmp_path / "t").rglob("*.val")], "over 32 KB: a file of its own"
    kv.set_many({"a": b"2", "b": b"small", "c": b"3"}, 0.2)
    assert kv.get_many(["a", "b", "c"]) == [b"2", b"small", b"3"]
    assert not [p for p in (tmp_path / "t").rglob("*.val")], "the file went with its value"
    other = DiskBackend(tmp_path).kv("t")
    assert other.get("a") == b"2" and other.keys() == ["a", "b", "c"]
    time.sleep(0.3)
    assert kv.get_many(["a", "b", "c"]) == [None, None, None], "each key with its new time to live"
    kv.set_many({"a": b"4", "d": b"5"}, 60)
    kv.set_many({"a": b"6"}, 60, delete=["d"])
    assert other.get_many(["a", "d"]) == [b"6", None] and "d" not in other.keys()


def test_a_row_rewritten_in_place_is_the_row_diskcache_writes(tmp_path: Path) -> None:
    """``DiskKV.set_many`` writes diskcache's table itself, on its private connection (pinned in pyproject.toml):
    the row it rewrites, and the store's count and size, are what diskcache's own ``set`` leaves, column by column
    but for the times."""
    import diskcache

    kv = DiskBackend(tmp_path).kv("t", **SETTINGS)
    kv.set_many({"a": b"1", "b": b"x"}, 60)
    kv.set_many({"a": b"2"}, None)  # the row rewritten by the UPDATE
    reference = diskcache.Cache(str(tmp_path / "reference"), **SETTINGS)
    for key, value, expire in (("a", b"1", 60), ("b", b"x", 60), ("a", b"2", None)):
        reference.set(key, value, expire=expire)
    rows = ("SELECT key, raw, expire_time IS NULL, access_count, tag, size, mode, filename, value FROM Cache"
            " ORDER BY key")
    settings = "SELECT key, value FROM Settings WHERE key IN ('count', 'size') ORDER BY key"
    ours = kv._db()._con
    assert ours.execute(rows).fetchall() == reference._con.execute(rows).fetchall()
    assert ours.execute(settings).fetchall() == reference._con.execute(settings).fetchall()
    reference.close()


def test_a_round_reader_replaces_its_turns_dict_when_a_call_id_comes_again() -> None:
    """The contract the stored chunks rely on: a turn's dict only gains calls at its end, or is a new dict."""
    reader = RoundReader()
    call = [ToolUse("call_0", "Bash", {"command": "ls"})]
    reader.feed(0, Message("user", "Fix it."), {})
    reader.feed(1, Message("assistant", "", tool_uses=tuple(call)), {})
    reader.feed(2, Message("tool", "", tool_outputs=(ToolOutput("call_0", "a.py"),)), {})
    first = reader.turn_receipts
    reader.feed(3, Message("assistant", "", tool_uses=(ToolUse("call_1", "Bash", {"command": "ls -a"}),)), {})
    reader.feed(4, Message("tool", "", tool_outputs=(ToolOutput("call_1", "a.py .git"),)), {})
    assert reader.turn_receipts is first and list(first) == ["call_0", "call_1"]
    reader.feed(5, Message("assistant", "", tool_uses=tuple(call)), {})
    reader.feed(6, Message("tool", "", tool_outputs=(ToolOutput("call_0", "b.py"),)), {})
    assert reader.turn_receipts is not first and list(first) == ["call_0", "call_1"]
    assert reader.turn_receipts["call_0"].result_key != first["call_0"].result_key


def test_a_stored_state_round_trips_and_builds_nothing_but_proxyvisor_objects() -> None:
    state = SessionSupervision()
    state.notes["loop"] += 2
    version = os.urandom(16)
    decoded = decode(encode(state, version).value)
    back, got = decoded.state, decoded.version
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
    # Each thread is a pickle of its own inside the state, read back the same way.
    for thread, match in [(pickle.dumps(Evil()), "may not hold"), (pickle.dumps(Counter()), "not one")]:
        holder = SessionSupervision()
        holder.threads = session_state._StoredThreads((b"key",), (thread,))  # type: ignore[assignment]
        with pytest.raises(ValueError, match=match):
            decode(forged(pickle.dumps(holder)))
    with pytest.raises(ValueError):
        decode(b"short")
    # A state whose classes' source differs from this proxyvisor's (another version wrote it) is not used.
    with pytest.raises(ValueError, match="classes differ"):
        decode(forged(pickle.dumps(SessionSupervision()), digest="00" * 16))


def _not_a_database(database: Path) -> str:
    database.write_bytes(b"not a database, " * 4096)
    return "file is not a database"


def _damaged_pages(database: Path) -> str:
    """Every page but the first (the schema's) overwritten: the file opens, its tables cannot be read."""
    data = bytearray(database.read_bytes())
    data[4096:] = b"\xff" * (len(data) - 4096)
    database.write_bytes(bytes(data))
    return "database disk image is malformed"


@pytest.mark.parametrize("damage", [_not_a_database, _damaged_pages], ids=["not-a-database", "damaged-pages"])
async def test_a_store_whose_database_is_damaged_is_unavailable_and_the_warning_says_what_to_move_aside(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, damage) -> None:
    """SQLite's own errors (a database file damaged, a disk full or failing) are the store being unavailable, as an
    unwritable folder is: the session state's save is warned about and the session goes on from memory, rather
    than the error reaching the response's ``after`` step, or, through a waiting save, the next request. For a
    damaged file the warning says which folder to move aside (or delete) to start afresh, and nothing it held."""
    from proxyvisor.adapters.state import StateUnavailable
    from proxyvisor.proxy.sessions import Session

    kv = DiskBackend(tmp_path).kv(NAMESPACE, **SETTINGS)
    kv.set_many({f"s{n}": b"sk-secret-%d " % n * 40 for n in range(300)}, 60)  # pages past the first
    kv.close()
    database = tmp_path / NAMESPACE / "cache.db"
    said = damage(database)
    advice = (f"{database} cannot be read as a database ({said}); to start it afresh, stop proxyvisor, move the "
              f"folder {tmp_path / NAMESPACE} aside (or delete it: proxyvisor runs without what it held) and start "
              "proxyvisor again")
    with pytest.raises(StateUnavailable) as caught:
        kv.get("s1")
    assert str(caught.value) == advice
    with pytest.raises(StateUnavailable):
        kv.set_many({"s1": b"2"}, 60)
    states = SessionStates(kv, 60)
    session = Session("s1", 0.0, 0.0)
    session.supervision = SessionSupervision()
    with caplog.at_level(logging.WARNING):
        await states.save(session)  # warned, not raised
    assert session.state_version == b""
    [warning] = [r.getMessage() for r in caplog.records]
    assert warning == f"session states: {advice}; sessions go on with the state this process holds until it answers"
    assert "sk-secret" not in caplog.text


async def test_a_state_whose_classes_have_no_source_is_not_stored_and_raises_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """The state's format is a digest of its classes' source: a proxyvisor installed without the source of a
    module (bytecode only) cannot write it, and that is a state that cannot be stored (logged), not an error out
    of the save (which runs in a response's after step, or in the session's next request)."""
    from proxyvisor.proxy.sessions import Session

    def no_source(names: tuple[str, ...]) -> bytes:
        raise ValueError("no source for proxyvisor.detectors.receipts: no source file")

    monkeypatch.setattr(session_state, "_source_digest", no_source)
    states = SessionStates(DiskBackend(tmp_path).kv(NAMESPACE, **SETTINGS), 60)
    session = Session("s1", 0.0, 0.0)
    session.supervision = SessionSupervision()
    await states.save(session)
    assert session.state_version == b"" and "cannot be stored (ValueError: no source" in caplog.text
