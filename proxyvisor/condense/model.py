"""The condenser call through litellm with ``[supervisor.model]``.

litellm runs on its own asyncio thread (:mod:`proxyvisor.adapters.litellm_bridge`), where it is also imported,
so its few seconds of import time never block the trio loop. Cancelling the awaiting trio task (the round's
timeout) cancels the litellm call.

``api_base = "scripted:"`` points the model at the embedded scripted upstream (no key, no network), which answers
condenser requests with a fixed policy (``proxyvisor.adapters.scripted_condenser``): the demo and
``proxyvisor replay --condense`` use it.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from ..adapters import litellm_bridge
from ..config import SCRIPTED_URL, Config, ConfigError, ModelConfig

SCRIPTED_KEY = "proxyvisor-scripted"
"""The placeholder key sent to the scripted upstream (the OpenAI client refuses to call without one)."""

Condenser = Callable[[list[dict[str, str]]], Awaitable[str]]
"""A condenser call: chat messages in, the model's answer text out; raises on any failure."""


def configured_condenser(model: ModelConfig, scripted_url: str | None = None,
                         env: Mapping[str, str] | None = None) -> Condenser | None:
    """The condenser ``[supervisor.model]`` describes: None when ``name`` is empty; with ``api_base =
    "scripted:"``, the embedded scripted upstream serving at ``scripted_url`` (``http://host:port``), called as an
    OpenAI-compatible endpoint whatever provider prefix ``name`` has.

    Raises:
        ConfigError: ``api_base`` is ``"scripted:"`` and no scripted upstream runs (``scripted_url`` None).
    """
    if not model.name:
        return None
    if model.api_base != SCRIPTED_URL:
        return litellm_condenser(model, env)
    if scripted_url is None:
        raise ConfigError(f'[supervisor.model] api_base = "{SCRIPTED_URL}" needs a scripted upstream '
                          f'([upstreams.NAME] url = "{SCRIPTED_URL}")')
    local = dataclasses.replace(model, name="openai/" + model.name.rsplit("/", 1)[-1],
                                api_base=scripted_url + "/v1", api_key_env="")
    return litellm_condenser(local, env, api_key=SCRIPTED_KEY)


def with_condense(config: Config) -> Config:
    """``config`` with condensing on: ``[supervisor.model]`` as configured, or, when it names no model, the
    scripted upstream's condenser (``api_base = "scripted:"``; ``proxyvisor.adapters.scripted_condenser``)."""
    model = config.supervisor.model
    if not model.name:
        model = dataclasses.replace(model, name="scripted-model", api_base=SCRIPTED_URL)
    return config.with_overrides(supervisor={
        "model": model, "condense": dataclasses.replace(config.supervisor.condense, enabled=True)})


def litellm_condenser(model: ModelConfig, env: Mapping[str, str] | None = None,
                      api_key: str | None = None) -> Condenser:
    """A :data:`Condenser` calling ``model.name`` through litellm; ``api_key`` overrides ``model.api_key_env``.

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
                raise ValueError("the condenser model answered without text")
            return text

        return await litellm_bridge.call(run)

    return complete
