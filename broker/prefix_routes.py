"""Routing a conversation's next turn to the worker whose prefix cache holds it.

Chat clients resend the whole conversation every turn, and a worker's engine keeps the
KV of what it ran (``workers/engines/prefix_cache.py``). With several workers for a
model the shared queue hands the next turn to whichever worker is free, so with W
workers it finds its prefix about 1/W of the time. So:

- **Workers advertise** the names of the prompt prefixes their engine holds (KV and
  host memory; ``app.prefix_blocks``: a chain hash per 32 tokens, seeded with the
  job's scope) in one Redis set each, ``{p}pfx:{worker}``, rewritten by the engine
  thread whenever a choice finishes (``PrefixAdverts``), before that step's tokens are
  published, so the set already names a reply when its client sees the reply end.
- **The web tier decides, at submit** (``PrefixRouter.choose``): it names the prompt's
  blocks the same way and asks every live worker's set, in one round trip, how many of
  the leading names it holds. The worker holding strictly the most (more than some
  other live worker) gets the request on its own queue (``tr.worker.{model}.{id}``,
  polled before the shared ones) if it has room (its running jobs and own queue below
  its slots); otherwise, and whenever the workers tie, the shared queue.
- **A wrong guess costs time, never text**: the engine decides what to reuse by
  comparing token ids itself. A turn routed to a worker that evicted the prefix runs
  cold there. A turn routed to a worker that then dies is sent to the shared queue by
  the streamers' watchdog as soon as the worker drops out of the registry (the record
  names its ``route``); a stopping worker hands its own queue back to the shared one
  (``broker.celery_app.requeue_own``).

A Responses API ``previous_response_id`` and a WebSocket chat need no affinity key of
their own: their prompt starts with the earlier turns' tokens, which is what is matched.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from collections.abc import Set as AbstractSet
from typing import Any

import redis

from app.prefix_blocks import BLOCK, block_names
from app.records import RequestRecord
from broker.celery_app import PRIORITY_STEPS, waiting, worker_queue
from broker.keys import Keys
from broker.registry import Registry, WorkerInfo

logger = logging.getLogger(__name__)

# Most leading blocks of a prompt that are looked up (32 tokens each: 32k tokens).
MAX_BLOCKS = 1024
# The live workers are read from the registry at most this often.
LIVE_CACHE_S = 0.5
# A worker whose last heartbeat is older than this is not routed to (it may be dead;
# the registry keeps it up to five beats).
FRESH_S = 5.0


class PrefixAdverts:
    """The worker side: one set of block names per worker, with the heartbeat's TTL."""

    def __init__(self, client: redis.Redis, keys: Keys, *, ttl_s: float) -> None:
        self.redis = client
        self.keys = keys
        self.ttl_ms = int(ttl_s * 1000)

    def publish(
        self,
        worker_id: str,
        names: AbstractSet[bytes],
        previous: AbstractSet[bytes] | None = None,
        load: int | None = None,
    ) -> None:
        """Make ``worker_id``'s set ``names``, atomically (a reader never sees it empty
        in between): from ``previous`` (what the last call wrote) by adding and removing
        the difference, or rewritten whole when ``previous`` is None; and its ``load``
        (requests running or waiting on it) when given."""
        key = self.keys.prefix_blocks(worker_id)
        pipe = self.redis.pipeline(transaction=True)
        if load is not None:
            pipe.set(self.keys.prefix_load(worker_id), load, px=self.ttl_ms)
        added: AbstractSet[bytes] = names
        removed: AbstractSet[bytes] = frozenset()
        if previous is None:
            pipe.delete(key)
        else:
            added, removed = names - previous, previous - names
        if removed:
            pipe.srem(key, *removed)
        if added:
            pipe.sadd(key, *added)
        pipe.pexpire(key, self.ttl_ms)
        pipe.execute()

    def touch(self, worker_id: str) -> None:
        """Keep the set and the load alive another TTL (the heartbeat calls it)."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.pexpire(self.keys.prefix_blocks(worker_id), self.ttl_ms)
        pipe.pexpire(self.keys.prefix_load(worker_id), self.ttl_ms)
        pipe.execute()

    def remove(self, worker_id: str) -> None:
        self.redis.delete(self.keys.prefix_blocks(worker_id), self.keys.prefix_load(worker_id))


class PrefixRouter:
    """The web side: which worker, if any, a request should go to (module doc)."""

    def __init__(
        self,
        client: redis.Redis,
        keys: Keys,
        workers: Registry[WorkerInfo],
        model: str,
        *,
        queues: redis.Redis | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.redis = client
        # Celery's Redis (``broker.celery_app.celery_redis``): the workers' own queues.
        self.queues = client if queues is None else queues
        self.keys = keys
        self.workers = workers
        self.model = model
        self.clock = clock
        self._live: list[WorkerInfo] = []
        self._live_until = 0.0
        # Decisions since start, by outcome (``OUTCOMES``), and a hook for /metrics.
        self.counts: dict[str, int] = dict.fromkeys(OUTCOMES, 0)
        self.observe: Callable[[str], None] | None = None

    def choose(self, record: RequestRecord) -> str | None:
        """The id of the worker to send ``record`` to, or None for the shared queue.

        Never raises for Redis: a router that cannot ask sends to the shared queue."""
        try:
            worker, outcome = self._choose(record)
        except redis.RedisError as exc:
            logger.debug("prefix routing skipped: %s", exc)
            worker, outcome = None, "error"
        self.counts[outcome] += 1
        if self.observe is not None:
            self.observe(outcome)
        return worker

    def _choose(self, record: RequestRecord) -> tuple[str | None, str]:
        if record.queue != "interactive" or not record.prompts:
            return None, "not_routed"
        workers = self._candidates()
        if len(workers) < 2:
            return None, "not_routed"  # nothing to choose between
        names = block_names(record.engine_scope, record.prompts[0][: MAX_BLOCKS * BLOCK])
        if not names:
            return None, "not_routed"
        # One round trip when Celery shares the token traffic's Redis, else one to each.
        pipe = self.redis.pipeline(transaction=False)
        lists = pipe if self.queues is self.redis else self.queues.pipeline(transaction=False)
        for w in workers:
            pipe.smismember(self.keys.prefix_blocks(w.worker_id), names)
            pipe.get(self.keys.prefix_load(w.worker_id))
        for w in workers:
            waiting(lists, worker_queue(self.model, w.worker_id))
        replies: list[Any] = pipe.execute()
        if lists is not pipe:
            replies += lists.execute()
        held = [_leading(replies[2 * i]) for i in range(len(workers))]
        best = max(held)
        if best == 0:
            return None, "no_match"
        if min(held) == best:
            return None, "tie"  # every worker holds as much: any of them will do
        steps, queued = len(PRIORITY_STEPS), 2 * len(workers)
        room = [
            (
                w.capacity
                - _load(w, replies[2 * i + 1])
                - sum(replies[queued + steps * i : queued + steps * (i + 1)]),
                w.worker_id,
            )
            for i, w in enumerate(workers)
            if held[i] == best
        ]
        free, worker_id = max(room)
        if free <= 0:
            return None, "full"
        return worker_id, "routed"

    def _candidates(self) -> list[WorkerInfo]:
        now = self.clock()
        if now >= self._live_until:
            self._live = [w for w in self.workers.live(now) if w.model == self.model]
            self._live_until = now + LIVE_CACHE_S
        return [w for w in self._live if w.routed and now - w.beat_at < FRESH_S]

    def sent(self, worker_id: str) -> None:
        """After sending to ``worker_id``'s queue: let the queue expire if that worker
        never takes it (it died), so dead workers' queues do not pile up in Redis."""
        with contextlib.suppress(redis.RedisError):
            self.queues.expire(worker_queue(self.model, worker_id), 600)


# How ``choose`` decided, for /metrics (``tokenrelay_prefix_routes_total``).
OUTCOMES = ("routed", "tie", "no_match", "full", "not_routed", "error")


def _load(worker: WorkerInfo, written: Any) -> int:
    """Requests running or waiting on ``worker``: as its engine thread last wrote it (at
    every change), else as its last heartbeat said."""
    return int(written) if written is not None else worker.active_jobs


def _leading(flags: list[Any]) -> int:
    """How many of the leading names are held (a chain hash names the whole prefix, so
    the first one missing ends the match)."""
    n = 0
    for flag in flags:
        if not int(flag):
            break
        n += 1
    return n
