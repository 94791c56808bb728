"""Flower, started exactly as ``tokenrelay up`` starts it, survives a Redis crash: its
process stays up through the outage and its event consumer reconnects by itself, so the
tasks sent after Redis is back show up in it."""

from __future__ import annotations

import base64
import json
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import pytest

from broker.celery_app import create_celery, queue_name
from broker.server import RedisServer, free_port
from tests.stack import Proc, child_env, isolated_settings, wait_for
from workers.up import flower_command

pytestmark = [pytest.mark.faults, pytest.mark.slow, pytest.mark.timeout(180)]

AUTH = "ops:secret"
OUTAGE_S = 5.0


def flower_get(port: int, path: str) -> Any:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}",
        headers={"Authorization": "Basic " + base64.b64encode(AUTH.encode()).decode()},
    )
    with urllib.request.urlopen(request, timeout=5) as resp:
        return json.loads(resp.read())


def flower_answers(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthcheck", timeout=5) as resp:
            return bool(resp.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def flower_has_task(port: int, task_id: str) -> bool:
    try:
        return task_id in dict(flower_get(port, "/api/tasks"))
    except (urllib.error.URLError, OSError, ValueError):
        return False


def send_until_accepted(celery: Any, model: str, timeout: float) -> str:
    """Send a task (its ``task-sent`` event is what Flower must see); retried while the
    broker is still coming back. No worker runs: the task only waits in its queue."""
    deadline = time.monotonic() + timeout
    while True:
        task_id = uuid.uuid4().hex
        try:
            celery.send_task(
                "tokenrelay.generate",
                args=[task_id, 0],
                queue=queue_name("interactive", model),
                task_id=task_id,
                retry=False,
            )
            return task_id
        except Exception:  # kombu's OperationalError while Redis is down
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def test_flower_survives_a_redis_crash_and_sees_new_events(tmp_path: Path) -> None:
    server = RedisServer().start()
    settings = isolated_settings(server.url, tmp_path / "models")
    port = free_port()
    flower = Proc(
        flower_command(port), child_env(settings, FLOWER_BASIC_AUTH=AUTH), tmp_path / "f.log"
    )
    celery = create_celery(settings)
    try:
        wait_for(lambda: flower_answers(port), 60, "Flower to answer", interval=0.3)
        # Flower answers before its event receiver has subscribed, and Celery's events
        # are fire-and-forget: send until it sees one, as after the restart below.
        first: list[str] = []

        def sees_a_first_task() -> bool:
            first.append(send_until_accepted(celery, settings.served_name, 10))
            return any(flower_has_task(port, task_id) for task_id in first)

        wait_for(sees_a_first_task, 60, "Flower to see a task", interval=0.5)

        server.kill()
        time.sleep(OUTAGE_S)
        assert flower.alive(), flower.output()
        server.start()  # the same port, as `up` restarts its private Redis
        back = time.monotonic()

        # Celery's events are fire-and-forget (a Redis PUBLISH): the ones sent before
        # Flower has subscribed again are lost, by design. So keep sending tasks until
        # Flower sees one.
        sent: list[str] = []

        def sees_a_new_task() -> bool:
            sent.append(send_until_accepted(celery, settings.served_name, 30))
            return any(flower_has_task(port, task_id) for task_id in sent)

        wait_for(sees_a_new_task, 60, "Flower to see events again", interval=0.5)
        recovery = time.monotonic() - back
        assert flower.alive(), flower.output()
        print(f"Flower sees events again {recovery:.1f}s after Redis is back")
        assert recovery < 30, flower.output()
    finally:
        celery.close()
        flower.stop()
        server.stop()
