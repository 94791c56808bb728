"""A worker's engine mode and capacity, as /ready and /metrics show them (issue 15 item 1).

An exllamav2 worker without paged attention runs one sequence at a time whatever its
slots; an operator must be able to see that on a running deployment, not only in a
start-up log line. The workers here are registry entries, as their heartbeats write them.
"""

from __future__ import annotations

import re
from typing import Any

from flask.testing import FlaskClient

from broker.registry import WorkerInfo


def register(fleet: Any, worker_id: str, mode: str, engine_capacity: int, **stats: float) -> None:
    fleet.workers.heartbeat(
        WorkerInfo(
            worker_id=worker_id,
            model=fleet.worker.model,
            engine="exllamav2",
            capacity=16,
            hostname="gpu",
            pid=1,
            started=0.0,
            mode=mode,
            engine_capacity=engine_capacity,
            engine_stats=stats,
        )
    )


def test_ready_lists_each_worker_with_its_mode_and_capacity(
    client: FlaskClient, fleet: Any
) -> None:
    register(fleet, "w-paged", "paged", 256)
    register(fleet, "w-unpaged", "unpaged", 1)
    body = client.get("/ready").get_json()
    assert body["status"] == "ready"
    workers = {w["worker_id"]: w for w in body["workers"]}
    assert workers["w-paged"] == {
        "worker_id": "w-paged",
        "engine": "exllamav2",
        "mode": "paged",
        "capacity": 256,
        "slots": 16,
    }
    assert workers["w-unpaged"]["mode"] == "unpaged"
    assert workers["w-unpaged"]["capacity"] == 1
    # A worker from before modes were reported (the fleet's own entry) has none.
    assert workers["w-test"]["mode"] is None and workers["w-test"]["capacity"] is None


def test_metrics_show_paged_and_engine_capacity_per_worker(client: FlaskClient, fleet: Any) -> None:
    register(fleet, "w-paged", "paged", 256)
    register(fleet, "w-unpaged", "unpaged", 1)
    text = client.get("/metrics").get_data(as_text=True)

    def sample(name: str, worker: str) -> tuple[str, float]:
        m = re.search(rf'^{name}\{{([^}}]*worker="{worker}"[^}}]*)\}} (\S+)$', text, re.M)
        assert m is not None, (name, worker)
        return m.group(1), float(m.group(2))

    assert sample("tokenrelay_worker_paged", "w-paged")[1] == 1.0
    assert sample("tokenrelay_worker_paged", "w-unpaged")[1] == 0.0
    labels, value = sample("tokenrelay_worker_engine_capacity", "w-unpaged")
    assert value == 1.0 and 'mode="unpaged"' in labels
    assert sample("tokenrelay_worker_engine_capacity", "w-paged")[1] == 256.0
    # The existing gauge keeps its meaning (slots) and its labels.
    labels, value = sample("tokenrelay_worker_capacity", "w-unpaged")
    assert value == 16.0
    assert dict(re.findall(r'(\w+)="([^"]*)"', labels)) == {
        "worker": "w-unpaged",
        "model": fleet.worker.model,
        "engine": "exllamav2",
    }
    assert not re.search(r'^tokenrelay_worker_paged\{[^}]*worker="w-test"', text, re.M)


def test_metrics_show_the_engine_s_cache_and_its_paused_streams(
    client: FlaskClient, fleet: Any
) -> None:
    """exllamav2's gauges (``ExLlamaV2Engine.stats``): cache pages in use, jobs waiting
    inside the engine, and live streams paused there for pages."""
    stats = {"cache_usage": 0.75, "engine_waiting": 3.0, "pending_continuations": 1.0}
    register(fleet, "w-gpu", "paged", 64, **stats)
    text = client.get("/metrics").get_data(as_text=True)
    for name, value in (
        ("tokenrelay_worker_cache_usage", 0.75),
        ("tokenrelay_worker_engine_waiting", 3.0),
        ("tokenrelay_worker_pending_continuations", 1.0),
    ):
        m = re.search(rf'^{name}\{{[^}}]*worker="w-gpu"[^}}]*\}} (\S+)$', text, re.M)
        assert m is not None and float(m.group(1)) == value, name
