"""The lease keeper against a real redis-server: a step longer than a lease no longer
loses the request to another worker; a wedged one still does (its leases expire)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any, Protocol

import pytest

from app.records import RequestRecord, StopConditions
from broker.celery_app import TaskOutcome
from broker.publish import lease_value
from broker.requests import ClaimResult, RequestStore
from workers.engine_thread import EngineThread
from workers.engines.base import ChoiceJob, Engine, EngineJob, EngineStep
from workers.engines.echo import EchoEngine
from workers.work_items import WorkItem

pytestmark = pytest.mark.integration

LEASE_S = 1.0
SLOW_STEP_S = 3.5  # three and a half leases


class OneSlowStep(Engine):
    """A real echo engine whose first step after ``arm()`` takes ``SLOW_STEP_S``, as a
    long prefill on a loaded machine does."""

    name = "slow-once"

    def __init__(self) -> None:
        self.inner = EchoEngine(tokens_per_second=100)
        self.armed = False
        self.slept = False

    def submit(self, job: EngineJob) -> None:
        self.inner.submit(job)

    def cancel(self, job_id: str) -> None:
        self.inner.cancel(job_id)

    def step(self) -> list[EngineStep]:
        if self.armed and not self.slept:
            self.slept = True
            time.sleep(SLOW_STEP_S)
        return self.inner.step()

    def has_work(self) -> bool:
        return self.inner.has_work()

    @property
    def capacity(self) -> int:
        return self.inner.capacity


def claimed(
    store: RequestStore, rid: str, prompt: list[int] | None = None, max_tokens: int = 11
) -> WorkItem:
    """A request created and claimed for worker "w", as the task would hand it over."""
    now = time.time()
    prompt = prompt if prompt is not None else list(range(100, 110))
    store.create(
        RequestRecord(
            request_id=rid,
            model="m",
            prompts=[prompt],
            stop=StopConditions(max_tokens=max_tokens, eos_token_ids=(2,)),
            created=now,
            deadline=now + 60,
        )
    )
    assert store.claim(rid, 0, "w", LEASE_S, now) is ClaimResult.OK
    job = EngineJob(
        job_id=f"{rid}/0",
        prompt_ids=prompt,
        choices=[ChoiceJob(0, max_tokens)],
        eos_token_ids=frozenset({2}),
    )
    return WorkItem(rid, 0, lease_value("w", 0), [job], deadline=now + 60)


class SlowOnce(Protocol):
    """What sleeps through one long step once ``armed`` (an engine or a generator)."""

    armed: bool
    slept: bool


def run_through_a_slow_step(
    store: RequestStore,
    engine: Engine,
    slow: SlowOnce,
    item: Callable[[str], WorkItem],
    *,
    max_step_s: float | None = None,
) -> tuple[str, Any]:
    """Run one request through ``engine`` on a real EngineThread while ``slow`` makes
    one step last SLOW_STEP_S; (request id, (result, lease alive at each look during
    the step, the lease keeper's refresh count))."""
    thread = EngineThread(engine, store, lease_ttl_s=LEASE_S)
    if max_step_s is not None:
        thread.lease_keeper.max_step_s = max_step_s
    thread.start()
    try:
        rid = f"slow-{uuid.uuid4().hex[:6]}"
        slow.armed = True
        handle = thread.submit(item(rid))
        lease_seen: list[bool] = []
        deadline = time.monotonic() + SLOW_STEP_S + 5
        while not handle.done.is_set() and time.monotonic() < deadline:
            if slow.slept and thread.step_started is not None:
                lease_seen.append(store.lease_alive(rid))
            time.sleep(0.1)
        assert handle.wait(10)
        return rid, (handle.result, lease_seen, thread.lease_keeper.refreshed)
    finally:
        thread.stop()
        thread.join(5)


def slow_echo(store: RequestStore, *, max_step_s: float | None) -> tuple[str, Any]:
    engine = OneSlowStep()
    return run_through_a_slow_step(
        store, engine, engine, lambda rid: claimed(store, rid), max_step_s=max_step_s
    )


def test_a_step_longer_than_the_lease_keeps_the_request(store: RequestStore) -> None:
    rid, (result, lease_seen, refreshed) = slow_echo(store, max_step_s=None)
    assert result is not None and result.outcome is TaskOutcome.DONE, result
    assert lease_seen and all(lease_seen), "the lease lapsed during the long step"
    assert refreshed >= 3  # about one refresh per third of a lease, for 3.5 leases
    assert store.progress(rid, 1)[0].token_ids == [*range(100, 110), 2]


def test_a_request_submitted_during_a_long_step_keeps_its_lease(store: RequestStore) -> None:
    """A task claims its request, then hands it to the engine thread; during a long
    step it waits in the inbox, where only the lease keeper can refresh its lease."""
    engine = OneSlowStep()
    thread = EngineThread(engine, store, lease_ttl_s=LEASE_S)
    thread.start()
    try:
        engine.armed = True
        first = thread.submit(claimed(store, f"first-{uuid.uuid4().hex[:6]}"))
        deadline = time.monotonic() + 5
        while not (engine.slept and thread.step_started is not None):
            assert time.monotonic() < deadline, "the slow step never started"
            time.sleep(0.01)
        rid = f"waiting-{uuid.uuid4().hex[:6]}"
        second = thread.submit(claimed(store, rid))  # claimed now, admitted after the step
        lease_seen: list[bool] = []
        while thread.step_started is not None and engine.slept and not first.done.is_set():
            lease_seen.append(store.lease_alive(rid))
            time.sleep(0.1)
            if len(lease_seen) > 100:
                break
        assert first.wait(10) and second.wait(10)
    finally:
        thread.stop()
        thread.join(5)
    assert len(lease_seen) > 2 * LEASE_S / 0.1, "the step was not long enough to tell"
    assert all(lease_seen), "the waiting request's lease lapsed during the long step"
    assert second.result is not None and second.result.outcome is TaskOutcome.DONE, second.result
    assert store.progress(rid, 1)[0].token_ids == [*range(100, 110), 2]


def test_a_wedged_step_lets_the_lease_expire(store: RequestStore) -> None:
    # A step that runs past max_step_s counts as wedged: no more refreshes, the lease
    # expires, another worker may resume the request; this one is fenced.
    _rid, (result, lease_seen, _refreshed) = slow_echo(store, max_step_s=1.5)
    assert result is not None and result.outcome is TaskOutcome.FENCED, result
    assert lease_seen and not lease_seen[-1]
