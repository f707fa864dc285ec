"""The contract between the kernel and an adapter's runtime: a job in, progress and a normalised outcome out.

A runtime (built by a descriptor's ``dispatch`` entrypoint) implements :class:`Runtime`. The kernel owns the
clocks, limits, health and shaping; the runtime only runs one child and reports what happens on the
:class:`ChildProgress` it is handed. Every report counts as a heartbeat, and what was reported before a stop
(text so far, usage, native id) is what the parent gets back, so a runtime reports as it goes, not at the end.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from .descriptors import Descriptor
from .failures import Failure, from_http, from_text, unclassified

progress_log = logging.getLogger("proxyvisor.adapters.progress")
"""Where a child's progress is logged for a person, one short line per event: started, idle, stopped and why, a
forced kill. The other adapter loggers carry detail (``proxyvisor delegate`` shows only these lines at its default
log level)."""

FINISHED = "stop"
"""The finish reason of a child that completed its answer; anything else is shaped as ``{text, finish_reason}``."""


@dataclass(frozen=True)
class ChildJob:
    """One unit of child work.

    ``prompt`` is all the child receives from the parent (no parent context passes through, seed 001).
    ``model``/``effort`` empty = the runtime's own default. ``traceparent`` is the W3C trace context of this
    child (same trace id as the parent). ``timeout_s`` is the child's wall clock (s), for runtimes that hand a
    timeout to an SDK; the kernel enforces it either way. ``stop_grace_s``: seconds between a subprocess's soft
    and hard stop. ``output_schema`` is a JSON schema for a structured
    answer (only with the ``structured_output`` capability).
    """

    job_id: str
    role: str
    prompt: str
    adapter: str
    model: str = ""
    effort: str = ""
    traceparent: str = ""
    timeout_s: float = 600.0
    stop_grace_s: float = 5.0
    output_schema: dict[str, Any] | None = None
    cwd: str | None = None


@dataclass(frozen=True)
class NativeError:
    """A runtime's own error, as the runtime saw it, before normalisation.

    ``message``: the error text (a CLI's error event or stderr, an exception's message). ``status``: an HTTP
    status when one is known. ``retry_after``/``retry_after_ms``: response headers when known. ``timed_out``:
    the runtime itself gave up waiting. ``exception``: the SDK exception, for adapters that map exception types.
    """

    message: str
    status: int | None = None
    retry_after: str | None = None
    retry_after_ms: str | None = None
    timed_out: bool = False
    exception: BaseException | None = None


def normalise_native(error: NativeError, now: float) -> Failure:
    """The shared normalisation: a runtime timeout is ``timeout`` with an unknown outcome; an HTTP status decides
    by :func:`~proxyvisor.adapters.failures.from_http`; otherwise the wording; otherwise ``unclassified``."""
    if error.timed_out:
        return Failure("timeout", True, "unknown", None, error.message or "the runtime timed out")
    if error.status is not None and error.status >= 400:
        return from_http(error.status, error.message, now, error.retry_after, error.retry_after_ms)
    return from_text(error.message, now) or unclassified(error.message)


class ChildProgress:
    """What a running child has produced so far. Written by the runtime, read by the kernel (also after a stop).

    ``on_event`` is called on every report: the kernel's heartbeat.
    """

    def __init__(self, on_event: Callable[[], None] = lambda: None) -> None:
        self._on_event = on_event
        self._parts: list[str] = []
        self.final_text: str | None = None
        self.finish_reason: str | None = None
        self.failure: Failure | None = None
        self.model = ""
        self.native_id = ""
        self.input_tokens = 0
        self.output_tokens = 0
        self.events = 0
        self.accepted_work = False
        """The child started work that may have changed something (ran a tool or command): no fallback after."""

    def event(self) -> None:
        """Any sign of life (a line of output, a chunk, a tool call): counts as a heartbeat."""
        self.events += 1
        self._on_event()

    def add_text(self, delta: str) -> None:
        self._parts.append(delta)
        self.event()

    def work(self) -> None:
        """The child ran a tool or command: from now on its outcome is never replayed elsewhere."""
        self.accepted_work = True
        self.event()

    def usage(self, input_tokens: int = 0, output_tokens: int = 0) -> None:
        """Add tokens spent (counted against the fan-out's budget)."""
        self.input_tokens += max(0, int(input_tokens))
        self.output_tokens += max(0, int(output_tokens))
        self.event()

    def finish(self, text: str | None = None, reason: str = FINISHED) -> None:
        """The child's answer is complete (``reason`` ``stop``) or ended early (``length``, ``tool_calls``,
        ``suspended``...). ``text`` replaces the streamed text when given."""
        if text is not None:
            self.final_text = text
        self.finish_reason = reason
        self.event()

    def fail(self, failure: Failure) -> None:
        self.failure = failure
        self.event()

    @property
    def text(self) -> str:
        return self.final_text if self.final_text is not None else "".join(self._parts)


class Runtime(Protocol):
    """A child runtime, built by ``factory(descriptor, options)``."""

    descriptor: Descriptor

    def readiness(self) -> str | None:
        """None when the runtime can run now, else why not (e.g. its CLI is not on PATH). Cheap, no I/O beyond
        a PATH or environment lookup; the kernel caches it."""

    def normalise(self, error: NativeError, now: float) -> Failure:
        """Turn a native error into a :class:`Failure` (``now``: wall clock, Unix seconds). Must classify common
        limit wordings as retryable capacity, extract a provider wait, keep a timeout's outcome unknown, report
        auth as auth, and give every other failure some category (the parity suite checks all five)."""

    async def run(self, job: ChildJob, progress: ChildProgress) -> None:
        """Run ``job`` to its end, reporting on ``progress``; on failure call ``progress.fail`` (do not raise).

        Cancellation is the soft stop: the runtime stops at its next checkpoint and cleans up (a subprocess is
        terminated, then killed, by :mod:`proxyvisor.adapters.process`). Raising instead of reporting is a crash:
        the kernel records it as an ``unavailable`` failure with an unknown outcome.
        """
