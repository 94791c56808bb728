"""The engine thread's publish overlaps the next engine step (a real redis-server): the
step runs while Redis appends the previous step's tokens, what the reply says acts one
step later, and nothing stays in flight once the engine is idle."""

from __future__ import annotations

import uuid

import pytest

from broker.celery_app import TaskOutcome
from broker.requests import RequestStore
from tests.integration.test_engine_thread import start_request
from workers.engine_thread import EngineThread
from workers.engines.base import EngineStep
from workers.engines.echo import EchoEngine

pytestmark = pytest.mark.integration


class WatchingEngine(EchoEngine):
    """The echo engine, noting at each step what the engine thread had in flight and
    what Redis already held: proof that the step ran while the publish was pending."""

    def __init__(self, store: RequestStore) -> None:
        super().__init__()
        self.store = store
        self.thread: EngineThread | None = None
        self.seen: list[tuple[bool, int]] = []  # (a publish in flight?, tokens in Redis)
        self.rid = ""

    def step(self) -> list[EngineStep]:
        assert self.thread is not None
        in_flight = self.thread._in_flight is not None
        entries = self.store.read_tokens(self.rid)
        stored = sum(len(d.token_ids) for _e, _a, deltas in entries for d in deltas)
        self.seen.append((in_flight, stored))
        return super().step()


def test_a_step_runs_while_the_previous_steps_publish_is_in_flight(store: RequestStore) -> None:
    engine = WatchingEngine(store)
    thread = EngineThread(engine, store, lease_ttl_s=5.0)
    engine.thread = thread
    engine.rid = rid = f"overlap-{uuid.uuid4().hex[:6]}"
    handle = thread.submit(start_request(store, rid, 5))  # 5 tokens, then EOS
    for _ in range(20):
        thread.iterate()
        if handle.done.is_set():
            break
    # Step 0 had nothing in flight; every later step k ran with step k-1's publish sent
    # and its reply unread: Redis held the k-1 tokens whose replies were read, and the
    # in-flight one's too if Redis had run it already.
    assert engine.seen[0] == (False, 0)
    assert all(in_flight for in_flight, _ in engine.seen[1:]), engine.seen
    assert all(k - 1 <= stored <= k for k, (_, stored) in enumerate(engine.seen)), engine.seen
    # The last step ended the request: the engine idle, its reply was read at once.
    assert handle.done.is_set() and thread._in_flight is None
    assert handle.result is not None and handle.result.outcome is TaskOutcome.DONE
    progress = store.progress(rid, 1)[0]
    assert progress.token_ids == [100, 101, 102, 103, 104, 2]


def test_a_cancel_reported_by_a_publish_stops_the_job_one_step_later(
    store: RequestStore,
) -> None:
    thread = EngineThread(EchoEngine(), store, lease_ttl_s=5.0)
    rid = f"cancelled-{uuid.uuid4().hex[:6]}"
    handle = thread.submit(start_request(store, rid, 50))
    thread.iterate()
    thread.iterate()
    store.cancel(rid)
    for _ in range(10):
        thread.iterate()
        if handle.done.is_set():
            break
    assert handle.done.is_set() and thread._in_flight is None
    assert handle.result is not None and handle.result.outcome is TaskOutcome.CANCELLED
    produced = store.progress(rid, 1)[0].token_ids
    # Seen by the publish after the cancel (in flight during the next step), then the
    # engine's cancel ends the choice: a step or two more, never the 50 tokens.
    assert len(produced) <= 6, produced
