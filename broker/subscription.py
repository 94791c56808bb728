"""One reader's view of one output stream, as the output hub (``broker.hub``) feeds it.

A ``Subscription`` is a bounded queue of output entries with an optional *pump*: a
callback the hub calls on its own thread instead of queueing (``web.sse_pump``), which
answers with ``Pumped``. Apart from the hub because readers (``broker.run``, the SSE
pump) deal in subscriptions, never in the hub's reading.
"""

from __future__ import annotations

import enum
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from app.messages import OutputEvent
from broker.outputs import MALFORMED_OUTPUT, decode_events

logger = logging.getLogger(__name__)


def _hub_events(raw: bytes, eid: str, key: str) -> list[OutputEvent]:
    """An output entry's events, as the hub hands them over: a malformed entry ends
    that request (``MALFORMED_OUTPUT``), nothing else."""
    try:
        return decode_events(raw)
    except Exception:
        logger.exception("output hub: malformed entry %s of %s", eid, key)
        return [MALFORMED_OUTPUT]


class Pumped(enum.Enum):
    """What a subscription's pump did with an entry the hub offered it."""

    TAKEN = "taken"  # delivered; keep offering
    TAKEN_LAST = "taken_last"  # delivered, but offer no more: wake the reader
    DECLINED = "declined"  # not delivered: queue it (and all after it) for the reader


# Queued by a pump that stopped after taking its entry: wakes a reader blocked in
# ``take``, which then behaves as if its wait had timed out.
_WAKE: tuple[str, list[OutputEvent] | bytes, int] = ("", [], 0)


@dataclass(slots=True, eq=False)
class Subscription:
    """One reader's view of one output stream, fed by an ``OutputHub``.

    The hub hands it entries until ``buffered`` (encoded bytes not yet taken) reaches
    the hub's ``buffer_bytes``; the rest waits in Redis, so a client that does not read
    costs its web process at most that much. Readers take entries with ``take`` (which
    keeps the count); ``taken_at`` is when the reader last took one, which tells a
    stalled reader (dropped: ``dropped`` is set, ``on_drop`` called) from a slow one.

    A reader with nothing queued may install a *pump* (``start_pump``) before it waits:
    the hub then calls the pump with each entry, on the hub's thread, instead of
    queueing it and waking the reader, so a stream that flows costs no thread hand-off
    per entry (the SSE route writes its frames from there, ``web.sse_pump``). The pump
    runs under the subscription's lock, so ``stop_pump`` returns only once no call is
    running and none will start: the reader owns its state again. A pump that declines
    an entry (or takes it as its last) is removed, and the reader gets the entry (or a
    wake-up) in its queue as before.
    """

    request_id: str
    key: str
    n: int  # the ordinal of the last chunk handed over (0: none)
    entries: queue.SimpleQueue[tuple[str, list[OutputEvent] | bytes, int]]
    notify: threading.Event | None = None  # set on every entry (one wait for many streams)
    on_drop: Callable[[], None] | None = None
    buffered: int = 0
    taken_at: float = field(default_factory=time.monotonic)
    dropped: bool = False
    pump: Callable[[str, list[OutputEvent]], Pumped] | None = None
    # The output stream's entries up to this one hold no chunk after ``n``: where the
    # stream itself is read from when the subscription needs it (``reload``).
    cursor: str = "0-0"
    # Read the output stream itself next (at the start; after a chunk it could not
    # take from a step stream: its buffer was full, or the chunk came after a gap).
    reload: bool = True
    _count_lock: threading.Lock = field(default_factory=threading.Lock)

    def put(self, eid: str, chunk: list[OutputEvent] | bytes, size: int) -> None:
        """Hand an entry to the reader: to its pump if it has one, else to its queue.

        ``chunk``: its events, or the chunk as read (``encode_events``), decoded where it
        is read: by the pump, or on the reader's own thread in ``take``. Why: a reader
        that waits is woken only once the hub's thread lets go of the GIL, after it has
        handed every line of the step it read, so the hub's share of each line (the
        decode was a quarter of it) delays every queued reader's first line."""
        with self._count_lock:
            pump = self.pump
            if pump is not None:
                chunk = self._events(eid, chunk)
                verdict = pump(eid, chunk)
                if verdict is Pumped.TAKEN:
                    self.taken_at = time.monotonic()
                    return
                self.pump = None
                if verdict is Pumped.TAKEN_LAST:
                    self.taken_at = time.monotonic()
                    self.entries.put(_WAKE)
                    return
            self.buffered += size
            # Under the lock: a pump started between the count and the put would
            # deliver later entries ahead of this one.
            self.entries.put((eid, chunk, size))

    def start_pump(self, pump: Callable[[str, list[OutputEvent]], Pumped]) -> bool:
        """Let the hub deliver entries through ``pump`` until it declines one or
        ``stop_pump``. Refused (False) while entries wait in the queue: they come first."""
        with self._count_lock:
            if not self.entries.empty() or self.dropped:
                return False
            self.pump = pump
            return True

    def wake(self) -> None:
        """Wake the reader from its wait with nothing to read (it looks around)."""
        self.entries.put(_WAKE)

    def stop_pump(self) -> None:
        """No pump call is running or will start once this returns."""
        if self.pump is not None:
            with self._count_lock:
                self.pump = None

    def take(self, timeout_s: float | None) -> tuple[str, list[OutputEvent]]:
        """The next entry (``timeout_s`` None: do not wait); raises ``queue.Empty``
        (also when a pump that stopped woke the reader)."""
        if timeout_s is None:
            entry = self.entries.get_nowait()
        else:
            entry = self.entries.get(timeout=max(timeout_s, 0.0))
        if entry is _WAKE:
            raise queue.Empty
        eid, chunk, size = entry
        with self._count_lock:
            self.buffered -= size
            self.taken_at = time.monotonic()
        return eid, self._events(eid, chunk)

    def _events(self, eid: str, chunk: list[OutputEvent] | bytes) -> list[OutputEvent]:
        """A handed entry's events: decoded here, by whoever reads it, when the hub
        handed the chunk's bytes (``put``)."""
        return _hub_events(chunk, eid, self.key) if isinstance(chunk, bytes) else chunk

    def full(self, limit: int | None) -> bool:
        return limit is not None and self.buffered >= limit
