"""OpenTelemetry traces of the supervised requests, made from each request's ledger record.

With ``[telemetry] otlp_endpoint`` set, :func:`tracing` returns a :class:`Tracing`; unset, it returns None and the
OpenTelemetry SDK is never imported (the pipeline then does no tracing work at all).

What one supervised request exports (:meth:`Tracing.request`, called where its ledger line is made):

- **the request span** (kind ``SERVER``, named ``chat {gen_ai.request.model}``), with the OpenTelemetry GenAI
  semantic conventions: ``gen_ai.operation.name``, ``gen_ai.provider.name`` (``anthropic`` for the Messages API,
  else ``openai``: the wire format the upstream was spoken to), ``gen_ai.request.model``,
  ``gen_ai.response.model``, ``gen_ai.usage.input_tokens``, ``gen_ai.usage.output_tokens``,
  ``gen_ai.conversation.id`` (the proxyvisor session), ``http.response.status_code`` and ``error.type``;
  proxyvisor's own under ``proxyvisor.*``. Its parent is the client's W3C ``traceparent`` when the request carries
  a valid one (its sampled flag is honoured), else it starts a trace;
- **span events**, one per thing supervision did, named ``proxyvisor.<what>`` with the ledger's fields as
  attributes: ``detector`` (signals fired), ``steer`` (the note added), ``condense``, ``plan``, ``learning.recall``,
  ``authorizer``, ``gate`` (the verdict), ``self_report``, ``upstream.attempt`` (each upstream tried under the
  breakers: a refusal of a cooling pool, a failure, the fallback that answered);
- **child spans** for each supervisor model call (``chat {model}``, kind ``CLIENT``, ``proxyvisor.purpose``:
  ``verify``, ``refute``, ``condense``, ``plan``, ``authorize``, ...; learning's ``distill``, made after the answer
  went out, is exported as it ends: :meth:`Tracing.model_call`) and each delegated child
  (``invoke_agent {role}``, kind ``CLIENT``, the delegation's evidence as attributes, each attempt an event). A
  delegated child is handed that span's context as its ``traceparent`` (an HTTP child as a header, a CLI child as
  ``TRACEPARENT``), so a child whose requests come back through proxyvisor puts its own request spans under it:
  one trace per delegation tree.

The span ids are chosen before the spans are made (the request's before it goes upstream, a child's before it
starts), so the spans are made when the ledger record is complete, with those ids (:class:`_Planned`) and their
recorded times. Export is asynchronous (``BatchSpanProcessor``: a bounded queue and a worker thread), so it never
blocks or fails a request; an export failure is logged once until an export succeeds again. The shutdown waits at
most :data:`CLOSE_S` for what is still queued.
"""

from __future__ import annotations

import logging
import threading
import time
import urllib.parse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import orjson

from ..adapters.results import TRACEPARENT
from ..config import TelemetryConfig

if TYPE_CHECKING:  # imported at run time only when tracing is on
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Span, Tracer

log = logging.getLogger("proxyvisor.telemetry")

TRACES_PATH = "/v1/traces"
CLOSE_S = 1.0
"""Seconds :meth:`Tracing.close` gives the export of what is queued before it drops it."""
ERROR_STATUSES = frozenset({"failed", "refused", "invalid"})
"""Delegation statuses whose span has the error status."""
_EVENTS = (("signals", "proxyvisor.detector"), ("steer", "proxyvisor.steer"), ("condensed", "proxyvisor.condense"),
           ("plan", "proxyvisor.plan"), ("learning", "proxyvisor.learning.recall"),
           ("authorizer", "proxyvisor.authorizer"), ("gate", "proxyvisor.gate"), ("report", "proxyvisor.self_report"))
"""Ledger fields that become span events of the request span, in the order supervision does them."""
_ON_REPLY = frozenset({"authorizer", "gate", "report"})
"""Of :data:`_EVENTS`, those done on the reply."""
_SPAN_FIELDS = (("format", "proxyvisor.format"), ("stream", "proxyvisor.stream"),
                ("overhead_ms", "proxyvisor.overhead_ms"), ("usage_estimated", "proxyvisor.usage_estimated"),
                ("scripted", "proxyvisor.scripted"), ("local", "proxyvisor.command"),
                ("tool_round", "proxyvisor.tool_round"))
"""Ledger fields that become attributes of the request span."""


@dataclass(frozen=True)
class SpanContext:
    """A span's W3C trace context: ids as integers, ``sampled`` from its flags."""

    trace_id: int
    span_id: int
    sampled: bool


def parse_traceparent(value: str | None) -> SpanContext | None:
    """The context of a W3C ``traceparent`` header (version 00), or None when absent or invalid (all-zero ids are
    invalid)."""
    match = TRACEPARENT.match((value or "").strip().lower())
    if match is None:
        return None
    trace_id, span_id = int(match.group(1), 16), int(match.group(2), 16)
    if not trace_id or not span_id:
        return None
    return SpanContext(trace_id, span_id, bool(int(match.group(3), 16) & 1))


@dataclass(frozen=True)
class ModelCallSpan:
    """One supervisor model call: wall times in ns since the epoch, its ``purpose`` (``verify``, ``condense``...),
    its token counts, and ``error`` (the exception's type name) when it failed."""

    start_ns: int
    end_ns: int
    purpose: str
    input_tokens: int | None = None
    output_tokens: int | None = None
    error: str | None = None


@dataclass(frozen=True)
class DelegationSpan:
    """One delegation of a request: its ledger entry (``result``: role, status, evidence) and wall times (ns)."""

    result: Mapping[str, Any]
    start_ns: int
    end_ns: int


def wall_ns(perf_counter_s: float) -> int:
    """The wall time (ns since the epoch) of a ``time.perf_counter()`` reading taken earlier in this process."""
    return time.time_ns() - int((time.perf_counter() - perf_counter_s) * 1e9)


def endpoint_url(base: str) -> str:
    """The OTLP/HTTP traces URL of ``[telemetry] otlp_endpoint``: ``/v1/traces`` appended to its path unless the
    path ends so (a query string stays after the path)."""
    parts = urllib.parse.urlsplit(base)
    path = parts.path.rstrip("/")
    return urllib.parse.urlunsplit(parts._replace(path=path if path.endswith(TRACES_PATH) else path + TRACES_PATH))


def shown_url(url: str) -> str:
    """``url`` as it may be printed or logged: without a user or password and with its query's values hidden
    (either may hold a credential)."""
    parts = urllib.parse.urlsplit(url)
    host = parts.netloc.rpartition("@")[2]
    query = "&".join(f"{name}=[redacted]" for name, _ in urllib.parse.parse_qsl(parts.query, keep_blank_values=True))
    return urllib.parse.urlunsplit(parts._replace(netloc=host, query=query))


def provider_name(fmt_name: str) -> str:
    """``gen_ai.provider.name`` of a wire format: ``anthropic`` for the Messages API, else ``openai``."""
    return "anthropic" if fmt_name == "messages" else "openai"


def response_model(answer: Any) -> str | None:
    """The model an answer names (a Chat Completions or Responses body or chunk, an Anthropic message or its
    ``message_start`` event), or None."""
    if not isinstance(answer, dict):
        return None
    for holder in (answer, answer.get("message"), answer.get("response")):
        if isinstance(holder, dict) and isinstance(holder.get("model"), str) and holder["model"]:
            return str(holder["model"])
    return None


def attributes(prefix: str, value: Any, out: dict[str, Any] | None = None) -> dict[str, Any]:
    """``value`` as OpenTelemetry attributes under ``prefix``: a mapping flattened into dotted keys, a list of one
    primitive type kept, any other list as JSON text, None left out."""
    out = {} if out is None else out
    if isinstance(value, Mapping):
        for key, item in value.items():
            attributes(f"{prefix}.{key}" if prefix else str(key), item, out)
    elif isinstance(value, (str, bool, int, float)):
        out[prefix] = value
    elif isinstance(value, (list, tuple)):
        kinds = {type(item) for item in value}
        out[prefix] = list(value) if len(kinds) == 1 and kinds <= {str, bool, int, float} \
            else orjson.dumps(value, default=str).decode()
    elif value is not None:
        out[prefix] = str(value)
    return out


def tracing(config: TelemetryConfig) -> Tracing | None:
    """The tracing of a proxy, or None when ``config.otlp_endpoint`` is empty (nothing is imported)."""
    return Tracing(config) if config.otlp_endpoint else None


class Tracing:
    """Exports spans to the OTLP/HTTP receiver of ``config`` (module docstring). Construction imports the
    OpenTelemetry SDK and starts its export thread; :meth:`close` flushes and stops it."""

    def __init__(self, config: TelemetryConfig) -> None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import SERVICE_NAME, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
        from opentelemetry.sdk.trace.id_generator import RandomIdGenerator

        from .. import __version__

        class Planned(RandomIdGenerator):
            """The SDK's ids, except the next span's (and, for a root span, trace's) when one is planned."""

            span_id: int | None = None
            trace_id: int | None = None

            def generate_span_id(self) -> int:
                planned, self.span_id = self.span_id, None
                return planned or super().generate_span_id()

            def generate_trace_id(self) -> int:
                planned, self.trace_id = self.trace_id, None
                return planned or super().generate_trace_id()

        url = endpoint_url(config.otlp_endpoint)

        class Reported(SpanExporter):
            """The OTLP exporter, whose failures are logged once (until an export succeeds again), not per batch;
            its own per-batch log lines are silenced."""

            def __init__(self) -> None:
                self.inner = OTLPSpanExporter(endpoint=url)
                self.failing = False
                self.closed = threading.Event()

            def export(self, spans: Sequence[Any]) -> SpanExportResult:
                try:
                    result = self.inner.export(spans)
                    reason = "the receiver refused or did not answer"
                except Exception as exc:  # noqa: BLE001 - an exporter's failure must never reach a request
                    result, reason = SpanExportResult.FAILURE, type(exc).__name__
                if result is SpanExportResult.FAILURE and not self.failing:
                    log.warning("OpenTelemetry: exporting spans to %s failed (%s); spans are dropped until it "
                                "works again, and this is not logged again until then", shown_url(url), reason)
                elif result is SpanExportResult.SUCCESS and self.failing:
                    log.info("OpenTelemetry: exporting spans to %s works again", shown_url(url))
                self.failing = result is SpanExportResult.FAILURE
                return result

            def shutdown(self) -> None:
                if not self.closed.is_set():  # (Tracing.close may have done it already)
                    self.closed.set()
                    self.inner.shutdown()  # type: ignore[no-untyped-call]

            def force_flush(self, timeout_millis: int = 30000) -> bool:
                return bool(self.inner.force_flush(timeout_millis))

        logging.getLogger("opentelemetry.exporter").setLevel(logging.CRITICAL)
        self.url = url
        self.ids = Planned()
        self.provider: TracerProvider = TracerProvider(
            resource=Resource.create({SERVICE_NAME: config.service_name}), id_generator=self.ids)
        self.exporter = Reported()
        self.provider.add_span_processor(BatchSpanProcessor(self.exporter))
        self.tracer: Tracer = self.provider.get_tracer("proxyvisor", __version__)

    def close(self) -> None:
        """Export what is queued and stop the export thread, within :data:`CLOSE_S`: past it the exporter is shut
        down, which ends its retries (a receiver that is down held a proxy's shutdown some 7 s, retrying after 1,
        2 and 4 s) and drops what was not exported."""
        deadline = threading.Timer(CLOSE_S, self.exporter.shutdown)
        deadline.start()
        try:
            self.provider.shutdown()
        finally:
            deadline.cancel()

    def _start(self, name: str, kind: str, context: SpanContext, parent: SpanContext | None, start_ns: int,
               attrs: dict[str, Any], remote: bool = False) -> Span:
        """Start span ``name`` with the ids of ``context`` (a span id of 0: the SDK's own) under ``parent`` (None: a
        root span; ``remote``: the client's span)."""
        from opentelemetry import trace

        parent_context = None
        if parent is not None:
            parent_context = trace.set_span_in_context(trace.NonRecordingSpan(trace.SpanContext(
                parent.trace_id, parent.span_id, is_remote=remote,
                trace_flags=trace.TraceFlags(trace.TraceFlags.SAMPLED if parent.sampled else 0))))
        else:
            self.ids.trace_id = context.trace_id
        self.ids.span_id = context.span_id
        return self.tracer.start_span(name, parent_context, getattr(trace.SpanKind, kind), attrs,
                                      start_time=start_ns)

    @staticmethod
    def _end(span: Span, end_ns: int, error: str | None) -> None:
        from opentelemetry.trace import Status, StatusCode

        if error is not None:
            span.set_status(Status(StatusCode.ERROR, error))
        span.end(end_ns)

    def request(self, record: Mapping[str, Any], *, session_id: str, trace: str, parent: str | None,
                start_ns: int, end_ns: int, response_model: str | None = None,
                model_calls: Sequence[ModelCallSpan] = (), model_route: Mapping[str, str] | None = None,
                delegations: Sequence[DelegationSpan] = ()) -> None:
        """Export one request's spans (module docstring). ``record``: its ledger line; ``trace``: its own span's
        ``traceparent`` (the ids handed to its children); ``parent``: the client's ``traceparent`` header;
        ``start_ns``/``end_ns``: wall times; ``model_route``: the supervisor calls' route (``{"route",
        "model"}``). Never raises: a span that cannot be made is logged and dropped."""
        try:
            self._request(record, session_id, trace, parent, start_ns, end_ns, response_model, model_calls,
                          model_route or {}, delegations)
        except Exception:  # noqa: BLE001 - tracing must never cost a request
            log.exception("OpenTelemetry: the spans of a request of session %s were not made", session_id)

    def _request(self, record: Mapping[str, Any], session_id: str, trace: str, parent: str | None, start_ns: int,
                 end_ns: int, response_model: str | None, model_calls: Sequence[ModelCallSpan],
                 model_route: Mapping[str, str], delegations: Sequence[DelegationSpan]) -> None:
        own = parse_traceparent(trace)
        if own is None:
            return
        provider = provider_name(str(record.get("format")))
        model = record.get("model")
        attrs: dict[str, Any] = {"gen_ai.operation.name": "chat", "gen_ai.provider.name": provider,
                                 "gen_ai.conversation.id": session_id,
                                 "http.response.status_code": record.get("status", 0)}
        for key, value in (("gen_ai.request.model", model), ("gen_ai.response.model", response_model),
                           ("gen_ai.usage.input_tokens", record.get("input_tokens")),
                           ("gen_ai.usage.output_tokens", record.get("output_tokens"))):
            if value is not None:
                attrs[key] = value
        for field, name in _SPAN_FIELDS:
            attributes(name, record.get(field), attrs)
        status = record.get("status", 0)
        error = None
        if isinstance(status, int) and status >= 400:
            attrs["error.type"] = str(status)
            error = str(record.get("error") or f"HTTP {status}")
        span = self._start(f"chat {model}" if model else "chat", "SERVER", own, parse_traceparent(parent),
                           start_ns, attrs, remote=True)
        for field, name in _EVENTS:
            if field in record:
                # What runs before the request goes upstream at its start; the reply's steps at its end.
                at = end_ns if field in _ON_REPLY else start_ns
                span.add_event(name, attributes(field if not isinstance(record[field], Mapping) else "",
                                                record[field]), at)
        upstream = record.get("upstream")
        if isinstance(upstream, Mapping):
            for attempt in [*upstream.get("tried", ()), upstream]:
                span.add_event("proxyvisor.upstream.attempt",
                               attributes("", {k: v for k, v in attempt.items() if k != "tried"}), start_ns)
        for call in model_calls:
            self._model_call(call, own, provider, model_route)
        for delegation in delegations:
            self._delegation(delegation, own)
        self._end(span, end_ns, error)

    def model_call(self, call: ModelCallSpan, trace: str, provider: str, route: Mapping[str, str]) -> None:
        """Export the span of a supervisor model call that ended after its request's spans were made, under the
        request's span (``trace``, its ``traceparent``; ``provider``: its ``gen_ai.provider.name``). Never
        raises."""
        try:
            parent = parse_traceparent(trace)
            if parent is not None:
                self._model_call(call, parent, provider, route)
        except Exception:  # noqa: BLE001 - tracing must never cost a request
            log.exception("OpenTelemetry: the span of a supervisor model call was not made")

    def _model_call(self, call: ModelCallSpan, parent: SpanContext, provider: str,
                    route: Mapping[str, str]) -> None:
        model = route.get("model") or ""
        attrs: dict[str, Any] = {"gen_ai.operation.name": "chat", "gen_ai.provider.name": provider,
                                 "proxyvisor.purpose": call.purpose or "supervisor",
                                 "proxyvisor.route": route.get("route") or ""}
        if model:
            attrs["gen_ai.request.model"] = model
        if call.input_tokens is not None:
            attrs["gen_ai.usage.input_tokens"] = call.input_tokens
        if call.output_tokens is not None:
            attrs["gen_ai.usage.output_tokens"] = call.output_tokens
        if call.error is not None:
            attrs["error.type"] = call.error
        span = self._start(f"chat {model}" if model else "chat", "CLIENT",
                           SpanContext(parent.trace_id, 0, parent.sampled), parent, call.start_ns, attrs)
        self._end(span, call.end_ns, call.error)

    def delegation(self, result: Mapping[str, Any], start_ns: int, end_ns: int, parent: str | None) -> None:
        """Export the span of a delegation asked for on its own (``POST /proxyvisor/delegate``): ``result`` its
        answer's evidence with its ``role`` and ``status``; ``parent``: the caller's ``traceparent`` header (None or
        invalid: the span starts the delegation's trace). Never raises."""
        try:
            context = parse_traceparent(parent)
            trace_id = result.get("trace_id")
            if context is None and isinstance(trace_id, str) and trace_id:
                self._delegation(DelegationSpan(result, start_ns, end_ns), None, int(trace_id, 16))
            elif context is not None:
                self._delegation(DelegationSpan(result, start_ns, end_ns), context, remote=True)
        except Exception:  # noqa: BLE001 - tracing must never cost a request
            log.exception("OpenTelemetry: the span of a delegation to %s was not made", result.get("role"))

    def _delegation(self, delegation: DelegationSpan, parent: SpanContext | None, trace_id: int = 0,
                    remote: bool = False) -> None:
        """The ``invoke_agent`` span of ``delegation`` under ``parent`` (None: a root span in trace ``trace_id``;
        ``remote``: a caller's span)."""
        result = delegation.result
        role = str(result.get("role") or "")
        evidence = {k: v for k, v in result.items() if k not in ("attempts", "role")}
        attrs: dict[str, Any] = {"gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": role}
        for key, value in evidence.items():
            name = key if key.startswith("gen_ai.") else f"proxyvisor.delegation.{key}"
            attributes(name, value, attrs)
        span_id = result.get("span_id")
        own = SpanContext(parent.trace_id if parent is not None else trace_id,
                          int(span_id, 16) if isinstance(span_id, str) and span_id else 0,
                          parent.sampled if parent is not None else True)
        span = self._start(f"invoke_agent {role}", "CLIENT", own, parent, delegation.start_ns, attrs,
                           remote)
        for attempt in result.get("attempts") or ():
            if isinstance(attempt, Mapping):
                span.add_event("proxyvisor.delegation.attempt", attributes("", attempt), delegation.start_ns)
        status = result.get("status")
        self._end(span, delegation.end_ns,
                  f"delegation {status}: {result.get('error_category') or ''}".strip(": ")
                  if status in ERROR_STATUSES else None)
