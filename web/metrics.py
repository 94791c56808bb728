"""Prometheus metrics of the web tier, served at ``/metrics`` (no API key needed).

Correct under several gunicorn workers: ``tokenrelay web`` sets
``PROMETHEUS_MULTIPROC_DIR`` before prometheus-client is imported, so every worker
writes its samples to memory-mapped files there and ``/metrics`` (answered by any
worker) aggregates all of them with ``MultiProcessCollector``; gauges use
``livesum`` so a dead worker's in-flight count disappears (the gunicorn ``child_exit``
hook calls ``mark_process_dead``). Without the variable (tests, ``flask run``) each app
has its own registry, so several apps in one process never collide.

Latencies are measured here, where the client is: time to first token is from the
request's arrival to the first text leaving for the client, end-to-end to the last
event. Queue time comes from the streamer's ``timings`` (arrival until a worker's
first token). Inter-token latency is observed once per request, as the mean gap
between its tokens ((last - first) / (tokens per choice - 1)).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import redis
from flask import Flask, Response, g, request
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector

from broker.celery_app import worker_queues

if TYPE_CHECKING:
    from web.service import GenerationService

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


class ClusterCollector:
    """Worker-side gauges, read from Redis when ``/metrics`` is scraped.

    Workers heart-beat their batch size, token count and engine gauges into the registry
    (``broker.registry``); Celery's queues are Redis lists. Reading both at scrape time
    lets one scrape of any web process show the whole cluster, with no port to open on
    GPU hosts. A Redis error yields no samples rather than a failed scrape.
    """

    def __init__(self, service: GenerationService) -> None:
        self.service = service

    def describe(self) -> list[Any]:
        return []  # collected lazily: nothing to check at registration

    def collect(self) -> Iterator[Any]:
        svc = self.service
        try:
            workers = svc.workers.live()
            streamers = svc.streamers.live()
            queues = worker_queues(svc.model_name)
            pipe = svc.redis.pipeline(transaction=False)
            for q in queues:
                pipe.llen(q)
            depths = pipe.execute()
        except redis.RedisError:
            return
        labels = ["worker", "model", "engine"]
        batch = GaugeMetricFamily(
            "tokenrelay_worker_batch_size",
            "Choices running in a worker's last step.",
            labels=labels,
        )
        active = GaugeMetricFamily(
            "tokenrelay_worker_active_requests", "Requests a worker is generating.", labels=labels
        )
        capacity = GaugeMetricFamily(
            "tokenrelay_worker_capacity", "Concurrent requests a worker accepts.", labels=labels
        )
        tokens = CounterMetricFamily(
            "tokenrelay_worker_tokens",
            "Token ids a worker produced since it started (rate() gives tokens/s).",
            labels=labels,
        )
        steps = CounterMetricFamily(
            "tokenrelay_worker_steps", "Engine steps a worker ran since it started.", labels=labels
        )
        cache = GaugeMetricFamily(
            "tokenrelay_worker_cache_usage",
            "Fraction of the engine's KV cache in use (engines that report it).",
            labels=labels,
        )
        for w in workers:
            lv = [w.worker_id, w.model, w.engine]
            batch.add_metric(lv, w.batch_size)
            active.add_metric(lv, w.active_jobs)
            capacity.add_metric(lv, w.capacity)
            tokens.add_metric(lv, w.tokens_total)
            steps.add_metric(lv, w.steps_total)
            if "cache_usage" in w.engine_stats:
                cache.add_metric(lv, w.engine_stats["cache_usage"])
        depth = GaugeMetricFamily(
            "tokenrelay_queue_depth",
            "Generation tasks waiting in a Celery queue.",
            labels=["queue"],
        )
        for q, n in zip(queues, depths, strict=True):
            depth.add_metric([q], float(n))
        live = GaugeMetricFamily("tokenrelay_streamers_live", "Streamer processes heart-beating.")
        live.add_metric([], len(streamers))
        yield from (batch, active, capacity, tokens, steps, cache, depth, live)


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
            "HTTP requests answered, by endpoint, status and error type ('' when none).",
            ["endpoint", "status", "error_type"],
            registry=r,
        )
        self.stream_errors = Counter(
            "tokenrelay_stream_errors",
            "Errors sent as SSE events after a stream had started, by endpoint and type.",
            ["endpoint", "error_type"],
            registry=r,
        )
        self.in_flight = Gauge(
            "tokenrelay_requests_in_flight",
            "Generation requests being answered right now, by endpoint.",
            ["endpoint"],
            registry=r,
            multiprocess_mode="livesum",
        )
        self.disconnects = Counter(
            "tokenrelay_client_disconnects",
            "Clients that went away before their response ended (the request is cancelled).",
            ["endpoint"],
            registry=r,
        )
        self.ttft = Histogram(
            "tokenrelay_time_to_first_token_seconds",
            "From the request's arrival to its first text sent to the client.",
            ["endpoint"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "tokenrelay_inter_token_latency_seconds",
            "Mean time between tokens of a request (one sample per request).",
            ["endpoint"],
            buckets=_ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "tokenrelay_e2e_request_latency_seconds",
            "From the request's arrival to its last event.",
            ["endpoint"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.queue = Histogram(
            "tokenrelay_queue_time_seconds",
            "From the request's arrival until a worker published its first token.",
            ["endpoint"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "tokenrelay_prompt_tokens",
            "Prompt tokens of finished requests.",
            ["endpoint"],
            registry=r,
        )
        self.completion_tokens = Counter(
            "tokenrelay_completion_tokens",
            "Completion tokens delivered to clients.",
            ["endpoint"],
            registry=r,
        )

    def render(self) -> bytes:
        """The exposition text: all gunicorn workers' samples in multiprocess mode."""
        if multiprocess_dir():
            registry = CollectorRegistry()
            MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
            if self.cluster is not None:
                registry.register(self.cluster)
            return generate_latest(registry)
        return generate_latest(self.registry)


class RequestTimer:
    """Timestamps of one generation request, turned into observations at its end."""

    def __init__(
        self,
        metrics: WebMetrics,
        endpoint: str,
        num_choices: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.metrics = metrics
        self.endpoint = endpoint
        self.num_choices = max(num_choices, 1)
        self.clock = clock
        self.started = clock()
        self.first_text: float | None = None
        self.last_text: float | None = None
        self._open = False

    def begin(self) -> None:
        self.metrics.in_flight.labels(self.endpoint).inc()
        self._open = True

    def text_sent(self) -> None:
        now = self.clock()
        if self.first_text is None:
            self.first_text = now
            self.metrics.ttft.labels(self.endpoint).observe(now - self.started)
        self.last_text = now

    def end(self, usage: dict[str, Any] | None, *, disconnected: bool = False) -> None:
        """Record the request's end once (idempotent)."""
        if not self._open:
            return
        self._open = False
        m, ep = self.metrics, self.endpoint
        m.in_flight.labels(ep).dec()
        if disconnected:
            m.disconnects.labels(ep).inc()
        if usage is None:
            return
        m.e2e.labels(ep).observe(self.clock() - self.started)
        prompt = int(usage.get("prompt_tokens") or 0)
        completion = int(usage.get("completion_tokens") or 0)
        m.prompt_tokens.labels(ep).inc(prompt)
        m.completion_tokens.labels(ep).inc(completion)
        timings = usage.get("timings") or {}
        queue_s = timings.get("queue_s")
        if isinstance(queue_s, int | float):
            m.queue.labels(ep).observe(max(float(queue_s), 0.0))
        per_choice = completion / self.num_choices
        if self.first_text is not None and self.last_text is not None and per_choice > 1:
            m.itl.labels(ep).observe((self.last_text - self.first_text) / (per_choice - 1))


def metrics_of(app: Flask) -> WebMetrics:
    m: WebMetrics = app.extensions["tokenrelay.metrics"]
    return m


def register(app: Flask) -> None:
    """Create the app's metrics, count every response, and serve ``/metrics``."""
    service = app.extensions.get("tokenrelay.service")
    metrics = WebMetrics(ClusterCollector(service) if service is not None else None)
    app.extensions["tokenrelay.metrics"] = metrics

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
