"""The ``litellm`` adapter: one streamed completion of any provider model through litellm.

The child gets the prompt as its only user message (no tools) and its answer is the completion's text. litellm
runs on the bridge thread (:mod:`proxyvisor.adapters.litellm_bridge`); each streamed chunk is a heartbeat.
Retries are off (``max_retries=0``): the pool breaker decides what happens after a limit, not an SDK loop.

Options (``[model_routing.adapter_options.litellm]``): ``api_base`` (e.g. an OpenAI-compatible endpoint) and
``api_key_env`` (the variable holding the key; without it litellm reads the provider's usual variable).

Failures are normalised from litellm's exception types: the HTTP status and ``Retry-After`` /
``retry-after-ms`` headers they carry, ``litellm.Timeout`` as a timeout with an unknown outcome, then the wording.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import Any

import trio

from . import litellm_bridge
from .descriptors import Descriptor
from .failures import Failure
from .runtime import ChildJob, ChildProgress, NativeError, normalise_native

_FINISH = {"stop": "stop", "end_turn": "stop", "length": "length", "max_tokens": "length",
           "tool_calls": "tool_calls", "function_call": "tool_calls", "content_filter": "content_filter"}


def _headers(exc: BaseException) -> Mapping[str, str]:
    headers = getattr(exc, "litellm_response_headers", None)
    if headers is None:
        response = getattr(exc, "response", None)
        headers = getattr(response, "headers", None)
    try:
        return {str(k).lower(): str(v) for k, v in dict(headers or {}).items()}
    except (TypeError, ValueError):
        return {}


class LiteLLMRuntime:
    def __init__(self, descriptor: Descriptor, options: Mapping[str, Any]) -> None:
        self.descriptor = descriptor
        self.api_base = str(options.get("api_base") or "")
        self.api_key_env = str(options.get("api_key_env") or "")

    def readiness(self) -> str | None:
        if self.api_key_env and not os.environ.get(self.api_key_env):
            return f"${self.api_key_env} is not set"
        return None

    def normalise(self, error: NativeError, now: float) -> Failure:
        exc = error.exception
        if exc is None:
            return normalise_native(error, now)
        litellm = litellm_bridge.import_litellm()
        status = getattr(exc, "status_code", None)
        headers = _headers(exc)
        return normalise_native(NativeError(
            error.message, status=status if isinstance(status, int) else None,
            retry_after=headers.get("retry-after"), retry_after_ms=headers.get("retry-after-ms"),
            timed_out=isinstance(exc, litellm.Timeout) or error.timed_out), now)

    async def run(self, job: ChildJob, progress: ChildProgress) -> None:
        litellm = await trio.to_thread.run_sync(litellm_bridge.import_litellm)
        kwargs: dict[str, Any] = {
            "model": job.model, "messages": [{"role": "user", "content": job.prompt}], "stream": True,
            "stream_options": {"include_usage": True}, "timeout": job.timeout_s, "max_retries": 0}
        if self.api_base:
            kwargs["api_base"] = self.api_base
        if self.api_key_env:
            kwargs["api_key"] = os.environ.get(self.api_key_env, "")
        if job.effort:
            kwargs["reasoning_effort"] = job.effort
        if job.output_schema is not None:
            kwargs["response_format"] = {"type": "json_schema",
                                         "json_schema": {"name": "result", "schema": job.output_schema}}
        if job.traceparent:
            kwargs["extra_headers"] = {"traceparent": job.traceparent}
        progress.model = job.model
        reason = "stop"
        try:
            stream = await litellm_bridge.call(lambda: litellm.acompletion(**kwargs))
            async for chunk in litellm_bridge.iterate(stream):
                choices = getattr(chunk, "choices", None) or ()
                usage = getattr(chunk, "usage", None)
                if usage:
                    progress.usage(getattr(usage, "prompt_tokens", 0) or 0, getattr(usage, "completion_tokens", 0) or 0)
                if not choices:
                    progress.event()
                    continue
                delta = getattr(choices[0], "delta", None)
                text = getattr(delta, "content", None)
                if text:
                    progress.add_text(text)
                else:
                    progress.event()
                if getattr(choices[0], "finish_reason", None):
                    reason = _FINISH.get(choices[0].finish_reason, str(choices[0].finish_reason))
        except Exception as exc:  # noqa: BLE001 - every litellm/provider error becomes a normalised failure
            progress.fail(self.normalise(NativeError(str(exc), exception=exc), time.time()))
            return
        progress.finish(None, reason)
