"""An exllamav2 engine whose step outlasts the lease keeps its requests (real Redis, the
real EngineThread and lease keeper; the generator is the stand-in below the engine
interface, tests/engines/exllamav2_standin.py, with one step slowed down as a burst of
long prefills on a large model would)."""

from __future__ import annotations

import time
from typing import Any

import pytest

from app.messages import EngineFinish
from broker.celery_app import TaskOutcome
from broker.requests import RequestStore
from tests.engines.exllamav2_standin import VOCAB, StandInDynamicGenerator, stand_in_api
from tests.integration.test_lease_keeper import (
    SLOW_STEP_S,
    claimed,
    run_through_a_slow_step,
)
from workers.engines.exllamav2 import ExLlamaV2Engine

pytestmark = pytest.mark.integration

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


def test_an_exllamav2_step_longer_than_the_lease_keeps_the_request(
    store: RequestStore,
) -> None:
    gen = OneSlowIterate()
    # Segments of 5 tokens: the request also crosses two segment boundaries.
    engine = ExLlamaV2Engine(gen, vocab_size=VOCAB, api=stand_in_api(), segment_tokens=5)
    rid, (result, lease_seen, refreshed) = run_through_a_slow_step(
        store, engine, gen, lambda rid: claimed(store, rid, PROMPT, MAX_TOKENS)
    )
    assert gen.slept
    assert result is not None and result.outcome is TaskOutcome.DONE, result
    assert lease_seen and all(lease_seen), "the lease lapsed during the long step"
    assert refreshed >= 3  # about one per third of a lease
    (progress,) = store.progress(rid, 1)
    assert len(progress.token_ids) == MAX_TOKENS and progress.finish is EngineFinish.LENGTH
    assert [j.max_new_tokens for j in gen.enqueued] == [5, 5, 2]
