"""``redis+sentinel://`` URLs: parsing, redaction, our client's pool, and the translation
to kombu's and Celery's own Sentinel form (checked with kombu and Celery themselves,
without connecting anywhere)."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis

from app.settings import Settings
from broker.celery_app import create_celery
from broker.connection import redis_client
from broker.sentinel import (
    DEFAULT_SENTINEL_PORT,
    SentinelBlockingConnectionPool,
    celery_connection,
    is_sentinel_url,
    parse_sentinel_url,
    redact,
)

URL = "redis+sentinel://s1:26380,s2,[::1]:26381/mymaster/2"


def test_is_sentinel_url() -> None:
    assert is_sentinel_url(URL)
    assert is_sentinel_url("REDIS+SENTINEL://h/m")
    assert not is_sentinel_url("redis://127.0.0.1:6379/0")
    assert not is_sentinel_url("sentinel://h:26379")  # kombu's form is not ours


def test_parse_hosts_master_and_db() -> None:
    spec = parse_sentinel_url(URL)
    assert spec.sentinels == (("s1", 26380), ("s2", DEFAULT_SENTINEL_PORT), ("::1", 26381))
    assert spec.master_name == "mymaster"
    assert spec.db == 2
    assert spec.username is None and spec.password is None
    assert parse_sentinel_url("redis+sentinel://h/m").db == 0


def test_parse_credentials_and_options() -> None:
    spec = parse_sentinel_url(
        "redis+sentinel://app:p%40ss%3Aw@h1:1,h2:2/main/1"
        "?sentinel_password=s3cret&sentinel_username=sent&socket_timeout=2.5"
    )
    assert (spec.username, spec.password) == ("app", "p@ss:w")
    assert (spec.sentinel_username, spec.sentinel_password) == ("sent", "s3cret")
    assert spec.socket_timeout == 2.5
    assert spec.master_kwargs() == {
        "db": 1,
        "username": "app",
        "password": "p@ss:w",
        "socket_timeout": 2.5,
    }
    sentinel_kwargs = spec.sentinel_kwargs()
    assert sentinel_kwargs["username"] == "sent"
    assert sentinel_kwargs["password"] == "s3cret"
    assert sentinel_kwargs["socket_timeout"] > 0
    # password only (requirepass): the common form
    only = parse_sentinel_url("redis+sentinel://:pw@h/m")
    assert (only.username, only.password) == (None, "pw")
    assert "pw" not in repr(only)


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("redis://h:6379/0", r"not a redis\+sentinel"),
        ("redis+sentinel://h:26379", "no master name"),
        ("redis+sentinel://h:26379/", "no master name"),
        ("redis+sentinel:///m", "no sentinel address"),
        ("redis+sentinel://h:abc/m", "bad sentinel port"),
        ("redis+sentinel://h:70000/m", "bad sentinel port"),
        ("redis+sentinel://[::1/m", "bad sentinel address"),
        ("redis+sentinel://h/m/x", "bad path"),
        ("redis+sentinel://h/m/0/1", "bad path"),
        ("redis+sentinel://h/m?master=x", "unknown option"),
        ("redis+sentinel://h/m?socket_timeout=soon", "bad socket_timeout"),
    ],
)
def test_parse_errors_say_what_is_wrong(url: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_sentinel_url(url)


def test_parse_errors_never_show_passwords() -> None:
    with pytest.raises(ValueError) as info:
        parse_sentinel_url("redis+sentinel://u:topsecret@h:bad/m")
    assert "topsecret" not in str(info.value)


def test_redact() -> None:
    assert redact("redis+sentinel://u:pw@h1,h2/m?sentinel_password=x&socket_timeout=1") == (
        "redis+sentinel://u:***@h1,h2/m?sentinel_password=***&socket_timeout=1"
    )
    assert redact("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"


@pytest.mark.integration  # starts a process or opens a socket
def test_redis_client_builds_a_blocking_sentinel_pool() -> None:
    client = redis_client(
        "redis+sentinel://:pw@127.0.0.1:1,127.0.0.1:2/mymaster/3", max_connections=7
    )
    pool = client.connection_pool
    assert isinstance(pool, SentinelBlockingConnectionPool)
    assert isinstance(pool, redis.BlockingConnectionPool)
    assert pool.service_name == "mymaster"
    assert pool.max_connections == 7
    assert pool.connection_kwargs["db"] == 3
    assert pool.connection_kwargs["password"] == "pw"
    addresses = [
        (s.connection_pool.connection_kwargs["host"], s.connection_pool.connection_kwargs["port"])
        for s in pool.sentinel_manager.sentinels
    ]
    assert addresses == [("127.0.0.1", 1), ("127.0.0.1", 2)]
    # Nothing listens there: looking the master up fails with redis-py's "no master",
    # a ConnectionError, which every reconnect loop already handles.
    with pytest.raises(redis.ConnectionError, match="No master found"):
        pool.get_master_address()


def test_redis_client_plain_url_unchanged() -> None:
    client = redis_client("redis://127.0.0.1:6390/4", max_connections=5, socket_timeout=3)
    pool = client.connection_pool
    assert type(pool) is redis.BlockingConnectionPool
    assert pool.connection_kwargs["port"] == 6390
    assert pool.connection_kwargs["db"] == 4
    assert pool.connection_kwargs["socket_timeout"] == 3


def test_celery_connection_plain_url_passes_through() -> None:
    conn = celery_connection("redis://127.0.0.1:6379/0")
    assert conn.broker_url == conn.backend_url == "redis://127.0.0.1:6379/0"
    assert conn.broker_transport_options == conn.backend_transport_options == {}


def test_celery_connection_is_understood_by_kombu() -> None:
    from kombu import Connection  # type: ignore[attr-defined]
    from kombu.transport.redis import SentinelChannel

    conn = celery_connection("redis+sentinel://:p%40w@10.0.0.1:26380,10.0.0.2/main/2")
    assert conn.broker_url == (
        "sentinel://:p%40w@10.0.0.1:26380/2;sentinel://:p%40w@10.0.0.2:26379/2"
    )
    assert conn.broker_transport_options["master_name"] == "main"
    kombu_conn = Connection(conn.broker_url, transport_options=conn.broker_transport_options)
    assert kombu_conn.transport.Channel is SentinelChannel
    assert kombu_conn.alt == conn.broker_url.split(";")
    assert kombu_conn.password == "p@w"
    assert kombu_conn.virtual_host == "2"


def test_celery_connection_is_understood_by_celery_backend() -> None:
    from celery import Celery
    from celery.backends.redis import SentinelBackend

    conn = celery_connection("redis+sentinel://:pw@10.0.0.1:26380,10.0.0.2:26390/main/5")
    app = Celery("t", broker=conn.broker_url, backend=conn.backend_url)
    app.conf.result_backend_transport_options = conn.backend_transport_options
    backend = app.backend
    assert isinstance(backend, SentinelBackend)
    params = backend.connparams
    assert [(h["host"], h["port"]) for h in params["hosts"]] == [
        ("10.0.0.1", 26380),
        ("10.0.0.2", 26390),
    ]
    assert params["db"] == 5
    assert params["password"] == "pw"


def test_create_celery_with_sentinel_url(tmp_path: Path) -> None:
    settings = Settings(
        redis_url="redis+sentinel://127.0.0.1:26380,127.0.0.1:26381/main/0",
        models_dir=tmp_path,
        served_model_name="m",
    )
    app = create_celery(settings)
    assert app.conf.broker_url.startswith("sentinel://127.0.0.1:26380/0;sentinel://")
    assert app.conf.result_backend == app.conf.broker_url
    options = app.conf.broker_transport_options
    assert options["master_name"] == "main"
    # our own broker options are kept beside the Sentinel ones
    assert options["queue_order_strategy"] == "priority"
    assert app.conf.result_backend_transport_options["master_name"] == "main"


def test_create_celery_plain_url_unchanged(tmp_path: Path) -> None:
    settings = Settings(
        redis_url="redis://127.0.0.1:6379/0", models_dir=tmp_path, served_model_name="m"
    )
    app = create_celery(settings)
    assert app.conf.broker_url == "redis://127.0.0.1:6379/0"
    assert "master_name" not in app.conf.broker_transport_options
