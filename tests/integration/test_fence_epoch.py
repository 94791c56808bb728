"""The publish's fence epoch (``Keys.fence_epoch``, ``scripts.PUBLISH``) on a real
redis-server: a worker skips checking each request's lease and cancel key while the
epoch is the one its last publish on the same connection ran under, and everything that
can fence or cancel a request changes it, so nothing the per-request checks caught gets
through: a resume, a second claim of the same attempt, a cancel, a Redis that lost the
epoch, a new connection (to a Redis that may have restarted without its last writes)."""

from __future__ import annotations

import time
from typing import Any

import pytest
import redis

from app.messages import TokenDelta
from app.settings import Settings
from broker.direct import DirectConnection
from broker.publish import (
    KnownEpoch,
    PublishItem,
    PublishStatus,
    encode_deltas,
    lease_value,
    publish_reply,
)
from broker.requests import ClaimResult, RequestStore
from broker.step_lines import split_step
from tests.stack import make_record

pytestmark = pytest.mark.integration


class Sender:
    """One worker's publishes, as its engine thread sends them: on a connection of its
    own, keeping the epoch each reply returns. A request's first publish is written out
    (its attempt's first chunk, a lease extension); the ones after are plain (its step
    line only, written by the worker: ``scripts.PUBLISH``)."""

    def __init__(self, store: RequestStore, worker: str) -> None:
        self.store, self.worker = store, worker
        self.via = DirectConnection(store.redis)
        self.known = KnownEpoch()
        self.ordinals: dict[str, int] = {}

    def publish(self, rids: list[str], attempt: int = 0) -> list[PublishStatus]:
        items = []
        for rid in rids:
            n = self.ordinals[rid] = self.ordinals.get(rid, 0) + 1
            payload = encode_deltas([TokenDelta(0, [n])])
            lease = lease_value(self.worker, attempt)
            items.append(
                PublishItem(rid, lease, attempt, payload, n == 1, refresh=n == 1, ordinal=n)
            )
        pending = self.store.publish_begin(items, 30.0, self.via, self.worker, known=self.known)
        return pending.statuses()

    def last_lines(self) -> list[tuple[str, int]]:
        """(request id, ordinal) of each line of the last step entry it wrote."""
        ((_eid, fields),) = self.store.redis.xrevrange(self.store.keys.steps(self.worker), count=1)
        prefix = self.store.keys.tokens("")
        return [(key.removeprefix(prefix), n) for key, _a, n, _p in split_step(fields[b"d"])]


def new_request(settings: Settings, store: RequestStore, worker: str) -> str:
    record = make_record(settings, [list(range(100, 110))], max_tokens=10)
    store.create(record)
    assert store.claim(record.request_id, 0, worker, 30.0, time.time()) is ClaimResult.OK
    return record.request_id


def calls(client: redis.Redis, command: str = "get") -> int:
    """How many times Redis ran ``command`` so far (scripts' own commands included)."""
    stats: Any = client.info("commandstats")
    return int(stats.get(f"cmdstat_{command}", {}).get("calls", 0))


def test_a_publish_under_the_known_epoch_checks_no_request(
    settings: Settings, store: RequestStore, redis_client: redis.Redis
) -> None:
    rids = [new_request(settings, store, "wA") for _ in range(3)]
    sender = Sender(store, "wA")
    before = calls(redis_client)
    assert sender.publish(rids) == [PublishStatus.OK] * 3
    checked = calls(redis_client) - before  # the epoch's GET and each lease's
    assert checked == 4
    before = calls(redis_client)
    assert sender.publish(rids) == [PublishStatus.OK] * 3
    assert calls(redis_client) - before == 1  # the epoch's alone

    # A lease that expired with no one resuming its request is still this attempt's:
    # the worker goes on (its lease is gone, so the watchdog resumes it, which fences).
    redis_client.delete(store.keys.lease(rids[0]))
    assert sender.publish(rids) == [PublishStatus.OK] * 3
    # On a new connection (Redis may have restarted without its last writes) it checks.
    sender.via.close()
    assert sender.publish(rids) == [PublishStatus.FENCED, PublishStatus.OK, PublishStatus.OK]


def test_a_resume_fences_the_worker_that_held_the_request(
    settings: Settings, store: RequestStore, redis_client: redis.Redis
) -> None:
    rid, other = new_request(settings, store, "wA"), new_request(settings, store, "wA")
    old = Sender(store, "wA")
    assert old.publish([rid, other]) == [PublishStatus.OK] * 2
    assert old.publish([rid, other]) == [PublishStatus.OK] * 2  # under the known epoch
    redis_client.delete(store.keys.lease(rid))  # wA stalled past its lease
    assert store.resume(rid) == 1
    assert store.claim(rid, 1, "wB", 30.0, time.time()) is ClaimResult.OK
    newer = new_request(settings, store, "wA")  # written out: its first publish
    statuses = old.publish([rid, newer, other])
    assert statuses == [PublishStatus.FENCED, PublishStatus.OK, PublishStatus.OK]
    assert sorted(old.last_lines()) == sorted([(newer, 1), (other, 3)])  # none of rid's
    assert Sender(store, "wB").publish([rid], attempt=1) == [PublishStatus.OK]


def test_a_second_claim_of_the_same_attempt_fences_the_first_worker(
    settings: Settings, store: RequestStore, redis_client: redis.Redis
) -> None:
    """Celery redelivers the task of a worker whose lease expired before any watchdog
    resumed the request: the same attempt, claimed again by another worker."""
    rid = new_request(settings, store, "wA")
    old = Sender(store, "wA")
    assert old.publish([rid]) == [PublishStatus.OK]
    assert old.publish([rid]) == [PublishStatus.OK]
    redis_client.delete(store.keys.lease(rid))
    assert store.claim(rid, 0, "wB", 30.0, time.time()) is ClaimResult.OK
    assert old.publish([rid]) == [PublishStatus.FENCED]


def test_a_cancel_is_reported_at_the_next_publish(settings: Settings, store: RequestStore) -> None:
    rid, other = new_request(settings, store, "wA"), new_request(settings, store, "wA")
    sender = Sender(store, "wA")
    assert sender.publish([rid, other]) == [PublishStatus.OK] * 2
    assert sender.publish([rid, other]) == [PublishStatus.OK] * 2
    store.cancel(rid)
    assert sender.publish([rid, other]) == [PublishStatus.CANCEL, PublishStatus.OK]
    assert sorted(sender.last_lines()) == sorted([(rid, 3), (other, 3)])  # cancelled, not fenced


def test_a_redis_that_lost_the_epoch_makes_the_worker_check(
    settings: Settings, store: RequestStore, redis_client: redis.Redis
) -> None:
    rid = new_request(settings, store, "wA")
    sender = Sender(store, "wA")
    assert sender.publish([rid]) == [PublishStatus.OK]
    redis_client.delete(store.keys.fence_epoch, store.keys.lease(rid))
    assert sender.publish([rid]) == [PublishStatus.FENCED]
    assert redis_client.get(store.keys.fence_epoch)  # created again


def test_the_plain_keys_are_sent_only_when_the_epoch_changed(
    settings: Settings, store: RequestStore, redis_client: redis.Redis
) -> None:
    """Under the epoch it knows, the worker leaves its plain items' lease and cancel
    keys out of the call; when the epoch changed, the script writes nothing and asks for
    them, and the call is sent again with them: one more round trip, the same outcome."""
    rid, other = new_request(settings, store, "wA"), new_request(settings, store, "wA")
    sender = Sender(store, "wA")
    assert sender.publish([rid, other]) == [PublishStatus.OK] * 2  # written out: keyed

    def plain_publish(rids: list[str]) -> tuple[list[PublishStatus], list[str], int]:
        items = []
        for r in rids:
            n = sender.ordinals[r] = sender.ordinals[r] + 1
            payload = encode_deltas([TokenDelta(0, [n])])
            items.append(PublishItem(r, lease_value("wA", 0), 0, payload, refresh=False, ordinal=n))
        before = calls(redis_client, "evalsha")
        pending = store.publish_begin(items, 30.0, sender.via, "wA", known=sender.known)
        sent = list(pending.keys)
        return pending.statuses(), sent, calls(redis_client, "evalsha") - before

    statuses, sent, runs = plain_publish([rid, other])
    assert statuses == [PublishStatus.OK] * 2 and runs == 1
    assert sent == [store.keys.fence_epoch, store.keys.steps("wA")]
    assert sorted(sender.last_lines()) == sorted([(rid, 2), (other, 2)])

    redis_client.delete(store.keys.lease(rid))  # wA stalled past its lease
    assert store.resume(rid) == 1  # a new epoch
    statuses, sent, runs = plain_publish([rid, other])
    assert statuses == [PublishStatus.FENCED, PublishStatus.OK] and runs == 2
    assert sorted(sender.last_lines()) == [(other, 3)]  # none of rid's, nothing twice
    assert len(redis_client.xrange(store.keys.steps("wA"))) == 3
    # The new epoch is known now (the fenced request is no longer published).
    assert plain_publish([other])[::2] == ([PublishStatus.OK], 1)


def test_a_reply_without_the_unchecked_plain_statuses() -> None:
    """Unchecked (the epoch the sender knew), the script leaves out the plain items'
    statuses: each was published. Any other count is a broken reply."""
    order = [2, 0, 1, 3]  # item 2 written out, then the plain items 0, 1 and 3
    short = publish_reply([b"2", b"e1"], order, plain=3)
    assert short.statuses == [
        PublishStatus.OK,
        PublishStatus.OK,
        PublishStatus.CANCEL,
        PublishStatus.OK,
    ]
    assert short.epoch == "e1"
    full = publish_reply([0, 1, 0, 2, b"e2"], order, plain=3)
    assert full.statuses == [
        PublishStatus.FENCED,
        PublishStatus.OK,
        PublishStatus.OK,
        PublishStatus.CANCEL,
    ]
    with pytest.raises(ValueError):
        publish_reply([0, 1, b"e3"], order, plain=3)
