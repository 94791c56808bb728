"""Checkpointed token streams (broker/chunks.py) against a real redis-server.

A worker with a step stream writes a request's own token stream only at checkpoints;
its chunks are the token stream's plus the tail in the step stream. These tests check
that every reader gets every chunk exactly once at every moment: after each publish,
after the step stream was trimmed past a request that stopped producing, after a
resumed attempt sealed its predecessor's tail, and that a publish whose reply was lost
is told apart from one that never ran.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator

import pytest
import redis

from app.messages import EngineFinish, TokenDelta
from app.settings import Settings
from broker.celery_app import TaskOutcome
from broker.chunks import (
    CHECKPOINT_BYTES,
    CHECKPOINT_STEPS,
    ChunkLog,
    encode_prior,
    entry_chunks,
    phase_of,
)
from broker.keys import Keys
from broker.publish import (
    FencedTail,
    PublishItem,
    PublishStatus,
    decode_deltas,
    encode_deltas,
    lease_value,
    publish_stamp,
)
from broker.requests import ClaimResult, RequestStore
from tests.stack import make_record
from workers.engine_thread import EngineThread
from workers.engines.base import ChoiceJob, Engine, EngineJob, EngineStep
from workers.engines.echo import EchoEngine
from workers.work_items import WorkItem

pytestmark = pytest.mark.integration


@pytest.fixture
def store(settings: Settings, redis_client: redis.Redis) -> RequestStore:
    return RequestStore(redis_client, Keys(settings.key_prefix), stream_ttl_s=600)


def new_request(settings: Settings, store: RequestStore, worker: str, tokens: int = 400) -> str:
    record = make_record(settings, [list(range(100, 100 + tokens))], max_tokens=tokens)
    store.create(record)
    assert store.claim(record.request_id, 0, worker, 30.0, time.time()) is ClaimResult.OK
    return record.request_id


def ids_of(store: RequestStore, rid: str, after: int = 0) -> list[int]:
    """Every token id a reader gets from the request's chunks, checking their ordinals
    run on from ``after`` without a gap or a repeat."""
    chunks = store.read_chunks(rid, after)
    assert [c.n for c in chunks] == list(range(after + 1, after + 1 + len(chunks)))
    return [t for c in chunks for d in decode_deltas(c.payload) for t in d.token_ids]


class Publisher:
    """Publishes like the engine thread: one ``ChunkLog`` per request."""

    def __init__(self, store: RequestStore, worker: str) -> None:
        self.store, self.worker = store, worker
        self.logs: dict[str, ChunkLog] = {}
        self.index = 0

    def step(self, tokens: dict[str, list[int]], done: tuple[str, ...] = ()) -> None:
        items = []
        for rid, ids in tokens.items():
            log = self.logs.setdefault(rid, ChunkLog())
            first = log.ordinal == 0
            finish = EngineFinish.LENGTH if rid in done else None
            payload = encode_deltas([TokenDelta(0, ids, finish=finish)])
            n, mark, prior = log.stage(payload, self.index, force=first or rid in done)
            lease = lease_value(self.worker, 0)
            items.append(
                PublishItem(rid, lease, 0, payload, first, rid in done, True, n, mark, prior)
            )
        for rid, log in self.logs.items():  # the engine thread's ``due`` restage
            if rid not in tokens and log.due(self.index):
                n, payload, prior = log.restage(self.index)
                lease = lease_value(self.worker, 0)
                items.append(
                    PublishItem(rid, lease, 0, payload, False, False, True, n, True, prior)
                )
        assert all(s == 0 for s in self.store.publish(items, 30.0, self.worker))
        self.index += 1


def test_chunk_log_numbers_checkpoints_and_rolls_back() -> None:
    log = ChunkLog(ordinal=7)
    assert log.stage(b"a", 0, force=True) == (8, True, b"")
    for i in range(1, CHECKPOINT_STEPS - 1):
        n, mark, _prior = log.stage(b"x%d" % i, i, force=False)
        assert (n, mark) == (8 + i, False)
    n, mark, prior = log.stage(b"y", CHECKPOINT_STEPS - 1, force=False)
    assert mark and n == 8 + CHECKPOINT_STEPS - 1
    assert [c for c, _p in entry_chunks({b"p": prior, b"n": b"%d" % n, b"d": b"y"})] == list(
        range(9, n + 1)
    )
    log.unstage()  # it did not run: the same ordinal, still a checkpoint, next time
    assert log.stage(b"z", CHECKPOINT_STEPS, force=False) == (n, True, prior)
    assert log.since == b"" and log.ordinal == n and not log.due(10_000)
    # A chunk that did not run is numbered again; many bytes make a checkpoint early.
    assert log.stage(b"c", CHECKPOINT_STEPS + 1, force=False) == (n + 1, False, b"")
    log.unstage()
    assert log.since == b"" and log.ordinal == n
    assert log.stage(b"b" * (CHECKPOINT_BYTES + 1), CHECKPOINT_STEPS + 1, force=False)[:2] == (
        n + 1,
        True,
    )


def test_a_request_that_stops_producing_is_due_a_checkpoint() -> None:
    log = ChunkLog()
    log.stage(b"a", 0, force=True)
    log.stage(b"b", 1, force=False)
    assert not log.due(CHECKPOINT_STEPS - 2) and log.due(CHECKPOINT_STEPS - 1)
    assert log.restage(CHECKPOINT_STEPS - 1) == (2, b"b", b"")
    log.unstage()  # did not run: still due, and the chunk still pending
    assert log.due(CHECKPOINT_STEPS) and log.ordinal == 2 and log.since == b"2\nb\n"
    assert log.restage(CHECKPOINT_STEPS) == (2, b"b", b"")
    assert not log.due(10 * CHECKPOINT_STEPS) and log.ordinal == 2
    # Several chunks pending: the last one taken back, then a checkpoint without one.
    log.stage(b"c", CHECKPOINT_STEPS + 1, force=False)
    log.stage(b"d", CHECKPOINT_STEPS + 2, force=False)
    log.unstage()  # d did not run
    assert log.ordinal == 3 and log.since == b"3\nc\n"
    assert log.stage(b"D", CHECKPOINT_STEPS + 3, force=False) == (4, False, b"")
    assert log.restage(3 * CHECKPOINT_STEPS) == (4, b"D", b"3\nc")


def test_requests_that_start_together_checkpoint_on_different_steps() -> None:
    marks: dict[int, list[int]] = {}
    phases = (0, 5, CHECKPOINT_STEPS - 2, phase_of("some request"))
    for phase in phases:
        log = ChunkLog(phase=phase)
        for i in range(4 * CHECKPOINT_STEPS):
            _n, mark, _prior = log.stage(b"x", i, force=i == 0)
            if mark and i:
                marks.setdefault(phase, []).append(i)
    for phase in phases:  # the first period is shortened by the phase, then whole
        m = marks[phase]
        assert m[0] == CHECKPOINT_STEPS - 1 - phase
        assert all(b - a == CHECKPOINT_STEPS - 1 for a, b in itertools.pairwise(m))
    assert 0 <= phase_of("some request") < CHECKPOINT_STEPS - 1


def test_encode_prior_round_trips_and_malformed_entries_raise() -> None:
    prior = encode_prior([(3, b"[[0,[1]]]"), (4, b"[[0,[2]]]")])
    fields = {b"p": prior, b"n": b"5", b"d": b"[[0,[3]]]"}
    assert entry_chunks(fields) == [(3, b"[[0,[1]]]"), (4, b"[[0,[2]]]"), (5, b"[[0,[3]]]")]
    with pytest.raises(ValueError):
        entry_chunks({b"p": b"3", b"n": b"5", b"d": b"[]"})
    with pytest.raises(KeyError):
        entry_chunks({b"d": b"[]"})


def test_every_chunk_is_read_once_at_every_step(
    settings: Settings, redis_client: redis.Redis, store: RequestStore
) -> None:
    keys = Keys(settings.key_prefix)
    a, b = new_request(settings, store, "wA"), new_request(settings, store, "wA")
    pub = Publisher(store, "wA")
    sent: dict[str, list[int]] = {a: [], b: []}
    steps = 3 * CHECKPOINT_STEPS + 5
    for i in range(steps):
        tokens = {a: [1000 + i], b: [2000 + i, 3000 + i]}
        pub.step(tokens, done=(a, b) if i == steps - 1 else ())
        for rid, ids in tokens.items():
            sent[rid] += ids
            assert ids_of(store, rid) == sent[rid]
            assert ids_of(store, rid, after=i) == ids  # a reader that has the rest
    # One token-stream entry per checkpoint, not per step.
    for rid in (a, b):
        assert len(redis_client.xrange(keys.tokens(rid))) == 5  # first, 3 periods, last
        log = store.read_log(rid)
        assert log.tail == [] and log.recorded == steps
    assert len(redis_client.xrange(keys.steps("wA"))) == steps


def test_the_tail_of_a_request_that_stops_producing_outlives_the_step_stream(
    settings: Settings, redis_client: redis.Redis, store: RequestStore
) -> None:
    """One request publishes three chunks and then nothing while another fills the
    step stream past its trimming: its tail was checkpointed in time."""
    keys = Keys(settings.key_prefix)
    idle, busy = new_request(settings, store, "wA"), new_request(settings, store, "wA", tokens=1000)
    pub = Publisher(store, "wA")
    for i in range(3):
        pub.step({idle: [7, i], busy: [i]})
    for i in range(3, 700):
        pub.step({busy: [i]})
    assert redis_client.xlen(keys.steps("wA")) < 500  # trimmed past the idle one's lines
    kept = redis_client.xrange(keys.steps("wA"))
    assert all(keys.tokens(idle).encode() not in fields[b"d"] for _id, fields in kept)
    assert len(redis_client.xrange(keys.tokens(idle))) == 2  # its first, and one when due
    assert ids_of(store, idle) == [7, 0, 7, 1, 7, 2]
    assert ids_of(store, busy) == list(range(700))


def test_a_resumed_attempt_seals_its_predecessors_tail(
    settings: Settings, redis_client: redis.Redis, store: RequestStore
) -> None:
    keys = Keys(settings.key_prefix)
    rid = new_request(settings, store, "wA")
    pub = Publisher(store, "wA")
    for i in range(CHECKPOINT_STEPS + 5):
        pub.step({rid: [i]})
    assert store.read_log(rid).tail  # chunks only worker A's step stream holds
    redis_client.delete(keys.lease(rid))  # worker A died
    assert store.resume(rid) == 1
    assert store.claim(rid, 1, "wB", 30.0, time.time()) is ClaimResult.OK
    progress, ordinal = store.resume_point(rid, 1, lease_value("wB", 1))
    assert ordinal == CHECKPOINT_STEPS + 5
    assert progress[0].token_ids == list(range(CHECKPOINT_STEPS + 5))
    redis_client.delete(keys.steps("wA"))  # its step stream goes away: nothing is lost
    log = store.read_log(rid)
    assert (
        log.tail == [] and log.recorded == ordinal and ids_of(store, rid) == progress[0].token_ids
    )
    # Sealing twice (a retried resume) seals nothing more.
    assert store.resume_point(rid, 1, lease_value("wB", 1))[1] == ordinal
    assert ids_of(store, rid) == progress[0].token_ids


def test_a_fenced_attempt_seals_nothing(
    settings: Settings, redis_client: redis.Redis, store: RequestStore
) -> None:
    keys = Keys(settings.key_prefix)
    rid = new_request(settings, store, "wA")
    pub = Publisher(store, "wA")
    for i in range(3):
        pub.step({rid: [i]})
    before = redis_client.xrange(keys.tokens(rid))
    store.resume_point(rid, 1, lease_value("wB", 1))  # not wB's lease
    assert redis_client.xrange(keys.tokens(rid)) == before


def test_unsealed_is_what_was_published_since_the_last_checkpoint() -> None:
    log = ChunkLog()
    assert log.unsealed() == (0, [])
    log.stage(b"[1]", 0, force=True)
    assert log.unsealed() == (1, [])
    log.stage(b"[2]", 1, force=False)
    log.stage(b"[3]", 2, force=False)
    log.stage(b"[4]", 3, force=False)
    log.unstage()  # fenced: chunk 4 was not written
    assert log.unsealed() == (1, [(2, b"[2]"), (3, b"[3]")])


def fence_and_trim(
    settings: Settings, redis_client: redis.Redis, store: RequestStore, seal: bool
) -> tuple[str, list[int], list[int]]:
    """Worker A publishes a request's chunks, the last few after its last checkpoint;
    its lease expires and the request is resumed; A's next publish is fenced (and, with
    ``seal``, A seals its tail as the engine thread does); A goes on serving another
    request until its step stream no longer holds the first one's tail. Returns the
    request, every token id A published for it, and those of its checkpoints."""
    keys = Keys(settings.key_prefix)
    rid, other = new_request(settings, store, "wA"), new_request(settings, store, "wA", 1000)
    pub = Publisher(store, "wA")
    for i in range(CHECKPOINT_STEPS + 5):
        pub.step({rid: [i], other: [i]})
    log = pub.logs.pop(rid)
    published = ids_of(store, rid)
    checkpointed = [
        t
        for _id, fields in redis_client.xrange(keys.tokens(rid))
        for _n, payload in entry_chunks(fields)
        for d in decode_deltas(payload)
        for t in d.token_ids
    ]
    assert len(checkpointed) < len(published) == CHECKPOINT_STEPS + 5  # a tail
    redis_client.delete(keys.lease(rid))  # A stalled past its lease
    assert store.resume(rid) == 1
    payload = encode_deltas([TokenDelta(0, [999])])
    n, mark, prior = log.stage(payload, pub.index, force=False)
    item = PublishItem(
        rid, lease_value("wA", 0), 0, payload, ordinal=n, checkpoint=mark, prior=prior
    )
    assert store.publish([item], 30.0, "wA") == [PublishStatus.FENCED]
    log.unstage()
    if seal:
        mark_n, chunks = log.unsealed()
        assert store.seal_fenced([FencedTail(rid, 0, mark_n, chunks)]) == [1]
    for i in range(CHECKPOINT_STEPS + 5, 400):  # A goes on with its other request
        pub.step({other: [i]})
    kept = redis_client.xrange(keys.steps("wA"))
    assert all(keys.tokens(rid).encode() not in fields[b"d"] for _id, fields in kept)
    return rid, published, checkpointed


def test_a_fenced_attempt_seals_its_tail_before_its_step_stream_loses_it(
    settings: Settings, redis_client: redis.Redis, store: RequestStore
) -> None:
    """The resumed attempt starts only after worker A, fenced but alive, trimmed the
    tail out of its step stream (the successor waited for a slot): it still resumes
    from every chunk A published, which a streamer has already turned into text."""
    rid, published, _checkpointed = fence_and_trim(settings, redis_client, store, seal=True)
    assert ids_of(store, rid) == published
    assert store.claim(rid, 1, "wB", 30.0, time.time()) is ClaimResult.OK
    progress, ordinal = store.resume_point(rid, 1, lease_value("wB", 1))
    assert progress[0].token_ids == published and ordinal == len(published)


def test_without_the_fenced_seal_the_tail_would_be_lost(
    settings: Settings, redis_client: redis.Redis, store: RequestStore
) -> None:
    """The case the seal exists for: without it the successor resumes from the last
    checkpoint, behind the text already sent (this test fails if the scenario above
    stops producing a lost tail, so the one above cannot pass vacuously)."""
    rid, published, checkpointed = fence_and_trim(settings, redis_client, store, seal=False)
    assert store.claim(rid, 1, "wB", 30.0, time.time()) is ClaimResult.OK
    progress, _ordinal = store.resume_point(rid, 1, lease_value("wB", 1))
    assert progress[0].token_ids == checkpointed != published


def test_a_successor_that_sealed_first_wins(
    settings: Settings, redis_client: redis.Redis, store: RequestStore
) -> None:
    """The successor read the tail from the step stream and sealed it before the fenced
    predecessor's seal came: that one is refused, nothing is written twice."""
    keys = Keys(settings.key_prefix)
    rid = new_request(settings, store, "wA")
    pub = Publisher(store, "wA")
    for i in range(5):
        pub.step({rid: [i]})
    mark_n, chunks = pub.logs[rid].unsealed()
    assert chunks
    redis_client.delete(keys.lease(rid))
    assert store.resume(rid) == 1
    assert store.claim(rid, 1, "wB", 30.0, time.time()) is ClaimResult.OK
    assert store.resume_point(rid, 1, lease_value("wB", 1))[1] == 5
    before = redis_client.xrange(keys.tokens(rid))
    assert store.seal_fenced([FencedTail(rid, 0, mark_n, chunks)]) == [-1]
    assert redis_client.xrange(keys.tokens(rid)) == before
    assert ids_of(store, rid) == [0, 1, 2, 3, 4]


def test_landed_asks_the_step_stream(
    settings: Settings, redis_client: redis.Redis, store: RequestStore
) -> None:
    rid = new_request(settings, store, "wA")
    stamp = publish_stamp()
    call = [(rid, 0, stamp)]
    assert store.landed(call, "wA") == [False]
    item = PublishItem(rid, lease_value("wA", 0), 0, encode_deltas([TokenDelta(0, [5])]), True)
    store.publish([item], 30.0, "wA", stamp)
    assert store.landed(call, "wA") == [True]
    assert store.landed([(rid, 0, publish_stamp())], "wA") == [False]


class PausingEngine(Engine):
    """Holds one job's steps back for ``pause`` engine steps, then lets them out in
    order (a job the engine stops advancing: its request publishes nothing meanwhile)."""

    name = "pausing"

    def __init__(self, inner: Engine, job: str, after: int, pause: int) -> None:
        self.inner, self.job, self.after, self.pause = inner, job, after, pause
        self.seen = 0
        self.calls = 0
        self.held_since: int | None = None
        self.held: list[EngineStep] = []

    def submit(self, job: EngineJob) -> None:
        self.inner.submit(job)

    def cancel(self, job_id: str) -> None:
        self.inner.cancel(job_id)

    def holding(self) -> bool:
        return self.held_since is not None and self.calls - self.held_since < self.pause

    def step(self) -> list[EngineStep]:
        self.calls += 1
        out = []
        for s in self.inner.step():
            if s.job_id.startswith(self.job):
                self.seen += 1
                if self.seen > self.after and self.held_since is None:
                    self.held_since = self.calls
                if self.holding():
                    self.held.append(s)
                    continue
            out.append(s)
        if self.held and not self.holding():
            out, self.held = self.held + out, []
        return out

    def has_work(self) -> bool:
        return self.inner.has_work() or bool(self.held)

    @property
    def capacity(self) -> int:
        return self.inner.capacity


@pytest.fixture
def paused_thread(store: RequestStore) -> Iterator[EngineThread]:
    engine = PausingEngine(EchoEngine(), "slow/", after=3, pause=1500)
    thread = EngineThread(engine, store, lease_ttl_s=30.0, worker_id="wE")
    thread.start()
    yield thread
    thread.stop()
    thread.join(5)


def test_the_engine_thread_checkpoints_a_request_it_stopped_advancing(
    settings: Settings, redis_client: redis.Redis, store: RequestStore, paused_thread: EngineThread
) -> None:
    """Through the engine thread: a request whose job the engine holds back publishes
    nothing for 1500 steps while another one fills the step stream; every chunk of both
    is still readable, while held back and at the end."""
    keys = Keys(settings.key_prefix)
    handles = {}
    for name, tokens in (("slow", 720), ("fast", 2500)):
        rid = new_request(settings, store, "wE", tokens)
        job = EngineJob(
            job_id=f"{name}/{rid}",
            prompt_ids=list(range(100, 100 + tokens)),
            choices=[ChoiceJob(0, tokens)],
            eos_token_ids=frozenset({2}),
        )
        item = WorkItem(rid, 0, lease_value("wE", 0), [job], deadline=time.time() + 120)
        handles[name] = paused_thread.submit(item)
    slow = handles["slow"].item.request_id
    deadline = time.time() + 60
    while paused_thread.steps < 900 and time.time() < deadline:
        time.sleep(0.02)
    paused = ids_of(store, slow)  # read while it is held back (until step ~1500)
    assert paused == list(range(100, 103))
    for h in handles.values():
        assert h.wait(60)
    for name, tokens in (("slow", 720), ("fast", 2500)):
        rid = handles[name].item.request_id
        assert ids_of(store, rid) == list(range(100, 100 + tokens))
        assert len(redis_client.xrange(keys.tokens(rid))) < tokens // 10


def test_each_checkpoint_gets_its_own_prior_chunks_when_another_is_fenced(
    settings: Settings, redis_client: redis.Redis, store: RequestStore
) -> None:
    """Prior chunks travel after the per-request arguments, one per checkpoint in
    order: a fenced request's must not shift the next one's."""
    keys = Keys(settings.key_prefix)
    lost, mine = new_request(settings, store, "wA"), new_request(settings, store, "wA")
    redis_client.set(keys.lease(lost), "wZ:3")  # lost: another worker holds it now
    payload = encode_deltas([TokenDelta(0, [9])])
    items = [
        PublishItem(rid, lease_value("wA", 0), 0, payload, ordinal=3, checkpoint=True, prior=p)
        for rid, p in ((lost, encode_prior([(1, b"[1]"), (2, b"[2]")])), (mine, b"1\n[5]\n2\n[6]"))
    ]
    assert store.publish(items, 30.0, "wA") == [1, 0]
    assert not redis_client.exists(keys.tokens(lost))
    ((_id, fields),) = redis_client.xrange(keys.tokens(mine))
    assert entry_chunks(fields) == [(1, b"[5]"), (2, b"[6]"), (3, payload)]


def test_the_engine_thread_seals_the_tail_of_an_attempt_it_learns_was_fenced(
    settings: Settings, redis_client: redis.Redis, store: RequestStore
) -> None:
    """Through the engine thread: a request's lease is lost while its tail is only in
    the step stream; the next publish is fenced and the thread seals the tail, then
    goes on serving another request until the step stream no longer holds it. The
    resumed attempt gets every token the fenced one published."""
    keys = Keys(settings.key_prefix)
    thread = EngineThread(
        EchoEngine(tokens_per_second=500), store, lease_ttl_s=30.0, worker_id="wE"
    )
    thread.start()
    try:
        handles = {}
        for name in ("lost", "other"):
            rid = new_request(settings, store, "wE", 3000)
            job = EngineJob(
                job_id=f"{name}/{rid}",
                prompt_ids=list(range(100, 3100)),
                choices=[ChoiceJob(0, 3000)],
                eos_token_ids=frozenset({2}),
            )
            item = WorkItem(rid, 0, lease_value("wE", 0), [job], deadline=time.time() + 120)
            handles[name] = thread.submit(item)
        rid = handles["lost"].item.request_id
        deadline = time.time() + 30
        while time.time() < deadline:  # until its tail holds a few chunks
            log = store.read_log(rid)
            if log.recorded > CHECKPOINT_STEPS and 3 <= len(log.tail) <= 20:
                break
            time.sleep(0.002)
        redis_client.delete(keys.lease(rid))  # it stalled past its lease (as far as Redis sees)
        assert store.resume(rid) == 1
        assert handles["lost"].wait(10)
        assert handles["lost"].result is not None
        assert handles["lost"].result.outcome is TaskOutcome.FENCED
        published = ids_of(store, rid)
        sealed = [f for _id, f in redis_client.xrange(keys.tokens(rid)) if b"w" not in f]
        assert len(sealed) == 1 and sealed[0][b"a"] == b"0"  # the fenced attempt's own
        steps = thread.steps
        while thread.steps < steps + 400 and time.time() < deadline:
            time.sleep(0.01)
        kept = redis_client.xrange(keys.steps("wE"))
        assert all(keys.tokens(rid).encode() not in fields[b"d"] for _id, fields in kept)
    finally:
        thread.stop()
        thread.join(5)
    assert store.claim(rid, 1, "wB", 30.0, time.time()) is ClaimResult.OK
    progress, ordinal = store.resume_point(rid, 1, lease_value("wB", 1))
    assert progress[0].token_ids == published == list(range(100, 100 + len(published)))
    assert ordinal == store.read_log(rid).recorded
