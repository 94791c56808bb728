"""The core cases on a real Redis Cluster (3 masters + 3 replicas, ``LocalCluster``):
token traffic, requests, leases, hand-off and admission spread over the cluster's
shards, Celery on a redis-server of its own (``tests.stack.full_stack(cluster=...)``).

SSE and JSON (every stop case: exact text), and that the requests really were spread
over every master; then the WebSocket and Responses API suites' core tests, imported
from their modules and run here against the cluster stack (this module's ``stack``).
Batches: ``test_cluster_batches``; a web process killed mid-stream and a master killed
mid-stream: ``tests/faults/test_cluster_faults.py``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
from redis.crc import key_slot

from broker.cluster_server import LocalCluster
from broker.connection import open_redis
from broker.registry import worker_registry
from tests.stack import Stack, close_client, full_stack, isolated_settings

pytestmark = pytest.mark.e2e

CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def cluster_stack(models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    settings = isolated_settings(
        "redis://unused", models_dir, web_workers=1, web_threads=32, sse_keepalive_s=1.0
    )
    log_dir = tmp_path_factory.mktemp("cluster-logs")
    cluster = LocalCluster(3, 1)
    workers = ("w1", "w2", "w3")  # one at home on each shard (broker.placement)
    with full_stack(settings, log_dir, workers=workers, batcher=True, cluster=cluster) as running:
        yield running


@pytest.fixture(scope="module")
def stack(cluster_stack: Stack) -> Stack:
    """The imported tests' stack: the cluster one."""
    return cluster_stack


# The other suites' core cases, collected here with this module's ``stack``.
from tests.e2e.test_http_api import test_stop_cases_same_text_over_sse_and_json  # noqa: E402
from tests.e2e.test_responses_api import (  # noqa: E402
    client,
    model,
    test_create_plain,
    test_delete,
    test_previous_response_id_chains_the_conversation,
    test_stream_with_the_sdk_helper,
    test_streamed_function_call_events,
    test_websocket_response_messages,
)
from tests.e2e.test_websocket import (  # noqa: E402
    fast_client,
    test_ids_may_be_reused_after_done,
    test_n_and_logprobs,
    test_stop_cases_same_text_over_websocket,
)

__all__ = [
    "client",
    "fast_client",
    "model",
    "test_create_plain",
    "test_delete",
    "test_ids_may_be_reused_after_done",
    "test_n_and_logprobs",
    "test_previous_response_id_chains_the_conversation",
    "test_stop_cases_same_text_over_sse_and_json",
    "test_stop_cases_same_text_over_websocket",
    "test_stream_with_the_sdk_helper",
    "test_streamed_function_call_events",
    "test_websocket_response_messages",
]


def test_requests_spread_over_every_master_and_stay_home(cluster_stack: Stack) -> None:
    """The three workers took home shards 0, 1, 2 in turn; new requests are placed on
    them in turn (``broker.placement``), so 21 requests' keys are on all three masters,
    and each shard's tokens were published by its home worker alone (one publish call
    per engine step, not one per shard)."""
    stack = cluster_stack
    assert stack.cluster is not None
    client, keys = open_redis(stack.settings)
    try:
        homes = {w.worker_id: w.home for w in worker_registry(client, keys).live()}
        assert sorted(homes.values()) == [0, 1, 2], homes
        ports = set()
        for i in range(21):
            body = {
                "model": stack.settings.served_name,
                "messages": [{"role": "user", "content": f"spread {i}"}],
                "max_tokens": 4,
            }
            resp = requests.post(stack.base_url + CHAT, json=body, timeout=30)
            assert resp.status_code == 200, resp.text
            rid = resp.headers["x-request-id"]
            key = keys.output(rid)
            assert client.exists(key), key
            ports.add(stack.cluster.master_for_slot(key_slot(key.encode())).port)
        assert len(ports) == 3
        for worker, home in homes.items():
            for k in range(keys.shards):
                published = bool(client.exists(keys.at(k).steps(worker)))
                assert published == (k == home), (worker, home, k)
    finally:
        close_client(client)
