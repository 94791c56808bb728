"""The Celery app object, built from settings; importable without any engine.

The web tier sends ``tokenrelay.generate`` by name (``send_generate``) so it never
imports worker code; ``workers.celery_worker`` registers the task on the same app.

Celery's broker and result backend live on ``celery_redis_url``: ``celery_url`` when it
is set (a Redis Cluster carries the token traffic and kombu does not speak Cluster),
else the token traffic's ``redis_url``. Whatever reads Celery's queues directly (their
lengths for metrics and routing, a stopping worker's own queue) does it through
``celery_redis``.
"""

from __future__ import annotations

import json
from enum import Enum
from typing import Any

import redis
from celery import Celery
from kombu import Queue  # type: ignore[attr-defined]
from pydantic import BaseModel, ConfigDict

from app.settings import Settings
from broker.connection import redis_client
from broker.kombu_redis import transport_for
from broker.sent_events import sent_events
from broker.sentinel import celery_connection

GENERATE_TASK = "tokenrelay.generate"


class TaskOutcome(str, Enum):
    """How one ``generate(request_id, attempt)`` task ended on its worker."""

    DONE = "done"  # every choice of the attempt ended here
    CANCELLED = "cancelled"  # a cancel stopped it
    FENCED = "fenced"  # it lost its lease mid-way; another attempt resumes it
    ABANDONED = "abandoned"  # the worker shut down; another attempt resumes it
    TIMEOUT = "timeout"  # the engine thread did not end it long after its deadline
    FAILED = "failed"  # the engine or the worker failed it (an error on its stream)
    SKIPPED = "skipped"  # not run here: ``claim`` says why (stale, done, held, ...)


class GenerateResult(BaseModel):
    """The ``generate`` task's result (Celery's result backend and Flower show it).

    One typed value for every way a task ends, encoded to a JSON-able dict because
    that is what Celery's JSON serializer carries.
    """

    model_config = ConfigDict(frozen=True)

    request_id: str
    attempt: int
    outcome: TaskOutcome
    claim: str | None = None  # the claim's answer when the task was skipped
    finish_reasons: dict[int, str] = {}
    completion_tokens: dict[int, int] = {}
    run_s: float | None = None
    # From the engine's start of the request to its first token, and the engine steps
    # that gave it tokens (its trace's prefill and decode).
    prefill_s: float | None = None
    steps: int | None = None
    error: str | None = None

    def encode(self) -> dict[str, Any]:
        return self.model_dump(mode="json", exclude_none=True)

    @classmethod
    def decode(cls, raw: dict[str, Any]) -> GenerateResult:
        return cls.model_validate(raw)


def celery_redis_url(settings: Settings) -> str:
    """The Redis of Celery's broker and result backend: ``celery_url``, else ``redis_url``."""
    return settings.celery_url or settings.redis_url


def celery_redis(
    settings: Settings, client: redis.Redis, *, max_connections: int = 4
) -> redis.Redis:
    """A client for reading Celery's queues (``queue_depths``, ``waiting``): ``client``
    (the token traffic's, on ``redis_url``) itself when Celery shares that Redis, so a
    single-Redis deployment keeps one pool; else a client of its own on ``celery_url``,
    which connects on its first command."""
    url = celery_redis_url(settings)
    if url == settings.redis_url:
        return client
    return redis_client(url, max_connections=max_connections)


def queue_name(kind: str, model: str, shard: int | None = None) -> str:
    """Queues are per served model, so a worker only takes jobs for its own model; on a
    Redis Cluster per shard too (``shard``), so a worker takes its home shard's first
    and its engine steps publish to few shards (docs/scaling.md)."""
    return f"tr.{kind}.{model}" if shard is None else f"tr.{kind}.{model}.s{shard}"


def shard_queues(kind: str, model: str, shards: int = 0, home: int | None = None) -> list[str]:
    """``kind``'s queues of ``model``: the one queue on one Redis; on a cluster of
    ``shards`` a worker's ``home`` shard's, then the shared one (every worker of the
    model consumes it: ``broker.placement``); without a home, every shard's and the
    shared one (what their depth counts)."""
    if not shards:
        return [queue_name(kind, model)]
    own = range(shards) if home is None else [home % shards]
    return [*(queue_name(kind, model, k) for k in own), queue_name(kind, model)]


def worker_queue(model: str, worker_id: str) -> str:
    """One worker's own queue: the web tier sends a conversation's next turn there when
    that worker holds its prefix (``broker.prefix_routes``)."""
    return f"tr.worker.{model}.{worker_id}"


def worker_queues(
    model: str,
    worker_id: str | None = None,
    *,
    embeds: bool = False,
    shards: int = 0,
    home: int | None = None,
) -> list[str]:
    """The queues a worker consumes, in the order the 'priority' strategy polls them:
    its own queue (turns routed to it), then its model's embeddings (short), then
    interactive, then batch (on a cluster, each its ``home`` shard's, then the shared
    one: ``shard_queues``)."""
    shared = [
        *shard_queues("interactive", model, shards, home),
        *shard_queues("batch", model, shards, home),
    ]
    if embeds:
        shared.insert(0, f"tr.embed.{model}")
    return shared if worker_id is None else [worker_queue(model, worker_id), *shared]


def create_celery(
    settings: Settings,
    model: str | None = None,
    *,
    results: bool = True,
    worker_id: str | None = None,
    embeds: bool = False,
    shards: int = 0,
    home: int | None = None,
) -> Celery:
    """The app for ``model``'s queues.

    ``results=False``: an app that only sends tasks and never reads their results (the
    web tier, the batch driver, the streamers' watchdog). Its sends then skip what a
    result backend does for a sender: a Redis backend built per thread on first use
    (Celery's backend is thread-local: one more connection pool and pub/sub connection
    for each of the web's request threads) and a pub/sub subscription to every task's
    result channel, which nobody reads (the subscriptions piled up for the process's
    life, and Redis buffered every published result for them). Half of a request's
    start in the web tier went there (docs/benchmarks.md). Workers still store results
    (Flower and ``celery result`` read them): the message does not say to ignore them.
    """
    model = model or settings.served_name
    # redis:// as it is; redis+sentinel:// in kombu's Sentinel form (broker.sentinel)
    redis_conn = celery_connection(celery_redis_url(settings))
    app = Celery(
        "tokenrelay",
        broker=redis_conn.broker_url,
        backend=redis_conn.backend_url if results else "disabled",
    )
    app.tokenrelay_shards = shards  # a Redis Cluster's shards (workers' -Q list)
    app.conf.update(
        # kombu's Redis transports with one client per channel (broker.kombu_redis).
        broker_transport=transport_for(redis_conn.broker_url),
        task_queues=[
            Queue(q)  # type: ignore[no-untyped-call]
            for q in worker_queues(model, worker_id, embeds=embeds, shards=shards, home=home)
        ],
        task_default_queue=queue_name("interactive", model),
        task_serializer="json",
        result_serializer="json",
        accept_content=["json"],
        # Long GPU jobs: one message per free thread. Late acks keep a busy worker from
        # holding messages it cannot start yet (an unacknowledged message counts against
        # the prefetch of one per thread), so an idle worker gets them instead.
        worker_prefetch_multiplier=1,
        task_acks_late=True,
        # No STARTED result: storing it is two round trips (Celery reads the result
        # before every write) on the task's thread before generation begins, on every
        # request's way to its first token. Flower sees a task start from its
        # ``task-started`` event; the result backend keeps the final result.
        task_track_started=False,
        worker_send_task_events=True,
        task_send_sent_event=True,
        result_expires=settings.stream_ttl_s,
        # Survive the broker: reconnect forever at start and after a loss; running tasks
        # go on (their engine thread publishes through its own Redis client).
        broker_connection_retry_on_startup=True,
        broker_connection_max_retries=None,
        worker_cancel_long_running_tasks_on_connection_loss=False,
        # A result that cannot be stored (Redis away when the task ends) is retried a
        # little, then dropped: results are for Flower; the record is the truth.
        result_backend_always_retry=True,
        result_backend_max_retries=10,
        result_backend_max_sleep_between_retries_ms=2000,
        broker_transport_options={
            # No ack emulation: kombu's copy of every delivered message (the "unacked"
            # hash, restored after a visibility timeout) duplicates what the lease does
            # better (a lost request resumes within seconds, see docs/architecture.md
            # "The lease is the fence"), and its restore on a lost connection builds a
            # client from a connection already closed and kills the worker
            # (AttributeError in kombu's redis ``_connparams``; docs/reliability.md).
            # Without it a message is Redis's until BRPOP and the worker's after; a
            # message a worker drops is sent again by the streamers' watchdog.
            "ack_emulation": False,
            "queue_order_strategy": "priority",
            **redis_conn.broker_transport_options,
        },
        result_backend_transport_options=redis_conn.backend_transport_options,
        # One result backend for all of a worker's threads, not one built per thread on
        # its first task (a Redis client and pool each: a burst of 200 requests built
        # 200, a tenth of the worker's CPU before their first tokens). The Redis
        # backend stores through redis-py's thread-safe pool; only a caller waiting on
        # results uses its pub/sub, and our workers never wait on one.
        result_backend_thread_safe=True,
        worker_hijack_root_logger=False,
    )
    return app


def send_generate(
    app: Celery,
    request_id: str,
    attempt: int,
    *,
    queue: str,
    model: str,
    worker: str | None = None,
    priority: int = 0,
    fair: bool = False,
    trace: dict[str, str] | None = None,
    shard: int | None = None,
) -> None:
    """Enqueue ``generate(request_id, attempt)`` without importing worker code; its
    ``task-sent`` event goes out on its own thread (``broker.sent_events``).

    ``worker``: to that worker's own queue instead of the model's ``queue``;
    ``priority``: kombu's Redis priority, 0 (taken first) to 9 (``fair_priority``);
    ``fair``: the worker runs the model's next request by fair share instead
    (``broker.fair_queue``; ``request_id`` names the request it was sent for);
    ``trace``: the request's trace context, as the message's headers (``traceparent``:
    what Celery's OpenTelemetry instrumentation reads; workers read the record's);
    ``shard``: to that shard's ``queue`` (a Redis Cluster's: ``broker.placement``)."""
    app.send_task(
        GENERATE_TASK,
        args=[request_id, attempt],
        kwargs={"fair": True} if fair else None,
        queue=queue_name(queue, model, shard) if worker is None else worker_queue(model, worker),
        task_id=task_id(request_id, attempt),
        event_dispatcher=sent_events(app),
        priority=priority,
        headers=trace or None,
    )


def fair_priority(owner_in_flight: int) -> int:
    """The queue priority of a key's next request, by how many of its requests are in
    flight already: a workers' queue is served in arrival order within a priority, so a
    key that sent many waits behind a key that sent few, and one key cannot hold the
    queue (issue 47). kombu's Redis transport keeps one list per step (0, 3, 6, 9) and
    takes the lowest first; 0 for a key's first request, 9 from its 16th on."""
    if owner_in_flight <= 0:
        return 0
    if owner_in_flight < 4:
        return 3
    return 6 if owner_in_flight < 16 else 9


def task_id(request_id: str, attempt: int) -> str:
    return f"{request_id}.{attempt}"


def requeue_own(app: Celery, client: redis.Redis, model: str, worker_id: str) -> int:
    """Send the tasks still waiting in a stopping worker's own queue to the shared
    interactive queue (any worker may run them); how many. ``client``: on Celery's
    Redis (``celery_redis``).

    Without this they would wait for the streamers' watchdog (``requeue_after_s``).
    Celery's messages on Redis are JSON whose headers carry the task id, which names
    the request and attempt (``task_id``)."""
    moved = 0
    for pri, key in zip(
        PRIORITY_STEPS, priority_lists(worker_queue(model, worker_id)), strict=True
    ):
        while (raw := client.rpop(key)) is not None:
            try:
                rid, _, attempt = json.loads(raw)["headers"]["id"].rpartition(".")  # type: ignore[arg-type]
                send_generate(
                    app, rid, int(attempt), queue="interactive", model=model, priority=pri
                )
            except (ValueError, KeyError, TypeError):
                continue  # not one of ours: nothing to resend
            moved += 1
    return moved


# kombu's Redis transport keeps a queue's messages of each priority step in a list of
# its own: the queue's name for 0, the name + "\x06\x16" + step for the others.
PRIORITY_STEPS = (0, 3, 6, 9)
_PRIORITY_SEP = "\x06\x16"


def priority_lists(queue: str) -> list[str]:
    """The Redis lists that hold ``queue``'s waiting messages, highest priority first."""
    return [queue if pri == 0 else f"{queue}{_PRIORITY_SEP}{pri}" for pri in PRIORITY_STEPS]


def waiting(pipe: Any, queue: str) -> None:
    """Queue on ``pipe`` (of Celery's Redis: ``celery_redis``) the LLENs of ``queue``'s
    lists (``priority_lists``): their sum is how many tasks wait in it."""
    for key in priority_lists(queue):
        pipe.llen(key)


def queue_depths(client: redis.Redis, model: str, shards: int = 0) -> dict[str, int]:
    """Tasks waiting in each of ``model``'s queues (Celery's queues are Redis lists);
    ``client`` on Celery's Redis (``celery_redis``). On a cluster of ``shards`` a queue's
    count is its shards' queues' and its own together."""
    queues = worker_queues(model, embeds=True)
    lists = {q: [q] for q in queues}
    for kind in ("interactive", "batch"):
        lists[queue_name(kind, model)] = shard_queues(kind, model, shards)
    pipe = client.pipeline(transaction=False)
    for q in queues:
        for name in lists[q]:
            waiting(pipe, name)
    lengths = iter(pipe.execute())
    steps = len(PRIORITY_STEPS)
    return {q: sum(next(lengths) for _ in range(steps * len(lists[q]))) for q in queues}
