"""One request's output after it was submitted, written once for every transport.

A ``Run`` is the request's output stream as typed ``(entry id, OutputEvent)`` items,
under one deadline guard: when the request's ``give_up_at`` passes, when its state
vanished from Redis (a restart without persistence) or when Redis stays unreachable
too long, the run itself produces the request-level error event the streamers would
have written, so every framer ends every stream the same way. ``close`` ends the run
exactly once: it frees the admission slot, cancels generation unless the terminal
event was read, and reports the outcome (status, error type, usage) to the one
metrics observer. ``broker.drive`` holds the only loops over a run; SSE, the JSON
fold, WebSocket messages and batch lines are framers over its items; none of them
touches Redis. Runs are made by ``broker.runner.Runner``.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import redis

from app.errors import (
    InvalidRequest,
    StreamError,
    error_body,
    event_error,
)
from app.intake import PreparedRequest
from app.messages import OutputEvent, OutputKind
from broker.outputs import MALFORMED_OUTPUT, is_terminal
from broker.subscription import Pumped

if TYPE_CHECKING:
    from broker.runner import Runner
    from broker.tracing import RequestTrace

logger = logging.getLogger(__name__)

# (event cursor, event). The cursor "<output chunk ordinal>/<index in the chunk>" names
# one event exactly: a client that saw it resumes right after it (``Runner.resume``).
Item = tuple[str, OutputEvent]

# A silent run checks this often whether its request still exists in Redis.
LOST_CHECK_S = 5.0
# A cursor's event index past any chunk's events: "every event of that chunk was seen".
PAST_EVERY_EVENT = 1 << 30
# A run whose Redis has been unreachable this long ends with a 503 (shorter outages are
# ridden out: with persistence the request resumes where it was).
OUTAGE_GIVE_UP_S = 30.0

TIMEOUT_MESSAGE = "The request timed out waiting for output."
LOST_MESSAGE = "The request was lost: the server's state was reset while it ran. Please retry it."
OUTAGE_MESSAGE = "The server lost its connection to Redis while the request ran."
STALLED_MESSAGE = (
    "The client stopped reading its stream, so the request was cancelled (see stream_stall_s)."
)


@dataclass(frozen=True, slots=True)
class RunOutcome:
    """How a run ended, as a client saw it."""

    status: int  # 200, the error's HTTP status, or 499 when the client went away
    error_type: str  # "" on success
    usage: dict[str, Any] | None  # the streamer's raw usage (timings included)
    cancelled: bool  # the client went away or cancelled before the end


class RunObserver(Protocol):
    """Per-run metrics: told of every text sent and of the outcome, once."""

    def text_sent(self) -> None: ...

    def ended(self, outcome: RunOutcome) -> None: ...


class Run:
    """One request's output under one deadline guard; ``close`` exactly once."""

    def __init__(
        self,
        runner: Runner,
        prepared: PreparedRequest,
        *,
        cursor: str | None = None,
        observer: RunObserver | None = None,
        notify: threading.Event | None = None,
        trace: RequestTrace | None = None,
    ) -> None:
        self.runner = runner
        self.prepared = prepared
        self.record = prepared.record
        self.shape = prepared.shape
        self.request_id = prepared.record.request_id
        # The last event cursor handed out: a client's resume point.
        self.cursor = cursor or ""
        chunk, skip = split_cursor(cursor)
        self.observer = observer
        self.trace = trace  # its web span when traced (also its observer, then)
        self.ended = False  # the terminal event was handed out
        # The terminal event was made here (the guard's deadline/lost/outage error, or
        # the hub's stand-in for an unreadable entry), not by a streamer: generation
        # may still be running upstream, so ``close`` cancels it.
        self.ended_here = False
        self.usage: dict[str, Any] | None = None
        self.request_error: StreamError | None = None
        self.choice_errors: dict[int, StreamError] = {}
        self._pending: deque[tuple[str, int, OutputEvent]] = deque()
        self._skip = (chunk, skip)  # resuming: events of that chunk already seen
        # Resumed from a cursor and nothing read since: a stream that ends before the
        # cursor's chunk (a cursor never handed out) ends this run (``_guard``).
        self._resumed_at = int(chunk)
        self._last_seen = runner.clock()
        self._closed = False
        self._sub = runner.hub.subscribe(
            self.request_id,
            max(int(chunk) - 1, 0),  # that chunk again: the events of it not yet seen
            notify=notify,
            on_drop=self._stalled,
            wake=False,
        )
        # The hub's wake-up and the follower count in one round trip. Both are best
        # effort: the hub reads the new stream on its next read anyway, and a follower
        # not counted only delays a disconnect's cancel.
        try:
            pipe = runner.redis.pipeline(transaction=False)
            runner.hub.queue_wake(pipe, self.request_id)
            runner.queue_follower(pipe, self.request_id, +1)
            pipe.execute()
        except redis.RedisError as exc:
            logger.warning("could not wake the output reader for %s: %s", self.request_id, exc)

    # -- reading -------------------------------------------------------------------------
    def next(self, timeout_s: float) -> Item | None:
        """The next item, or None when ``timeout_s`` passes without one (a tick for
        keep-alives). After the terminal item it returns None at once."""
        if self._pending:
            return self._deliver(self._pending.popleft())
        if self.ended:
            return None
        if self._sub.dropped:
            self._sub.stop_pump()
            return self._fail(STALLED_MESSAGE, 504)
        try:
            eid, events = self._sub.take(timeout_s)
        except queue.Empty:
            # A pump (``hand_to``) may have run meanwhile: it stops now, and what it
            # declined after the wait ended is still read.
            self._sub.stop_pump()
            try:
                eid, events = self._sub.take(None)
            except queue.Empty:
                return self._guard()
        self._queue(eid, events)
        return self._deliver(self._pending.popleft()) if self._pending else None

    def hand_to(self, pump: Callable[[str, list[OutputEvent]], Pumped]) -> bool:
        """Until the next ``next`` returns, let the hub's thread hand entries to
        ``pump`` (``Subscription.start_pump``), which delivers them with ``absorb``.

        For a framer that can write without its own thread (``web.sse_pump``): a flowing
        stream then costs no thread wake-up per entry. Refused (False) while items wait
        here or in the queue, or after the end. The pump may touch this run only while
        it runs: ``next`` stops it before it returns."""
        if self._pending or self.ended or self._closed:
            return False
        return self._sub.start_pump(pump)

    def absorb(self, eid: str, events: list[OutputEvent]) -> list[Item]:
        """Every item of one entry, delivered (the pump's ``next`` + ``poll``)."""
        self._queue(eid, events)
        out: list[Item] = []
        while self._pending:
            out.append(self._deliver(self._pending.popleft()))
        return out

    def poll(self, limit: int | None = None) -> list[Item]:
        """Every item available now (at most ``limit``), without blocking. What is left
        stays encoded in the subscription, within its buffer, until the next call."""
        out: list[Item] = []
        while not self.ended and (limit is None or len(out) < limit):
            if self._pending:
                out.append(self._deliver(self._pending.popleft()))
                continue
            if self._sub.dropped:
                out.append(self._fail(STALLED_MESSAGE, 504))
                break
            try:
                eid, events = self._sub.take(None)
            except queue.Empty:
                guarded = self._guard()
                if guarded is not None:
                    out.append(guarded)
                break
            self._queue(eid, events)
        return out

    def _queue(self, eid: str, events: list[OutputEvent]) -> None:
        self._last_seen = self.runner.clock()
        self._resumed_at = 0
        first = self._skip[1] if eid == self._skip[0] else 0
        if any(is_terminal(ev) for ev in events[:first]):
            # Resumed after the terminal event: the client has seen it all; without
            # this the run would wait for an event that never comes, until the deadline.
            self.ended = True
            return
        self._pending.extend((eid, i, ev) for i, ev in enumerate(events) if i >= first)

    def _deliver(self, pending: tuple[str, int, OutputEvent]) -> Item:
        eid, index, ev = pending
        if eid:  # "": an event made here, not read from the stream: the cursor stays
            self.cursor = f"{eid}/{index}"
        error = event_error(ev)
        if error is not None:
            if ev.kind is OutputKind.ERROR and ev.choice is None:
                self.request_error = error
            elif ev.choice is not None:
                self.choice_errors.setdefault(ev.choice, error)
        elif ev.kind is OutputKind.DELTA and ev.text and self.observer is not None:
            self.observer.text_sent()
        if ev.kind is OutputKind.USAGE:
            self.usage = ev.usage
        if is_terminal(ev):
            self.ended = True
            self.ended_here = not eid or ev is MALFORMED_OUTPUT
            self._pending.clear()
        return self.cursor, ev

    def _stalled(self) -> None:
        """The hub dropped this run's reader (it took nothing for ``stream_stall_s``
        with a full buffer): cancel generation and free the slot now, on the hub's
        thread, since the reader's own thread may be stuck writing to its client."""
        try:
            self.runner.cancel(self.request_id)
        except redis.RedisError as exc:
            logger.warning("could not cancel stalled request %s: %s", self.request_id, exc)

    def _guard(self) -> Item | None:
        """The request-level error the run owes its reader, if any (else None)."""
        now = self.runner.clock()
        if now > self.record.give_up_at:
            return self._fail(TIMEOUT_MESSAGE, 504)
        down = self.runner.hub.down_for()
        if down > OUTAGE_GIVE_UP_S:
            return self._fail(OUTAGE_MESSAGE, 503)
        if down == 0.0 and now - self._last_seen >= LOST_CHECK_S:
            self._last_seen = now
            try:
                lost = self.runner.outputs.lost(self.request_id)
                past_end = self._resumed_at and self._ended_before(self._resumed_at)
            except redis.RedisError:
                lost = past_end = False
            if lost:
                return self._fail(LOST_MESSAGE, 503)
            if past_end:
                self.ended = True  # everything up to the end was seen: nothing more
        return None

    def _ended_before(self, chunk: int) -> bool:
        end = self.runner.outputs.ended_at(self.request_id)
        return end is not None and end < chunk

    def _fail(self, message: str, status: int) -> Item:
        """The run's own request-level error (not in the stream: it keeps the cursor)."""
        cursor = self.cursor
        item = self._deliver(("", 0, OutputEvent(OutputKind.ERROR, error=message, code=status)))
        self.cursor = cursor
        return cursor, item[1]

    # -- outcome ------------------------------------------------------------------------
    @property
    def failure(self) -> StreamError | None:
        """The run's error as a whole: the request's, or every choice's (the first)."""
        if self.request_error is not None:
            return self.request_error
        if self.choice_errors and len(self.choice_errors) >= self.record.num_choices:
            return self.choice_errors[min(self.choice_errors)]
        return None

    def close(
        self,
        *,
        disconnected: bool = False,
        resumable: bool = False,
        error: BaseException | None = None,
    ) -> None:
        """End the run once: free its slot; cancel generation unless it ended; report.

        ``resumable``: the client lost a stream it may resume (SSE, WebSocket): the
        generation goes on for ``resume_grace_s`` and is cancelled then only if no
        client follows it any more. ``error``: the framer failed (a bug), reported
        as that error's status.
        """
        if self._closed:
            return
        self._closed = True
        self._sub.stop_pump()
        self.runner.hub.unsubscribe(self._sub)
        runner, rid = self.runner, self.request_id
        try:
            left = runner.followers(rid, -1)
            if self.ended and not self.ended_here:
                runner.store.release(rid)
                runner.settle(self.record, self.usage)
            elif self.ended:
                runner.cancel(rid)
            elif resumable and disconnected and runner.settings.resume_grace_s > 0:
                runner.cancel_later(rid)
            elif left <= 0:
                runner.cancel(rid)
        except redis.RedisError as exc:
            logger.warning("could not release request %s: %s", rid, exc)
        if self.observer is not None:
            self.observer.ended(self.outcome(disconnected=disconnected, error=error))

    def detach(self) -> None:
        """Stop following without ending anything (the request belongs to someone
        else now, e.g. a batch driver that lost the batch's lock)."""
        if self._closed:
            return
        self._closed = True
        self._sub.stop_pump()
        self.runner.hub.unsubscribe(self._sub)
        with contextlib.suppress(redis.RedisError):
            self.runner.followers(self.request_id, -1)
        if self.trace is not None:
            self.trace.handed_over()

    def outcome(
        self, *, disconnected: bool = False, error: BaseException | None = None
    ) -> RunOutcome:
        failure: BaseException | None = error or self.failure
        cancelled = disconnected and not self.ended
        if cancelled:
            return RunOutcome(499, STATUS_CANCELLED, self.usage, True)
        if failure is None and not self.ended:
            failure = StreamError("The response ended early.", 500)
        if failure is None:
            return RunOutcome(200, "", self.usage, False)
        status, body = error_body(failure)
        return RunOutcome(status, body["error"]["type"], self.usage, False)


STATUS_CANCELLED = "cancelled_error"


def split_cursor(cursor: str | None) -> tuple[str, int]:
    """(output chunk ordinal, events of it already seen) for an event cursor; ("0", 0)
    for None (from the start)."""
    if not cursor:
        return "0", 0
    chunk, _, index = cursor.partition("/")
    return chunk, int(index) + 1


def invalid_event_id() -> InvalidRequest:
    """The 400 for a ``Last-Event-ID`` (or a WebSocket resume's cursor) that is not an
    event id this server sends."""
    return InvalidRequest(
        "Last-Event-ID must be an event id this server sent (like '17/3').",
        param="Last-Event-ID",
        code="invalid_event_id",
    )
