"""The tiktoken encodings supervision counts with: loaded at start on a thread, awaited off the event loop.

Loading an encoding takes 0.3-0.9 s, and part of it (tiktoken building its ``CoreBPE``: 140-280 ms) holds the
GIL, so the event loop stands still meanwhile, whichever thread loads. :func:`warm` loads them when the proxy
starts, before an agent's first request normally arrives (``wrap``'s agent takes a second or more to send it), in
the order a first request needs them. Code on the event loop that is about to count awaits :func:`loaded` first:
at once when the encoding is in memory, otherwise on a worker thread until the warm-up (or whichever thread asked
first: tiktoken's registry lock loads each encoding once) has it, so the loop serves other requests meanwhile.
Code on a worker thread just counts: it waits there for a load under way.
"""

from __future__ import annotations

import functools
import threading
from typing import Any, Protocol

import trio


class Loader(Protocol):
    """An encoding's loader: a ``functools.cache``-d function of no arguments (``condense.text.encoding``,
    ``proxy.estimate.encoding``), whose cache says whether it has loaded."""

    def __call__(self) -> Any: ...

    def cache_info(self) -> functools._CacheInfo: ...


def is_loaded(load: Loader) -> bool:
    """Whether ``load`` has returned its encoding in this process (calling it now takes no time)."""
    return load.cache_info().currsize > 0


def warm(*loads: Loader) -> None:
    """Run ``loads`` one after the other on a daemon thread, those not loaded yet; returns at once."""
    pending = [load for load in loads if not is_loaded(load)]
    if pending:
        threading.Thread(target=lambda: [load() for load in pending], name="proxyvisor-tiktoken",
                         daemon=True).start()


async def loaded(load: Loader) -> None:
    """Return once ``load`` has loaded its encoding: at once (no checkpoint) when it has, otherwise after calling
    it on a worker thread (which waits for a load under way). Cancelled, it raises ``trio.Cancelled`` at once;
    the load goes on in its thread."""
    if not is_loaded(load):
        await trio.to_thread.run_sync(load, abandon_on_cancel=True)
