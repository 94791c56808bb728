"""A web process's output hub reads the outputs of a streamer's write from that
streamer's output step stream: one entry per write instead of one stream per request
(``broker.hub.OutputHub``, ``scripts.WRITE_OUTPUTS``; real redis-server).

Whatever the step stream misses (a line it does not have, a second reader, a full
buffer, another streamer, a key that is not a stream), the hub reads the request's own
stream again: every reader gets every entry once, in order."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
import redis

from app.messages import OutputEvent, OutputKind
from broker import hub as hub_module
from broker.hub import OutputHub
from broker.keys import Keys
from broker.outputs import OutputEntry, OutputStreams
from broker.subscription import Subscription

pytestmark = pytest.mark.integration


@pytest.fixture
def keys() -> Keys:
    return Keys(f"tr-{uuid.uuid4().hex[:6]}:")


@pytest.fixture
def hub(redis_client: redis.Redis, keys: Keys) -> Iterator[OutputHub]:
    hub = OutputHub(redis_client, keys, block_ms=200)
    yield hub
    hub.stopping.set()


class Writer:
    """Writes outputs as streamer ``owner`` does: fenced, with the output step stream."""

    def __init__(self, client: redis.Redis, keys: Keys, owner: str) -> None:
        self.outputs = OutputStreams(client, keys)
        self.owner = owner
        self.count = 0

    def write(self, *texts: tuple[str, str]) -> None:
        """One write call: ``(request id, text)`` for each request it appends to."""
        entries = []
        for rid, text in texts:
            events = [OutputEvent(OutputKind.DELTA, 0, text)]
            entries.append(OutputEntry(rid, events, f"{self.count}-0", first=self.count == 0))
        self.count += 1
        assert self.outputs.write(entries, owner=self.owner) == set()


def take_texts(sub: Subscription, n: int) -> list[str]:
    out = []
    for _ in range(n):
        _eid, events = sub.take(5.0)
        out += [ev.text for ev in events]
    return out


def streaming(hub: OutputHub, client: redis.Redis, keys: Keys) -> tuple[Writer, Subscription]:
    """Request r1 followed by the hub, with its first two entries ("0 ", "1 ") taken."""
    writer = Writer(client, keys, "streamer-a")
    sub = hub.subscribe("r1")
    writer.write(("r1", "0 "))
    writer.write(("r1", "1 "))
    assert take_texts(sub, 2) == ["0 ", "1 "]
    return writer, sub


def test_outputs_come_through_the_step_stream_once_the_first_names_its_streamer(
    hub: OutputHub, redis_client: redis.Redis, keys: Keys
) -> None:
    writer = Writer(redis_client, keys, "streamer-a")
    subs = {rid: hub.subscribe(rid) for rid in ("r1", "r2")}
    writer.write(("r1", "a0"), ("r2", "b0"))
    assert take_texts(subs["r1"], 1) == ["a0"] and take_texts(subs["r2"], 1) == ["b0"]
    for i in range(1, 20):
        writer.write(("r1", f"a{i}"), ("r2", f"b{i}"))
    assert take_texts(subs["r1"], 19) == [f"a{i}" for i in range(1, 20)]
    assert take_texts(subs["r2"], 19) == [f"b{i}" for i in range(1, 20)]
    assert hub.stepped >= 30  # most of them from the step stream, not the own streams
    entry = redis_client.xrevrange(keys.output("r1"), count=1)[0][1]
    assert entry[b"n"] == b"20" and entry[b"w"] == b"streamer-a"


def test_an_entry_missing_from_the_step_stream_is_read_from_its_own_stream(
    hub: OutputHub, redis_client: redis.Redis, keys: Keys
) -> None:
    writer, sub = streaming(hub, redis_client, keys)
    # Appended by something else (no step line): the next line's ordinal jumps.
    unowned = OutputStreams(redis_client, keys)
    unowned.write([OutputEntry("r1", [OutputEvent(OutputKind.DELTA, 0, "2 ")], "x")])
    for i in range(3, 8):
        writer.write(("r1", f"{i} "))
    assert take_texts(sub, 6) == [f"{i} " for i in range(2, 8)]


def test_a_second_reader_and_a_full_buffer_each_get_every_entry_in_order(
    redis_client: redis.Redis, keys: Keys
) -> None:
    hub = OutputHub(redis_client, keys, block_ms=200, buffer_bytes=200)
    try:
        writer = Writer(redis_client, keys, "streamer-a")
        first = hub.subscribe("r1")
        writer.write(("r1", "t0 "))
        assert take_texts(first, 1) == ["t0 "]
        for i in range(1, 40):  # the reader takes nothing: its buffer fills and pauses
            writer.write(("r1", f"t{i} "))
        second = hub.subscribe("r1")  # from the start, while the first is followed
        assert take_texts(first, 39) == [f"t{i} " for i in range(1, 40)]
        assert take_texts(second, 40) == [f"t{i} " for i in range(40)]
        for i in range(40, 45):
            writer.write(("r1", f"t{i} "))
        assert take_texts(first, 5) == take_texts(second, 5) == [f"t{i} " for i in range(40, 45)]
    finally:
        hub.stopping.set()


def test_a_request_another_streamer_writes_is_read_on_its_own_after_a_quiet_second(
    hub: OutputHub, redis_client: redis.Redis, keys: Keys, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(hub_module, "STEP_QUIET_S", 0.3)
    a = Writer(redis_client, keys, "streamer-a")
    b = Writer(redis_client, keys, "streamer-b")
    b.count = 1  # not the stream's first write (its TTL is set)
    sub = hub.subscribe("r1")
    for i in range(3):
        a.write(("r1", f"a{i} "))
    assert take_texts(sub, 3) == ["a0 ", "a1 ", "a2 "]
    for i in range(3):  # taken over: streamer-b's step stream is not followed yet
        b.write(("r1", f"b{i} "))
    assert take_texts(sub, 3) == ["b0 ", "b1 ", "b2 "]
    stepped = hub.stepped
    for i in range(3, 6):
        b.write(("r1", f"b{i} "))
    assert take_texts(sub, 3) == ["b3 ", "b4 ", "b5 "]
    assert hub.stepped > stepped  # following streamer-b's step stream now


def test_a_step_stream_key_that_is_not_a_stream_is_left_and_nothing_is_lost(
    hub: OutputHub, redis_client: redis.Redis, keys: Keys
) -> None:
    _writer, sub = streaming(hub, redis_client, keys)
    # Overwritten by something else: the hub's read of it fails until it stops
    # following it; the script's step entry fails too, so write around it.
    redis_client.delete(keys.output_steps("streamer-a"))
    redis_client.set(keys.output_steps("streamer-a"), "not a stream")
    plain = OutputStreams(redis_client, keys)
    for i in range(2, 6):
        plain.write([OutputEntry("r1", [OutputEvent(OutputKind.DELTA, 0, f"{i} ")], "x")])
    assert take_texts(sub, 4) == ["2 ", "3 ", "4 ", "5 "]
