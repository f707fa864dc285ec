"""Integers beyond 64 bits pass through supervision exactly: in the agent's request (read whole or from its new
bytes), in a JSON answer and in a stream's events, whether supervision rewrote them or not; and the JSON helpers
that keep them (proxyvisor.wirejson) read and fail as orjson does otherwise."""

from __future__ import annotations

import json
from typing import Any

import orjson
import pytest

from proxyvisor import wirejson
from proxyvisor.config import Config, GateConfig, UpstreamConfig
from proxyvisor.proxy.formats import BY_NAME, AssistantTurn
from proxyvisor.proxy.server import Request, Response
from proxyvisor.proxy.service import running
from proxyvisor.store import Store

from helpers import FORMATS, MODEL, raw_stream, request_body, serve_handler, sse_events
from test_gate_proxy import Verifier

BIG = 12345678901234567890123
NEGATIVE = -9223372036854775809  # one below orjson's range
TOP = 18446744073709551616  # one above it
REPORT = '<sup>{"state": "done", "focus": "listed the files", "carry": []}</sup>'


def test_wide_integers_read_and_write_exactly() -> None:
    text = f'{{"a": [{BIG}, {NEGATIVE}, {TOP}, 18446744073709551615, 1.5], "b": "{BIG}"}}'
    value = wirejson.loads(text)
    assert value == {"a": [BIG, NEGATIVE, TOP, 2**64 - 1, 1.5], "b": str(BIG)}
    assert wirejson.loads(text.encode()) == value
    assert json.loads(wirejson.dumps(value)) == value
    assert wirejson.dumps({"b": 1, "a": BIG}, option=orjson.OPT_SORT_KEYS) == f'{{"a":{BIG},"b":1}}'.encode()


def test_other_json_is_orjsons_own() -> None:
    plain = b'{"n": 1234567890123456789, "text": "a run 12345678901234567890123 in a string", "f": 1e3}'
    assert wirejson.loads(plain) == orjson.loads(plain)
    for bad in (b'{"a": NaN}', b"[1e400]", b"{", b'{"a": 12345678901234567890123,}'):
        with pytest.raises(orjson.JSONDecodeError):
            wirejson.loads(bad)
    assert wirejson.dumps({"é": [1, None]}) == orjson.dumps({"é": [1, None]})
    for unwritable in ({"a": object()}, [BIG, object()], {"a": BIG, "b": "\ud800"}):
        with pytest.raises(orjson.JSONEncodeError):
            wirejson.dumps(unwritable)


def _widened(obj: dict[str, Any]) -> dict[str, Any]:
    """``obj`` with wide integers added at its top level."""
    return {**obj, "x_wide": [BIG, NEGATIVE, TOP]}


class WideUpstream:
    """Answers every request in its format with text that ends in a self-report (so supervision rewrites it),
    every JSON object of the answer carrying wide integers; keeps the request bodies it received."""

    def __init__(self, fmt: str) -> None:
        self.fmt = BY_NAME[fmt]
        self.bodies: list[bytes] = []

    async def __call__(self, request: Request) -> Response:
        self.bodies.append(request.body)
        body = json.loads(request.body)
        turn = AssistantTurn("Here are the files. " + REPORT)
        if not body.get("stream"):
            answer = json.dumps(_widened(self.fmt.render(turn, MODEL))).encode()
            return Response(200, [(b"content-type", b"application/json")], answer)
        events = []
        for event in sse_events(b"".join(self.fmt.render_stream(turn, MODEL, body))):
            data = event.data if not event.data.startswith("{") else json.dumps(_widened(json.loads(event.data)))
            events.append((f"event: {event.event}\n" if event.event else "") + f"data: {data}\n\n")
        return Response(200, [(b"content-type", b"text/event-stream")], "".join(events).encode())


@pytest.mark.parametrize("gate", [False, True], ids=["ungated", "gated"])
@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("fmt", FORMATS)
async def test_wide_integers_pass_supervision_exactly(fmt: str, stream: bool, gate: bool, tmp_path) -> None:
    upstream = WideUpstream(fmt)
    body = request_body(fmt, stream, x_wide=[BIG, NEGATIVE, TOP])
    history = BY_NAME[fmt].history_field
    verifier = Verifier()
    async with serve_handler(upstream) as url, running(
            Config(upstreams=(UpstreamConfig(name="wide", url=url),)).with_overrides(
                supervisor={"gate": GateConfig(enabled=gate, hold="answer")}),
            port=0, store=Store(tmp_path / "state"), model=verifier) as rp:
        for turn in range(2):  # the second request extends the first: read from its new bytes only
            reply, received = await raw_stream(rp.url, fmt, json.dumps(body).encode(),
                                               headers={"x-proxyvisor-session": "wide"})
            assert reply.status_code == 200
            sent = json.loads(upstream.bodies[-1])
            assert sent["x_wide"] == [BIG, NEGATIVE, TOP]
            assert [item.get("x_wide") for item in sent[history] if isinstance(item, dict)
                    and "x_wide" in item] == [[TOP, BIG]] * turn
            answers = [json.loads(e.data) for e in sse_events(received) if e.data.startswith("{")] if stream \
                else [json.loads(received)]
            wide = [answer.get("x_wide") for answer in answers]
            assert wide and all(value == [BIG, NEGATIVE, TOP] for value in wide)
            assert "<sup>" not in received.decode()  # supervision did rewrite the answer
            assert bool(verifier.calls) == gate  # the gated answer was held, judged and written again
            body[history] += [{"role": "assistant", "content": "Here are the files."},
                              {"role": "user", "content": "And now?", "x_wide": [TOP, BIG]}]
