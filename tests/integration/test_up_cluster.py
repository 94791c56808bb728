"""``tokenrelay up --redis-cluster 3``'s Redis: a private cluster (3 masters, a replica
each) and a private redis-server for Celery, both supervised children of ``up``, and the
settings every child is given. A killed node is restarted and the cluster serves on;
``up`` started again on its run directory finds its cluster and data. (The rest of the
stack on a cluster: the e2e and fault tests.)"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
from redis.exceptions import RedisClusterException

from app.settings import Settings
from broker.server import free_port
from tests.stack import wait_for
from tests.upstack import pid_alive
from workers.up import Stack
from workers.up_options import parse_args

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(autouse=True)
def _no_settings_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in [v for v in os.environ if v.startswith("TOKENRELAY_")]:
        monkeypatch.delenv(var)


def cluster_ok(url: str) -> bool:
    try:
        with redis.RedisCluster.from_url(url) as client:
            infos = client.cluster_info(target_nodes=redis.RedisCluster.ALL_NODES)
    except (redis.RedisError, RedisClusterException):  # e.g. its one node is restarting
        return False
    return all(info["cluster_state"] == "ok" for info in infos.values())


@pytest.fixture
def start_redis_of_up(tmp_path: Path, models_dir: Path) -> Iterator[Callable[[], Stack]]:
    """Run ``up``'s Redis start-up only (no other child) on one run directory; at the
    end stop everything each start started."""
    argv = ["--redis-cluster", "3", "--run-dir", str(tmp_path), "--redis-port", str(free_port())]
    stacks: list[Stack] = []

    def start() -> Stack:
        _, options = parse_args(argv)
        stack = Stack(Settings(models_dir=models_dir), options, threading.Event())
        (tmp_path / "logs").mkdir(exist_ok=True)
        stacks.append(stack)
        stack.settings = stack.settings.model_copy(update=stack.start_redis())
        return stack

    try:
        yield start
    finally:
        for stack in stacks:
            stack.stop()


def test_up_starts_a_cluster_and_a_redis_for_celery_for_its_children(
    start_redis_of_up: Callable[[], Stack],
) -> None:
    stack = start_redis_of_up()
    cluster = stack.cluster
    assert cluster is not None and len(cluster.nodes) == 6
    assert [n.role for n in cluster.nodes] == ["master"] * 3 + ["replica"] * 3

    env = stack._child_env()
    assert env["TOKENRELAY_REDIS_URL"] == cluster.url
    assert env["TOKENRELAY_REDIS_CLUSTER"] == "yes"
    celery_port = stack.options.redis_port
    assert env["TOKENRELAY_CELERY_URL"] == f"redis://127.0.0.1:{celery_port}/0"
    with redis.Redis(port=celery_port) as celery:  # a plain server, as kombu needs
        assert celery.info("cluster")["cluster_enabled"] == 0
    assert cluster_ok(cluster.url)

    # Every node is a supervised child, stopped with Redis (last), its data in run/.
    names = [f"redis-node-{i}" for i in range(1, 7)]
    assert stack.redis_names == ["redis", *names]
    assert set(stack.supervisor.slots) == {"redis", *names}
    cluster_dir = stack.options.run_dir / "redis-cluster"
    assert all((cluster_dir / f"node-{i}").is_dir() for i in range(1, 7))

    with redis.RedisCluster.from_url(cluster.url) as client:
        client.set("{kept}:across", "runs")
        # A killed node (the master of that key) is restarted, and the cluster serves on.
        master = cluster.master_for_slot(client.keyslot("{kept}:across"))
        slot_of = stack.supervisor.slots[f"redis-{master.name}"]
        os.kill(slot_of.child.pid, signal.SIGKILL)

        def restarted() -> bool:
            stack.supervisor.poll()
            return slot_of.restarts == 1 and not slot_of.child.exited()

        wait_for(restarted, 10, "the killed node to be restarted")
        wait_for(lambda: cluster_ok(cluster.url), 20, "the cluster to be ok again")
        assert client.get("{kept}:across") == b"runs"

    pids = [slot.child.pid for slot in stack.supervisor.slots.values()]
    stack.stop()
    assert not any(pid_alive(pid) for pid in pids)
    again = start_redis_of_up()  # on the same run directory: the same cluster, its data
    assert again.cluster and [n.port for n in again.cluster.nodes] == [
        n.port for n in cluster.nodes
    ]
    with redis.RedisCluster.from_url(again.settings.redis_url) as client:
        assert client.get("{kept}:across") == b"runs"
