"""Where the web tier sends a request (broker.prefix_routes), against a real Redis.

Workers are registered and advertise their cached prefixes exactly as a worker
process does (``Registry.heartbeat``, ``PrefixAdverts.publish``); the router must send a
prompt to the worker holding strictly the most of it, with room, and to the shared
queue otherwise. ``requeue_own`` hands a stopping worker's own queue back. With
``celery_url`` the workers' queues are on Celery's own Redis and are read there.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import pytest
import redis

from app.prefix_blocks import BLOCK, block_names
from app.records import RequestRecord
from app.settings import Settings
from broker.celery_app import (
    celery_redis,
    create_celery,
    priority_lists,
    queue_depths,
    queue_name,
    requeue_own,
    send_generate,
    worker_queue,
)
from broker.keys import Keys
from broker.prefix_routes import PrefixAdverts, PrefixRouter
from broker.registry import WorkerInfo, worker_registry
from broker.server import RedisServer
from tests.stack import make_record

pytestmark = pytest.mark.integration

SYSTEM = list(range(1000, 1000 + 3 * BLOCK))  # a system prompt of three blocks
A = SYSTEM + list(range(1, 1 + 2 * BLOCK))  # conversation A: two blocks more
B = SYSTEM + list(range(500, 500 + 2 * BLOCK))


class Fleet:
    def __init__(
        self, client: redis.Redis, settings: Settings, queues: redis.Redis | None = None
    ) -> None:
        self.settings = settings
        self.keys = Keys(settings.key_prefix)
        self.registry = worker_registry(client, self.keys)
        self.adverts = PrefixAdverts(client, self.keys, ttl_s=10)
        self.router = PrefixRouter(
            client, self.keys, self.registry, settings.served_name, queues=queues
        )

    def worker(
        self,
        wid: str,
        holds: Sequence[list[int]] = (),
        *,
        scope: str | None = None,
        active: int = 0,
        age_s: float = 0.0,
        routed: bool = True,
    ) -> None:
        model = self.settings.served_name
        info = WorkerInfo(
            worker_id=wid,
            model=model,
            engine="llamacpp",
            capacity=2,
            hostname="h",
            pid=1,
            started=0.0,
            active_jobs=active,
            beat_at=time.time() - age_s,
            routed=routed,
        )
        self.registry.heartbeat(info)
        names = {n for t in holds for n in block_names(scope or f"{model}\n", t)}
        self.adverts.publish(wid, frozenset(names))

    def choose(self, prompt: list[int], **fields: object) -> str | None:
        record = make_record(self.settings, [prompt]).model_copy(update=fields)
        self.router._live_until = 0.0  # read the registry again
        return self.router.choose(record)


@pytest.fixture
def fleet(redis_client: redis.Redis, settings: Settings) -> Fleet:
    return Fleet(redis_client, settings)


def test_the_worker_holding_the_conversation_gets_its_next_turn(fleet: Fleet) -> None:
    fleet.worker("w1", [A])
    fleet.worker("w2", [B])
    assert fleet.choose(A + [7] * 40) == "w1"
    assert fleet.choose(B + [7] * 40) == "w2"
    assert fleet.router.counts["routed"] == 2


def test_ties_and_unknown_prompts_go_to_the_shared_queue(fleet: Fleet) -> None:
    fleet.worker("w1", [SYSTEM])
    fleet.worker("w2", [SYSTEM])
    assert fleet.choose(A) is None  # both hold the system prompt: any will do
    assert fleet.router.counts["tie"] == 1
    assert fleet.choose(list(range(9000, 9200))) is None
    assert fleet.router.counts["no_match"] == 1
    assert fleet.choose(SYSTEM[: BLOCK - 1]) is None  # not one full block


def test_a_shared_system_prompt_is_worth_routing_to(fleet: Fleet) -> None:
    fleet.worker("w1", [A])
    fleet.worker("w2", [])
    assert fleet.choose(B) == "w1"  # w1 holds B's first three blocks, w2 nothing


def test_a_full_stale_or_unrouted_worker_is_passed_over(fleet: Fleet) -> None:
    fleet.worker("w1", [A], active=2)  # its two slots are busy
    fleet.worker("w2", [B])
    assert fleet.choose(A) is None
    assert fleet.router.counts["full"] == 1
    fleet.worker("w1", [A], age_s=30)  # no heartbeat for 30 s: maybe dead
    assert fleet.choose(A) is None
    fleet.worker("w1", [A], routed=False)  # an engine without a prefix cache
    assert fleet.choose(A) is None


def test_queued_turns_count_against_the_room(
    fleet: Fleet, settings: Settings, redis_client: redis.Redis
) -> None:
    fleet.worker("w1", [A], active=1)
    fleet.worker("w2", [B])
    assert fleet.choose(A) == "w1"
    app = create_celery(settings, results=False)
    send_generate(app, "r1", 0, queue="interactive", model=settings.served_name, worker="w1")
    assert fleet.choose(A) is None  # one running + one waiting = its two slots


def test_queues_on_celery_s_own_redis_are_read_there(
    settings: Settings, redis_client: redis.Redis
) -> None:
    with RedisServer() as celery_server:
        settings = settings.model_copy(update={"celery_url": celery_server.url})
        queues = celery_redis(settings, redis_client)
        assert queues is not redis_client
        fleet = Fleet(redis_client, settings, queues)
        fleet.worker("w1", [A], active=1)
        fleet.worker("w2", [B])
        assert fleet.choose(A) == "w1"
        model = settings.served_name
        own, shared = worker_queue(model, "w1"), queue_name("interactive", model)
        app = create_celery(settings, results=False)
        send_generate(app, "r1", 0, queue="interactive", model=model, worker="w1")
        fleet.router.sent("w1")
        assert queues.llen(own) == 1 and not redis_client.exists(own)
        assert 0 < int(queues.ttl(own)) <= 600  # ``sent`` set it on Celery's Redis
        assert fleet.choose(A) is None  # one running + one waiting (there) = its two slots
        assert requeue_own(app, queues, model, "w1") == 1
        assert queue_depths(queues, model)[shared] == 1
        assert queue_depths(redis_client, model)[shared] == 0
        queues.connection_pool.disconnect()


def test_scopes_and_queues_are_respected(fleet: Fleet, settings: Settings) -> None:
    fleet.worker("w1", [A])
    fleet.worker("w2", [B])
    assert fleet.choose(A, cache_scope="salted") is None  # another scope: nothing held
    assert fleet.choose(A, queue="batch") is None  # batch lines share the batch queue
    salted = f"{settings.served_name}\nsalted"
    fleet.worker("w2", [B, A], scope=salted)
    assert fleet.choose(A, cache_scope="salted") == "w2"


def test_the_record_names_its_route_and_goes_to_that_queue(
    fleet: Fleet, settings: Settings, redis_client: redis.Redis
) -> None:
    fleet.worker("w1", [A])
    fleet.worker("w2", [B])
    model = settings.served_name
    record = make_record(settings, [A]).model_copy(update={"route": "w1"})
    assert RequestRecord.decode(record.encode()).route == "w1"
    app = create_celery(settings, results=False)
    send_generate(app, record.request_id, 0, queue="interactive", model=model, worker="w1")
    send_generate(app, "other", 2, queue="interactive", model=model, worker="w1")
    # A key with many requests in flight queues its next one behind (fair_priority):
    # kombu keeps it in the queue's list for that priority step.
    send_generate(app, "late", 0, queue="interactive", model=model, worker="w1", priority=9)
    own, shared = worker_queue(model, "w1"), queue_name("interactive", model)
    assert [redis_client.llen(k) for k in priority_lists(own)] == [2, 0, 0, 1]
    assert queue_depths(redis_client, model)[shared] == 0
    # w1 stops: all go to the shared queue, where any worker takes them, each at its step.
    assert requeue_own(app, redis_client, model, "w1") == 3
    assert sum(redis_client.llen(k) for k in priority_lists(own)) == 0
    assert [redis_client.llen(k) for k in priority_lists(shared)] == [2, 0, 0, 1]
    assert queue_depths(redis_client, model)[shared] == 3


def test_adverts_are_rewritten_or_changed_in_place(fleet: Fleet, redis_client: redis.Redis) -> None:
    key = fleet.keys.prefix_blocks("w9")
    fleet.adverts.publish("w9", frozenset({b"a", b"b"}))
    fleet.adverts.publish("w9", frozenset({b"b", b"c"}), frozenset({b"a", b"b"}))
    assert redis_client.smembers(key) == {b"b", b"c"}
    assert 0 < redis_client.pttl(key) <= 10_000
    fleet.adverts.publish("w9", frozenset({b"d"}))  # a rewrite drops what it does not name
    assert redis_client.smembers(key) == {b"d"}
    fleet.adverts.remove("w9")
    assert not redis_client.exists(key)


def test_the_load_the_engine_thread_wrote_beats_the_heartbeats(fleet: Fleet) -> None:
    fleet.worker("w1", [A], active=2)  # the heartbeat says full ...
    fleet.worker("w2", [B])
    names = frozenset(block_names(f"{fleet.settings.served_name}\n", A))
    fleet.adverts.publish("w1", names, names, 1)  # ... but one has finished since
    assert fleet.choose(A) == "w1"
    fleet.adverts.publish("w1", names, names, 2)
    assert fleet.choose(A) is None
