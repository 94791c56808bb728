"""Where a new request goes on a Redis Cluster: its shard, and its task's queue.

A worker's engine step publishes one call per shard its requests are on (each call
costs Redis a fixed ~13 µs on top of ~0.05 µs per request: benchmarks/
cluster_publish.py), so a worker whose requests come from every shard makes every
master pay every step's fixed cost, and more masters add little capacity. So each
worker has a **home** shard (taken in turn at its start: ``connection.worker_shards``),
consumes that shard's queues before the shared ones, and the web tier gives new
requests ids on the home shards of the live workers, in turn, and sends each task to
its shard's queue when a live worker of its model is at home there (else to the
shared queue, which every worker of the model consumes). A worker then publishes to
its home shard alone while the load is spread evenly, and each master carries its
workers' steps only.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from typing import Any

from broker.keys import Keys

# How long the live workers' homes are kept before being read again.
HOMES_TTL_S = 1.0
# A new id is drawn at most this many times to land on the chosen shard.
DRAWS = 64


class ShardPlacement:
    """The shards of new requests and the queues of their tasks (module doc)."""

    def __init__(
        self, keys: Keys, workers: Any, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.keys = keys
        self.workers = workers  # a worker registry (``live()``: WorkerInfo with ``home``)
        self.clock = clock
        self._homes: dict[str, set[int]] = {}
        self._read_at = float("-inf")
        self._turn = itertools.count()
        self._lock = threading.Lock()

    def homes(self) -> dict[str, set[int]]:
        """Model -> the home shards of its live workers (read at most once a second)."""
        now = self.clock()
        if now - self._read_at >= HOMES_TTL_S:
            with self._lock:
                if now - self._read_at >= HOMES_TTL_S:
                    homes: dict[str, set[int]] = {}
                    for w in self.workers.live():
                        if 0 <= w.home < self.keys.shards:
                            homes.setdefault(w.model, set()).add(w.home)
                    self._homes, self._read_at = homes, now
        return self._homes

    def ids(self, draw: Callable[[], str]) -> Callable[[], str]:
        """``draw`` (a new request id each call), placed: each id is on the next of the
        live workers' home shards in turn (every shard when no worker has one)."""

        def placed() -> str:
            homes = sorted(set().union(*self.homes().values())) or range(self.keys.shards)
            target = homes[next(self._turn) % len(homes)]
            rid = draw()
            for _ in range(DRAWS):
                if self.keys.index_of(rid) == target:
                    break
                rid = draw()
            return rid

        return placed

    def queue_shard(self, model: str, rid: str) -> int | None:
        """The shard whose queue ``rid``'s task goes to: its own when a live worker of
        ``model`` is at home there, else None (the shared queue)."""
        shard = self.keys.index_of(rid)
        return shard if shard in self.homes().get(model, set()) else None


def placement_for(keys: Keys, workers: Any) -> ShardPlacement | None:
    """The placement of a cluster's requests; None on one Redis (nothing to place)."""
    return ShardPlacement(keys, workers) if keys.clustered else None
