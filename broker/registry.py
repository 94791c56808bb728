"""Worker registration: who serves which model, with a heartbeat TTL.

The web tier reads it to answer /ready and to route by model; a worker that stops
heart-beating disappears when its key expires (the zset entry is pruned by readers).
"""

from __future__ import annotations

import time

import redis
from pydantic import BaseModel, ConfigDict

from broker.keys import Keys


class WorkerInfo(BaseModel):
    model_config = ConfigDict(frozen=True)

    worker_id: str
    model: str
    engine: str
    capacity: int
    hostname: str
    pid: int
    started: float
    active_jobs: int = 0


class WorkerRegistry:
    def __init__(self, client: redis.Redis, keys: Keys, *, ttl_s: float = 10.0) -> None:
        self.redis = client
        self.keys = keys
        self.ttl_s = ttl_s

    def heartbeat(self, info: WorkerInfo, now: float | None = None) -> None:
        now = time.time() if now is None else now
        pipe = self.redis.pipeline(transaction=False)
        pipe.set(self.keys.worker(info.worker_id), info.model_dump_json(), px=int(self.ttl_s * 1000))
        pipe.zadd(self.keys.workers, {info.worker_id: now})
        pipe.execute()

    def unregister(self, worker_id: str) -> None:
        pipe = self.redis.pipeline(transaction=False)
        pipe.delete(self.keys.worker(worker_id))
        pipe.zrem(self.keys.workers, worker_id)
        pipe.execute()

    def live_workers(self, now: float | None = None) -> list[WorkerInfo]:
        """Workers whose heartbeat key still exists (stale ids are pruned)."""
        now = time.time() if now is None else now
        self.redis.zremrangebyscore(self.keys.workers, "-inf", now - 10 * self.ttl_s)
        ids = [i.decode() if isinstance(i, bytes) else i for i in self.redis.zrange(self.keys.workers, 0, -1)]
        if not ids:
            return []
        raws = self.redis.mget([self.keys.worker(i) for i in ids])
        return [WorkerInfo.model_validate_json(r) for r in raws if r is not None]
