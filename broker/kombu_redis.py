"""kombu's Redis transports, with one Redis client per channel instead of one per command.

kombu's Redis channel builds a new ``redis.Redis`` for every command it sends outside
its consumer loop (``Channel.conn_or_acquire`` → ``_create_client``): every task a
sender queues (LPUSH), every event it publishes (PUBLISH) and every event batch a
worker flushes. A ``redis.Redis`` is 60 µs of Python to build on an idle machine
(three times that under load); in a burst of 200 requests it was a fifth of the Celery
worker's Python time (docs/benchmarks.md). The client is only a front for the
channel's connection pool, and redis-py clients are safe to share between threads, so
these channels build it once, on first use, and keep it for the channel's life (the
pool, and with it every connection, is the channel's own as before).

``broker_transport`` names these classes (``create_celery``); Flower and anything else
that reads the same Redis with kombu's own transports interoperates unchanged: the
commands and their data are the same.
"""

from __future__ import annotations

from typing import Any

from kombu.transport import redis as kombu_redis


class _OneClient:
    """The sync client built once per channel; the async one (BRPOP, pub/sub) as ever."""

    _tr_client: Any = None

    def _create_client(self, asynchronous: bool = False) -> Any:
        if asynchronous:
            return super()._create_client(asynchronous=True)  # type: ignore[misc]
        if self._tr_client is None:
            self._tr_client = super()._create_client()  # type: ignore[misc]
        return self._tr_client


class Channel(_OneClient, kombu_redis.Channel):
    """``redis://``'s channel."""


class SentinelChannel(_OneClient, kombu_redis.SentinelChannel):
    """``sentinel://``'s channel (its pool follows the master, the client with it)."""


class Transport(kombu_redis.Transport):
    Channel = Channel


class SentinelTransport(kombu_redis.SentinelTransport):
    Channel = SentinelChannel


def transport_for(broker_url: str) -> str | None:
    """The ``broker_transport`` for ``broker_url``: ours for ``redis://`` and
    ``sentinel://``; None (kombu's choice from the URL) for anything else."""
    scheme = broker_url.split("://", 1)[0]
    if scheme == "redis":
        return f"{__name__}:Transport"
    if scheme == "sentinel":
        return f"{__name__}:SentinelTransport"
    return None
