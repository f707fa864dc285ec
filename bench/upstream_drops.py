"""How many requests fail when the upstream drops kept-alive connections without saying so.

Usage (from the repository root, in the project's environment)::

    python bench/upstream_drops.py              # 200 sequential requests per upstream, a few seconds
    python bench/upstream_drops.py --count 1000

proxyvisor (supervision off, in this process) relays sequential chat requests to a local upstream that never
sends ``Connection: close`` and drops connections in one of two ways:

- ``idle``: as a load balancer does, it closes a connection that got no request for ``--idle-ms`` (5), and its
  close takes ``--latency-ms`` (5) to reach proxyvisor, so a request sent meanwhile crosses it; the client waits
  a random 0 to 4 x ``--idle-ms`` between requests (seeded);
- ``cross``: it answers one request per connection and drops the connection when the next one arrives.

Prints the failed requests (any status but 200) of each. Nothing is written.
"""

from __future__ import annotations

import argparse
import random

import h11
import httpx
import orjson
import trio

from proxyvisor.config import Config, UpstreamConfig
from proxyvisor.proxy.service import running

_BODY = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]})


def _answer(conn: h11.Connection, n: int) -> bytes:
    body = b'{"n":%d}' % n
    head = h11.Response(status_code=200, headers=[(b"content-type", b"application/json"),
                                                  (b"content-length", b"%d" % len(body))])
    return conn.send(head) + conn.send(h11.Data(data=body)) + conn.send(h11.EndOfMessage())


def upstream(mode: str, idle_s: float, latency_s: float):
    """A connection handler for ``trio.serve_listeners`` that drops connections as ``mode`` says."""

    async def handle(stream: trio.SocketStream) -> None:
        conn = h11.Connection(h11.SERVER)
        answered = 0
        try:
            while True:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    with trio.move_on_after(idle_s if mode == "idle" and answered else float("inf")) as idle:
                        data = await stream.receive_some(65536)
                    if idle.cancelled_caught:
                        await trio.sleep(latency_s)  # the close is on its way; a request sent now crosses it
                        return
                    if not data:
                        return
                    conn.receive_data(data)
                elif isinstance(event, h11.EndOfMessage):
                    if mode == "cross" and answered:
                        return
                    answered += 1
                    await stream.send_all(_answer(conn, answered))
                    conn.start_next_cycle()
                elif isinstance(event, h11.ConnectionClosed):
                    return
        except (trio.BrokenResourceError, h11.ProtocolError):
            return
        finally:
            await trio.aclose_forcefully(stream)

    return handle


async def failures(mode: str, count: int, idle_s: float, latency_s: float, seed: int = 1) -> int:
    """Requests of ``count`` sequential ones through proxyvisor that did not get a 200."""
    rng = random.Random(seed)
    failed = 0
    async with trio.open_nursery() as nursery:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        await nursery.start(trio.serve_listeners, upstream(mode, idle_s, latency_s), listeners)
        url = f"http://127.0.0.1:{listeners[0].socket.getsockname()[1]}"
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
