"""Admission and the record's write in one call (``RequestStore.admit(create=...)``):
a start's one round trip, with nothing written for a request that is refused."""

from __future__ import annotations

import time
import uuid

import pytest
import redis

from app.records import RequestRecord, RequestState, SamplingParams, StopConditions
from broker.requests import Admission, ClaimResult, RequestStore

pytestmark = pytest.mark.integration


def record(owner: str = "") -> RequestRecord:
    now = time.time()
    return RequestRecord(
        request_id=uuid.uuid4().hex,
        model="m",
        prompts=[[10, 11, 12]],
        sampling=SamplingParams(),
        stop=StopConditions(max_tokens=8, eos_token_ids=(2,)),
        created=now,
        deadline=now + 60,
        owner=owner,
    )


def handed_to_streamers(store: RequestStore, rid: str) -> bool:
    entries = store.redis.xrange(store.keys.new_requests)
    return any(fields[b"r"].decode() == rid for _eid, fields in entries)


def admit(store: RequestStore, rec: RequestRecord, limit: int, owner_limit: int = 0) -> Admission:
    answer, _ahead, *_used = store.admit(
        rec.request_id,
        rec.deadline,
        limit,
        time.time(),
        owner=rec.owner,
        owner_limit=owner_limit,
        create=rec,
    )
    return answer


def test_an_admitted_request_is_written_as_create_writes_it(
    store: RequestStore, redis_client: redis.Redis
) -> None:
    rec = record()
    assert admit(store, rec, limit=10) is Admission.ADMITTED
    loaded = store.load(rec.request_id)
    assert loaded == (rec, RequestState.QUEUED, 0)
    assert redis_client.hget(store.keys.request(rec.request_id), "worker") == b""
    assert 0 < redis_client.ttl(store.keys.request(rec.request_id)) <= store.stream_ttl_s
    assert handed_to_streamers(store, rec.request_id)
    assert store.in_flight(time.time()) >= 1
    store.release(rec.request_id)


def test_a_refused_request_writes_nothing(store: RequestStore, redis_client: redis.Redis) -> None:
    held = record()
    assert admit(store, held, limit=1) is Admission.ADMITTED
    refused = record()
    assert admit(store, refused, limit=1) is Admission.FULL
    assert store.load(refused.request_id) is None
    assert not handed_to_streamers(store, refused.request_id)
    store.release(held.request_id)


def test_an_owner_over_quota_writes_nothing(store: RequestStore) -> None:
    first, second = record(owner="k1"), record(owner="k1")
    assert admit(store, first, limit=10, owner_limit=1) is Admission.ADMITTED
    assert admit(store, second, limit=10, owner_limit=1) is Admission.OWNER_FULL
    assert store.load(second.request_id) is None
    assert not handed_to_streamers(store, second.request_id)
    store.release(first.request_id)


def test_a_claim_brings_the_record_with_it(store: RequestStore, redis_client: redis.Redis) -> None:
    """A worker's start is one round trip: the claim that takes the lease returns the
    record; a claim that fails returns none and takes nothing."""
    rec = record()
    assert admit(store, rec, limit=10) is Admission.ADMITTED
    rid = rec.request_id
    now = time.time()
    assert store.claim_and_load(rid, 0, "w1", 5.0, now) == (ClaimResult.OK, rec, False)
    assert redis_client.get(store.keys.lease(rid)) == b"w1:0"
    assert store.claim_and_load(rid, 0, "w2", 5.0, now) == (ClaimResult.HELD, None, False)
    assert store.claim_and_load(rid, 1, "w2", 5.0, now) == (ClaimResult.STALE, None, False)
    assert redis_client.get(store.keys.lease(rid)) == b"w1:0"
    redis_client.delete(store.keys.lease(rid))  # w1 is gone: claimed again, "again"
    assert store.claim_and_load(rid, 0, "w2", 5.0, now) == (ClaimResult.OK, rec, True)
    missing = uuid.uuid4().hex
    assert store.claim_and_load(missing, 0, "w1", 5.0, now) == (ClaimResult.MISSING, None, False)
    assert not redis_client.exists(store.keys.lease(missing))


def test_admission_says_how_many_of_the_owners_requests_are_ahead(store: RequestStore) -> None:
    """What orders the queue between keys (``fair_priority``): 0 for a key's first
    request, then one more for each of its requests in flight; a key's count is its own."""
    held = [record(owner="k-ahead") for _ in range(3)]
    counts = [
        store.admit(r.request_id, r.deadline, 10, time.time(), owner=r.owner, create=r)[1]
        for r in held
    ]
    other = record(owner="k-other")
    alone = store.admit(other.request_id, other.deadline, 10, time.time(), owner=other.owner)
    assert counts == [0, 1, 2] and alone[:2] == (Admission.ADMITTED, 0)
    for r in (*held, other):
        store.release(r.request_id)


def test_a_model_over_its_share_is_refused_while_others_are_admitted(
    store: RequestStore,
) -> None:
    """``model_max_queue``: one model's choices in flight are bounded on their own, under
    the shared limit, so a burst for one model leaves room for the others; a refused
    request writes nothing; an entry written before models were recorded counts for
    none."""

    def admit(r: RequestRecord, model: str, weight: int = 1) -> Admission:
        answer, _ahead, *_used = store.admit(
            r.request_id,
            r.deadline,
            10,
            time.time(),
            weight=weight,
            model=model,
            model_limit=3,
            create=r,
        )
        return answer

    a1, a2, b1, old = record(), record(), record(), record()
    assert admit(a1, "model-a", weight=2) is Admission.ADMITTED
    assert admit(a2, "model-a", weight=2) is Admission.MODEL_FULL  # 2 + 2 > 3
    assert store.load(a2.request_id) is None
    assert admit(b1, "model-b", weight=3) is Admission.ADMITTED
    store.redis.zadd(store.keys.inflight, {old.request_id: old.deadline})
    store.redis.hset(store.inflight_weights, old.request_id, "1 ")  # the older format
    assert admit(a2, "model-a", weight=1) is Admission.ADMITTED  # 2 + 1 <= 3
    for r in (a1, a2, b1, old):
        store.release(r.request_id)
