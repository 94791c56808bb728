"""Tracing off costs nothing of ours (issue 45): without ``OTEL_EXPORTER_OTLP_*`` no
module of tokenrelay's imports OpenTelemetry's tracing SDK, its propagators or an
exporter, and every span call returns at its first check; and ``app.tracecontext``
reads W3C ``traceparent`` headers as the specification says, without OpenTelemetry.

(redis-py imports OpenTelemetry's *metrics* SDK by itself whenever it is installed, for
its own opt-in metrics: a start-up cost of every process that has redis-py beside the
SDK, and none per command while its metrics are not enabled; docs/operations.md.)
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from app.tracecontext import TraceParent, parse_traceparent, trace_id_of

REPO = Path(__file__).resolve().parent.parent
TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = "00f067aa0ba902b7"


@pytest.mark.integration
def test_with_tracing_off_no_tracing_code_is_imported_and_spans_are_skipped() -> None:
    script = textwrap.dedent(
        f"""
        import sys, time
        import web.app, web.__main__, workers.runtime, workers.streamer, workers.batcher
        import workers.celery_worker
        from broker import tracing
        from app.records import RequestRecord, SamplingParams, StopConditions
        from app.usage import UsageCount
        from broker.celery_app import GenerateResult, TaskOutcome

        carrier = {{"traceparent": "00-{TRACE}-{PARENT}-01"}}
        tracing.start("worker")  # what every process does as it starts
        assert not tracing.enabled() and tracing.tracer() is None
        assert tracing.request_trace("/v1/chat/completions", carrier) is None
        now = time.time()
        record = RequestRecord(
            request_id="r", model="m", prompts=[[1, 2]], stop=StopConditions(max_tokens=4),
            created=now, deadline=now + 60, trace=carrier,
        )
        result = GenerateResult(request_id="r", attempt=0, outcome=TaskOutcome.DONE)
        tracing.generation_spans(
            record, attempt=0, worker_id="w", claimed=now, ended=now, result=result
        )
        count = UsageCount.of(record, {{"prompt_tokens": 2}}, error=False, at=now)
        tracing.relay_span(record, started=now, first_token_at=None, finish_reasons=[],
                           count=count, took_over=False, consumer="s")
        loaded = sorted(
            m for m in sys.modules
            if m.startswith(("opentelemetry.sdk.trace", "opentelemetry.exporter",
                             "opentelemetry.trace.propagation.tracecontext",
                             "opentelemetry.propagate"))
        )
        print(loaded)
        """
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env["PYTHONPATH"] = str(REPO)
    out = subprocess.run(
        [sys.executable, "-c", script], env=env, cwd=REPO, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@pytest.mark.unit
@pytest.mark.parametrize(
    ("env", "on"),
    [
        ({}, False),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}, True),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/v1/traces"}, True),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_SDK_DISABLED": "true"}, False),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_TRACES_EXPORTER": "none"}, False),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "  "}, False),
    ],
)
def test_tracing_is_on_only_with_an_otlp_endpoint(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], on: bool
) -> None:
    from broker import tracing

    for var in (*tracing.ENDPOINT_VARS, "OTEL_SDK_DISABLED", "OTEL_TRACES_EXPORTER"):
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    assert tracing.enabled() is on


@pytest.mark.unit
@pytest.mark.parametrize(("delay", "millis"), [(None, 15_000.0), ("100", 100.0)])
def test_spans_are_exported_every_15_s_unless_the_batch_delay_is_set(
    monkeypatch: pytest.MonkeyPatch, delay: str | None, millis: float
) -> None:
    """tokenrelay's own default delay between exports (each costs 1-2 ms of CPU
    however few spans it carries); ``OTEL_BSP_SCHEDULE_DELAY`` means what the SDK says."""
    from broker import tracing

    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")  # never sent to
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_PROTOCOL", raising=False)
    monkeypatch.delenv("OTEL_BSP_SCHEDULE_DELAY", raising=False)
    if delay is not None:
        monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", delay)
    processor = tracing._span_processor()
    try:
        assert processor._batch_processor._schedule_delay_millis == millis
    finally:
        processor.shutdown()  # nothing queued: nothing is sent


@pytest.mark.unit
@pytest.mark.parametrize(
    ("header", "parsed"),
    [
        (f"00-{TRACE}-{PARENT}-01", TraceParent(TRACE, PARENT, 1)),
        (f"00-{TRACE}-{PARENT}-00", TraceParent(TRACE, PARENT, 0)),
        (f" 00-{TRACE}-{PARENT}-01 ", TraceParent(TRACE, PARENT, 1)),
        # A later version may add fields; version 00 may not.
        (f"01-{TRACE}-{PARENT}-01-extra", TraceParent(TRACE, PARENT, 1)),
        (f"00-{TRACE}-{PARENT}-01-extra", None),
        (f"ff-{TRACE}-{PARENT}-01", None),
        (f"00-{'0' * 32}-{PARENT}-01", None),
        (f"00-{TRACE}-{'0' * 16}-01", None),
        (f"00-{TRACE.upper()}-{PARENT}-01", None),  # lowercase hex only
        (f"00-{TRACE[:-1]}-{PARENT}-01", None),
        ("", None),
        (None, None),
        ("garbage", None),
    ],
)
def test_traceparent_is_read_as_w3c_trace_context_says(
    header: str | None, parsed: TraceParent | None
) -> None:
    assert parse_traceparent(header) == parsed
    if parsed is not None:
        assert parsed.sampled is bool(parsed.flags & 1)
        assert parse_traceparent(parsed.header()) == parsed


@pytest.mark.unit
def test_the_trace_id_of_a_carrier() -> None:
    assert trace_id_of({"traceparent": f"00-{TRACE}-{PARENT}-01"}) == TRACE
    assert trace_id_of({"traceparent": "bad"}) == ""
    assert trace_id_of({}) == trace_id_of(None) == ""
