"""How much of one upstream reply proxyvisor holds in memory whole, in one place for every reader of replies."""

from __future__ import annotations

MAX_BUFFERED_BODY = 256 * 1024 * 1024
"""The most bytes held of one reply body read whole (a JSON answer) or of one SSE event of a stream proxyvisor
parses (supervised streams, usage): past it the client gets a 502, or the format's error event mid-stream."""
