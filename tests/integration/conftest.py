from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from app.settings import Settings
from broker.keys import Keys
from broker.requests import RequestStore
from broker.server import RedisServer
from tests.stack import isolated_settings


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


@pytest.fixture
def settings(redis_server: RedisServer, models_dir: Path) -> Settings:
    return isolated_settings(redis_server.url, models_dir)


@pytest.fixture
def redis_client(redis_server: RedisServer) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_server.url)
    yield client
    client.close()


@pytest.fixture
def store(redis_client: redis.Redis, settings: Settings) -> RequestStore:
    return RequestStore(redis_client, Keys(settings.key_prefix), stream_ttl_s=600)
