"""The supervisor model call through litellm with ``[supervisor.model]``: one profile serves condense, the
verify-gate (verifier and refuter) and the planner (reference ``in-session-supervisor-mechanics.md`` section 9:
"the single supervisor profile serves gate, resolve, plan, condense...").

litellm runs on its own asyncio thread (:mod:`proxyvisor.adapters.litellm_bridge`), where it is also imported,
so its few seconds of import time never block the trio loop. Cancelling the awaiting trio task (the round's
timeout) cancels the litellm call.

``api_base = "scripted:"`` points the model at the embedded scripted upstream (no key, no network), which answers
condenser, verifier and planner requests with fixed policies (``proxyvisor.adapters.scripted_condenser``,
``proxyvisor.adapters.scripted_verifier``, ``proxyvisor.adapters.scripted_planner``): the demo,
``proxyvisor replay --condense`` and the tests use it.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from .adapters import litellm_bridge
from .config import SCRIPTED_URL, Config, ConfigError, ModelConfig

SCRIPTED_KEY = "proxyvisor-scripted"
"""The placeholder key sent to the scripted upstream (the OpenAI client refuses to call without one)."""

ModelCall = Callable[[list[dict[str, str]]], Awaitable[str]]
"""A supervisor model call: chat messages in, the model's answer text out (a :class:`ModelAnswer` when the call
went through litellm, carrying its usage); raises on any failure."""


class ModelAnswer(str):
    """The answer text of a litellm call, with its usage: ``input_tokens``, ``output_tokens`` and ``cost_usd``
    (litellm's cost map; 0.0 for a model the map does not price, such as the scripted upstream). A ``str``, so
    callers that want only the text need nothing else; :func:`usage_of` reads the usage of any answer."""

    input_tokens: int
    output_tokens: int
    cost_usd: float

    def __new__(cls, text: str, input_tokens: int = 0, output_tokens: int = 0, cost_usd: float = 0.0) -> ModelAnswer:
        answer = super().__new__(cls, text)
        answer.input_tokens, answer.output_tokens, answer.cost_usd = input_tokens, output_tokens, cost_usd
        return answer


def usage_of(answer: str) -> tuple[int, int, float]:
    """(input tokens, output tokens, cost in USD) of a model answer; zeros for a plain ``str`` (a test double)."""
    if isinstance(answer, ModelAnswer):
        return answer.input_tokens, answer.output_tokens, answer.cost_usd
    return 0, 0, 0.0


def configured_model(model: ModelConfig, scripted_url: str | None = None,
                     env: Mapping[str, str] | None = None) -> ModelCall | None:
    """The model call ``[supervisor.model]`` describes: None when ``name`` is empty; with ``api_base =
    "scripted:"``, the embedded scripted upstream serving at ``scripted_url`` (``http://host:port``), called as an
    OpenAI-compatible endpoint whatever provider prefix ``name`` has.

    Raises:
        ConfigError: ``api_base`` is ``"scripted:"`` and no scripted upstream runs (``scripted_url`` None).
    """
    if not model.name:
        return None
    if model.api_base != SCRIPTED_URL:
        return litellm_model(model, env)
    if scripted_url is None:
        raise ConfigError(f'[supervisor.model] api_base = "{SCRIPTED_URL}" needs a scripted upstream '
                          f'([upstreams.NAME] url = "{SCRIPTED_URL}")')
    local = dataclasses.replace(model, name="openai/" + model.name.rsplit("/", 1)[-1],
                                api_base=scripted_url + "/v1", api_key_env="")
    return litellm_model(local, env, api_key=SCRIPTED_KEY)


def with_model(config: Config) -> Config:
    """``config`` with a supervisor model: ``[supervisor.model]`` as configured, or, when it names no model, the
    embedded scripted upstream's fixed policies (``api_base = "scripted:"``)."""
    model = config.supervisor.model
    if model.name:
        return config
    return config.with_overrides(supervisor={
        "model": dataclasses.replace(model, name="scripted-model", api_base=SCRIPTED_URL)})


def with_condense(config: Config) -> Config:
    """:func:`with_model`, with condensing on."""
    config = with_model(config)
    return config.with_overrides(supervisor={
        "condense": dataclasses.replace(config.supervisor.condense, enabled=True)})


def litellm_model(model: ModelConfig, env: Mapping[str, str] | None = None,
                  api_key: str | None = None) -> ModelCall:
    """A :data:`ModelCall` calling ``model.name`` through litellm; ``api_key`` overrides ``model.api_key_env``.

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

    async def complete(messages: list[dict[str, str]]) -> str:
        async def run() -> str:
            litellm = litellm_bridge.import_litellm()
            response = await litellm.acompletion(messages=messages, **kwargs)
            text = response.choices[0].message.content
            if not isinstance(text, str) or not text:
                raise ValueError("the supervisor model answered without text")
            usage = getattr(response, "usage", None)
            try:
                cost = float(litellm.completion_cost(completion_response=response) or 0.0)
            except Exception:  # noqa: BLE001 - a model missing from litellm's cost map costs "unknown", shown as 0
                cost = 0.0
            return ModelAnswer(text, int(getattr(usage, "prompt_tokens", 0) or 0),
                               int(getattr(usage, "completion_tokens", 0) or 0), cost)

        return await litellm_bridge.call(run)

    return complete
