"""``proxyvisor batch``: run a file of tasks, each agent run through its own proxied session with the verify-gate on,
and report each task's outcome.

One proxy runs in this process (:func:`proxyvisor.proxy.service.running`) with supervision on and the gate on and
``headless`` (no user is present: a turn that stops while still in progress is nudged on). Each task gets a fresh
session, ``TASKID-RANDOM``; its agent command is run with the base-URL variables pointing at that session, as
``proxyvisor wrap`` does (:func:`proxyvisor.wrap.agent_invocation`). When the agent exits, the task's result is
read from the session's ledger (:mod:`proxyvisor.batch_report`).

The task file (:func:`load_tasks`) is JSON lines, one task object per line; blank lines are skipped. Keys:
``id`` (required; 1-64 of ``A-Za-z0-9._-``, starting with a letter or digit, unique: it names the task's session,
log files and default working directory), ``prompt`` (required, non-empty), and optionally ``workdir`` (the
folder to run the agent in, created if missing; a relative path is relative to the task file's folder),
``timeout_s`` (seconds, overrides ``--timeout``) and ``env`` (an object of extra environment variables, string
values). Other keys are an error, so a misspelt key is never silently ignored. No string may hold a NUL byte, and
the prompt (which the agent gets as an argument and in ``PROXYVISOR_PROMPT``) and each ``env`` entry must fit in one
Linux argument or environment string (:data:`MAX_ARG_STRLEN`).

The agent command (:func:`agent_argv`) is a command line, split into words the way a POSIX shell would
(:func:`shlex.split`) once; in each word, ``{prompt}``, ``{id}``, ``{workdir}`` and ``{session}`` are then replaced
by the task's values as they are (a value is never split or re-read), and the words are run directly, not through
a shell; any other ``{name}`` is an error. The agent also gets ``PROXYVISOR_TASK_ID`` and ``PROXYVISOR_PROMPT`` in
its environment (for ``sh -c '...'`` commands, where a value pasted into the script would be read as code).

A task whose working directory cannot be made ends with that error (outcome ``no_verdict``); the others run.

Agents run with ``cwd`` = the task's working directory, stdin empty, stdout and stderr to files, each in a new
process group (session). A task past its timeout, and every running task on SIGINT or SIGTERM, gets SIGTERM on
its whole process group, then SIGKILL after :data:`GRACE_S` seconds (at once on a second Ctrl-C); whatever an
agent leaves running in its group when it exits is killed too.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import re
import secrets
import shlex
import signal
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Annotated, Any

import msgspec
import orjson
import trio
from msgspec import Meta
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from . import batch_report
from .batch_report import TaskResult
from .config import Config
from .proxy.info import plural, summarize
from .proxy.service import running
from .rules import HOLD_ANSWER, POSITIVE
from .schema import Invalid, convert, json_kind, real
from .store import Store, private_dir, private_opener
from .supervisor_model import describe
from .wrap import agent_invocation

PLACEHOLDERS = ("prompt", "id", "workdir", "session")
PLACEHOLDER = re.compile(r"\{(prompt|id|workdir|session)\}")
_NAMED = re.compile(r"(?<!\$)\{([A-Za-z_][A-Za-z0-9_]*)\}")
"""A ``{name}`` in a word of the agent command (``${NAME}`` is the shell's, left alone)."""
MAX_ARG_STRLEN = 131_072
"""Linux's limit on one argument or environment string, in bytes with its closing NUL (``MAX_ARG_STRLEN`` in
``include/uapi/linux/binfmts.h``: 32 pages of 4 KiB); a longer one fails ``execve`` with E2BIG."""
_PROMPT_VAR = "PROXYVISOR_PROMPT"
GRACE_S = 5.0
"""Seconds an agent's process group has between SIGTERM and SIGKILL when it is stopped."""
ERROR_CHARS = 300


class BatchError(ValueError):
    """A batch cannot start: its task file or its agent command is not usable (nothing has run)."""


class TaskFileError(BatchError):
    """The task file cannot be used; the message names the file and line."""


class _TaskLine(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The schema of one line of the task file (module docstring)."""

    id: Annotated[str, Meta(pattern=r"\A[A-Za-z0-9][A-Za-z0-9._-]{0,63}\Z",
                            description="1-64 of A-Z a-z 0-9 . _ - starting with a letter or digit")]
    prompt: Annotated[str, Meta(pattern=r"\S", description="a non-empty string")]
    workdir: Annotated[str, Meta(min_length=1, description="a non-empty string")] | None = None
    timeout_s: Annotated[float, real(POSITIVE, "a positive number of seconds")] | None = None
    env: Annotated[dict[Annotated[str, Meta(pattern="^[^=]+$")], str],
                   Meta(description="an object of variable names to string values")] = {}


@dataclass(frozen=True)
class Task:
    """One task of the file (module docstring); ``line`` is its line number (1-based)."""

    id: str
    prompt: str
    line: int
    workdir: Path | None = None
    timeout_s: float | None = None
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)


def load_tasks(path: str | Path) -> list[Task]:
    """Read and check the whole task file (module docstring) before anything runs.

    Raises:
        TaskFileError: the file cannot be read as UTF-8 text; a line is not a JSON object, lacks ``id`` or
            ``prompt``, has a key or value that is not allowed, or repeats an id (the message starts
            ``PATH:LINE:``); or the file holds no task.
    """
    path = Path(path)
    tasks: list[Task] = []
    seen: dict[str, int] = {}
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise TaskFileError(f"{path}: cannot read the task file: {getattr(exc, 'strerror', None) or exc}") from None
    for number, raw in enumerate(text.splitlines(), 1):
        if not raw.strip():
            continue
        where = f"{path}:{number}"
        try:
            obj = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise TaskFileError(f"{where}: not JSON: {exc}") from None
        task = _task(obj, where, number, path.parent)
        if task.id in seen:
            raise TaskFileError(f"{where}: task id {task.id!r} is already used on line {seen[task.id]}")
        seen[task.id] = number
        tasks.append(task)
    if not tasks:
        raise TaskFileError(f"{path}: no tasks (one JSON object per line: {{\"id\": ..., \"prompt\": ...}})")
    return tasks


def _task(obj: Any, where: str, number: int, base: Path) -> Task:
    if not isinstance(obj, dict):
        raise TaskFileError(f"{where}: a task must be a JSON object, got {json_kind(obj)}")
    try:
        line = convert(obj, _TaskLine, table="object")
    except Invalid as exc:
        p = exc.problem
        if p.unknown:
            raise TaskFileError(f"{where}: unknown key(s) {list(p.unknown)}; a task has {list(p.known)}") from None
        raise TaskFileError(f"{where}: '{p.key}' {p.message}") from None
    task_id, prompt, workdir, timeout, env = line.id, line.prompt, line.workdir, line.timeout_s, line.env
    for name, value in (("prompt", prompt), ("workdir", workdir or ""),
                        *((f"env {k!r}", f"{k}={v}") for k, v in env.items())):
        if "\0" in value:
            raise TaskFileError(f"{where}: {name} contains a NUL byte, which no program argument, path or "
                                "environment variable can hold")
    # The prompt is passed both as an argument and as PROXYVISOR_PROMPT=...; the variable is the longer of the two.
    for name, value in (("prompt", f"{_PROMPT_VAR}={prompt}"), *((f"env {k!r}", f"{k}={v}") for k, v in env.items())):
        size = len(value.encode("utf-8", "surrogatepass")) + 1
        if size > MAX_ARG_STRLEN:
            raise TaskFileError(f"{where}: {name} is too long to pass to a program: {size:,} bytes as the "
                                f"environment string {value.partition('=')[0]}=..., over Linux's limit of "
                                f"{MAX_ARG_STRLEN:,} bytes per argument or environment string (MAX_ARG_STRLEN); "
                                "put long text in a file and name the file in the prompt")
    return Task(task_id, prompt, number, base / workdir if workdir else None, timeout, env)


def check_template(template: str) -> None:
    """Raise :class:`BatchError` unless ``template`` is a usable ``--agent`` command line (module docstring):
    words a shell would split, no placeholder but the known ones, and the prompt passed on (``{prompt}``, or
    ``$PROXYVISOR_PROMPT`` in a command of the user's)."""
    try:
        words = _words(template)
    except ValueError as exc:
        raise BatchError(f"--agent: cannot split the command line: {exc}") from None
    if not words:
        raise BatchError("--agent: the command is empty")
    unknown = sorted({m[1] for word in words for m in _NAMED.finditer(word)} - set(PLACEHOLDERS))
    if unknown:
        raise BatchError(f"--agent: unknown placeholder(s) {', '.join(f'{{{n}}}' for n in unknown)}; the known ones "
                         f"are {', '.join(f'{{{n}}}' for n in PLACEHOLDERS)}")
    if "{prompt}" not in template and _PROMPT_VAR not in template:
        raise BatchError("--agent: the command must contain {prompt} (or read $PROXYVISOR_PROMPT), e.g. "
                         "--agent 'claude -p {prompt}'")


@functools.lru_cache(maxsize=4)
def _words(template: str) -> tuple[str, ...]:
    """``template`` split as a POSIX shell would, once per template (not per task: the values are never split).
    Raises ValueError (an unclosed quote)."""
    return tuple(shlex.split(template))


def agent_argv(template: str, task: Task, workdir: Path, session: str) -> list[str]:
    """The words of ``template`` with the placeholders in each filled in as they are (module docstring).
    Raises ValueError when ``template`` cannot be split (:func:`check_template` refuses it first)."""
    values = {"prompt": task.prompt, "id": task.id, "workdir": str(workdir), "session": session}
    return [PLACEHOLDER.sub(lambda m: values[m[1]], word) for word in _words(template)]


@dataclass(frozen=True)
class Options:
    """How to run a batch. ``parallel``: tasks at once; ``timeout_s``: a task's default limit;
    ``workdir_template``: a folder per task with ``{id}`` (None: a fresh temporary folder, kept); ``logs``: the
    folder for the agents' stdout and stderr."""

    agent: str
    parallel: int
    timeout_s: float
    workdir_template: str | None
    logs: Path = Path("batch-logs")


def batch_config(config: Config) -> Config:
    """``config`` with what a batch needs: supervision on, and the gate on, headless and holding whole answers
    (``hold = "answer"``: nobody watches the stream, and a harness that parses the final message gets only the
    answer that passed the gate, never a premature one followed by its rework)."""
    gate = msgspec.structs.replace(config.supervisor.gate, enabled=True, headless=True, hold=HOLD_ANSWER)
    return config.with_overrides(supervisor={"enabled": True, "gate": gate})


class Batch:
    """One batch run: :meth:`run` runs the tasks and returns their results (module docstring)."""

    def __init__(self, config: Config, tasks: Sequence[Task], options: Options, store: Store,
                 progress: Progress) -> None:
        self.config = config
        self.tasks = tasks
        self.options = options
        self.store = store
        self.progress = progress
        self.results: dict[int, TaskResult] = {}
        self.interrupted: int | None = None
        """The signal that stopped the run (SIGINT or SIGTERM), if one did."""
        self.hurry = trio.Event()
        """Set by a second signal: stopped agents get SIGKILL at once."""
        self._bar = progress.add_task("batch", total=len(tasks), verified=0, running=0)
        self._running = 0

    async def run(self) -> list[TaskResult]:
        """Run every task (at most ``parallel`` at once, started in file order) and return the results of those
        that started, in task order. SIGINT or SIGTERM stops the running agents and starts no more
        (:attr:`interrupted`)."""
        limiter = trio.CapacityLimiter(self.options.parallel)
        async with running(self.config, port=0, store=self.store) as proxy:
            async with trio.open_nursery() as outer:
                async with trio.open_nursery() as tasks:
                    outer.start_soon(self._watch_signals, tasks.cancel_scope)
                    for index, task in enumerate(self.tasks):
                        # Taken here, not in the task, so that tasks start in file order.
                        await limiter.acquire_on_behalf_of(index)
                        tasks.start_soon(self._run_one, proxy.url, limiter, index, task)
                outer.cancel_scope.cancel()
        return [self.results[i] for i in sorted(self.results)]

    async def _watch_signals(self, tasks: trio.CancelScope) -> None:
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async for signum in signals:
                if self.interrupted is None:
                    self.interrupted = signum
                    self._say(f"{signal.Signals(signum).name}: stopping the running agents "
                              "(again to kill them at once); the report covers the tasks that started")
                    tasks.cancel()
                else:
                    self.hurry.set()

    async def _run_one(self, proxy_url: str, limiter: trio.CapacityLimiter, index: int, task: Task) -> None:
        self._count_running(+1)
        try:
            await self._agent(proxy_url, index, task)
        finally:
            self._count_running(-1)
            limiter.release_on_behalf_of(index)
        result = self.results[index]
        self._say(f"{task.id}: {result.outcome}, exit {batch_report.cell(result, 'exit_code')}, "
                  f"{result.seconds:.1f} s" + (f" ({result.error})" if result.error else ""))
        verified = sum(r.verified for r in self.results.values())
        self.progress.update(self._bar, advance=1, verified=verified)

    async def _agent(self, proxy_url: str, index: int, task: Task) -> None:
        """Run ``task``'s agent to its end and record its result as ``results[index]``; cancelled (an
        interrupt), it stops the agent and still records the result, with the error "interrupted"."""
        session = f"{task.id}-{secrets.token_hex(8)}"
        out_path, err_path = self.options.logs / f"{task.id}.stdout", self.options.logs / f"{task.id}.stderr"
        workdir: Path | None = None
        run = _Run()
        started = time.monotonic()
        finished = False
        try:
            with open(out_path, "wb", opener=private_opener) as out, open(err_path, "wb", opener=private_opener) as err:
                try:
                    workdir = self._workdir(task)
                except OSError as exc:  # this task's own problem: the others still run
                    run.error = (f"cannot make the working directory {exc.filename or ''}: "
                                 f"{exc.strerror or exc}").replace(" :", ":")
                else:
                    # PWD as a shell sets it for a command run in the workdir: agents that take their project
                    # folder from it (opencode) would work in the folder batch was started from.
                    base = {**os.environ, "PWD": str(workdir), **task.env, "PROXYVISOR_TASK_ID": task.id,
                            _PROMPT_VAR: task.prompt}
                    cmd, env = agent_invocation(proxy_url, session,
                                                agent_argv(self.options.agent, task, workdir, session), base)
                    await self._process(cmd, workdir, env, out, err, task.timeout_s or self.options.timeout_s, run)
            finished = True
        finally:
            seconds = round(time.monotonic() - started, 3)
            if not finished:
                run.error = run.error or "interrupted"
            elif run.code not in (0, None) and run.error is None:
                run.error = _last_line(err_path)
            # Complete for an agent that exited on its own: the proxy writes a request's line before the client
            # can see the end of its response (a stream's line is written before the body's end marker is sent).
            # A stopped agent's open request is written (499) once the proxy sees its connection close.
            with trio.CancelScope(shield=True):  # an interrupted task is reported too
                info = await trio.to_thread.run_sync(lambda: summarize(self.store.read_ledger(session)))
            self.results[index] = batch_report.from_summary(
                info, id=task.id, session=session, exit_code=run.code, error=run.error, seconds=seconds,
                workdir=str(workdir or ""), stdout=str(out_path), stderr=str(err_path))

    def _workdir(self, task: Task) -> Path:
        if task.workdir is not None:
            folder = task.workdir
        elif self.options.workdir_template is not None:
            folder = Path(self.options.workdir_template.replace("{id}", task.id))
        else:
            return Path(tempfile.mkdtemp(prefix=f"proxyvisor-batch-{task.id}-"))
        folder.mkdir(parents=True, exist_ok=True)
        return folder.resolve()

    async def _process(self, cmd: list[str], workdir: Path, env: dict[str, str], out: Any, err: Any,
                       timeout_s: float, run: _Run) -> None:
        """Run the agent to its end, or past ``timeout_s`` stop it; its exit status and any error go to ``run``.
        Cancelled, it stops the agent's process group before it returns."""
        kept = _KeptStatus()
        try:
            async with trio.open_nursery() as nursery:
                try:
                    process = await nursery.start(functools.partial(
                        _run_process, cmd, kept, cwd=workdir, env=env, stdin=subprocess.DEVNULL, stdout=out,
                        stderr=err, check=False, start_new_session=True,
                        deliver_cancel=functools.partial(_stop_group, hurry=self.hurry)))
                except OSError as exc:
                    run.code, run.error = 127, f"cannot run {cmd[0]!r}: {exc.strerror or exc}"
                    return
                with trio.move_on_after(timeout_s) as deadline:
                    await process.wait()
                if deadline.cancelled_caught:
                    run.error = f"timed out after {timeout_s:g} s"
                    nursery.cancel_scope.cancel()
        finally:
            process = kept.process
            if process is not None:
                _signal_group(process.pid, signal.SIGKILL)  # whatever the agent left running in its group
                if process.returncode is not None:
                    run.code = 128 - process.returncode if process.returncode < 0 else process.returncode

    def _count_running(self, delta: int) -> None:
        self._running += delta
        self.progress.update(self._bar, running=self._running)

    def _say(self, text: str) -> None:
        self.progress.console.print(text, markup=False, highlight=False, soft_wrap=True)


@dataclass
class _Run:
    """What became of one agent process: its exit status (128+N for signal N; 127: it could not start) and the
    error that ended the task early, if any."""

    code: int | None = None
    error: str | None = None


class _KeptStatus(trio.TaskStatus[trio.Process]):
    """A task status that keeps the process it reports: a cancel landing while ``nursery.start`` hands the process
    over makes ``start`` raise instead of returning it, and the agent's exit status would be lost with it."""

    def __init__(self) -> None:
        self.process: trio.Process | None = None
        self.status: trio.TaskStatus[trio.Process] = trio.TASK_STATUS_IGNORED

    def started(self, value: trio.Process) -> None:
        self.process = value
        self.status.started(value)


async def _run_process(cmd: list[str], kept: _KeptStatus, *,
                       task_status: trio.TaskStatus[trio.Process] = trio.TASK_STATUS_IGNORED, **options: Any) -> None:
    kept.status = task_status
    await trio.run_process(cmd, task_status=kept, **options)


async def _stop_group(process: trio.Process, hurry: trio.Event) -> None:
    """``deliver_cancel`` for an agent: SIGTERM to its process group, SIGKILL after :data:`GRACE_S` seconds or
    as soon as ``hurry`` is set."""
    _signal_group(process.pid, signal.SIGTERM)
    with trio.move_on_after(GRACE_S):
        async with trio.open_nursery() as nursery:
            async def first(wait: Any) -> None:
                await wait()
                nursery.cancel_scope.cancel()

            nursery.start_soon(first, process.wait)
            nursery.start_soon(first, hurry.wait)
    _signal_group(process.pid, signal.SIGKILL)


def _signal_group(pgid: int, signum: int) -> None:
    try:
        os.killpg(pgid, signum)
    except (ProcessLookupError, PermissionError):
        pass  # the group is gone already


def _last_line(path: Path) -> str | None:
    """The last non-blank line of a log file, clipped; None when there is none."""
    try:
        with path.open("rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 4096))
            tail = f.read().decode("utf-8", "replace")
    except OSError:
        return None
    lines = [line.strip() for line in tail.splitlines() if line.strip()]
    return lines[-1][:ERROR_CHARS] if lines else None


def batch_command(config: Config, tasks_file: str, options: Options, require_verified: bool = False,
                  report: str | None = None) -> int:
    """``proxyvisor batch``: check the task file, the command and the report's folder, run the batch with a
    progress bar on stderr, write ``REPORT.jsonl``, ``REPORT.md`` and the agents' output under ``REPORT-logs/``
    (``report``, default ``batch/batch-YYYYMMDD-HHMMSS`` in the state directory), and
    return the exit status: 0 every agent exited 0 (and, with ``require_verified``, every task is verified: the
    tasks that are not are named on stderr); 1 otherwise; 128+N when signal N (SIGINT, SIGTERM) stopped the run.

    Raises:
        BatchError: the task file (:class:`TaskFileError`), the ``--agent`` command or the ``--report`` folder is
            not usable (nothing has run).
        OSError: a report file cannot be written.
        ConfigError: the configuration cannot be served (nothing has run).
    """
    tasks = load_tasks(tasks_file)
    check_template(options.agent)
    config = batch_config(config)
    started = datetime.now(timezone.utc)
    # Not the current folder by default: a batch run from a checkout would leave its report in the working tree.
    prefix = Path(report or config.state_dir() / "batch" / f"batch-{started:%Y%m%d-%H%M%S}")
    options = dataclasses.replace(options, logs=prefix.with_name(prefix.name + "-logs"))
    try:  # made now, so that a report that cannot be written is known before any agent runs
        if not report:
            private_dir(private_dir(config.state_dir()) / "batch")
        options.logs.parent.mkdir(parents=True, exist_ok=True)
        private_dir(options.logs)  # the agents' output may hold what they read: private, like the state dir
    except OSError as exc:
        raise BatchError(f"--report: cannot make the folder {exc.filename or options.logs}: "
                         f"{exc.strerror or exc}") from None
    if not os.access(prefix.parent, os.W_OK | os.X_OK):
        raise BatchError(f"--report: cannot write in the folder {prefix.parent}")
    console = Console(stderr=True)
    clock = time.monotonic()
    quiet_gate = _GateAsInfo()
    logging.getLogger("proxyvisor.gate").addFilter(quiet_gate)
    try:
        with Progress(TextColumn("batch"), BarColumn(), TextColumn("done"), MofNCompleteColumn(),
                      TextColumn("· verified {task.fields[verified]}"), TextColumn("· running {task.fields[running]}"),
                      TimeElapsedColumn(), console=console) as progress:
            batch = Batch(config, tasks, options, Store(config.state_dir()), progress)
            results = trio.run(batch.run)
    finally:
        logging.getLogger("proxyvisor.gate").removeFilter(quiet_gate)
    unverified = [r for r in results if not r.verified]
    facts = [("tasks", f"{tasks_file} ({plural(len(tasks), 'task')}, {len(results)} run)"),
             ("agent", f"`{options.agent}`"),
             ("started", (f"{started:%Y-%m-%d %H:%M:%S} UTC, {options.parallel} at a time, timeout "
                          f"{options.timeout_s:g} s per task")),
             ("wall time", (f"{time.monotonic() - clock:.1f} s for the whole batch (the agent seconds column is each "
                            "agent's own time; its total is their sum)")),
             ("supervisor model", describe(config.supervisor.model)),
             ("require verified", (f"yes: {len(results) - len(unverified)} of {len(tasks)} verified"
                                   if require_verified else "no")),
             ("ledgers", str(config.state_dir() / "ledger"))]
    if batch.interrupted is not None:
        facts.append(("interrupted", (f"by {signal.Signals(batch.interrupted).name} after {len(results)} of "
                                      f"{plural(len(tasks), 'task')} started")))
    jsonl, md = batch_report.write(prefix, results, facts)
    counts = batch_report.outcome_counts(results)
    console.print(f"proxyvisor batch: {len(results)} of {plural(len(tasks), 'task')}: "
                  f"{', '.join(f'{k} {v}' for k, v in counts.items()) or 'none run'}; report {md} and {jsonl}",
                  markup=False, highlight=False, soft_wrap=True)
    if batch.interrupted is not None:
        return 128 + batch.interrupted
    clean = len(results) == len(tasks) and all(r.exit_code == 0 and r.error is None for r in results)
    if require_verified and unverified:
        listed = ", ".join(f"{r.id} ({r.outcome}, exit {batch_report.cell(r, 'exit_code')})" for r in unverified)
        console.print(f"proxyvisor batch: --require-verified: {len(unverified)} of {plural(len(tasks), 'task')} "
                      f"not verified (outcome verified with exit 0): {listed}", markup=False, highlight=False, soft_wrap=True)
        return 1
    return 0 if clean else 1


class _GateAsInfo(logging.Filter):
    """Shows the gate's per-turn warnings ("turn unverified: ...") as INFO during a batch: there a turn's label is
    an expected outcome, which the task's own line and the report give, not a problem of the batch."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno != logging.WARNING:
            return True
        record.levelno, record.levelname = logging.INFO, "INFO"
        return logging.getLogger(record.name).isEnabledFor(logging.INFO)


__all__ = ["Batch", "BatchError", "Options", "Task", "TaskFileError", "agent_argv", "batch_command", "batch_config",
           "check_template", "load_tasks"]
