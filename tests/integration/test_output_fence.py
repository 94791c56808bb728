"""A streamer's output write is fenced by its hand-off entry, on a real redis-server: a
streamer that stalled between decoding and writing (SIGSTOP, a long pause) must not
append stale text after the streamer that took its request over
(tests/faults/test_streamer_stall.py failed about half the time before this)."""

from __future__ import annotations

import time
import uuid

import pytest
import redis

from app.messages import OutputEvent, OutputKind
from broker.handoff import GROUP, RequestHandoff
from broker.keys import Keys
from broker.outputs import OutputEntry, OutputStreams

pytestmark = pytest.mark.integration


def entry(rid: str, handoff_id: str, text: str) -> OutputEntry:
    return OutputEntry(
        rid, [OutputEvent(OutputKind.DELTA, 0, text)], "1-0", first=True, handoff_id=handoff_id
    )


def texts(outputs: OutputStreams, rid: str) -> list[str]:
    return [ev.text or "" for _n, events in outputs.read(rid) for ev in events]


def two_requests(
    redis_client: redis.Redis, consumer: str
) -> tuple[Keys, RequestHandoff, OutputStreams, str, str]:
    """Requests "a" and "b" handed off to ``consumer``, under a prefix of their own."""
    keys = Keys(f"fence{uuid.uuid4().hex[:6]}:")
    handoff = RequestHandoff(redis_client, keys)
    handoff.ensure_group()
    redis_client.xadd(keys.new_requests, {"r": "a"})
    redis_client.xadd(keys.new_requests, {"r": "b"})
    (a_id, _), (b_id, _) = handoff.claim_new(consumer)
    return keys, handoff, OutputStreams(redis_client, keys, ttl_s=60), a_id, b_id


def test_only_the_owner_of_the_handoff_entry_writes(redis_client: redis.Redis) -> None:
    keys, _handoff, outputs, a_id, b_id = two_requests(redis_client, "s1")

    # Both are s1's: both written.
    assert outputs.write([entry("a", a_id, "a1"), entry("b", b_id, "b1")], owner="s1") == set()
    # s2 takes request a over (what XAUTOCLAIM does after the takeover time).
    redis_client.xclaim(keys.new_requests, GROUP, "s2", 0, [a_id], justid=True)
    taken = outputs.write([entry("a", a_id, "a2-stale"), entry("b", b_id, "b2")], owner="s1")
    assert taken == {"a"}
    assert outputs.write([entry("a", a_id, "a2")], owner="s2") == set()
    assert texts(outputs, "a") == ["a1", "a2"]  # the stale write never landed
    assert texts(outputs, "b") == ["b1", "b2"]
    assert redis_client.ttl(keys.output("a")) > 0

    # An entry pending for no one (acked, or lost with Redis's data) does not fence: the
    # request must still be able to end with its error.
    redis_client.xack(keys.new_requests, GROUP, b_id)
    assert outputs.write([entry("b", b_id, "b3")], owner="s1") == set()
    assert texts(outputs, "b") == ["b1", "b2", "b3"]


def test_a_takeover_changes_the_epoch_a_writer_trusts(redis_client: redis.Redis) -> None:
    """A streamer that knows its entries' owners under the current hand-off epoch skips
    the per-entry owner check (two fifths of the write's cost in Redis). Every takeover
    sets a new epoch in the same call as its XAUTOCLAIM, so a writer that trusted the
    old one checks every entry again and its stale write is fenced; touching our entries
    never takes one back from the streamer that took it over."""
    keys, handoff, outputs, a_id, b_id = two_requests(redis_client, "s1")

    owners, epoch = handoff.owners([a_id, b_id])
    assert owners == {a_id: "s1", b_id: "s1"} and epoch == ""
    outputs.fence_epoch = epoch
    assert outputs.write([entry("a", a_id, "a1"), entry("b", b_id, "b1")], owner="s1") == set()

    # s1 stops touching its entries; s2 takes over what has been idle 50 ms.
    handoff.touch("s1", [b_id])  # b is still worked on
    time.sleep(0.1)
    handoff.touch("s1", [b_id])
    assert handoff.take_over("s2", min_idle_ms=50) == [(a_id, "a")]
    assert redis_client.get(keys.handoff_epoch) not in (None, b"")

    # s1 still trusts the old epoch: the script sees it changed and checks each entry.
    taken = outputs.write([entry("a", a_id, "a2-stale"), entry("b", b_id, "b2")], owner="s1")
    assert taken == {"a"}
    assert texts(outputs, "a") == ["a1"]
    assert texts(outputs, "b") == ["b1", "b2"]

    # A touch by s1 (it has not noticed yet) leaves a with s2.
    handoff.touch("s1", [a_id, b_id])
    owners, new_epoch = handoff.owners([a_id, b_id])
    assert owners == {a_id: "s2", b_id: "s1"} and new_epoch != epoch

    # A take-over that claims nothing leaves the epoch alone.
    assert handoff.take_over("s3", min_idle_ms=60_000) == []
    assert handoff.owners([])[1] == new_epoch


def test_plain_entries_are_fenced_too(redis_client: redis.Redis) -> None:
    """Most entries are written as step lines the streamer joins itself (an ordinal,
    neither the request's first chunk nor a checkpoint: ``scripts.WRITE_OUTPUTS``'s
    plain entries); when the hand-off epoch changed they are checked as the others are,
    and a stale one's line is left out of the step entry."""
    _keys, handoff, outputs, a_id, b_id = two_requests(redis_client, "s1")
    outputs.fence_epoch = handoff.owners([a_id, b_id])[1]

    def chunk(rid: str, handoff_id: str, text: str, n: int, mark: bool = False) -> OutputEntry:
        event = OutputEvent(OutputKind.DELTA, 0, text)
        mark = mark or n == 1
        return OutputEntry(
            rid, [event], str(n), n == 1, handoff_id=handoff_id, n=n, checkpoint=mark
        )

    assert outputs.write([chunk("a", a_id, "a1", 1), chunk("b", b_id, "b1", 1)], "s1") == set()
    assert outputs.write([chunk("a", a_id, "a2", 2), chunk("b", b_id, "b2", 2)], "s1") == set()
    handoff.touch("s1", [b_id])
    time.sleep(0.1)
    handoff.touch("s1", [b_id])
    assert handoff.take_over("s2", min_idle_ms=50) == [(a_id, "a")]

    stale = [chunk("b", b_id, "b3", 3), chunk("a", a_id, "a3-stale", 3)]
    assert outputs.write(stale, "s1") == {"a"}
    assert texts(outputs, "a") == ["a1", "a2"]
    assert texts(outputs, "b") == ["b1", "b2", "b3"]
