"""Prometheus metrics of the web tier, served at ``/metrics`` (no API key needed).

Correct under several gunicorn workers: ``tokenrelay web`` sets
``PROMETHEUS_MULTIPROC_DIR`` before prometheus-client is imported, so every worker
writes its samples to memory-mapped files there and ``/metrics`` (answered by any
worker) aggregates all of them with ``MultiProcessCollector``; gauges use
``livesum`` so a dead worker's in-flight count disappears (the gunicorn ``child_exit``
hook calls ``mark_process_dead``). Without the variable (tests, ``flask run``) each app
has its own registry, so several apps in one process never collide.

Generation requests are recorded in one place: ``broker.run`` reports each rejection
(``rejected``) and each run's outcome through ``RunTimer`` (a ``RunObserver``), for
SSE, JSON and WebSocket alike, with the seed's labels: ``model``, ``endpoint`` and
``mode`` (``stream`` or ``unary``). Latencies are measured here, where the client is:
time to first token is from the request's arrival to the first text leaving for the
client, end-to-end to the last event, inter-token latency once per text delta after
the first (the gap since the previous one). Queue time (arrival to a worker claiming the
request) comes from the streamer's ``timings``.

The cluster's families, read from Redis at scrape time, are ``web.cluster_metrics``'s.
docs/operations.md's table of every metric is generated from both
(``tokenrelay metrics docs``, ``web.metrics_docs``): a metric's help is its meaning there.
"""

from __future__ import annotations

import os
import time
from bisect import bisect_left
from collections.abc import Callable
from typing import Any

from flask import Flask, Response, g, request
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.multiprocess import MultiProcessCollector

from app.errors import error_body
from app.intake import PreparedRequest
from broker.run import RunOutcome
from web.cluster_metrics import ClusterCollector

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"

_LATENCY_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0,
    160.0, 320.0, 640.0,
)  # fmt: skip
_ITL_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
    1.0, 2.5,
)  # fmt: skip


def multiprocess_dir() -> str | None:
    return os.environ.get(MULTIPROC_ENV) or os.environ.get(MULTIPROC_ENV.lower())


class WebMetrics:
    """The web tier's metrics, registered in a registry of their own."""

    def __init__(self, cluster: ClusterCollector | None = None) -> None:
        self.cluster = cluster
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        if cluster is not None:
            r.register(cluster)
        self.requests = Counter(
            "tokenrelay_requests",
            "HTTP responses (all but /metrics's), by endpoint, status and error type "
            "('' when none).",
            ["endpoint", "status", "error_type"],
            registry=r,
        )
        gen = ["model", "endpoint", "mode"]
        self.generations = Counter(
            "tokenrelay_generations",
            "Generation requests by outcome: status (499: the client went away) and error "
            "type, for SSE, JSON and WebSocket alike, rejected ones included.",
            [*gen, "status", "error_type"],
            registry=r,
        )
        self.rejected = Counter(
            "tokenrelay_requests_rejected",
            "Generation requests refused before they ran, by reason (the error type).",
            [*gen, "reason"],
            registry=r,
        )
        self.cancelled = Counter(
            "tokenrelay_requests_cancelled",
            "Generation requests whose client went away or cancelled before the end.",
            gen,
            registry=r,
        )
        self.stream_errors = Counter(
            "tokenrelay_stream_errors",
            "Errors sent as stream events after a stream had started, by endpoint and type.",
            ["model", "endpoint", "error_type"],
            registry=r,
        )
        self.in_flight = Gauge(
            "tokenrelay_requests_in_flight",
            "Generation requests being answered right now (summed over live gunicorn workers).",
            gen,
            registry=r,
            multiprocess_mode="livesum",
        )
        self.disconnects = Counter(
            "tokenrelay_client_disconnects",
            "Clients that went away before their response ended (the request is cancelled).",
            ["model", "endpoint"],
            registry=r,
        )
        self.ttft = Histogram(
            "tokenrelay_time_to_first_token_seconds",
            "From the request's arrival to its first text sent to the client.",
            gen,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "tokenrelay_inter_token_latency_seconds",
            "Gap between consecutive text deltas sent to a client: one sample per delta after "
            "the first (tallied per stream, added at most 1 s late).",
            gen,
            buckets=_ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "tokenrelay_e2e_request_latency_seconds",
            "From the request's arrival to its last event, for requests that ran to their end.",
            gen,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.queue = Histogram(
            "tokenrelay_queue_time_seconds",
            "From the request's arrival until a worker claimed it (the streamer's "
            "timings.queue_s), for requests that ran to their end.",
            gen,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "tokenrelay_prompt_tokens",
            "Prompt tokens of finished requests.",
            gen,
            registry=r,
        )
        self.completion_tokens = Counter(
            "tokenrelay_completion_tokens",
            "Completion tokens delivered to clients.",
            gen,
            registry=r,
        )
        self.prefix_routes = Counter(
            "tokenrelay_prefix_routes",
            "Where interactive requests were sent (broker.prefix_routes): 'routed' to the "
            "worker holding the most of the prompt; to the shared queue on a 'tie', "
            "'no_match', when that worker was 'full', 'not_routed' (fewer than two "
            "workers to choose from, a batch line) or on an 'error'.",
            ["model", "outcome"],
            registry=r,
        )

    # -- broker.runner.RunMetrics ---------------------------------------------------------
    def rejected_request(self, model: str, endpoint: str, stream: bool, exc: BaseException) -> None:
        status, body = error_body(exc)
        error_type = body["error"]["type"]
        mode = "stream" if stream else "unary"
        self.rejected.labels(model, endpoint, mode, error_type).inc()
        self.generations.labels(model, endpoint, mode, str(status), error_type).inc()

    def render(self) -> bytes:
        """The exposition text: all gunicorn workers' samples in multiprocess mode."""
        if multiprocess_dir():
            registry = CollectorRegistry()
            MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
            if self.cluster is not None:
                registry.register(self.cluster)
            return generate_latest(registry)
        return generate_latest(self.registry)


class RunMetrics:
    """``broker.runner.RunMetrics``: rejections (labelled with the default model: a
    refused request's model may be any string a client sent) and run observers
    (labelled with the served model that ran it)."""

    def __init__(self, metrics: WebMetrics, model: str) -> None:
        self.metrics = metrics
        self.model = model

    def rejected(self, endpoint: str, stream: bool, exc: BaseException) -> None:
        self.metrics.rejected_request(self.model, endpoint, stream, exc)

    def observer(self, prepared: PreparedRequest, endpoint: str) -> RunTimer:
        model = prepared.record.model
        return RunTimer(self.metrics, (model, endpoint, _mode(prepared, endpoint)))


def _mode(prepared: PreparedRequest, endpoint: str) -> str:
    return "stream" if prepared.stream or endpoint == "/v1/ws" else "unary"


#: A run's inter-token latencies reach the shared histogram at least this often.
TALLY_FLUSH_S = 1.0


class HistogramTally:
    """Observations of one histogram child, counted here and added in bulk.

    Why: the inter-token latency histogram takes one observation per token per stream,
    and in multiprocess mode each ``observe`` is two writes to a memory-mapped file,
    each under a lock with a pid check: a fifth of the web tier's CPU per token
    (docs/benchmarks.md). Counting in a list and adding each bucket's count at once
    gives the same histogram for one write per bucket touched per flush.
    """

    def __init__(self, child: Histogram) -> None:
        self.child = child
        # prometheus-client's own parts (stable since 0.4); without them, observe each.
        bounds = getattr(child, "_upper_bounds", None)
        buckets = getattr(child, "_buckets", None)
        total = getattr(child, "_sum", None)
        self._bulk = bounds is not None and buckets is not None and total is not None
        self._bounds: list[float] = list(bounds) if bounds is not None and self._bulk else []
        self._counts = [0] * len(self._bounds)
        self._sum = 0.0
        self._pending = 0
        self._direct: list[float] = []

    def observe(self, amount: float) -> None:
        if not self._bulk:
            self._direct.append(amount)
        else:
            # observe() counts an amount in the first bucket whose bound is >= it.
            self._counts[min(bisect_left(self._bounds, amount), len(self._counts) - 1)] += 1
            self._sum += amount
        self._pending += 1

    def flush(self) -> None:
        """Add what was counted since the last flush to the shared histogram."""
        if not self._pending:
            return
        self._pending = 0
        if not self._bulk:
            for amount in self._direct:
                self.child.observe(amount)
            self._direct.clear()
            return
        child: Any = self.child
        child._sum.inc(self._sum)
        self._sum = 0.0
        for i, n in enumerate(self._counts):
            if n:
                child._buckets[i].inc(n)
                self._counts[i] = 0


class RunTimer:
    """Timestamps of one run, turned into observations as it goes and at its end.

    Inter-token latencies are tallied per run and flushed every ``TALLY_FLUSH_S`` and
    at the end (``HistogramTally``): a scrape sees them at most that late."""

    def __init__(
        self,
        metrics: WebMetrics,
        labels: tuple[str, str, str],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.metrics = metrics
        self.labels = labels
        self.clock = clock
        self.started = clock()
        self.last_text: float | None = None
        self._open = True
        self._itl: HistogramTally | None = None
        self._flushed_at = 0.0
        metrics.in_flight.labels(*labels).inc()

    def text_sent(self) -> None:
        now = self.clock()
        if self.last_text is None:
            self.metrics.ttft.labels(*self.labels).observe(now - self.started)
            self._itl = HistogramTally(self.metrics.itl.labels(*self.labels))
            self._flushed_at = now
        else:
            itl = self._itl
            assert itl is not None
            itl.observe(now - self.last_text)
            if now - self._flushed_at >= TALLY_FLUSH_S:
                itl.flush()
                self._flushed_at = now
        self.last_text = now

    def ended(self, outcome: RunOutcome) -> None:
        """Record the run's end once (idempotent)."""
        if not self._open:
            return
        self._open = False
        if self._itl is not None:
            self._itl.flush()
        m, lv = self.metrics, self.labels
        m.in_flight.labels(*lv).dec()
        m.generations.labels(*lv, str(outcome.status), outcome.error_type).inc()
        if outcome.cancelled:
            m.cancelled.labels(*lv).inc()
            m.disconnects.labels(lv[0], lv[1]).inc()
        if outcome.status != 200 and not outcome.cancelled and self.last_text is not None:
            m.stream_errors.labels(lv[0], lv[1], outcome.error_type).inc()
        usage = outcome.usage
        if usage is None:
            return
        m.e2e.labels(*lv).observe(self.clock() - self.started)
        m.prompt_tokens.labels(*lv).inc(int(usage.get("prompt_tokens") or 0))
        m.completion_tokens.labels(*lv).inc(int(usage.get("completion_tokens") or 0))
        timings = usage.get("timings") or {}
        queue_s = timings.get("queue_s")
        if isinstance(queue_s, int | float):
            m.queue.labels(*lv).observe(max(float(queue_s), 0.0))


def metrics_of(app: Flask) -> WebMetrics:
    m: WebMetrics = app.extensions["tokenrelay.metrics"]
    return m


def register(app: Flask) -> None:
    """Create the app's metrics, count every response, and serve ``/metrics``."""
    runner = app.extensions.get("tokenrelay.runner")
    metrics = WebMetrics(ClusterCollector(runner) if runner is not None else None)
    app.extensions["tokenrelay.metrics"] = metrics
    if runner is not None:
        runner.metrics = RunMetrics(metrics, runner.model_name)
        routes = metrics.prefix_routes
        runner.route_observer = lambda model, outcome: routes.labels(model, outcome).inc()

    @app.after_request
    def _count(response: Response) -> Response:
        rule = request.url_rule
        endpoint = rule.rule if rule is not None else "unmatched"
        if endpoint != "/metrics":
            error_type = getattr(g, "error_type", "") or ""
            metrics.requests.labels(endpoint, str(response.status_code), error_type).inc()
        return response

    @app.get("/metrics")
    def _metrics() -> Response:
        return Response(metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})
