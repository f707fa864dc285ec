"""A rewritten history (compaction, an edit, a summary in front, a dropped middle): the detectors' state and
outputs are those of a full recompute, whatever the receipts reused by content, reading it does not hold the
event loop for more than a few ms at a time, and a reading whose thread a load replaced meanwhile counts nothing
twice."""

from __future__ import annotations

import gc
import json
import random
import time
import tracemalloc
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
import trio

from proxyvisor.config import Config, SupervisorConfig
from proxyvisor.detectors import receipts
from proxyvisor.detectors.detectors import HistoryTracker, Update
from proxyvisor.proxy.formats import BY_NAME, CHAT, ToolSpec
from proxyvisor.proxy.server import Request
from proxyvisor.proxy.service import running
from proxyvisor.proxy.sessions import Session
from proxyvisor.proxy import supervise
from proxyvisor.proxy.supervise import SessionSupervision, Supervisor, Thread
from proxyvisor.proxy.session_state import decode, encode
from proxyvisor.scripted.upstream import ScriptedUpstream
from proxyvisor.store import Store
from proxyvisor.transcript import ToolOutput, ToolUse

History = list[dict[str, Any]]
RUNNER = {"type": "object", "properties": {"command": {"type": "string"}}}
NOT_RUNNER = {"type": "object", "properties": {"command": {"type": "string", "enum": ["ls", "make test"]}}}
COMMANDS = ["ls", "cat status", "make test", "pytest -q", "sed -i s/a/b/ x.py", "grep -r foo .", "deploy now"]
OUTPUTS = ["running", "running", "done at 12:00:01", "done at 12:00:07", "Exit code 1\nboom", "Exit code 1\nbang",
           "3 failed, 2 passed in 0.4s", "5 passed in 0.3s", "", "Traceback (most recent call last):\nX",
           "Exit code 0\nok"]
TEXTS = ["Checking.", "Checking.", "Let me look.", "I will try again."]


class Agent:
    """A random agent session in Chat messages: tool rounds (parallel ones, repeated calls and outputs, failures,
    missing results, call ids numbered again from 0), turns without tool calls, genuine user turns, re-prompts."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.ids = 0

    def _id(self) -> str:
        if self.rng.random() < 0.1:
            self.ids = 0  # a client numbering each round's calls from 0
        self.ids += 1
        return f"call_{self.ids}"

    def step(self) -> History:
        rng = self.rng
        kind = rng.random()
        if kind < 0.08:
            return [{"role": "user", "content": rng.choice(["Go on.", "Now fix the tests.", "Try another way."])}]
        if kind < 0.12:
            return [{"role": "user", "content": "Please always provide EXACTLY ONE action."}]
        if kind < 0.2:
            return [{"role": "assistant", "content": rng.choice(TEXTS)}]
        calls = [(self._id(), rng.choice(["Bash", "Bash", "Read", "Edit", "Deploy"]), rng.choice(COMMANDS))
                 for _ in range(rng.choice([1, 1, 1, 2, 3]))]
        out: History = [{"role": "assistant", "content": rng.choice([None, *TEXTS]), "tool_calls": [
            {"id": i, "type": "function", "function": {"name": name, "arguments": json.dumps(
                {"command": command} if name == "Bash" else {"file_path": command.split()[-1], "command": command})}}
            for i, name, command in calls]}]
        for i, _name, _command in calls:
            if rng.random() < 0.05:
                continue  # a result that never came
            result: dict[str, Any] = {"role": "tool", "tool_call_id": i, "content": rng.choice(OUTPUTS)}
            if rng.random() < 0.2:
                result["is_error"] = rng.choice([True, False])
            out.append(result)
        return out


def _summary(rng: random.Random) -> dict[str, Any]:
    return {"role": "user", "content": f"Summary of the conversation so far ({rng.randint(0, 9)}): tests were run."}


def _cut(rng: random.Random, history: History) -> int:
    return rng.randint(1, max(1, len(history) - 1))


REWRITES: dict[str, Callable[[random.Random, History], History]] = {
    "edit the first message": lambda rng, h: [{**h[0], "content": h[0]["content"] + " (edited)"}, *h[1:]],
    "edit an early message": lambda rng, h: [*h[:1], {**h[1], "content": "Fix the other bug."}, *h[2:]],
    "edit a message inside": lambda rng, h: (lambda i: [*h[:i], {**h[i], "content": "edited"}, *h[i + 1:]])(
        _cut(rng, h)),
    "compact: a summary after the first messages, the middle dropped": lambda rng, h: (
        [*h[:2], _summary(rng), *h[_cut(rng, h):]]),
    "a summary in front of the later part": lambda rng, h: [_summary(rng), *h[_cut(rng, h):]],
    "drop the middle": lambda rng, h: (lambda a, b: [*h[:a], *h[b:]])(*sorted((_cut(rng, h), _cut(rng, h)))),
    "drop the oldest rounds": lambda rng, h: [*h[:2], *h[min(len(h), 2 + rng.randint(1, 6)):]],
    "truncate": lambda rng, h: h[:_cut(rng, h)],
    "replace the last message": lambda rng, h: [*h[:-1], {"role": "user", "content": "Start over."}],
    "summary only": lambda rng, h: [h[0], _summary(rng)],
}


def _schemas(rng: random.Random) -> dict[str, Any]:
    return {"Bash": rng.choice([RUNNER, NOT_RUNNER])} if rng.random() < 0.8 else {}


def _state(tracker: HistoryTracker) -> tuple[Any, ...]:
    return (tracker.fed, tracker.turn_start, tracker.user_turns, tracker.reader.turn_receipts,
            tracker.reader._last_prompt, tracker.reader._answered, tracker.reader._tool_rounds_since_prompt,
            list(tracker.detectors._seen), list(tracker.detectors._window), dict(tracker.detectors._failed))


def _outputs(update: Update) -> tuple[Any, ...]:
    return update.rounds, update.firings, update.last, update.rebuilt, update.signals


def _recomputed(monkeypatch: pytest.MonkeyPatch, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` where a receipt cache made meanwhile keeps nothing: the full recompute."""
    with monkeypatch.context() as patch:
        patch.setattr(receipts, "POOL", receipts.ReceiptPool(0))
        return fn(*args, **kwargs)


def _recomputing(mutating: frozenset[str]) -> HistoryTracker:
    """A tracker whose receipt cache keeps nothing: every receipt computed."""
    return HistoryTracker(mutating, receipts.ReceiptCache(mutating, receipts.ReceiptPool(0)))


@pytest.mark.parametrize("seed", range(40))
def test_a_tracker_reusing_receipts_matches_a_full_recompute_over_random_rewrites(seed: int) -> None:
    """Two trackers fed the same requests, one reusing receipts by content, one recomputing every receipt; after
    every request their updates and their whole state agree, and after a rewrite both agree with a new tracker
    reading the history once. A reading abandoned part way (a cancelled request) leaves the state as it was."""
    rng = random.Random(seed)
    mutating = frozenset({"Deploy"}) if seed % 3 == 0 else frozenset()
    pool = receipts.ReceiptPool(receipts.CACHED_BYTES)
    agent, reusing = Agent(rng), HistoryTracker(mutating, receipts.ReceiptCache(mutating, pool))
    recomputing = _recomputing(mutating)
    history: History = [{"role": "system", "content": "You are an agent."}, {"role": "user", "content": "Fix it."}]
    rewrites = 0
    for request in range(60):
        if request % 12 == 11:
            history = REWRITES[rng.choice(sorted(REWRITES))](rng, history)
            rewrites += 1
        else:
            for _ in range(rng.randint(1, 3)):
                history = history + agent.step()
        schemas = _schemas(rng)
        if rng.random() < 0.2 and reusing.from_start(history, CHAT.message):
            before = _state(reusing)
            steps = reusing.updating(history, CHAT.message, schemas, Update())
            for _ in range(rng.randint(0, len(history) - 1)):
                next(steps)
            steps.close()
            assert _state(reusing) == before
        got = reusing.update(history, CHAT.message, schemas)
        want = recomputing.update(history, CHAT.message, schemas)
        assert _outputs(got) == _outputs(want), f"request {request}"
        assert _state(reusing) == _state(recomputing), f"request {request}"
        if got.rebuilt:
            fresh = _recomputing(mutating)
            once = fresh.update(history, CHAT.message, schemas)
            assert (once.rounds, once.firings, once.last) == (got.rounds, got.firings, got.last)
            assert _state(fresh) == _state(reusing)
            # Another thread of the session (a summary is now its first user message) shares the receipts.
            other = HistoryTracker(mutating, reusing.cache)
            assert _outputs(other.update(history, CHAT.message, schemas)) == _outputs(once)
            assert _state(other) == _state(fresh)
    assert rewrites == 5
    assert len(pool) > 0 and len(recomputing.cache.pool) == 0


def _bodies(fmt_name: str, seed: int) -> list[dict[str, Any]]:
    """A session's requests in ``fmt_name``: a loop of polls that the detectors steer, rewritten now and then."""
    rng = random.Random(seed)
    agent = Agent(rng)
    history: History = [{"role": "system", "content": "You are an agent."}, {"role": "user", "content": "Fix it."}]
    poll = [{"role": "assistant", "content": "Checking.", "tool_calls": [
        {"id": "call_p", "type": "function", "function": {"name": "Bash", "arguments": '{"command": "cat st"}'}}]},
        {"role": "tool", "tool_call_id": "call_p", "content": "running"}]
    out = []
    for request in range(30):
        if request % 7 == 6:
            history = REWRITES[rng.choice(sorted(REWRITES))](rng, history)
        else:
            history = history + (poll if rng.random() < 0.5 else agent.step())
        out.append(BY_NAME[fmt_name].request_from_chat(history, "m", False, (ToolSpec("Bash", RUNNER),)))
    return out


@pytest.mark.parametrize("fmt_name", ["chat", "messages"])
async def test_the_proxys_stepped_reading_steers_as_a_full_recompute(
        fmt_name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same session's requests through a supervisor that reads rewritten histories in steps reusing receipts
    (``catch_up`` then ``begin``, as the pipeline does) and one that reads them at once recomputing every receipt:
    the same upstream bodies (steer notes at the same places), firings and notes."""
    fmt = BY_NAME[fmt_name]
    stepped, whole = Supervisor(SupervisorConfig()), Supervisor(SupervisorConfig())
    sessions = Session("a", 0, 0), Session("b", 0, 0)
    notes = 0
    for seed in range(3):
        for body in _bodies(fmt_name, seed):
            mine, theirs = orjson.loads(orjson.dumps(body)), orjson.loads(orjson.dumps(body))
            got = stepped.begin(sessions[0], fmt, mine, reading=await stepped.catch_up(sessions[0], fmt, mine))
            want = _recomputed(monkeypatch, whole.begin, sessions[1], fmt, theirs)
            assert got.upstream_body() == want.upstream_body()
            assert (got.record.firings, got.record.note, got.record.note_index, got.record.rebuilt) == (
                want.record.firings, want.record.note, want.record.note_index, want.record.rebuilt)
            notes += got.record.note is not None
    assert notes > 0
    assert sessions[0].supervision.signals == sessions[1].supervision.signals


def _big_history(size: int) -> History:
    """A Chat history of about ``size`` bytes: tool rounds with outputs of a few hundred bytes to 40 KB."""
    rng = random.Random(5)
    words = "the file path command output tool agent returns string list integer error passed failed".split()
    history: History = [{"role": "system", "content": "You are an agent."}, {"role": "user", "content": "Fix it."}]
    total, n = 0, 0
    while total < size:
        n += 1
        lines = rng.randint(600, 1000) if n % 12 == 5 else rng.randint(5, 60)
        output = "\n".join(f"{i:5d} " + " ".join(rng.choices(words, k=rng.randint(4, 9))) for i in range(lines))
        history += [{"role": "assistant", "content": "Next.", "tool_calls": [
            {"id": f"call_{n}", "type": "function", "function": {
                "name": "Bash", "arguments": json.dumps({"command": f"cat src/m{rng.randint(0, 99)}.py"})}}]},
            {"role": "tool", "tool_call_id": f"call_{n}", "content": output}]
        total += len(output) + 200
    return history


async def test_reading_a_rewritten_4_mb_history_does_not_hold_the_event_loop() -> None:
    """A 4 MB history, then the same compacted (a summary after the first messages, the older half dropped) and
    with a summary in front: each is read from the start, and another task on the event loop never waits more than
    a few ms of CPU between two of its turns (about 6 measured, two steps of 2 ms and ``begin``; the whole reading,
    80 to 200 ms, at once before). CPU time of the loop's thread, not wall time: a loaded machine that stops the
    process for a while does not count; the bound leaves room for a newly booted virtual machine's page faults
    (as in test_reliability_big_events.py); the garbage collector is off meanwhile (a collection of the test
    process's objects is not the reading's work)."""
    fmt, supervisor, session = CHAT, Supervisor(SupervisorConfig()), Session("s", 0, 0)
    history = _big_history(4 * 1024 * 1024)
    half = len(history) // 2
    requests = [history, [*history[:2], {"role": "user", "content": "Summary: tests were run."}, *history[half:]],
                [{"role": "user", "content": "Summary: all of it."}, *history[half + 2:]]]
    bodies = [fmt.request_from_chat(h, "m", False, (ToolSpec("Bash", RUNNER),)) for h in requests]
    worst = 0.0
    turns = 0
    reading = True

    async def heartbeat(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        nonlocal worst, turns
        last = time.thread_time()
        task_status.started()  # the reading starts only now: its first stretch is measured too
        while reading:
            await trio.lowlevel.checkpoint()
            now = time.thread_time()
            worst, last = max(worst, now - last), now
            turns += 1

    gc.disable()
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(heartbeat)
            for body in bodies:
                found = await supervisor.catch_up(session, fmt, body)
                assert found.update is not None  # read from the start, in steps
                supervisor.begin(session, fmt, body, reading=found)
            reading = False
    finally:
        gc.enable()
    assert turns > 10  # the loop ran other tasks while the histories were read
    assert worst < 0.016, f"another task waited {worst * 1000:.1f} ms of CPU between two turns"


def _nested(depth: int) -> dict[str, Any]:
    """An argument object nested ``depth`` levels deep (a client's JSON may nest up to 1,024)."""
    inner: dict[str, Any] = {}
    for _ in range(depth):
        inner = {"a": inner}
    return inner


def test_calls_nested_too_deep_to_digest_are_never_taken_for_one_another() -> None:
    """Two calls of different tools, whose arguments nest deeper than a digest reads them (one digest for all such
    parts), and the same output: each gets its own receipt, as computed alone, not the other's."""
    mutating = frozenset({"Write"})
    cache = receipts.ReceiptCache(mutating)
    output = ToolOutput("c", "ok")
    calls = [ToolUse("c1", "Bash", {"command": "pytest -q", "x": _nested(1100)}),
             ToolUse("c2", "Write", {"file_path": "app.py", "x": _nested(1100)})]
    got = [cache.receipt(use, output, None) for use in calls]
    assert got == [receipts.receipt(use, output, None, mutating) for use in calls]
    assert [(r.tool, r.mutation, r.target) for r in got] == [("Bash", "none", ()), ("Write", "declared", ("app.py",))]


def test_the_receipt_pool_keeps_a_bounded_amount_of_command_text() -> None:
    """Commands of 64 KB (a file written through the shell): a pool of 1 MiB keeps the latest 15, and a receipt
    it no longer keeps is computed again, the same."""
    cache = receipts.ReceiptCache(pool=receipts.ReceiptPool(1 << 20))
    uses = [ToolUse(f"c{n}", "Bash", {"command": f"cat > f{n}.py <<EOF\n{'x' * 65536}\nEOF"}) for n in range(40)]
    output = ToolOutput("c", "")
    got = [cache.receipt(use, output, RUNNER) for use in uses]
    assert len(cache.pool) == 15 and cache.pool.size <= 1 << 20  # 16 commands are over 1 MiB
    assert cache.receipt(uses[0], output, RUNNER) == got[0] and cache.receipt(uses[0], output, RUNNER) is not got[0]
    assert cache.receipt(uses[-1], output, RUNNER) is got[-1]


def test_a_receipt_larger_than_the_pool_is_not_kept_and_drops_nothing() -> None:
    """A command over the pool's whole bound (a file of 2 MiB written through the shell) is computed each time it is
    read, and the receipts the pool kept stay."""
    cache = receipts.ReceiptCache(pool=receipts.ReceiptPool(1 << 20))
    output = ToolOutput("c", "")
    small = [ToolUse(f"c{n}", "Bash", {"command": f"pytest tests/test_{n}.py"}) for n in range(10)]
    kept = [cache.receipt(use, output, RUNNER) for use in small]
    huge = ToolUse("big", "Bash", {"command": f"cat > big.py <<EOF\n{'x' * (2 << 20)}\nEOF"})
    first = cache.receipt(huge, output, RUNNER)
    assert (len(cache.pool), cache.pool.size <= 1 << 20) == (10, True)
    assert cache.receipt(huge, output, RUNNER) == first
    assert all(cache.receipt(use, output, RUNNER) is got for use, got in zip(small, kept))


def _call(session: int, n: int) -> tuple[ToolUse, ToolOutput]:
    """Call ``n`` of a session: its arguments parsed from JSON (strings of their own, as a request's are), its
    result 1 KB of text (which no receipt keeps)."""
    arguments = orjson.loads(orjson.dumps({"command": f"pytest tests/test_{session}_{n}.py -q"}))
    return ToolUse(f"c{n}", "Bash", arguments), ToolOutput(f"c{n}", "." * 1024 + f"\n{n} passed")


def test_many_sessions_receipts_stay_within_the_pools_bound_while_each_reuses_its_own() -> None:
    """200 sessions of 30 calls each, over a pool of 1 MiB (about a quarter of what they compute): the memory the
    caches hold (traced) stays within the bound (give or take what the pool cannot count), each session finds its
    latest receipts again (the same objects) while sessions long idle lost theirs, and a session never gets
    another's receipt for the same content."""
    limit, sessions, calls = 1 << 20, 200, 30
    watched = (0, 1, sessions - 2, sessions - 1)
    pool = receipts.ReceiptPool(limit)
    caches = [receipts.ReceiptCache(pool=pool) for _ in range(sessions)]
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        first: dict[int, list[receipts.Receipt]] = {}
        for s, cache in enumerate(caches):
            got = [cache.receipt(*_call(s, n), RUNNER) for n in range(calls)]
            if s in watched:
                first[s] = got
        # Besides the pool: the receipts of the two watched sessions it dropped, held here (600 bytes each).
        held = tracemalloc.get_traced_memory()[0] - before - 2 * calls * 600
    finally:
        tracemalloc.stop()
    # The pool counts each receipt by its measured size (ENTRY_BYTES); what it cannot see, its table growing in steps
    # and the interpreter's own caches traced meanwhile, is a few percent either way.
    assert pool.size <= limit and 0.9 * limit <= held <= 1.05 * limit, (pool.size, held)
    assert len(pool) < sessions * calls // 3
    for s in watched:  # idle since the start: computed again; used last: the very same receipts
        again = [caches[s].receipt(*_call(s, n), RUNNER) for n in range(calls)]
        assert again == first[s]
        assert all((a is b) == (s >= sessions - 2) for a, b in zip(again, first[s]))
    other = receipts.ReceiptCache(pool=pool)
    assert other.receipt(*_call(sessions - 1, calls - 1), RUNNER) is not first[sessions - 1][-1]
    assert pool.size <= limit


def test_a_loaded_state_gives_its_threads_one_receipt_cache_this_processs_own() -> None:
    """Each thread is stored pickled on its own: loaded, the session's threads share one receipt cache again (a
    compaction, another thread, finds the receipts of the calls its thread read), and a load replacing the state
    this process holds keeps its cache and what it computed."""
    mutating = frozenset({"Deploy"})
    history = _big_history(20_000)
    state = SessionSupervision(receipts=receipts.ReceiptCache(mutating, receipts.ReceiptPool(1 << 30)))
    for key in (b"a" * 16, b"b" * 16):
        state.thread(key, mutating).tracker.update(history, CHAT.message, {"Bash": RUNNER})
    value = encode(state, bytes(16)).value
    for held in (None, state):
        loaded = decode(value, held).state
        assert loaded.receipts is not None and loaded.receipts is (state.receipts if held else loaded.receipts)
        for thread in loaded.threads.values():
            assert thread.tracker.cache is loaded.receipts and thread.tracker.reader.cache is loaded.receipts
    compacted = [history[0], {"role": "user", "content": "Summary: tests were run."}, *history[2:]]
    kept = len(state.receipts.pool)
    loaded.thread(b"c" * 16, mutating).tracker.update(compacted, CHAT.message, {"Bash": RUNNER})
    assert len(loaded.receipts.pool) == kept  # every receipt found, none computed again


async def test_two_requests_of_a_thread_reading_one_rewritten_history_at_once_judge_it_once() -> None:
    """Two requests of one thread with the same history read from the start (a summary in front: the thread's
    first; the second a retry while the first still reads it), read in steps at once: the second goes on from what
    the first read, as when they come one after the other (nothing new: no firings again, the session's signal
    counts not doubled)."""
    poll = [{"role": "assistant", "content": "Checking.", "tool_calls": [
        {"id": "call_p", "type": "function", "function": {"name": "Bash", "arguments": '{"command": "cat st"}'}}]},
        {"role": "tool", "tool_call_id": "call_p", "content": "running"}]
    history = _big_history(1024 * 1024) + poll * 4
    rewritten = [{"role": "user", "content": "Summary: tests were run."}, *history[2:]]
    bodies = [CHAT.request_from_chat(h, "m", False, (ToolSpec("Bash", RUNNER),)) for h in (history, rewritten)]
    records = {}
    for together in (False, True):
        supervisor, session = Supervisor(SupervisorConfig()), Session("s", 0, 0)
        supervisor.begin(session, CHAT, orjson.loads(orjson.dumps(bodies[0])))
        got = []

        async def request(supervisor: Supervisor = supervisor, session: Session = session,
                          got: list[Any] = got) -> None:
            body = orjson.loads(orjson.dumps(bodies[1]))
            record = supervisor.begin(session, CHAT, body, reading=await supervisor.catch_up(session, CHAT, body)).record
            got.append((record.firings, record.rebuilt))

        if together:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(request)
                nursery.start_soon(request)
        else:
            await request()
            await request()
        assert session.supervision is not None
        records[together] = got, session.supervision.signals
    assert records[False][0][0][0] and records[False][0][1] == ([], False)  # the loop fired on the first reading
    assert records[True] == records[False]


def polling(rounds: int = 6) -> History:
    """A Chat history of ``rounds`` polls of a build that is still running: the loop detector fires."""
    history: History = [{"role": "system", "content": "You are an agent."}, {"role": "user", "content": "Wait."}]
    for n in range(rounds):
        history += [{"role": "assistant", "content": "Checking.", "tool_calls": [{"id": f"call_{n}", "type": "function",
                     "function": {"name": "Bash", "arguments": '{"command": "cat st"}'}}]},
                    {"role": "tool", "tool_call_id": f"call_{n}", "content": "running"}]
    return history


def paused_reading(monkeypatch: pytest.MonkeyPatch) -> tuple[trio.Event, trio.Event]:
    """(paused, released): the next history read from the start in steps (``Supervisor.catch_up``) lets the event
    loop run after each item and, after its third, sets ``paused`` and waits until ``released`` is set (10 s at
    most), letting the loop run meanwhile."""
    monkeypatch.setattr(supervise, "RUN_S", 0.0)
    reading, paused, released = HistoryTracker.updating, trio.Event(), trio.Event()

    def updating(self: HistoryTracker, *args: Any) -> Iterator[None]:
        for n, step in enumerate(reading(self, *args)):
            yield step
            if n == 2 and not paused.is_set():
                paused.set()
                deadline = time.monotonic() + 10
                while not released.is_set() and time.monotonic() < deadline:
                    yield

    monkeypatch.setattr(HistoryTracker, "updating", updating)
    return paused, released


@pytest.mark.parametrize("loaded_thread", ["kept", "replaced", "fresh"])
async def test_a_stepped_reading_whose_thread_a_load_replaced_reads_the_new_one(
        loaded_thread: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The session's state replaced while a history is read in steps (a load of another process's state): a thread
    the new state keeps (its stored pickle this process's own) has the reading's firings counted; one it replaced
    having read the same history goes on from it (none counted again); one it replaced that has not read it reads
    it again, in steps too (the event loop runs between them), its firings counted once."""
    history = polling()
    body = CHAT.request_from_chat(history, "m", False, (ToolSpec("Bash", RUNNER),))
    supervisor, session = Supervisor(SupervisorConfig()), Session("s", 0, 0)
    paused, released = paused_reading(monkeypatch)
    turns = 0  # of the event loop, by another task
    steps: list[list[int]] = []  # per reading of a history: the loop's turns at each of its steps
    reading_of = HistoryTracker.updating

    def updating(self: HistoryTracker, *args: Any) -> Iterator[None]:
        steps.append([])
        for step in reading_of(self, *args):
            steps[-1].append(turns)
            yield step

    monkeypatch.setattr(HistoryTracker, "updating", updating)
    got = []

    async def request() -> None:
        mine = orjson.loads(orjson.dumps(body))
        reading = await supervisor.catch_up(session, CHAT, mine)
        got.append(supervisor.begin(session, CHAT, mine, reading=reading).record.firings)

    async def heartbeat() -> None:
        nonlocal turns
        while not got:
            await trio.lowlevel.checkpoint()
            turns += 1

    async with trio.open_nursery() as nursery:
        nursery.start_soon(request)
        await paused.wait()
        assert session.supervision is not None
        (key, thread), = session.supervision.threads.items()
        loaded = SessionSupervision()
        if loaded_thread == "kept":
            loaded.threads[key] = thread
        else:  # another process's thread: it read the same history and counted its firings, or nothing yet
            other = loaded.threads[key] = Thread(HistoryTracker(supervisor.mutating_tools))
            if loaded_thread == "replaced":
                loaded.signals.update(s for f in other.tracker.update(history, CHAT.message, {"Bash": RUNNER}).firings
                                      for s in f.signals)
        counted = loaded.signals.copy()
        session.supervision = loaded
        nursery.start_soon(heartbeat)
        released.set()
    assert loaded.signals["loop"] > 0
    if loaded_thread == "replaced":
        assert got == [[]] and loaded.signals == counted
    else:
        assert got[0] and loaded.signals == counted + Counter(s for _i, fired in got[0] for s in fired)
    if loaded_thread == "fresh":
        assert steps[-1][-1] > steps[-1][0], "the new thread's reading held the event loop"


async def test_a_request_cut_off_while_its_history_is_read_in_steps_has_its_ledger_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The client leaves while its request's history is read from the start in steps (``Supervisor.catch_up``,
    before anything is forwarded): the request's one ledger line says so (499), as for one cut off in a later step,
    and the thread is as before it (its next request reads the history from the start)."""
    paused, _released = paused_reading(monkeypatch)
    body = orjson.dumps(CHAT.request_from_chat(polling(), "m", False, (ToolSpec("Bash", RUNNER),)))
    headers = [(b"content-type", b"application/json"), (b"x-proxyvisor-session", b"cut")]
    async with running(Config(), port=0, store=Store(tmp_path / "state"),
                       scripted={"scripted": ScriptedUpstream()}) as proxy:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(proxy.pipeline, Request("POST", CHAT.path, headers, body, time.perf_counter()))
            with trio.fail_after(10):
                await paused.wait()
            nursery.cancel_scope.cancel()  # the client leaves
        assert proxy.pipeline.store is not None
        lines = proxy.pipeline.store.read_ledger("cut")
        assert not proxy.scripted["scripted"].requests
        session = proxy.pipeline.sessions.get("cut")
        assert session is not None and session.supervision is not None
        (thread,) = session.supervision.threads.values()
        assert thread.tracker.fed == 0
    assert [(line["status"], line["error"]) for line in lines] == [(499, "cancelled before the answer: the client left")]
