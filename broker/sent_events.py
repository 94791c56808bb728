"""Celery's ``task-sent`` events, published off the sending thread, many per message.

Celery publishes a task's ``task-sent`` event (``task_send_sent_event``: Flower shows a
task from the moment it is queued) in the thread that sends the task: a second kombu
message and Redis round trip for every task, ~40% of a send. In the web tier that is
inside a request's start, and in a burst every start waits for the ones before it
(``broker.run.START_TURN_WAIT_S``; docs/benchmarks.md).

``SentEvents`` stands in for Celery's dispatcher there (``send_task(...,
event_dispatcher=...)``): the sending thread only builds the event, with the fields,
hostname, pid and logical clock Celery's own dispatcher gives it, and one thread per
process publishes whatever has gathered in ``LINGER_S`` as one ``task.multi`` message.
That is the form Celery's workers send their own task events in, and every event
receiver (Flower, ``celery events``) splits it back into its events. An event may now
reach a monitor after the worker's ``task-received``; Celery's event state merges an
earlier state that arrives late without going back to it.

Events are monitoring, not the request's truth (its record is): a batch that cannot be
published (Redis away past the retry policy) is dropped with a warning, and at most
``MAX_PENDING`` wait while the publisher is stuck.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from typing import Any

from celery import Celery
from celery.events.event import Event, get_exchange
from celery.utils.nodenames import anon_nodename
from celery.utils.time import utcoffset

logger = logging.getLogger(__name__)

MAX_PENDING = 10_000  # events held while the publisher cannot publish; more are dropped
MAX_BATCH = 500  # events per message
LINGER_S = 0.05  # how long the thread lets events gather before it publishes them
RETRY_POLICY = {"max_retries": 3, "interval_start": 0.2, "interval_step": 0.5}


class SentEvents:
    """A ``task-sent`` publisher for one sender app; pass it as ``event_dispatcher``."""

    def __init__(self, app: Celery) -> None:
        self.app = app
        self.hostname = anon_nodename()  # what Celery's sender-side dispatcher uses
        with app.connection_for_write() as conn:
            self.exchange = get_exchange(conn, name=app.conf.event_exchange)
        self.serializer = app.conf.event_serializer
        self._cond = threading.Condition()
        self._pending: list[Any] = []
        self._pid = 0  # the process whose thread publishes (a fork starts its own)
        self._busy = False  # the thread holds a batch it has not finished publishing
        self.dropped = 0

    def publish(
        self, type: str, fields: dict[str, Any], producer: Any, blind: bool = False, **_: Any
    ) -> None:
        """What Celery's ``send_task_message`` calls: queue the event for the thread."""
        event = Event(
            type,
            hostname=self.hostname,
            utcoffset=utcoffset(),
            pid=os.getpid(),
            clock=None if blind else self.app.clock.forward(),
            **fields,
        )
        with self._cond:
            if self._pid != os.getpid():
                self._start()
            if len(self._pending) >= MAX_PENDING:
                self.dropped += 1
                return
            self._pending.append(event)
            self._cond.notify()

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until every queued event was published (or dropped); False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._pending and not self._busy, timeout_s)

    # -- the publishing thread --------------------------------------------------------
    def _start(self) -> None:
        self._pid = os.getpid()
        self._pending = []
        self._busy = False
        thread = threading.Thread(target=self._run, name="task-sent-events", daemon=True)
        thread.start()

    def _run(self) -> None:
        while True:
            with self._cond:
                self._busy = False
                self._cond.notify_all()
                self._cond.wait_for(lambda: bool(self._pending))
                self._busy = True
            time.sleep(LINGER_S)  # one message for what a burst sends meanwhile
            with self._cond:
                batch = self._pending[:MAX_BATCH]
                del self._pending[:MAX_BATCH]
            self._send(batch)

    def _send(self, batch: list[Any]) -> None:
        try:
            with self.app.producer_or_acquire() as producer:
                producer.publish(
                    batch,
                    routing_key="task.multi",
                    exchange=self.exchange.name,
                    declare=[self.exchange],
                    serializer=self.serializer,
                    headers={"hostname": self.hostname},
                    delivery_mode=1,
                    retry=True,
                    retry_policy=RETRY_POLICY,
                )
        except Exception as exc:  # monitoring only: never let it take the thread down
            logger.warning("dropped %d task-sent events: %s", len(batch), exc)


_BY_APP: weakref.WeakKeyDictionary[Celery, SentEvents] = weakref.WeakKeyDictionary()
_BY_APP_LOCK = threading.Lock()


def sent_events(app: Celery) -> SentEvents | None:
    """``app``'s publisher, built on first use; None when the app sends no such events."""
    if not app.conf.task_send_sent_event:
        return None
    with _BY_APP_LOCK:
        found = _BY_APP.get(app)
        if found is None:
            found = _BY_APP[app] = SentEvents(app)
        return found
