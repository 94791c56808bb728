"""The cluster's metrics: families read from Redis when ``/metrics`` is scraped.

Workers heart-beat their batch size, token count and engine gauges into the registry
(``broker.registry``); Celery's queues are Redis lists (on Celery's own Redis when
``celery_url`` is set); the usage ledger is Redis hashes. Reading them at scrape time
lets one scrape of any web process show the whole cluster, with no port to open on GPU
hosts: every web process reports the same values.

Every family is declared here once (``web.metric_family.FamilySpec``) and built only
from its declaration; ``CLUSTER_FAMILIES`` lists them all, the usage ledger's included:
``ClusterCollector.describe`` returns them, and docs/operations.md's table is generated
from them (``web.metrics_docs``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import redis

from broker.celery_app import celery_redis, queue_depths
from web.metric_family import FamilySpec, ScrapeFamily
from web.usage_metrics import USAGE_FAMILIES, usage_families

if TYPE_CHECKING:
    from broker.registry import WorkerInfo
    from broker.runner import Runner

WORKER_LABELS = ("worker", "model", "engine")


@dataclass(frozen=True)
class WorkerFamily:
    """A family with one sample per live worker, from its heartbeat (``None``: that
    worker has none). Labels beyond ``WORKER_LABELS`` are attributes of the worker."""

    spec: FamilySpec
    sample: Callable[[WorkerInfo], float | None]

    @property
    def extra(self) -> tuple[str, ...]:
        return self.spec.labels[len(WORKER_LABELS) :]


def _worker(
    name: str,
    kind: Literal["counter", "gauge"],
    doc: str,
    sample: Callable[[WorkerInfo], float | None],
    *extra: str,
) -> WorkerFamily:
    return WorkerFamily(FamilySpec(name, kind, doc, (*WORKER_LABELS, *extra)), sample)


WORKER_FAMILIES: tuple[WorkerFamily, ...] = (
    _worker(
        "tokenrelay_worker_batch_size",
        "gauge",
        "Choices running in a worker's last engine step.",
        lambda w: w.batch_size,
    ),
    _worker(
        "tokenrelay_worker_active_requests",
        "gauge",
        "Requests a worker is generating.",
        lambda w: w.active_jobs,
    ),
    _worker(
        "tokenrelay_worker_capacity",
        "gauge",
        "Concurrent requests a worker accepts (its slots).",
        lambda w: w.capacity,
    ),
    _worker(
        "tokenrelay_worker_engine_capacity",
        "gauge",
        "Sequences a worker's engine runs at once, by its mode: an unpaged exllamav2 "
        "worker runs 1 whatever its slots.",
        # A worker from before modes were reported has none.
        lambda w: w.engine_capacity if w.mode else None,
        "mode",
    ),
    _worker(
        "tokenrelay_worker_paged",
        "gauge",
        "1 when an exllamav2 worker runs paged attention (continuous batching), 0 when "
        "it runs unpaged (one sequence at a time).",
        lambda w: {"paged": 1.0, "unpaged": 0.0}.get(w.mode),
    ),
    _worker(
        "tokenrelay_worker_tokens",
        "counter",
        "Token ids a worker produced since it started (rate() gives tokens/s).",
        lambda w: w.tokens_total,
    ),
    _worker(
        "tokenrelay_worker_steps",
        "counter",
        "Engine steps a worker ran since it started.",
        lambda w: w.steps_total,
    ),
    _worker(
        "tokenrelay_worker_cache_usage",
        "gauge",
        "Fraction of the engine's KV cache that running sequences hold, 0..1 (llama.cpp: "
        "cells; exllamav2: pages; engines that report it).",
        lambda w: w.engine_stats.get("cache_usage"),
    ),
    _worker(
        "tokenrelay_worker_engine_waiting",
        "gauge",
        "Jobs waiting inside a worker's engine for cache pages or a batch slot "
        "(exllamav2): work it accepted but cannot run yet.",
        lambda w: w.engine_stats.get("engine_waiting"),
    ),
    _worker(
        "tokenrelay_worker_pending_continuations",
        "gauge",
        "Live streams paused inside a worker's engine, their next segment waiting for "
        "cache pages (exllamav2).",
        lambda w: w.engine_stats.get("pending_continuations"),
    ),
    # The prefix cache (engines that have one): hits / queries is the hit rate.
    _worker(
        "tokenrelay_worker_prefix_cache_queries",
        "counter",
        "Prompt tokens looked up in a worker's prefix cache since it started.",
        lambda w: w.engine_stats.get("prefix_cache_queries"),
    ),
    _worker(
        "tokenrelay_worker_prefix_cache_hits",
        "counter",
        "Prompt tokens found in a worker's prefix cache (not computed again).",
        lambda w: w.engine_stats.get("prefix_cache_hits"),
    ),
    _worker(
        "tokenrelay_worker_prefix_cache_evicted",
        "counter",
        "KV cells a worker's prefix cache evicted to make room.",
        lambda w: w.engine_stats.get("prefix_cache_evicted"),
    ),
    _worker(
        "tokenrelay_worker_prefix_cache_cells",
        "gauge",
        "KV cells that hold only cached prefixes (free to take when needed).",
        lambda w: w.engine_stats.get("prefix_cache_cells"),
    ),
)

QUEUE_DEPTH = FamilySpec(
    "tokenrelay_queue_depth",
    "gauge",
    "Generation tasks waiting in a Celery queue (each known model's embed, interactive "
    "and batch queues).",
    ("model", "queue"),
)
STREAMERS_LIVE = FamilySpec(
    "tokenrelay_streamers_live", "gauge", "Streamer processes heart-beating."
)

# Per model (issue 43), what autoscalers and dashboards read; then the same under the
# names vLLM's dashboards and autoscaling recipes use, labelled ``model_name``.
MODEL_WAITING = FamilySpec(
    "tokenrelay_model_requests_waiting",
    "gauge",
    "Requests of a model not running yet: queued, or held by a worker's engine (waiting "
    "for cache pages or a batch slot). What an autoscaler scales a model on.",
    ("model",),
)
MODEL_RUNNING = FamilySpec(
    "tokenrelay_model_requests_running", "gauge", "Requests a model's workers generate.", ("model",)
)
MODEL_WORKERS = FamilySpec(
    "tokenrelay_model_workers", "gauge", "Live workers of a model.", ("model",)
)
MODEL_KV_CACHE = FamilySpec(
    "tokenrelay_model_kv_cache_usage",
    "gauge",
    "Mean fraction of the KV cache in use over a model's live workers.",
    ("model",),
)
VLLM_WAITING = FamilySpec(
    "vllm:num_requests_waiting",
    "gauge",
    "vLLM's name for tokenrelay_model_requests_waiting.",
    ("model_name",),
)
VLLM_RUNNING = FamilySpec(
    "vllm:num_requests_running",
    "gauge",
    "vLLM's name for tokenrelay_model_requests_running.",
    ("model_name",),
)
VLLM_KV_CACHE = FamilySpec(
    "vllm:kv_cache_usage_perc",
    "gauge",
    "vLLM's name for tokenrelay_model_kv_cache_usage (a fraction, as vLLM's is).",
    ("model_name",),
)
MODEL_FAMILIES = (
    MODEL_WAITING,
    MODEL_RUNNING,
    MODEL_WORKERS,
    MODEL_KV_CACHE,
    VLLM_WAITING,
    VLLM_RUNNING,
    VLLM_KV_CACHE,
)

#: Every family ``ClusterCollector`` yields, in its order.
CLUSTER_FAMILIES: tuple[FamilySpec, ...] = (
    *(f.spec for f in WORKER_FAMILIES),
    QUEUE_DEPTH,
    STREAMERS_LIVE,
    *MODEL_FAMILIES,
    *USAGE_FAMILIES,
)


class ClusterCollector:
    """The cluster's families (module doc), collected from Redis at each scrape. A Redis
    error yields no samples rather than a failed scrape."""

    def __init__(self, service: Runner) -> None:
        self.service = service
        self._queues: redis.Redis | None = None  # Celery's Redis, on the first scrape

    def queues(self) -> redis.Redis:
        """Celery's Redis (``broker.celery_app.celery_redis``), where the queues are."""
        if self._queues is None:
            self._queues = celery_redis(self.service.settings, self.service.redis)
        return self._queues

    def describe(self) -> list[ScrapeFamily]:
        # The declarations, so the registry refuses a static metric of the same name.
        return [spec.build() for spec in CLUSTER_FAMILIES]

    def collect(self) -> Iterator[ScrapeFamily]:
        svc = self.service
        try:
            workers = svc.workers.live()
            streamers = svc.streamers.live()
            depths = {
                (model, queue): depth
                for model in svc.models.known()
                for queue, depth in queue_depths(self.queues(), model, svc.keys.shards).items()
            }
        except redis.RedisError:
            return
        for wf in WORKER_FAMILIES:
            family = wf.spec.build()
            for w in workers:
                value = wf.sample(w)
                if value is not None:
                    labels = [w.worker_id, w.model, w.engine, *(getattr(w, a) for a in wf.extra)]
                    family.add_metric(labels, float(value))
            yield family
        depth = QUEUE_DEPTH.build()
        for (model, q), n in depths.items():
            depth.add_metric([model, q], float(n))
        live = STREAMERS_LIVE.build()
        live.add_metric([], len(streamers))
        yield from (depth, live)
        yield from model_gauges(svc.models.known(), workers, depths)
        yield from usage_families(svc.redis, svc.keys)  # the usage ledger's counters


def model_gauges(
    models: Sequence[str], workers: Sequence[WorkerInfo], depths: dict[tuple[str, str], int]
) -> Iterator[ScrapeFamily]:
    """Per model: requests waiting (in its queues, and accepted by a worker's engine but
    not running yet), running, live workers and KV cache use; then the same under
    vLLM's names (``MODEL_FAMILIES``)."""
    waiting, running, live, usage, *aliases = (spec.build() for spec in MODEL_FAMILIES)
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
