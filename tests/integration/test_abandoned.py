"""Abandoned streams' deadlines (``broker.abandon``) on a real Redis: a stream nobody
follows is cancelled once after the grace, by the process that saw its client go or,
when that process is gone, by another process's sweep; a client that resumes in time
keeps it; a later disconnect's deadline is not taken early by an older timer."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable

import redis

from broker.abandon import Abandoned
from broker.keys import Keys

GRACE_S = 0.4


def process(
    client: redis.Redis, keys: Keys, cancelled: list[str], sweep_s: float = 60.0
) -> Abandoned:
    """One web process's ``Abandoned``, recording its cancels."""
    lock = threading.Lock()

    def cancel(rid: str) -> None:
        with lock:
            cancelled.append(rid)

    return Abandoned(client, keys, GRACE_S, cancel, sweep_s=sweep_s)


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
