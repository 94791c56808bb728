"""A real OTLP/HTTP trace receiver for tests and benchmarks: what a collector is to the
processes that export to it.

It listens on a free loopback port, accepts ``POST /v1/traces`` (protobuf, plain or
gzip) as the OpenTelemetry SDK's OTLP/HTTP exporter sends it, decodes each
``ExportTraceServiceRequest`` with ``opentelemetry-proto`` and keeps every span with its
resource's attributes, so a test can ask which process made which span under which
parent. Point processes at it with ``OTEL_EXPORTER_OTLP_ENDPOINT=<receiver.url>``.
"""

from __future__ import annotations

import gzip
import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import requests
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

from app.settings import Settings
from tests.stack import Stack, full_stack, isolated_settings


def _value(v: AnyValue) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in v.kvlist_value.values}
    return None if kind is None else getattr(v, kind)


def _attributes(kvs: Any) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in kvs}


@dataclass(frozen=True)
class ReceivedSpan:
    """One span as it arrived: ids in lowercase hex, times in unix nanoseconds."""

    trace_id: str
    span_id: str
    parent_id: str  # "" for a root span
    name: str
    kind: int  # opentelemetry.proto.trace.v1.Span.SpanKind (2: SERVER)
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    events: list[tuple[str, dict[str, Any]]]
    links: list[tuple[str, str]]  # (trace id, span id)
    status: int  # Status.StatusCode (2: ERROR)
    resource: dict[str, Any] = field(default_factory=dict)

    @property
    def process(self) -> str:
        """Which tokenrelay process made it (its resource's ``tokenrelay.process``)."""
        return str(self.resource.get("tokenrelay.process", ""))

    @property
    def pid(self) -> int:
        return int(self.resource.get("process.pid", 0))

    def event_names(self) -> list[str]:
        return [name for name, _ in self.events]


class OtlpReceiver:
    """A collector on a free loopback port; ``spans()`` is everything received so far."""

    def __init__(self) -> None:
        self._spans: list[ReceivedSpan] = []
        self._lock = threading.Lock()
        self.requests = 0
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                if self.path != "/v1/traces":
                    self.send_error(404)
                    return
                message = ExportTraceServiceRequest()
                message.ParseFromString(body)
                receiver._add(message)
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, format: str, *args: Any) -> None:  # quiet
                return

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def _add(self, message: ExportTraceServiceRequest) -> None:
        got = []
        for rs in message.resource_spans:
            resource = _attributes(rs.resource.attributes)
            for ss in rs.scope_spans:
                for s in ss.spans:
                    got.append(
                        ReceivedSpan(
                            trace_id=s.trace_id.hex(),
                            span_id=s.span_id.hex(),
                            parent_id=s.parent_span_id.hex(),
                            name=s.name,
                            kind=s.kind,
                            start_ns=s.start_time_unix_nano,
                            end_ns=s.end_time_unix_nano,
                            attributes=_attributes(s.attributes),
                            events=[(e.name, _attributes(e.attributes)) for e in s.events],
                            links=[(lk.trace_id.hex(), lk.span_id.hex()) for lk in s.links],
                            status=s.status.code,
                            resource=resource,
                        )
                    )
        with self._lock:
            self._spans.extend(got)
            self.requests += 1

    def spans(self, trace_id: str | None = None) -> list[ReceivedSpan]:
        with self._lock:
            return [s for s in self._spans if trace_id is None or s.trace_id == trace_id]

    def wait_for(
        self, cond: Callable[[list[ReceivedSpan]], bool], timeout: float, trace_id: str
    ) -> list[ReceivedSpan]:
        """The trace's spans once ``cond`` holds for them (AssertionError after
        ``timeout`` s, with what arrived)."""
        deadline = time.monotonic() + timeout
        while True:
            spans = self.spans(trace_id)
            if cond(spans):
                return spans
            if time.monotonic() > deadline:
                got = sorted((s.process, s.name) for s in spans)
                raise AssertionError(f"trace {trace_id} incomplete after {timeout} s: {got}")
            time.sleep(0.05)

    def start(self) -> OtlpReceiver:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(5)


@contextmanager
def otlp_receiver() -> Iterator[OtlpReceiver]:
    receiver = OtlpReceiver().start()
    try:
        yield receiver
    finally:
        receiver.stop()


# -- a traced stack and its clients (tests/e2e/test_tracing.py, tests/faults/) -------------

WAIT_S = 30.0
TEXT = "one trace from the client to the worker and back, " * 3
SERVER = 2  # Span.SpanKind.SPAN_KIND_SERVER
CONSUMER = 5  # Span.SpanKind.SPAN_KIND_CONSUMER


@contextmanager
def traced_stack(
    receiver: OtlpReceiver, models_dir: Path, log_dir: Path, export_delay_ms: int = 100
) -> Iterator[Stack]:
    """A stack (worker, streamer, batch driver, web "web-b") whose processes export
    their spans to ``receiver`` every ``export_delay_ms`` (``OTEL_BSP_SCHEDULE_DELAY``:
    by default soon, so a test need not wait); echo at 40 tokens/s, so a reply takes
    seconds (a fault can hit it)."""
    settings = isolated_settings(
        "redis://unused",
        models_dir,
        echo_tokens_per_second=40.0,
        resume_grace_s=30.0,
        sse_keepalive_s=0.5,
        batch_lock_ttl_s=2.0,  # a killed batch driver's batches are taken over soon
    )
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.url)
        mp.setenv("OTEL_BSP_SCHEDULE_DELAY", str(export_delay_ms))
        with full_stack(settings, log_dir, web="web-b", batcher=True) as running:
            yield running


def traceparent() -> tuple[str, str, str]:
    """(header, trace id, parent span id): a client's own trace context."""
    trace_id, parent = os.urandom(16).hex(), os.urandom(8).hex()
    return f"00-{trace_id}-{parent}-01", trace_id, parent


def chat_body(settings: Settings, **extra: Any) -> dict[str, Any]:
    """A streamed chat request (usage included) that the echo engine answers with TEXT."""
    return {
        "model": settings.served_name,
        "messages": [{"role": "user", "content": TEXT}],
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": 200,
        **extra,
    }


def read_stream(resp: requests.Response, *, stop_after: int | None = None) -> dict[str, Any]:
    """The text, usage, last event id and whether [DONE] came; ``stop_after``: return
    after that many content events (the stream left open)."""
    got: dict[str, Any] = {"text": "", "usage": None, "last_id": None, "done": False, "n": 0}
    event_id = None
    for raw in resp.iter_lines(decode_unicode=True):
        if raw.startswith("id:"):
            event_id = raw[3:].strip()
        if not raw.startswith("data:"):
            continue
        data = raw[5:].strip()
        if data == "[DONE]":
            got["done"] = True
            break
        chunk = json.loads(data)
        got["last_id"] = event_id or got["last_id"]
        if chunk.get("usage"):
            got["usage"] = chunk["usage"]
        for c in chunk.get("choices", []):
            if c["delta"].get("content"):
                got["text"] += c["delta"]["content"]
                got["n"] += 1
        if stop_after is not None and got["n"] >= stop_after:
            break
    return got


def one(spans: list[ReceivedSpan], name: str) -> ReceivedSpan:
    """The only span named ``name``."""
    found = [s for s in spans if s.name == name]
    assert len(found) == 1, (name, sorted(s.name for s in spans))
    return found[0]


def has(*names: str) -> Callable[[list[ReceivedSpan]], bool]:
    """A condition for ``OtlpReceiver.wait_for``: every one of ``names`` arrived."""
    return lambda spans: set(names) <= {s.name for s in spans}
