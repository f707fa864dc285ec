"""CPU cost of the supervised reply path per MB of streamed answer, stage by stage, in the three formats.

Usage: python bench/reply_path.py [--repeat 15] [--kb 20] [--read 1500]

A long text answer (``--kb`` KB of prose, streamed word by word as ``render_stream`` does: hundreds of small
events, the shape of a real model's stream) is fed in ``--read``-byte reads through, in turn:

- **scan**: :class:`~proxyvisor.proxy.reply.Blocks` alone, written out by :class:`~proxyvisor.proxy.reply.Encoded`
  (the one scan every supervised stream pays);
- **stripper**: the scan, then the self-report stripper (:class:`~proxyvisor.proxy.reply.Edited`), as every
  supervised stream gets;
- **gate + stripper**: the verify-gate's hold (``hold = "stop"``, a judge that delivers at once) between them,
  as a turn-ending answer gets.

Each figure is the least process CPU time over ``--repeat`` runs, per MB of stream; the ratio is each against the
scan in the same run. The output is checked to be the input's bytes (the answer carries no self-report, so every
event goes out as the upstream sent it).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from proxyvisor.config import GateConfig  # noqa: E402
from proxyvisor.detectors.selfreport import Stripper, strip  # noqa: E402
from proxyvisor.proxy.client import Cut  # noqa: E402
from proxyvisor.proxy import gating  # noqa: E402
from proxyvisor.proxy.formats import BY_NAME, AssistantTurn, WireFormat  # noqa: E402
from proxyvisor.proxy.reply import Blocks, Edited, Encoded, ReplyStream  # noqa: E402

FORMATS = ("chat", "messages", "responses")


class _Judge:
    """A stand-in :class:`~proxyvisor.proxy.gating.Gating` that reads the held answer and delivers it."""

    def __init__(self, fmt: WireFormat) -> None:
        self.fmt = fmt
        self.config = GateConfig(hold="stop")
        self.background = None
        self.notice = None
        self.cut = Cut()

    def _calls_tools(self, _response: dict[str, Any]) -> bool:
        return False

    async def judged(self, held: Callable[[], dict[str, Any]]) -> None:
        held()


class _Reads:
    def __init__(self, reads: list[bytes]) -> None:
        self.reads = reads
        self.error = None

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for read in self.reads:
            yield read


def _stripper(fmt: WireFormat, stream: ReplyStream) -> ReplyStream:
    return Edited(stream, fmt.stream_editor(Stripper, lambda text: strip(text)[0]), lambda _complete: None)


CHAINS: dict[str, Callable[[WireFormat, _Reads], ReplyStream]] = {
    "scan": lambda fmt, reads: Blocks(reads),
    "stripper": lambda fmt, reads: _stripper(fmt, Blocks(reads)),
    "gate + stripper": lambda fmt, reads: _stripper(fmt, gating.GatedStream(_Judge(fmt), Blocks(reads))),  # type: ignore[arg-type]
}


def measure(fmt: WireFormat, data: bytes, read: int, chain: Callable[[WireFormat, _Reads], ReplyStream],
            repeat: int) -> float:
    """Least CPU seconds of ``repeat`` runs of ``chain`` over ``data``."""
    reads = [data[i:i + read] for i in range(0, len(data), read)]

    async def run() -> bytes:
        return b"".join([piece async for piece in Encoded(chain(fmt, _Reads(reads)))])

    best = float("inf")
    for _ in range(repeat):
        started = time.process_time()
        out = trio.run(run)
        best = min(best, time.process_time() - started)
        if out != data:
            raise SystemExit(f"{fmt.name}: the stream came out changed")
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=15, help="runs per figure; the least is kept (15)")
    parser.add_argument("--kb", type=int, default=20, help="KB of answer text (20)")
    parser.add_argument("--read", type=int, default=1500, help="bytes per upstream read (1500)")
    args = parser.parse_args(argv)
    # Ends in a word: trailing white space is held back by the stripper for the next delta, which changes bytes.
    text = ("The quick brown fox jumps over the lazy dog, and then it reads the log again. " * 2000)[:args.kb * 1024]
    text = text.rstrip() + "."
    print(f"ms of CPU per MB of stream ({args.kb} KB of text, {args.read}-byte reads, least of {args.repeat}); "
          "ratio: against the scan")
    print(f"{'format':<10} {'stream MB':>9} " + " ".join(f"{name:>22}" for name in CHAINS))
    for name in FORMATS:
        fmt = BY_NAME[name]
        data = b"".join(fmt.render_stream(AssistantTurn(text), "m", {"stream": True}))
        mb = len(data) / 1e6
        costs = {chain: measure(fmt, data, args.read, make, args.repeat) * 1000 / mb for chain, make in CHAINS.items()}
        cells = [f"{cost:8.1f} ({cost / costs['scan']:4.1f}x)" for cost in costs.values()]
        print(f"{name:<10} {mb:9.2f} " + " ".join(f"{cell:>22}" for cell in cells))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
