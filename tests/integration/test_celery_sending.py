"""Sending tasks through Celery, cheaply: one Redis client per kombu channel
(``broker.kombu_redis``) and ``task-sent`` events published off the sending thread,
many per message (``broker.sent_events``), against a real Redis and a real Celery
event receiver."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from app.settings import Settings
from broker import kombu_redis, sent_events
from broker.celery_app import create_celery, queue_name, send_generate
from broker.server import RedisServer
from tests.stack import isolated_settings, wait_for

pytestmark = pytest.mark.integration


class Events:
    """Every Celery event on the broker, as a receiver (Flower, ``celery events``) sees
    them: ``task.multi`` messages come back split into their events."""

    def __init__(self, settings: Settings) -> None:
        self.app = create_celery(settings, results=False)
        self.seen: list[dict[str, Any]] = []
        self._conn = self.app.connection()
        self._receiver = self.app.events.Receiver(self._conn, handlers={"*": self.seen.append})
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        self._receiver.should_stop = False
        try:
            for _ in self._receiver.consume(limit=None, timeout=None, wakeup=False):
                self._ready.set()
        except Exception:  # the server stops under it at the end of a test
            pass

    def wait_ready(self, send: Any) -> None:
        """Subscribed (pub/sub drops what is sent before): send until one arrives."""

        def arrived() -> bool:
            send()
            return bool(self.seen)

        wait_for(arrived, 20, "the receiver to subscribe", interval=0.2)
        time.sleep(0.2)
        self.seen.clear()

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.seen if e["type"] == kind]

    def close(self) -> None:
        self._receiver.should_stop = True
        self._conn.release()


@pytest.fixture
def events(settings: Settings) -> Iterator[Events]:
    found = Events(settings)
    try:
        yield found
    finally:
        found.close()


def publishes(client: redis.Redis) -> int:
    stats: Any = client.info("commandstats")
    return int(stats.get("cmdstat_publish", {}).get("calls", 0))


def test_transport_for_each_url_scheme() -> None:
    assert kombu_redis.transport_for("redis://127.0.0.1:6379/0") == ("broker.kombu_redis:Transport")
    assert kombu_redis.transport_for("sentinel://127.0.0.1:26379/0;sentinel://h:1/0") == (
        "broker.kombu_redis:SentinelTransport"
    )
    # TLS and anything else: kombu's own choice from the URL.
    assert kombu_redis.transport_for("rediss://127.0.0.1:6380/0") is None


def test_a_channel_builds_one_client_for_all_its_commands(
    settings: Settings, redis_client: redis.Redis
) -> None:
    app = create_celery(settings, results=False)
    with app.connection_for_write() as conn:
        channel = conn.default_channel
        assert isinstance(channel, kombu_redis.Channel)
        assert channel._create_client() is channel._create_client()
        # The consumer's (BRPOP, pub/sub) client is not the shared one.
        assert channel._create_client(asynchronous=True) is not channel._create_client()
    queue = queue_name("interactive", settings.served_name)
    rids = [uuid.uuid4().hex for _ in range(3)]
    for rid in rids:
        send_generate(app, rid, 0, queue="interactive", model=settings.served_name)
    assert redis_client.llen(queue) == 3  # every send reached its queue
    redis_client.delete(queue)


def test_task_sent_events_arrive_many_per_message(
    settings: Settings, redis_client: redis.Redis, events: Events
) -> None:
    app = create_celery(settings, results=False)
    queue = queue_name("interactive", settings.served_name)
    events.wait_ready(
        lambda: send_generate(app, uuid.uuid4().hex, 0, queue="interactive", model="warm")
    )
    before = publishes(redis_client)
    rids = [uuid.uuid4().hex for _ in range(20)]
    for rid in rids:
        send_generate(app, rid, 0, queue="interactive", model=settings.served_name)
    publisher = sent_events.sent_events(app)
    assert publisher is not None and publisher.flush()
    wait_for(lambda: len(events.of("task-sent")) >= 20, 10, "20 task-sent events")
    sent = events.of("task-sent")
    assert [e["uuid"] for e in sent] == [f"{rid}.0" for rid in rids]  # each once, in order
    assert {e["name"] for e in sent} == {"tokenrelay.generate"}
    assert {e["queue"] for e in sent} == {queue}
    clocks = [e["clock"] for e in sent]
    assert clocks == sorted(clocks) and len(set(clocks)) == 20  # Celery's logical clock
    # Twenty tasks, twenty LPUSHes, and their events in a few messages, not twenty.
    assert publishes(redis_client) - before <= 5
    redis_client.delete(queue, queue_name("interactive", "warm"))


def test_an_app_without_sent_events_sends_none(settings: Settings) -> None:
    app = create_celery(settings, results=False)
    app.conf.task_send_sent_event = False
    assert sent_events.sent_events(app) is None


def test_events_lost_to_an_outage_do_not_stop_later_ones(tmp_path: Path) -> None:
    """A batch that cannot be published is dropped (events are monitoring); the thread
    lives on and publishes the next ones once Redis is back."""
    server = RedisServer().start()
    try:
        settings = isolated_settings(server.url, tmp_path)
        app = create_celery(settings, results=False)
        publisher = sent_events.sent_events(app)
        assert publisher is not None
        server.kill()
        publisher.publish("task-sent", {"uuid": "lost"}, None)
        assert publisher.flush(timeout_s=30)  # retried, then dropped
        server.start()
        seen = Events(settings)
        try:
            seen.wait_ready(lambda: publisher.publish("task-sent", {"uuid": "warm"}, None))
            publisher.publish("task-sent", {"uuid": "after"}, None)
            wait_for(lambda: any(e.get("uuid") == "after" for e in seen.seen), 10, "the next event")
            assert not any(e.get("uuid") == "lost" for e in seen.seen)
        finally:
            seen.close()
    finally:
        server.stop()
