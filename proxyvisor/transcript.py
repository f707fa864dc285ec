"""A format-neutral view of a request's history, for the detectors, and the text filter the formats apply.

Each wire format turns one item of its history (a Chat or Anthropic message, a Responses input item) into one
:class:`Message` (``WireFormat.message``). The detectors only ever see these, so they know nothing of formats.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import orjson


@dataclass(frozen=True, slots=True)
class ToolUse:
    """A tool call the model made: the call id, the tool name and its arguments (a JSON object)."""

    id: str
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True, slots=True)
class ToolOutput:
    """A tool result the agent sent back. ``is_error`` is the client's own flag (Anthropic ``is_error``), None
    when it sent none; ``structured`` is True when the result holds more than text (images, documents)."""

    call_id: str
    text: str
    is_error: bool | None = None
    structured: bool = False


@dataclass(frozen=True, slots=True)
class Message:
    """One history item. ``role`` is ``system``, ``user`` (text the user or harness wrote), ``assistant`` (model
    text and tool calls), ``tool`` (tool results, with any text sent alongside them) or ``other`` (reasoning items
    and anything else the detectors ignore)."""

    role: str
    text: str = ""
    tool_uses: tuple[ToolUse, ...] = ()
    tool_outputs: tuple[ToolOutput, ...] = ()
    _fingerprint: bytes | None = field(default=None, init=False, repr=False, compare=False)
    """Its :func:`fingerprint`, once computed (a message is read once per history item and kept on it, and each
    request asks for the fingerprints of a few items it has seen before)."""


_CONTEXT = re.compile(r"<(system-reminder|environment_context)>.*?</\1>", re.DOTALL)
"""A context block an agent harness puts into a user message: Claude Code's ``<system-reminder>`` (beside the
user's words, or alone in a message of its own) and Codex's ``<environment_context>`` (a user message of its own:
working directory, shell, date, sandbox)."""
_OPENERS = ("<system-reminder>", "<environment_context>")


def own_words(text: str) -> str:
    """What the user wrote in a user message's ``text``: without the harness's context blocks (:data:`_CONTEXT`),
    trimmed. Empty for a message that is only such context (or empty)."""
    if not any(opener in text for opener in _OPENERS):
        return text.strip()
    return _CONTEXT.sub("", text).strip()


def harness_context(text: str) -> bool:
    """Whether a user message's ``text`` is only harness context (:func:`own_words`): such a message is not a
    user turn, and its text is not the user's request. A message with no text at all (an image alone) is not."""
    return any(opener in text for opener in _OPENERS) and not own_words(text)


_SAMPLE = 256


class Tail(NamedTuple):
    """The agent's last history item in a request: where it is, its :func:`fingerprint`, its role."""

    position: int
    fingerprint: bytes
    role: str


def _sample(text: str) -> str:
    return text if len(text) <= 2 * _SAMPLE else text[:_SAMPLE] + text[-_SAMPLE:]


def fingerprint(message: Message) -> bytes:
    """A cheap digest (16 bytes) that changes when a history item is replaced or edited.

    It covers the role, ids and names, lengths and the first and last 256 characters of each text, so its cost
    does not grow with a tool output's size. Used to notice that a history was rewritten (compaction, edits) and
    to check that a note's anchor is still in place. Computed once per message (kept on it).
    """
    if message._fingerprint is not None:
        return message._fingerprint
    parts: list[Any] = [message.role, len(message.text), _sample(message.text)]
    for use in message.tool_uses:
        parts += [use.id, use.name]
    for out in message.tool_outputs:
        parts += [out.call_id, len(out.text), _sample(out.text), out.is_error]
    digest = hashlib.blake2b(orjson.dumps(parts), digest_size=16).digest()
    object.__setattr__(message, "_fingerprint", digest)  # frozen: the one field set after construction, once
    return digest


class TextFilter(Protocol):
    """Streaming text rewriting, one instance per text part: ``feed`` returns the text safe to send now,
    ``finish`` the rest at the end of the part (see ``proxyvisor.detectors.selfreport.Stripper``)."""

    def feed(self, piece: str) -> str: ...

    def finish(self) -> str: ...


TextEdit = Callable[[str], str]
"""Rewrites a whole text (a non-streaming response's text, or a stream's full-text copy)."""


class StreamEditor(Protocol):
    """Rewrites one SSE stream event by event (``WireFormat.stream_editor``).

    ``event`` returns None to pass the event on byte-identical, or the bytes to send instead (possibly none);
    ``close`` returns what must still be sent at the end of the stream.
    """

    def event(self, name: str | None, data: str) -> list[bytes] | None: ...

    def close(self) -> list[bytes]: ...


class StreamSplice(StreamEditor, Protocol):
    """Joins upstream streams into one stream for the client (``WireFormat.stream_splice``): a
    :class:`StreamEditor` fed the events of one upstream stream after another.

    On the first stream, events pass unchanged until one starts a call of a tool the splice holds; from there on
    :attr:`held` is True and every event of that stream is held back (returned as ``[]``). After
    :meth:`next_response`, the events of the next upstream stream (the turn continued upstream) are rewritten to
    continue what the client already has: no second response head, block, tool-call and output positions shifted
    past those already sent, sequence numbers going on, and a final response object listing everything sent.

    With ``stop`` (``WireFormat.stream_splice(hold, stop=True)``) it also holds the stop of a stream that makes
    no tool call: from the event that ends the answer (Messages ``message_delta``, a Chat chunk with a
    ``finish_reason`` (any text it carries still passes), Responses ``response.completed`` / ``incomplete`` /
    ``failed``) on, :attr:`stopped` is True and every event is kept back until :meth:`release` sends it or
    :meth:`next_response` drops it (the turn goes on in the next stream); :meth:`add_text` adds text to the answer
    before the stop. The close of the answer's last text (a Messages ``content_block_stop``, a Responses message's
    ``done`` events) waits for the next event, and is kept back with the stop when that is the stop.
    """

    held: bool
    stopped: bool
    calling: bool
    """A tool call started in the current stream (its stop is then never kept back)."""
    continuing: bool
    """:meth:`next_response` was called: events are rewritten to continue what the client has."""

    def next_response(self) -> None:
        """The events that follow belong to the next upstream stream, which continues this one; kept-back stop
        events are dropped."""

    def add_text(self, text: str) -> list[bytes]:
        """The events that add ``text`` to the answer the client is reading, to send before :meth:`release`: after
        a blank line at the end of the answer's last text when its close was kept back with the stop (a Messages
        text block, a Responses message; a Chat message's content always), else as new text (a new text block or
        output item after everything sent so far)."""

    def release(self) -> list[bytes] | None:
        """The kept-back stop events as the client must get them, or None when they go out as the upstream sent
        them (the caller then sends their own bytes). Clears them."""
