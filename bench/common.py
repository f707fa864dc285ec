"""What the benchmarks share: the processes they start and stop (roles, the LiteLLM proxy), how they measure
them (CPU time, load average, percentiles), and the filler text of their synthetic requests."""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import select
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

from bench.results import RESULTS

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT.parent / "shared" / "corpus" / "trajectories"
"""Where the corpus benchmarks look for trajectories when given no folder."""
MODEL = "scripted-model"
CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "proxyvisor-bench"
API_KEY = b"sk-bench-" + os.urandom(24).hex().encode()
"""Sent by the load generator to every arm; the LiteLLM proxy requires it as its master key."""


class BenchError(Exception):
    pass


MISSED_TARGET = 3
"""The exit status of a benchmark that ran to its end with right results but missed a timing target: .ci/run
reports it and goes on (a shared runner's timings vary). Any other non-zero status (a crash, wrong results) fails
the run."""


def exit_status(timings_met: bool, results_right: bool = True) -> int:
    """A benchmark's exit status: 1 when a result was wrong (failed requests, a changed answer), else
    :data:`MISSED_TARGET` when a timing target was missed, else 0."""
    return 1 if not results_right else 0 if timings_met else MISSED_TARGET


WORDS = ("the file path command output tool agent returns string list integer optional default when run shell "
         "working directory timeout lines pattern glob search replace edit write read notebook cell task todo "
         "status pending completed description example must should never always use instead of prefer — café "
         "naïve ✓ résumé").split()


def prose(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


def cpu_time(proc: subprocess.Popen[bytes] | None) -> float:
    """CPU time used so far by all threads of ``proc`` (s), from Linux's per-thread schedstat (ns resolution;
    /proc/PID/stat ticks are too coarse for a block of requests). NaN where that is not available."""
    if proc is None:
        return float("nan")
    total = 0
    try:
        tasks = os.listdir(f"/proc/{proc.pid}/task")
    except OSError:
        return float("nan")
    for task in tasks:
        try:
            with open(f"/proc/{proc.pid}/task/{task}/schedstat", "rb") as f:
                total += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            pass
    return total / 1e9


def loadavg() -> str:
    try:
        return "%.1f" % os.getloadavg()[0]
    except OSError:
        return "?"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_redis(work: Path) -> tuple[subprocess.Popen[bytes], str]:
    """A ``redis-server`` (Debian package) on a free loopback port without persistence, its files in ``work``;
    (the process, its URL).

    Raises:
        BenchError: redis-server is not installed or does not start.
    """
    binary = shutil.which("redis-server") or ("/usr/bin/redis-server" if os.access("/usr/bin/redis-server", os.X_OK)
                                              else None)
    if binary is None:
        raise BenchError("--redis needs redis-server (Debian: apt-get install redis-server)")
    port = free_port()
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", str(work), "--logfile", str(work / "redis.log")],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5) as conn:
                conn.sendall(b"PING\r\n")
                if conn.recv(16).startswith(b"+PONG"):
                    return proc, f"redis://127.0.0.1:{port}/0"
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise BenchError("redis-server did not start")


def add_compare_options(parser: argparse.ArgumentParser) -> None:
    """``--compare CHECKOUT`` (also measure another checkout of proxyvisor, in its own process: :func:`checkouts`)
    and the hidden ``--checkout`` by which :func:`run_in_checkout` runs each one."""
    parser.add_argument("--compare", type=Path, help="also measure this checkout of proxyvisor, in its own process")
    parser.add_argument("--checkout", type=Path, help=argparse.SUPPRESS)


def checkouts(compare: Path | None) -> list[tuple[str, Path]]:
    """The checkouts a ``--compare`` bench measures: (label, folder) of this one and, when given, the other."""
    return [("this checkout", ROOT)] + ([("compared", compare)] if compare is not None else [])


def run_in_checkout(script: str, checkout: Path, *args: str) -> str:
    """The standard output of bench ``script`` run with ``--checkout CHECKOUT`` and ``args`` in a process of its
    own (so that it imports that checkout's proxyvisor). Raises CalledProcessError when it fails."""
    return subprocess.run([sys.executable, script, "--checkout", str(checkout), *args], check=True,
                          capture_output=True, text=True).stdout


def spawn_role(script: str, role: str, *args: str, log: Path) -> tuple[subprocess.Popen[bytes], int]:
    """Start bench ``script`` in ``role`` as a child process; returns it and the port it printed as ``PORT n``.
    The child exits when its stdin closes (see :func:`exit_on_stdin_eof`), so it never outlives this process.
    Raises BenchError when no port line comes within 60 s."""
    proc = subprocess.Popen([sys.executable, script, "--role", role, *args], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=log.open("wb"), cwd=ROOT)
    ready, _, _ = select.select([proc.stdout], [], [], 60)
    line = proc.stdout.readline() if ready else b""
    if not line.startswith(b"PORT "):
        proc.kill()
        raise BenchError(f"{role} did not start: {log.read_text(errors='replace')[-2000:]}")
    return proc, int(line.split()[1])


def litellm_venv(venv: Path, install: bool) -> tuple[Path | None, str]:
    """(path of the ``litellm`` CLI or None, a note saying what happened)."""
    exe = venv / "bin" / "litellm"
    # Package metadata, not an import: importing the proxy takes seconds, and a broken install shows at start.
    probe = [str(venv / "bin" / "python"), "-c", "import importlib.metadata as m; m.version('fastapi');"
             "m.version('uvicorn'); print(m.version('litellm'))"]
    env = dict(os.environ, LITELLM_LOCAL_MODEL_COST_MAP="True")
    ok = exe.exists() and subprocess.run(probe, capture_output=True, env=env).returncode == 0
    if not ok:
        if not install:
            return None, f"LiteLLM proxy not installed in {venv} (and --no-install given)"
        print(f"installing litellm[proxy] into {venv} (once; about a minute) ...", flush=True)
        try:
            if not (venv / "bin" / "python").exists():
                subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, capture_output=True)
            subprocess.run([str(venv / "bin" / "pip"), "install", "-q", "litellm[proxy]"], check=True,
                           capture_output=True, timeout=900)
        except (subprocess.SubprocessError, OSError) as exc:
            detail = getattr(exc, "stderr", b"") or b""
            return None, f"could not install litellm[proxy]: {exc} {detail.decode(errors='replace')[-500:]}"
    done = subprocess.run(probe, capture_output=True, env=env)
    if done.returncode != 0:
        return None, f"litellm[proxy] is incomplete in {venv}: {done.stderr.decode(errors='replace')[-500:]}"
    return exe, f"litellm {done.stdout.decode().strip()}"


def start_litellm(exe: Path, upstream_port: int, workdir: Path) -> tuple[subprocess.Popen[bytes], int]:
    """Start the LiteLLM proxy as a pass-through to the upstream, in its default setup (one worker, master key,
    no database); returns at once: see :func:`wait_litellm`."""
    port = free_port()
    config = workdir / "litellm.yaml"
    config.write_text(
        "model_list:\n"
        f"  - model_name: {MODEL}\n"
        "    litellm_params:\n"
        f"      model: openai/{MODEL}\n"
        f"      api_base: http://127.0.0.1:{upstream_port}/v1\n"
        "      api_key: sk-bench\n"
        "general_settings:\n"
        f"  master_key: {API_KEY.decode()}\n"
        "litellm_settings:\n"
        "  telemetry: false\n"
        "  set_verbose: false\n"
    )
    log = workdir / "litellm.log"
    env = dict(os.environ, LITELLM_LOCAL_MODEL_COST_MAP="True", LITELLM_LOG="ERROR", LITELLM_TELEMETRY="False",
               NO_PROXY="*", no_proxy="*")
    for var in ("DATABASE_URL", "REDIS_HOST", "REDIS_URL", "LITELLM_MASTER_KEY"):
        env.pop(var, None)
    proc = subprocess.Popen([str(exe), "--config", str(config), "--host", "127.0.0.1", "--port", str(port),
                             "--num_workers", "1"], stdin=subprocess.DEVNULL, stdout=log.open("wb"),
                            stderr=subprocess.STDOUT, cwd=workdir, env=env, start_new_session=True)
    return proc, port


def wait_litellm(proc: subprocess.Popen[bytes], port: int, log: Path, timeout_s: float = 120) -> None:
    """Wait until the LiteLLM proxy answers ``/health/liveliness``. Raises BenchError when it exits or times out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise BenchError(f"LiteLLM proxy exited ({proc.returncode}): {log.read_text(errors='replace')[-1500:]}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
                s.sendall(b"GET /health/liveliness HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
                if s.recv(64).startswith(b"HTTP/1.1 200"):
                    return
        except OSError:
            pass
        time.sleep(0.25)
    stop(proc)
    raise BenchError(f"LiteLLM proxy did not answer within {timeout_s:g} s: "
                     f"{log.read_text(errors='replace')[-1500:]}")


def stop(proc: subprocess.Popen[bytes] | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    try:
        if proc.stdin:
            proc.stdin.close()
        proc.send_signal(signal.SIGTERM)
        proc.wait(5)
    except (subprocess.TimeoutExpired, OSError):
        proc.kill()
        proc.wait()


def pct(values: list[float], q: float) -> float:
    """The ``q``-th percentile (0-100) by linear interpolation (statistics.quantiles, inclusive)."""
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=1000, method="inclusive")[int(q * 10) - 1]


def exit_on_stdin_eof() -> None:
    """End this process (exit status 0) as soon as its stdin closes: how a spawned role dies with its parent."""
    def watch() -> None:
        sys.stdin.buffer.read()
        os._exit(0)

    threading.Thread(target=watch, daemon=True).start()


def corpus_parser(description: str, *, formats: bool = False, modes: bool = False) -> argparse.ArgumentParser:
    """The command line of a corpus benchmark: the trajectories folder (positional, default :data:`CORPUS`),
    ``--write``, and with ``formats`` / ``modes`` the ``--formats`` / ``--modes`` lists it replays in (comma-
    separated; read them with ``args.formats.split(",")``); the caller adds its own options."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("corpus", nargs="?", default=str(CORPUS), help="folder of trajectory .jsonl files")
    parser.add_argument("--write", action="store_true", help="write the table into bench/RESULTS.md")
    if formats:
        parser.add_argument("--formats", default="chat,messages,responses", help="comma-separated wire formats")
    if modes:
        parser.add_argument("--modes", default="json,stream", help="comma-separated: json, stream")
    return parser


def trajectories(folder: str) -> list[Path]:
    """The ``*.jsonl`` files of ``folder``, sorted; empty, after saying so on stderr, when there are none."""
    paths = sorted(Path(folder).glob("*.jsonl"))
    if not paths:
        print(f"no trajectories in {folder}", file=sys.stderr)
    return paths


def sized_parser(description: str, quick_help: str) -> argparse.ArgumentParser:
    """The command line of a benchmark with a CI-size ``--quick`` run (``quick_help`` says what it sets); the
    caller adds its own options and parses with :func:`parse_sized`."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help=quick_help)
    return parser


def parse_sized(parser: argparse.ArgumentParser, argv: list[str] | None, quick: dict[str, object],
                full: dict[str, object]) -> argparse.Namespace:
    """Parse ``argv``; each option of ``quick``/``full`` left unset (None) takes its value for the run's size."""
    args = parser.parse_args(argv)
    for key, value in (quick if args.quick else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def add_arm_options(parser: argparse.ArgumentParser) -> None:
    """The options of a benchmark that runs arms through proxies: the LiteLLM arm and where the figures go."""
    parser.add_argument("--no-litellm", action="store_true", help="leave out the LiteLLM proxy arm")
    parser.add_argument("--no-install", action="store_true", help="do not install litellm[proxy] when missing")
    parser.add_argument("--litellm-venv", type=Path, default=CACHE / "litellm-venv",
                        help=f"venv holding litellm[proxy] (default {CACHE / 'litellm-venv'})")
    parser.add_argument("--results", type=Path, default=RESULTS,
                        help="markdown file to write (default bench/RESULTS.md)")
    parser.add_argument("--no-write", action="store_true", help="print only; leave RESULTS.md alone")


def command_line(script: str, argv: list[str] | None) -> str:
    """How to rerun this benchmark: ``python {script}`` and its arguments, quoted for a shell."""
    return f"python {script}" + "".join(" " + shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))


@contextlib.contextmanager
def workspace(prefix: str) -> Iterator[tuple[Path, list[subprocess.Popen[bytes]]]]:
    """A scratch folder and a list to put started processes in; on leaving, the processes are stopped (last
    started first) and the folder removed."""
    work = Path(tempfile.mkdtemp(prefix=prefix))
    procs: list[subprocess.Popen[bytes]] = []
    try:
        yield work, procs
    finally:
        for proc in reversed(procs):
            stop(proc)
        shutil.rmtree(work, ignore_errors=True)


@contextlib.asynccontextmanager
async def proxy_in_process(source: str) -> AsyncIterator[Any]:
    """A supervised proxy (its defaults, a fresh state folder) running in this process, its upstream the scripted
    model on loopback answering every request with a tool call (``bench.histories.TOOL_ROUND``); yields the running
    proxy, whose ``pipeline`` takes requests straight (no client socket). ``source`` names the bench in its config.
    proxyvisor is imported when this is called (``bench/request_profile.py --checkout`` puts another checkout
    first)."""
    import trio

    from bench.histories import TOOL_ROUND
    from proxyvisor.config import Config, StateConfig, SupervisorConfig, UpstreamConfig
    from proxyvisor.proxy.server import Limits, bound_port, open_listeners, serve_listeners
    from proxyvisor.proxy.service import running
    from proxyvisor.scripted.upstream import ScriptedUpstream

    listeners = await open_listeners("127.0.0.1", 0)
    async with trio.open_nursery() as nursery:
        await nursery.start(serve_listeners, listeners, ScriptedUpstream([TOOL_ROUND], record=False), Limits())
        config = Config(upstreams=(UpstreamConfig(name="bench", url=f"http://127.0.0.1:{bound_port(listeners)}"),),
                        state=StateConfig(dir=tempfile.mkdtemp(prefix="proxyvisor-bench-")),
                        supervisor=SupervisorConfig(enabled=True), source=source)
        async with running(config, port=0) as proxy:
            yield proxy
        nursery.cancel_scope.cancel()
