"""Starting and stopping a proxy: upstream clients, embedded scripted upstreams, the listening socket.

:func:`running` is the one way to run proxyvisor, used by ``serve``, ``wrap``, ``demo``, ``replay``, the tests
and the benchmarks, so they all exercise the same code.
"""

from __future__ import annotations

import functools
import gc
import os
import sys
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import trio

from ..adapters.state import backend_of
from ..adapters import litellm_bridge
from ..scripted.upstream import ScriptedUpstream, load_script
from ..supervisor_model import LITELLM, ModelCall, configured_model
from ..config import Config, ConfigError
from ..rules import FORMATS
from ..store import Store
from . import allocator
from .pipeline import Pipeline, format_for_path
from .relay import HttpRelay
from .session_model import SUPPLIED, SupervisorRoutes
from .server import Limits, Stopping, bound_port, open_listeners, serve_listeners


@dataclass
class RunningProxy:
    """A proxy serving on ``host:port``; ``scripted`` holds the embedded scripted upstreams by name."""

    host: str
    port: int
    pipeline: Pipeline
    scripted: dict[str, ScriptedUpstream] = field(default_factory=dict)
    scripted_urls: dict[str, str] = field(default_factory=dict)
    stopping: Stopping = field(default_factory=Stopping)

    async def drain(self, grace_s: float) -> None:
        """Stop the way a rolling upgrade needs (``serve`` on SIGTERM): accept no connection (the listener is
        closed), close idle keep-alive connections, and let the responses in flight finish for up to ``grace_s``
        seconds; then end each stream still relaying with its format's error event (:meth:`Pipeline.stop`),
        waiting :data:`CUT_S` more for them. What still runs after that is cut when the :func:`running` block exits,
        which stops the pipeline too. Cancelled (a second signal), it returns at once."""
        self.stopping.begin()
        with trio.move_on_after(grace_s):
            await self.stopping.quiet()
        self.pipeline.stop()
        with trio.move_on_after(CUT_S):
            await self.stopping.quiet()

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"


CUT_S = 0.5
"""Seconds :meth:`RunningProxy.drain` waits, after the grace, for streams to end with their error event: one
waiting for its upstream's next piece, or held while proxyvisor works (the verify-gate awaiting its verdict), ends
at once, one sending at its next piece; what still runs when this runs out is cut."""


def upstream_keys(config: Config, env: Mapping[str, str] | None = None) -> dict[str, str | None]:
    """The API key of each upstream from its ``api_key_env`` (None: forward the client's own credentials).

    Raises:
        ConfigError: an ``api_key_env`` names a variable that is not set.
    """
    env = os.environ if env is None else env
    keys: dict[str, str | None] = {}
    for upstream in config.upstreams:
        if not upstream.api_key_env:
            keys[upstream.name] = None
        elif env.get(upstream.api_key_env):
            keys[upstream.name] = env[upstream.api_key_env]
        else:
            raise ConfigError(f"{config.source}: [upstreams.{upstream.name}] api_key_env = "
                              f"{upstream.api_key_env!r}, but that environment variable is not set")
    return keys


SWITCH_INTERVAL_S = 0.0002
"""The interpreter's thread switch interval in the proxy process (:func:`tune_runtime`); Python's default is 5 ms."""


def tune_runtime() -> None:
    """Tune the interpreter for a long-lived proxy process (``serve``, ``wrap``): the collector, the thread
    switch interval and the C allocator (:mod:`.allocator`).

    Why the collector: under 200 concurrent sessions the default thresholds cost about 11% of the proxy's CPU and
    gen-2 pauses of up to 121 ms; (50000, 20, 20) cut the overhead header's p99 from 74 to 30 ms (bench/load.py).
    Objects alive at startup (imports, config) are frozen out of every later collection.

    Why the switch interval: a worker thread busy with one big event (``reply.off_loop``) keeps the interpreter
    lock until the loop has waited a whole interval for it, and the loop, which serves every session, gives the
    lock up at every wait for its sockets: at the default 5 ms each of its turns cost the loop up to 5 ms while the
    event relayed (other sessions' p90 +3.8 s among 100 sessions, +0.34 s at 0.2 ms: bench/load.py, big event).
    A shorter interval costs nothing while no other thread wants the lock.
    """
    gc.freeze()
    gc.set_threshold(50_000, 20, 20)
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    allocator.tune()


def limits_of(config: Config) -> Limits:
    p = config.proxy
    return Limits(max_body_bytes=p.max_body_bytes, header_timeout_s=p.request_header_timeout_s,
                  body_timeout_s=p.request_body_timeout_s, body_deadline_s=p.request_body_deadline_s,
                  keepalive_timeout_s=p.keepalive_timeout_s, error_body=_error_body)


def _error_body(path: str, status: int, message: str) -> bytes:
    """An error the server answers itself, in the API of the request's ``path`` (``Limits.error_body``)."""
    return format_for_path(path).error_body(status, message)


@asynccontextmanager
async def running(config: Config, port: int | None = None, store: Store | None = None,
                  scripted: dict[str, ScriptedUpstream] | None = None,
                  model: ModelCall | None = None) -> AsyncIterator[RunningProxy]:
    """Serve ``config`` until the block exits; yields the :class:`RunningProxy`.

    ``port`` overrides ``[proxy] port`` (0 = a free port). ``store`` overrides the state directory (by default
    the configured one, and none at all when supervision is disabled, so nothing can be written). ``scripted``
    supplies ready-made scripted upstreams by name (tests queue steps on them). ``model`` (the supervisor model call:
    condenser, verifier, planner; its route is labelled ``supplied``) replaces the route ``[supervisor.model]``
    describes (``proxyvisor.supervisor_model``: the session's own, or litellm, where ``api_base = "scripted:"`` is
    the first scripted upstream).

    Raises:
        ConfigError: an upstream key variable is missing, a script file is invalid, ``[supervisor.model]``
            asks for a scripted upstream that is not configured, or ``[state] backend = "redis"`` and its Redis
            cannot be reached.
        OSError: the address is in use.
    """
    keys = upstream_keys(config)
    if store is None and config.supervisor.enabled:
        store = Store(config.state_dir())
    backend = backend_of(config, store.root) if store is not None else None
    limits = limits_of(config)
    scripted = dict(scripted or {})
    pipeline: Pipeline | None = None
    try:
        async with trio.open_nursery() as nursery:
            urls: dict[str, str] = {}
            for upstream in config.upstreams:
                if not upstream.scripted:
                    continue
                if upstream.name not in scripted:
                    try:
                        steps = load_script(upstream.script) if upstream.script else None
                    except (OSError, ValueError) as exc:
                        raise ConfigError(f"{config.source}: [upstreams.{upstream.name}] script: {exc}") from None
                    scripted[upstream.name] = ScriptedUpstream(steps, upstream.chunk_delay_ms, record=False)
                listeners = await open_listeners("127.0.0.1", 0)
                await nursery.start(serve_listeners, listeners, scripted[upstream.name], Limits())
                urls[upstream.name] = f"http://127.0.0.1:{bound_port(listeners)}"
            relays = {u.name: HttpRelay(u, urls.get(u.name), keys[u.name]) for u in config.upstreams}
            for relay in relays.values():
                nursery.start_soon(relay.expire_idle)
            route = SUPPLIED
            if model is None:
                route = LITELLM
                model = configured_model(config.supervisor.model, next(iter(urls.values()), None))
            if config.supervisor.enabled and route == LITELLM and model is not None:
                # litellm takes seconds to import: now, rather than inside the first request that condenses.
                nursery.start_soon(functools.partial(trio.to_thread.run_sync, litellm_bridge.import_litellm,
                                                     abandon_on_cancel=True))
            translator = None
            if any(set(u.formats) != set(FORMATS) for u in config.upstreams):
                from .translate import Translator

                translator = Translator(relays)
            pipeline = Pipeline(config, relays, store, translator,
                                routes=SupervisorRoutes(config.supervisor.model, model, route), backend=backend)
            pipeline.background = nursery
            host = config.proxy.host
            listeners = await open_listeners(host, config.proxy.port if port is None else port)
            stopping = Stopping()
            await nursery.start(serve_listeners, listeners, pipeline, limits, stopping)
            nursery.start_soon(allocator.trim_when_idle, lambda: stopping.in_flight, lambda: stopping.ended)
            try:
                yield RunningProxy(host, bound_port(listeners), pipeline, scripted, urls, stopping)
            finally:
                pipeline.stop()  # what is cut now is cut by the proxy's stop (wrap's agent ended), not by its client
                nursery.cancel_scope.cancel()
                with trio.CancelScope(shield=True):
                    for relay in relays.values():
                        await relay.aclose()
                    if pipeline.sharing is not None:  # what is queued, and no send in flight as the backend closes
                        await pipeline.sharing.flush()
                    await pipeline.settle()  # the session states whose save waits for the end of a response
    finally:
        if pipeline is not None:  # once the background work (a session's last save, shielded) is over
            pipeline.close()
