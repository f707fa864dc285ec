"""How many requests fail when the upstream drops kept-alive connections without saying so.

Usage (from the repository root, in the project's environment)::

    python bench/upstream_drops.py              # 200 sequential requests per upstream, a few seconds
    python bench/upstream_drops.py --count 1000

proxyvisor (supervision off, in this process) relays sequential chat requests to a local upstream that never
sends ``Connection: close`` (:class:`proxyvisor.testing.KeepAliveUpstream`, the tests' too) and drops connections
in one of two ways:

- ``idle``: as a load balancer does, it closes a connection that got no request for ``--idle-ms`` (5), and its
  close takes ``--latency-ms`` (5) to reach proxyvisor, so a request sent meanwhile crosses it; the client waits
  a random 0 to 4 x ``--idle-ms`` between requests (seeded);
- ``cross``: it answers one request per connection and drops the connection when the next one arrives.

Prints the failed requests (any status but 200) of each. Nothing is written.
"""

from __future__ import annotations

import argparse
import random

import httpx
import orjson
import trio

from proxyvisor.config import Config, UpstreamConfig
from proxyvisor.proxy.service import running
from proxyvisor.testing import KeepAliveUpstream, serve

_BODY = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]})


def upstream(mode: str, idle_s: float, latency_s: float) -> KeepAliveUpstream:
    """The upstream that drops connections as ``mode`` says (the module docstring)."""
    if mode == "idle":
        return KeepAliveUpstream(idle_s=idle_s, close_latency_s=latency_s)
    return KeepAliveUpstream(answers=1)


async def failures(mode: str, count: int, idle_s: float, latency_s: float, seed: int = 1) -> int:
    """Requests of ``count`` sequential ones through proxyvisor that did not get a 200."""
    rng = random.Random(seed)
    failed = 0
    async with trio.open_nursery() as nursery:
        url = await serve(nursery, upstream(mode, idle_s, latency_s))
        config = Config(upstreams=(UpstreamConfig(name="dropping", url=url),)).with_overrides(
            supervisor={"enabled": False})
        async with running(config, port=0) as rp, httpx.AsyncClient(trust_env=False, timeout=10) as client:
            for _ in range(count):
                if mode == "idle":
                    await trio.sleep(rng.uniform(0, 4 * idle_s))
                reply = await client.post(rp.url + "/v1/chat/completions", content=_BODY,
                                          headers={"content-type": "application/json"})
                failed += reply.status_code != 200
        nursery.cancel_scope.cancel()
    return failed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=200, help="sequential requests per upstream (200)")
    parser.add_argument("--idle-ms", type=float, default=5.0, help="the idle upstream's idle timeout (5)")
    parser.add_argument("--latency-ms", type=float, default=5.0, help="how late its close arrives (5)")
    args = parser.parse_args()
    for mode in ("idle", "cross"):
        failed = trio.run(failures, mode, args.count, args.idle_ms / 1000, args.latency_ms / 1000)
        print(f"{mode:6} {failed}/{args.count} requests failed ({100 * failed / args.count:.1f}%)")


if __name__ == "__main__":
    main()
