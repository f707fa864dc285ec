"""The ``scripted`` adapter: the scripted model (:mod:`proxyvisor.scripted.upstream`), played in process.

Each child sends one streamed Chat Completions request (the prompt as the only user message) straight to a
:class:`~proxyvisor.scripted.upstream.ScriptedUpstream` handler, with no socket in between, so every fault the
scripted upstream can play (429 with Retry-After, 529, 500, 401, a stall, a reset mid-stream) reaches the
adapter exactly as an HTTP client would see it. Each SSE event is a heartbeat. With no script step left the
scripted model answers with a short text.

Options (``[model_routing.adapter_options.scripted]``): ``script``, a JSON file of steps.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import orjson

from ..proxy.server import AbortConnection, Request
from ..proxy.closing import close
from ..proxy.sse import SSEParser
from ..adapters.descriptors import Descriptor
from ..adapters.failures import Failure
from ..adapters.runtime import ChildJob, ChildProgress, NativeError, normalise_native
from .upstream import MODEL, ScriptedUpstream, load_script


def _error_message(body: bytes) -> str:
    try:
        error = orjson.loads(body).get("error") or {}
        return str(error.get("message") or "") if isinstance(error, dict) else str(error)
    except (orjson.JSONDecodeError, AttributeError):
        return body[:300].decode("utf-8", "replace")


class ScriptedRuntime:
    """``upstream``: a ready-made scripted upstream (tests queue steps on it and read ``upstream.requests``)."""

    def __init__(self, descriptor: Descriptor, options: Mapping[str, Any],
                 upstream: ScriptedUpstream | None = None) -> None:
        self.descriptor = descriptor
        if upstream is None:
            script = options.get("script")
            upstream = ScriptedUpstream(load_script(str(script)) if script else None, record=False)
        self.upstream = upstream

    def readiness(self) -> str | None:
        return None

    def normalise(self, error: NativeError, now: float) -> Failure:
        return normalise_native(error, now)

    async def run(self, job: ChildJob, progress: ChildProgress) -> None:
        body = {"model": job.model or MODEL, "stream": True, "stream_options": {"include_usage": True},
                "messages": [{"role": "user", "content": job.prompt}]}
        headers = [(b"content-type", b"application/json")]
        if job.traceparent:
            headers.append((b"traceparent", job.traceparent.encode()))
        response = await self.upstream(Request("POST", "/v1/chat/completions", headers, orjson.dumps(body)))
        progress.model = job.model or MODEL
        if response.status >= 400:
            got = {k.decode(): v.decode("latin-1") for k, v in response.headers}
            message = _error_message(response.body if isinstance(response.body, bytes) else b"")
            progress.fail(self.normalise(NativeError(message, status=response.status,
                                                     retry_after=got.get("retry-after")), time.time()))
            return
        parser, reason = SSEParser(), "stop"
        try:
            async for chunk in response.body:  # type: ignore[union-attr]
                for event in parser.feed(chunk):
                    progress.event()
                    if event.data == "[DONE]":
                        continue
                    data = orjson.loads(event.data)
                    if data.get("usage"):
                        progress.usage(data["usage"].get("prompt_tokens", 0), data["usage"].get("completion_tokens", 0))
                    for choice in data.get("choices") or ():
                        delta = choice.get("delta") or {}
                        if delta.get("content"):
                            progress.add_text(delta["content"])
                        if delta.get("tool_calls"):
                            reason = "tool_calls"
                        if choice.get("finish_reason") == "length":
                            reason = "length"
        except AbortConnection:
            progress.fail(self.normalise(NativeError("connection reset mid-stream"), time.time()))
            return
        except (orjson.JSONDecodeError, AttributeError) as exc:
            progress.fail(self.normalise(NativeError(f"undecodable stream event: {exc}"), time.time()))
            return
        finally:
            await close(response.body)
        progress.finish(None, reason)
