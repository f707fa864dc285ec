"""The translation path: a client format that no upstream speaks natively, served through litellm.

One litellm entry point per client format, pointed at the upstream's format by a provider prefix
(DESIGN.md, principle 3):

============  ==========  =============================================  ==========================
client        upstream    litellm call                                   model
============  ==========  =============================================  ==========================
chat          messages    ``acompletion``                                ``anthropic/M``
chat          responses   ``acompletion``                                ``openai/responses/M``
messages      chat        ``anthropic.messages.acreate``                 ``custom_openai/M``
messages      responses   ``anthropic.messages.acreate``                 ``openai/M``
responses     chat        ``aresponses``                                 ``custom_openai/M``
responses     messages    ``aresponses``                                 ``anthropic/M``
============  ==========  =============================================  ==========================

``custom_openai`` is litellm's plain OpenAI-compatible provider: with it litellm bridges Messages and Responses
requests to ``/v1/chat/completions`` (with ``openai/`` it would call ``/v1/responses``, which a chat-only
upstream lacks). ``M`` is the upstream's configured ``model``, else the client's. Only the documented request
fields of the client's format are handed to litellm (:data:`_CLIENTS`): a body field such as ``api_base`` must
never reach litellm's keyword arguments, and fields without a counterpart upstream are dropped.

Replies are written in the client's own grammar: JSON for a non-streaming request; for a stream, chat ``data:``
lines ending in ``data: [DONE]``, Anthropic named events, or Responses named events renumbered with an
increasing ``sequence_number``. proxyvisor never retries (``max_retries=0``): clients run their own retry loops.

The credential is the upstream's configured key, else the client's own (``Authorization: Bearer`` or
``x-api-key``), else a placeholder: never a key from proxyvisor's environment, where litellm would otherwise look.

A chat upstream's stream is normalised before litellm reads it (:class:`ToolCallSplitter`): a tool call delta
with a new ``id`` at an ``index`` that an earlier call holds is a new call, given an index of its own (some
providers stream parallel calls all at index 0, which litellm's Responses bridge merges into one call).
"""

from __future__ import annotations

import ast
import json
import logging
import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import orjson
import trio

from .. import wirejson
from ..adapters import litellm_bridge
from ..adapters.failures import retry_after_header
from ..config import UpstreamConfig
from .formats import WireFormat, sse
from .client import Cut
from .relay import Headers, HttpRelay, UpstreamError, UpstreamReply, stopped_or_idle

log = logging.getLogger("proxyvisor.translate")

NO_KEY = "proxyvisor-no-key"
"""Sent as the API key when neither the upstream config nor the client supplies one."""

_JSON: Headers = [(b"content-type", b"application/json")]
_SSE: Headers = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
_MAX_REGISTERED = 256


@dataclass(frozen=True)
class _Route:
    """How litellm reaches one upstream format from one client format."""

    call: str
    """``acompletion``, ``messages`` (litellm.anthropic.messages.acreate) or ``aresponses``."""
    prefix: str
    """litellm provider prefix put before the model name."""
    v1: bool
    """Whether litellm's ``api_base`` includes ``/v1`` (OpenAI providers) or not (Anthropic adds it itself)."""


_ROUTES: dict[tuple[str, str], _Route] = {
    ("chat", "messages"): _Route("acompletion", "anthropic/", False),
    ("chat", "responses"): _Route("acompletion", "openai/responses/", True),
    ("messages", "chat"): _Route("messages", "custom_openai/", True),
    ("messages", "responses"): _Route("messages", "openai/", True),
    ("responses", "chat"): _Route("aresponses", "custom_openai/", True),
    ("responses", "messages"): _Route("aresponses", "anthropic/", False),
}


@dataclass(frozen=True)
class _Client:
    """What the translation needs to know of a client format."""

    fields: frozenset[str]
    """The request fields the API documents that litellm translates; the rest of the body is dropped."""
    named: bool
    """Whether stream events carry an ``event:`` line (their ``type``), as Anthropic's and Responses' do."""
    numbered: bool
    """Whether stream events carry an increasing ``sequence_number`` (Responses)."""
    done: bytes
    """What ends a complete stream after litellm's last event (chat's ``[DONE]`` line)."""
    terminal: tuple[bytes, ...]
    """Events that end the client's stream (litellm's adapters send their own error events); a failure after
    one (litellm's own clean-up) is not reported to the client."""


# Anthropic's thinking, context_management and output_config, and Responses' store, previous_response_id and
# include, have no counterpart on the other APIs (litellm would emulate some of them with extra model calls or
# server-side state), so they are not in ``fields``.
_CLIENTS: dict[str, _Client] = {
    "chat": _Client(
        frozenset({"messages", "tools", "tool_choice", "parallel_tool_calls", "temperature", "top_p", "max_tokens",
                   "max_completion_tokens", "stop", "n", "presence_penalty", "frequency_penalty", "logit_bias",
                   "logprobs", "top_logprobs", "seed", "response_format", "user", "reasoning_effort",
                   "stream_options"}),
        named=False, numbered=False, done=b"data: [DONE]\n\n", terminal=()),
    "messages": _Client(
        frozenset({"messages", "system", "max_tokens", "tools", "tool_choice", "temperature", "top_p", "top_k",
                   "stop_sequences", "metadata"}),
        named=True, numbered=False, done=b"", terminal=(b"event: message_stop\n", b"event: error\n")),
    "responses": _Client(
        frozenset({"input", "instructions", "tools", "tool_choice", "parallel_tool_calls", "temperature", "top_p",
                   "max_output_tokens", "reasoning", "text", "truncation", "user"}),
        named=True, numbered=True, done=b"",
        terminal=(b"event: response.completed\n", b"event: response.failed\n", b"event: response.incomplete\n",
                  b"event: error\n")),
}

# litellm's prefixes before the upstream's message: "litellm.RateLimitError: RateLimitError: OpenAIException - ".
_PREFIX = re.compile(r"^(?:litellm\.\w+: |\w+Error: )*(?:\w+Exception - )?")
_TRACEBACK = re.compile(r"Traceback \(most recent call last\):")
_SOURCE_PATH = re.compile(r"(?:[A-Za-z]:)?(?:[\\/][\w.+@-]+)+\.py[cw]?\b")
"""A Python source file's path, as litellm quotes them in the tracebacks it puts into its messages."""

# The content part types a Chat Completions message of each role may hold: the documented ones, and for user
# messages those litellm accepts too (it validates only user messages, and fails with a traceback).
_CHAT_PARTS: dict[str, frozenset[str]] = {
    "user": frozenset({"text", "image_url", "input_audio", "file", "audio_url", "document", "video_url",
                       "guarded_text", "grounding_source", "query"}),
    "assistant": frozenset({"text", "refusal"}),
}


def _route_for(client: str, upstream_formats: tuple[str, ...]) -> tuple[str, _Route]:
    """The upstream format to translate to and how: the first of ``upstream_formats`` litellm can reach.

    Raises:
        UpstreamError: 501, no translation exists between the formats.
    """
    for target in upstream_formats:
        route = _ROUTES.get((client, target))
        if route is not None:
            return target, route
    raise UpstreamError(501, f"no translation from {client} to {'/'.join(upstream_formats)}")


def _client_key(headers: Headers) -> str | None:
    """The client's own credential: ``Authorization: Bearer X`` or ``x-api-key: X``."""
    for name, value in headers:
        if name == b"authorization" and value[:7].lower() == b"bearer ":
            return value[7:].decode("latin-1").strip() or None
        if name in (b"x-api-key", b"api-key"):
            return value.decode("latin-1").strip() or None
    return None


class Translator:
    """Serves requests through litellm for upstreams that do not speak the client's format.

    ``relays`` maps upstream names to their :class:`HttpRelay`, whose ``base`` (URL without ``/v1``) and
    ``api_key`` are used.
    """

    def __init__(self, relays: dict[str, HttpRelay]) -> None:
        self.relays = relays
        self._registered: set[str] = set()
        self._http: httpx.AsyncClient | None = None

    async def send(self, fmt: WireFormat, upstream: UpstreamConfig, body: dict[str, Any],
                   headers: Headers) -> UpstreamReply:
        """Translate ``body`` (client format ``fmt``) for ``upstream`` and return the reply in ``fmt``.

        An error status from the upstream comes back as a reply with that status (529 for Anthropic's
        ``overloaded_error``), the format's error body and the upstream's ``Retry-After`` (a 429 always has
        one). A stream is an async iterable of SSE bytes whose ``error`` is set when it broke mid-way.

        The upstream's error ``code`` (``context_length_exceeded``, on which clients compact; litellm's
        recognition of a context window error where the upstream's format has no code) is kept in the client's
        error body. No message from litellm's own code reaches the client beyond its first line, and never a
        traceback or a source path.

        Raises:
            UpstreamError: no translation exists (501), no model is known (400), a Chat Completions request
                holds content parts of another format (400: litellm cannot translate them), the upstream is
                unreachable (502) or sent nothing within ``first_byte_timeout_s`` (504).
        """
        target, route = _route_for(fmt.name, upstream.formats)
        relay = self.relays[upstream.name]
        model = upstream.model or body.get("model")
        if not isinstance(model, str) or not model:
            raise UpstreamError(400, "the request names no model and [upstreams] model is not set")
        if fmt.name == "chat" and (problem := _chat_problem(body.get("messages"))):
            raise UpstreamError(400, problem)
        key = relay.api_key or _client_key(headers) or NO_KEY
        stream = body.get("stream") is True
        # A copy: litellm may edit what it is handed, and a supervised body's history items are shared with the
        # session's later requests (proxyvisor.proxy.bodies).
        kwargs = wirejson.loads(wirejson.dumps({k: v for k, v in body.items() if k in _CLIENTS[fmt.name].fields}))
        kwargs.update(model=route.prefix + model, stream=stream, api_key=key,
                      api_base=relay.base + ("/v1" if route.v1 else ""),
                      max_retries=0, num_retries=0, drop_params=True)
        started = time.perf_counter()
        try:
            with trio.fail_after(upstream.first_byte_timeout_s):
                result = await litellm_bridge.call(lambda: self._invoke(route, target, model, kwargs))
        except trio.TooSlowError:
            raise UpstreamError(504, f"upstream {upstream.name!r} sent no response within "
                                     f"{upstream.first_byte_timeout_s:g} s") from None
        except Exception as exc:  # filtered: litellm's errors become the client's, bugs propagate
            if not _is_api_error(exc):
                raise
            return _failure(fmt, upstream.name, exc, key)
        waited = time.perf_counter() - started
        if stream:
            return UpstreamReply(200, list(_SSE), TranslatedStream(fmt, result, upstream, key, relay.cut), waited)
        return UpstreamReply(200, list(_JSON), wirejson.dumps(_plain(result)), waited)

    async def _invoke(self, route: _Route, target: str, model: str, kwargs: dict[str, Any]) -> Any:
        """The litellm call; runs on the litellm thread."""
        litellm = litellm_bridge.import_litellm()
        if target == "responses" and kwargs["stream"]:
            self._native_streaming(litellm, model)
        if target == "chat":
            # openai takes an httpx client as well as its httpx2 one; its annotation names only httpx2
            kwargs = {**kwargs, "client": openai.AsyncOpenAI(api_key=kwargs["api_key"], base_url=kwargs["api_base"],
                                                             max_retries=0,
                                                             http_client=self._chat_http())}  # type: ignore[arg-type]
        if route.call == "acompletion":
            return await litellm.acompletion(**kwargs)
        if route.call == "aresponses":
            return await litellm.aresponses(**kwargs)
        return await litellm.anthropic.messages.acreate(**kwargs)

    def _chat_http(self) -> httpx.AsyncClient:
        """The HTTP client of litellm's calls to chat upstreams, whose streams it normalises
        (:class:`ToolCallSplitter`). Made on the litellm thread, on first use: it belongs to that thread's loop."""
        if self._http is None:
            self._http = httpx.AsyncClient(transport=_SplittingTransport(httpx.AsyncHTTPTransport()), timeout=None)
        return self._http

    def _native_streaming(self, litellm: Any, model: str) -> None:
        # litellm fakes a stream (one non-streaming upstream call, replayed in slices) for a Responses model
        # missing from its model map; registering the name keeps the upstream call a real stream.
        if model in self._registered or len(self._registered) >= _MAX_REGISTERED:
            return
        self._registered.add(model)
        try:
            litellm.get_model_info(model=model, custom_llm_provider="openai")
        except litellm.exceptions.ModelNotMappedError:
            litellm.register_model({f"openai/{model}": {"litellm_provider": "openai",
                                                        "supports_native_streaming": True}},
                                   persist_across_reloads=False, add_to_provider_model_sets=False)


class ToolCallSplitter:
    """Rewrites a Chat Completions SSE stream so that each tool call has an ``index`` of its own.

    A ``tool_calls`` delta carrying an ``id`` that differs from the id of the call streaming at its ``index``
    starts a new call: it and the id-less deltas after it at that index get the next free index. Streams that
    index their calls distinctly pass unchanged (each index keeps its number); lines without ``tool_calls``
    pass byte for byte. Feed the body in any pieces; :meth:`feed` returns the bytes to pass on, :meth:`finish`
    what an unterminated last line left.
    """

    def __init__(self) -> None:
        self._rest: list[bytes] = []
        """The pieces of an unfinished line (joined once it ends: a long line costs its size, not its square)."""
        self._calls: dict[tuple[int, int], tuple[int, str]] = {}
        """(choice, upstream index) -> (index given, id of the call streaming there)."""
        self._given: dict[int, set[int]] = {}
        """choice -> the indexes given so far."""

    def feed(self, data: bytes) -> bytes:
        end = data.rfind(b"\n") + 1
        if not end:
            self._rest.append(data)
            return b""
        lines = b"".join([*self._rest, data[:end]])
        self._rest = [data[end:]] if end < len(data) else []
        if b'"tool_calls"' not in lines:
            return lines
        return b"".join(self._line(line) for line in lines.splitlines(keepends=True))

    def finish(self) -> bytes:
        rest, self._rest = b"".join(self._rest), []
        return self._line(rest) if rest else b""

    def _line(self, line: bytes) -> bytes:
        if not line.startswith(b"data:") or b'"tool_calls"' not in line:
            return line
        body = line[5:].strip()
        try:
            chunk = wirejson.loads(body)
        except orjson.JSONDecodeError:
            return line
        changed = False
        for choice in chunk.get("choices") or () if isinstance(chunk, dict) else ():
            delta = choice.get("delta") if isinstance(choice, dict) else None
            calls = delta.get("tool_calls") if isinstance(delta, dict) else None
            for call in calls if isinstance(calls, list) else ():
                if isinstance(call, dict) and isinstance(call.get("index"), int):
                    given = self._index(choice.get("index", 0), call["index"], call.get("id"))
                    if given != call["index"]:
                        call["index"] = given
                        changed = True
        if not changed:
            return line
        return b"data: " + wirejson.dumps(chunk) + line[len(line.rstrip(b"\r\n")):]

    def _index(self, choice: Any, index: int, call_id: Any) -> int:
        key = (choice if isinstance(choice, int) else 0, index)
        current = self._calls.get(key)
        if current is not None and (not call_id or call_id == current[1]):
            return current[0]
        given = self._given.setdefault(key[0], set())
        new = index if index not in given else max(given) + 1
        given.add(new)
        self._calls[key] = (new, call_id if isinstance(call_id, str) else "")
        return new


class _SplittingTransport(httpx.AsyncBaseTransport):
    """An HTTP transport that passes Chat Completions streams through a :class:`ToolCallSplitter`."""

    def __init__(self, inner: httpx.AsyncBaseTransport) -> None:
        self.inner = inner

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        chat = request.url.path.endswith("/chat/completions")
        if chat:
            request.headers["accept-encoding"] = "identity"  # the splitter reads the bytes as sent
        response = await self.inner.handle_async_request(request)
        if not chat or not response.headers.get("content-type", "").startswith("text/event-stream") \
                or response.headers.get("content-encoding", "identity") != "identity":
            return response
        return httpx.Response(response.status_code, headers=response.headers, stream=_SplitStream(response.stream),
                              extensions=response.extensions)

    async def aclose(self) -> None:
        await self.inner.aclose()


class _SplitStream(httpx.AsyncByteStream):
    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.splitter = ToolCallSplitter()

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for piece in self.inner:
            out = self.splitter.feed(piece)
            if out:
                yield out
        if rest := self.splitter.finish():
            yield rest

    async def aclose(self) -> None:
        await self.inner.aclose()


@dataclass
class TranslatedStream:
    """litellm's stream re-framed as SSE bytes in the client's format. Iterate once.

    Afterwards ``error`` is None or the failure that cut the stream short (the pipeline then sends the format's
    error event); ``last_chunk`` is the last bytes sent. A wait for the next item ends at ``cut`` (its relay's).
    """

    fmt: WireFormat
    source: Any
    upstream: UpstreamConfig
    key: str
    cut: Cut
    error: UpstreamError | None = None
    last_chunk: bytes = b""

    async def __aiter__(self) -> AsyncIterator[bytes]:
        client = _CLIENTS[self.fmt.name]
        sequence = 0
        finished = False
        items = litellm_bridge.iterate(self.source)
        try:
            while True:
                try:
                    with trio.fail_after(self.upstream.idle_timeout_s) as scope:
                        item = await self.cut.during(scope, items.__anext__())
                except StopAsyncIteration:
                    break
                except trio.TooSlowError:
                    self.error = stopped_or_idle(self.cut, self.upstream.idle_timeout_s)
                    return
                except Exception as exc:  # a broken stream ends with the format's error event
                    if finished:
                        log.debug("litellm failed after the end of the stream: %r", exc)
                    elif _is_api_error(exc):
                        self.error = UpstreamError(_status(exc), "upstream stream broke: " + _message(exc, self.key))
                        log.warning("translated stream from %r broke: %s", self.upstream.name, self.error.message)
                    else:
                        self.error = UpstreamError(500, f"proxyvisor translation failed ({type(exc).__name__}); "
                                                        "see the proxyvisor log")
                        log.exception("translated stream from %r failed", self.upstream.name)
                    return
                chunk = _frame(client, item, sequence)
                sequence += 1
                finished = finished or any(marker in chunk for marker in client.terminal)
                self.last_chunk = chunk
                yield chunk
            if client.done:
                yield client.done
        finally:
            await items.aclose()


def _plain(obj: Any) -> Any:
    """litellm's result as JSON-ready data, less its ``None`` fields and private ``provider_specific_fields``."""
    if isinstance(obj, dict):
        return obj
    return _strip(obj.model_dump(mode="json", exclude_none=True))


def _strip(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _strip(v) for k, v in value.items() if k != "provider_specific_fields"}
    if isinstance(value, list):
        return [_strip(v) for v in value]
    return value


def _frame(client: _Client, item: Any, sequence: int) -> bytes:
    """One stream item from litellm as an SSE event of the client's format."""
    if isinstance(item, bytes):
        return item  # litellm's Anthropic adapters yield ready SSE frames
    data = _plain(item)
    if client.numbered:
        data["sequence_number"] = sequence
    return sse(wirejson.dumps(data), data.get("type") if client.named else None)


def _failure(fmt: WireFormat, upstream: str, exc: Exception, key: str) -> UpstreamReply:
    """An upstream error status as a reply in the client's format; transport failures raise UpstreamError."""
    status, message = _status(exc), _message(exc, key)
    if status in (502, 504):
        raise UpstreamError(status, f"upstream {upstream!r}: {message}") from None
    headers = list(_JSON)
    retry = _retry_after(exc)
    if retry or status == 429:
        headers.append((b"retry-after", (retry or "1").encode()))
    return UpstreamReply(status, headers, fmt.error_body(status, message, _code(exc)), 0.0)


def _chat_problem(messages: Any) -> str | None:
    """Why litellm cannot translate a Chat Completions ``messages`` list, in one line, or None: a message that is
    not an object with a ``role``, or a user or assistant content part of a type Chat Completions lacks (an
    Anthropic ``tool_use`` or ``tool_result`` block)."""
    if not isinstance(messages, list):
        return None  # litellm's own check says what is missing
    # No positions in the message: the body here may hold proxyvisor's additions, so they would not be the client's.
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            return "every item of 'messages' must be an object with a 'role'"
        allowed = _CHAT_PARTS.get(message["role"])
        content = message.get("content")
        if allowed is None or not isinstance(content, list):
            continue
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in allowed:
                return (f"a Chat Completions {message['role']} message cannot hold a content part of type "
                        f"{kind!r} (only {', '.join(sorted(allowed))}): tool calls go in an assistant message's "
                        "'tool_calls' and their results in 'tool' messages; Anthropic content blocks go to "
                        "/v1/messages")
    return None


def _code(exc: Exception) -> str | None:
    """The machine-readable error code to give the client: the upstream's own ``code``, else
    ``context_length_exceeded`` when litellm recognised a context window error (Anthropic's has no code), else
    None."""
    original = getattr(exc, "original_exception", None)
    for candidate in (exc, original) if isinstance(original, Exception) else (exc,):
        code = _upstream_error(candidate).get("code")
        if isinstance(code, str) and code:
            return code
    if isinstance(exc, litellm_bridge.import_litellm().ContextWindowExceededError):
        return "context_length_exceeded"
    return None


def _is_api_error(exc: Exception) -> bool:
    """Whether litellm raised one of its API errors (all derive from the openai SDK's) rather than a bug."""
    import openai  # already loaded by litellm

    return isinstance(exc, openai.OpenAIError)


def _status(exc: Exception) -> int:
    """The status the client should see for a litellm exception: the upstream's, except 504 for a timeout, 502
    for a connection that failed or broke, and 529 for Anthropic's overloaded error."""
    litellm = litellm_bridge.import_litellm()
    if isinstance(exc, litellm.Timeout):
        return 504
    if isinstance(exc, litellm.exceptions.MidStreamFallbackError):
        return 502
    status = getattr(exc, "provider_status_code", None) or getattr(exc, "status_code", None)
    if isinstance(exc, litellm.APIConnectionError) or not isinstance(status, int):
        return 502
    if status == 500 and not getattr(exc, "litellm_response_headers", None):
        return 502  # litellm reports a refused connection as a 500 without any upstream response
    if _upstream_error(exc).get("type") == "overloaded_error":
        return 529  # litellm maps Anthropic's 529 to 500; the body's type keeps what it was
    return status if 400 <= status <= 599 else 502


def _upstream_error(exc: Exception) -> dict[str, Any]:
    """The upstream's JSON error object quoted in litellm's message (``{"error": {...}}``, also as the repr of
    a bytes object, ``b'{...}'``), or {}."""
    text = str(getattr(exc, "message", "") or exc)
    start = text.find("{")
    if start < 0:
        return {}
    if start >= 2 and text[start - 2:start] in ("b'", 'b"'):
        text, start = _unquoted(text, start - 2), 0
    try:
        body, _end = json.JSONDecoder().raw_decode(text, start)
    except ValueError:
        return {}
    error = body.get("error") if isinstance(body, dict) else None
    return error if isinstance(error, dict) else {}


def _unquoted(text: str, start: int) -> str:
    """The text of the bytes literal at ``text[start:]`` (``b'...'``), or "" when it is not one."""
    quote = text[start + 1]
    end = start + 2
    while (end := text.find(quote, end)) > 0 and text[end - 1] == "\\":
        end += 1
    try:
        value = ast.literal_eval(text[start:end + 1]) if end > 0 else b""
    except (ValueError, SyntaxError):
        return ""
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else ""


def _message(exc: Exception, key: str) -> str:
    """The upstream's own error message if litellm quotes one, else litellm's without its prefixes; the API key
    is redacted."""
    original = getattr(exc, "original_exception", None)
    exc = original if isinstance(original, Exception) else exc
    message = _upstream_error(exc).get("message")
    if not isinstance(message, str) or not message:
        message = _first_line(_PREFIX.sub("", str(getattr(exc, "message", "") or exc), count=1)) \
            or type(exc).__name__
    return message.replace(key, "[redacted]") if len(key) >= 4 else message


def _first_line(text: str) -> str:
    """litellm's own message as one line: what comes before a traceback or a second line, with source paths
    removed."""
    text = _TRACEBACK.split(text, maxsplit=1)[0].strip()
    return _SOURCE_PATH.sub("[path]", text.splitlines()[0]).strip() if text else ""


def _retry_after(exc: Exception) -> str | None:
    """The upstream's Retry-After in whole seconds, from the response headers litellm keeps."""
    headers = getattr(exc, "litellm_response_headers", None)
    if not headers:
        return None
    lower = {str(k).lower(): str(v) for k, v in dict(headers).items()}
    if lower.get("retry-after"):
        return lower["retry-after"]
    seconds = retry_after_header(None, 0.0, lower.get("retry-after-ms"))
    return str(seconds) if seconds else None
