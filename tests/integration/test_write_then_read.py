"""``OutputStreams.write_then_read`` (the streamer's steady cycle: its output write
sent with its next blocking read) against a real redis-server: the outputs land while
the read still blocks, the fenced ids reach the caller, and a read that fails still
says whether the write ran, so the streamer never writes the same chunks twice."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from app.messages import OutputEvent, OutputKind
from broker.connection import redis_client
from broker.direct import DirectConnection
from broker.handoff import GROUP, RequestHandoff
from broker.keys import Keys
from broker.outputs import OutputEntry, OutputStreams
from broker.scripts import WRITE_OUTPUTS
from broker.server import RedisServer

pytestmark = pytest.mark.integration


@pytest.fixture
def client(redis_server: RedisServer) -> redis.Redis:
    return redis_client(redis_server.url)


@pytest.fixture
def s(client: redis.Redis) -> Iterator[Setup]:
    setup = Setup(client)
    yield setup
    setup.via.close()


class Setup:
    """Requests "a" and "b" handed off to streamer "s1", under a prefix of their own,
    and the streamer's connection."""

    def __init__(self, client: redis.Redis) -> None:
        self.client = client
        self.keys = Keys(f"wtr{uuid.uuid4().hex[:6]}:")
        handoff = RequestHandoff(client, self.keys)
        handoff.ensure_group()
        client.xadd(self.keys.new_requests, {"r": "a"})
        client.xadd(self.keys.new_requests, {"r": "b"})
        (self.a_id, _), (self.b_id, _) = handoff.claim_new("s1")
        self.outputs = OutputStreams(client, self.keys, ttl_s=60)
        self.via = DirectConnection(client)
        self.input = self.keys.tokens("a")  # what the read waits on
        self.written: list[set[str]] = []
        client.script_load(WRITE_OUTPUTS)  # as in a streamer's steady cycle

    def entries(self, text: str) -> list[OutputEntry]:
        return [
            OutputEntry(
                rid, [OutputEvent(OutputKind.DELTA, 0, text)], "1-0", first=True, handoff_id=hid
            )
            for rid, hid in (("a", self.a_id), ("b", self.b_id))
        ]

    def call(self, text: str, *, block_ms: int = 2000, stamp: str = "") -> Any:
        return self.outputs.write_then_read(
            self.entries(text),
            "s1",
            {self.input: "0-0"},
            count=16,
            block_ms=block_ms,
            on_written=self.written.append,
            via=self.via,
            stamp=stamp,
        )

    def texts(self, rid: str) -> list[str]:
        return [ev.text or "" for _n, events in self.outputs.read(rid) for ev in events]


def later(delay_s: float, fn: Any) -> threading.Thread:
    thread = threading.Thread(target=lambda: (time.sleep(delay_s), fn()), daemon=True)
    thread.start()
    return thread


def kill_named(client: redis.Redis, name: str) -> None:
    for c in client.client_list():
        if c.get("name") == name:
            client.client_kill_filter(_id=c["id"])


def test_written_before_the_read_returns_and_the_fenced_ids_come_back(
    client: redis.Redis, s: Setup
) -> None:
    # The read blocks until its input gets an entry; the outputs are there meanwhile.
    seen: list[list[str]] = []
    later(0.3, lambda: (seen.append(s.texts("a")), client.xadd(s.input, {"x": "1"})))
    reply = s.call("one")
    assert seen == [["one"]]  # written while the read still blocked
    assert [key for key, _ in reply] == [s.input.encode()]
    assert s.written == [set()]
    # Request a taken over by s2: the next write leaves it alone and says so.
    client.xclaim(s.keys.new_requests, GROUP, "s2", 0, [s.a_id], justid=True)
    s.call("two", block_ms=50)
    assert s.written == [set(), {"a"}]
    assert s.texts("a") == ["one"] and s.texts("b") == ["one", "two"]


def test_a_failed_read_still_tells_that_the_write_ran(client: redis.Redis, s: Setup) -> None:
    s.via.call("CLIENT", "SETNAME", "wtr-read")
    later(0.3, lambda: kill_named(client, "wtr-read"))
    with pytest.raises(redis.ConnectionError):
        s.call("one")
    assert s.written == [set()]  # known written: not to be written again
    assert s.texts("a") == ["one"]
    assert s.via.call("PING") in (True, b"PONG")  # reconnected, no reply left behind
    s.call("two", block_ms=50)  # the next cycle goes on
    assert s.texts("b") == ["one", "two"]


def test_a_write_not_answered_when_the_read_fails_is_left_unknown(
    client: redis.Redis, s: Setup
) -> None:
    """Redis holds the write (a client pause for writes) when the connection is lost:
    the caller is not told it ran, and no late reply is taken for the next call's.
    Whether it ran after all is then Redis's to say (``landed``: the streamer asks
    before writing it again)."""
    s.via.call("CLIENT", "SETNAME", "wtr-read")
    client.execute_command("CLIENT", "PAUSE", 1500, "WRITE")
    try:
        later(0.2, lambda: kill_named(client, "wtr-read"))
        with pytest.raises(redis.ConnectionError):
            s.call("one", stamp="7")
        assert s.written == []
    finally:
        client.execute_command("CLIENT", "UNPAUSE")
    assert s.via.call("PING") in (True, b"PONG")
    time.sleep(0.1)
    assert s.outputs.landed("s1", "7") == (s.texts("a") == ["one"])


def test_a_lost_script_is_loaded_and_the_write_redone(client: redis.Redis, s: Setup) -> None:
    client.script_flush()
    later(0.2, lambda: client.xadd(s.input, {"x": "1"}))
    reply = s.call("one")
    assert reply and s.written == [set()]
    assert s.texts("a") == ["one"] and s.texts("b") == ["one"]
