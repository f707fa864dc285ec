"""Shared fixtures: an isolated environment, a proxy on a free port, and standalone scripted upstreams.

Every test runs with ``HOME``, ``XDG_*`` and ``PROXYVISOR_STATE_DIR`` pointing into its own ``tmp_path``, so no
test can read the developer's configuration or write into their state directory, and a test can check that
nothing at all was written. The whole run has a ``TMPDIR`` of its own, which must be empty at the end.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from proxyvisor.scripted.upstream import ScriptedUpstream
from proxyvisor.config import BreakersConfig, Config, GateConfig, UpstreamConfig
from proxyvisor.proxy.service import RunningProxy, running
from proxyvisor.store import Store

from helpers import serve_handler

# Variables the SDKs or proxyvisor read that would make a test depend on the machine it runs on.
_LEAKY_ENV = ("PROXYVISOR_CONFIG", "OPENAI_API_KEY", "OPENAI_BASE_URL", "OPENAI_API_BASE", "OPENAI_ORG_ID",
              "OPENAI_PROJECT_ID", "ANTHROPIC_API_KEY", "ANTHROPIC_AUTH_TOKEN", "ANTHROPIC_BASE_URL",
              "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy")


@pytest.fixture(scope="session", autouse=True)
def no_litter_in_the_temporary_directory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Points ``TMPDIR`` (ours and every subprocess's) at an empty folder for the whole run, and fails the run if
    anything is left in it at the end: tests use ``tmp_path``, and the product removes its own temporary folders.
    pytest's own ``tmp_path`` root is made first, under the real temporary directory, so it is not counted."""
    tmp_path_factory.getbasetemp()
    scratch = Path(tempfile.mkdtemp(prefix="proxyvisor-tests-tmpdir-"))
    saved = os.environ.get("TMPDIR"), tempfile.tempdir
    os.environ["TMPDIR"], tempfile.tempdir = str(scratch), str(scratch)
    try:
        yield
    finally:
        if saved[0] is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = saved[0]
        tempfile.tempdir = saved[1]
        litter = sorted(p.name for p in scratch.iterdir())
        shutil.rmtree(scratch, ignore_errors=True)
    assert litter == [], f"left in the temporary directory by the test run: {litter}"


@pytest.fixture(autouse=True)
def isolated_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private home for the test; returns it. ``$PROXYVISOR_STATE_DIR`` is ``tmp_path/state`` (not created)."""
    home = tmp_path / "home"
    home.mkdir()
    for name in _LEAKY_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(home / ".config"))
    monkeypatch.setenv("XDG_STATE_HOME", str(home / ".local" / "state"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(home / ".cache"))
    monkeypatch.setenv("PROXYVISOR_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("NO_PROXY", "*")
    return home


@pytest.fixture
def state_dir(tmp_path: Path) -> Path:
    """The state directory every proxy of the test uses (``$PROXYVISOR_STATE_DIR``); absent until written."""
    return tmp_path / "state"


@dataclass
class Upstream:
    """A standalone scripted upstream: ``url`` to call it directly, ``script`` to queue steps and read what it got."""

    url: str
    script: ScriptedUpstream


@pytest.fixture
async def scripted_server() -> AsyncIterator[Upstream]:
    """A :class:`ScriptedUpstream` (recording requests and responses) served on its own port."""
    script = ScriptedUpstream()
    async with serve_handler(script) as url:
        yield Upstream(url, script)


@pytest.fixture
def start_proxy() -> Callable[..., Any]:
    """Factory for running proxies: ``async with start_proxy(...) as rp``.

    Arguments (all optional): ``steps`` for the embedded scripted upstream (``rp.scripted["scripted"]``,
    recording); ``supervised`` (default True); ``upstream_url`` to relay to an HTTP upstream instead of the
    embedded one; ``upstream`` fields of the one upstream (``first_byte_timeout_s``, ``api_key_env``, ...);
    ``proxy`` fields (``max_body_bytes``, ``auth_token``, ...); ``store`` (default: a :class:`Store` on
    ``state_dir`` when supervised, none otherwise, as ``proxyvisor serve`` does); ``gate`` (default False: the
    verify-gate, which would hold and judge every text answer to a request offering tools, is off unless a test
    is about it); ``breakers`` (default True: ``[supervisor.breakers]``; off for a test of what each of a series of
    upstream faults looks like to the client, which a cooling pool would answer itself).
    """

    @asynccontextmanager
    async def start(steps: list[dict[str, Any]] | None = None, *, supervised: bool = True,
                    upstream_url: str | None = None, upstream: dict[str, Any] | None = None,
                    proxy: dict[str, Any] | None = None, store: Store | None = None,
                    chunk_delay_ms: float = 0.0, gate: bool = False,
                    breakers: bool = True) -> AsyncIterator[RunningProxy]:
        fields = dict(upstream or {})
        if upstream_url:
            fields["url"] = upstream_url
        config = Config(upstreams=(UpstreamConfig(name="scripted", **fields),))
        config = config.with_overrides(supervisor={"enabled": supervised, "gate": GateConfig(enabled=gate),
                                                   "breakers": BreakersConfig(enabled=breakers)}, proxy=proxy or {})
        scripted = None if upstream_url else {"scripted": ScriptedUpstream(steps, chunk_delay_ms)}
        async with running(config, port=0, store=store, scripted=scripted) as rp:
            yield rp

    return start


@pytest.fixture
async def proxy(start_proxy: Callable[..., Any]) -> AsyncIterator[RunningProxy]:
    """A supervised proxy over the embedded scripted upstream (queue steps on ``proxy.scripted["scripted"]``)."""
    async with start_proxy() as rp:
        yield rp
