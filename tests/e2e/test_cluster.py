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

from app.model_card import load_model_card, load_tokenizer
from broker.cluster_server import LocalCluster
from broker.connection import open_redis
from tests.e2e.stop_cases import CASES, chat_body, expected
from tests.e2e.test_http_api import fold_chat_chunks, read_sse
from tests.stack import Stack, close_client, full_stack, isolated_settings

pytestmark = pytest.mark.e2e

CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def cluster_stack(models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    settings = isolated_settings(
        "redis://unused", models_dir, web_workers=1, web_threads=32, sse_keepalive_s=1.0
    )
    log_dir = tmp_path_factory.mktemp("cluster-logs")
    with full_stack(settings, log_dir, batcher=True, cluster=LocalCluster(3, 1)) as running:
        yield running


@pytest.fixture(scope="module")
def stack(cluster_stack: Stack) -> Stack:
    """The imported tests' stack: the cluster one."""
    return cluster_stack


# The other suites' core cases, collected here with this module's ``stack``.
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
    "test_stop_cases_same_text_over_websocket",
    "test_stream_with_the_sdk_helper",
    "test_streamed_function_call_events",
    "test_websocket_response_messages",
]


@pytest.mark.parametrize("case", sorted(CASES))
def test_stop_cases_exact_over_sse_and_json(
    cluster_stack: Stack, model_dir: Path, case: str
) -> None:
    stack = cluster_stack
    model = stack.settings.served_name
    tokenizer = load_tokenizer(load_model_card(model_dir))
    body = chat_body(case, model, tokenizer)
    want = expected(case, model_dir, model)
    want_choices = {
        i: (want.texts[i], want.finish_reasons[i], want.stop_reasons[i]) for i in want.texts
    }
    plain = requests.post(stack.base_url + CHAT, json=body, timeout=30)
    assert plain.status_code == 200, plain.text + stack.logs()
    got_plain = {
        c["index"]: (c["message"]["content"], c["finish_reason"], c["stop_reason"])
        for c in plain.json()["choices"]
    }
    streamed = requests.post(stack.base_url + CHAT, json={**body, "stream": True}, timeout=30)
    assert got_plain == want_choices
    assert fold_chat_chunks(read_sse(streamed)) == want_choices


def test_requests_spread_over_every_master(cluster_stack: Stack) -> None:
    """Twenty requests' output streams land on all three masters (the shards' tags
    are spread over the slots, one shard per master)."""
    stack = cluster_stack
    assert stack.cluster is not None
    client, keys = open_redis(stack.settings)
    try:
        ports = set()
        for i in range(20):
            body = {
                "model": stack.settings.served_name,
                "messages": [{"role": "user", "content": f"spread {i}"}],
                "max_tokens": 4,
            }
            resp = requests.post(stack.base_url + CHAT, json=body, timeout=30)
            assert resp.status_code == 200, resp.text
            rid = resp.json()["id"]
            key = next(
                k
                for k in (keys.output(rid), keys.output(rid.removeprefix("chatcmpl-")))
                if client.exists(k)
            )
            ports.add(stack.cluster.master_for_slot(key_slot(key.encode())).port)
        assert len(ports) == 3
    finally:
        close_client(client)
