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
client, end-to-end to the last event, inter-token latency once per text delta (the gap
since the previous one). Queue time comes from the streamer's ``timings``.
"""

from __future__ import annotations

import os
import time
from bisect import bisect_left
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

from app.errors import error_body
from app.intake import PreparedRequest
from broker.celery_app import queue_depths
from broker.run import RunOutcome
from web.usage_metrics import usage_families

if TYPE_CHECKING:
    from broker.registry import WorkerInfo
    from broker.runner import Runner

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

    def __init__(self, service: Runner) -> None:
        self.service = service

    def describe(self) -> list[Any]:
        return []  # collected lazily: nothing to check at registration

    def collect(self) -> Iterator[Any]:
        svc = self.service
        try:
            workers = svc.workers.live()
            streamers = svc.streamers.live()
            depths = {
                (model, queue): depth
                for model in svc.models.known()
                for queue, depth in queue_depths(svc.redis, model).items()
            }
        except redis.RedisError:
            return
        for kind, name, doc, extra, sample in WORKER_FAMILIES:
            family = kind(name, doc, labels=[*WORKER_LABELS, *extra])
            for w in workers:
                value = sample(w)
                if value is not None:
                    labels = [w.worker_id, w.model, w.engine, *(getattr(w, a) for a in extra)]
                    family.add_metric(labels, float(value))
            yield family
        depth = GaugeMetricFamily(
            "tokenrelay_queue_depth",
            "Generation tasks waiting in a Celery queue.",
            labels=["model", "queue"],
        )
        for (model, q), n in depths.items():
            depth.add_metric([model, q], float(n))
        live = GaugeMetricFamily("tokenrelay_streamers_live", "Streamer processes heart-beating.")
        live.add_metric([], len(streamers))
        yield from (depth, live)
        yield from model_gauges(svc.models.known(), workers, depths)
        yield from usage_families(svc.redis, svc.keys)  # the usage ledger's counters


def model_gauges(
    models: list[str], workers: list[WorkerInfo], depths: dict[tuple[str, str], int]
) -> Iterator[Any]:
    """Per model, what autoscalers and dashboards read (issue 43): requests waiting
    (in its queues, and accepted by a worker's engine but not running yet), running,
    live workers and KV cache use; then the same under the names vLLM's dashboards and
    autoscaling recipes use (``vllm:num_requests_waiting``, ``..._running``,
    ``vllm:kv_cache_usage_perc``: a fraction, as vLLM's is), labelled ``model_name``."""
    waiting = GaugeMetricFamily(
        "tokenrelay_model_requests_waiting",
        "Requests of a model not running yet: queued, or held by a worker's engine.",
        labels=["model"],
    )
    running = GaugeMetricFamily(
        "tokenrelay_model_requests_running",
        "Requests a model's workers generate.",
        labels=["model"],
    )
    live = GaugeMetricFamily(
        "tokenrelay_model_workers", "Live workers of a model.", labels=["model"]
    )
    usage = GaugeMetricFamily(
        "tokenrelay_model_kv_cache_usage",
        "Mean fraction of the KV cache in use over a model's live workers.",
        labels=["model"],
    )
    aliases = [
        GaugeMetricFamily("vllm:num_requests_waiting", "As tokenrelay_model_requests_waiting.",
                          labels=["model_name"]),
        GaugeMetricFamily("vllm:num_requests_running", "As tokenrelay_model_requests_running.",
                          labels=["model_name"]),
        GaugeMetricFamily("vllm:kv_cache_usage_perc", "As tokenrelay_model_kv_cache_usage.",
                          labels=["model_name"]),
    ]  # fmt: skip
    for model in models:
        mine = [w for w in workers if w.model == model]
        held = sum(w.engine_stats.get("engine_waiting", 0.0) for w in mine)
        queued = sum(n for (m, _q), n in depths.items() if m == model)
        values = (
            float(queued + held),
            float(sum(w.active_jobs for w in mine) - held),
        )
        caches = [w.engine_stats["cache_usage"] for w in mine if "cache_usage" in w.engine_stats]
        waiting.add_metric([model], values[0])
        running.add_metric([model], max(values[1], 0.0))
        live.add_metric([model], float(len(mine)))
        aliases[0].add_metric([model], values[0])
        aliases[1].add_metric([model], max(values[1], 0.0))
        if caches:
            mean = sum(caches) / len(caches)
            usage.add_metric([model], mean)
            aliases[2].add_metric([model], mean)
    yield from (waiting, running, live, usage, *aliases)


WORKER_LABELS = ("worker", "model", "engine")
_Family = type[GaugeMetricFamily] | type[CounterMetricFamily]
# Each worker family: its kind, name, help, labels beyond WORKER_LABELS (attributes of
# the worker) and its sample from one worker's heartbeat (None: that worker has none).
WORKER_FAMILIES: tuple[
    tuple[_Family, str, str, tuple[str, ...], Callable[[WorkerInfo], float | None]], ...
] = (
    (
        GaugeMetricFamily,
        "tokenrelay_worker_batch_size",
        "Choices running in a worker's last step.",
        (),
        lambda w: w.batch_size,
    ),
    (
        GaugeMetricFamily,
        "tokenrelay_worker_active_requests",
        "Requests a worker is generating.",
        (),
        lambda w: w.active_jobs,
    ),
    (
        GaugeMetricFamily,
        "tokenrelay_worker_capacity",
        "Concurrent requests a worker accepts.",
        (),
        lambda w: w.capacity,
    ),
    (
        GaugeMetricFamily,
        "tokenrelay_worker_engine_capacity",
        "Sequences a worker's engine runs at once, by its mode: an unpaged exllamav2 "
        "worker runs 1 whatever its slots.",
        ("mode",),
        # A worker from before modes were reported has none.
        lambda w: w.engine_capacity if w.mode else None,
    ),
    (
        GaugeMetricFamily,
        "tokenrelay_worker_paged",
        "1 when an exllamav2 worker runs paged attention (continuous batching), 0 when "
        "it runs unpaged (one sequence at a time).",
        (),
        lambda w: {"paged": 1.0, "unpaged": 0.0}.get(w.mode),
    ),
    (
        CounterMetricFamily,
        "tokenrelay_worker_tokens",
        "Token ids a worker produced since it started (rate() gives tokens/s).",
        (),
        lambda w: w.tokens_total,
    ),
    (
        CounterMetricFamily,
        "tokenrelay_worker_steps",
        "Engine steps a worker ran since it started.",
        (),
        lambda w: w.steps_total,
    ),
    (
        GaugeMetricFamily,
        "tokenrelay_worker_cache_usage",
        "Fraction of the engine's KV cache in use (engines that report it).",
        (),
        lambda w: w.engine_stats.get("cache_usage"),
    ),
    (
        GaugeMetricFamily,
        "tokenrelay_worker_engine_waiting",
        "Jobs waiting inside a worker's engine for cache pages or a batch slot "
        "(exllamav2): work it accepted but cannot run yet.",
        (),
        lambda w: w.engine_stats.get("engine_waiting"),
    ),
    (
        GaugeMetricFamily,
        "tokenrelay_worker_pending_continuations",
        "Live streams paused inside a worker's engine, their next segment waiting for "
        "cache pages (exllamav2).",
        (),
        lambda w: w.engine_stats.get("pending_continuations"),
    ),
    # The prefix cache (engines that have one): hits / queries is the hit rate.
    (
        CounterMetricFamily,
        "tokenrelay_worker_prefix_cache_queries",
        "Prompt tokens looked up in a worker's prefix cache since it started.",
        (),
        lambda w: w.engine_stats.get("prefix_cache_queries"),
    ),
    (
        CounterMetricFamily,
        "tokenrelay_worker_prefix_cache_hits",
        "Prompt tokens found in a worker's prefix cache (not computed again).",
        (),
        lambda w: w.engine_stats.get("prefix_cache_hits"),
    ),
    (
        CounterMetricFamily,
        "tokenrelay_worker_prefix_cache_evicted",
        "KV cells a worker's prefix cache evicted to make room.",
        (),
        lambda w: w.engine_stats.get("prefix_cache_evicted"),
    ),
    (
        GaugeMetricFamily,
        "tokenrelay_worker_prefix_cache_cells",
        "KV cells that hold only cached prefixes (free to take when needed).",
        (),
        lambda w: w.engine_stats.get("prefix_cache_cells"),
    ),
)


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
        gen = ["model", "endpoint", "mode"]
        self.generations = Counter(
            "tokenrelay_generations",
            "Generation requests by outcome: status (499: the client went away) and error "
            "type, for SSE, JSON and WebSocket alike.",
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
            "Generation requests being answered right now.",
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
            "Time between consecutive text deltas sent to a client (one sample per delta).",
            gen,
            buckets=_ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "tokenrelay_e2e_request_latency_seconds",
            "From the request's arrival to its last event.",
            gen,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.queue = Histogram(
            "tokenrelay_queue_time_seconds",
            "From the request's arrival until a worker published its first token.",
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
