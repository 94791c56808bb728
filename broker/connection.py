"""Redis clients sized for the process that uses them, for one Redis or a Sentinel group.

redis-py's default pool holds at most 100 connections and fails beyond that
(``MaxConnectionsError``). A web process parks one connection per open stream in a
blocking XREAD, so it needs as many as it has streams; a blocking pool then makes a
burst wait for a free connection instead of failing a request.

``TOKENRELAY_REDIS_URL`` may also be a ``redis+sentinel://`` URL (``broker.sentinel``):
then the pool asks the sentinels for the current master on every new connection, so a
process that reconnects after a failover finds the new master by itself.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import redis

from broker.cluster import ClusterAway, cluster_client, is_cluster_server, recorded_shards
from broker.keys import Keys
from broker.sentinel import is_sentinel_url, parse_sentinel_url, sentinel_client

if TYPE_CHECKING:
    from app.settings import Settings

logger = logging.getLogger(__name__)

POOL_WAIT_S = 20.0
# Connecting to a reachable Redis takes milliseconds; a refused connection fails at once.
# This bounds the case in between (a host that drops packets, a Redis that cannot accept),
# so a request thread that needs a new connection answers 503 within about a second
# instead of redis-py's default 5 s. Reads keep redis-py's 5 s socket timeout: blocking
# XREADs wait up to 1 s for data on the same connections.
CONNECT_TIMEOUT_S = 1.0


def redis_client(url: str, *, max_connections: int = 64, **connection_kwargs: Any) -> redis.Redis:
    """A client on a blocking pool of ``max_connections`` for ``url``.

    ``url`` is ``redis://``, ``rediss://``, ``unix://`` or ``redis+sentinel://``;
    ``connection_kwargs`` (e.g. ``socket_timeout``) go to every connection.
    ``socket_connect_timeout`` is ``CONNECT_TIMEOUT_S`` unless given.
    """
    connection_kwargs.setdefault("socket_connect_timeout", CONNECT_TIMEOUT_S)
    if is_sentinel_url(url):
        return sentinel_client(
            parse_sentinel_url(url),
            max_connections=max_connections,
            pool_timeout=POOL_WAIT_S,
            **connection_kwargs,
        )
    pool = redis.BlockingConnectionPool.from_url(
        url, max_connections=max_connections, timeout=POOL_WAIT_S, **connection_kwargs
    )
    return redis.Redis(connection_pool=pool)


# How long a process starting against a cluster waits for it to answer (the shards it
# records), e.g. while compose starts the cluster beside it.
CLUSTER_START_WAIT_S = 60.0


def uses_cluster(settings: Settings) -> bool:
    """Whether ``settings.redis_url`` is a Redis Cluster: as set, or asked (``auto``: one
    ``INFO cluster``; a Redis that does not answer then counts as no cluster, with a
    warning: set ``TOKENRELAY_REDIS_CLUSTER`` where that guess must not be made)."""
    if settings.redis_cluster != "auto":
        return settings.redis_cluster == "yes"
    if is_sentinel_url(settings.redis_url) or settings.redis_url.startswith("unix:"):
        return False
    try:
        return is_cluster_server(settings.redis_url)
    except redis.RedisError as exc:
        logger.warning(
            "could not ask %s whether it is a Redis Cluster (%s); taking it for one Redis "
            "(set TOKENRELAY_REDIS_CLUSTER to say)",
            settings.redis_url.rsplit("@", 1)[-1],
            exc,
        )
        return False


def open_redis(
    settings: Settings,
    *,
    max_connections: int = 64,
    client: redis.Redis | None = None,
    **connection_kwargs: Any,
) -> tuple[redis.Redis, Keys]:
    """The process's client for token traffic and its key builder: one Redis (or a
    Sentinel group) with untagged keys, or a Redis Cluster (``broker.cluster``) with the
    deployment's shards, waiting up to ``CLUSTER_START_WAIT_S`` for the cluster to say
    how many there are. ``max_connections`` is per node on a cluster. ``client``: one
    made already (tests), for which only the key builder is made."""
    if client is not None:
        return client, keys_for(client, settings)
    if not uses_cluster(settings):
        client = redis_client(
            settings.redis_url, max_connections=max_connections, **connection_kwargs
        )
        return client, Keys(settings.key_prefix)
    if not settings.celery_url:
        raise ValueError(
            "TOKENRELAY_REDIS_URL is a Redis Cluster, which Celery cannot use: set "
            "TOKENRELAY_CELERY_URL to a Redis (or Sentinel group) of its own (docs/scaling.md)"
        )
    connection_kwargs.setdefault("socket_connect_timeout", CONNECT_TIMEOUT_S)
    deadline = time.monotonic() + CLUSTER_START_WAIT_S
    while True:
        try:
            cluster = cluster_client(
                settings.redis_url, max_connections=max_connections, **connection_kwargs
            )
            shards = recorded_shards(cluster, settings.key_prefix, settings.redis_shards)
            break
        except (redis.RedisError, ClusterAway) as exc:
            if time.monotonic() > deadline:
                raise
            logger.warning("waiting for the redis cluster (%s)", exc)
            time.sleep(1.0)
    # A RedisCluster answers the commands tokenrelay sends as a Redis does.
    return cluster, Keys(settings.key_prefix, shards)  # type: ignore[return-value]


def worker_shards(settings: Settings) -> tuple[int, int]:
    """A starting worker's (shards, home shard): (0, 0) on one Redis; on a cluster the
    deployment's shards and the next home in turn (``Keys.worker_homes``), so workers
    started one after another prefer different shards' queues."""
    if not uses_cluster(settings):
        return 0, 0
    client, keys = open_redis(settings, max_connections=2)
    try:
        return keys.shards, (int(client.incr(keys.worker_homes)) - 1) % keys.shards
    finally:
        client.close()


def keys_for(client: Any, settings: Settings) -> Keys:
    """The key builder for a client made elsewhere (tests, benchmarks): with a cluster's
    shards when ``client`` is a cluster client."""
    from redis.cluster import RedisCluster

    if isinstance(client, RedisCluster):
        return Keys(
            settings.key_prefix, recorded_shards(client, settings.key_prefix, settings.redis_shards)
        )
    return Keys(settings.key_prefix)


def as_str(v: Any) -> str:
    """A Redis reply value (bytes or not) as text."""
    return v.decode() if isinstance(v, bytes) else str(v)
