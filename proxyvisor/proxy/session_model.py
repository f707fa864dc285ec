"""The supervisor model on the session's own route: each supervised request's model call
(``proxyvisor.supervisor_model``, route ``session``).

:meth:`SupervisorRoutes.for_request` gives one request its :data:`~proxyvisor.supervisor_model.ModelCall` and the
route's label for the ledger. On the session route the call (:class:`SessionModel`) is a request of its own to the
upstream the agent's request went to, sent the same way (the relay with the agent's headers, so its credentials or
the upstream's configured key exactly as the relay sends them; or the translator the request itself took), in the
agent's wire format, naming the agent's model (``[supervisor.model] name`` when set). It is never streamed and
carries ``max_tokens``, ``temperature``, ``top_p`` and ``reasoning_effort`` of ``[supervisor.model]``; verifier,
refuter and planner calls ask for their answer's JSON schema in the format's own way:

=========  ==========================================================================================
format     structured answer
=========  ==========================================================================================
chat       ``response_format: {"type": "json_schema", "json_schema": {"name", "schema", "strict": false}}``
messages   a forced tool: ``tools: [{"name", "input_schema"}]``, ``tool_choice: {"type": "tool"}``; the
           answer is the ``tool_use`` block's input
responses  ``text: {"format": {"type": "json_schema", "name", "schema", "strict": false}}``
=========  ==========================================================================================

An upstream that refuses those extras (a 400: a model without ``temperature``, an endpoint without schemas) is asked
once more with the plain request, and that upstream and model get plain requests from then on. A 401 or 403 (a key
that serves only the agent itself, such as a subscription token, which Anthropic answers with a 400 about the
credential: :func:`refusal`) is a refusal: the gate labels the turn ``unverified`` with that reason (a
:class:`RouteError`), and the proxy warns once per upstream and status, not per request.

Credentials stay in the request's own closures (``send``) and are never written: error reasons quote the upstream's
message with every credential the request carried, and any other secret-looking value (``proxyvisor.redact``),
replaced by ``[redacted]``.

Usage is read from the answer (``WireFormat.usage``) and priced by litellm's cost map (``proxyvisor.pricing``, on a
worker thread): None, not priced, for a model the map does not know and for the scripted upstream).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
import trio

from ..config import SCRIPTED_MODEL, ModelConfig, UpstreamConfig
from ..pricing import price
from ..redact import redact
from ..supervisor_model import LITELLM, SESSION, ModelAnswer, ModelCall, ReportedFailure, schema_of
from .formats import WireFormat
from .info import model_name
from .relay import Headers, UpstreamReply
from .sse import SSEParser

log = logging.getLogger("proxyvisor.supervisor")

Send = Callable[[dict[str, Any]], Awaitable[UpstreamReply]]
"""Sends one request body the way the agent's request went and returns the upstream's reply."""

SUPPLIED = "supplied"
"""The route label of a model call given to ``proxyvisor.proxy.service.running`` (tests, benchmarks)."""
_AUTH = (b"authorization", b"x-api-key", b"api-key")
_REASON_CHARS = 300


class RouteError(ReportedFailure):
    """The session's route answered a supervisor call with an error ``status`` (401/403: it refused it). The
    message (the reason the ledger records) holds no credential."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def secrets_of(headers: Headers, api_key: str | None = None) -> list[str]:
    """The credentials a request carries in ``headers`` (and the upstream's configured ``api_key``), longest
    first, each also without its ``Bearer`` scheme: what must never appear in a reason."""
    found = {api_key} if api_key else set()
    for name, value in headers:
        if name.lower() in _AUTH:
            text = value.decode("latin-1").strip()
            found.add(text)
            found.add(text.partition(" ")[2].strip() if text.lower().startswith("bearer ") else text)
    return sorted((s for s in found if len(s) >= 4), key=len, reverse=True)


class SupervisorRoutes:
    """The supervisor route of every request of a proxy: ``settings`` (``[supervisor.model]``) and, for the litellm
    route or a supplied call, the one ``fixed`` call every request shares (labelled ``fixed_route``)."""

    def __init__(self, settings: ModelConfig, fixed: ModelCall | None = None, fixed_route: str = LITELLM) -> None:
        self.settings = settings
        self.fixed = fixed
        self.fixed_route = fixed_route
        self.plain: set[tuple[str, str]] = set()
        """(upstream, model) pairs that refused the structured extras: they get plain requests."""
        self.warned: set[tuple[str, int]] = set()

    def for_request(self, fmt: WireFormat, body: dict[str, Any], send: Send, upstream: UpstreamConfig,
                    secrets: list[str], translated: bool = False) -> tuple[ModelCall, dict[str, str]]:
        """The model call of one supervised request in ``fmt`` (``body`` as the agent sent it) whose upstream is
        ``upstream``, and its label ``{"route", "model"}``. ``send`` sends a body the way the request went
        (``translated``: through the translator, which names the upstream's ``model`` when one is configured);
        ``secrets`` are the credentials it carries (:func:`secrets_of`)."""
        if self.fixed is not None:
            return self.fixed, {"route": self.fixed_route, "model": self.settings.name}
        model = self.settings.name or (given if isinstance(given := body.get("model"), str) else "")
        call = SessionModel(self, fmt, send, model, upstream, secrets, "max_completion_tokens" in body)
        # The built-in scripted upstream answers whatever model is asked for: it, not that name, judged.
        named = SCRIPTED_MODEL if upstream.scripted else upstream.model if translated and upstream.model else model
        return call, {"route": SESSION, "model": model_name(named) or ""}

    def failed(self, upstream: str, status: int, reason: str) -> None:
        """Log a route's refusal or error once per upstream and status (later ones at debug level)."""
        if (upstream, status) in self.warned:
            log.debug("supervisor call failed: %s", reason)
            return
        self.warned.add((upstream, status))
        log.warning("%s; turns the verifier cannot judge there are labelled unverified (to use another route, "
                    "give [supervisor.model] an api_key_env and name; to stop these calls, set "
                    "[supervisor.gate] enabled = false)", reason)


class SessionModel:
    """The supervisor :data:`~proxyvisor.supervisor_model.ModelCall` of one request on the session's route (module
    docstring): ``completion_tokens``: the agent's chat request names its token limit ``max_completion_tokens``
    (what newer OpenAI models take), so the supervisor's does too."""

    def __init__(self, routes: SupervisorRoutes, fmt: WireFormat, send: Send, model: str, upstream: UpstreamConfig,
                 secrets: list[str], completion_tokens: bool = False) -> None:
        self.routes = routes
        self.fmt = fmt
        self.send = send
        self.model = model
        self.upstream = upstream
        self.secrets = secrets
        self.completion_tokens = completion_tokens

    async def __call__(self, messages: list[dict[str, str]]) -> ModelAnswer:
        """The answer to ``messages``, with its usage.

        Raises:
            RouteError: the upstream answered with an error status (``refused`` for 401/403).
            UpstreamError: the upstream is unreachable or timed out.
            ValueError: the answer has no text.
        """
        schema = schema_of(messages)
        key = (self.upstream.name, self.model)
        plain = key in self.routes.plain
        status, response = await self._ask(self.request(messages, schema, plain))
        if status == 400 and not plain and not refusal(status, response):
            self.routes.plain.add(key)
            plain = True
            status, response = await self._ask(self.request(messages, schema, plain))
        if status >= 400:
            reason = (f"the session's route ({self.upstream.name!r}, model {self.model!r}) "
                      f"{'refused' if refusal(status, response) else 'failed'} the supervisor call ({status}): "
                      f"{self._message(response)}")
            self.routes.failed(self.upstream.name, status, reason)
            raise RouteError(status, reason)
        text = self.fmt.schema_answer(response, schema[0]) if schema and not plain else \
            self.fmt.parse_response(response).text
        if not text:
            raise ValueError("the supervisor model answered without text")
        usage = self.fmt.usage(response)
        tokens_in, tokens_out = usage.input_tokens or 0, usage.output_tokens or 0
        cost: float | None = None if self.upstream.scripted or not self.model else 0.0
        if cost is not None and (tokens_in or tokens_out):
            # A worker thread: the first price reads litellm's cost map from disk.
            cost = await trio.to_thread.run_sync(price, self.model, tokens_in, tokens_out, abandon_on_cancel=True)
        return ModelAnswer(text, tokens_in, tokens_out, cost)

    def request(self, messages: list[dict[str, str]], schema: tuple[str, dict[str, Any]] | None,
                plain: bool) -> dict[str, Any]:
        """The request body for ``messages`` in the request's format (module docstring); ``plain``: without the
        sampling settings and the schema."""
        s = self.routes.settings
        body = self.fmt.request_from_chat(messages, self.model, stream=False)
        if plain:
            return body
        self.fmt.ask_settings(body, s.max_tokens, s.temperature, s.top_p, s.reasoning_effort, self.completion_tokens)
        if schema is not None:
            self.fmt.ask_schema(body, *schema)
        return body

    async def _ask(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        """Send ``body``; the reply's status and JSON object (``{}`` when it is none)."""
        reply = await self.send(body)
        if reply.streaming:  # an upstream that streams unasked: its events make the same response
            parser, events = SSEParser(), []
            async for chunk in reply.body:  # type: ignore[union-attr]
                events += [(e.event, e.data) for e in parser.feed(chunk)]
            try:
                return reply.status, self.fmt.stream_response(events)
            except (AttributeError, IndexError, KeyError, TypeError, ValueError):
                return reply.status, {}
        try:
            data = orjson.loads(reply.body)  # type: ignore[arg-type]
        except orjson.JSONDecodeError:
            data = {}
        return reply.status, data if isinstance(data, dict) else {}

    def _message(self, response: dict[str, Any]) -> str:
        message = error_message(response)
        return redact(message, self.secrets)[:_REASON_CHARS] if message else "no error message"


def error_message(response: dict[str, Any]) -> str:
    """The message of an error body (OpenAI's and Anthropic's ``error.message``), empty when it has none."""
    error = response.get("error")
    message = error.get("message") if isinstance(error, dict) else error
    return message if isinstance(message, str) else ""


def refusal(status: int, response: dict[str, Any]) -> bool:
    """Whether an error answer refuses the caller rather than the request: 401 or 403, or a 400 that says the
    credential does not serve this use (Anthropic answers a subscription token used outside its own client with
    400 "This credential is only authorized for use with Claude Code ...")."""
    return status in (401, 403) or status == 400 and "credential" in error_message(response).lower()
