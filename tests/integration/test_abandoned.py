"""Abandoned streams' deadlines (``broker.abandon``) on a real Redis: a stream nobody
follows is cancelled once after the grace, by the process that saw its client go or,
when that process is gone, by another process's sweep; a client that resumes in time
keeps it; a later disconnect's deadline is not taken early by an older timer. A web
process that dies without closing its streams has its clients counted out by another
(once), and one only stalled counts them in again."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest
import redis

from broker.abandon import Abandoned
from broker.keys import Keys

GRACE_S = 0.4
DEAD_AFTER_S = 0.3


def process(
    client: redis.Redis, keys: Keys, cancelled: list[str], sweep_s: float = 60.0
) -> Abandoned:
    """One web process's ``Abandoned``, recording its cancels."""
    lock = threading.Lock()

    def cancel(rid: str) -> None:
        with lock:
            cancelled.append(rid)

    return Abandoned(
        client, keys, GRACE_S, cancel, sweep_s=sweep_s, dead_after_s=DEAD_AFTER_S, ttl_s=60
    )


def follow(web: Abandoned, rid: str, change: int = 1) -> None:
    """One of ``web``'s clients starts (+1) or stops (-1) following ``rid``, as
    ``Runner.queue_follower`` counts it."""
    pipe = web.redis.pipeline(transaction=False)
    pipe.incrby(web.keys.followers(rid), change)
    web.follows.queue(pipe, rid, change)
    pipe.execute()


def followers(client: redis.Redis, keys: Keys, rid: str) -> int:
    return int(client.get(keys.followers(rid)) or 0)


def wait_until(check: Callable[[], bool], timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.02)
    return check()


def fresh_keys() -> Keys:
    return Keys(f"t{uuid.uuid4().hex[:6]}:")


def test_the_process_that_saw_the_client_go_cancels_after_the_grace(
    redis_client: redis.Redis,
) -> None:
    keys, cancelled = fresh_keys(), list[str]()
    web = process(redis_client, keys, cancelled)
    started = time.monotonic()
    web.later("r1")
    assert wait_until(lambda: cancelled == ["r1"])
    assert time.monotonic() - started >= GRACE_S
    assert redis_client.zcard(keys.abandoned) == 0
    web.stopping.set()


def test_a_stopped_process_s_deadline_is_kept_by_another_s_sweep(
    redis_client: redis.Redis,
) -> None:
    keys = fresh_keys()
    gone: list[str] = []
    other: list[str] = []
    stopping = process(redis_client, keys, gone)
    stopping.redis.zadd(keys.abandoned, {"r2": time.time() + GRACE_S})  # its timer died
    sweeper = process(redis_client, keys, other, sweep_s=0.1)
    assert sweeper.sweep() == 0  # not due yet
    sweeper.start_sweeping()
    assert wait_until(lambda: other == ["r2"])
    time.sleep(0.3)
    assert other == ["r2"] and gone == []  # once
    sweeper.stopping.set()


def test_a_resumed_stream_is_not_cancelled(redis_client: redis.Redis) -> None:
    keys, cancelled = fresh_keys(), list[str]()
    web = process(redis_client, keys, cancelled)
    web.later("r3")
    redis_client.incr(keys.followers("r3"))  # a client follows it again
    assert wait_until(lambda: redis_client.zcard(keys.abandoned) == 0)
    time.sleep(0.1)
    assert cancelled == []


def test_each_deadline_is_acted_on_once_among_many_processes(
    redis_client: redis.Redis,
) -> None:
    keys, cancelled = fresh_keys(), list[str]()
    webs = [process(redis_client, keys, cancelled, sweep_s=0.05) for _ in range(4)]
    for i in range(20):
        webs[i % 4].later(f"r{i}")
    for web in webs:
        web.start_sweeping()
    assert wait_until(lambda: len(cancelled) == 20)
    time.sleep(0.3)
    assert sorted(cancelled) == sorted(f"r{i}" for i in range(20))
    for web in webs:
        web.stopping.set()


def test_a_later_disconnect_pushes_the_deadline_back(redis_client: redis.Redis) -> None:
    """A client resumed and left again: the first disconnect's timer must not cancel
    the stream before the second grace is up."""
    keys, cancelled = fresh_keys(), list[str]()
    web = process(redis_client, keys, cancelled)
    web.later("r4")
    time.sleep(GRACE_S * 0.6)
    second = time.monotonic()
    web.later("r4")  # the second disconnect (the follower count is 0 again)
    assert wait_until(lambda: cancelled == ["r4"])
    assert time.monotonic() - second >= GRACE_S * 0.95


def test_a_dead_process_s_clients_are_counted_out_and_its_lone_stream_cancelled(
    redis_client: redis.Redis,
) -> None:
    """Web "killed" follows k1 (two clients) and k2 (one; another process follows k2
    too), then stops heartbeating without closing anything. Another process's sweep
    counts its clients out: k1, followed by nobody now, is cancelled once, its grace
    counted from the dead process's last heartbeat; k2 is kept."""
    keys, theirs, ours = fresh_keys(), list[str](), list[str]()
    killed = process(redis_client, keys, theirs)
    for rid in ("k1", "k1", "k2", "k3"):
        follow(killed, rid)
    follow(killed, "k3", -1)  # that client finished
    assert redis_client.hgetall(keys.web_follows(killed.follows.id)) == {b"k1": b"2", b"k2": b"1"}
    killed.start_sweeping()  # its first heartbeat at once
    registered = keys.web_processes, killed.follows.id
    assert wait_until(lambda: redis_client.zscore(*registered) is not None)
    killed.stopping.set()  # SIGKILL: no more heartbeats, nothing closed
    last_beat = redis_client.zscore(*registered)
    assert last_beat is not None
    other = process(redis_client, keys, ours)
    follow(other, "k2")
    assert other.tick() == 0 and followers(redis_client, keys, "k1") == 2  # not dead yet
    time.sleep(DEAD_AFTER_S + 0.05)
    assert other.reap(time.time()) == 1
    assert other.reap(time.time()) == 0  # taken once
    assert followers(redis_client, keys, "k1") == 0 and followers(redis_client, keys, "k2") == 1
    assert redis_client.zscore(keys.abandoned, "k1") == pytest.approx(last_beat + GRACE_S)
    assert redis_client.zscore(keys.abandoned, "k2") is None
    assert not redis_client.exists(keys.web_follows(killed.follows.id))
    assert wait_until(lambda: other.sweep() >= 0 and ours == ["k1"])
    assert time.time() >= last_beat + GRACE_S
    assert other.tick() == 0 and ours == ["k1"] and theirs == []


def test_a_process_only_stalled_counts_its_clients_in_again(redis_client: redis.Redis) -> None:
    """Taken for dead while it was only stopped (its stream's count went to 0, its
    grace started), its next heartbeat counts its clients in again before the grace
    is up: the stream is not cancelled."""
    keys, ours = fresh_keys(), list[str]()
    slow = process(redis_client, keys, ours)
    follow(slow, "s1")
    slow.follows.beat(time.time())
    other = process(redis_client, keys, ours)
    time.sleep(DEAD_AFTER_S + 0.05)
    assert other.reap(time.time()) == 1 and followers(redis_client, keys, "s1") == 0
    slow.follows.beat(time.time())  # it wakes up
    assert followers(redis_client, keys, "s1") == 1
    assert redis_client.hgetall(keys.web_follows(slow.follows.id)) == {b"s1": b"1"}
    time.sleep(GRACE_S)
    assert other.sweep() == 0 and ours == []
    assert redis_client.zcard(keys.abandoned) == 0  # the deadline was taken, not acted on


def test_one_of_many_sweepers_counts_a_dead_process_out(redis_client: redis.Redis) -> None:
    keys, cancelled = fresh_keys(), list[str]()
    dead = process(redis_client, keys, cancelled)
    alive = process(redis_client, keys, cancelled)
    for rid in ("d1", "d2", "d3"):
        follow(dead, rid)
        follow(alive, rid)
    dead.follows.beat(time.time())
    sweepers = [process(redis_client, keys, cancelled) for _ in range(4)]
    time.sleep(DEAD_AFTER_S + 0.05)
    barrier = threading.Barrier(len(sweepers))
    taken: list[int] = []

    def reap(web: Abandoned) -> None:
        barrier.wait()
        taken.append(web.reap(time.time()))

    threads = [threading.Thread(target=reap, args=(w,)) for w in sweepers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(taken) == [0, 0, 0, 1]
    assert [followers(redis_client, keys, r) for r in ("d1", "d2", "d3")] == [1, 1, 1]
    assert redis_client.zcard(keys.abandoned) == 0 and cancelled == []


def test_a_process_that_exits_cleanly_leaves_the_registry(redis_client: redis.Redis) -> None:
    keys, cancelled = fresh_keys(), list[str]()
    web = process(redis_client, keys, cancelled)
    follow(web, "e1")
    web.follows.beat(time.time())
    web.leave()  # a client still follows: the others must count it out
    assert redis_client.zscore(keys.web_processes, web.follows.id) is not None
    follow(web, "e1", -1)
    web.leave()
    assert redis_client.zscore(keys.web_processes, web.follows.id) is None
    assert not redis_client.exists(keys.web_follows(web.follows.id))


def test_on_a_redis_cluster_a_dead_process_s_clients_are_counted_out_once() -> None:
    """The same on a real Redis Cluster (3 masters): the registry and the hashes are on
    the global tag, each request's follower count on its own shard; the heartbeat's
    clock is the registry node's."""
    from broker.cluster_server import LocalCluster

    keys = Keys(f"t{uuid.uuid4().hex[:6]}:", shards=3)
    rids = [f"c{i}" for i in range(6)]  # spread over the shards
    assert len({keys.followers(r).split("}")[0] for r in rids}) > 1
    with LocalCluster() as cluster, redis.RedisCluster.from_url(cluster.url) as client:
        cluster_client: Any = client
        cancelled: list[str] = []
        dead = process(cluster_client, keys, cancelled)
        alive = process(cluster_client, keys, cancelled)
        for rid in rids:
            follow(dead, rid)
        follow(alive, rids[0])
        assert dead.tick() == 0  # its heartbeat, on the server's clock
        time.sleep(DEAD_AFTER_S + 0.05)
        assert alive.tick() == 0  # counts the dead one's clients out; nothing due yet
        assert [followers(cluster_client, keys, r) for r in rids] == [1, 0, 0, 0, 0, 0]
        assert wait_until(lambda: alive.tick() >= 0 and sorted(cancelled) == rids[1:])
        assert cluster_client.zcard(keys.web_processes) == 1  # the live one
