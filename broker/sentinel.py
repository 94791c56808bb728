"""Redis Sentinel: one URL for every tokenrelay process, and the same for Celery.

A deployment that outgrows one Redis runs a master, replicas and (at least three)
``redis-server --sentinel`` processes; clients ask the sentinels where the master is and
ask again after a failover. tokenrelay takes that as one URL in ``TOKENRELAY_REDIS_URL``
(the format of the ``redis-sentinel-url`` package, also used by Django and Dramatiq
setups)::

    redis+sentinel://[[USER]:PASSWORD@]HOST[:PORT][,HOST[:PORT]...]/MASTER_NAME[/DB]
        [?sentinel_password=...&sentinel_username=...&socket_timeout=...]

``PORT`` defaults to 26379 (Sentinel's), ``DB`` to 0. The user and password are the data
nodes' (``requirepass`` / ACL on the master and replicas); the sentinels' own credentials,
when they have ``requirepass`` set, go in the query string.

Our own clients (``broker.connection.redis_client``) get a blocking pool whose connections
look the master up through the sentinels on every (re)connect, so after a failover the next
reconnect lands on the new master. Celery and Flower speak kombu's dialect instead
(``sentinel://h1:p1;sentinel://h2:p2`` plus a ``master_name`` transport option, for the
broker and the result backend): ``celery_connection`` translates.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, quote, unquote

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry
from redis.sentinel import Sentinel, SentinelConnectionPool

logger = logging.getLogger(__name__)

SCHEME = "redis+sentinel"
DEFAULT_SENTINEL_PORT = 26379
# How long one question to one sentinel may take: a dead sentinel must not stall a
# reconnect for long, since the next sentinel in the list can answer instead.
SENTINEL_SOCKET_TIMEOUT_S = 1.0
_QUERY_OPTIONS = {"sentinel_password", "sentinel_username", "socket_timeout"}


def is_sentinel_url(url: str) -> bool:
    """Whether ``url`` names a Sentinel-managed Redis (``redis+sentinel://``)."""
    return url.split("://", 1)[0].lower() == SCHEME


@dataclass(frozen=True)
class SentinelURL:
    """A parsed ``redis+sentinel://`` URL."""

    sentinels: tuple[tuple[str, int], ...]
    master_name: str
    db: int = 0
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    sentinel_username: str | None = None
    sentinel_password: str | None = field(default=None, repr=False)
    socket_timeout: float | None = None

    def sentinel_kwargs(self) -> dict[str, Any]:
        """Connection options for the sentinels themselves (not the data nodes)."""
        kwargs: dict[str, Any] = {
            "socket_timeout": SENTINEL_SOCKET_TIMEOUT_S,
            "socket_connect_timeout": SENTINEL_SOCKET_TIMEOUT_S,
        }
        if self.sentinel_username:
            kwargs["username"] = self.sentinel_username
        if self.sentinel_password:
            kwargs["password"] = self.sentinel_password
        return kwargs

    def master_kwargs(self) -> dict[str, Any]:
        """Connection options for the master (db, credentials, timeout)."""
        kwargs: dict[str, Any] = {"db": self.db}
        if self.username:
            kwargs["username"] = self.username
        if self.password:
            kwargs["password"] = self.password
        if self.socket_timeout is not None:
            kwargs["socket_timeout"] = self.socket_timeout
        return kwargs


def _parse_host(text: str, url: str) -> tuple[str, int]:
    """``host``, ``host:port``, ``[v6]`` or ``[v6]:port``."""
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        if not sep or (rest and not rest.startswith(":")):
            raise ValueError(f"bad sentinel address {text!r} in {redact(url)}")
        port_text = rest[1:]
    else:
        host, _, port_text = text.partition(":")
    if not host:
        raise ValueError(f"empty sentinel host in {redact(url)}")
    if not port_text:
        return host, DEFAULT_SENTINEL_PORT
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ValueError(f"bad sentinel port {port_text!r} in {redact(url)}")
    return host, int(port_text)


def parse_sentinel_url(url: str) -> SentinelURL:
    """Parse ``redis+sentinel://...``; raises ValueError naming what is wrong.

    urllib cannot split a netloc that holds several ``host:port`` pairs, so the URL is cut
    by hand: scheme, userinfo, the comma-separated sentinel list, the path, the query.
    """
    if not is_sentinel_url(url):
        raise ValueError(f"not a {SCHEME}:// URL: {redact(url)}")
    rest = url.split("://", 1)[1]
    rest, _, query = rest.partition("?")
    rest = rest.partition("#")[0]
    netloc, _, path = rest.partition("/")
    userinfo, at, hosts = netloc.rpartition("@")
    if not at:
        userinfo, hosts = "", netloc
    username = password = None
    if userinfo:
        user_text, colon, pass_text = userinfo.partition(":")
        username = unquote(user_text) or None
        password = unquote(pass_text) if colon and pass_text else None
    sentinels = tuple(_parse_host(h.strip(), url) for h in hosts.split(",") if h.strip())
    if not sentinels:
        raise ValueError(f"no sentinel address in {redact(url)}")
    parts = [p for p in path.split("/") if p]
    if not parts:
        raise ValueError(
            f"no master name in {redact(url)}: expected "
            f"{SCHEME}://HOST:PORT[,HOST:PORT...]/MASTER_NAME[/DB]"
        )
    if len(parts) > 2 or (len(parts) == 2 and not parts[1].isdigit()):
        raise ValueError(f"bad path {path!r} in {redact(url)}: expected /MASTER_NAME[/DB]")
    options = dict(parse_qsl(query, keep_blank_values=True))
    unknown = set(options) - _QUERY_OPTIONS
    if unknown:
        raise ValueError(
            f"unknown option(s) {', '.join(sorted(unknown))} in {redact(url)}; "
            f"known: {', '.join(sorted(_QUERY_OPTIONS))}"
        )
    timeout = options.get("socket_timeout")
    try:
        socket_timeout = float(timeout) if timeout else None
    except ValueError:
        raise ValueError(f"bad socket_timeout {timeout!r} in {redact(url)}") from None
    return SentinelURL(
        sentinels=sentinels,
        master_name=unquote(parts[0]),
        db=int(parts[1]) if len(parts) == 2 else 0,
        username=username,
        password=password,
        sentinel_username=options.get("sentinel_username") or None,
        sentinel_password=options.get("sentinel_password") or None,
        socket_timeout=socket_timeout,
    )


def redact(url: str) -> str:
    """``url`` with its passwords replaced, for messages and logs."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    netloc, slash, tail = rest.partition("/")
    userinfo, at, hosts = netloc.rpartition("@")
    if at and ":" in userinfo:
        netloc = f"{userinfo.partition(':')[0]}:***@{hosts}"
    if "password=" in tail:
        head, _, query = tail.partition("?")
        pairs = [
            (k, "***" if k.endswith("password") else v)
            for k, v in parse_qsl(query, keep_blank_values=True)
        ]
        tail = head + "?" + "&".join(f"{k}={v}" for k, v in pairs)
    return f"{scheme}{sep}{netloc}{slash}{tail}"


class SentinelBlockingConnectionPool(SentinelConnectionPool, redis.BlockingConnectionPool):
    """redis-py's Sentinel pool with the blocking pool's behaviour when full.

    redis-py ships only a non-blocking Sentinel pool, which fails a burst beyond its size;
    tokenrelay's processes need the blocking one (see ``broker.connection``). The MRO puts
    the Sentinel lookup (connection class, ``owns_connection``, ``reset``) over the blocking
    pool's queue. A connection that was opened to a former master is not owned any more:
    it is closed on release and also dropped from the pool's list, which the blocking pool
    would otherwise grow by one entry per reconnect for as long as an outage lasts.
    """

    def release(self, connection: Any) -> None:
        if not self.owns_connection(connection):  # type: ignore[no-untyped-call]
            with self._lock:
                if connection in self._connections:
                    self._connections.remove(connection)
        super().release(connection)  # type: ignore[no-untyped-call]


def sentinel_client(
    spec: SentinelURL, *, max_connections: int, pool_timeout: float, **connection_kwargs: Any
) -> redis.Redis:
    """A client for the current master of ``spec.master_name``, found through the sentinels.

    Every new connection asks the sentinels for the master first, and a connection that
    sees the old master's socket close (or a READONLY reply, once it has been demoted) is
    dropped, so the caller's own reconnect-with-backoff lands on the new master.
    """
    kwargs = {**spec.master_kwargs(), **connection_kwargs}
    # No retries per sentinel: redis-py's default (3, with backoff) would spend seconds
    # on a dead sentinel before asking the next one, on every reconnect.
    sentinel_kwargs = {**spec.sentinel_kwargs(), "retry": Retry(NoBackoff(), 0)}
    # Typed from redis 8.2 on, untyped before: called through Any, so both check clean.
    sentinel_class: Any = Sentinel
    sentinel = sentinel_class(
        list(spec.sentinels), min_other_sentinels=0, sentinel_kwargs=sentinel_kwargs
    )
    pool = SentinelBlockingConnectionPool(  # type: ignore[no-untyped-call]
        spec.master_name,
        sentinel,
        max_connections=max_connections,
        timeout=pool_timeout,
        **kwargs,
    )
    return redis.Redis(connection_pool=pool)


@dataclass(frozen=True)
class CeleryConnection:
    """What ``create_celery`` hands to Celery for one ``TOKENRELAY_REDIS_URL``."""

    broker_url: str
    backend_url: str
    broker_transport_options: dict[str, Any] = field(default_factory=dict)
    backend_transport_options: dict[str, Any] = field(default_factory=dict)


def celery_connection(url: str) -> CeleryConnection:
    """Broker and result-backend URLs and transport options for Celery and Flower.

    A plain ``redis://`` URL is used as it is. A ``redis+sentinel://`` URL becomes kombu's
    and Celery's own Sentinel form: one ``sentinel://[user:password@]host:port/db`` per
    sentinel joined by ``;`` (both read the data node's db and credentials from the first
    one), with ``master_name`` and the sentinels' own connection options as transport
    options of the broker and of the result backend.
    """
    if not is_sentinel_url(url):
        return CeleryConnection(url, url)
    spec = parse_sentinel_url(url)
    auth = ""
    if spec.username or spec.password:
        auth = quote(spec.username or "", safe="")
        if spec.password:
            auth += ":" + quote(spec.password, safe="")
        auth += "@"
    hosts = [f"[{h}]" if ":" in h else h for h, _ in spec.sentinels]
    celery_url = ";".join(
        f"sentinel://{auth}{host}:{port}/{spec.db}"
        for host, (_, port) in zip(hosts, spec.sentinels, strict=True)
    )
    options: dict[str, Any] = {
        "master_name": spec.master_name,
        "sentinel_kwargs": spec.sentinel_kwargs(),
    }
    return CeleryConnection(celery_url, celery_url, dict(options), dict(options))
