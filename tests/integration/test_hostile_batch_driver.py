"""Issue 16 item 6's second half: a batch that keeps hitting a bug must end, not loop.

The issue's batch (a ``custom_id`` with a lone surrogate) made the driver fail the same
way every half second forever: release the batch, retake it, fail again, with a
traceback each time. The surrogate itself is now repaired when the line is read
(``tests/e2e/test_hostile_clients.py`` runs that batch to ``completed``); this test
injects a bug the driver cannot get past, through a subclass, and checks the batch
fails after ``MAX_STRIKES`` attempts with a clear error instead.
"""

from __future__ import annotations

import threading
import time

import pytest
import redis

from app.batches import BatchStatus
from app.settings import Settings
from broker.batches import BatchBody, BatchStore
from broker.files import FileStore
from broker.keys import Keys
from broker.runner import Runner
from workers.batch_state import DrivenBatch
from workers.batcher import MAX_STRIKES, BatchDriver

pytestmark = pytest.mark.integration


class BuggyDriver(BatchDriver):
    """A driver whose planning always raises: a bug, not a Redis error."""

    plans = 0

    def _plan(self, b: DrivenBatch, status: BatchStatus) -> None:
        self.plans += 1
        raise RuntimeError("injected bug")


def test_a_batch_that_keeps_failing_ends_failed(
    settings: Settings, redis_client: redis.Redis
) -> None:
    keys = Keys(settings.key_prefix)
    now = time.time()
    files = FileStore(redis_client, keys, ttl_s=600)
    f = files.create(filename="in", purpose="batch", content=b"{}\n", now=now)
    batches = BatchStore(redis_client, keys, ttl_s=600)
    body = BatchBody(
        id="batch_buggy",
        endpoint="/v1/chat/completions",
        input_file_id=f.id,
        completion_window="24h",
        created_at=int(now),
        expires_at=int(now) + 3600,
    )
    batches.create(body, now)
    driver = BuggyDriver(settings, Runner(settings, max_connections=4))
    for _ in range(MAX_STRIKES + 3):
        driver.maintain()
    assert driver.plans == MAX_STRIKES  # retried, then given up: no endless loop
    batch = batches.get("batch_buggy")
    assert batch is not None and batch.status is BatchStatus.FAILED
    assert batch.errors is not None
    assert batch.errors.data[0].code == "internal_error"
    assert batch.errors.data[0].message == (
        "The batch stopped on an internal error; not every line was run."
    )
    assert "batch_buggy" not in batches.active()


def test_an_idle_driver_sleeps_until_maintain_and_a_stop_wakes_it(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    # With no batch the loop has nothing to do before the next maintain: it must not
    # poll ten times a second on the engine's cores, and a stop must not wait it out.
    from workers import batcher

    monkeypatch.setattr(batcher, "MAINTAIN_S", 1.0)

    class Counting(BatchDriver):
        turns = 0

        def iterate(self) -> None:
            self.turns += 1
            super().iterate()

    driver = Counting(settings, Runner(settings, max_connections=4))
    thread = threading.Thread(target=driver.run)
    thread.start()
    try:
        time.sleep(2.5)
        assert 1 <= driver.turns <= 5  # ~one a second (a 0.1 s poll: ~25)
    finally:
        started = time.monotonic()
        driver.stopping.set()
        thread.join(10)
    assert not thread.is_alive()
    assert time.monotonic() - started < 0.5  # not the rest of a one-second sleep
