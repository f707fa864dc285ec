"""The event loop's longest steps while one huge SSE event goes through a supervised proxy: the thread CPU time and
page faults of each task step (a trio ``Instrument``), against a baseline checkout in the same run.

Usage (from the repository root)::

    python bench/big_event_turns.py                           # chat, messages and responses at 128 MB
    python bench/big_event_turns.py --sizes 128,250 --baseline /tmp/old    # and another checkout, same run
    python bench/big_event_turns.py --formats chat --trace    # where in each long step the time goes
    python bench/big_event_turns.py --formats chat --sizes 1,4 --gate   # the verify-gate on (a verifier double)

Everything runs in one process per checkout: the proxy (supervision on, the verify-gate off as in the tests, or on
with ``--gate``, its verifier a double whose answer the gate rejects: the turn ends unverified), an
upstream streaming a turn whose text has one word of the given size (so one delta event, and in Responses each of
the four events that repeat the text, is that big) 1 MiB a read, and a client reading the reply, all on loopback.
Printed per run: the longest turn of the loop (CPU from one wait for I/O to the next), the longest step of a proxy
task (the client's own steps left out: its first, which makes its TLS context, takes some 20 ms), and each proxy
step over ``--over`` ms with its faults; with ``--trace``, each gap of over half that between two profiler events
in such a step, with its stack (a big free shows as a gap before the call that follows it). ``--trace`` slows the
loop: its CPU figures are not comparable with a run without it.
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="128", help="event sizes in MB, comma-separated (default 128)")
    p.add_argument("--formats", default="chat,messages,responses", help="formats, comma-separated")
    p.add_argument("--over", type=float, default=5.0, help="list proxy steps over this many ms of CPU (default 5)")
    p.add_argument("--trace", action="store_true", help="the stacks of the gaps in long steps (slows the loop)")
    p.add_argument("--gate", action="store_true", help="with the verify-gate on (its verifier gets the same stream)")
    p.add_argument("--baseline", type=Path, help="another checkout of proxyvisor, measured first in the same run")
    p.add_argument("--checkout", type=Path, help=argparse.SUPPRESS)  # (the baseline's own process)
    return p.parse_args(argv)


def _faults() -> int:
    usage = resource.getrusage(resource.RUSAGE_THREAD)
    return usage.ru_minflt + usage.ru_majflt


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.baseline is not None:
        print(f"### baseline {args.baseline}", flush=True)
        forwarded = [a for a in (argv or sys.argv[1:]) if a != "--baseline" and a != str(args.baseline)]
        subprocess.run([sys.executable, __file__, *forwarded, "--checkout", str(args.baseline)], check=True)
        print(f"### this checkout {ROOT}", flush=True)
    sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
    if args.checkout is not None:
        sys.path.insert(0, str(args.checkout.resolve()))
    import trio

    from helpers import HugeEventUpstream, http_client, path_of, request_body, serve_handler
    from proxyvisor.config import Config, GateConfig, UpstreamConfig
    from proxyvisor.proxy import allocator, limits
    from proxyvisor.proxy.service import running
    from proxyvisor.store import Store
    from proxyvisor.supervisor_model import ModelAnswer

    class Steps(trio.abc.Instrument):
        def __init__(self, client: Any, gap_s: float | None) -> None:
            self.client, self.gap_s = client, gap_s
            self.steps: list[tuple[float, int, str, list[str]]] = []
            self.turns: list[float] = []
            self.cpu, self.faults, self.last = time.thread_time(), _faults(), time.perf_counter()
            self.turn = self.cpu
            self.gaps: list[str] = []

        def _profile(self, frame: Any, event: str, arg: Any) -> None:
            now = time.perf_counter()
            if self.gap_s is not None and now - self.last >= self.gap_s:
                what = f"{event} {getattr(arg, '__qualname__', '')}" if event.startswith("c_") else event
                self.gaps.append(f"gap {(now - self.last) * 1000:.1f} ms before {what} at\n"
                                 + "".join(traceback.format_stack(frame, limit=10)))
            self.last = time.perf_counter()

        def before_task_step(self, task: Any) -> None:
            self.cpu, self.faults, self.gaps = time.thread_time(), _faults(), []
            if self.gap_s is not None:
                self.last = time.perf_counter()
                sys.setprofile(self._profile)

        def after_task_step(self, task: Any) -> None:
            sys.setprofile(None)
            if task is not self.client:
                self.steps.append((time.thread_time() - self.cpu, _faults() - self.faults, task.name, self.gaps))

        def after_io_wait(self, timeout: float) -> None:
            self.turn = time.thread_time()

        def before_io_wait(self, timeout: float) -> None:
            self.turns.append(time.thread_time() - self.turn)

    async def verifier(messages: list[dict[str, str]]) -> ModelAnswer:  # (the verify-gate's, with --gate)
        return ModelAnswer('{"verdict": "pass", "gaps": []}')

    async def one_run(fmt: str, size_mb: int, state: Path) -> None:
        upstream = HugeEventUpstream(fmt, size_mb * 1024 * 1024)
        limits.MAX_BUFFERED_BODY = max(limits.MAX_BUFFERED_BODY, 2 * size_mb * 1024 * 1024)
        received = 0
        async with serve_handler(upstream) as url:
            config = Config(upstreams=(UpstreamConfig(name="up", url=url),)).with_overrides(
                supervisor={"gate": GateConfig(enabled=args.gate)})
            async with running(config, port=0, store=Store(state),
                               model=verifier if args.gate else None) as rp, http_client() as client:
                steps = Steps(trio.lowlevel.current_task(), args.over / 2000 if args.trace else None)
                trio.lowlevel.add_instrument(steps)
                try:
                    async with client.stream("POST", rp.url + "/s/big" + path_of(fmt),
                                             json=request_body(fmt, stream=True)) as reply:
                        async for chunk in reply.aiter_raw():
                            received += len(chunk)
                    while not rp.pipeline.store.read_ledger("big"):  # the proxy's work on the request is over
                        await trio.sleep(0.01)
                finally:
                    trio.lowlevel.remove_instrument(steps)
        longest = max(steps.steps)
        print(f"{fmt} {size_mb} MB: status {reply.status_code}, {received / 2**20:.0f} MiB out; longest loop turn "
              f"{max(steps.turns) * 1000:.1f} ms CPU, longest proxy step {longest[0] * 1000:.1f} ms "
              f"({longest[2].rsplit('.', 1)[-1]}, {longest[1]} faults)", flush=True)
        for cpu, faults, name, gaps in steps.steps:
            if cpu * 1000 >= args.over:
                print(f"  step {cpu * 1000:.1f} ms CPU, {faults} faults: {name}")
                for gap in gaps:
                    print("    " + gap.replace("\n", "\n    "))

    import gc
    allocator.tune()
    gc.disable()  # this process's own objects: not the event's work
    for fmt in args.formats.split(","):
        for size in map(int, args.sizes.split(",")):
            with tempfile.TemporaryDirectory() as state:
                trio.run(one_run, fmt, size, Path(state))


if __name__ == "__main__":
    main()
