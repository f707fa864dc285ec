"""The supervisor model: one profile, ``[supervisor.model]``, serves condense, the verify-gate (verifier and
refuter) and the planner (reference ``in-session-supervisor-mechanics.md`` section 9: "the single supervisor
profile serves gate, resolve, plan, condense...").

Two routes (:func:`route_of`):

- **session** (the default; seed 003: omitted fields inherit the agent's model): each call goes the way the request
  being supervised went: to its upstream, in its wire format (or through the translator it took), with the
  credentials it carried, to the model it named, or to ``name`` when one is set (another model beside the agent's,
  e.g. ``claude-haiku-4-5``). One :data:`ModelCall` per request, made by ``proxyvisor.proxy.session_model``.
- **litellm**: with ``api_base`` or ``api_key_env`` set, every call goes to ``name`` through litellm, with its own
  key (:func:`configured_model`). litellm runs on its own asyncio thread (:mod:`proxyvisor.adapters.litellm_bridge`),
  where it is also imported, so its few seconds of import time never block the trio loop. Cancelling the awaiting
  trio task (the round's timeout) cancels the litellm call. ``api_base = "scripted:"`` points it at the embedded
  scripted upstream (no key, no network).

The scripted upstream answers condenser, verifier and planner calls with fixed policies
(``proxyvisor.scripted.condenser``, ``proxyvisor.scripted.verifier``,
``proxyvisor.scripted.planner``) on either route, so the demo, ``replay`` and the tests need no key.

Verifier, refuter and planner calls ask for their answer by JSON schema (:func:`schema_of`): the session route in the
format's own way (``proxyvisor.proxy.session_model``), litellm through ``response_format``.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import msgspec
import orjson
import trio

from .adapters import litellm_bridge
from .config import SCRIPTED_URL, Config, ConfigError, ModelConfig

SCRIPTED_KEY = "proxyvisor-scripted"
"""The placeholder key sent to the scripted upstream (the OpenAI client refuses to call without one)."""


@dataclasses.dataclass(frozen=True)
class ModelAnswer:
    """The answer of one supervisor model call: its ``text`` and usage, ``input_tokens`` and ``output_tokens``
    (the call's prompt and completion tokens) and ``cost_usd`` (USD from litellm's cost map; None, not priced, for
    a model the map does not price and for the built-in scripted model). Not a ``str``: whoever reads the text
    takes ``text``, and the usage stays with the answer whatever is done to the text."""

    text: str
    input_tokens: int = 0
    output_tokens: int = 0
    cost_usd: float | None = 0.0


ModelCall = Callable[[list[dict[str, str]]], Awaitable[ModelAnswer]]
"""A supervisor model call: chat messages in, the model's :class:`ModelAnswer` out; raises on any failure."""


SESSION, LITELLM = "session", "litellm"


class ReportedFailure(Exception):
    """A supervisor call failed in a way its route reported already (logged once for the proxy, e.g. a route that
    refuses the call): callers record the reason and log it below warning level."""


def route_of(model: ModelConfig) -> str:
    """The route ``[supervisor.model]`` picks: :data:`LITELLM` when it sets ``api_base`` or ``api_key_env`` (an
    endpoint or a key of its own), else :data:`SESSION`."""
    return LITELLM if model.api_base or model.api_key_env else SESSION


def describe(model: ModelConfig) -> str:
    """What ``serve`` and ``wrap`` print about the supervisor model's route and model."""
    if route_of(model) == LITELLM:
        return f"litellm: {model.name}" + (" (the scripted upstream's policies)" if model.api_base == SCRIPTED_URL
                                          else "")
    if model.name:
        return f"{model.name} on the session's route"
    return "the session's own (each request's upstream and model)"


def key_warning(model: ModelConfig, env: Mapping[str, str] | None = None) -> str | None:
    """The warning ``serve`` and ``wrap`` print when ``[supervisor.model] api_key_env`` names a variable unset or
    empty in ``env`` (default: ours), which fails every supervisor call; None when it is set or not asked for."""
    env = os.environ if env is None else env
    if route_of(model) != LITELLM or not model.api_key_env or env.get(model.api_key_env):
        return None
    return (f"[supervisor.model] api_key_env names {model.api_key_env}, which is not set: every supervisor call "
            "will fail")


@functools.cache
def _schemas() -> tuple[tuple[str, str, dict[str, Any]], ...]:
    # Imported here, not at the top: the gate's modules import the condense package, whose engine imports this one.
    from .gate.plan import DECISION_SCHEMA, PLANNER_INSTRUCTIONS
    from .gate.verdict import REFUTATION_SCHEMA, REFUTER_INSTRUCTIONS, VERDICT_SCHEMA, VERIFIER_INSTRUCTIONS
    return ((VERIFIER_INSTRUCTIONS, "verdict", VERDICT_SCHEMA), (REFUTER_INSTRUCTIONS, "refutation", REFUTATION_SCHEMA),
            (PLANNER_INSTRUCTIONS, "plan_decision", DECISION_SCHEMA))


def schema_of(messages: list[dict[str, str]]) -> tuple[str, dict[str, Any]] | None:
    """(name, JSON schema) of the answer a supervisor call asks for, recognised by its system prompt (the
    verifier's, refuter's and planner's begin with their instructions); None for a call without one (the
    condenser's own protocol)."""
    system = messages[0].get("content", "") if messages and messages[0].get("role") == "system" else ""
    return next(((name, schema) for prompt, name, schema in _schemas() if system.startswith(prompt)), None)


def configured_model(model: ModelConfig, scripted_url: str | None = None,
                     env: Mapping[str, str] | None = None) -> ModelCall | None:
    """The litellm model call ``[supervisor.model]`` describes, or None on the session route (:func:`route_of`);
    with ``api_base = "scripted:"``, the embedded scripted upstream serving at ``scripted_url``
    (``http://host:port``), called as an OpenAI-compatible endpoint whatever provider prefix ``name`` has.

    Raises:
        ConfigError: the litellm route without ``name``, or ``api_base = "scripted:"`` and no scripted upstream
            runs (``scripted_url`` None).
    """
    if route_of(model) == SESSION:
        return None
    if not model.name:
        raise ConfigError("[supervisor.model] api_base or api_key_env picks the litellm route, which needs a name "
                          "(a litellm model id such as \"anthropic/claude-haiku-4-5\")")
    if model.api_base != SCRIPTED_URL:
        return litellm_model(model, env)
    if scripted_url is None:
        raise ConfigError(f'[supervisor.model] api_base = "{SCRIPTED_URL}" needs a scripted upstream '
                          f'([upstreams.NAME] url = "{SCRIPTED_URL}")')
    return scripted_model(model, scripted_url)


def scripted_model(model: ModelConfig, scripted_url: str) -> ModelCall:
    """A :data:`ModelCall` asking the embedded scripted upstream at ``scripted_url`` (``http://host:port``) with
    one Chat Completions request over loopback (proxyvisor's own HTTP client, no litellm: importing litellm costs
    seconds of CPU, many times the scripted answer's). Answers are never priced (``cost_usd`` None); within
    ``model.request_timeout_s``.

    Raises (from the returned callable): ``RuntimeError`` for an answer other than a 200 with text,
    ``trio.TooSlowError`` past the timeout, and the connection's errors (``OSError``, ``h11.ProtocolError``).
    """
    from .proxy.client import ConnectionPool

    name = model.name.rsplit("/", 1)[-1]

    async def complete(messages: list[dict[str, str]]) -> ModelAnswer:
        schema = schema_of(messages)
        body: dict[str, Any] = {"model": name, "messages": messages, "max_tokens": model.max_tokens}
        if schema is not None:
            body["response_format"] = {"type": "json_schema", "json_schema": {
                "name": schema[0], "schema": schema[1], "strict": False}}
        pool = ConnectionPool(scripted_url, model.request_timeout_s)
        try:
            with trio.fail_after(model.request_timeout_s):
                conn, head = await pool.request(b"POST", b"/v1/chat/completions", [
                    (b"content-type", b"application/json"), (b"authorization", b"Bearer " + SCRIPTED_KEY.encode())],
                    orjson.dumps(body))
                parts, done = [], False
                while not done:
                    piece, done = await conn.next_piece(model.request_timeout_s)
                    parts.append(piece)
                await pool.release(conn, True)
        finally:
            await pool.aclose()
        try:
            answer = orjson.loads(b"".join(parts))
            text = answer["choices"][0]["message"]["content"] if head.status_code == 200 else None
        except (orjson.JSONDecodeError, LookupError, TypeError):
            text = None
        if not isinstance(text, str) or not text:
            raise RuntimeError(f"the scripted upstream answered HTTP {head.status_code} without text")
        usage = answer.get("usage") or {}
        return ModelAnswer(text, int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0),
                           None)

    return complete


def with_condense(config: Config) -> Config:
    """``config`` with condensing on."""
    return config.with_overrides(supervisor={
        "condense": msgspec.structs.replace(config.supervisor.condense, enabled=True)})


def litellm_model(model: ModelConfig, env: Mapping[str, str] | None = None,
                  api_key: str | None = None) -> ModelCall:
    """A :data:`ModelCall` calling ``model.name`` through litellm; ``api_key`` overrides ``model.api_key_env``.

    Verifier, refuter and planner calls ask for their answer's JSON schema through ``response_format``
    (:func:`schema_of`; litellm drops it for a model that takes none).

    Raises (from the returned callable): whatever litellm raises (``litellm.exceptions.*`` for API errors,
    timeouts and connection failures), and ``ValueError`` when the answer has no text.
    """
    env = os.environ if env is None else env
    kwargs: dict[str, Any] = {"model": model.name, "max_tokens": model.max_tokens, "temperature": model.temperature,
                              "timeout": model.request_timeout_s, "num_retries": model.max_retries,
                              "drop_params": True}
    if model.top_p < 1.0:
        kwargs["top_p"] = model.top_p
    if model.reasoning_effort:
        kwargs["reasoning_effort"] = model.reasoning_effort
    if model.api_base:
        kwargs["api_base"] = model.api_base
    if api_key is not None:
        kwargs["api_key"] = api_key
    elif model.api_key_env:
        kwargs["api_key"] = env.get(model.api_key_env, "")

    async def complete(messages: list[dict[str, str]]) -> ModelAnswer:
        schema = schema_of(messages)
        extra = {"response_format": {"type": "json_schema", "json_schema": {
            "name": schema[0], "schema": schema[1], "strict": False}}} if schema is not None else {}

        async def run() -> ModelAnswer:
            litellm = litellm_bridge.import_litellm()
            response = await litellm.acompletion(messages=messages, **kwargs, **extra)
            text = response.choices[0].message.content
            if not isinstance(text, str) or not text:
                raise ValueError("the supervisor model answered without text")
            usage = getattr(response, "usage", None)
            cost: float | None = None
            try:
                cost = float(litellm.completion_cost(completion_response=response) or 0.0)
            except Exception:  # noqa: BLE001 - a model missing from litellm's cost map is not priced (None)
                pass
            return ModelAnswer(text, int(getattr(usage, "prompt_tokens", 0) or 0),
                               int(getattr(usage, "completion_tokens", 0) or 0), cost)

        return await litellm_bridge.call(run)

    return complete
