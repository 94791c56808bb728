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

from typing import Any

import redis

from broker.sentinel import is_sentinel_url, parse_sentinel_url, sentinel_client

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


def as_str(v: Any) -> str:
    """A Redis reply value (bytes or not) as text."""
    return v.decode() if isinstance(v, bytes) else str(v)
