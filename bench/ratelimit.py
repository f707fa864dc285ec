"""How many requests reach a rate-limited upstream, directly and through proxyvisor's breakers.

Usage (from the repository root, in the project's environment)::

    python bench/ratelimit.py                  # 20 sessions, 429s for 10 s; about 40 s
    python bench/ratelimit.py --quick          # CI size: 5 sessions, 429s for 3 s, nothing written; about 20 s
    python bench/ratelimit.py --sessions 5 --window-s 3 --no-write

An upstream on loopback answers every model request with 429 and ``Retry-After: 1`` for ``--window-s`` seconds,
then answers normally (the scripted model). ``--sessions`` agents each send chat requests back to back for the
window and 2 s more, sleeping the ``Retry-After`` of each 429 as the OpenAI and Anthropic SDKs do. Three arms, in
this run, one after the other, each with a fresh upstream:

- ``direct``: the agents call the upstream;
- ``proxyvisor``: through a supervised proxy (breakers on, default settings), one state directory;
- ``fallback``: the same, with ``fallback = ["spare"]`` to a second upstream that always answers.

For each arm: the requests the limited upstream received during the window, and the share of the agents' requests
made during the window that got a 200. Figures go to bench/RESULTS.md (section "Rate limits") unless ``--no-write``.
Exits 3 (``bench.common.MISSED_TARGET``) when the breakers miss their targets: through proxyvisor, after the agents' first burst (the first 0.5 s),
at most one request per second of the window reaches the limited upstream (the recovery probes), against the
direct arm's every retry; with the fallback, at least 90% of the agents' requests are answered.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
from pathlib import Path

import httpx
import orjson
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import MISSED_TARGET  # noqa: E402
from bench.results import write_section  # noqa: E402
from proxyvisor.config import Config, GateConfig, UpstreamConfig
from proxyvisor.proxy.server import Limits, Request, Response, bound_port, open_listeners, serve_listeners
from proxyvisor.proxy.service import running
from proxyvisor.scripted.upstream import ScriptedUpstream

_BODY = orjson.dumps({"model": "scripted-model", "messages": [{"role": "user", "content": "hi"}]})


class Limited:
    """An upstream that answers 429 (``Retry-After: 1``) for ``window_s`` from :meth:`begin` (trio clock), then
    as the scripted model; counts the model requests it got while limiting."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self.start = self.until = math.inf
        self.limited = 0
        self.later = 0
        """Of ``limited``, those that came 0.5 s or more into the window: after the agents' first burst."""
        self.model = ScriptedUpstream(record=False)

    def begin(self) -> None:
        self.start = trio.current_time()
        self.until = self.start + self.window_s

    async def __call__(self, request: Request) -> Response:
        if request.path.endswith("/chat/completions") and trio.current_time() < self.until:
            self.limited += 1
            self.later += trio.current_time() >= self.start + 0.5
            return Response(429, [(b"content-type", b"application/json"), (b"retry-after", b"1")],
                            b'{"error": {"message": "rate limited", "type": "rate_limit_error"}}')
        return await self.model(request)


async def _serve(nursery: trio.Nursery, handler: Limited | ScriptedUpstream) -> str:
    listeners = await open_listeners("127.0.0.1", 0)
    await nursery.start(serve_listeners, listeners, handler, Limits())
    return f"http://127.0.0.1:{bound_port(listeners)}"


async def _agent(client: httpx.AsyncClient, url: str, session: int, window_end: float,
                 tally: dict[str, int]) -> None:
    """Requests back to back until 2 s after the window, sleeping each 429's Retry-After; tallies those sent in
    the window."""
    async with client:
        while trio.current_time() < window_end + 2:
            in_window = trio.current_time() < window_end
            reply = await client.post(f"{url}/s/agent-{session}/v1/chat/completions", content=_BODY,
                                      headers={"content-type": "application/json"})
            if in_window:
                tally["sent"] += 1
                tally["ok"] += reply.status_code == 200
            if reply.status_code == 429:
                await trio.sleep(float(reply.headers.get("retry-after", "1")))


async def arm(name: str, sessions: int, window_s: float, state: Path) -> tuple[int, int, dict[str, int]]:
    """One arm (module docstring): (requests the limited upstream got in the window, those of them after its
    first 0.5 s, the agents' tally)."""
    tally = {"sent": 0, "ok": 0}
    async with trio.open_nursery() as nursery:
        limited = Limited(window_s)
        url = await _serve(nursery, limited)
        upstreams = [UpstreamConfig(name="limited", url=url, fallback=("spare",) if name == "fallback" else ())]
        if name == "fallback":
            upstreams.append(UpstreamConfig(name="spare", url=await _serve(nursery, ScriptedUpstream(record=False))))
        config = Config(upstreams=tuple(upstreams)).with_overrides(
            supervisor={"gate": GateConfig(enabled=False)}, state={"dir": str(state / name)})
        async with running(config, port=0) as rp:
            target = url if name == "direct" else rp.url
            # Made first (each builds a TLS context, tens of ms), so that the agents start together.
            clients = [httpx.AsyncClient(trust_env=False, timeout=30) for _ in range(sessions)]
            limited.begin()
            async with trio.open_nursery() as agents:
                for i, client in enumerate(clients):
                    agents.start_soon(_agent, client, target, i, limited.until, tally)
        nursery.cancel_scope.cancel()
    return limited.limited, limited.later, tally


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, default=20, help="concurrent agents (20)")
    parser.add_argument("--window-s", type=float, default=10.0, help="seconds the upstream answers 429 (10)")
    parser.add_argument("--no-write", action="store_true", help="print only; leave bench/RESULTS.md alone")
    parser.add_argument("--quick", action="store_true", help="CI size: --sessions 5 --window-s 3 --no-write")
    args = parser.parse_args(argv)
    if args.quick:
        args.sessions, args.window_s, args.no_write = 5, 3.0, True
    rows = []
    with tempfile.TemporaryDirectory(prefix="proxyvisor-ratelimit-") as state:
        for name in ("direct", "proxyvisor", "fallback"):
            upstream, later, tally = trio.run(arm, name, args.sessions, args.window_s, Path(state))
            share = tally["ok"] / tally["sent"] if tally["sent"] else 0.0
            rows.append((name, upstream, later, tally["sent"], share))
            print(f"{name:10} limited upstream got {upstream:4} requests in the {args.window_s:g} s window "
                  f"({later} after its first 0.5 s); agents sent {tally['sent']:4}, {share:.0%} answered")
    direct = rows[0][1]
    table = "\n".join(f"| {name} | {upstream:,} | {later:,} | {upstream / direct:.2f} | {sent:,} | {share:.0%} |"
                      for name, upstream, later, sent, share in rows)
    body = (f"`python bench/ratelimit.py{' ' + ' '.join(sys.argv[1:]) if argv is None and sys.argv[1:] else ''}`: "
            f"{args.sessions} agents sending chat requests back to back, sleeping each 429's Retry-After, against "
            f"an upstream answering 429 with `Retry-After: 1` for {args.window_s:g} s; the arms run one after the "
            "other in one run (default `[supervisor.breakers]`: 1 s doubling, Retry-After the floor).\n\n"
            "The requests of the first 0.5 s are the agents' first burst, sent before any 429 came back; after it "
            "only recovery probes reach the limited upstream through proxyvisor.\n\n"
            "| arm | requests to the limited upstream in the window | of them after its first 0.5 s | against direct "
            "| agent requests in the window | answered (200) |\n|---|---|---|---|---|---|\n" + table + "\n")
    if not args.no_write:
        write_section("Rate limits", body)
    (_, _, direct_later, _, _), (_, _, later, _, _), (_, _, _, _, share) = rows
    if later > math.ceil(args.window_s) or later >= direct_later or share < 0.9:
        print(f"ratelimit: missed a target: {later} requests after the first burst through proxyvisor (at most "
              f"{math.ceil(args.window_s)}, direct {direct_later}), {share:.0%} answered with a fallback (at "
              "least 90%)", file=sys.stderr)
        sys.exit(MISSED_TARGET)


if __name__ == "__main__":
    main()
