"""Running one child as a subprocess: stream its output line by line, stop it softly, then hard (seed 002).

Adapters for agent CLIs call :func:`run_process` from their ``run``; it never decides what a line means. The
child runs in its own process group, with stdin closed. Each complete stdout line goes to ``on_line`` and each
stderr chunk to ``on_stderr`` (both are signs of life). When the calling scope is cancelled (a wall clock, an
idle cancel, the parent), the stop is staged: SIGTERM to the group, up to ``stop_grace_s`` for the child to
exit, then SIGKILL; the cleanup is shielded, so no child outlives the call. :class:`CliRuntime` is the base of
the agent-CLI adapters built on it.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson
import trio

from .failures import Failure
from .runtime import ChildJob, ChildProgress, NativeError, normalise_native, progress_log

log = logging.getLogger("proxyvisor.adapters.process")

MAX_LINE_BYTES = 16 * 1024 * 1024
"""A longer stdout line is cut to this many bytes (the rest is dropped) rather than held in memory."""
STDERR_TAIL_BYTES = 16 * 1024


@dataclass
class ProcessExit:
    """How a child process ended: ``returncode`` (negative: killed by that signal) and its last stderr bytes
    (at most 16 KiB, decoded with replacement)."""

    returncode: int
    stderr_tail: str


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


async def stop_process(process: trio.Process, grace_s: float) -> str:
    """Soft then hard stop of ``process`` and its group; returns ``"exited"``, ``"terminated"`` or ``"killed"``.

    Call it shielded: it waits up to ``grace_s`` seconds after SIGTERM before SIGKILL.
    """
    if process.returncode is not None:
        return "exited"
    _signal_group(process.pid, signal.SIGTERM)
    with trio.move_on_after(grace_s):
        await process.wait()
    how = "terminated"
    if process.returncode is None:
        progress_log.warning("the child ignored SIGTERM for %g s: killing it (SIGKILL)", grace_s)
        how = "killed"
    # Also reaches members of the group that outlived their leader.
    _signal_group(process.pid, signal.SIGKILL)
    await process.wait()
    return how


async def _read_lines(stream: trio.abc.ReceiveStream, on_line: Callable[[bytes], None]) -> None:
    buffer = bytearray()
    dropping = False
    while True:
        chunk = await stream.receive_some(65536)
        if not chunk:
            break
        buffer += chunk
        while True:
            end = buffer.find(b"\n")
            if end < 0:
                break
            line = bytes(buffer[:end])
            del buffer[: end + 1]
            if dropping:
                dropping = False
                continue
            on_line(line)
        if len(buffer) > MAX_LINE_BYTES and not dropping:
            on_line(bytes(buffer[:MAX_LINE_BYTES]))
            buffer.clear()
            dropping = True
        elif dropping:
            buffer.clear()
    if buffer and not dropping:
        on_line(bytes(buffer))


async def _read_tail(stream: trio.abc.ReceiveStream, tail: bytearray,
                     on_chunk: Callable[[bytes | bytearray], None]) -> None:
    while True:
        chunk = await stream.receive_some(65536)
        if not chunk:
            return
        tail += chunk
        del tail[: max(0, len(tail) - STDERR_TAIL_BYTES)]
        on_chunk(chunk)


async def run_process(argv: Sequence[str], on_line: Callable[[bytes], None], *,
                      on_stderr: Callable[[bytes | bytearray], None] = lambda _chunk: None,
                      env: Mapping[str, str] | None = None, cwd: str | None = None,
                      stop_grace_s: float = 5.0) -> ProcessExit:
    """Run ``argv`` to completion, streaming its output (see the module docstring).

    Returns when the process has exited and both pipes are drained.

    Raises:
        OSError: the program cannot be started (e.g. not found); nothing is left running.
        trio.Cancelled: the calling scope was cancelled; the process was stopped (soft, then hard) first.
    """
    process = await trio.lowlevel.open_process(
        list(argv), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        env=dict(env) if env is not None else None, cwd=cwd, start_new_session=True)
    log.info("child pid %d started: %s", process.pid, argv[0])
    assert process.stdout is not None and process.stderr is not None  # opened as pipes
    tail = bytearray()
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_read_lines, process.stdout, on_line)
            nursery.start_soon(_read_tail, process.stderr, tail, on_stderr)
        returncode = await process.wait()
    finally:
        with trio.CancelScope(shield=True):
            how = await stop_process(process, stop_grace_s)
            if how != "exited":
                progress_log.info("the child stopped (%s)", how)
            for stream in (process.stdout, process.stderr):
                if stream is not None:
                    await stream.aclose()
    return ProcessExit(returncode, tail.decode("utf-8", "replace"))


def json_event(line: bytes, progress: ChildProgress) -> dict[str, Any] | None:
    """One line of a CLI's JSON-lines output as an object; None, after counting the line as a bare event on
    ``progress``, when it is not JSON or not an object."""
    try:
        event = orjson.loads(line)
    except orjson.JSONDecodeError:
        event = None
    if not isinstance(event, dict):
        progress.event()
        return None
    return event


class CliRuntime:
    """Base of adapters that run an agent CLI as the child: options, readiness, environment and exit handling.

    A subclass gives the command (:attr:`command`, :meth:`effort_args`; :meth:`argv` builds the line) and reads
    its output (:meth:`on_line`, one stdout line at a time, with a per-run ``state`` dict). Options
    (``[model_routing.adapter_options.<id>]``): ``bin`` (the executable, default :attr:`default_bin`),
    ``extra_args`` (list), ``env`` (list of ``NAME=value``), ``cwd``.
    The child's environment is the proxy's plus ``env`` plus ``TRACEPARENT`` (W3C trace context).
    """

    default_bin = ""

    def __init__(self, descriptor: Any, options: Mapping[str, Any]) -> None:
        self.descriptor = descriptor
        self.bin = str(options.get("bin") or self.default_bin)
        self.extra_args = [str(a) for a in options.get("extra_args", [])]
        pairs = [str(p).partition("=") for p in options.get("env", [])]
        self.env = {name: value for name, _, value in pairs if name}
        self.cwd = str(options["cwd"]) if options.get("cwd") else None

    def readiness(self) -> str | None:
        return None if shutil.which(self.bin) else f"{self.bin!r} is not on PATH"

    def normalise(self, error: NativeError, now: float) -> Failure:
        return normalise_native(error, now)

    command: tuple[str, ...] = ()
    """The CLI's arguments between the executable and the model (its headless, machine-readable mode)."""

    def effort_args(self, effort: str) -> list[str]:
        """The arguments that set the reasoning ``effort``; none for a CLI without such a setting."""
        return []

    def argv(self, job: ChildJob) -> list[str]:
        """``bin command [--model M] [effort args] extra_args -- prompt``."""
        argv = [self.bin, *self.command]
        if job.model:
            argv += ["--model", job.model]
        if job.effort:
            argv += self.effort_args(job.effort)
        return argv + self.extra_args + ["--", job.prompt]

    def on_line(self, line: bytes, progress: ChildProgress, state: dict[str, Any]) -> None:
        raise NotImplementedError

    async def run(self, job: ChildJob, progress: ChildProgress) -> None:
        env = {**os.environ, **self.env}
        if job.traceparent:
            env["TRACEPARENT"] = job.traceparent
        state: dict[str, Any] = {}
        try:
            exit = await run_process(self.argv(job), lambda line: self.on_line(line, progress, state),
                                     on_stderr=lambda _chunk: progress.event(), env=env,
                                     cwd=job.cwd or self.cwd, stop_grace_s=job.stop_grace_s)
        except OSError as exc:
            progress.fail(self.normalise(NativeError(f"cannot start {self.bin}: {exc.strerror or exc}"), time.time()))
            return
        if progress.failure is not None or (progress.finish_reason is not None and exit.returncode == 0):
            return
        if exit.returncode == 0 and progress.text:
            progress.finish(None)
            return
        message = exit.stderr_tail.strip()[-2000:] or f"{self.bin} exited with code {exit.returncode} and no answer"
        progress.fail(self.normalise(NativeError(message), time.time()))
