"""The real SDKs through proxyvisor get the same answers as a direct call to the same scripted upstream."""

from __future__ import annotations

import pytest
import trio

from helpers import FORMATS, TEXT_STEP, TOOL_STEP, TWO_CALLS_STEP, ask


@pytest.mark.parametrize("supervised", [True, False], ids=["supervised", "disabled"])
@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("fmt", FORMATS)
async def test_sdk_through_proxy_equals_direct(fmt: str, stream: bool, supervised: bool, start_proxy) -> None:
    async with start_proxy(supervised=supervised) as rp:
        upstream = rp.scripted["scripted"]
        direct_url = rp.scripted_urls["scripted"]
        for step in (TOOL_STEP, TEXT_STEP, TWO_CALLS_STEP):
            upstream.queue(step, step)
            direct = await ask(fmt, direct_url, stream=stream)
            proxied = await ask(fmt, rp.url, stream=stream)
            assert proxied == direct
            assert proxied.text == step.get("text", "")
            assert [c[0] for c in proxied.tool_calls] == [c["id"] for c in step.get("tool_calls", ())]


@pytest.mark.parametrize("fmt", FORMATS)
async def test_auto_mode_calls_a_tool_then_answers(fmt: str, proxy) -> None:
    """With no script, the scripted model calls the offered shell tool (a full agent turn needs no setup)."""
    answer = await ask(fmt, proxy.url, stream=True)
    assert [(name, args) for _id, name, args in answer.tool_calls] == [("Bash", {"command": "ls"})]


async def test_concurrent_streams_do_not_mix(start_proxy) -> None:
    """16 clients stream at once through one proxy; each gets its own complete answer."""
    async with start_proxy(chunk_delay_ms=1) as rp:
        answers: dict[int, object] = {}

        async def one(i: int) -> None:
            answers[i] = await ask(("chat", "messages", "responses")[i % 3], rp.url, stream=True,
                                   headers={"x-proxyvisor-session": f"c{i}"})

        async with trio.open_nursery() as nursery:
            for i in range(16):
                nursery.start_soon(one, i)
    assert len(answers) == 16
    assert all(a.tool_calls[0][1:] == ("Bash", {"command": "ls"}) for a in answers.values())
    assert len(rp.pipeline.sessions) == 16
