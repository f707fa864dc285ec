"""``proxyvisor serve``: run the proxy in the foreground until SIGINT or SIGTERM."""

from __future__ import annotations

import signal
import sys

import trio

from .config import Config
from .proxy.service import running, tune_gc
from .supervisor_model import describe


async def _serve(config: Config) -> None:
    async with running(config) as proxy:
        upstreams = ", ".join(f"{u.name} ({u.url}, {'/'.join(u.formats)})" for u in config.upstreams)
        mode = "supervision off: byte relay, nothing written"
        if config.supervisor.enabled:
            gate = config.supervisor.gate
            mode = (f"supervision on; verify-gate {f'on ({gate.failure_policy})' if gate.enabled else 'off'}; "
                    f"supervisor model: {describe(config.supervisor.model)}")
        print(f"proxyvisor listening on {proxy.url} ({mode}); upstreams: {upstreams}", file=sys.stderr, flush=True)
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async for _ in signals:
                print("proxyvisor: shutting down", file=sys.stderr)
                return


def serve(config: Config) -> int:
    """Serve until interrupted. Returns the exit code: 0, or 1 when the address cannot be bound.

    Raises:
        ConfigError: an upstream key variable is unset or a script file is invalid (inside an exception group).
    """
    tune_gc()
    try:
        trio.run(_serve, config)
    except BaseExceptionGroup as group:
        bind_error = group.subgroup(lambda e: isinstance(e, OSError) and not isinstance(e, BaseExceptionGroup))
        if bind_error is None:
            raise
        exc = bind_error.exceptions[0]
        while isinstance(exc, BaseExceptionGroup):
            exc = exc.exceptions[0]
        print(f"proxyvisor: cannot listen on {config.proxy.host}:{config.proxy.port}: {exc.strerror or exc}",
              file=sys.stderr)
        return 1
    return 0
