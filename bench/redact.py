"""Secret detection (``proxyvisor.redact``) on real session text: its cost per text and what it flags.

Usage: python bench/redact.py [CORPUS_TRAJECTORIES_DIR] [--write]

Every message of the corpus trajectories (system prompts, user turns, assistant text and tool-call arguments, tool
outputs) is one text, cut to ``proxyvisor.learning.memory.READ_CHARS`` characters as learning reads a record
candidate. Per text, timed in the same run: :func:`proxyvisor.redact.holds_secret` (what learning runs on every
record candidate), :func:`proxyvisor.redact.redact`, and the baseline, the whitespace normalisation learning runs on
every candidate anyway (``" ".join(text.split())``); with Yelp's ``detect-secrets`` importable (it is no
dependency: ``pip install detect-secrets`` to compare), its ``scan_line`` over the text's lines with its default
plugins, and without its two high-entropy ones. Then the texts flagged: the corpus holds no real credential (public
runs), so each flag is a false positive, or a credential-shaped fixture of the run; their count and the shapes.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import corpus_parser, trajectories  # noqa: E402
from bench.results import write_section  # noqa: E402
from proxyvisor.learning.memory import READ_CHARS  # noqa: E402
from proxyvisor.redact import SHAPES, holds_secret, redact  # noqa: E402


def texts_of(paths: list[Path]) -> list[str]:
    out: list[str] = []
    for path in paths:
        for line in path.read_text(encoding="utf-8").splitlines():
            message = json.loads(line)
            parts = [message.get("content")] + [c["function"]["arguments"] for c in message.get("tool_calls") or []]
            out += [p[:READ_CHARS] for p in parts if isinstance(p, str) and p.strip()]
    return out


def per_text_us(texts: list[str], check: Callable[[str], Any]) -> tuple[float, float]:
    """(median, mean) CPU microseconds per text over three passes (the best pass's)."""
    best: list[float] | None = None
    for _ in range(3):
        times = []
        for text in texts:
            started = time.process_time_ns()
            check(text)
            times.append((time.process_time_ns() - started) / 1000)
        best = times if best is None or sum(times) < sum(best) else best
    assert best is not None
    return statistics.median(best), statistics.fmean(best)


def detect_secrets_checks() -> dict[str, Callable[[str], Any]]:
    try:
        from detect_secrets.core.plugins.util import get_mapping_from_secret_type_to_class
        from detect_secrets.core.scan import scan_line
        from detect_secrets.settings import transient_settings
    except ImportError:
        return {}
    names = [c.__name__ for c in get_mapping_from_secret_type_to_class().values()]

    def scanner(plugins: list[str]) -> Callable[[str], Any]:
        def check(text: str) -> bool:
            with transient_settings({"plugins_used": [{"name": n} for n in plugins]}):
                return any(any(True for _ in scan_line(line)) for line in text.splitlines())
        return check
    return {"detect-secrets, default plugins": scanner(names),
            "detect-secrets, no high-entropy plugins": scanner([n for n in names if "Entropy" not in n])}


def run(paths: list[Path]) -> list[str]:
    texts = texts_of(paths)
    chars = statistics.fmean(len(t) for t in texts)
    checks: dict[str, Callable[[str], Any]] = {
        "baseline: whitespace normalisation": lambda t: " ".join(t.split()),
        "holds_secret": holds_secret, "redact": redact, **detect_secrets_checks()}
    timed = {name: per_text_us(texts, check) for name, check in checks.items()}
    base = timed["baseline: whitespace normalisation"][1]
    lines = [f"{len(texts)} texts from {len(paths)} trajectories, each cut to {READ_CHARS:,} characters "
             f"(mean {chars:,.0f}).", "",
             "| check | median per text | mean per text | mean vs baseline | texts flagged |", "|---|---|---|---|---|"]
    for name, (median, mean) in timed.items():
        flagged = "" if name.startswith("baseline") or name == "redact" else \
            str(sum(1 for t in texts if checks[name](t)))
        lines.append(f"| {name} | {median:.1f} us | {mean:.1f} us | {mean / base:.1f}x | {flagged} |")
    shapes: Counter[str] = Counter()
    examples: list[str] = []
    for text in texts:
        for number, shape in enumerate(SHAPES, 1):
            for match in shape.matches(text):
                shapes[f"shape {number}"] += 1
                if len(examples) < 8:
                    examples.append(" ".join(text[max(0, match.start() - 30):match.end() + 10].split()))
    lines += ["", "holds_secret's flags by shape (the order of `proxyvisor.redact.SHAPES`): "
              + (", ".join(f"{k}: {v}" for k, v in sorted(shapes.items())) or "none") + "."]
    lines += [f"- `{e}`" for e in examples]
    return lines


def main() -> int:
    args = corpus_parser(__doc__).parse_args()
    paths = trajectories(args.corpus)
    if not paths:
        return 2
    lines = run(paths)
    print("\n".join(lines))
    if args.write:
        write_section("Secret detection", "\n".join([
            "CPU time per text of `proxyvisor.redact` on every message of the corpus (cut as learning reads a record "
            "candidate), against learning's own whitespace normalisation of it, in the same run; the texts it flags "
            "(the corpus holds no real credential).", "",
            "Command: `python bench/redact.py ../shared/corpus/trajectories --write` (with `detect-secrets` "
            "installed in the venv for its rows)", "", *lines]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
