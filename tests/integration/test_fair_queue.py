"""Fair share between API keys where a worker takes its next job (``broker.fair_queue``),
on a real Redis: start-time fair queuing over per-key queues, ``priority`` within a key,
weights, an idle key that cannot bank turns, and a resend that keeps a request's place.
"""

from __future__ import annotations

import uuid

import redis

from broker.fair_queue import BURST_TURNS, FairQueue
from broker.keys import Keys


def queue(client: redis.Redis) -> FairQueue:
    return FairQueue(client, Keys(f"t{uuid.uuid4().hex[:6]}:"), ttl_s=60)


def drain(fq: FairQueue, model: str = "m") -> list[str]:
    taken = []
    while (rid := fq.pop(model)) is not None:
        taken.append(rid)
    return taken


def test_a_flood_does_not_hold_back_a_key_that_sends_a_few(redis_client: redis.Redis) -> None:
    fq = queue(redis_client)
    for i in range(200):
        fq.push("m", "A", f"a{i}")
    for i in range(3):
        fq.push("m", "B", f"b{i}")
    order = drain(fq)
    assert len(order) == 203
    # B's three come within the first six: turns alternate while both wait.
    assert {order.index(f"b{i}") for i in range(3)} <= set(range(6))
    assert [r for r in order if r.startswith("a")] == [f"a{i}" for i in range(200)]


def test_weights_share_turns_in_proportion(redis_client: redis.Redis) -> None:
    fq = queue(redis_client)
    for i in range(90):
        fq.push("m", "heavy", f"h{i}", weight=3)
    for i in range(30):
        fq.push("m", "light", f"l{i}", weight=1)
    order = drain(fq)
    # Past the first turns (each key's burst), three to one.
    window = order[40:60]
    assert 14 <= sum(r.startswith("h") for r in window) <= 16, window


def test_priority_orders_within_one_key_only(redis_client: redis.Redis) -> None:
    fq = queue(redis_client)
    fq.push("m", "A", "late", priority=5)
    fq.push("m", "A", "urgent", priority=-1)
    fq.push("m", "A", "normal")
    fq.push("m", "B", "b0", priority=100)  # B's priority does not push it behind A's
    assert drain(fq) == ["urgent", "b0", "normal", "late"]


def test_an_idle_key_gets_a_bounded_burst_then_shares(redis_client: redis.Redis) -> None:
    fq = queue(redis_client)
    for i in range(100):
        fq.push("m", "A", f"a{i}")
    assert [fq.pop("m") for _ in range(40)] == [f"a{i}" for i in range(40)]
    for i in range(30):  # B was idle meanwhile: a burst of its turns, then turn about
        fq.push("m", "B", f"b{i}")
    rest = drain(fq)
    assert rest[:BURST_TURNS] == [f"b{i}" for i in range(BURST_TURNS)]
    after = rest[BURST_TURNS : BURST_TURNS + 10]
    assert sum(r.startswith("b") for r in after) == 5  # then they alternate


def test_a_resend_keeps_the_request_s_place_and_models_are_apart(
    redis_client: redis.Redis,
) -> None:
    fq = queue(redis_client)
    for rid in ("x", "y", "z"):
        fq.push("m", "A", rid)
    fq.push("other", "A", "elsewhere")
    fq.push("m", "A", "x", weight=0)  # the streamers' resend: still queued, stays first
    assert drain(fq) == ["x", "y", "z"]
    fq.push("m", "A", "y", weight=0)  # taken meanwhile and lost: back in the queue
    assert drain(fq) == ["y"]
    assert drain(fq, "other") == ["elsewhere"]
