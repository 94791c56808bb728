"""Flower, pointed at the same Redis, lists the worker and its finished generate task."""

from __future__ import annotations

import base64
import json
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import pytest
import redis

from app.records import RequestRecord, RequestState, SamplingParams, StopConditions
from app.settings import Settings
from broker.celery_app import create_celery
from broker.keys import Keys
from broker.requests import RequestStore
from broker.server import free_port
from tests.stack import Proc, child_env, wait_for, worker_process

pytestmark = pytest.mark.integration


def _get(url: str, auth: str) -> Any:
    req = urllib.request.Request(
        url, headers={"Authorization": "Basic " + base64.b64encode(auth.encode()).decode()}
    )
    with urllib.request.urlopen(req, timeout=10) as resp:
        return json.loads(resp.read())


def test_flower_lists_worker_and_task(settings: Settings, tmp_path: Path) -> None:
    port, auth = free_port(), "ops:secret"
    flower = Proc(
        [
            sys.executable,
            "-m",
            "celery",
            "--broker",
            settings.redis_url,
            "flower",
            f"--port={port}",
            "--address=127.0.0.1",
            f"--basic-auth={auth}",
        ],
        child_env(settings),
        tmp_path / "flower.log",
    )
    try:
        base = f"http://127.0.0.1:{port}"

        def up() -> bool:
            try:
                _get(f"{base}/api/workers", auth)
                return True
            except (urllib.error.URLError, ConnectionError):
                return False

        wait_for(up, 30, "flower to answer", interval=0.3)
        with pytest.raises(urllib.error.HTTPError):  # basic auth is enforced
            _get(f"{base}/api/workers", "ops:wrong")
        with worker_process(settings, tmp_path):
            store = RequestStore(
                redis.Redis.from_url(settings.redis_url), Keys(settings.key_prefix)
            )
            now = time.time()
            rec = RequestRecord(
                request_id=uuid.uuid4().hex,
                model=settings.served_name,
                prompts=[[10, 11, 12]],
                sampling=SamplingParams(),
                stop=StopConditions(max_tokens=8, eos_token_ids=(2,)),
                created=now,
                deadline=now + 60,
            )
            store.submit(rec, create_celery(settings))
            wait_for(
                lambda: (s := store.state(rec.request_id)) and s[0] is RequestState.DONE,
                30,
                "the request to finish",
            )
            task_id = f"{rec.request_id}.0"

            def task_listed() -> bool:
                tasks = _get(f"{base}/api/tasks", auth)
                return tasks.get(task_id, {}).get("state") == "SUCCESS"

            wait_for(task_listed, 30, "flower to list the task", interval=0.5)
            workers = wait_for(
                lambda: _get(f"{base}/api/workers?refresh=1", auth),
                30,
                "flower to list the worker",
                interval=0.5,
            )
            assert any(name.startswith("tokenrelay-") for name in workers)  # type: ignore[union-attr]
            # The worker's page shows its engine, mode and capacity (the "Other" tab).
            (ours,) = [w for name, w in workers.items() if name.startswith("tokenrelay-")]  # type: ignore[union-attr]
            stats = ours["stats"]
            assert stats["tokenrelay_engine"] == "echo"
            assert stats["tokenrelay_engine_mode"] == "batched"
            assert stats["tokenrelay_engine_capacity"] >= 1
            assert stats["tokenrelay_worker_slots"] == settings.worker_slots
            task = _get(f"{base}/api/task/info/{task_id}", auth)
            assert task["name"] == "tokenrelay.generate"
            # Each of its events reached Flower: the sender's task-sent (published off
            # the sending thread, broker.sent_events) and the worker's, which it lets
            # gather (workers.celery_worker.EVENT_LINGER_S).
            for stamp in ("sent", "received", "started", "succeeded"):
                assert task[stamp], (stamp, task)
    finally:
        flower.stop()


@pytest.mark.parametrize(
    ("url", "client"),
    [
        ("redis://127.0.0.1:6379/0", "Redis"),
        ("redis+sentinel://127.0.0.1:26379/m/0", "RedisSentinel"),
    ],
)
def test_flower_can_read_queue_lengths_from_its_broker(url: str, client: str) -> None:
    """Flower picks its broker client by the URL's scheme; the app it runs with gives it
    one it knows (its queue page and ``/api/queues/length`` were a 404 before)."""
    from flower.utils.broker import Broker

    from broker.flower_app import flower_celery

    app = flower_celery(Settings(redis_url=url))
    with app.connection() as conn:
        uri = conn.as_uri(include_password=True)
    broker = Broker(uri, broker_options=app.conf.broker_transport_options)
    assert type(broker).__name__ == client
