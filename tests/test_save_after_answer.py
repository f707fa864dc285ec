"""Work after the answer (``proxyvisor.proxy.server``'s ``Response.after``): it runs once the client has the whole
response and before the connection's next request is read, a failure in it changes nothing the client gets; and
with the local state store the sessions' supervision state is stored there (``proxyvisor.proxy.pipeline``), so the
client has the answer's last byte before the save runs, while this process still never reads a state older than
the one it holds: the same session's next request (on another connection), its plan and a restart all find it."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from pathlib import Path

import h11
import httpx
import orjson
import pytest
import trio

from proxyvisor.config import Config
from proxyvisor.proxy.formats import BY_NAME
from proxyvisor.proxy.formats.base import shared_prefix
from proxyvisor.proxy.server import Request, Response
from proxyvisor.proxy.service import running
from proxyvisor.proxy.sessions import Session
from proxyvisor.scripted.upstream import ScriptedUpstream
from proxyvisor.store import Store

from helpers import serve_handler
from test_recite_prefix import RECITED, Agent, Model, report


class Client:
    """One keep-alive connection speaking HTTP/1.1 with h11."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.conn = h11.Connection(h11.CLIENT)

    async def send(self, target: str) -> None:
        await self.stream.send_all(self.conn.send(h11.Request(
            method="POST", target=target, headers=[("host", "x"), ("content-length", "0")])) or b"")
        await self.stream.send_all(self.conn.send(h11.EndOfMessage()) or b"")

    async def answer(self) -> bytes:
        """The next response's whole body (its end of message read)."""
        body = b""
        while True:
            event = self.conn.next_event()
            if event is h11.NEED_DATA:
                self.conn.receive_data(await self.stream.receive_some(65536))
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage):
                self.conn.start_next_cycle()
                return body


async def test_the_step_after_a_response_runs_once_the_client_has_it_and_before_the_next_request(
        caplog: pytest.LogCaptureFixture) -> None:
    released = trio.Event()
    seen: list[str] = []

    async def after_one() -> None:
        seen.append("after /one")
        await released.wait()
        seen.append("after /one done")

    async def after_two() -> None:
        seen.append("after /two")
        raise RuntimeError("the save failed")

    async def chunks() -> AsyncIterator[bytes]:
        yield b"streamed "
        yield b"answer"

    async def handler(request: Request) -> Response:
        seen.append(request.target)
        if request.target == "/one":
            return Response(200, [], b"json answer", after=after_one)
        if request.target == "/two":
            return Response(200, [], chunks(), after=after_two)
        return Response(200, [], b"plain")

    async with serve_handler(handler) as url:
        client = Client(await trio.open_tcp_stream("127.0.0.1", int(url.rsplit(":", 1)[1])))
        with trio.fail_after(10):
            await client.send("/one")
            assert await client.answer() == b"json answer"  # while its after step waits
            await client.send("/two")
            await trio.sleep(0.05)
            assert seen == ["/one", "after /one"], "the next request waits for the step after the one before"
            released.set()
            assert await client.answer() == b"streamed answer"
            await client.send("/three")
            assert await client.answer() == b"plain", "a failed after step changes nothing for the client"
        await client.stream.aclose()
    assert seen == ["/one", "after /one", "after /one done", "/two", "after /two", "/three"]
    (failed,) = [r for r in caplog.records if r.name == "proxyvisor.server" and r.levelno >= logging.ERROR]
    assert failed.getMessage() == "the step after a response failed (RuntimeError: the save failed)"
    assert failed.exc_info is None and failed.exc_text is None, "no traceback in the log"


async def test_the_step_after_a_stream_runs_when_the_client_leaves_mid_stream() -> None:
    sent, done = trio.Event(), trio.Event()

    async def chunks() -> AsyncIterator[bytes]:
        yield b"first piece"
        sent.set()
        await trio.sleep_forever()
        yield b""  # never reached

    async def after() -> None:
        done.set()

    async def handler(request: Request) -> Response:
        return Response(200, [], chunks(), after=after)

    async with serve_handler(handler) as url:
        client = Client(await trio.open_tcp_stream("127.0.0.1", int(url.rsplit(":", 1)[1])))
        await client.send("/")
        with trio.fail_after(10):
            await sent.wait()
            await client.stream.aclose()
            await done.wait()


@pytest.mark.parametrize(("fmt", "stream"), [("chat", False), ("messages", True)], ids=["chat-json", "messages-sse"])
async def test_the_session_state_is_stored_after_the_client_has_the_whole_answer(tmp_path: Path, fmt: str,
                                                                                 stream: bool) -> None:
    model = Model()
    async with running(Config(), port=0, store=Store(tmp_path / "state"), scripted={"scripted": ScriptedUpstream()},
                       model=model) as proxy:
        states = proxy.pipeline.states
        assert states is not None and proxy.pipeline.save_after
        save, released, saving = states.save, trio.Event(), []

        async def held(session: Session) -> None:  # the store, as if its write took until the test says
            saving.append(session.id)
            with trio.move_on_after(20):  # bounded: under the old order the client's own deadline fails first
                await released.wait()
            await save(session)

        states.save = held  # type: ignore[method-assign]
        agent = Agent(proxy, BY_NAME[fmt], stream)
        with trio.fail_after(10):  # the old order (the save before the answer's end) never gets here
            await agent.turn(agent.step("Reading. " + report()))
        with trio.fail_after(10):
            while not saving:
                await trio.sleep(0.01)
        assert states.kv.get("prefix:v") is None, "the client had the whole answer before the state was stored"
        # The session's next request, on a connection of its own, while the first answer's save still waits: it
        # goes on from the state this process holds (a recitation after the first tool result, as without the wait).
        with trio.fail_after(10):
            await agent.turn(agent.step("Reading on. " + report()))
        assert [body.count(RECITED) for body in agent.bodies()] == [0, 1]
        released.set()
        with trio.fail_after(10):
            while states.kv.get("prefix:v") != proxy.pipeline.sessions.get("prefix").state_version:  # type: ignore[union-attr]
                await trio.sleep(0.01)
        with trio.fail_after(10):
            await agent.turn(agent.step("Planning. " + report(plan="request")))
            await agent.turn(agent.step("Split under way. " + report()))
        assert model.purposes == ["plan"]
        async with httpx.AsyncClient(timeout=10) as http:  # at once: the state this process holds
            plan = (await http.get(f"{proxy.url}/proxyvisor/sessions/prefix/plan")).json()
        assert plan["plan"]["plan_title"] == "Split the parser" and plan["prohibitions"]
        bodies = agent.bodies()
    # A restart resumes where the session was: the plan made before it came back from the store.
    async with running(Config(), port=0, store=Store(tmp_path / "state"), scripted={"scripted": ScriptedUpstream()},
                       model=model) as proxy:
        agent.proxy, agent.upstream = proxy, proxy.scripted["scripted"]
        with trio.fail_after(10):
            await agent.turn(agent.step("After the restart. " + report()))
        bodies += agent.bodies()
    assert model.purposes == ["plan"] and b"Live plan (0/2 done)" in bodies[-1]
    prompts = [agent.fmt.prompt(orjson.loads(body)) for body in bodies]
    for i in range(1, len(prompts)):
        assert shared_prefix(prompts[i - 1], prompts[i]) == sum(map(len, prompts[i - 1])), f"request {i} breaks it"
