"""One request's life after intake, written once for every transport.

``Runner`` is a process's door to generation (one per web process, one per batch
driver): it prepares a body (``app.intake``), refuses at once when the system cannot
serve it (fail fast: 503 + Retry-After when Redis, every worker of the model or every
streamer is gone), admits it against the shared in-flight limit (429 + Retry-After),
submits it, and hands back a ``Run``.

A ``Run`` is the request's output stream as typed ``(entry id, OutputEvent)`` items,
under one deadline guard: when the request's ``give_up_at`` passes, when its state
vanished from Redis (a restart without persistence) or when Redis stays unreachable
too long, the run itself produces the request-level error event the streamers would
have written, so every framer ends every stream the same way. ``close`` ends the run
exactly once: it frees the admission slot, cancels generation unless the terminal
event was read, and reports the outcome (status, error type, usage) to the one
metrics observer. SSE, the JSON fold, WebSocket messages and batch lines are framers
over these items; none of them touches Redis.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import queue
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import redis
from celery import Celery
from kombu.exceptions import OperationalError
from redis.client import Pipeline

from app.errors import (
    NotFound,
    QueueFull,
    QuotaExceeded,
    ServiceUnavailable,
    StreamError,
    error_body,
    event_error,
)
from app.intake import Endpoint, Intake, PreparedRequest
from app.messages import OutputEvent, OutputKind
from app.model_card import ModelCard, load_model_card
from app.records import RequestRecord
from app.settings import Settings
from broker.celery_app import create_celery
from broker.connection import redis_client
from broker.hub import OutputHub, Pumped
from broker.keys import Keys
from broker.outputs import MALFORMED_OUTPUT, OutputStreams, is_terminal
from broker.prefix_routes import PrefixRouter
from broker.registry import streamer_registry, worker_registry
from broker.requests import Admission, RequestStore

logger = logging.getLogger(__name__)

# (event cursor, event). The cursor "<output chunk ordinal>/<index in the chunk>" names
# one event exactly: a client that saw it resumes right after it (``Runner.resume``).
Item = tuple[str, OutputEvent]

# A silent run checks this often whether its request still exists in Redis.
LOST_CHECK_S = 5.0
# A run whose Redis has been unreachable this long ends with a 503 (shorter outages are
# ridden out: with persistence the request resumes where it was).
OUTAGE_GIVE_UP_S = 30.0
# Positive readiness answers are reused this long (one registry read per burst).
READY_CACHE_S = 1.0
RETRY_AFTER_S = 1
# Starting a request (tokenizing, admitting, sending its task) is CPU under the GIL:
# a process runs one at a time however many threads start at once. Interleaved, a
# burst of 200 made every request wait for nearly all of them (processor sharing:
# TTFT p50 close to the whole burst's time); taken in turn, in arrival order, the
# first requests reach the workers first (docs/benchmarks.md). A start that waits
# longer than this for its turn (the one before it stuck on a slow Redis) goes ahead.
START_TURN_WAIT_S = 1.0

# What "Redis is away" looks like to a client library: refused or dropped connections,
# timeouts, a Redis still loading its append-only file (BusyLoadingError is a
# ConnectionError), a former master turned replica (ReadOnlyError), a full Redis under
# noeviction (OutOfMemoryError), and kombu's own error when it cannot publish a task.
# Each is answered 503 + Retry-After: the client should retry, nothing is wrong with
# its request. Any other RedisError is a bug (500).
BACKBONE_DOWN: tuple[type[Exception], ...] = (
    redis.ConnectionError,
    redis.TimeoutError,
    redis.exceptions.ReadOnlyError,
    redis.exceptions.OutOfMemoryError,
    OperationalError,
)
UNAVAILABLE_MESSAGE = "The server cannot reach its queue right now; please retry shortly."

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


class RunMetrics(Protocol):
    """Where runs report (the web tier's Prometheus metrics; nothing for batches)."""

    def rejected(self, endpoint: str, stream: bool, exc: BaseException) -> None: ...

    def observer(self, prepared: PreparedRequest, endpoint: str) -> RunObserver: ...


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

    def poll(self) -> list[Item]:
        """Every item available now, without blocking (the batch driver's loop)."""
        out: list[Item] = []
        while not self.ended:
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
            except redis.RedisError:
                lost = False
            if lost:
                return self._fail(LOST_MESSAGE, 503)
        return None

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


class Runner:
    """A process's door to generation: intake, fail-fast checks, admission, runs."""

    def __init__(
        self,
        settings: Settings,
        *,
        card: ModelCard | None = None,
        client: redis.Redis | None = None,
        celery_app: Celery | None = None,
        clock: Callable[[], float] = time.time,
        new_id: Callable[[], str] = lambda: uuid.uuid4().hex,
        metrics: RunMetrics | None = None,
        max_connections: int | None = None,
    ) -> None:
        self.settings = settings
        self.card = card or load_model_card(settings.model_path())
        self.clock = clock
        self.new_id = new_id
        # Lambdas, not the callables themselves: tests may replace runner.clock/new_id.
        self.intake = Intake.for_model(
            settings, self.card, clock=lambda: self.clock(), new_id=lambda: self.new_id()
        )
        self.model_name = settings.served_name
        # One hub thread reads every stream; the other connections serve request threads
        # (submit, cancel, ready), at most one each at a time.
        self.redis = client or redis_client(
            settings.redis_url, max_connections=max_connections or settings.web_threads + 16
        )
        keys = Keys(settings.key_prefix)
        self.store = RequestStore(self.redis, keys, stream_ttl_s=settings.stream_ttl_s)
        self.outputs = OutputStreams(self.redis, keys, ttl_s=settings.stream_ttl_s)
        self.hub = OutputHub(
            self.redis,
            keys,
            ttl_s=settings.stream_ttl_s,
            buffer_bytes=settings.stream_buffer_bytes,
            stall_s=settings.stream_stall_s,
        )
        self.workers = worker_registry(self.redis, keys)
        self.streamers = streamer_registry(self.redis, keys)
        self.router = (
            PrefixRouter(self.redis, keys, self.workers, self.model_name, clock=self.clock)
            if settings.prefix_routing
            else None
        )
        self.celery = celery_app or create_celery(settings, results=False)
        self.metrics = metrics
        self._ready_until = 0.0
        self._start_turn = threading.Semaphore(1)  # FIFO: its waiters wake in order

    # -- starting ------------------------------------------------------------------------
    def start(
        self,
        endpoint: Endpoint,
        body: Any,
        *,
        route: str | None = None,
        stream: bool | None = None,
        owner: str = "",
    ) -> Run:
        """Prepare, check, admit and submit one interactive request; its ``Run``.

        Raises the ``TokenRelayError`` the client is answered with (400, 404, 429, 501,
        503, ...), after reporting it as a rejection. ``route`` labels the metrics
        (the WebSocket's path for its requests; the endpoint's by default); ``owner``
        (the API key's hash, web.auth) is the only tenant that may resume it.
        """
        label = route or endpoint.value
        # One start at a time in this process, in arrival order (``START_TURN_WAIT_S``).
        turn = self._start_turn.acquire(timeout=START_TURN_WAIT_S)
        try:
            prepared = self.intake.prepare(endpoint, body, stream=stream, owner=owner)
            self.check_ready()
            prepared = self._admit_and_submit(prepared)
        except Exception as exc:
            if self.metrics is not None:
                self.metrics.rejected(label, _wants_stream(body, stream), exc)
            raise
        finally:
            if turn:
                self._start_turn.release()
        return self.follow(prepared, route=label)

    def follow(
        self,
        prepared: PreparedRequest,
        *,
        cursor: str | None = None,
        route: str | None = None,
        notify: threading.Event | None = None,
    ) -> Run:
        """A run over a request already submitted (a batch line, a resumed stream)."""
        observer = None
        if self.metrics is not None:
            observer = self.metrics.observer(prepared, route or prepared.endpoint.value)
        return Run(self, prepared, cursor=cursor, observer=observer, notify=notify)

    def resume(
        self,
        request_id: str,
        cursor: str | None,
        *,
        route: str | None = None,
        scope: str | None = None,
    ) -> Run:
        """A run that continues request ``request_id``'s output after ``cursor`` (from
        the start when None): what a client that lost its connection reconnects to, on
        any web process, until the request's output expires. It is not admitted again
        and its generation is not cancelled when the reconnected client leaves early
        unless nothing else is following it (the run's own close decides, as ever).

        ``scope``: the owner the caller may see (None: any, e.g. an admin key); another
        owner's stream is answered as if it did not exist."""
        try:
            loaded = self.store.load(request_id)
        except redis.RedisError as exc:
            raise backbone_unavailable() from exc
        if loaded is None or (scope is not None and loaded[0].owner != scope):
            raise NotFound(
                f"No stream with id '{request_id}' exists (or it has expired).",
                param="request_id",
                code="stream_not_found",
            )
        prepared = self.intake.restore(loaded[0])
        return self.follow(prepared, cursor=cursor, route=route)

    # -- following and cancelling ---------------------------------------------------------
    def followers(self, rid: str, change: int) -> int:
        """Count a client starting (+1) or stopping (-1) to follow ``rid``; the count."""
        pipe = self.redis.pipeline(transaction=False)
        self.queue_follower(pipe, rid, change)
        count: Any = pipe.execute()[0]
        return int(count)

    def queue_follower(self, pipe: Pipeline, rid: str, change: int) -> None:
        """``followers``'s commands, added to ``pipe`` (its first result is the count)."""
        key = self.store.keys.followers(rid)
        pipe.incrby(key, change)
        pipe.expire(key, self.settings.stream_ttl_s)

    def cancel(self, rid: str) -> None:
        """Stop generating ``rid`` and free its admission slot."""
        self.store.cancel(rid)
        self.store.release(rid)

    def cancel_later(self, rid: str) -> None:
        """Cancel ``rid`` after the resume grace unless a client follows it again."""

        def check() -> None:
            try:
                key = self.store.keys.followers(rid)
                raw: Any = self.redis.get(key)
                if int(raw or 0) <= 0:
                    self.cancel(rid)
            except redis.RedisError as exc:
                logger.warning("could not cancel abandoned request %s: %s", rid, exc)

        timer = threading.Timer(self.settings.resume_grace_s, check)
        timer.daemon = True
        timer.start()

    def _admit_and_submit(self, prepared: PreparedRequest) -> PreparedRequest:
        """Admit and submit; the request as submitted (with its ``route``)."""
        record = prepared.record
        settings = self.settings
        if record.num_choices > settings.max_request_choices:
            raise QuotaExceeded(
                f"This request asks for {record.num_choices} choices (prompts x n); the "
                f"quota is {settings.max_request_choices} per request (max_request_choices)."
            )
        route = self.router.choose(record) if self.router is not None else None
        if route is not None:
            record = record.model_copy(update={"route": route})
            prepared = dataclasses.replace(prepared, record=record)
        try:
            admitted = self._admit(record)
            if admitted is Admission.OWNER_FULL:
                full = QuotaExceeded(
                    f"This API key already has {settings.key_max_in_flight} requests in "
                    "flight, its quota (key_max_in_flight); retry when one has finished."
                )
                full.retry_after = RETRY_AFTER_S  # type: ignore[attr-defined]
                raise full
            if not admitted:
                raise QueueFull(
                    "The server is at capacity; please retry shortly.", retry_after=RETRY_AFTER_S
                )
            try:
                self.store.send(record, self.celery)
                if route is not None:
                    self.router.sent(route)  # type: ignore[union-attr]
            except Exception:
                # The record is written without its task (Redis went away between the
                # two): cancel it, or a streamer would send the task again for a client
                # that was told 503.
                with contextlib.suppress(redis.RedisError):
                    self.store.cancel(record.request_id)
                self.store.release(record.request_id)
                raise
        except (redis.RedisError, OperationalError) as exc:
            self._ready_until = 0.0
            raise backbone_unavailable() from exc
        return prepared

    def _admit(self, record: RequestRecord) -> Admission:
        """Admit ``record`` and write it, in one call (``RequestStore.admit``)."""
        settings = self.settings
        try:
            return self.store.admit(
                record.request_id,
                record.deadline,
                settings.max_queue,
                self.clock(),
                weight=record.num_choices,
                # Only with keys configured does an owner stand for one client.
                owner=record.owner if settings.api_keys else "",
                owner_limit=settings.key_max_in_flight,
                create=record,
            )
        except redis.ResponseError:
            # The script may have counted the request before a command in it failed
            # (a full Redis refuses the record's write): free its slot, which Redis
            # allows even then. (Not after a connection error: then nothing answers.)
            with contextlib.suppress(redis.RedisError):
                self.store.release(record.request_id)
            raise

    # -- readiness -----------------------------------------------------------------------
    def readiness(self) -> tuple[bool, str]:
        """(ready, reason): Redis reachable, a live worker for our model, a live streamer."""
        try:
            workers = [w for w in self.workers.live() if w.model == self.model_name]
            streamers = self.streamers.live()
        except redis.RedisError:
            return False, "Redis is unreachable."
        if not workers:
            return False, f"No live worker serves model '{self.model_name}'."
        if not streamers:
            return False, "No live streamer."
        return True, "ok"

    def check_ready(self) -> None:
        """Fail fast: 503 + Retry-After before anything is submitted or streamed."""
        now = time.monotonic()
        if now < self._ready_until:
            return
        ok, reason = self.readiness()
        if not ok:
            raise ServiceUnavailable(reason, code="not_ready", retry_after=RETRY_AFTER_S)
        self._ready_until = now + READY_CACHE_S


def backbone_unavailable() -> ServiceUnavailable:
    """The 503 a client gets while Redis is away (``BACKBONE_DOWN``)."""
    return ServiceUnavailable(UNAVAILABLE_MESSAGE, code="not_ready", retry_after=RETRY_AFTER_S)


def _wants_stream(body: Any, stream: bool | None) -> bool:
    if stream is not None:
        return stream
    return isinstance(body, dict) and body.get("stream") is True
