"""``DirectConnection`` against a real redis-server: it answers as the client does, and
it survives what the pool would have hidden (a killed connection, a lost script)."""

from __future__ import annotations

import uuid

import pytest
import redis

from broker import direct
from broker.connection import redis_client
from broker.direct import DirectConnection, xread_command
from broker.server import RedisServer

pytestmark = pytest.mark.integration


@pytest.fixture
def client(redis_server: RedisServer) -> redis.Redis:
    return redis_client(redis_server.url)


def kill_connections(client: redis.Redis, name: str) -> None:
    for c in client.client_list():
        if c.get("name") == name:
            client.client_kill_filter(_id=c["id"])


def test_replies_are_shaped_as_the_clients(client: redis.Redis) -> None:
    key = f"s-{uuid.uuid4().hex}"
    client.xadd(key, {"e": b"one"})
    client.xadd(key, {"e": b"two"})
    via = DirectConnection(client)
    streams = {key: "0-0"}
    assert via.call(*xread_command(streams, count=10, block_ms=None)) == client.xread(
        streams, count=10
    )
    # Nothing new: a blocking read times out with the client's empty reply.
    last = client.xrevrange(key, count=1)[0][0]
    assert via.call(*xread_command({key: last}, count=10, block_ms=10)) == client.xread(
        {key: last}, count=10, block=10
    )


def test_a_reply_error_leaves_the_connection_usable(client: redis.Redis) -> None:
    key = f"k-{uuid.uuid4().hex}"
    client.set(key, "not a stream")
    via = DirectConnection(client)
    via.call("CLIENT", "SETNAME", "direct-a")
    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
        via.call(*xread_command({key: "0-0"}, count=1, block_ms=None))
    assert via.call("CLIENT", "GETNAME") == b"direct-a"  # the same connection


def test_replies_of_one_send_come_in_order_after_an_error(client: redis.Redis) -> None:
    key = f"k-{uuid.uuid4().hex}"
    client.set(key, "1")
    via = DirectConnection(client)
    via.send(("LPUSH", key, "x"), ("INCR", key))
    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
        via.reply("LPUSH")
    assert via.reply("INCR") == 2


def test_a_killed_connection_fails_one_call_and_the_next_reconnects(
    client: redis.Redis,
) -> None:
    via = DirectConnection(client)
    via.call("CLIENT", "SETNAME", "direct-b")
    kill_connections(client, "direct-b")
    with pytest.raises(redis.ConnectionError):
        via.call("PING")
    assert via.call("PING") in (True, b"PONG")


def test_an_idle_connection_closed_meanwhile_is_replaced_without_an_error(
    client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    via = DirectConnection(client)
    via.call("CLIENT", "SETNAME", "direct-c")
    kill_connections(client, "direct-c")
    monkeypatch.setattr(direct, "STALE_AFTER_S", 0.0)  # "idle a while" is now
    assert via.call("PING") in (True, b"PONG")


def test_a_lost_script_is_loaded_again(client: redis.Redis) -> None:
    script = client.register_script("return ARGV[1] .. KEYS[1]")
    via = DirectConnection(client)
    assert via.evalsha(script, ["k"], ["a"]) == b"ak"
    client.script_flush()
    assert via.evalsha(script, ["k"], ["b"]) == b"bk"
