"""Usage of answers that report none: counted with tiktoken and marked as estimated in the ledger and /info
(``proxyvisor.proxy.estimate``)."""

from __future__ import annotations

import json
from typing import Any

import orjson
import tiktoken

from proxyvisor.proxy.estimate import completed, count
from proxyvisor.proxy.formats import BY_NAME, AssistantTurn, Usage
from proxyvisor.proxy.pipeline import _KEPT_FOR_ESTIMATE
from proxyvisor.proxy.server import Request, Response

from helpers import MODEL, http_client, raw_stream, serve_handler

AIDER_SYSTEM = "Act as an expert software developer.\nTake requests for changes to the supplied code."
ANSWER = "Ok, I will change the greeting.\n\nhello.txt\n```\nhey from file\n```\n"


def aider_body(stream: bool, prompt: str = "change the greeting") -> dict[str, Any]:
    """What aider sends (client-captures/aider_0.86.2_edit_request.json, in small): a stream without
    ``stream_options``, ``temperature: 0``, a system prompt and canned example messages, no tools."""
    return {"model": MODEL, "stream": stream, "temperature": 0, "messages": [
        {"role": "system", "content": AIDER_SYSTEM},
        {"role": "user", "content": "Change the greeting to be more casual"},
        {"role": "assistant", "content": "Ok, I will:\n\n1. Switch the greeting text."},
        {"role": "user", "content": prompt}]}


def ledger(state_dir) -> list[dict[str, Any]]:
    [path] = (state_dir / "ledger").glob("*.jsonl")
    return [json.loads(line) for line in path.read_text().splitlines()]


def reference(text: str) -> int:
    """An independent count: o200k_base as tiktoken gives it."""
    return len(tiktoken.get_encoding("o200k_base").encode(text))


async def test_a_chat_stream_without_usage_is_counted_and_marked_estimated(start_proxy, state_dir) -> None:
    async with start_proxy([{"text": ANSWER}, {"text": ANSWER, "input_tokens": 70, "output_tokens": 9}]) as rp:
        reply, data = await raw_stream(f"{rp.url}/s/est", "chat", aider_body(stream=True))
        assert reply.status_code == 200 and b'"usage"' not in data
        asked = aider_body(stream=True, prompt="change it back")
        asked["stream_options"] = {"include_usage": True}
        await raw_stream(f"{rp.url}/s/est", "chat", asked)
        async with http_client(rp.url) as client:
            info = (await client.get("/proxyvisor/sessions/est/info")).json()
    estimated, reported = ledger(state_dir)
    assert estimated["usage_estimated"] is True
    assert estimated["output_tokens"] == reference(ANSWER)
    texts = [m["content"] for m in aider_body(True)["messages"]]
    assert estimated["input_tokens"] >= reference("\n".join(texts)) + 3 * len(texts)
    assert (reported["input_tokens"], reported["output_tokens"]) == (70, 9) and "usage_estimated" not in reported
    assert info["upstream"]["estimated_requests"] == 1
    assert info["upstream"]["output_tokens"] == reference(ANSWER) + 9


async def test_a_json_answer_without_usage_is_counted_from_its_text_and_tool_calls(start_proxy, state_dir) -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "read", "arguments": '{"path": "a.rs"}'}}
    answer = {"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": MODEL,
              "choices": [{"index": 0, "finish_reason": "tool_calls",
                           "message": {"role": "assistant", "content": "Reading.", "tool_calls": [call]}}]}

    async def upstream(request: Request) -> Response:
        return Response(200, [(b"content-type", b"application/json")], orjson.dumps(answer))

    async with serve_handler(upstream) as url, start_proxy(upstream_url=url) as rp:
        reply, _data = await raw_stream(rp.url, "chat", aider_body(stream=False))
        assert reply.status_code == 200
    [line] = ledger(state_dir)
    assert line["usage_estimated"] is True and line["input_tokens"] > 0
    assert line["output_tokens"] == reference('Reading.\nread{"path":"a.rs"}')


async def test_a_stream_event_past_the_kept_data_is_counted_by_its_length_not_read_again(start_proxy,
                                                                                           state_dir) -> None:
    def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
        return orjson.dumps({"id": "chatcmpl-big", "object": "chat.completion.chunk", "created": 0, "model": MODEL,
                             "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})

    big = chunk({"content": "word " * (_KEPT_FOR_ESTIMATE // 5 + 1000)})
    events = [chunk({"role": "assistant", "content": "Here: "}), big, chunk({}, "stop"), b"[DONE]"]
    sent = b"".join(b"data: " + e + b"\n\n" for e in events)

    async def upstream(request: Request) -> Response:
        return Response(200, [(b"content-type", b"text/event-stream")], sent)

    async with serve_handler(upstream) as url, start_proxy(upstream_url=url) as rp:
        reply, data = await raw_stream(rp.url, "chat", aider_body(stream=True))
    assert reply.status_code == 200
    deltas = [orjson.loads(line[6:])["choices"][0]["delta"] for line in data.split(b"\n\n")[:-2]]
    assert "".join(d.get("content", "") for d in deltas) == "Here: " + orjson.loads(big)["choices"][0]["delta"][
        "content"]  # the answer as it came (the stripper may move a trailing space to the next event)
    [line] = ledger(state_dir)
    # The two small events are read ("Here: " is 2 tokens); the big one counts at 4 characters a token.
    assert line["usage_estimated"] is True
    assert line["output_tokens"] == reference("Here: ") + (len(big) + 3) // 4


def test_an_estimate_adds_the_unread_characters_at_four_a_token() -> None:
    fmt, turn = BY_NAME["chat"], AssistantTurn(text="hello there")
    assert completed(Usage(10, None), fmt, None, turn, unread=40).output_tokens == reference("hello there") + 10
    assert completed(Usage(10, None), fmt, None, None, unread=41).output_tokens == 11
    assert completed(Usage(10, None), fmt, None, None).output_tokens is None  # nothing to count
    assert completed(Usage(10, 5), fmt, None, None, unread=400).output_tokens == 5  # reported wins


def test_long_texts_are_counted_on_their_start_and_scaled() -> None:
    text = "word " * 100_000  # 500,000 characters
    assert abs(count(text) - reference(text)) <= reference(text) * 0.02


async def test_the_scripted_models_zero_usage_reaches_the_client_and_the_ledger_estimates_it(start_proxy,
                                                                                             state_dir) -> None:
    """The client is told 0 tokens (it would price any other count at its own model's rate); the ledger counts the
    answer like one that reported none (marked estimated), and keeps counts a script step sets."""
    async with start_proxy([{"text": ANSWER}, {"text": ANSWER, "input_tokens": 70, "output_tokens": 9}]) as rp:
        answers = []
        for _ in range(2):
            reply, data = await raw_stream(f"{rp.url}/s/zero", "chat", aider_body(stream=False))
            assert reply.status_code == 200
            answers.append(orjson.loads(data)["usage"])
    assert [(u["prompt_tokens"], u["completion_tokens"]) for u in answers] == [(0, 0), (70, 9)]
    estimated, reported = ledger(state_dir)
    assert estimated["usage_estimated"] is True and estimated["scripted"] is True
    assert estimated["output_tokens"] == reference(ANSWER) and estimated["input_tokens"] > 0
    assert (reported["input_tokens"], reported["output_tokens"]) == (70, 9) and "usage_estimated" not in reported


class CountingEncoding:
    """o200k_base, counting the characters it is asked to encode."""

    def __init__(self) -> None:
        self.inner = tiktoken.get_encoding("o200k_base")
        self.encoded = 0

    def encode(self, text: str, **options: Any) -> list[int]:
        self.encoded += len(text)
        return self.inner.encode(text, **options)


def test_a_grown_history_encodes_only_its_new_messages_and_counts_like_the_whole(monkeypatch) -> None:
    import random

    from proxyvisor.proxy import estimate

    encoding = CountingEncoding()
    monkeypatch.setattr(estimate, "encoding", lambda: encoding)
    monkeypatch.setattr(estimate, "_counts", {})
    words = random.Random(5).choices(["fn", "main()", "error:", "the", "test", "passed", "src/lib.rs:12", "{", "}"],
                                     k=60_000)
    messages: list[dict[str, Any]] = [{"role": "system", "content": AIDER_SYSTEM}]
    for n in range(20):  # about 175,000 characters: encoded whole at first
        messages.append({"role": "user" if n % 2 == 0 else "assistant",
                         "content": " ".join(words[n * 1500:(n + 1) * 1500])})
    fmt = BY_NAME["chat"]
    first = estimate.input_tokens(fmt, {"model": MODEL, "messages": messages[:-1]})
    history_chars = encoding.encoded
    grown = estimate.input_tokens(fmt, {"model": MODEL, "messages": messages})
    assert encoding.encoded - history_chars == len(messages[-1]["content"])  # the new message only
    texts = [m["content"] for m in messages]
    whole = reference("\n".join(texts)) + 3 * len(texts)
    assert abs(grown - whole) <= whole * 0.01 and grown > first


def test_an_estimate_encodes_at_most_its_limit_and_counts_the_rest_at_that_rate(monkeypatch) -> None:
    from proxyvisor.proxy import estimate

    encoding = CountingEncoding()
    monkeypatch.setattr(estimate, "encoding", lambda: encoding)
    monkeypatch.setattr(estimate, "_counts", {})
    parts = [f"line {n}: " + "word " * 2_000 for n in range(60)]  # 600,000 characters
    tokens = estimate.count_parts(parts)
    assert encoding.encoded <= estimate.EXACT_CHARS
    assert abs(tokens - reference("\n".join(parts))) <= reference("\n".join(parts)) * 0.02
    estimate.count_parts(parts)  # the parts encoded are remembered, the rest encoded now, up to the limit
    assert estimate.EXACT_CHARS < encoding.encoded <= 2 * estimate.EXACT_CHARS


def test_the_remembered_counts_are_bounded(monkeypatch) -> None:
    from proxyvisor.proxy import estimate

    monkeypatch.setattr(estimate, "_counts", {})
    monkeypatch.setattr(estimate, "REMEMBERED", 8)
    estimate.count_parts([f"part {n}" for n in range(20)])
    assert len(estimate._counts) == 8
    assert (hash("part 19"), len("part 19")) in estimate._counts and (hash("part 0"), 6) not in estimate._counts


def test_a_part_encoded_only_in_part_is_not_remembered_as_its_count(monkeypatch) -> None:
    """A part past what is left of the limit is counted on its start and scaled: that is no count to remember,
    or every later estimate of a history holding it would carry the scaled figure instead of converging."""
    from proxyvisor.proxy import estimate

    monkeypatch.setattr(estimate, "_counts", {})
    first = "word " * (estimate.EXACT_CHARS // 5 - 1)  # leaves 5 characters of the limit
    second = "fn main() { return 0; }\n" * 2_000
    estimate.count_parts([first, second])
    assert estimate.count_parts([second]) == estimate.count(second)
