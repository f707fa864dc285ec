"""The allocator settings of the proxy process (proxyvisor.proxy.allocator): big request blocks reuse the heap's
pages; while big texts are built, big blocks are mapped of their own. Checked by what they are for, the page faults
of allocating and freeing a 4 MB block again and again, in a fresh process (the settings must precede threads)."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest
import trio
import trio.testing

from proxyvisor.proxy import allocator

GLIBC = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the settings are glibc's (mallopt)")

_SCRIPT = """
import resource
from proxyvisor.proxy import allocator

pieces = [bytes([n]) * (255 * 1024) for n in range(16)]  # a 4 MB body as the reads bring it

def faults_per_join():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(20):
        body = b"".join(pieces)
        del body
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 20

allocator.tune()
faults_per_join()  # the heap grows once
print(faults_per_join())
with allocator.big_blocks_mapped():
    with allocator.big_blocks_mapped():
        print(faults_per_join())
    print(faults_per_join())  # one work still wants them mapped
faults_per_join()  # the heap grows again once
print(faults_per_join())
"""


@GLIBC
def test_big_request_blocks_reuse_pages_and_are_mapped_only_while_big_texts_are_built() -> None:
    run = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr[-2000:]
    heap, nested, outer, after = (float(line) for line in run.stdout.split())
    pages = 4 * 1024 * 1024 // 4096
    assert heap < pages / 10, f"a 4 MB block faulted {heap} pages in per allocation by default"
    assert nested > pages * 0.9 and outer > pages * 0.9, "big blocks were not mapped while big texts are built"
    assert after < pages / 10, "the default did not come back once no work wants big blocks mapped"


_KEPT = """
import os
from proxyvisor.proxy import allocator

def resident_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

allocator.tune()
blocks = [bytes([n]) * (4 * 2**20) for n in range(12)]  # 48 MB: freed, the heap keeps it (allocator.KEEP_FREE)
before = resident_mb()
del blocks
freed = resident_mb()
allocator.trim()
print(before, freed, resident_mb())
"""


_DEFERRED = """
import time
from proxyvisor import bigtext
from proxyvisor.proxy import allocator

allocator.tune()
steps, last = [], time.thread_time()

def pause():
    global last
    now = time.thread_time()
    steps.append(now - last)
    last = now

bigtext.PAUSE.set(pause)
with allocator.big_blocks_mapped():
    text = bigtext.concat(["y" * 2**20] * 128)  # 128 MB, mapped of its own, as a big event's data is built
    pieces = [bytes([n]) * 2**20 for n in range(64)]
    used = "u" * (4 * 2**20)
for obj in (text, pieces, used, pieces):  # (pieces twice: kept once)
    allocator.defer_free(obj)
before = time.thread_time()
del text, pieces, obj
dropped = time.thread_time() - before
last = time.thread_time()
kept = allocator.free_deferred()
print(round(dropped * 1000, 3), round(max(steps) * 1000, 3), len(steps), kept,
      used == "u" * (4 * 2**20), allocator.deferred_bytes())
"""


@GLIBC
def test_objects_deferred_are_freed_in_bounded_steps_once_nothing_else_uses_them() -> None:
    """A 128 MB text and 64 MB of pieces dropped cost their last holder nothing (freeing them at once: 6 to 12 ms
    and 3 to 6 ms); ``free_deferred`` frees them in steps (each under 3 ms; the text at once: 6 to 12) and
    keeps, intact, what is still used."""
    run = subprocess.run([sys.executable, "-c", _DEFERRED], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr[-2000:]
    dropped_ms, longest_ms, steps, kept, intact, kept_bytes = run.stdout.split()
    assert float(dropped_ms) < 1, f"dropping the last reference took {dropped_ms} ms"
    assert int(steps) >= 128 + 64 and float(longest_ms) < 3, f"{steps} steps, the longest {longest_ms} ms"
    assert (kept, intact, kept_bytes) == ("1", "True", str(4 * 2**20))


@GLIBC
def test_a_trim_gives_back_what_the_heap_kept_of_big_blocks_freed() -> None:
    run = subprocess.run([sys.executable, "-c", _KEPT], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr[-2000:]
    before, freed, trimmed = (float(x) for x in run.stdout.split())
    assert freed > before - 10, "the heap kept the freed blocks (what the trim is for)"
    assert trimmed < freed - 40, f"the trim gave back {freed - trimmed:.0f} MB of some 48 MB freed"


async def test_the_heap_is_trimmed_once_after_requests_when_the_proxy_is_idle(
        monkeypatch: pytest.MonkeyPatch, autojump_clock: trio.testing.MockClock) -> None:
    """Not while requests go on, nor while one is in flight; once after they stop for allocator.IDLE_S; not again
    until more are served."""
    trims: list[float] = []
    monkeypatch.setattr(allocator, "trim", lambda: trims.append(trio.current_time()))
    state = {"in_flight": 0, "ended": 0}
    async with trio.open_nursery() as nursery:
        nursery.start_soon(allocator.trim_when_idle, lambda: state["in_flight"], lambda: state["ended"])
        await trio.sleep(allocator.IDLE_S * 3)
        assert trims == [], "nothing served yet"
        for _ in range(10):  # requests ending every second
            state["ended"] += 1
            await trio.sleep(1)
        assert trims == []
        state["in_flight"] = 1  # a long request
        await trio.sleep(allocator.IDLE_S * 3)
        assert trims == []
        state["in_flight"], state["ended"] = 0, state["ended"] + 1
        ended_at = trio.current_time()
        await trio.sleep(allocator.IDLE_S * 5)
        assert len(trims) == 1 and ended_at + allocator.IDLE_S <= trims[0] <= ended_at + 2 * allocator.IDLE_S
        nursery.cancel_scope.cancel()
