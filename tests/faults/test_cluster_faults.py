"""Faults on a real Redis Cluster (3 masters + 3 replicas, ``LocalCluster``), token
traffic spread over its shards and Celery on a redis-server of its own.

- A master SIGKILLed mid-stream: the one holding the keys of the most of 8 streams in
  flight, or the one holding the global tag (admission, registries, models). Its
  replica is promoted within seconds; every stream ends with exactly its text or a
  clear error event (never hangs), new requests succeed again, and no tokenrelay
  process dies or is replaced: the fleet goes on without a human.
- A web process SIGKILLed mid-stream: the client resumes on another web process with
  exactly the rest of its text (``test_resume``'s tests, run here with this module's
  cluster backbone).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest
from redis.crc import key_slot

from broker.cluster_server import LocalCluster
from broker.connection import open_redis
from tests.faults.test_resume import (
    test_sse_resumes_on_another_web_process_after_a_sigkill,
    test_websocket_resumes_on_another_web_process,
)
from tests.faults.web_clients import CHAT, Failover, Stream, chat_once, children, words
from tests.stack import close_client, full_stack, isolated_settings

pytestmark = pytest.mark.faults
logger = logging.getLogger(__name__)

__all__ = [
    "test_sse_resumes_on_another_web_process_after_a_sigkill",
    "test_websocket_resumes_on_another_web_process",
]

RATE = 20.0  # echo tokens per second per request: a stream lasts several seconds
STREAMS = 8
NEW_REQUEST_WITHIN_S = 30.0
STREAMS_END_WITHIN_S = 60.0


@pytest.fixture(scope="module")
def backbone_cluster() -> bool:
    """``test_resume``'s backbone (``tests.faults.conftest``) on a cluster."""
    return True


@pytest.fixture(scope="module")
def resume_grace_s() -> float:
    return 30.0


@pytest.mark.timeout(180)
@pytest.mark.parametrize("victim", ["most_streams", "global_tag"])
def test_a_master_killed_mid_stream(models_dir: Path, tmp_path: Path, victim: str) -> None:
    settings = isolated_settings(
        "redis://unused",
        models_dir,
        echo_tokens_per_second=RATE,
        web_workers=1,
        web_threads=24,
        sse_keepalive_s=1.0,
    )
    cluster = LocalCluster(3, 1, node_timeout_ms=1000)
    workers = ("w1", "w2", "w3")  # a home on each shard: the streams spread over them
    with full_stack(
        settings, tmp_path / "logs", workers=workers, cluster=cluster, batcher=True
    ) as stack:
        settings, procs = stack.settings, stack.procs
        model, base = settings.served_name, stack.base_url

        def report() -> str:
            return stack.logs()

        warm = "warm up on the cluster"
        assert chat_once(base, model, warm, timeout=30) == warm, report()
        pids = {name: p.pid for name, p in procs.items()}
        web_children = children(procs["web"].pid)

        streams = [Stream(CHAT, words(f"stream {i}", 60)) for i in range(STREAMS)]
        Failover.start(base, model, streams, report)

        # The master holding the most of these requests' keys (each stream's shard).
        client, keys = open_redis(settings)
        try:
            held: dict[int, int] = {}
            for s in streams:
                assert s.request_id, "no x-request-id"
                key = keys.request(s.request_id)
                assert client.exists(key), f"no record at {key}"
                port = cluster.master_for_slot(key_slot(key.encode())).port
                held[port] = held.get(port, 0) + 1
            global_key = keys.inflight
        finally:
            close_client(client)
        if victim == "most_streams":
            port = max(held, key=lambda p: held[p])
        else:
            port = cluster.master_for_slot(key_slot(global_key.encode())).port
        node = next(n for n in cluster.nodes if n.port == port)
        seen = Failover(time.monotonic(), streams)
        cluster.kill(node)
        seen.watch(lambda: cluster.wait_promoted(node, 30))
        seen.probe(base, model, NEW_REQUEST_WITHIN_S)
        summary = seen.finish(STREAMS_END_WITHIN_S)
        assert seen.promoted, f"no replica took over\n{report()}"
        logger.warning(
            "cluster failover (%s, %d of %d streams' keys on the killed master): %s",
            victim,
            held.get(port, 0),
            STREAMS,
            seen.line(summary),
        )
        seen.check(summary, procs, report())
        assert {n: p.pid for n, p in procs.items()} == pids
        assert children(procs["web"].pid) == web_children
        again = "and one more, exactly"
        assert chat_once(base, model, again, timeout=30) == again, report()
