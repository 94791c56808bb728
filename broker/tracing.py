"""One trace per request, across the web tier, a worker and a streamer (OpenTelemetry).

On when ``OTEL_EXPORTER_OTLP_ENDPOINT`` or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` is set
(and neither ``OTEL_SDK_DISABLED=true`` nor ``OTEL_TRACES_EXPORTER=none``); every other
``OTEL_*`` variable means what the OpenTelemetry SDK says (protocol, headers, sampler,
batch delays, service name, resource attributes). Off, nothing here imports
OpenTelemetry and every caller skips its span work on one ``None`` check.

Where the spans come from (their parents in brackets):

- web (``RequestTrace``): the request's span ``POST <route>`` (kind SERVER) [the
  client's ``traceparent`` if it sent one], with ``parse`` and ``admission`` [the
  request's span] and the delivery as its events (``first_byte``, ``client_gone``,
  ``handed_over``; the span ends with the last byte); a resumed stream on any web
  process is a ``resume <route>`` span [the request's span, read from its record].
- worker (``generation_spans``): ``queue`` (arrival to a worker's claim),
  ``<operation> <model>`` (the claim to the end, per attempt) and under it ``prefill``
  and ``decode`` (steps and tokens as attributes: never a span per step).
- streamer (``relay_span``): ``detokenize <model>`` (adoption to the last chunk:
  stop handling and finish reasons as attributes and events).
- batch driver (``batch_line_trace``): a line's ``batch <route>`` span (a trace of
  its own) in place of the web's request span, from its submission to its result; a
  line another driver adopts is a ``resume batch <route>`` span under it.

The request's span's context travels in ``RequestRecord.trace`` (and the Celery
message's headers); workers and streamers make their spans at the end of their part,
with the times they measured, so no span is open across a token step. Attributes
follow OpenTelemetry's GenAI semantic conventions (``gen_ai.*``) where they exist.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import socket
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from app.intake import PreparedRequest
from app.records import RequestRecord
from app.usage import UsageCount
from broker.celery_app import GenerateResult

if TYPE_CHECKING:
    from opentelemetry.trace import Span, Tracer

    from broker.run import RunObserver, RunOutcome

logger = logging.getLogger(__name__)

ENDPOINT_VARS = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
PROVIDER = "tokenrelay"  # gen_ai.provider.name
# The batch processor's delay between exports when ``OTEL_BSP_SCHEDULE_DELAY`` is unset
# (the SDK's own default is 5 s): an export costs about 1-2 ms of CPU however few spans
# it carries, so at a light load the exports, not the spans, are most of what tracing
# costs (docs/benchmarks.md, "Tracing"). A busy process exports sooner, whenever 512
# spans wait (``OTEL_BSP_MAX_EXPORT_BATCH_SIZE``); one that exits exports what it holds.
EXPORT_DELAY_MS = 15_000

# The GenAI operation of each endpoint (gen_ai.operation.name).
OPERATIONS = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "text_completion",
    "/v1/responses": "chat",
    "/v1/messages": "chat",
}

_lock = threading.Lock()
_tracer: Tracer | None = None
_process = "tokenrelay"
_started = False


def enabled() -> bool:
    """Whether this process exports traces (read from the environment; no import)."""
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    if os.environ.get("OTEL_TRACES_EXPORTER", "").strip().lower() == "none":
        return False
    return any(os.environ.get(v, "").strip() for v in ENDPOINT_VARS)


def set_process(kind: str) -> None:
    """Name this process's kind (web, worker, streamer, batcher) for its spans'
    resource; call before the first span."""
    global _process
    _process = kind


def start(kind: str) -> None:
    """Name this process's kind and, when tracing is on, set the SDK up now, at start-up
    (once per process, after any fork): an exporter this install cannot make stops the
    process here (``check``) instead of failing every request's spans later, and the
    set-up's cost falls outside any request."""
    set_process(kind)
    check(kind)
    tracer()


def check(kind: str) -> None:
    """Exit 2 with one line, as a bad setting does (``app.logs.settings_or_exit``), when
    the ``OTEL_*`` variables ask for an exporter this install cannot make (a protocol
    without its package, or none the SDK has); nothing when tracing is off."""
    if not enabled():
        return
    try:
        _exporter_class()
    except RuntimeError as exc:
        from app.logs import report_settings_problem

        report_settings_problem(kind, exc)
        raise SystemExit(2) from None


def tracer() -> Tracer | None:
    """This process's tracer, set up by ``start`` (or here, on first use, in a process
    that did not call it; after any fork: the exporter's thread belongs to the process
    that uses it); None when tracing is off."""
    global _tracer, _started
    if _started:
        return _tracer
    with _lock:
        if not _started:
            _tracer = _build() if enabled() else None
            _started = True
    return _tracer


def _build() -> Tracer:
    from opentelemetry import trace
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider

    attributes: dict[str, Any] = {
        "tokenrelay.process": _process,
        "service.instance.id": f"{socket.gethostname()}-{os.getpid()}",
        "process.pid": os.getpid(),
    }
    if not os.environ.get("OTEL_SERVICE_NAME", "").strip():
        attributes["service.name"] = f"tokenrelay-{_process}"
    provider = TracerProvider(resource=Resource.create(attributes))
    provider.add_span_processor(_span_processor())
    trace.set_tracer_provider(provider)
    logger.info("tracing on: spans go to %s", _where())
    return provider.get_tracer("tokenrelay")


def _span_processor() -> Any:
    """The batch processor that exports this process's spans: every ``OTEL_BSP_*``
    variable as the SDK reads it, and ``EXPORT_DELAY_MS`` when the delay is unset."""
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    delay = None if os.environ.get("OTEL_BSP_SCHEDULE_DELAY", "").strip() else EXPORT_DELAY_MS
    return BatchSpanProcessor(_exporter_class()(), schedule_delay_millis=delay)


def _protocol() -> str:
    for var in ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"):
        value = os.environ.get(var, "").strip().lower()
        if value:
            return value
    return "http/protobuf"


def _where() -> str:
    return next((os.environ[v] for v in ENDPOINT_VARS if os.environ.get(v, "").strip()), "")


def _exporter_class() -> Any:
    """The OTLP span exporter the protocol variables ask for (RuntimeError: none here)."""
    protocol = _protocol()
    if protocol == "grpc":
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
                OTLPSpanExporter as GrpcExporter,
            )
        except ImportError as exc:
            raise RuntimeError(
                "OTEL_EXPORTER_OTLP_PROTOCOL=grpc needs the gRPC exporter: "
                "pip install 'tokenrelay[otlp-grpc]' (or use http/protobuf)"
            ) from exc
        return GrpcExporter
    if protocol != "http/protobuf":
        raise RuntimeError(
            f"OTEL_EXPORTER_OTLP_PROTOCOL={protocol!r} is not supported: use "
            "http/protobuf (the default) or grpc"
        )
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter


def shutdown() -> None:
    """Export what is left (a process about to exit); harmless when off."""
    if _tracer is None:
        return
    from opentelemetry import trace

    provider: Any = trace.get_tracer_provider()
    with contextlib.suppress(Exception):
        provider.shutdown()


# -- carrying the context ------------------------------------------------------------------


def _context_of(carrier: Mapping[str, str] | None) -> Any:
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    return TraceContextTextMapPropagator().extract(dict(carrier or {}))


def _carrier(span: Span) -> dict[str, str]:
    from opentelemetry import trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier, context=trace.set_span_in_context(span))
    return carrier


def _under(span: Span) -> Any:
    from opentelemetry import trace

    return trace.set_span_in_context(span)


def _ns(unix_s: float) -> int:
    return int(unix_s * 1e9)


def request_attributes(record: RequestRecord) -> dict[str, Any]:
    """GenAI semantic-convention attributes of what a request asks for."""
    attrs: dict[str, Any] = {
        "gen_ai.operation.name": OPERATIONS.get(record.api or record.endpoint, "chat"),
        "gen_ai.provider.name": PROVIDER,
        "gen_ai.request.model": record.model_alias or record.model,
        "gen_ai.response.model": record.model,
        "gen_ai.request.max_tokens": record.max_tokens,
        "gen_ai.request.temperature": record.sampling.temperature,
        "gen_ai.request.top_p": record.sampling.top_p,
        "tokenrelay.request_id": record.request_id,
    }
    if record.num_choices > 1:
        attrs["gen_ai.request.choice.count"] = record.num_choices
    if record.sampling.seed is not None:
        attrs["gen_ai.request.seed"] = record.sampling.seed
    if record.stop.stop:
        attrs["gen_ai.request.stop_sequences"] = list(record.stop.stop)
    return attrs


def _usage_attributes(usage: Mapping[str, Any] | None) -> dict[str, Any]:
    if not usage:
        return {}
    attrs: dict[str, Any] = {}
    for key, name in (
        ("prompt_tokens", "gen_ai.usage.input_tokens"),
        ("completion_tokens", "gen_ai.usage.output_tokens"),
    ):
        value = usage.get(key)
        if isinstance(value, int):
            attrs[name] = value
    details = usage.get("prompt_tokens_details")
    if isinstance(details, Mapping) and isinstance(details.get("cached_tokens"), int):
        attrs["gen_ai.usage.cache_read.input_tokens"] = details["cached_tokens"]
    return attrs


# -- web: the request's span ---------------------------------------------------------------


class RequestTrace:
    """A request's span in the web tier, from its arrival to its last byte; the run's
    observer (``broker.run.RunObserver``), passing everything on to ``inner``."""

    def __init__(
        self,
        tracer: Tracer,
        name: str,
        parent: Mapping[str, str] | None,
        attributes: Mapping[str, Any],
        *,
        links: Sequence[Mapping[str, str]] = (),
        kind: str = "SERVER",
    ) -> None:
        from opentelemetry.trace import Link, SpanKind, get_current_span

        self.tracer = tracer
        linked = [get_current_span(_context_of(c)).get_span_context() for c in links]
        self.span = tracer.start_span(
            name,
            context=_context_of(parent),
            kind=SpanKind[kind],
            attributes=dict(attributes),
            links=[Link(c) for c in linked if c.is_valid],
        )
        self.inner: RunObserver | None = None
        self._sent = False
        self._ended = False

    @property
    def carrier(self) -> dict[str, str]:
        """The span's context to store in the record: every other process's parent."""
        return _carrier(self.span)

    @property
    def trace_id(self) -> str:
        return f"{self.span.get_span_context().trace_id:032x}"

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[Span]:
        """A child span around a step of the request's start (parse, admission)."""
        span = self.tracer.start_span(name, context=_under(self.span))
        try:
            yield span
        except Exception as exc:
            span.set_attribute("error.type", type(exc).__name__)
            raise
        finally:
            span.end()

    def describe(self, record: RequestRecord) -> None:
        self.span.set_attributes(request_attributes(record))

    def event(self, name: str, **attributes: Any) -> None:
        self.span.add_event(name, attributes)

    def handed_over(self) -> None:
        """Another process follows the request from here on (a batch driver that lost
        its batch's lock): this span ends; the next one continues the trace."""
        if not self._ended:
            self._ended = True
            self.span.add_event("handed_over")
            self.span.end()

    def rejected(self, exc: BaseException) -> None:
        """The request was refused before it ran (400, 429, 503, ...)."""
        from app.errors import error_body

        status, body = error_body(exc)
        self._finish(status, body["error"]["type"], None)

    # RunObserver
    def text_sent(self) -> None:
        if not self._sent:
            self._sent = True
            self.span.add_event("first_byte")
        if self.inner is not None:
            self.inner.text_sent()

    def ended(self, outcome: RunOutcome) -> None:
        if self.inner is not None:
            self.inner.ended(outcome)
        if outcome.cancelled:
            self.span.add_event("client_gone")
        self._finish(outcome.status, outcome.error_type, outcome.usage)

    def _finish(self, status: int, error_type: str, usage: Mapping[str, Any] | None) -> None:
        from opentelemetry.trace import StatusCode

        if self._ended:
            return
        self._ended = True
        self.span.set_attribute("http.response.status_code", status)
        self.span.set_attributes(_usage_attributes(usage))
        if error_type:
            self.span.set_attribute("error.type", error_type)
        if status >= 500:
            self.span.set_status(StatusCode.ERROR, error_type)
        self.span.add_event("last_byte")
        self.span.end()


def request_trace(
    route: str,
    traceparent: Mapping[str, str] | None,
    *,
    resumed_from: Mapping[str, str] | None = None,
) -> RequestTrace | None:
    """A request's web span (None when tracing is off): ``POST <route>`` (a WebSocket's
    request: its route) under the client's context, or, for a resumed stream
    (``resumed_from``: its record's context), ``resume <route>`` under the request's own
    span, linked to the client's."""
    t = tracer()
    if t is None:
        return None
    if resumed_from:
        return RequestTrace(
            t, f"resume {route}", resumed_from, {"http.route": route, "tokenrelay.resumed": True},
            links=[traceparent] if traceparent else (),
        )  # fmt: skip
    if route not in OPERATIONS:  # a WebSocket's message: no HTTP request of its own
        return RequestTrace(t, route, traceparent, {"network.protocol.name": "websocket"})
    return RequestTrace(
        t, f"POST {route}", traceparent, {"http.request.method": "POST", "http.route": route}
    )


def batch_line_trace(
    route: str,
    batch_id: str,
    index: int,
    custom_id: str,
    *,
    resumed_from: Mapping[str, str] | None = None,
) -> RequestTrace | None:
    """A batch line's span in the batch driver (None when tracing is off): each line is
    a trace of its own (a batch runs for hours; one trace of thousands of lines would
    be unreadable), ``batch <route>`` (kind CONSUMER: the line is taken from the batch
    as a message from a queue) from its submission to its result, or, for a line a
    driver adopted from another (``resumed_from``: its record's context), ``resume
    batch <route>`` under the line's own span."""
    t = tracer()
    if t is None:
        return None
    attributes = {
        "tokenrelay.batch.id": batch_id,
        "tokenrelay.batch.line": index + 1,  # as the batch's error file numbers lines
        "tokenrelay.batch.custom_id": custom_id,
    }
    if resumed_from:
        return RequestTrace(
            t, f"resume batch {route}", resumed_from,
            {**attributes, "tokenrelay.resumed": True}, kind="CONSUMER",
        )  # fmt: skip
    return RequestTrace(t, f"batch {route}", None, attributes, kind="CONSUMER")


def phase(span: RequestTrace | None, name: str) -> contextlib.AbstractContextManager[Any]:
    """A child span of the request's (parse, admission), or nothing when not traced."""
    return span.phase(name) if span is not None else contextlib.nullcontext()


def traced(prepared: PreparedRequest, span: RequestTrace) -> PreparedRequest:
    """``prepared`` with its record carrying ``span``'s context to the other processes."""
    span.describe(prepared.record)
    record = prepared.record.model_copy(update={"trace": span.carrier})
    return dataclasses.replace(prepared, record=record)


# -- worker and streamer: spans made at the end of their part -------------------------------


def generation_spans(
    record: RequestRecord,
    *,
    attempt: int,
    worker_id: str,
    claimed: float,
    ended: float,
    result: GenerateResult,
) -> None:
    """A worker's spans for one attempt of ``record`` (times in unix seconds; ``result``:
    what its task returns): ``queue`` (first attempt only), the generation, and its
    ``prefill`` and ``decode``."""
    t = tracer()
    if t is None or not record.trace:
        return
    parent = _context_of(record.trace)
    if attempt == 0:
        t.start_span("queue", context=parent, start_time=_ns(record.created)).end(_ns(claimed))
    tokens = sum(result.completion_tokens.values())
    finishes = [v for _k, v in sorted(result.finish_reasons.items())]
    attrs = {
        **request_attributes(record),
        "gen_ai.usage.input_tokens": sum(len(p) for p in record.prompts),
        "gen_ai.usage.output_tokens": tokens,
        # The engine's (eos, length, cancelled, error): a stop string is the
        # streamer's, which reports the client's finish reasons.
        "tokenrelay.engine.finish_reasons": finishes,
        "tokenrelay.attempt": attempt,
        "tokenrelay.worker_id": worker_id,
        "tokenrelay.outcome": result.outcome.value,
    }
    op = attrs["gen_ai.operation.name"]
    span = t.start_span(f"{op} {record.model}", context=parent, start_time=_ns(claimed),
                        attributes=attrs)  # fmt: skip
    under = _under(span)
    prefill_s = result.prefill_s
    first = claimed + prefill_s if prefill_s is not None else ended
    t.start_span(
        "prefill", context=under, start_time=_ns(claimed),
        attributes={"gen_ai.usage.input_tokens": attrs["gen_ai.usage.input_tokens"]},
    ).end(_ns(first))  # fmt: skip
    if prefill_s is not None:
        t.start_span(
            "decode", context=under, start_time=_ns(first),
            attributes={"tokenrelay.steps": result.steps or 0,
                        "gen_ai.usage.output_tokens": tokens},
        ).end(_ns(ended))  # fmt: skip
    span.end(_ns(ended))


def relay_span(
    record: RequestRecord,
    *,
    started: float,
    first_token_at: float | None,
    finish_reasons: Sequence[str],
    count: UsageCount,
    took_over: bool,
    consumer: str,
) -> None:
    """A streamer's span for ``record``: from adopting it (``started``, unix seconds) to
    its last output chunk, which ``count`` (what the usage ledger counts) ends."""
    t = tracer()
    if t is None or not record.trace:
        return
    attrs = {
        **request_attributes(record),
        "gen_ai.usage.input_tokens": count.prompt_tokens,
        "gen_ai.usage.output_tokens": count.completion_tokens,
        "gen_ai.usage.cache_read.input_tokens": count.cached_tokens,
        "gen_ai.response.finish_reasons": list(finish_reasons),
        "tokenrelay.streamer": consumer,
        "tokenrelay.took_over": took_over,
    }
    span = t.start_span(
        f"detokenize {record.model}", context=_context_of(record.trace),
        start_time=_ns(started), attributes=attrs,
    )  # fmt: skip
    if first_token_at is not None:
        span.add_event("first_token", timestamp=_ns(first_token_at))
    if count.error:
        from opentelemetry.trace import StatusCode

        span.set_status(StatusCode.ERROR, "request ended with an error")
    span.end(_ns(time.time()))
