"""Token counts for answers that report none: estimated with tiktoken, and marked as estimates.

A Chat Completions stream carries usage only when the request asked for it (``stream_options.include_usage``;
aider and the openai SDK do not by default), and some local servers report none at all. The pipeline then
counts the tokens itself (``Pipeline._account`` writes ``usage_estimated: true`` on the ledger line):

- input: the request body's history as the upstream got it (each message's text, tool calls' names and
  arguments, tool results' text, plus 3 tokens per message for the role and separators, as OpenAI counts them),
  the system prompt when it is not a history message, and the tools' JSON;
- output: the answer's text and tool calls' names and arguments.

The encoding is ``o200k_base`` (OpenAI's current models; other providers' tokenizers differ by some percent),
read from the copy bundled with litellm so nothing is downloaded, else ``cl100k_base``, else 4 characters a
token. An estimate encodes at most :data:`EXACT_CHARS` characters (a few milliseconds on the event loop): a longer
text is counted on its start and scaled. A history's parts (each message's text, tool call, tool result) are
counted once per process and remembered by their hash (:data:`REMEMBERED` of them), so a session's next request,
whose history only grew, encodes its new messages only; the history's parts not encoded within the limit are
counted at the rate of those that were.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import trio

from .. import wirejson
from ..condense.text import use_bundled_tokenizers
from . import tokenizers
from .formats import AssistantTurn, Usage, WireFormat

log = logging.getLogger("proxyvisor.estimate")

EXACT_CHARS = 200_000
"""Characters encoded per estimate at most; the rest is counted at the same tokens-per-character rate."""
REMEMBERED = 1 << 16
"""Parts whose count is remembered (the oldest forgotten first): a few MB, some hundred sessions' histories."""
_counts: dict[tuple[int, int], int] = {}
"""Tokens of each part counted, by the part's hash and length."""
_PER_MESSAGE = 3
_ENCODINGS = ("o200k_base", "cl100k_base")


@functools.cache
def encoding() -> Any:
    """``o200k_base``, else ``cl100k_base`` (0.3-0.9 s on the first call, part of it holding the GIL:
    ``proxyvisor.proxy.tokenizers``), or None when none does (counted at 4 characters a token)."""
    import tiktoken

    use_bundled_tokenizers()
    for name in _ENCODINGS:
        try:
            return tiktoken.get_encoding(name)
        except Exception:  # noqa: BLE001 - a missing file means a download, which fails offline: try the next
            continue
    return None


def count(text: str, limit: int = EXACT_CHARS) -> int:
    """Tokens in ``text``: its first ``limit`` characters encoded (module docstring), the rest at their rate."""
    if not text:
        return 0
    head = text[:max(1, limit)]
    codec = encoding()
    tokens = len(codec.encode(head, disallowed_special=())) if codec is not None else (len(head) + 3) // 4
    return tokens if len(text) == len(head) else round(tokens * len(text) / len(head))


def count_parts(parts: list[str]) -> int:
    """Tokens in ``parts`` joined by newlines (a newline a token): each part's count remembered (module docstring),
    at most :data:`EXACT_CHARS` characters encoded; parts past that are counted at the rate of the others."""
    budget = EXACT_CHARS
    tokens = counted = uncounted = 0
    for part in parts:
        key = (hash(part), len(part))
        found = _counts.get(key)
        if found is None:
            if budget <= 0:
                uncounted += len(part)
                continue
            found = count(part, budget)
            if budget >= len(part):  # encoded whole: a count to remember (a part cut short was only scaled)
                if len(_counts) >= REMEMBERED:
                    del _counts[next(iter(_counts))]
                _counts[key] = found
            budget -= len(part)
        tokens += found
        counted += len(part)
    if uncounted:
        tokens += round(uncounted * tokens / counted) if tokens else (uncounted + 3) // 4
    return tokens + max(0, len(parts) - 1)


def input_tokens(fmt: WireFormat, body: dict[str, Any]) -> int:
    """Estimated input tokens of the request ``body`` in ``fmt`` (module docstring)."""
    parts: list[str] = []
    messages = [fmt.message(item) for item in fmt.history(body)]
    if not any(m.role == "system" for m in messages):
        parts.append(fmt.fingerprint_parts(body)[0])
    for message in messages:
        parts.append(message.text)
        parts += [use.name + wirejson.dumps(use.arguments).decode() for use in message.tool_uses]
        parts += [out.text for out in message.tool_outputs]
    tools = body.get("tools")
    if tools:
        parts.append(wirejson.dumps(tools).decode())
    return count_parts(parts) + _PER_MESSAGE * len(messages)


def output_tokens(turn: AssistantTurn) -> int:
    """Estimated output tokens of an answer: its text and its tool calls' names and arguments."""
    calls = [call.name + wirejson.dumps(call.arguments).decode() for call in turn.tool_calls]
    return count("\n".join([turn.text, *calls]))


def completed(usage: Usage, fmt: WireFormat, body: dict[str, Any] | None, turn: AssistantTurn | None,
              unread: int = 0) -> Usage:
    """``usage`` with each count the answer did not report estimated (``estimated`` then True): input from
    ``body`` (none without it), output from ``turn`` (none without it, or when it holds nothing: a stream
    that did not parse as the format's events) and ``unread``, the characters of stream event data that were
    not kept to be read (counted at 4 characters a token). Never raises: a count that fails is left unreported
    (and logged)."""
    if usage.input_tokens is not None and usage.output_tokens is not None:
        return usage
    filled = Usage(usage.input_tokens, usage.output_tokens)
    try:
        if filled.input_tokens is None and body is not None:
            filled.input_tokens = input_tokens(fmt, body)
        read = turn is not None and bool(turn.text or turn.tool_calls)
        if filled.output_tokens is None and (read or unread):
            filled.output_tokens = (output_tokens(turn) if turn is not None and read else 0) + (unread + 3) // 4
    except Exception as exc:  # noqa: BLE001 - an estimate must never cost the agent its answer or ledger line
        log.warning("cannot estimate the usage of an answer that reported none (%s)", type(exc).__name__)
    filled.estimated = (filled.input_tokens, filled.output_tokens) != (usage.input_tokens, usage.output_tokens)
    return filled


async def completed_off_loop(usage: Usage, fmt: WireFormat, body: dict[str, Any] | None,
                             turn: AssistantTurn | None, unread: int = 0) -> Usage:
    """:func:`completed`, for the event loop: when a count is missing and the encoding is still loading (a
    proxy's first answers, while ``tokenizers.warm`` runs), it first waits for the encoding on a worker thread
    instead of loading it on the loop. The wait is shielded (bounded by the load, under a second), so that an
    answer cut meanwhile is still counted for its ledger line."""
    if usage.input_tokens is None or usage.output_tokens is None:
        with trio.CancelScope(shield=True):
            await tokenizers.loaded(encoding)
    return completed(usage, fmt, body, turn, unread)
