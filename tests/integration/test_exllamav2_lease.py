"""An exllamav2 engine whose step outlasts the lease keeps its requests (real Redis, the
real EngineThread and lease keeper; the generator is the stand-in below the engine
interface, tests/engines/exllamav2_standin.py, with one step slowed down as a burst of
long prefills on a large model would)."""

from __future__ import annotations

import time
import uuid
from typing import Any

import pytest

from app.messages import EngineFinish, StopConditions
from app.records import RequestRecord
from broker.celery_app import TaskOutcome
from broker.requests import ClaimResult, RequestStore, lease_value
from tests.engines.exllamav2_standin import VOCAB, StandInDynamicGenerator, stand_in_api
from workers.engine_thread import EngineThread, WorkItem
from workers.engines.base import ChoiceJob, EngineJob
from workers.engines.exllamav2 import ExLlamaV2Engine

pytestmark = pytest.mark.integration

LEASE_S = 1.0
SLOW_STEP_S = 3.5  # three and a half leases
PROMPT = list(range(10, 20))
MAX_TOKENS = 12


class OneSlowIterate(StandInDynamicGenerator):
    """The stand-in generator; its first ``iterate()`` after ``armed`` takes SLOW_STEP_S."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.armed = False
        self.slept = False

    def iterate(self) -> list[dict[str, Any]]:
        if self.armed and not self.slept:
            self.slept = True
            time.sleep(SLOW_STEP_S)
        return super().iterate()


def claimed(store: RequestStore, rid: str) -> WorkItem:
    now = time.time()
    store.create(
        RequestRecord(
            request_id=rid,
            model="m",
            prompts=[PROMPT],
            stop=StopConditions(max_tokens=MAX_TOKENS, eos_token_ids=(2,)),
            created=now,
            deadline=now + 60,
        )
    )
    assert store.claim(rid, 0, "w", LEASE_S, now) is ClaimResult.OK
    job = EngineJob(
        job_id=f"{rid}/0",
        prompt_ids=PROMPT,
        choices=[ChoiceJob(0, MAX_TOKENS)],
        eos_token_ids=frozenset({2}),
    )
    return WorkItem(rid, 0, lease_value("w", 0), [job], deadline=now + 60)


def test_an_exllamav2_step_longer_than_the_lease_keeps_the_request(
    store: RequestStore,
) -> None:
    gen = OneSlowIterate()
    # Segments of 5 tokens: the request also crosses two segment boundaries.
    engine = ExLlamaV2Engine(gen, vocab_size=VOCAB, api=stand_in_api(), segment_tokens=5)
    thread = EngineThread(engine, store, lease_ttl_s=LEASE_S)
    thread.start()
    try:
        rid = f"exl-slow-{uuid.uuid4().hex[:6]}"
        gen.armed = True
        handle = thread.submit(claimed(store, rid))
        lease_seen: list[bool] = []
        deadline = time.monotonic() + SLOW_STEP_S + 5
        while not handle.done.is_set() and time.monotonic() < deadline:
            if gen.slept and thread.step_started is not None:
                lease_seen.append(store.lease_alive(rid))
            time.sleep(0.1)
        assert handle.wait(10)
        result = handle.result
    finally:
        thread.stop()
        thread.join(5)
    assert gen.slept
    assert result is not None and result.outcome is TaskOutcome.DONE, result
    assert lease_seen and all(lease_seen), "the lease lapsed during the long step"
    assert thread.lease_keeper.refreshed >= 3  # about one per third of a lease
    (progress,) = store.progress(rid, 1)
    assert len(progress.token_ids) == MAX_TOKENS and progress.finish is EngineFinish.LENGTH
    assert [j.max_new_tokens for j in gen.enqueued] == [5, 5, 2]
