"""The per-model gauges autoscalers and dashboards read (issue 43): requests waiting
(queued, and held in a worker's engine), running, live workers and KV cache use, and
the same under vLLM's names; and a scrape exposes exactly the families that
docs/operations.md's table lists (``web.metrics_docs``)."""

from __future__ import annotations

import re

import pytest
from flask.testing import FlaskClient

from app.settings import Settings
from broker.celery_app import queue_name
from tests.web.conftest import LiveFleet
from web.metrics_docs import metric_docs

pytestmark = pytest.mark.integration


def sample(text: str, name: str, labels: str) -> float:
    match = re.search(rf"^{re.escape(name)}\{{{re.escape(labels)}\}} (\S+)$", text, re.M)
    assert match, f"no {name}{{{labels}}} in the scrape"
    return float(match.group(1))


def test_waiting_running_and_cache_use_per_model(
    client: FlaskClient, fleet: LiveFleet, settings: Settings
) -> None:
    model = settings.served_name
    busy = fleet.worker.model_copy(
        update={"active_jobs": 5, "engine_stats": {"engine_waiting": 2.0, "cache_usage": 0.25}}
    )
    other = fleet.worker.model_copy(
        update={"worker_id": "w-2", "active_jobs": 1, "engine_stats": {"cache_usage": 0.75}}
    )
    fleet.workers.heartbeat(busy)
    fleet.workers.heartbeat(other)
    queue = queue_name("interactive", model)
    fleet.workers.redis.rpush(queue, "a", "b", "c")
    try:
        text = client.get("/metrics").get_data(as_text=True)
    finally:
        fleet.workers.redis.delete(queue)
    mine = f'model="{model}"'
    assert sample(text, "tokenrelay_model_requests_waiting", mine) == 3 + 2
    assert sample(text, "tokenrelay_model_requests_running", mine) == 5 - 2 + 1
    assert sample(text, "tokenrelay_model_workers", mine) == 2
    assert sample(text, "tokenrelay_model_kv_cache_usage", mine) == 0.5
    vllm = f'model_name="{model}"'
    assert sample(text, "vllm:num_requests_waiting", vllm) == 5
    assert sample(text, "vllm:num_requests_running", vllm) == 4
    assert sample(text, "vllm:kv_cache_usage_perc", vllm) == 0.5


def test_a_scrape_exposes_exactly_the_documented_families(
    client: FlaskClient, fleet: LiveFleet
) -> None:
    """Every family this app's /metrics exposes is in the table with its type, and every
    row is exposed: in one process, a family shows its TYPE line before its first sample,
    and the families read from Redis are built at every scrape."""
    text = client.get("/metrics").get_data(as_text=True)
    exposed = dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M))
    assert "tokenrelay_worker_capacity" in exposed  # Redis was read
    assert exposed == {d.name: d.type for d in metric_docs()}
