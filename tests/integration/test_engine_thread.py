"""The engine thread in-process against a real redis-server: only it touches the engine,
and nothing a job does can end its loop."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from app.messages import EngineFinish, TokenDelta
from app.model_card import ModelCard
from app.records import RequestRecord, StopConditions
from app.settings import Settings
from broker.celery_app import TaskOutcome
from broker.keys import Keys
from broker.publish import PublishItem, PublishStatus, encode_deltas, lease_value
from broker.registry import worker_registry
from broker.requests import ClaimResult, RequestStore
from broker.server import RedisServer
from tests.stack import wait_for
from workers.engine_thread import EngineThread
from workers.engines.base import ChoiceJob, Engine, EngineJob, EngineStep
from workers.engines.echo import EchoEngine
from workers.runtime import WorkerRuntime
from workers.work_items import WorkItem

pytestmark = pytest.mark.integration


class ThreadCheckingEngine(Engine):
    """Wraps a real engine and records which threads call it."""

    name = "checked"

    def __init__(self, inner: Engine, poison: str | None = None) -> None:
        self.inner = inner
        self.poison = poison
        self.callers: set[str] = set()

    def _seen(self) -> None:
        self.callers.add(threading.current_thread().name)

    def submit(self, job: EngineJob) -> None:
        self._seen()
        self.inner.submit(job)

    def cancel(self, job_id: str) -> None:
        self._seen()
        self.inner.cancel(job_id)

    def step(self) -> list[EngineStep]:
        self._seen()
        steps = self.inner.step()
        if self.poison and any(s.job_id.startswith(self.poison) for s in steps):
            self.poison = None
            raise RuntimeError("simulated engine crash")
        return steps

    def has_work(self) -> bool:
        self._seen()
        return self.inner.has_work()

    @property
    def capacity(self) -> int:
        return self.inner.capacity


def start_request(store: RequestStore, rid: str, n_tokens: int) -> WorkItem:
    now = time.time()
    store.create(
        RequestRecord(
            request_id=rid,
            model="m",
            prompts=[list(range(100, 100 + n_tokens))],
            stop=StopConditions(max_tokens=n_tokens + 1, eos_token_ids=(2,)),
            created=now,
            deadline=now + 60,
        )
    )
    assert store.claim(rid, 0, "w", 5.0, now) is ClaimResult.OK
    job = EngineJob(
        job_id=f"{rid}/0",
        prompt_ids=list(range(100, 100 + n_tokens)),
        choices=[ChoiceJob(0, n_tokens + 1)],
        eos_token_ids=frozenset({2}),
    )
    return WorkItem(rid, 0, lease_value("w", 0), [job], deadline=now + 60)


@pytest.fixture
def engine_thread(store: RequestStore) -> Iterator[tuple[EngineThread, ThreadCheckingEngine]]:
    engine = ThreadCheckingEngine(EchoEngine(tokens_per_second=200), poison="poisoned")
    thread = EngineThread(engine, store, lease_ttl_s=5.0)
    thread.start()
    yield thread, engine
    thread.stop()
    thread.join(5)


def test_only_the_engine_thread_calls_the_engine(
    engine_thread: tuple[EngineThread, ThreadCheckingEngine], store: RequestStore
) -> None:
    thread, engine = engine_thread
    handles = []

    def task(i: int) -> None:  # like Celery task threads
        handles.append(thread.submit(start_request(store, f"req{i}", 10)))

    tasks = [threading.Thread(target=task, args=(i,), name=f"task-{i}") for i in range(6)]
    for t in tasks:
        t.start()
    for t in tasks:
        t.join()
    assert all(h.wait(10) for h in handles)
    assert engine.callers == {"engine"}
    assert all(h.result is not None and h.result.outcome is TaskOutcome.DONE for h in handles)
    assert all(
        p.finish is EngineFinish.EOS for h in handles for p in store.progress(h.item.request_id, 1)
    )


def test_an_engine_crash_fails_its_jobs_and_the_loop_goes_on(
    engine_thread: tuple[EngineThread, ThreadCheckingEngine], store: RequestStore
) -> None:
    thread, _engine = engine_thread
    bad = thread.submit(start_request(store, "poisoned", 20))
    assert bad.wait(10)
    last = store.read_tokens("poisoned")[-1][2][-1]
    assert last.finish is EngineFinish.ERROR and last.error_code == 500
    good = thread.submit(start_request(store, "after", 5))
    assert good.wait(10)
    assert store.progress("after", 1)[0].token_ids == [100, 101, 102, 103, 104, 2]


class CorruptingEngine(ThreadCheckingEngine):
    """A real engine whose steps for jobs named ``prefix...`` come out malformed, as a
    buggy engine's would: token ids that cannot be encoded, or none at all."""

    def __init__(self, inner: Engine, prefix: str, bad_ids: Any) -> None:
        super().__init__(inner)
        self.prefix = prefix
        self.bad_ids = bad_ids

    def step(self) -> list[EngineStep]:
        steps = super().step()
        for s in steps:
            if s.job_id.startswith(self.prefix) and s.delta.token_ids:
                s.delta.token_ids = self.bad_ids
        return steps


@pytest.mark.parametrize("bad_ids", [[object()], None], ids=["unencodable", "missing"])
def test_a_malformed_step_fails_only_its_job(store: RequestStore, bad_ids: Any) -> None:
    engine = CorruptingEngine(EchoEngine(tokens_per_second=100), "bad", bad_ids)
    thread = EngineThread(engine, store, lease_ttl_s=5.0)
    thread.start()
    try:
        rid = f"bad-{uuid.uuid4().hex[:6]}"
        good_rid = f"good-{uuid.uuid4().hex[:6]}"
        bad = thread.submit(start_request(store, rid, 8))
        good = thread.submit(start_request(store, good_rid, 8))
        assert bad.wait(10) and good.wait(10)
        assert bad.result is not None and bad.result.outcome is TaskOutcome.FAILED
        last = store.read_tokens(rid)[-1][2][-1]
        assert last.finish is EngineFinish.ERROR and last.error_code == 500
        assert good.result is not None and good.result.outcome is TaskOutcome.DONE
        assert store.progress(good_rid, 1)[0].token_ids == [*range(100, 108), 2]
        assert thread.is_alive()
    finally:
        thread.stop()
        thread.join(5)


@pytest.mark.parametrize("appendfsync", ["everysec", "always"])
def test_publishing_survives_a_redis_restart(
    caplog: pytest.LogCaptureFixture, appendfsync: str
) -> None:
    """Redis SIGKILLed (AOF on) while a job streams: the loop keeps its deltas, retries
    with backoff (one warning, no storm) and, once Redis is back, publishes the rest
    with its lease intact: the token stream is gapless and duplicate-free. With
    ``always`` an fsync sits between Redis's AOF write and its reply, so the kill often
    lands on a publish that ran but was never answered (it was once appended twice)."""
    with RedisServer(appendonly=True, appendfsync=appendfsync) as server:
        client = redis.Redis.from_url(server.url)
        store = RequestStore(client, Keys("t:"), stream_ttl_s=600)
        thread = EngineThread(EchoEngine(tokens_per_second=20), store, lease_ttl_s=10.0)
        thread.start()
        try:
            handle = thread.submit(start_request(store, "through-outage", 60))
            time.sleep(0.5)
            with caplog.at_level(logging.INFO, logger="workers.engine_thread"):
                server.kill()
                time.sleep(2.0)
                server.start()
                assert handle.wait(15)
            assert thread.is_alive()
            assert handle.result is not None and handle.result.outcome is TaskOutcome.DONE
            progress = store.progress("through-outage", 1)[0]
            assert progress.token_ids == [*range(100, 160), 2]
            assert progress.finish is EngineFinish.EOS
            messages = [r.getMessage() for r in caplog.records]
            assert sum("publishing to redis failed" in m for m in messages) == 1, messages
            assert sum("publishing to redis again" in m for m in messages) == 1, messages
            assert len(messages) < 10, messages
        finally:
            thread.stop()
            thread.join(5)
            client.close()


def test_a_request_claimed_anew_here_supersedes_its_older_run(store: RequestStore) -> None:
    """A step that outlasts the lease lets the request be claimed again, possibly by
    this same worker while its older run is still in the engine: the older run is
    dropped (fenced), the new one runs; no "already running" error reaches the client."""
    thread = EngineThread(EchoEngine(tokens_per_second=20), store, lease_ttl_s=5.0)
    thread.start()
    try:
        rid = f"again-{uuid.uuid4().hex[:6]}"
        first = start_request(store, rid, 40)
        older = thread.submit(first)
        time.sleep(0.3)
        again = WorkItem(
            rid,
            0,
            lease_value("w", 0),
            [
                EngineJob(
                    job_id=f"{rid}/0.1/0",  # the runtime's ids are unique per submission
                    prompt_ids=list(range(100, 140)),
                    choices=[ChoiceJob(0, 41)],
                    eos_token_ids=frozenset({2}),
                )
            ],
            deadline=first.deadline,
        )
        newer = thread.submit(again)
        assert older.wait(5)
        assert older.result is not None and older.result.outcome is TaskOutcome.FENCED
        assert newer.wait(15)
        assert newer.result is not None and newer.result.outcome is TaskOutcome.DONE
        errors = [
            d for _eid, _a, deltas in store.read_tokens(rid) for d in deltas if d.error is not None
        ]
        assert errors == []
        assert thread.is_alive()
    finally:
        thread.stop()
        thread.join(5)


def test_a_first_publish_without_tokens_still_gives_the_stream_its_ttl(
    store: RequestStore,
) -> None:
    """An attempt's first publish was only a lease refresh: its EXPIRE found no stream
    yet, and the token streams of finished requests stayed in Redis for ever (found by
    benchmarks/memory.py: every request of a run left one). The last publish sets the
    TTL too, and the worker keeps "first" until it has published tokens."""
    item = start_request(store, "late", 3)
    rid, lease = item.request_id, item.lease_value
    refresh = PublishItem(rid, lease, 0, b"", first=True, done=False)
    assert store.publish([refresh], 5.0) == [PublishStatus.OK]
    assert not store.redis.exists(store.keys.tokens(rid))  # nothing to expire yet
    payload = encode_deltas([TokenDelta(0, [100, 101])])
    assert store.publish([PublishItem(rid, lease, 0, payload, first=False, done=True)], 5.0) == [
        PublishStatus.OK
    ]
    assert 0 < store.redis.ttl(store.keys.tokens(rid)) <= store.stream_ttl_s


def test_a_lease_is_extended_every_fifth_of_it_not_every_step(
    store: RequestStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every step publishes, but the PEXPIRE in it runs only when a fifth of the lease
    has passed since the last one; a publish that keeps the TTL leaves it running down."""
    item = start_request(store, f"ext-{uuid.uuid4().hex[:6]}", 3)
    rid, lease = item.request_id, item.lease_value
    payload = encode_deltas([TokenDelta(0, [100])])
    store.redis.pexpire(store.keys.lease(rid), 3000)
    keep = PublishItem(rid, lease, 0, payload, first=True, refresh=False)
    assert store.publish([keep], 5.0) == [PublishStatus.OK]
    assert store.redis.pttl(store.keys.lease(rid)) <= 3000
    assert store.publish([PublishItem(rid, lease, 0, payload)], 5.0) == [PublishStatus.OK]
    assert store.redis.pttl(store.keys.lease(rid)) > 4000

    sent: list[PublishItem] = []
    real = store.publish_begin

    def spy(items: Any, *args: Any, **kwargs: Any) -> Any:
        sent.extend(items)
        return real(items, *args, **kwargs)

    monkeypatch.setattr(store, "publish_begin", spy)
    thread = EngineThread(EchoEngine(tokens_per_second=200), store, lease_ttl_s=2.5)
    thread.start()
    try:
        work = start_request(store, f"long-{uuid.uuid4().hex[:6]}", 240)  # ~1.2 s
        handle = thread.submit(work)
        assert handle.wait(15)
        assert handle.result is not None and handle.result.outcome is TaskOutcome.DONE
    finally:
        thread.stop()
        thread.join(5)
    mine = [p for p in sent if p.request_id == work.request_id]
    assert len(mine) > 100  # one publish a step
    assert 2 <= sum(p.refresh for p in mine) <= 5  # one every 0.5 s (and the first)


@pytest.mark.parametrize(
    ("where", "which"),
    [
        ("reply", "middle"),  # the script ran; the connection broke before its reply
        ("reply", "last"),  # the same for the publish that ends the request
        ("send", "middle"),  # the send raised, yet Redis had the whole call and ran it
        ("unsent", "middle"),  # the call never reached Redis: everything goes out again
    ],
)
def test_a_publish_whose_reply_was_lost_is_not_appended_twice(
    store: RequestStore, monkeypatch: pytest.MonkeyPatch, where: str, which: str
) -> None:
    """A publish is not idempotent: retrying one that ran appends its tokens twice, and
    a client reads them twice (seen in a full run with AOF ``always``, where a kill
    between Redis's write and its reply loses only the reply). The worker asks Redis
    which parts of the failed call ran before it publishes again: the token stream is
    exact, and the request ends DONE (not fenced by its own landed final publish)."""
    rid = f"lost-reply-{where}-{which}-{uuid.uuid4().hex[:6]}"
    real = store.publish_begin
    calls: list[int] = []

    def flaky(items: Any, *args: Any, **kwargs: Any) -> Any:
        mine = [p for p in items if p.request_id == rid]
        calls.append(1)
        hit = mine and (mine[0].done if which == "last" else len(calls) == 5)
        if not hit or getattr(flaky, "fired", False):
            return real(items, *args, **kwargs)
        flaky.fired = True  # type: ignore[attr-defined]
        if where == "unsent":
            raise redis.ConnectionError("simulated: connection refused")
        pending = real(items, *args, **kwargs)
        if where == "send":
            pending.statuses()  # it ran; the sender only saw an error
            raise redis.ConnectionError("simulated: broken pipe after the send")
        return _LostReply(pending)

    monkeypatch.setattr(store, "publish_begin", flaky)
    thread = EngineThread(EchoEngine(tokens_per_second=200), store, lease_ttl_s=10.0)
    thread.start()
    try:
        handle = thread.submit(start_request(store, rid, 30))
        assert handle.wait(15)
        assert handle.result is not None and handle.result.outcome is TaskOutcome.DONE
    finally:
        thread.stop()
        thread.join(5)
    assert getattr(flaky, "fired", False)
    progress = store.progress(rid, 1)[0]
    assert progress.token_ids == [*range(100, 130), 2]
    assert progress.finish is EngineFinish.EOS
    ordinals = [int(f[b"n"]) for _eid, f in store.redis.xrange(store.keys.tokens(rid))]
    assert ordinals == list(range(1, len(ordinals) + 1))


class _LostReply:
    """A publish that ran whose reply is read and then reported lost."""

    def __init__(self, pending: Any) -> None:
        self.pending = pending

    def statuses(self) -> list[PublishStatus]:
        self.pending.statuses()
        raise redis.ConnectionError("simulated: connection lost before the reply")


class BreakingEngine(ThreadCheckingEngine):
    """A real engine that works for ``good_steps`` steps, then raises ``error`` on every
    step after: a sticky fault (a CUDA context that every later call fails on)."""

    def __init__(self, inner: Engine, good_steps: int, error: Exception) -> None:
        super().__init__(inner)
        self.good_steps = good_steps
        self.error = error
        self.failed = 0

    def step(self) -> list[EngineStep]:
        if self.good_steps <= 0:
            self.failed += 1
            raise self.error
        self.good_steps -= 1
        return super().step()


@pytest.mark.parametrize(
    ("error", "steps_to_break", "outcome"),
    [
        (RuntimeError("a wedged engine"), 3, TaskOutcome.FAILED),
        (
            RuntimeError("CUDA error: an illegal memory access was encountered"),
            1,
            TaskOutcome.ABANDONED,
        ),
    ],
    ids=["three-in-a-row", "sticky-cuda-error"],
)
def test_a_broken_engine_stops_the_thread_and_gives_its_leases_back(
    store: RequestStore, error: Exception, steps_to_break: int, outcome: TaskOutcome
) -> None:
    """Issue 40: an engine whose steps keep failing (3 in a row) or fail in a way no step
    comes back from (a CUDA error) does not fail request after request while its worker
    heart-beats on: the thread stops as ``broken``, what was published before stays and
    its leases are given back at once, for the requests to resume elsewhere. A failure
    that may be one request's (below the breaker) fails the jobs of that step, as
    before; a sticky CUDA error fails none: they are abandoned, to resume elsewhere."""
    engine = BreakingEngine(EchoEngine(tokens_per_second=0), good_steps=4, error=error)
    thread = EngineThread(engine, store, lease_ttl_s=30.0, max_failed_steps=3)
    thread.start()
    try:
        handle = thread.submit(start_request(store, "doomed", 40))
        assert thread.broke.wait(10), "the breaker never tripped"
        assert handle.wait(5)
    finally:
        thread.stop()
        thread.join(5)
    assert thread.broken is not None and str(error) in thread.broken
    assert engine.good_steps == 0 and engine.failed == steps_to_break
    assert handle.result is not None and handle.result.outcome is outcome
    assert not store.lease_alive("doomed")  # not in 30 s: now
    published = store.progress("doomed", 1)[0]
    assert published.token_ids[:3] == [100, 101, 102]
    if outcome is TaskOutcome.ABANDONED:
        assert published.finish is None
        assert store.resume("doomed") == 1  # what a streamer's watchdog does next


def test_failures_below_the_breaker_fail_jobs_and_a_good_step_resets_the_count(
    store: RequestStore,
) -> None:
    """Two failed steps in a row fail their jobs as before; a good step in between
    starts the count again, so scattered failures never stop a worker."""
    engine = ThreadCheckingEngine(EchoEngine(tokens_per_second=200), poison="poisoned")
    thread = EngineThread(engine, store, lease_ttl_s=5.0, max_failed_steps=2)
    thread.start()
    try:
        for i in range(3):
            engine.poison = "poisoned"
            bad = thread.submit(start_request(store, f"poisoned-{i}", 10))
            assert bad.wait(10)
            good = thread.submit(start_request(store, f"fine-{i}", 3))
            assert good.wait(10)
            assert good.result is not None and good.result.outcome is TaskOutcome.DONE
        assert thread.broken is None and not thread.broke.is_set()
    finally:
        thread.stop()
        thread.join(5)


def test_a_broken_worker_leaves_the_fleet_and_says_so(
    settings: Settings, card: ModelCard, redis_client: redis.Redis
) -> None:
    """The runtime's side of the breaker: a worker whose engine broke stops
    heart-beating and leaves the registry (the web tier no longer counts on it, and
    ``/ready`` says so if it was the last), then calls ``on_broken`` with the reason,
    where the Celery worker exits non-zero for its supervisor to restart it."""
    engine = BreakingEngine(EchoEngine(), 0, RuntimeError("CUDA error: unspecified launch failure"))
    runtime = WorkerRuntime(settings, card, engine, redis_client, worker_id="w-breaks")
    broken: list[str] = []
    runtime.on_broken = broken.append
    runtime.start()
    registry = worker_registry(redis_client, Keys(settings.key_prefix))
    try:
        wait_for(lambda: any(w.worker_id == "w-breaks" for w in registry.live()), 5, "a beat")
        store = RequestStore(redis_client, Keys(settings.key_prefix), stream_ttl_s=600)
        result = threading.Thread(
            target=runtime.thread.submit, args=(start_request(store, "r", 5),)
        )
        result.start()
        wait_for(lambda: bool(broken), 10, "on_broken")
    finally:
        runtime.stop()
    assert "unspecified launch failure" in broken[0]
    assert not any(w.worker_id == "w-breaks" for w in registry.live())
