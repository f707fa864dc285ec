"""What passes through untouched: bodies byte for byte with supervision disabled, query strings, headers,
unknown fields and tool types; and with supervision disabled, nothing is written anywhere."""

from __future__ import annotations

import json

import orjson
import pytest

from helpers import (FORMATS, TEXT_STEP, TOOL_STEP, anthropic_client, files_under, http_client, path_of, raw_stream,
                     request_body, without_generated_ids)

_UNKNOWN_TOOLS = {
    "chat": {"type": "custom", "custom": {"name": "grammar_tool", "format": {"type": "text"}}},
    "messages": {"type": "web_search_20250305", "name": "web_search", "max_uses": 2},
    "responses": {"type": "web_search_preview", "search_context_size": "low"},
}


def odd_body(fmt: str, stream: bool) -> bytes:
    """A request whose exact bytes any re-encoding would change: indentation, key order, ASCII escapes, ``1.50``,
    ``1E3``, an escaped ``/``, unknown top-level fields and an unknown tool type."""
    body = request_body(fmt, stream)
    body["tools"].append(_UNKNOWN_TOOLS[fmt])
    body["zz_unknown_field"] = {"nested": ["é", None, True]}
    text = json.dumps(body, indent=3, ensure_ascii=True)
    return (text[:-1] + ',\n  "x_float": 1.50, "x_big": 1E3, "x_esc": "a\\/b\\u00e9"  \n}\n').encode()


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("fmt", FORMATS)
async def test_disabled_supervision_is_byte_identical_and_writes_nothing(
        fmt: str, stream: bool, start_proxy, scripted_server, state_dir, isolated_env) -> None:
    upstream = scripted_server.script
    body = odd_body(fmt, stream)
    async with start_proxy(supervised=False, upstream_url=scripted_server.url) as rp:
        for step in (TOOL_STEP, TEXT_STEP):
            upstream.queue(step, step)
            reply, received = await raw_stream(rp.url, fmt, body, headers={"x-proxyvisor-session": "abc"})
            assert reply.status_code == 200
            target, sent_up, _headers = upstream.requests[-1]
            assert (target, sent_up) == (path_of(fmt), body)
            assert received == upstream.responses[-1]  # the exact bytes the upstream wrote
            assert reply.headers["content-type"] == ("text/event-stream" if stream else "application/json")
            assert float(reply.headers["x-proxyvisor-overhead-ms"]) >= 0
            # A direct call differs only in the ids and timestamps the scripted upstream generates per response.
            _, direct = await raw_stream(scripted_server.url, fmt, body)
            assert without_generated_ids(received) == without_generated_ids(direct)
            assert direct != received  # guard: the ids above really are generated per response
    assert files_under(state_dir, isolated_env) == []


async def test_a_body_of_megabytes_goes_upstream_byte_identical(start_proxy, scripted_server) -> None:
    """A body that arrives in many reads goes upstream as the client sent it, byte for byte."""
    upstream = scripted_server.script
    body = odd_body("chat", False).rstrip()[:-1] + b', "x_pad": "' + b"ab\\u00e9 \\n" * 400_000 + b'"}\n'
    assert len(body) > 4_000_000
    async with start_proxy(supervised=False, upstream_url=scripted_server.url) as rp:
        upstream.queue(TOOL_STEP)
        reply, received = await raw_stream(rp.url, "chat", body)
        assert reply.status_code == 200
        assert upstream.requests[-1][1] == body
        assert received == upstream.responses[-1]


@pytest.mark.parametrize("supervised", [True, False], ids=["supervised", "disabled"])
@pytest.mark.parametrize("fmt", FORMATS)
async def test_unknown_fields_and_tool_types_reach_the_upstream(fmt: str, supervised: bool, start_proxy) -> None:
    body = odd_body(fmt, stream=False)
    async with start_proxy(supervised=supervised) as rp:
        reply, _ = await raw_stream(rp.url, fmt, body)
        assert reply.status_code == 200
        _target, sent_up, _headers = rp.scripted["scripted"].requests[-1]
        sent, original = orjson.loads(sent_up), orjson.loads(body)
        # Supervision may add to the conversation (system prompt, history); everything else goes up as sent.
        conversation = {"system", "messages", "instructions", "input"}
        assert {k: v for k, v in sent.items() if k not in conversation} == \
            {k: v for k, v in original.items() if k not in conversation}
        assert sent["tools"][-1] == _UNKNOWN_TOOLS[fmt]
        assert (sent["x_float"], sent["x_big"], sent["x_esc"]) == (1.5, 1000.0, "a/bé")


@pytest.mark.parametrize("supervised", [True, False], ids=["supervised", "disabled"])
async def test_query_string_and_anthropic_headers_are_forwarded(supervised: bool, start_proxy) -> None:
    async with start_proxy(supervised=supervised) as rp:
        upstream = rp.scripted["scripted"]
        for base in (rp.url, rp.url + "/s/sess-42"):
            async with anthropic_client(base) as client:
                message = await client.beta.messages.create(
                    **request_body("messages"), betas=["interleaved-thinking-2025-05-14"],
                    extra_query={"beta": "true"},  # what Claude Code sends; this SDK no longer adds it itself
                    extra_headers={"x-proxyvisor-session": "abc", "x-custom-client": "yes"})
            assert message.content
            target, _body, headers = upstream.requests[-1]
            assert target == "/v1/messages?beta=true"
            assert headers["anthropic-beta"] == "interleaved-thinking-2025-05-14"
            assert headers["anthropic-version"]
            # The client's own credentials go up unchanged (this SDK version sends them as a bearer token).
            assert "sk-ant-client-key" in (headers.get("x-api-key"), headers.get("authorization", "")[7:])
            assert headers["x-custom-client"] == "yes"
            assert not any(name.startswith("x-proxyvisor") for name in headers)


async def test_models_and_count_tokens_are_forwarded(proxy) -> None:
    async with http_client(proxy.url) as client:
        models = await client.get("/v1/models")
        assert models.status_code == 200 and models.json()["data"][0]["id"] == "scripted-model"
        count = await client.post("/s/s1/v1/messages/count_tokens?beta=true", json=request_body("messages"))
        assert count.status_code == 200 and count.json() == {"input_tokens": 0}  # the scripted model counts none
        for method, path in (("HEAD", "/"), ("GET", "/healthz"), ("GET", "/s/s1/healthz")):
            reply = await client.request(method, path)
            assert reply.status_code == 200


async def test_every_response_carries_the_overhead_header(start_proxy) -> None:
    """Relayed answers, proxyvisor's own errors and health checks all say how long proxyvisor took (ms)."""
    async with start_proxy([{"fault": {"status": 429}}], proxy={"max_body_bytes": 1024}, breakers=False) as rp, \
            http_client(rp.url) as client:
        replies = [
            await client.post("/v1/chat/completions", json=request_body("chat")),  # 429 from upstream
            await client.post("/v1/chat/completions", json=request_body("chat")),  # 200
            await client.post("/v1/messages", content=b"{", headers={"content-type": "application/json"}),
            await client.post("/v1/messages", content=b"x" * 2048, headers={"content-type": "application/json"}),
            await client.post("/v1/responses", json={}, headers={"content-type": "text/plain"}),
            await client.get("/v1/nope"), await client.get("/s/.bad/v1/messages"),
            await client.get("/v1/models"), await client.get("/healthz"), await client.head("/"),
        ]
        assert [r.status_code for r in replies] == [429, 200, 400, 413, 415, 404, 400, 200, 200, 200]
        for reply in replies:
            assert float(reply.headers["x-proxyvisor-overhead-ms"]) >= 0, reply.request.url
        # The shared header list of the health answer must not grow with each request.
        again = await client.get("/healthz")
        assert len(again.headers.get_list("x-proxyvisor-overhead-ms")) == 1
