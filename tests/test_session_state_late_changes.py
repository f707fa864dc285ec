"""A thread changed after the last save pickled it is pickled again (``proxyvisor.proxy.supervise.Thread.changes``),
however its request ends: cut off while its verify-gate waits for the verdict, or its stream closed by the client
while the verdict runs in the background. The encoding with the kept pickles must be a fresh one, and the state saved
at the request's end holds no gate still waiting for its verdict."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import orjson
import pytest
import trio

from proxyvisor.proxy import continuation
from proxyvisor.proxy.formats import BY_NAME
from proxyvisor.proxy.gating import ABANDONED, GateTurn
from proxyvisor.adapters.state import DiskBackend
from proxyvisor.proxy.pipeline import Pipeline
from proxyvisor.proxy.server import Request, Response
from proxyvisor.proxy.session_state import NAMESPACE, SETTINGS, SessionStates
from proxyvisor.proxy.sessions import Session
from proxyvisor.proxy.supervise import SessionSupervision, Supervisor

from helpers import ProxyRun, read_until_cut
from test_gate_proxy import DONE, Verifier, gated, verdict, with_history
from test_session_state_changes import _assert_cached_is_fresh

SESSION = "gate-test"


async def _call(pipeline: Pipeline, body: dict[str, Any], fmt: str = "chat") -> Response:
    headers = [(b"content-type", b"application/json"), (b"x-proxyvisor-session", SESSION.encode())]
    return await pipeline(Request("POST", BY_NAME[fmt].path, headers, orjson.dumps(body), time.perf_counter()))


async def _send(pipeline: Pipeline, body: dict[str, Any]) -> None:
    """One request through the pipeline as the server runs it: its answer read whole, its ``after`` step (the
    session's save) run."""
    response = await _call(pipeline, body)
    if not isinstance(response.body, bytes):
        async for _piece in response.body:
            pass
    if response.after is not None:
        await response.after()


def _other_thread() -> dict[str, Any]:
    """A request of another thread of the session (another system prompt): no tools, so nothing gates it."""
    return BY_NAME["chat"].request_from_chat([{"role": "system", "content": "You write titles."},
                                              {"role": "user", "content": "A title, please."}], "m", False, ())


def _state(pipeline: Pipeline) -> SessionSupervision:
    session = pipeline.sessions.get(SESSION)
    assert session is not None and session.supervision is not None
    return session.supervision


async def _verifying(verifier: Verifier) -> None:
    with trio.fail_after(10):
        while not verifier.calls:
            await trio.sleep(0.005)


async def _stored_gates(run: ProxyRun) -> list[GateTurn | None]:
    """The gate turns of the session's threads as a restarted proxy, or another replica, loads them."""
    restarted = Session(SESSION, 0.0, 0.0)
    await SessionStates(DiskBackend(run.store.root).kv(NAMESPACE, **SETTINGS), 60).load(restarted)
    assert restarted.supervision is not None
    return [t.gate_turn for t in restarted.supervision.threads.values()]


async def test_a_request_cut_off_mid_verdict_is_pickled_again_and_saved_with_its_verdict_abandoned(
        tmp_path: Path) -> None:
    """A JSON request cut off while its verdict is awaited, after another thread's request saved the session (its
    thread as it waited): the state is saved as the cut left it, no gate waiting, and pickled afresh."""
    verifier = Verifier([verdict()])
    verifier.release = trio.Event()  # the verdict never comes: the client leaves first
    async with gated(tmp_path, [DONE, {"text": "A title."}], verifier) as run:
        pipeline = run.proxy.pipeline
        ended = with_history("chat", False, "Fix the bug in app.py.", check="3 passed in 0.12s")
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_send, pipeline, ended)
            await _verifying(verifier)
            await _send(pipeline, _other_thread())  # saved meanwhile: the gated thread as it waits for its verdict
            nursery.cancel_scope.cancel()  # the client of the gated request leaves
        (thread,) = [t for t in _state(pipeline).threads.values() if t.gate_turn is None and t.tracker.fed > 2]
        _assert_cached_is_fresh(_state(pipeline))
        assert await _stored_gates(run) == [None, None]
        assert [line["status"] for line in run.ledger()] == [200, 499]


async def test_a_stream_closed_mid_verdict_is_saved_with_its_verdict_abandoned(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The save at the end of a stream the client closed while its verdict was awaited holds no gate waiting for
    that verdict (a restart, or another replica, loading it would refuse the retry's stop): the turn is unverified,
    as its ledger line says, and the kept pickles are a fresh encode."""
    monkeypatch.setattr(continuation, "KEEPALIVE_S", 0.01)
    verifier = Verifier([verdict()])
    verifier.release = trio.Event()
    async with gated(tmp_path, [DONE], verifier) as run:
        pipeline = run.proxy.pipeline
        response = await _call(pipeline, with_history("chat", True, "Fix the bug in app.py.",
                                                      check="3 passed in 0.12s"))
        assert not isinstance(response.body, bytes)
        stream = aiter(response.body)
        await anext(stream)  # a keep-alive: the verdict is under way
        await stream.aclose()  # the client leaves
        await pipeline.settle()  # the save at the stream's end
        assert [t.gate_turn for t in _state(pipeline).threads.values()] == [None]
        _assert_cached_is_fresh(_state(pipeline))
        assert await _stored_gates(run) == [None]
        (line,) = run.ledger()
    assert (line["status"], line["error"]) == (200, "client disconnected mid-stream")
    assert (line["gate"]["outcome"], line["gate"]["passed"], line["gate"]["reason"]) == ("unverified", False, ABANDONED)


async def test_a_stream_cut_while_the_gate_continues_its_turn_is_saved_with_its_verdict_abandoned(
        tmp_path: Path) -> None:
    """The client leaves while the turn the gate sent back streams its continued answer (held: hold = "answer"):
    the request's verdict never comes, so the turn is unverified, as its ledger line says, and its gate is
    forgotten: a retry of the request starts the turn's gate afresh, its re-entries not spent by a turn the client
    never saw."""
    stands = '{"findings": [{"id": 1, "status": "stands", "citation": ""}]}'
    verifier = Verifier([verdict("gaps", (("the fix is not shown", "a passing run"),))], [stands])
    stalled = {"fault": {"stall_after_events": 2, "stall_s": 30}}  # the continued answer stops coming
    async with gated(tmp_path, [DONE, stalled], verifier) as run:
        pipeline = run.proxy.pipeline
        response = await _call(pipeline, with_history("chat", True, "Fix the bug in app.py.",
                                                      check="3 passed in 0.12s"))

        async def continued() -> None:
            while len(run.upstream.requests) < 2:  # the turn continued upstream
                await trio.sleep(0.005)
            await trio.sleep(0.05)

        await read_until_cut(response, continued)  # the client leaves
        await pipeline.settle()
        assert [t.gate_turn for t in _state(pipeline).threads.values()] == [None]
        assert await _stored_gates(run) == [None]
        (line,) = run.ledger()
    assert (line["gate"]["outcome"], line["gate"]["passed"], line["gate"]["reason"]) == ("unverified", False, ABANDONED)
    assert line["gate"]["reentries"] == 1


async def test_a_supervision_failure_after_the_thread_changed_is_pickled_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A bug in supervision once the request's history was read into its thread (the request then goes up
    unsupervised, with no exchange to note over): the session's next save pickles the thread again."""
    verifier = Verifier()
    async with gated(tmp_path, [{"text": "Working."}] * 2, verifier, enabled=False) as run:
        pipeline = run.proxy.pipeline
        body = with_history("chat", False, "Fix the bug in app.py.")
        await _send(pipeline, body)  # saved: the thread's pickle kept
        begin = Supervisor.begin

        def failing(self: Supervisor, *args: Any, **kwargs: Any) -> Any:
            begin(self, *args, **kwargs)
            raise RuntimeError("a bug after the history was read")

        monkeypatch.setattr(Supervisor, "begin", failing)
        history = body["messages"] + [{"role": "assistant", "content": "Working."},
                                      {"role": "user", "content": "Go on."}]
        await _send(pipeline, {**body, "messages": history})
        _assert_cached_is_fresh(_state(pipeline))


async def test_a_load_ending_after_the_session_was_loaded_or_saved_meanwhile_leaves_the_newer_state(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two requests of a session at once each load the newer state another process stored: the one whose read
    ends last, after the other request changed the state it installed and saved it, does not put the state it read
    (now older) in place of the one in memory, which the store holds."""
    other, mine = (SessionStates(DiskBackend(tmp_path).kv(NAMESPACE, **SETTINGS), 60) for _ in range(2))
    stored = Session("s", 0.0, 0.0, supervision=SessionSupervision())
    stored.supervision.thread(b"k" * 16, frozenset()).carry = ("from the other process",)
    await other.save(stored)
    session = Session("s", 0.0, 0.0)
    held, release = threading.Event(), threading.Event()
    load = SessionStates._load

    def slow(self: SessionStates, *args: Any) -> Any:
        found = load(self, *args)
        if not held.is_set():  # the first read: it ends once the other request is over
            held.set()
            release.wait(10)
        return found

    monkeypatch.setattr(SessionStates, "_load", slow)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(mine.load, session)
        await trio.to_thread.run_sync(held.wait, 10)
        await mine.load(session)  # the other request: loads, changes and saves the state
        assert session.supervision is not None
        changed = session.supervision
        thread = next(iter(changed.threads.values()))
        thread.carry = ("changed here",)
        await mine.save(session)
        release.set()
    assert session.supervision is changed
    reader = Session("s", 0.0, 0.0)
    await other.load(reader)
    assert reader.supervision is not None and next(iter(reader.supervision.threads.values())).carry == (
        "changed here",)


class _Remote:
    """A store written in worker threads, as Redis is (``local`` False), whose first write waits for ``release``
    (a slow round trip) once it has set ``held``."""

    local = False

    def __init__(self, kv: Any) -> None:
        self.kv = kv
        self.held, self.release = threading.Event(), threading.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.kv, name)

    def set_many(self, *args: Any, **kwargs: Any) -> None:
        if not self.held.is_set():
            self.held.set()
            self.release.wait(10)
        self.kv.set_many(*args, **kwargs)


async def test_two_saves_of_a_session_at_once_store_the_later_state(tmp_path: Path) -> None:
    """Two requests of a session end at once on a store written in worker threads: the first save's write is
    slow; the second state, pickled later, is the one stored, under the version this process holds."""
    remote = _Remote(DiskBackend(tmp_path).kv(NAMESPACE, **SETTINGS))
    states = SessionStates(remote, 60)
    session = Session("s", 0.0, 0.0, supervision=SessionSupervision())
    thread = session.supervision.thread(b"k" * 16, frozenset())
    thread.carry = ("first",)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(states.save, session)
        await trio.to_thread.run_sync(remote.held.wait, 10)
        thread.carry = ("second",)
        nursery.start_soon(states.save, session)
        await trio.sleep(0.2)  # the second save's turn, while the first write waits
        remote.release.set()
    assert remote.kv.get("s:v") == session.state_version
    reader = Session("s", 0.0, 0.0)
    await SessionStates(DiskBackend(tmp_path).kv(NAMESPACE, **SETTINGS), 60).load(reader)
    assert reader.supervision is not None and next(iter(reader.supervision.threads.values())).carry == ("second",)
