"""Process registration (workers, streamers, batch drivers) with a heartbeat TTL.

The web tier reads it to answer /ready and to route by model; a process that stops
heart-beating disappears when its key expires (the zset entry is pruned by readers).
"""

from __future__ import annotations

import time
from typing import Any, Generic, TypeVar

import redis
from pydantic import BaseModel, ConfigDict, Field

from broker.keys import Keys


class WorkerInfo(BaseModel):
    model_config = ConfigDict(frozen=True)

    worker_id: str
    model: str
    engine: str
    capacity: int = Field(description="Concurrent requests it accepts (worker_slots).")
    hostname: str
    pid: int
    started: float
    active_jobs: int = 0
    batch_size: int = Field(default=0, description="Choices running at the last step.")
    steps_total: int = Field(default=0, description="Engine steps since start.")
    tokens_total: int = Field(default=0, description="Token ids produced since start.")
    engine_stats: dict[str, float] = Field(
        default_factory=dict, description="Engine gauges, e.g. cache_usage (0..1)."
    )
    mode: str = Field(
        default="", description="How the engine batches: exllamav2 'paged' or 'unpaged'."
    )
    engine_capacity: int = Field(
        default=0, description="Sequences the engine runs at once (unpaged exllamav2: 1)."
    )
    beat_at: float = Field(
        default=0.0, description="Unix time of this heartbeat (how fresh active_jobs is)."
    )
    home: int = Field(
        default=-1,
        description="Its home shard on a Redis Cluster (-1: none; broker.placement).",
    )
    routed: bool = Field(
        default=False,
        description="It consumes its own queue and advertises its cached prefixes "
        "(broker.prefix_routes): the web tier may send it a conversation's next turn.",
    )
    embeds: bool = Field(
        default=False,
        description="It consumes its model's embed queue (broker.embeddings): "
        "/v1/embeddings for the model is served.",
    )

    @property
    def member_id(self) -> str:
        return self.worker_id


class StreamerInfo(BaseModel):
    model_config = ConfigDict(frozen=True)

    streamer_id: str
    hostname: str
    pid: int
    started: float
    active_requests: int = 0

    @property
    def member_id(self) -> str:
        return self.streamer_id


class BatcherInfo(BaseModel):
    """A batch driver (``workers.batcher``): which batches it drives right now."""

    model_config = ConfigDict(frozen=True)

    batcher_id: str
    hostname: str
    pid: int
    started: float
    batches: list[str] = []

    @property
    def member_id(self) -> str:
        return self.batcher_id


InfoT = TypeVar("InfoT", WorkerInfo, StreamerInfo, BatcherInfo)


class Registry(Generic[InfoT]):
    """Live members of one kind, each a key with a TTL plus a zset index."""

    def __init__(
        self,
        client: redis.Redis,
        keys: Keys,
        kind: str,
        info_type: type[InfoT],
        *,
        ttl_s: float = 10.0,
    ) -> None:
        self.redis = client
        self.keys = keys
        self.kind = kind
        self.info_type: type[InfoT] = info_type
        self.ttl_s = ttl_s

    def heartbeat(self, info: InfoT, now: float | None = None) -> None:
        """Say ``info``'s member is alive for another ``ttl_s``.

        A Redis at ``maxmemory`` (noeviction) refuses SET and ZADD; the beat then only
        extends the key's TTL (PEXPIRE frees nothing but is never refused), so the fleet
        stays visible while Redis is full and is ready the moment room is made.
        """
        now = time.time() if now is None else now
        key = self.keys.member(self.kind, info.member_id)
        ttl_ms = int(self.ttl_s * 1000)
        pipe = self.redis.pipeline(transaction=False)
        pipe.set(key, info.model_dump_json(), px=ttl_ms)
        pipe.zadd(self.keys.members(self.kind), {info.member_id: now})
        try:
            pipe.execute()
        except redis.exceptions.OutOfMemoryError:
            if not self.redis.pexpire(key, ttl_ms):  # expired meanwhile: nothing to extend
                raise

    def unregister(self, member_id: str) -> None:
        pipe = self.redis.pipeline(transaction=False)
        pipe.delete(self.keys.member(self.kind, member_id))
        pipe.zrem(self.keys.members(self.kind), member_id)
        pipe.execute()

    def live(self, now: float | None = None) -> list[InfoT]:
        """Members whose heartbeat key still exists. Index entries whose key is gone and
        whose last full beat is long past (10 TTLs) are pruned; a member that only
        extended its key while Redis was full keeps its old score and stays."""
        now = time.time() if now is None else now
        index = self.keys.members(self.kind)
        entries: Any = self.redis.zrange(index, 0, -1, withscores=True)
        if not entries:
            return []
        ids = [i.decode() if isinstance(i, bytes) else str(i) for i, _ in entries]
        raws: Any = self.redis.mget([self.keys.member(self.kind, i) for i in ids])
        long_dead = [
            i
            for i, (_, score), raw in zip(ids, entries, raws, strict=True)
            if raw is None and score < now - 10 * self.ttl_s
        ]
        if long_dead:
            self.redis.zrem(index, *long_dead)
        return [self.info_type.model_validate_json(r) for r in raws if r is not None]


def worker_registry(client: redis.Redis, keys: Keys, ttl_s: float = 10.0) -> Registry[WorkerInfo]:
    return Registry(client, keys, "worker", WorkerInfo, ttl_s=ttl_s)


def streamer_registry(
    client: redis.Redis, keys: Keys, ttl_s: float = 10.0
) -> Registry[StreamerInfo]:
    return Registry(client, keys, "streamer", StreamerInfo, ttl_s=ttl_s)


def batcher_registry(client: redis.Redis, keys: Keys, ttl_s: float = 10.0) -> Registry[BatcherInfo]:
    return Registry(client, keys, "batcher", BatcherInfo, ttl_s=ttl_s)
