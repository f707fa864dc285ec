"""A save pickles what changed (``proxyvisor.proxy.session_state``: each thread's pickle is kept until the thread
changes, ``Thread.changes``, and is not while a request holds it): over a long random session of several threads (sub-agents) driven through the proxy's
pipeline (tool rounds with and without self-reports, call ids used again, plan requests, ended turns and their
verify-gate, histories rewritten, upstream errors, two requests at once), with restarts and another process reading
the store, every encoding is byte for byte the one a fresh full encode makes, and what another process loads
equals the state the proxy holds."""

from __future__ import annotations

import enum
import os
import random
import subprocess
import sys
import time
from collections import deque
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import orjson
import pytest
import trio

from proxyvisor.adapters.state import DiskBackend, backend_of
from proxyvisor.config import Config
from proxyvisor.proxy import session_state
from proxyvisor.proxy.formats import BY_NAME, ToolSpec
from proxyvisor.proxy.server import Request
from proxyvisor.proxy.service import RunningProxy, running
from proxyvisor.proxy.session_state import NAMESPACE, SETTINGS, SessionStates, decode, encode
from proxyvisor.proxy.sessions import Session
from proxyvisor.proxy.supervise import SessionSupervision
from proxyvisor.scripted.upstream import ScriptedUpstream
from proxyvisor.store import Store

from redis_support import redis_server
from test_recite_prefix import report

SESSION = "changes"
BASH = ToolSpec("Bash", {"type": "object", "properties": {"command": {"type": "string"}}})
ITEMS = 160
OUTPUTS = ("3 passed in 0.12s", "1 failed, 2 passed in 0.3s", "src/a.py\nsrc/b.py", "", "Error: no such file")


def _plain(obj: Any) -> Any:
    """``obj`` as plain data to compare across processes: objects by class and pickled state, dicts in order, sets
    sorted."""
    if obj is None or isinstance(obj, (str, bytes, int, float, bool)):
        return obj
    if isinstance(obj, enum.Enum):
        return [type(obj).__qualname__, obj.value]
    if isinstance(obj, dict):
        return [type(obj).__name__, [[_plain(k), _plain(v)] for k, v in obj.items()]]
    if isinstance(obj, (set, frozenset)):
        return sorted(repr(_plain(v)) for v in obj)
    if isinstance(obj, (list, tuple, deque)):
        return [_plain(v) for v in obj]
    return [type(obj).__qualname__, _plain(obj.__getstate__())]


def plain_state(state_dir: str) -> str:
    """What another process loads of the session from ``state_dir``, as :func:`_plain` (printed when run as a
    script, by :func:`test_a_save_pickles_only_what_changed_and_loads_as_a_fresh_encode`)."""
    async def load() -> SessionSupervision | None:
        session = Session(SESSION, 0.0, 0.0)
        await SessionStates(DiskBackend(Path(state_dir)).kv(NAMESPACE, **SETTINGS), 60).load(session)
        return session.supervision
    return repr(_plain(trio.run(load)))


class _Thread:
    """One sub-agent's history (its own system prompt and task: a thread of the session), in ``fmt``."""

    def __init__(self, n: int, fmt: str, stream: bool) -> None:
        self.fmt, self.stream = BY_NAME[fmt], stream
        self.marker = f"[thread-{n}]"
        self.history: list[dict[str, Any]] = [{"role": "system", "content": f"You are sub-agent {n}."},
                                              {"role": "user", "content": f"{self.marker} Fix the tests, part {n}."}]
        self.calls: list[str] = []
        """The call ids of the current turn."""

    def body(self) -> bytes:
        history = orjson.loads(orjson.dumps(self.history))
        return orjson.dumps(self.fmt.request_from_chat(history, "m", self.stream, (BASH,)))

    def answer(self, rng: random.Random, n: int) -> dict[str, Any]:
        """The upstream's next answer to this thread: mostly a tool call (its id now and then one of the turn's
        again), with or without a self-report; sometimes the turn's end, an error."""
        roll = rng.random()
        if roll < 0.03:
            return {"fault": {"status": 400}, "marker": self.marker}
        text = rng.choice(["Working.", "Checking the tests. " + report(rng.choice(["progressing", "blocked"])),
                           "Planning. " + report(plan="request"), "Done with that. " + report("verifying")])
        if roll < 0.08:
            return {"text": "All fixed. " + report("done"), "marker": self.marker}
        call = rng.choice(self.calls) if self.calls and rng.random() < 0.05 else f"call_{n}"
        command = rng.choice(["pytest -q", "ls src", "cat src/a.py", "pytest -k parser"])
        return {"text": text, "tool_calls": [{"name": "Bash", "arguments": {"command": command}, "id": call}],
                "marker": self.marker}

    def answered(self, got: Any, rng: random.Random, n: int) -> None:
        """Append the answer ``got`` (an ``AssistantTurn``) and its tool results, a next task after a turn's end,
        and now and then a rewritten history (a compaction: the history cut back to a round's start; always past
        :data:`ITEMS`, which keeps the test's time bounded)."""
        calls = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": orjson.dumps(
            c.arguments).decode()}} for c in got.tool_calls]
        self.history.append({"role": "assistant", "content": got.text or None, **({"tool_calls": calls}
                                                                                   if calls else {})})
        self.history += [{"role": "tool", "tool_call_id": c["id"], "content": rng.choice(OUTPUTS)} for c in calls]
        self.calls += [c["id"] for c in calls]
        if not calls:
            self.history.append({"role": "user", "content": f"Next: part {n}."})
            self.calls = []
        if rng.random() < 0.03 or len(self.history) > ITEMS:
            starts = [i for i, m in enumerate(self.history) if i > 2 and m["role"] == "assistant"]
            if starts:
                del self.history[rng.choice(starts):]
                self.history.append({"role": "user", "content": f"(history compacted) Go on, {n}."})
                self.calls = []


async def _request(proxy: RunningProxy, thread: _Thread, rng: random.Random, n: int) -> None:
    """One request of ``thread`` through the pipeline, as the server runs it (its ``after`` step included)."""
    proxy.scripted["scripted"].queue(thread.answer(rng, n))
    headers = [(b"content-type", b"application/json"), (b"x-proxyvisor-session", SESSION.encode())]
    response = await proxy.pipeline(Request("POST", thread.fmt.path, headers, thread.body(), time.perf_counter()))
    if isinstance(response.body, bytes):
        content = response.body
    else:
        content = b"".join([piece async for piece in response.body])
    if response.after is not None:
        await response.after()
    if response.status != 200:
        return
    if thread.stream:
        from proxyvisor.proxy.sse import SSEParser
        got = thread.fmt.assemble([(e.event, e.data) for e in SSEParser().feed(content)])
    else:
        got = thread.fmt.parse_response(orjson.loads(content))
    thread.answered(got, rng, n)


def _assert_cached_is_fresh(state: SessionSupervision) -> None:
    """The encoding with the threads' kept pickles is one a fresh full encode makes (the kept ones are put back
    after it, as they were): the same format, chunks and state. (Not always the same bytes: a pickle read back
    from the store and kept may share a string object where a fresh pickle of what it built writes it again.)"""
    version = os.urandom(16)
    cached = encode(state, version)
    kept = dict(session_state._PICKLED)
    session_state._PICKLED.clear()
    try:
        fresh = encode(state, version)
    finally:
        session_state._PICKLED.clear()
        session_state._PICKLED.update(kept)
    size = 20 + int.from_bytes(fresh.value[16:20], "big")
    assert cached.value[:size] == fresh.value[:size], "the same format: version, classes, their digest"
    assert cached.chunks == fresh.chunks
    assert [c.digest for c in cached.unstored] == [c.digest for c in fresh.unstored]
    assert cached.value == fresh.value or _plain(decode(cached.value).state) == _plain(decode(fresh.value).state)


async def _session(proxy: RunningProxy) -> SessionSupervision:
    await proxy.pipeline.settle()
    session = proxy.pipeline.sessions.get(SESSION)
    assert session is not None and session.supervision is not None
    return session.supervision


@pytest.mark.parametrize(("backend", "steps"), [("diskcache", 2000), ("redis", 300)])
async def test_a_save_pickles_only_what_changed_and_loads_as_a_fresh_encode(tmp_path: Path, backend: str,
                                                                            steps: int) -> None:
    rng = random.Random(f"{backend}-12")
    threads = [_Thread(n, fmt, stream) for n, (fmt, stream) in
               enumerate([("chat", False), ("chat", True), ("messages", False), ("messages", True)])]
    with ExitStack() as stack:
        config = Config() if backend == "diskcache" else Config().with_overrides(
            state={"backend": "redis", "url": stack.enter_context(redis_server(tmp_path / "redis"))})
        n, restarts, reads = 0, 0, 0
        while n < steps:
            # Two proxies on one state (two replicas, or two proxies on one folder), the session going back and
            # forth between them; restarted together.
            async with running(config, port=0, store=Store(tmp_path / "state"),
                               scripted={"scripted": ScriptedUpstream(record=False)}) as one, \
                    running(config, port=0, store=Store(tmp_path / "state"),
                            scripted={"scripted": ScriptedUpstream(record=False)}) as two:
                while n < steps:
                    n += 1
                    proxy = one if rng.random() < 0.6 else two
                    if rng.random() < 0.1:  # two threads' requests at once (on one proxy: else the later save wins)
                        async with trio.open_nursery() as both:
                            for thread in rng.sample(threads, 2):
                                both.start_soon(_request, proxy, thread, rng, n)
                    else:
                        await _request(proxy, rng.choice(threads), rng, n)
                    state = await _session(proxy)
                    _assert_cached_is_fresh(state)
                    if rng.random() < 0.2:  # another process (another store on the folder, or Redis) reads it
                        reads += 1
                        other = Session(SESSION, 0.0, 0.0)
                        reader = SessionStates(backend_of(config, tmp_path / "state").kv(NAMESPACE, **SETTINGS), 60)
                        await reader.load(other)
                        reader.close()
                        assert other.supervision is not None
                        assert _plain(other.supervision) == _plain(state)
                    if rng.random() < 0.01:
                        restarts += 1
                        break
        assert restarts >= 2 and reads >= 50
    if backend == "diskcache":  # a real second process loads what the last save stored
        done = subprocess.run([sys.executable, "-c", "import sys, test_session_state_changes as t; "
                               "print(t.plain_state(sys.argv[1]))", str(tmp_path / "state")],
                              capture_output=True, text=True, timeout=60, check=True,
                              env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                  [str(Path(__file__).parent), *sys.path])})
        assert done.stdout.strip() == repr(_plain(state))
        assert decode(encode(state, bytes(16)).value).state.threads.keys() == state.threads.keys()
