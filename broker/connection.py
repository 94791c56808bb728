"""Redis clients sized for the process that uses them.

redis-py's default pool holds at most 100 connections and fails beyond that
(``MaxConnectionsError``). A web process parks one connection per open stream in a
blocking XREAD, so it needs as many as it has streams; a blocking pool then makes a
burst wait for a free connection instead of failing a request.
"""

from __future__ import annotations

import redis

POOL_WAIT_S = 20.0


def redis_client(url: str, *, max_connections: int = 64) -> redis.Redis:
    pool = redis.BlockingConnectionPool.from_url(
        url, max_connections=max_connections, timeout=POOL_WAIT_S
    )
    return redis.Redis(connection_pool=pool)
