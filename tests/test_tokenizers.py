"""The encodings supervision counts with are loaded at start, on a thread, and waited for off the event loop
(``proxyvisor.proxy.tokenizers``). Each load is made to take :data:`LOAD_S` (a sleep before tiktoken's own,
already in memory), so that the tests see where a load is waited for, whatever ran before them."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import tiktoken
import trio

from proxyvisor.condense import text as condense_text
from proxyvisor.proxy import estimate

from helpers import MODEL, http_client, raw_stream

LOAD_S = 1.0
"""How long each encoding's load takes here (their real loads: 0.3-0.9 s each, on a busy machine more)."""
LOADS = (condense_text.encoding, estimate.encoding)


@pytest.fixture
def slow_loads(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Encodings not loaded in this process yet, each load taking :data:`LOAD_S`."""
    for load in LOADS:  # tiktoken keeps the real ones, so each load below is the sleep and a lookup
        load()
        load.cache_clear()
    real = tiktoken.get_encoding

    def slow(name: str) -> tiktoken.Encoding:
        time.sleep(LOAD_S)
        return real(name)

    monkeypatch.setattr(tiktoken, "get_encoding", slow)
    yield


def ledger(state_dir: Path) -> list[dict[str, Any]]:
    [path] = (state_dir / "ledger").glob("*.jsonl")
    return [json.loads(line) for line in path.read_text().splitlines()]


async def test_an_answer_estimated_while_the_encodings_load_waits_for_them_off_the_event_loop(
        start_proxy, state_dir, slow_loads) -> None:
    """A fresh proxy's first answer that needs an estimate (a Chat stream without usage), arriving while the
    encodings still load, waits for its encoding off the event loop (it once loaded it again on the loop): the
    loop, which this test's client shares, turns meanwhile, another client's requests are answered at once, and
    the answer is counted with the encoding."""
    answer = "Ok, I will change the greeting."
    body = {"model": MODEL, "stream": True, "messages": [{"role": "user", "content": "change the greeting"}]}
    waits: list[float] = []
    async with start_proxy([{"text": answer}]) as rp, http_client(rp.url) as client:
        answered = trio.Event()

        async def first() -> None:
            reply, _data = await raw_stream(f"{rp.url}/s/first", "chat", body)
            assert reply.status_code == 200
            answered.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(first)
            begun = time.perf_counter()
            for _ in range(400):  # pings until the answer and both loads are done (some 4 LOAD_S), bounded
                started = time.perf_counter()
                assert (await client.get("/healthz")).status_code == 200
                await trio.sleep(0.01)
                waits.append(time.perf_counter() - started)  # a held loop holds this test's client too
                if answered.is_set() and started - begun > 2.5 * LOAD_S:
                    break
    assert answered.is_set() and max(waits) < LOAD_S / 2, waits  # the loop was never held for a load
    [line] = ledger(state_dir)
    assert line["usage_estimated"] is True
    assert line["output_tokens"] == len(tiktoken.get_encoding("o200k_base").encode(answer))


async def test_a_sessions_first_request_finds_the_encoding_its_memory_recall_counts_with_loaded(
        start_proxy, state_dir, slow_loads, tmp_path: Path) -> None:
    """A proxy whose warm-up has ended counts a session's first request (its memory recall counts tokens with
    condensing's encoding) with no load: its overhead stays far below one load (it once paid the load of the
    encoding the warm-up left out, some 0.5 s with Claude Code)."""
    body = {"model": MODEL, "max_tokens": 64, "stream": True,
            "system": f"You are a coding agent.\nPrimary working directory: {tmp_path}",
            "messages": [{"role": "user", "content": "List the files."}],
            "tools": [{"name": "Bash", "description": "Run a shell command.",
                       "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}}}]}
    async with start_proxy([{"text": "Done."}]) as rp:
        with trio.fail_after(6 * LOAD_S):
            while not estimate.encoding.cache_info().currsize:  # the estimate's: the warm-up loads it last
                await trio.sleep(0.02)
        reply, _data = await raw_stream(f"{rp.url}/s/recall", "messages", body)
        assert reply.status_code == 200
    [line] = ledger(state_dir)
    assert line["overhead_ms"] < LOAD_S * 1000 / 2, line
