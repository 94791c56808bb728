"""Celery on a Redis of its own (``celery_url``), the token traffic on ``redis_url``.

Two redis-servers: the stack's (``full_stack`` starts it and sets ``redis_url``) and
Celery's, given as ``celery_url``. Real processes on them: a worker, a streamer,
gunicorn and Flower. Requests are answered end to end; a request for a model with no
worker yet waits in its queue, which is a list on Celery's Redis, and the web tier's
``tokenrelay_queue_depth`` (what an autoscaler reads) counts it there; once that
model's worker starts, it is answered. Celery's keys (its queues, kombu's bindings, the
task results) are on Celery's Redis only, and tokenrelay's own keys on the other.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import requests

from broker.celery_app import priority_lists, queue_name
from broker.server import RedisServer, free_port
from tests.faults.web_clients import CHAT, Unary, flower_workers, start_unary, words
from tests.stack import (
    Stack,
    flower_process,
    full_stack,
    isolated_settings,
    start_model_worker,
    wait_for,
)

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

LATE = "model-late"
# Keys only Celery writes: its queues (tr.<kind>.<model>), kombu's bindings and
# unacked bookkeeping, the results of tasks.
CELERY_KEY = ("tr.", "_kombu", "unacked", "celery-task-meta-")


@pytest.fixture
def celery_server() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


def keys_on(client: redis.Redis) -> set[str]:
    return {k.decode() for k in client.scan_iter(count=1000)}


def queue_depth(base_url: str, model: str, kind: str) -> float | None:
    """``tokenrelay_queue_depth`` of ``model``'s ``kind`` queue on the web's /metrics."""
    text = requests.get(base_url + "/metrics", timeout=10).text
    label = f'{{model="{model}",queue="{queue_name(kind, model)}"}}'
    for line in text.splitlines():
        if line.startswith("tokenrelay_queue_depth" + label):
            return float(line.rsplit(" ", 1)[1])
    return None


def chat(stack: Stack, content: str, *, stream: bool) -> str:
    body = {"messages": [{"role": "user", "content": content}], "stream": stream}
    resp = requests.post(stack.base_url + CHAT, json=body, timeout=30)
    assert resp.status_code == 200, (resp.text, stack.logs())
    if not stream:
        return str(resp.json()["choices"][0]["message"]["content"])
    text = ""
    for line in resp.text.splitlines():
        if line.startswith("data: {"):
            for choice in json.loads(line[len("data: ") :])["choices"]:
                text += choice["delta"].get("content") or ""
    assert resp.text.rstrip().endswith("data: [DONE]"), resp.text[-200:]
    return text


@pytest.mark.timeout(150)
def test_celery_on_its_own_redis(
    celery_server: RedisServer, models_dir: Path, tmp_path: Path
) -> None:
    settings = isolated_settings(
        "redis://unused",
        models_dir,
        celery_url=celery_server.url,
        known_models=[LATE],
        model_wait_s=60.0,
        web_workers=1,
        web_threads=8,
    )
    flower_port, flower_auth = free_port(), "ops:secret"
    with full_stack(settings, tmp_path / "logs") as stack:
        settings = stack.settings
        assert settings.celery_url == celery_server.url != settings.redis_url
        stack.start("flower", flower_process(settings, stack.log_dir, flower_port, flower_auth))
        tokens = redis.Redis.from_url(settings.redis_url)
        celery = redis.Redis.from_url(celery_server.url)

        assert chat(stack, "hello over two Redis servers", stream=False)
        assert chat(stack, "and streamed", stream=True)

        # A model without a worker: its request waits in its queue on Celery's Redis,
        # where /metrics (and so an autoscaler) sees it.
        late = Unary(CHAT, words("waiting on the Celery Redis"))
        thread = start_unary(stack.base_url, LATE, late)
        lists = priority_lists(queue_name("interactive", LATE))
        wait_for(lambda: sum(int(celery.llen(k)) for k in lists) >= 1, 10, "the queued task")
        assert sum(int(tokens.llen(k)) for k in lists) == 0
        depth = wait_for(lambda: queue_depth(stack.base_url, LATE, "interactive"), 10, "depth")
        assert depth is not None and depth >= 1, stack.logs()
        assert thread.is_alive(), late
        start_model_worker(stack, LATE)
        thread.join(60)
        assert late.status == 200 and late.text == late.content, (late, stack.logs())

        # Flower reads the workers' events from Celery's Redis.
        node = f"tokenrelay-{stack.procs['worker'].pid}@"
        wait_for(
            lambda: any(n.startswith(node) for n in flower_workers(flower_port, flower_auth)),
            30,
            "Flower to list the worker",
            interval=0.5,
        )

        # Results are stored as tasks end: give the last one a moment.
        time.sleep(0.5)
        on_tokens, on_celery = keys_on(tokens), keys_on(celery)
        assert not [k for k in on_tokens if k.startswith(CELERY_KEY)], sorted(on_tokens)
        assert any(k.startswith("_kombu.binding.") for k in on_celery), sorted(on_celery)
        assert any(k.startswith("celery-task-meta-") for k in on_celery), sorted(on_celery)
        assert any(k.startswith(settings.key_prefix) for k in on_tokens)
        assert not [k for k in on_celery if k.startswith(settings.key_prefix)], sorted(on_celery)
        tokens.close()
        celery.close()
