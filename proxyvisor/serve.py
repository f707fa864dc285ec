"""``proxyvisor serve``: run the proxy in the foreground until SIGINT or SIGTERM."""

from __future__ import annotations

import signal
import sys

import trio

from .config import Config, default_config_path
from .proxy.server import CannotListen
from .proxy.service import RunningProxy, running, tune_runtime
from .proxy.telemetry import shown_url
from .supervisor_model import describe, key_warning


def start_notices(config: Config, quiet: bool = False) -> list[str]:
    """The lines ``serve`` and ``wrap`` print on stderr as they start, before anything else: each upstream that is
    the embedded scripted model, so no one takes its answers for a real model's, with how to configure a real one
    (the config file to write, and the one in use), and a supervisor key variable that is not set
    (:func:`proxyvisor.supervisor_model.key_warning`). ``quiet`` (``wrap --quiet``): the warning only."""
    scripted = [] if quiet else [u.name for u in config.upstreams if u.scripted]
    notices = [f"proxyvisor: upstream{'' if len(config.upstreams) == 1 else ' ' + name}: the built-in scripted model "
               "(no key, no network): answers are not a real model's" for name in scripted]
    if scripted:
        where = "the built-in defaults" if config.source == Config.source else config.source
        tables = ", ".join(f"[upstreams.{name}]" for name in scripted)
        notices.append(f"proxyvisor:   for a real model, replace {tables} in a config file (--config FILE, or "
                       f"{default_config_path()}; in use: {where}) with your upstream, e.g. [upstreams.anthropic] "
                       'url = "https://api.anthropic.com", formats = ["messages"] (README: Use it with your agent)')
    warning = key_warning(config.supervisor.model) if config.supervisor.enabled else None
    return notices + ([f"proxyvisor: warning: {warning}"] if warning else [])


def stop_notices(proxy: RunningProxy) -> list[str]:
    """The lines ``serve`` and ``wrap`` print on stderr as they stop: how many requests the ledger misses, when
    any (``proxyvisor.store.Store.append_ledger``)."""
    store = proxy.pipeline.store
    if store is None or not store.unrecorded:
        return []
    why = f"the ledger is off: {store.ledger_off}" if store.ledger_off else "see the warnings above"
    n = store.unrecorded
    return [f"proxyvisor: {n} request{'' if n == 1 else 's'} not recorded in the ledger ({why})"]


async def _serve(config: Config) -> None:
    # The signals are caught before 'listening on' is printed: a SIGINT sent as soon as that line shows stops it.
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with running(config) as proxy:
            for notice in start_notices(config):
                print(notice, file=sys.stderr)
            upstreams = ", ".join(f"{u.name} ({u.url}, {'/'.join(u.formats)})" for u in config.upstreams)
            mode = "supervision off: byte relay, nothing written"
            if config.supervisor.enabled:
                gate = config.supervisor.gate
                mode = (f"supervision on; verify-gate {f'on ({gate.failure_policy})' if gate.enabled else 'off'}; "
                        f"supervisor model: {describe(config.supervisor.model)}")
                if proxy.pipeline.backend is not None:
                    mode += f"; shared state: {proxy.pipeline.backend.describe()}"
            print(f"proxyvisor listening on {proxy.url} ({mode}); upstreams: {upstreams}", file=sys.stderr, flush=True)
            if config.supervisor.enabled:
                auth = ("&auth=TOKEN", " and auth_token") if config.proxy.auth_token else ("", "")
                print(f"proxyvisor: web view at {proxy.url}/proxyvisor/ui"
                      + (f"#admin=TOKEN{auth[0]} (your [proxy] admin_token{auth[1]})" if config.proxy.admin_token else
                         f"#session=ID{auth[0]} (the session list needs [proxy] admin_token)"),
                      file=sys.stderr, flush=True)
            if config.telemetry.otlp_endpoint:
                tracing = proxy.pipeline.telemetry
                print(f"proxyvisor: OpenTelemetry traces to {shown_url(tracing.url)} as {config.telemetry.service_name}"
                      if tracing is not None else
                      "proxyvisor: [telemetry] otlp_endpoint is set, but with supervision off nothing is traced",
                      file=sys.stderr, flush=True)
            await anext(signals)
            grace = config.proxy.shutdown_grace_s
            busy = proxy.stopping.in_flight
            print(f"proxyvisor: shutting down: not accepting connections; requests in flight: {busy}, given up to "
                  f"{grace:g} s to finish ([proxy] shutdown_grace_s; signal again to stop at once)",
                  file=sys.stderr, flush=True)
            async with trio.open_nursery() as nursery:
                async def stop_at_once() -> None:
                    await anext(signals)
                    print("proxyvisor: stopping at once", file=sys.stderr, flush=True)
                    nursery.cancel_scope.cancel()

                nursery.start_soon(stop_at_once)
                await proxy.drain(grace)
                nursery.cancel_scope.cancel()
            for notice in stop_notices(proxy):
                print(notice, file=sys.stderr)


def serve(config: Config) -> int:
    """Serve until interrupted. Returns the exit code: 0, or 1 when the address cannot be bound.

    Raises:
        ConfigError: an upstream key variable is unset or a script file is invalid (inside an exception group).
    """
    tune_runtime()
    try:
        trio.run(_serve, config)
    except BaseExceptionGroup as group:
        bind_error = group.subgroup(lambda e: isinstance(e, CannotListen))
        if bind_error is None:
            raise
        exc = bind_error.exceptions[0]
        while isinstance(exc, BaseExceptionGroup):
            exc = exc.exceptions[0]
        print(f"proxyvisor: cannot listen on {config.proxy.host}:{config.proxy.port}: {exc.strerror or exc}",
              file=sys.stderr)
        return 1
    return 0
