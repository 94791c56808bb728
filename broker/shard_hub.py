"""A web process's output hub on a Redis Cluster: one ``OutputHub`` per shard.

An ``OutputHub`` reads every stream it follows in one blocking XREAD, and a cluster
serves an XREAD only when all its streams share a slot: the output streams and output
step streams of one shard do (``broker.keys``). So a process follows each shard's
requests with that shard's hub (its own thread and connection, to the shard's master),
and ``ShardedHub`` sends each call to the hub of the request's shard. On one Redis
``output_hub`` makes the plain hub: nothing in between.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import redis
from redis.client import Pipeline

from broker.hub import OutputHub
from broker.keys import Keys
from broker.subscription import Subscription


class ShardedHub:
    """``OutputHub``'s interface over one hub per shard (module doc)."""

    def __init__(self, client: redis.Redis, keys: Keys, **options: Any) -> None:
        self.keys = keys
        self.hubs = [OutputHub(client, k, **options) for k in keys.all_shards()]

    def _hub(self, rid: str) -> OutputHub:
        return self.hubs[self.keys.index_of(rid)]

    def subscribe(
        self,
        rid: str,
        after: int = 0,
        *,
        notify: threading.Event | None = None,
        on_drop: Callable[[], None] | None = None,
        wake: bool = True,
    ) -> Subscription:
        return self._hub(rid).subscribe(rid, after, notify=notify, on_drop=on_drop, wake=wake)

    def queue_wake(self, pipe: Pipeline, rid: str) -> None:
        self._hub(rid).queue_wake(pipe, rid)

    def unsubscribe(self, sub: Subscription) -> None:
        self._hub(sub.request_id).unsubscribe(sub)

    def wake_all(self) -> None:
        for hub in self.hubs:
            hub.wake_all()

    def stop(self) -> None:
        for hub in self.hubs:
            hub.stop()

    def close(self) -> None:
        for hub in self.hubs:
            hub.close()

    @property
    def followed(self) -> int:
        return sum(hub.followed for hub in self.hubs)

    def down_for(self) -> float:
        """The longest any shard's hub has been failing to read (0.0 when all read)."""
        return max(hub.down_for() for hub in self.hubs)


def output_hub(client: redis.Redis, keys: Keys, **options: Any) -> OutputHub | ShardedHub:
    """The hub for ``keys``' Redis: one ``OutputHub``, or one per shard on a cluster."""
    if keys.clustered:
        return ShardedHub(client, keys, **options)
    return OutputHub(client, keys, **options)
