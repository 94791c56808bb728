"""Issue 16 line 3 ("with Redis at maxmemory: uploads, chats and WS chats get 500
internal_error (not 503), DELETE /v1/files/{id} also 500s"), against a real
redis-server started as ``tokenrelay up`` starts it (noeviction, a ``maxmemory``),
with a tiny limit and filled to it: writes get 503 + Retry-After, reads and deletes
still work, and deleting frees room for new writes.
"""

from __future__ import annotations

import io
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from flask.testing import FlaskClient

from broker.backbone import UNAVAILABLE_MESSAGE
from broker.keys import Keys
from broker.registry import WorkerInfo, worker_registry
from broker.runner import Runner
from broker.server import RedisServer
from tests.stack import isolated_settings
from tests.web.conftest import LiveFleet, RequestIds
from web.app import create_app

CHAT = "/v1/chat/completions"
BIG = 256 * 1024


@pytest.fixture
def full_redis() -> Iterator[RedisServer]:
    with RedisServer(maxmemory="4mb") as server:
        yield server


def fill(server: RedisServer) -> int:
    """Write junk until Redis refuses even a tiny write (noeviction at maxmemory): big
    pieces first, then smaller ones into what is left; the number of keys written."""
    client = redis.Redis.from_url(server.url)
    written = 0
    try:
        for size in (BIG, 4096, 64, 1):
            while written < 100_000:
                try:
                    client.set(f"junk:{written}", b"j" * size)
                except redis.exceptions.OutOfMemoryError:
                    break
                written += 1
        assert written < 100_000, "Redis never refused a write: no maxmemory is set"
        # Connection buffers freed later (this client's, for one) would let small writes
        # in again: put the limit a little under what Redis holds now.
        used = int(client.info("memory")["used_memory"])
        client.config_set("maxmemory", used - 256 * 1024)
        with pytest.raises(redis.exceptions.OutOfMemoryError):
            client.set("probe", "1")
        return written
    finally:
        client.close()


def upload(client: FlaskClient, content: bytes = b'{"a": 1}\n') -> Any:
    return client.post(
        "/v1/files",
        data={"purpose": "batch", "file": (io.BytesIO(content), "in.jsonl")},
        content_type="multipart/form-data",
    )


def assert_unavailable(resp: Any) -> None:
    assert resp.status_code == 503, resp.get_data(as_text=True)
    assert resp.headers["Retry-After"] == "1"
    error = resp.get_json()["error"]
    assert error["type"] == "service_unavailable_error", error


def test_a_full_redis_is_503_and_deletes_still_work(
    full_redis: RedisServer, models_dir: Path
) -> None:
    settings = isolated_settings(full_redis.url, models_dir)
    LiveFleet(settings)
    runner = Runner(settings, new_id=RequestIds())
    app = create_app(settings, runner=runner)
    app.testing = True
    client = app.test_client()
    kept = upload(client)
    assert kept.status_code == 200, kept.get_data(as_text=True)
    fid = kept.get_json()["id"]

    written = fill(full_redis)
    resp = client.post(CHAT, json={"messages": [{"role": "user", "content": "hi"}]})
    assert_unavailable(resp)
    assert resp.get_json()["error"]["message"] == UNAVAILABLE_MESSAGE
    stream = client.post(
        CHAT, json={"messages": [{"role": "user", "content": "hi"}], "stream": True}
    )
    assert_unavailable(stream)
    assert runner.store.in_flight(time.time()) == 0  # no admission slot is left held
    assert_unavailable(upload(client, b'{"b": 2}\n' * 1000))

    assert client.get(f"/v1/files/{fid}").status_code == 200  # reads work
    deleted = client.delete(f"/v1/files/{fid}")
    assert deleted.status_code == 200, deleted.get_data(as_text=True)
    assert deleted.get_json() == {"id": fid, "object": "file", "deleted": True}
    assert client.get(f"/v1/files/{fid}").status_code == 404

    # Deleting frees memory: once the junk is gone, writes succeed again.
    raw = redis.Redis.from_url(full_redis.url)
    try:
        for start in range(0, written, 1000):
            raw.delete(*[f"junk:{i}" for i in range(start, min(start + 1000, written))])
    finally:
        raw.close()
    assert upload(client).status_code == 200


def test_the_private_redis_runs_with_maxmemory_and_noeviction(models_dir: Path) -> None:
    """``tokenrelay up`` starts its Redis with ``redis_server_args(maxmemory=
    settings.redis_maxmemory)``; this is that command line, running."""
    settings = isolated_settings("redis://unused", models_dir, redis_maxmemory="64mb")
    with RedisServer(maxmemory=settings.redis_maxmemory) as server:
        client = redis.Redis.from_url(server.url)
        try:
            config = client.config_get("maxmemory*")
        finally:
            client.close()
    assert config["maxmemory"] == str(64 * 1024 * 1024)
    assert config["maxmemory-policy"] == "noeviction"
    assert isolated_settings("redis://unused", models_dir).redis_maxmemory == "4gb"


def test_heartbeats_keep_the_fleet_visible_while_redis_is_full(full_redis: RedisServer) -> None:
    """Line 3's "heartbeats fail": a full Redis refuses the beat's SET and ZADD; the beat
    extends the member's key instead, so the worker stays live (and the web tier ready)
    for as long as Redis stays full, and beats in full once room is made."""
    client = redis.Redis.from_url(full_redis.url)
    registry = worker_registry(client, Keys("hb:"), ttl_s=1.0)
    info = WorkerInfo(
        worker_id="w1", model="m", engine="echo", capacity=1, hostname="h", pid=1, started=0.0
    )
    try:
        registry.heartbeat(info)
        fill(full_redis)
        # Well under what Redis holds, so that no freed buffer lets a write in again.
        used = int(client.info("memory")["used_memory"])
        client.config_set("maxmemory", used - 1024 * 1024)
        with pytest.raises(redis.exceptions.OutOfMemoryError):
            client.set("probe", "1")
        for _ in range(6):  # 3 s: three times the TTL
            time.sleep(0.5)
            registry.heartbeat(info.model_copy(update={"active_jobs": 1}))
            assert [w.worker_id for w in registry.live()] == ["w1"]
        # The key was only extended: it still says what the last full beat said.
        assert registry.live()[0].active_jobs == 0
        client.config_set("maxmemory", 0)  # room again
        registry.heartbeat(info.model_copy(update={"active_jobs": 2}))
        assert registry.live()[0].active_jobs == 2
        # A member that stops beating still disappears after its TTL.
        time.sleep(1.2)
        assert registry.live() == []
    finally:
        client.close()
