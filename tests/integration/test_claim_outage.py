"""A worker's claim goes through a short Redis outage (``claim_through_outage``): a
task that gave up at the first refused connection left its request to the streamers'
requeue, 30 s later by default; on a Redis Cluster one shard's master can be away for
a failover while the request was admitted on the others."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import redis

from broker.keys import Keys
from broker.publish import lease_value
from broker.requests import ClaimResult, RequestStore
from broker.server import RedisServer
from tests.stack import isolated_settings, make_record


def test_a_claim_waits_out_a_restart(tmp_path: Path, models_dir: Path) -> None:
    server = RedisServer(data_dir=tmp_path, appendonly=True, appendfsync="always").start()
    try:
        settings = isolated_settings(server.url, models_dir)
        client = redis.Redis.from_url(server.url, socket_connect_timeout=0.2)
        store = RequestStore(client, Keys(settings.key_prefix))
        record = make_record(settings, [[1, 2, 3]])
        store.create(record)
        server.kill()
        threading.Timer(0.8, server.start).start()
        started = time.monotonic()
        claim, loaded, again = store.claim_through_outage(record.request_id, 0, "w1", 30.0)
        assert claim is ClaimResult.OK
        assert loaded is not None and loaded.request_id == record.request_id
        assert not again
        assert 0.7 < time.monotonic() - started < 5
        assert client.get(store.keys.lease(record.request_id)) == b"w1:0"
    finally:
        server.stop()


def test_a_claim_that_ran_before_its_reply_was_lost_is_its_own(
    store: RequestStore, settings: object
) -> None:
    """The retry finds the lease held by this very attempt: the claim is OK, loaded."""
    record = make_record(settings, [[1, 2, 3]])  # type: ignore[arg-type]
    store.create(record)
    rid = record.request_id
    assert store.claim(rid, 0, "w1", 30.0, time.time()) is ClaimResult.OK
    calls = {"n": 0}
    real = store.claim_and_load

    def lost_once(*args: object) -> object:
        calls["n"] += 1
        if calls["n"] == 1:
            raise redis.ConnectionError("reply lost")
        return real(*args)  # type: ignore[arg-type]

    store.claim_and_load = lost_once  # type: ignore[method-assign,assignment]
    claim, loaded, again = store.claim_through_outage(rid, 0, "w1", 30.0)
    assert (claim, again) == (ClaimResult.OK, True)
    assert loaded is not None and loaded.request_id == rid
    assert store.redis.get(store.keys.lease(rid)) == lease_value("w1", 0).encode()
    # Another worker's attempt is still refused.
    assert store.claim_through_outage(rid, 0, "w2", 30.0)[0] is ClaimResult.HELD


@pytest.mark.parametrize("error", [redis.TimeoutError, redis.ConnectionError])
def test_a_claim_gives_up_after_its_time(store: RequestStore, error: type[Exception]) -> None:
    def failing(*_args: object) -> object:
        raise error("away")

    store.claim_and_load = failing  # type: ignore[method-assign,assignment]
    started = time.monotonic()
    with pytest.raises(error):
        store.claim_through_outage("r1", 0, "w1", 30.0, within_s=0.3)
    assert time.monotonic() - started < 1.0
