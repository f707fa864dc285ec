"""The condenser call through litellm with ``[supervisor.model]``.

litellm runs on its own asyncio thread (:mod:`proxyvisor.adapters.litellm_bridge`), where it is also imported,
so its few seconds of import time never block the trio loop. Cancelling the awaiting trio task (the round's
timeout) cancels the litellm call.
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from ..adapters import litellm_bridge
from ..config import ModelConfig

Condenser = Callable[[list[dict[str, str]]], Awaitable[str]]
"""A condenser call: chat messages in, the model's answer text out; raises on any failure."""


def litellm_condenser(model: ModelConfig, env: Mapping[str, str] | None = None) -> Condenser:
    """A :data:`Condenser` calling ``model.name`` through litellm.

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
    if model.api_key_env:
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
