"""The key space on a Redis Cluster (``broker.keys``, ``broker.cluster``), the shard
queues (``broker.celery_app``) and the placement of new requests
(``broker.placement``), without a server: every key a script uses together must be in
one slot, and one Redis's keys must be exactly what they were."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

import pytest
from redis.crc import key_slot

from broker.celery_app import queue_depths, queue_name, shard_queues, worker_queues
from broker.cluster import SLOTS, shard_of, shard_tags
from broker.keys import Keys
from broker.placement import ShardPlacement

pytestmark = pytest.mark.unit


def slot(key: str) -> int:
    return int(key_slot(key.encode()))


@pytest.mark.parametrize("count", [1, 2, 3, 4, 5, 8, 16, 64])
def test_shard_tags_spread_over_the_slot_range(count: int) -> None:
    tags = shard_tags(count)
    assert len(tags) == len(set(tags)) == count
    for k, tag in enumerate(tags):
        assert k * SLOTS // count <= slot(tag) < (k + 1) * SLOTS // count
    assert shard_tags(count) == tags  # the same in every process


def test_one_redis_keeps_its_key_names() -> None:
    k = Keys("tr:")
    assert k.of("r1") is k and k.at(0) is k and k.all_shards() == [k]
    assert (k.request("r1"), k.tokens("r1"), k.output("r1")) == (
        "tr:req:r1",
        "tr:tok:r1",
        "tr:out:r1",
    )
    assert (k.fence_epoch, k.new_requests, k.steps("w"), k.output_steps("s")) == (
        "tr:fence:epoch",
        "tr:new",
        "tr:steps:w",
        "tr:osteps:s",
    )
    assert (k.inflight, k.usage_total, k.fair_owners("m")) == (
        "tr:inflight",
        "tr:usage:total",
        "tr:fq:{m}",
    )
    assert k.tokens_prefix() + "r1" == k.tokens("r1")
    assert k.index_of("r1") == 0 and not k.clustered


def test_what_a_script_uses_with_a_request_shares_its_slot() -> None:
    keys = Keys("tr:", 3)
    for _ in range(50):
        rid = uuid.uuid4().hex
        k = keys.of(rid)
        together = [
            keys.request(rid),
            keys.lease(rid),
            keys.tokens(rid),
            keys.output(rid),
            keys.cancel(rid),
            keys.followers(rid),
            keys.usage_done(rid),
            k.fence_epoch,
            k.new_requests,
            k.handoff_epoch,
            k.steps("w1"),
            k.output_steps("s1"),
            k.hub_wake("h1"),
            k.usage_total,
            k.usage_day("2026-12-05"),
            k.tokens_prefix() + rid,
            k.output_prefix() + rid,
        ]
        assert {slot(x) for x in together} == {slot(keys.request(rid))}
        assert keys.index_of(rid) == shard_of(rid, 3) == k.shard


def test_global_keys_share_the_global_slot() -> None:
    keys = Keys("tr:", 3)
    names = [
        keys.inflight,
        keys.inflight_weights,
        keys.rate_requests("o", 1),
        keys.rate_tokens("o", 1),
        keys.rate_settled("r1"),
        keys.member("worker", "w1"),
        keys.members("worker"),
        keys.models,
        keys.api_keys,
        keys.batch("b1"),
        keys.batch_lock("b1"),
        keys.fair_owners("m"),
        keys.fair_requests("m", "o"),
        keys.worker_homes,
        keys.response("resp1"),
    ]
    assert len({slot(n) for n in names}) == 1
    assert all(n.startswith("tr:{g}:") for n in names)


def test_an_unbound_cluster_builder_refuses_shard_scoped_keys() -> None:
    keys = Keys("tr:", 3)
    with pytest.raises(RuntimeError):
        _ = keys.fence_epoch
    with pytest.raises(RuntimeError):
        keys.steps("w1")
    assert [k.shard for k in keys.all_shards()] == [0, 1, 2]
    assert keys.at(1) is keys.at(1)


def test_shard_queues_and_a_workers_order() -> None:
    assert shard_queues("interactive", "m") == ["tr.interactive.m"]
    assert shard_queues("interactive", "m", 3, 1) == ["tr.interactive.m.s1", "tr.interactive.m"]
    assert shard_queues("batch", "m", 3) == [
        "tr.batch.m.s0",
        "tr.batch.m.s1",
        "tr.batch.m.s2",
        "tr.batch.m",
    ]
    assert worker_queues("m", "w1", shards=3, home=2) == [
        "tr.worker.m.w1",
        "tr.interactive.m.s2",
        "tr.interactive.m",
        "tr.batch.m.s2",
        "tr.batch.m",
    ]
    assert worker_queues("m", "w1") == ["tr.worker.m.w1", "tr.interactive.m", "tr.batch.m"]
    assert queue_name("interactive", "m", 0) == "tr.interactive.m.s0"


class _Lengths:
    """A pipeline of LLENs over fixed list lengths."""

    def __init__(self, lengths: dict[str, int]) -> None:
        self.lengths, self.calls = lengths, []  # type: ignore[var-annotated]

    def pipeline(self, transaction: bool = False) -> _Lengths:
        return self

    def llen(self, key: str) -> None:
        self.calls.append(key)

    def execute(self) -> list[int]:
        return [self.lengths.get(k, 0) for k in self.calls]


def test_queue_depths_count_the_shard_queues_with_theirs() -> None:
    client: Any = _Lengths(
        {"tr.interactive.m.s0": 2, "tr.interactive.m.s2": 3, "tr.interactive.m": 1}
    )
    depths = queue_depths(client, "m", 3)
    assert depths["tr.interactive.m"] == 6 and depths["tr.batch.m"] == 0
    assert queue_depths(_Lengths({"tr.interactive.m": 4}), "m")["tr.interactive.m"] == 4  # type: ignore[arg-type]


@dataclass
class _Worker:
    model: str
    home: int


class _Registry:
    def __init__(self, workers: list[_Worker]) -> None:
        self.workers = workers

    def live(self) -> list[_Worker]:
        return self.workers


def test_new_requests_go_to_the_live_workers_homes_in_turn() -> None:
    keys = Keys("tr:", 3)
    registry = _Registry([_Worker("m", 0), _Worker("m", 2), _Worker("other", 1)])
    now = [0.0]
    placement = ShardPlacement(keys, registry, clock=lambda: now[0])
    draw = placement.ids(lambda: uuid.uuid4().hex)
    shards = [keys.index_of(draw()) for _ in range(9)]
    assert shards == [0, 1, 2] * 3  # every live worker's home, any model's
    rid = next(r for r in (uuid.uuid4().hex for _ in range(100)) if keys.index_of(r) == 1)
    assert placement.queue_shard("other", rid) == 1
    assert placement.queue_shard("m", rid) is None  # no worker of m at home on 1: shared
    registry.workers = [_Worker("m", 1)]
    assert placement.queue_shard("m", rid) is None  # read again only after a second
    now[0] = 1.5
    assert placement.queue_shard("m", rid) == 1


def test_with_no_worker_every_shard_takes_new_requests() -> None:
    keys = Keys("tr:", 3)
    draw = ShardPlacement(keys, _Registry([])).ids(lambda: uuid.uuid4().hex)
    assert sorted({keys.index_of(draw()) for _ in range(6)}) == [0, 1, 2]


def test_the_sharded_hub_has_the_output_hubs_interface() -> None:
    """Whatever holds an ``output_hub`` (web routes, the relay benchmark) may hold either:
    every public method and property of ``OutputHub`` that is not its reader's own state
    is on ``ShardedHub`` too."""
    import inspect

    from broker.hub import OutputHub
    from broker.shard_hub import ShardedHub

    public = {
        name
        for name, member in inspect.getmembers(OutputHub)
        if not name.startswith("_") and (callable(member) or isinstance(member, property))
    }
    missing = sorted(name for name in public if not hasattr(ShardedHub, name))
    assert not missing, f"ShardedHub lacks {missing}"
