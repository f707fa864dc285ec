"""Big SSE events: a supervised stream's work per event is linear in the event's size, an event past
``MAX_BUFFERED_BODY`` ends the stream with the format's error event (everything before it delivered), and a line
that never ends stops being read at that size instead of filling memory. So does a JSON answer past it (502).

What each test pins is listed in ``docs/reliability.md``.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import orjson
import pytest
import trio

from proxyvisor.detectors.selfreport import Stripper, strip
from proxyvisor.proxy import limits
from proxyvisor.proxy.formats import BY_NAME, AssistantTurn
from proxyvisor.proxy.server import Request, Response
from proxyvisor.proxy import allocator
from proxyvisor.proxy.sse import SSEParser
from proxyvisor.proxy.reply import Blocks, Edited, Encoded

from helpers import (FORMATS, MODEL, HugeEventUpstream, assert_ends_with_error_event, assert_error_shape, http_client,
                     path_of, raw_stream, request_body, serve_handler, sse_events)

ALL_FORMATS = pytest.mark.parametrize("fmt", FORMATS)
allocator.tune()  # the allocator settings serve and wrap run with, made before any test starts a thread
_SSE = [(b"content-type", b"text/event-stream")]
LIMIT = 64 * 1024
BIG_WORD = "x" * (2 * LIMIT)


def _big_event_stream(size: int, piece: int) -> tuple[bytes, list[bytes]]:
    """A Chat stream with one content delta of ``size`` bytes, and the same bytes cut into ``piece``-byte reads."""
    head = b'data: {"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"'
    tail = b'"},"finish_reason":null}]}\n\n'
    data = head + b"y" * size + tail + b"data: [DONE]\n\n"
    return data, [data[i:i + piece] for i in range(0, len(data), piece)]


async def test_a_big_event_in_small_reads_is_edited_in_linear_time() -> None:
    """16 MB in 4 KiB reads: joining the pending event on every read (quadratic) copies about 32 GB, tens of
    seconds; scanning only the new bytes takes well under a second. The bound is on this process's CPU time, which
    a loaded machine does not inflate as it does wall time."""
    data, pieces = _big_event_stream(16 * 1024 * 1024, 4096)

    async def upstream():
        for piece in pieces:
            yield piece
            await trio.sleep(0)

    editor = BY_NAME["chat"].stream_editor(Stripper, lambda text: strip(text)[0])
    stream = Encoded(Edited(Blocks(upstream()), editor, lambda _complete: None))
    started = time.process_time()
    with trio.fail_after(60):  # guards a hang only
        out = b"".join([chunk async for chunk in stream])
    assert time.process_time() - started < 5
    assert out == data and stream.error is None
    parser, events, started = SSEParser(), [], time.process_time()
    for piece in pieces:  # the parser the pipeline reads usage with, fed the raw reads
        events += parser.feed(piece)
    assert time.process_time() - started < 5
    assert [len(e.data) for e in events] == [len(data.split(b"\n\n")[0]) - len(b"data: "), len("[DONE]")]


class BigEventUpstream:
    """Streams a turn whose text has one word of ``2 * LIMIT`` bytes, so one delta event is past the limit.
    ``endless`` sends, after the events before that one, a data line that never ends, until it is no longer
    read; ``stopped`` is set when the upstream's body was closed."""

    def __init__(self, fmt: str, endless: bool = False) -> None:
        self.fmt = BY_NAME[fmt]
        self.endless = endless
        self.stopped = trio.Event()
        self.before = b""

    async def __call__(self, request: Request) -> Response:
        events = self.fmt.render_stream(AssistantTurn(f"Here: {BIG_WORD} done."), MODEL, orjson.loads(request.body))
        big = next(i for i, event in enumerate(events) if BIG_WORD.encode() in event)
        self.before = b"".join(events[:big])

        async def play():
            try:
                yield self.before
                if self.endless:
                    yield b"data: "
                    while True:
                        yield b"z" * 8192
                        await trio.sleep(0)
                else:
                    for event in events[big:]:
                        yield event
            finally:
                self.stopped.set()

        return Response(200, _SSE, play())


@ALL_FORMATS
@pytest.mark.parametrize("gate", [False, True], ids=["edited", "gated"])
async def test_an_event_over_the_limit_ends_the_stream_with_the_formats_error_event_after_all_before_it(
        fmt: str, gate: bool, start_proxy, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(limits, "MAX_BUFFERED_BODY", LIMIT)
    upstream = BigEventUpstream(fmt)
    async with serve_handler(upstream) as url, start_proxy(upstream_url=url, gate=gate) as rp:
        with trio.fail_after(10):
            reply, data = await raw_stream(rp.url + "/s/big", fmt, request_body(fmt, stream=True))
        assert reply.status_code == 200
        assert data.startswith(upstream.before)  # every event before the big one, byte for byte
        assert_ends_with_error_event(fmt, data)
        assert len(sse_events(data[len(upstream.before):])) == 1  # then only the error event
        assert f"larger than {LIMIT} bytes" in sse_events(data)[-1].data
        (record,) = rp.pipeline.store.read_ledger("big")
        assert record["status"] == 502 and f"larger than {LIMIT} bytes" in record["error"]


@ALL_FORMATS
async def test_a_line_that_never_ends_is_read_only_up_to_the_limit(
        fmt: str, start_proxy, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(limits, "MAX_BUFFERED_BODY", LIMIT)
    upstream = BigEventUpstream(fmt, endless=True)
    async with serve_handler(upstream) as url, start_proxy(upstream_url=url) as rp:
        with trio.fail_after(10):
            reply, data = await raw_stream(rp.url + "/s/endless", fmt, request_body(fmt, stream=True))
            await upstream.stopped.wait()  # proxyvisor closed the upstream's stream: nothing more is held
        assert reply.status_code == 200 and data.startswith(upstream.before)
        assert_ends_with_error_event(fmt, data)
        assert b"zzz" not in data


async def test_a_json_answer_over_the_limit_gives_502(start_proxy, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(limits, "MAX_BUFFERED_BODY", LIMIT)

    async def upstream(request: Request) -> Response:
        return Response(200, [(b"content-type", b"application/json")],
                        orjson.dumps({"choices": [{"message": {"content": BIG_WORD}}]}))

    async with serve_handler(upstream) as url, start_proxy(upstream_url=url) as rp:
        reply, data = await raw_stream(rp.url + "/s/json", "chat", request_body("chat"))
    assert reply.status_code == 502
    assert f"exceeds {LIMIT} bytes" in assert_error_shape("chat", 502, data)["message"]


def _bounded_orjson(monkeypatch: pytest.MonkeyPatch, module: object) -> list[int]:
    """Record the size of every ``orjson.loads`` / ``orjson.dumps`` input in ``module`` (a string's length; an
    object's longest string), calling the real functions."""
    sizes: list[int] = []
    real_loads, real_dumps = orjson.loads, orjson.dumps

    def longest(value: object) -> int:
        if isinstance(value, str):
            return len(value)
        if isinstance(value, dict):
            return max([longest(k) + longest(v) for k, v in value.items()] or [0])
        if isinstance(value, list):
            return max([longest(v) for v in value] or [0])
        return 0

    def loads(text: str | bytes) -> object:
        sizes.append(len(text))
        return real_loads(text)

    def dumps(value: object) -> bytes:
        sizes.append(longest(value))
        return real_dumps(value)

    fake = type("orjson", (), {"loads": staticmethod(loads), "dumps": staticmethod(dumps),
                               "JSONDecodeError": orjson.JSONDecodeError})
    monkeypatch.setattr(module, "orjson", fake)
    return sizes


async def test_a_big_event_is_read_and_rewritten_in_bounded_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """One Chat delta of 40 slices, with escapes, a multi-byte character and a self-report, through a supervised
    stream editor with the big-event thresholds made small: no JSON parse or write ever sees more than about one
    slice of it (each such step holds Python's interpreter lock, so a whole-event one stops the event loop even
    from a worker thread), no whole-event decode happens, and the client gets exactly what the whole-event path
    gives: the event rewritten without the report, byte for byte."""
    from proxyvisor.proxy import reply, sse
    from proxyvisor.proxy.formats import largejson

    slice_ = 4096
    monkeypatch.setattr(largejson, "SLICE", slice_)
    monkeypatch.setattr(largejson, "LONG", 512)
    monkeypatch.setattr(sse, "DECODE_SLICE", slice_)
    monkeypatch.setattr(reply, "OFF_LOOP_BYTES", slice_)
    text = ('say "hi"\\n to é and \U0001F600 ' * 5000)[:40 * slice_] + ' <sup>{"state": "done"}</sup>'
    chunk = {"id": "c", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": text},
                                                                        "finish_reason": None}]}
    data = b"data: " + orjson.dumps(chunk) + b"\n\n" + b"data: [DONE]\n\n"
    expected = dict(chunk, choices=[dict(chunk["choices"][0], delta={"content": strip(text)[0]})])
    sizes = _bounded_orjson(monkeypatch, largejson)
    decoded: list[int] = []
    real_str = str

    class CountingStr(str):  # str(view, "utf-8", ...) is the parser's one-shot decode of a line
        def __new__(cls, *args: object) -> str:
            if len(args) == 3:
                decoded.append(len(args[0]))  # type: ignore[arg-type]
            return real_str(*args)

    monkeypatch.setattr(sse, "str", CountingStr, raising=False)

    async def upstream():
        for i in range(0, len(data), 3000):
            yield data[i:i + 3000]
            await trio.sleep(0)

    editor = BY_NAME["chat"].stream_editor(Stripper, lambda t: strip(t)[0])
    stream = Encoded(Edited(Blocks(upstream()), editor, lambda _complete: None))
    with trio.fail_after(30):
        pieces = [piece async for piece in stream]
    assert stream.error is None
    events = sse_events(b"".join(pieces))
    assert [orjson.loads(e.data) for e in events[:-1]] == [expected] and events[-1].data == "[DONE]"
    assert b"".join(pieces) == b"data: " + orjson.dumps(expected) + b"\n\n" + b"data: [DONE]\n\n"
    assert sizes and max(sizes) <= 2 * slice_, "a JSON step covered the whole event"
    assert max(decoded, default=0) <= slice_, "the event's data was decoded whole"
    assert max(map(len, pieces)) <= slice_, "a write to the client carried the whole event"


def test_large_json_reads_and_writes_as_orjson_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """The sliced reader and writer give orjson's object, bytes and errors: long strings with escapes of every
    kind (surrogate pairs at every cut), long keys, dense escaped quotes, and broken texts."""
    from proxyvisor.proxy.formats import largejson

    monkeypatch.setattr(largejson, "SLICE", 16)
    monkeypatch.setattr(largejson, "LONG", 8)
    monkeypatch.setattr(largejson, "_DENSE", 2)
    alphabet = ["a", " ", '"', "\\", "\n", "é", "\U0001F600", "\u2028", "\x01", "/", "<", "\x00"]
    for n in range(400):
        value = "".join(alphabet[(n * 7 + i * i) % len(alphabet)] for i in range(n % 97))
        obj = {"choices": [{"delta": {"content": value, value[:20]: [value[::-1], 1.5, None]}}], "n": [True]}
        encoded = orjson.dumps(obj)
        assert b"".join(largejson.dumps(obj)) == encoded
        text = encoded.decode()
        assert largejson.loads(text) == obj
        for cut in (len(text) // 3, len(text) // 2, len(text) - 2):  # broken texts fail as orjson fails
            broken = text[:cut] + '"' + text[cut + 1:]
            try:
                want: object = orjson.loads(broken)
            except orjson.JSONDecodeError:
                want = orjson.JSONDecodeError
            try:
                got: object = largejson.loads(broken)
            except orjson.JSONDecodeError:
                got = orjson.JSONDecodeError
            assert got == want


_FRESH = "PROXYVISOR_TEST_FRESH_PROCESS"
"""Set (to the format) in the process that runs the big-event loop test itself."""


@pytest.mark.parametrize("fmt", ["chat", "messages"])
async def test_the_event_loop_runs_between_the_bounded_steps_of_a_big_events_work(
        fmt: str, start_proxy, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A 64 MB event relayed through a supervised proxy, with the interpreter's switch interval made longer than the
    whole relay: a worker thread then keeps the interpreter lock until it lets go of it, so the event loop (which
    serves every other session) runs only where the work on the event stops on its own. That work goes a bounded
    step at a time and lets the loop go first between steps: the CPU time worker threads spend between two turns of
    the loop stays under 24 ms, where one whole-event step (a join, a decode) takes 28 to 34 ms. (Two steps and the
    2 ms a worker works before yielding may fall between two turns, when it found the loop idle; a step is 1 to 4
    ms, up to 9 ms on a machine whose memory other processes keep busy: the system's own time in remapping and
    freeing pages, CPU time all the same.) The loop's own CPU per turn stays small too. CPU time, not wall time: a
    loaded machine that stops the process for a while does not count. The client gets the text without its
    report.

    It runs in a process of its own, as a proxy starts: in one whose heap earlier tests left with big free regions,
    the allocator may place a growing string in one, and copy it whole when it outgrows it (``bigtext.concat``).
    Not Responses: its four events that repeat the whole text still meet such a copy now and then (10 to 23 ms)."""
    if os.environ.get(_FRESH) != fmt:
        test = f"{__file__}::test_the_event_loop_runs_between_the_bounded_steps_of_a_big_events_work[{fmt}]"
        run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--basetemp",
                              str(tmp_path / "run"), test], env={**os.environ, _FRESH: fmt}, capture_output=True,
                             text=True, timeout=300)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
        return
    upstream = HugeEventUpstream(fmt, 64 * 1024 * 1024)
    started: dict[int, float] = {}  # worker threads (trio keeps them between calls): CPU time when first seen
    real_run_sync = trio.to_thread.run_sync

    async def recorded(fn, *args, **kwargs):
        def run(*inner):
            started.setdefault(threading.get_ident(), time.thread_time())
            return fn(*inner)
        return await real_run_sync(run, *args, **kwargs)

    monkeypatch.setattr(trio.to_thread, "run_sync", recorded)

    def worker_cpu(before: dict[int, float]) -> dict[int, float]:
        now = {}
        for ident in started:
            try:
                now[ident] = time.clock_gettime(time.pthread_getcpuclockid(ident))
            except OSError:  # a thread that ended: it no longer runs
                now[ident] = before.get(ident, started[ident])
        return now

    worst_worker = worst_loop = 0.0
    done = trio.Event()

    async def heartbeat() -> None:
        nonlocal worst_worker, worst_loop
        worker = worker_cpu({})
        while not done.is_set():
            loop = time.thread_time()
            await trio.sleep(0.001)
            now = worker_cpu(worker)
            worst_worker = max(worst_worker, sum(cpu - worker.get(i, started[i]) for i, cpu in now.items()))
            worst_loop = max(worst_loop, time.thread_time() - loop)
            worker = now

    interval = sys.getswitchinterval()
    async with serve_handler(upstream) as url, start_proxy(upstream_url=url) as rp, trio.open_nursery() as nursery:
        sys.setswitchinterval(5.0)
        gc.disable()  # a collection of this test process's objects holds the lock for long: not the event's work
        try:
            nursery.start_soon(heartbeat)
            with trio.fail_after(120):  # guards a hang only
                async with http_client() as client, client.stream(
                        "POST", rp.url + "/s/huge" + path_of(fmt), json=request_body(fmt, stream=True)) as reply:
                    chunks = [chunk async for chunk in reply.aiter_raw()]  # (joined after: not a step of the proxy)
            done.set()
        finally:
            gc.enable()
            sys.setswitchinterval(interval)
    assert reply.status_code == 200
    data = b"".join(chunks)
    turn = BY_NAME[fmt].assemble([(e.event, e.data) for e in sse_events(data)])
    assert turn.text == strip(upstream.full)[0] and b"<sup>" not in data
    assert worst_worker < 0.024, f"worker threads held the event loop for {worst_worker * 1000:.1f} ms of CPU at once"
    assert worst_loop < 0.03, f"the event loop spent {worst_loop * 1000:.1f} ms of CPU in one turn"


class _LoopSteps(trio.abc.Instrument):
    """The longest step (thread CPU time) of any task but ``skipped`` (the test's own, whose client reads the
    reply), and the task it was."""

    def __init__(self, skipped: trio.lowlevel.Task) -> None:
        self.skipped = skipped
        self.started = time.thread_time()
        self.longest = (0.0, "")

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        self.started = time.thread_time()

    def after_task_step(self, task: trio.lowlevel.Task) -> None:
        took = time.thread_time() - self.started
        if task is not self.skipped and took > self.longest[0]:
            self.longest = (took, task.name)


async def test_no_step_of_the_event_loop_grows_with_a_128_mb_event(start_proxy) -> None:
    """A 128 MB Chat event relayed through a supervised proxy: no step any task takes on the event loop (the
    proxy's, the upstream's) holds it for more than 12 ms of CPU. Every step on the event's bytes, text and
    rewrite is bounded, and so is letting go of them: freed at once where the stages drop them, the event's data,
    its bytes and its rewrite cost the loop 18 ms in one step (about 50 us per MB). The process's first-time work
    (its state database opened by the first save, 5 to 7 ms whatever the event's size) is done before, by a small
    stream. Afterwards nothing of the event is kept. CPU time, not wall time: a loaded machine that stops the
    process for a while does not count."""
    upstream = HugeEventUpstream("chat", 128 * 1024 * 1024)
    steps = _LoopSteps(trio.lowlevel.current_task())
    async with serve_handler(upstream) as url, start_proxy(upstream_url=url) as rp, http_client() as client:
        # First, a stream of a few KB: what a process does once whatever the size (its state store's database
        # opened, the token counter's first count: 5 to 10 ms each, more on a slower machine) is not the event's.
        upstream.data, big = HugeEventUpstream("chat", 4096).data, upstream.data
        async with client.stream("POST", rp.url + "/s/warm" + path_of("chat"),
                                 json=request_body("chat", stream=True)) as reply:
            await reply.aread()
        while not rp.pipeline.store.read_ledger("warm"):
            await trio.sleep(0.01)
        await rp.pipeline.settle()
        upstream.data = big
        gc.disable()  # a collection of this test process's objects holds the loop for long: not the event's work
        trio.lowlevel.add_instrument(steps)
        try:
            with trio.fail_after(120):  # guards a hang only
                async with client.stream("POST", rp.url + "/s/huge" + path_of("chat"),
                                         json=request_body("chat", stream=True)) as reply:
                    size = sum([len(chunk) async for chunk in reply.aiter_raw()])
                while not rp.pipeline.store.read_ledger("huge"):  # the proxy's work on the request is over
                    await trio.sleep(0.01)
        finally:
            trio.lowlevel.remove_instrument(steps)
            gc.enable()
    assert reply.status_code == 200 and size > 128 * 1024 * 1024
    took, task = steps.longest
    assert took < 0.012, f"a step of {task} held the event loop for {took * 1000:.1f} ms of CPU"
    assert allocator.deferred_bytes() == 0
