"""What a session's stored supervision state costs when its requests go back and forth between two processes (two
replicas, or two proxies on one state directory): each round one process saves the state with one more receipt in
one of its threads' current turn (in turn: ``--threads``, sub-agents), and the other loads it. CPU of the whole
process per round (the save, the load and its worker thread), for turns of ``--receipts`` receipts, on a diskcache
folder; with ``--saves``, of the saves alone (no other process loads: what a save costs as the turn grows).

Usage (from the repository root)::

    python bench/state_replicas.py                                   # this checkout
    python bench/state_replicas.py --compare /tmp/old                # and another checkout, with the ratio
    python bench/state_replicas.py --threads 8 --compare /tmp/old    # a session of 8 threads
    python bench/state_replicas.py --saves --receipts 4096 --compare /tmp/old   # the saves alone, a long turn

Each checkout runs in a process of its own (``--checkout`` is how the parent runs the other one).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import add_compare_options, checkouts, run_in_checkout  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--receipts", type=int, default=560, help="receipts in the turn at the start (default 560)")
    p.add_argument("--rounds", type=int, default=60, help="rounds measured (default 60)")
    p.add_argument("--threads", type=int, default=1, help="threads of the session, each with such a turn (default 1)")
    p.add_argument("--saves", action="store_true", help="measure the saves alone: no other process loads")
    add_compare_options(p)
    return p.parse_args(argv)


def measure(receipts: int, rounds: int, threads: int, saves: bool) -> float:
    """Process CPU ms per round (module docstring), with proxyvisor imported from ``sys.path``."""
    import trio

    from proxyvisor.adapters.state import DiskBackend
    from proxyvisor.detectors.checks import PASSED
    from proxyvisor.detectors.receipts import Receipt
    from proxyvisor.proxy import session_state
    from proxyvisor.proxy.session_state import NAMESPACE, SETTINGS, SessionStates
    from proxyvisor.proxy.sessions import Session
    from proxyvisor.proxy.supervise import SessionSupervision

    backend = DiskBackend(Path(tempfile.mkdtemp(prefix="proxyvisor-replicas-")))
    one, other = (SessionStates(backend.kv(NAMESPACE, **SETTINGS), 60) for _ in range(2))
    # What a request does to the thread it is on: its change is counted (Thread.changes), or, in a checkout from
    # before the count, noted as the pipeline noted it (session_state.changed).
    changed = getattr(session_state, "changed", None) or (lambda thread: setattr(thread, "changes", thread.changes + 1))
    state = SessionSupervision()
    for t in range(threads):
        state.thread(b"thread%d" % t, frozenset()).tracker.reader.turn_receipts = {
            f"call_{i}": Receipt("Bash", os.urandom(16), ("src/a.py",), os.urandom(16), False, "none", f"pytest -k {i}",
                                 os.urandom(16), os.urandom(16), PASSED, f"{i} passed") for i in range(receipts)}
    saving, loading = Session("s", 0.0, 0.0, supervision=state), Session("s", 0.0, 0.0)

    async def run() -> float:
        spent = 0.0
        for n in range(rounds + 5):
            started = time.process_time()
            thread = state.threads[b"thread%d" % (n % threads)]
            thread.tracker.reader.turn_receipts[f"more_{n}"] = thread.tracker.reader.turn_receipts["call_1"]
            changed(thread)
            await one.save(saving)
            if not saves:
                await other.load(loading)
                assert loading.state_version == saving.state_version
            if n >= 5:  # the first rounds read the whole turn
                spent += time.process_time() - started
        return spent / rounds * 1000

    return trio.run(run)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.checkout is not None:
        sys.path.insert(0, str(args.checkout.resolve()))
        print(f"{measure(args.receipts, args.rounds, args.threads, args.saves):.3f}")
        return 0
    found = {}
    for label, where in checkouts(args.compare):
        out = run_in_checkout(__file__, where, "--receipts", str(args.receipts), "--rounds", str(args.rounds),
                              "--threads", str(args.threads), *(["--saves"] if args.saves else []))
        found[label] = float(out.split()[-1])
        print(f"{label} ({where}): {found[label]:.3f} ms CPU per {'save' if args.saves else 'round'}, "
              f"{args.threads} thread(s) of {args.receipts} receipts")
    if args.compare:
        print(f"ratio: {found['this checkout'] / found['compared']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
