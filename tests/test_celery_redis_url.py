"""Which Redis Celery uses (``celery_url``, else ``redis_url``), and the client for
reading its queues: the token traffic's own client when the two are one Redis, so a
single-Redis deployment keeps one pool. Nothing here connects anywhere."""

from __future__ import annotations

import redis

from app.settings import Settings
from broker.celery_app import celery_redis, celery_redis_url, create_celery
from broker.connection import redis_client
from broker.sentinel import SentinelBlockingConnectionPool

TOKENS = "redis://10.0.0.1:6379/0"
CELERY = "redis://10.0.0.2:6380/3"


def test_the_url_falls_back_to_the_token_traffic_s() -> None:
    assert celery_redis_url(Settings(redis_url=TOKENS)) == TOKENS
    assert celery_redis_url(Settings(redis_url=TOKENS, celery_url=CELERY)) == CELERY


def test_one_redis_means_one_client() -> None:
    client = redis_client(TOKENS)
    assert celery_redis(Settings(redis_url=TOKENS), client) is client
    assert celery_redis(Settings(redis_url=TOKENS, celery_url=TOKENS), client) is client


def test_celery_s_own_redis_gets_its_own_client() -> None:
    client = redis_client(TOKENS)
    own = celery_redis(Settings(redis_url=TOKENS, celery_url=CELERY), client, max_connections=3)
    assert own is not client
    pool = own.connection_pool
    assert type(pool) is redis.BlockingConnectionPool and pool.max_connections == 3
    assert (pool.connection_kwargs["host"], pool.connection_kwargs["port"]) == ("10.0.0.2", 6380)
    assert pool.connection_kwargs["db"] == 3


def test_a_sentinel_group_for_celery() -> None:
    url = "redis+sentinel://:pw@10.0.0.5:26379,10.0.0.6:26379/celery/1"
    settings = Settings(redis_url=TOKENS, celery_url=url)
    own = celery_redis(settings, redis_client(TOKENS))
    assert isinstance(own.connection_pool, SentinelBlockingConnectionPool)
    app = create_celery(settings)
    assert app.conf.broker_url.startswith("sentinel://:pw@10.0.0.5:26379/1;")
    assert app.conf.broker_transport_options["master_name"] == "celery"
    assert app.conf.result_backend_transport_options["master_name"] == "celery"


def test_create_celery_puts_broker_and_backend_on_celery_s_redis() -> None:
    app = create_celery(Settings(redis_url=TOKENS, celery_url=CELERY))
    assert app.conf.broker_url == app.conf.result_backend == CELERY
    shared = create_celery(Settings(redis_url=TOKENS))
    assert shared.conf.broker_url == shared.conf.result_backend == TOKENS


def test_flower_s_app_is_on_celery_s_redis() -> None:
    from broker.flower_app import flower_celery

    app = flower_celery(Settings(redis_url=TOKENS, celery_url=CELERY))
    assert app.conf.broker_url == app.conf.result_backend == CELERY
