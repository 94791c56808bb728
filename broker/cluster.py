"""Redis Cluster: the client, the shards requests are spread over, and finding out.

A cluster refuses a script, a transaction or a multi-stream XREAD whose keys are in
different hash slots, and tokenrelay's token path is built from exactly those (a
worker's publish writes every request of an engine step and its step stream in one
script). So on a cluster the key space is cut into a few **shards**, each one hash tag
(``Keys``): every key of a request carries its shard's tag, and so does everything a
script uses together with it (the fence epoch, the hand-off stream, the workers' and
streamers' step streams, the usage ledger's counts); each shard is then a small copy of
the single-Redis design, and a worker's step costs one call per shard it has requests
on. Everything else (admission, registries, keys, files, batches) lives under one more
tag, the global one. docs/scaling.md says why shards and not one slot per request.

A request's shard is a hash of its id (``shard_of``), so every process finds it
without asking Redis. The shards' tags are chosen so that their slots are spread evenly
over the 16,384 (``shard_tags``): on a cluster whose masters split the slots evenly
(``redis-cli --cluster create``, ``broker.cluster_server``), n shards over n masters put
one on each. How many there are is recorded in the cluster once
(``recorded_shards``): every process of a deployment must agree on it.

Cluster errors that mean "Redis is away for now" (a master down before its replica is
promoted, slots not served yet, no node reachable) are raised as ``ClusterAway``, a
``redis.ConnectionError``, so every process's outage handling treats them as it treats a
restarting Redis.
"""

from __future__ import annotations

import zlib
from functools import lru_cache
from typing import Any

import redis
from redis.backoff import ExponentialBackoff
from redis.cluster import ClusterPipeline, RedisCluster
from redis.crc import key_slot
from redis.retry import Retry

SLOTS = 16384
GLOBAL_TAG = "g"


class ClusterAway(redis.ConnectionError):
    """The cluster cannot serve the call now (failover, slots moving, nodes down)."""


# What a cluster says while it fails over or cannot be reached; redis-py's own
# ``RedisClusterException`` is not even a ``RedisError``.
AWAY: tuple[type[Exception], ...] = (
    redis.exceptions.RedisClusterException,
    redis.exceptions.ClusterDownError,
    redis.exceptions.TryAgainError,
)


class _Pipeline(ClusterPipeline):
    def execute(self, raise_on_error: bool = True) -> list[Any]:
        try:
            return super().execute(raise_on_error)
        except AWAY as exc:
            raise ClusterAway(f"redis cluster: {exc}") from exc


class TokenrelayCluster(RedisCluster):
    """``RedisCluster`` whose "cluster away" errors are ``ClusterAway`` (module doc)."""

    def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().execute_command(*args, **kwargs)  # type: ignore[no-untyped-call]
        except AWAY as exc:
            raise ClusterAway(f"redis cluster: {exc}") from exc

    def pipeline(self, transaction: Any = None, shard_hint: Any = None) -> Any:
        pipe = super().pipeline(transaction, shard_hint)  # type: ignore[no-untyped-call]
        pipe.__class__ = _Pipeline
        return pipe

    def refresh(self) -> None:
        """Read the slot map again (after a failover moved a shard's master)."""
        try:
            self.nodes_manager.initialize()
        except AWAY as exc:
            raise ClusterAway(f"redis cluster: {exc}") from exc


def cluster_client(url: str, *, max_connections: int, **kwargs: Any) -> TokenrelayCluster:
    """A cluster client from one node's ``redis://`` URL (the others are found from it).

    ``max_connections`` is per node. Few retries inside redis-py: a failover takes
    seconds, and every caller has its own backoff (and answers 503 meanwhile)."""
    try:
        return TokenrelayCluster.from_url(  # type: ignore[return-value]
            url,
            max_connections=max_connections,
            retry=Retry(ExponentialBackoff(cap=0.5, base=0.05), 2),
            **kwargs,
        )
    except AWAY as exc:
        raise ClusterAway(f"redis cluster: {exc}") from exc


def is_cluster_server(url: str, *, timeout_s: float = 2.0) -> bool:
    """Whether the Redis at ``url`` runs in cluster mode (``INFO cluster``); a Redis that
    cannot be reached raises (the caller decides whether to wait)."""
    client = redis.Redis.from_url(url, socket_connect_timeout=timeout_s, socket_timeout=timeout_s)
    try:
        info: Any = client.info("cluster")
        return bool(int(info.get("cluster_enabled", 0)))
    finally:
        client.close()


@lru_cache(maxsize=64)
def shard_tags(count: int) -> tuple[str, ...]:
    """``count`` hash tags whose slots are spread evenly over the slot range: the k-th
    is the first of ``"k"``, ``"k.1"``, ``"k.2"``, ... whose slot falls in the k-th of
    ``count`` equal parts. Deterministic: every process computes the same tags."""
    tags: list[str] = []
    for k in range(count):
        low, high = k * SLOTS // count, (k + 1) * SLOTS // count
        j = 0
        while True:
            tag = str(k) if j == 0 else f"{k}.{j}"
            if low <= key_slot(tag.encode()) < high:
                tags.append(tag)
                break
            j += 1
    return tuple(tags)


def shard_of(request_id: str, count: int) -> int:
    """The shard of a request: a hash of its id (ids are random, so shards fill evenly)."""
    return zlib.crc32(request_id.encode()) % count


def masters(client: RedisCluster) -> int:
    """How many masters serve the cluster's slots now."""
    return len(client.get_primaries())  # type: ignore[no-untyped-call]


def recorded_shards(client: RedisCluster, prefix: str, wanted: int) -> int:
    """The deployment's number of shards, recorded in the cluster at its first start
    (``<prefix>{g}:shards``): ``wanted``, or one per master when 0. A ``wanted`` that
    differs from the recorded number is refused: processes that disagree would look for
    a request's keys under different tags."""
    key = f"{prefix}{{{GLOBAL_TAG}}}:shards"
    count = wanted or masters(client)
    client.set(key, count, nx=True)
    recorded = int(client.get(key) or count)
    if wanted and recorded != wanted:
        raise ValueError(
            f"TOKENRELAY_REDIS_SHARDS={wanted}, but this cluster records {recorded} shards for "
            f"key prefix {prefix!r}: use {recorded} (or 0), or another key prefix"
        )
    return recorded
