"""The proxy overhead of an agent's first model requests: the real Claude Code run headless (``claude -p``) under
``proxyvisor wrap`` against the built-in scripted model, against a baseline checkout in the same run.

Usage (from the repository root)::

    python bench/first_request.py                              # 6 wrap runs of this checkout
    python bench/first_request.py --runs 6 --baseline /tmp/old  # and another checkout's, interleaved run by run
    python bench/first_request.py --serve                      # 3 sessions one after the other under one serve

Each wrap run is a fresh state directory and a fresh ``wrap`` process; Claude Code lists its working directory
(one tool call, two model requests). Printed per checkout: the first request's ``overhead_ms`` (the ledger's: time
in the proxy, the upstream's and the supervisor model's left out), the later requests', and the time from
``wrap``'s start to the first request's arrival (its ledger line's time less its latency), medians over the runs,
with the ratios to the baseline's. ``--serve`` starts ``proxyvisor serve`` once per checkout and runs Claude Code
three times against it, its first request ``--serve-delay`` seconds after the port answers: the first request of
each session, the first of them the process's. Claude Code comes from ``.ci/install-agents``
(``/root/.cache/proxyvisor-agents/bin``, else ``PATH``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
AGENTS = Path("/root/.cache/proxyvisor-agents/bin")
PROMPT = "List the files in the current directory."
MODEL = "claude-sonnet-4-5"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=6, help="wrap runs per checkout (default 6)")
    p.add_argument("--baseline", type=Path, help="another checkout of proxyvisor, run before this one each time")
    p.add_argument("--serve", action="store_true", help="sessions under one serve instead of wrap runs")
    p.add_argument("--serve-delay", type=float, default=0.3, help="seconds between serve's start and claude's")
    return p.parse_args(argv)


def claude() -> str:
    found = AGENTS / "claude" if (AGENTS / "claude").exists() else shutil.which("claude")
    if not found:
        sys.exit("claude is not installed: run .ci/install-agents")
    return str(found)


def env_for(checkout: Path, folder: Path) -> dict[str, str]:
    """The environment of a run: ``checkout`` first on the path, Claude Code's config and scratch in ``folder``."""
    own = {k: v for k, v in os.environ.items() if not k.startswith(("ANTHROPIC", "OPENAI", "CLAUDE"))}
    return own | {"PYTHONPATH": str(checkout), "CLAUDE_CONFIG_DIR": str(folder / "home"),
                  "ANTHROPIC_API_KEY": "placeholder", "DISABLE_TELEMETRY": "1", "DISABLE_AUTOUPDATER": "1",
                  "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "TMPDIR": str(folder / "home")}


def workspace(folder: Path) -> Path:
    for name in ("work", "home", "state"):
        (folder / name).mkdir(parents=True)
    (folder / "work" / "notes.txt").write_text("hello\n")
    return folder


def sessions(state: Path) -> list[list[dict[str, Any]]]:
    """Each session's ledger lines, the sessions in the order of their first line."""
    found = [[json.loads(line) for line in path.read_text().splitlines()]
             for path in (state / "ledger").glob("*.jsonl")]
    return sorted((lines for lines in found if lines), key=lambda lines: lines[0]["time"])


def wrap_run(checkout: Path, folder: Path) -> tuple[list[float], float]:
    """One wrap run: each request's overhead_ms, and ms from wrap's start to the first request's arrival."""
    workspace(folder)
    started = time.time()
    subprocess.run([sys.executable, "-m", "proxyvisor", "wrap", "--quiet", "--state-dir", str(folder / "state"), "--",
                    claude(), "-p", PROMPT, "--model", MODEL, "--output-format", "json"],
                   cwd=folder / "work", env=env_for(checkout, folder), capture_output=True, timeout=180, check=True)
    lines = [line for session in sessions(folder / "state") for line in session]
    lines.sort(key=lambda line: line["time"])
    arrived = datetime.fromisoformat(lines[0]["time"]).timestamp() - lines[0]["latency_ms"] / 1000
    return [line["overhead_ms"] for line in lines], (arrived - started) * 1000


def serve_runs(checkout: Path, folder: Path, delay: float) -> list[list[float]]:
    """Three claude runs against one serve: each session's requests' overhead_ms."""
    workspace(folder)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    config = folder / "config.toml"
    config.write_text(f'[proxy]\nport = {port}\n[upstreams.scripted]\nurl = "scripted:"\n'
                      'formats = ["chat", "messages", "responses"]\n')
    env = env_for(checkout, folder)
    server = subprocess.Popen([sys.executable, "-m", "proxyvisor", "serve", "--config", str(config), "--state-dir",
                               str(folder / "state")], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(400):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.1).close()
                break
            except OSError:
                time.sleep(0.05)
        time.sleep(delay)
        for _ in range(3):
            subprocess.run([claude(), "-p", PROMPT, "--model", MODEL, "--output-format", "json"], cwd=folder / "work",
                           env=env | {"ANTHROPIC_BASE_URL": f"http://127.0.0.1:{port}"}, capture_output=True,
                           timeout=180, check=True)
    finally:
        server.terminate()
        server.wait(30)
    return [[line["overhead_ms"] for line in lines] for lines in sessions(folder / "state")]


def ratio(base: dict[str, float] | None, figures: dict[str, float], key: str) -> str:
    return f" ({figures[key] / base[key]:.2f}x the baseline's)" if base else ""


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    checkouts = ([args.baseline.resolve()] if args.baseline else []) + [ROOT]
    with tempfile.TemporaryDirectory(prefix="first-request-") as scratch:
        if args.serve:
            for n, checkout in enumerate(checkouts):
                for s, overheads in enumerate(serve_runs(checkout, Path(scratch) / f"serve-{n}", args.serve_delay)):
                    print(f"{checkout}: serve, session {s + 1}: overhead_ms {overheads}")
            return
        runs: dict[Path, list[tuple[list[float], float]]] = {c: [] for c in checkouts}
        for i in range(args.runs):
            for n, checkout in enumerate(checkouts):
                overheads, start_ms = wrap_run(checkout, Path(scratch) / f"wrap-{n}-{i}")
                runs[checkout].append((overheads, start_ms))
                print(f"{checkout}: run {i + 1}: overhead_ms {overheads}, wrap start -> first request "
                      f"{start_ms:.0f} ms", flush=True)
    base: dict[str, float] | None = None
    for checkout in checkouts:
        done = runs[checkout]
        figures = {"first": statistics.median(o[0] for o, _ in done),
                   "later": statistics.median(x for o, _ in done for x in o[1:]),
                   "start": statistics.median(s for _, s in done)}
        print(f"{checkout}: first request {figures['first']:.1f} ms{ratio(base, figures, 'first')}, later "
              f"requests {figures['later']:.1f} ms{ratio(base, figures, 'later')}, wrap start -> first request "
              f"{figures['start']:.0f} ms{ratio(base, figures, 'start')} (medians of {len(done)} runs)")
        base = base or figures


if __name__ == "__main__":
    main()
