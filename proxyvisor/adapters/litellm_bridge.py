"""litellm on one dedicated asyncio thread, bridged to trio.

Why a thread: litellm is asyncio code and calls ``run_in_executor`` inside, which trio-asyncio cannot host
(DESIGN.md, principle 3). One daemon thread runs one asyncio loop for the whole process; trio tasks submit
coroutines with ``asyncio.run_coroutine_threadsafe`` and are woken through their trio token when the result is
ready. Cancelling the trio task cancels the asyncio future, so a client that hangs up stops the litellm call.

litellm is imported lazily, on the first call, because importing it costs seconds; before that import
``LITELLM_LOCAL_MODEL_COST_MAP`` is set (no network at import) and litellm's bundled tiktoken encodings are
registered (tiktoken would otherwise download them, which fails offline).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import threading
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any, TypeVar

import trio

T = TypeVar("T")

_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None


def import_litellm() -> Any:
    """Import litellm offline-safe (see the module docstring) and return the module.

    Unless ``LITELLM_LOG`` is set, litellm's own loggers are silenced: its tracebacks would repeat upstream
    messages that proxyvisor already reports (redacted) in the client's error and in its own log.
    """
    quiet = "LITELLM_LOG" not in os.environ
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    os.environ.setdefault("LITELLM_LOG", "ERROR")
    import litellm
    import litellm.litellm_core_utils.default_encoding  # noqa: F401 - points TIKTOKEN_CACHE_DIR at the bundled files

    litellm.suppress_debug_info = True
    litellm.telemetry = False
    if quiet:
        for name in ("LiteLLM", "LiteLLM Router", "LiteLLM Proxy"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    return litellm


def _get_loop() -> asyncio.AbstractEventLoop:
    global _loop
    with _lock:
        if _loop is None:
            loop = asyncio.new_event_loop()
            ready = threading.Event()

            def run() -> None:
                asyncio.set_event_loop(loop)
                loop.call_soon(ready.set)
                loop.run_forever()

            threading.Thread(target=run, name="proxyvisor-litellm", daemon=True).start()
            ready.wait()
            _loop = loop
        return _loop


async def call(fn: Callable[[], Awaitable[T]]) -> T:
    """Run the coroutine made by ``fn()`` on the litellm thread and return its result.

    Exceptions raised by the coroutine are re-raised here unchanged. If the calling trio task is cancelled, the
    asyncio task is cancelled too and ``trio.Cancelled`` propagates.
    """
    token = trio.lowlevel.current_trio_token()
    done = trio.Event()
    future: concurrent.futures.Future[T] = asyncio.run_coroutine_threadsafe(_wrap(fn), _get_loop())
    future.add_done_callback(lambda _f: token.run_sync_soon(done.set))
    try:
        await done.wait()
    except trio.Cancelled:
        future.cancel()
        raise
    return future.result()


async def _wrap(fn: Callable[[], Awaitable[T]]) -> T:
    return await fn()


async def iterate(aiter: Any) -> AsyncGenerator[Any, None]:
    """Iterate an asyncio async iterator (e.g. a litellm stream) from trio, one item per thread hop."""
    iterator = aiter.__aiter__()

    async def next_item() -> tuple[bool, Any]:
        try:
            return True, await iterator.__anext__()
        except StopAsyncIteration:
            return False, None

    try:
        while True:
            more, item = await call(next_item)
            if not more:
                return
            yield item
    finally:
        aclose = getattr(iterator, "aclose", None)
        if aclose is not None:
            with trio.CancelScope(shield=True), trio.move_on_after(5):
                try:
                    await call(aclose)
                except Exception:  # noqa: BLE001 - best-effort close of an abandoned upstream stream
                    pass
