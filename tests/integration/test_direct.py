"""``DirectConnection`` against a real redis-server: it answers as the client does, and
it survives what the pool would have hidden (a killed connection, a lost script)."""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any

import pytest
import redis

from broker import direct
from broker.connection import redis_client
from broker.direct import DirectConnection, read_rest, xread_command
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


def blocked_read(
    via: DirectConnection, streams: dict[str, str]
) -> tuple[threading.Thread, list[Any]]:
    """A blocking XREAD of ``streams`` on ``via``'s connection, sent now; the returned
    thread (started) puts its reply into the returned list."""
    via.send(xread_command(streams, count=10, block_ms=5000))
    got: list[Any] = []
    thread = threading.Thread(target=lambda: got.append(via.reply("XREAD")))
    thread.start()
    return thread, got


def wait_blocked(client: redis.Redis) -> None:
    deadline = time.monotonic() + 5
    while int(client.info("clients")["blocked_clients"]) < 1:
        assert time.monotonic() < deadline, "the read never blocked"
        time.sleep(0.01)


def xread_calls(client: redis.Redis) -> int:
    stats: Any = client.info("commandstats")
    return int(stats.get("cmdstat_xread", {}).get("calls", 0))


def test_one_script_writing_many_streams_is_read_whole(client: redis.Redis) -> None:
    """Redis wakes a reader blocked on many streams with the first one a script wrote
    (an engine step's publish, a streamer's output write): read_rest reads the others
    at once, so the step is handled in one cycle."""
    keys = [f"s-{uuid.uuid4().hex}" for _ in range(4)]
    streams = {k: "0-0" for k in keys}
    via = DirectConnection(client)
    reader, got = blocked_read(via, streams)
    wait_blocked(client)
    client.eval(
        "for i, k in ipairs(KEYS) do redis.call('XADD', k, '*', 'e', i) end", len(keys), *keys
    )
    reader.join()
    first = got[0]
    assert [k.decode() for k, _ in first] == keys[:1]  # what Redis hands a blocked read
    whole = read_rest(via, streams, first, count=10)
    assert sorted(k.decode() for k, _ in whole) == sorted(keys)
    assert {k.decode(): [f[b"e"] for _, f in e] for k, e in whole} == {
        k: [str(i).encode()] for i, k in enumerate(keys, start=1)
    }


def test_no_extra_read_for_one_stream_or_a_quiet_one(client: redis.Redis) -> None:
    """A reader of one stream (plus a quiet wake-up stream) pays no extra round trip
    per entry; an empty reply (a timeout) none either."""
    key, wake = f"s-{uuid.uuid4().hex}", f"w-{uuid.uuid4().hex}"
    client.xadd(key, {"e": b"1"})
    via = DirectConnection(client)
    streams = {key: "0-0", wake: "0-0"}
    reply = via.call(*xread_command(streams, count=10, block_ms=None))
    before = xread_calls(client)
    assert read_rest(via, streams, reply, count=10, quiet=(wake,)) is reply
    assert read_rest(via, streams, [], count=10) == []
    assert xread_calls(client) == before
    # Without ``quiet`` the wake-up stream is read too (one call, nothing there).
    assert read_rest(via, streams, reply, count=10) == reply
    assert xread_calls(client) == before + 1
