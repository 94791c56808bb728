"""A process's door to generation, written once for every transport.

``Runner`` (one per web process, one per batch driver) prepares a body
(``app.intake``), refuses at once when the system cannot serve it (fail fast: 503 +
Retry-After when Redis, every worker of the model or every streamer is gone), admits
it against the shared in-flight limit (429 + Retry-After), sends it to a worker's
queue (``broker.prefix_routes`` picks which), and hands back a ``Run``
(``broker.run``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Collection, Mapping
from typing import Any, Protocol

import redis
from celery import Celery
from kombu.exceptions import OperationalError
from redis.client import Pipeline

from app import logs
from app.errors import (
    InvalidRequest,
    ModelError,
    NotFound,
    QueueFull,
    QuotaExceeded,
    RateLimited,
    ServiceUnavailable,
    TokenRelayError,
)
from app.intake import Endpoint, Intake, PreparedRequest, shape_of
from app.lenient_json import loads_lenient
from app.model_card import ModelCard, load_model_card
from app.records import RequestRecord
from app.responses_api import response_id_of
from app.settings import Settings
from broker.abandon import Abandoned
from broker.backbone import RETRY_AFTER_S, backbone_unavailable
from broker.celery_app import celery_redis, create_celery, fair_priority
from broker.connection import open_redis
from broker.fair_queue import FairQueue
from broker.models import MAX_CARDS, ModelCards, catalog_of, settings_directory
from broker.output_usage import OutputUsage
from broker.outputs import OutputStreams
from broker.placement import placement_for
from broker.prefix_routes import PrefixRouter
from broker.registry import streamer_registry, worker_registry
from broker.requests import Admission, RateLimit, RequestStore
from broker.run import PAST_EVERY_EVENT, Run, RunObserver, invalid_event_id, split_cursor
from broker.shard_hub import output_hub
from broker.tenancy import KeyPolicy, reserved_tokens, unused_tokens
from broker.tracing import RequestTrace, phase, request_trace, traced

logger = logging.getLogger(__name__)

# Positive readiness answers are reused this long (one registry read per burst).
READY_CACHE_S = 1.0
# Starting a request (tokenizing, admitting, sending its task) is CPU under the GIL:
# a process runs one at a time however many threads start at once. Interleaved, a
# burst of 200 made every request wait for nearly all of them (processor sharing:
# TTFT p50 close to the whole burst's time); taken in turn, in arrival order, the
# first requests reach the workers first (docs/benchmarks.md). A start that waits
# longer than this for its turn (the one before it stuck on a slow Redis) goes ahead.
START_TURN_WAIT_S = 1.0


class RunMetrics(Protocol):
    """Where runs report (the web tier's Prometheus metrics; nothing for batches)."""

    def rejected(self, endpoint: str, stream: bool, exc: BaseException) -> None: ...

    def observer(self, prepared: PreparedRequest, endpoint: str) -> RunObserver: ...


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
        self.card = card or load_model_card(settings.card_path())
        self.clock = clock
        self.new_id = new_id
        # Lambdas, not the callables themselves: tests may replace runner.clock/new_id.
        self.intake = Intake.for_model(
            settings, self.card, clock=lambda: self.clock(), new_id=lambda: self.new_id()
        )
        self.model_name = settings.served_name
        # The hub's threads read every stream; the rest serve request threads, one each.
        pool = max_connections or settings.web_threads + 16
        self.redis, keys = open_redis(settings, max_connections=pool, client=client)
        self.store = RequestStore(self.redis, keys, stream_ttl_s=settings.stream_ttl_s)
        self.outputs = OutputStreams(self.redis, keys, ttl_s=settings.stream_ttl_s)
        self.output_usage = OutputUsage(
            self.redis, keys, window_s=settings.stream_ttl_s, clock=lambda: self.clock()
        )
        self.hub = output_hub(
            self.redis,
            keys,
            ttl_s=settings.stream_ttl_s,
            buffer_bytes=settings.stream_buffer_bytes,
            stall_s=settings.stream_stall_s,
        )
        self.celery_redis = celery_redis(settings, self.redis)  # Celery's queues (lengths)
        self.workers = worker_registry(self.redis, keys)
        self.placement = placement_for(keys, self.workers)  # a Redis Cluster's (or None)
        self.new_id = self.placement.ids(new_id) if self.placement else new_id
        self.streamers = streamer_registry(self.redis, keys)
        self.keys = keys
        # Streams nobody follows any more, and web processes gone without closing theirs:
        # cancelled after the grace by whichever web process sweeps first (on Redis's clock).
        self.abandoned = Abandoned(
            self.redis, keys, settings.resume_grace_s, lambda rid: self.cancel(rid),
            ttl_s=settings.stream_ttl_s, dead_after_s=settings.web_dead_after_s,
        )  # fmt: skip
        # Every model with workers on this Redis (broker.models): one front door.
        self.models = catalog_of(self.redis, keys, self.workers, settings)
        self.cards = ModelCards(self.models, self.card, fallback=settings_directory(settings))
        self._intakes: OrderedDict[str, Intake] = OrderedDict({self.model_name: self.intake})
        self._routers: dict[str, PrefixRouter] = {}
        # (model, outcome) of each routing decision (the web tier's metrics).
        self.route_observer: Callable[[str, str], None] | None = None
        self._models_lock = threading.Lock()
        self.celery = celery_app or create_celery(settings, results=False, shards=keys.shards)
        self.metrics = metrics
        self._ready_until: dict[str, float] = {}
        self._start_turn = threading.Semaphore(1)  # FIFO: its waiters wake in order
        # Per-key limits and weights (the web tier sets ``policy.cache``: managed keys).
        self.policy = KeyPolicy(settings)
        self.fair = FairQueue(self.redis, keys, ttl_s=settings.stream_ttl_s)
        # Set when this process hands its open streams over (``close_streams``).
        self.closing = threading.Event()

    def close_streams(self) -> None:
        """The drain time of a stopping process is up: every open stream ends without
        its final event (``broker.drive.HandedOver``), for its client to resume it on
        another process, while its generation goes on (``resume_grace_s``)."""
        self.closing.set()
        self.hub.wake_all()

    # -- starting ------------------------------------------------------------------------
    def start(
        self,
        endpoint: Endpoint,
        body: Any,
        *,
        route: str | None = None,
        stream: bool | None = None,
        owner: str = "",
        context: list[Any] | None = None,
        trace: Mapping[str, str] | None = None,
    ) -> Run:
        """Prepare, check, admit and submit one interactive request; its ``Run``.

        Raises the ``TokenRelayError`` the client is answered with (400, 404, 429, 501,
        503, ...), after reporting it as a rejection. ``route`` labels the metrics
        (the WebSocket's path for its requests; the endpoint's by default); ``owner``
        (the API key's hash, web.auth) is the only tenant that may resume it;
        ``context`` is a Responses body's settled conversation (``Intake.prepare``);
        ``trace``: the client's W3C trace context headers (its trace's parent).
        """
        label = route or endpoint.value
        span = request_trace(label, trace)  # None unless tracing is on
        # One start at a time in this process, in arrival order (``START_TURN_WAIT_S``).
        turn = self._start_turn.acquire(timeout=START_TURN_WAIT_S)
        try:
            with phase(span, "parse"):
                prepared = self.prepare(endpoint, body, stream=stream, owner=owner, context=context)
            if span is not None:
                prepared = traced(prepared, span)
            self._log_start(prepared, body, span)
            self.check_ready(prepared.record.model)
            with phase(span, "admission"):
                prepared = self._admit_and_submit(prepared)
        except Exception as exc:
            if self.metrics is not None:
                self.metrics.rejected(label, _wants_stream(body, stream), exc)
            if span is not None:
                span.rejected(exc)
            raise
        finally:
            if turn:
                self._start_turn.release()
        return self.follow(prepared, route=label, trace=span)

    def prepare(self, endpoint: Endpoint, body: Any, **options: Any) -> PreparedRequest:
        """``body`` prepared by the intake of the model it names (``Intake.prepare``'s
        options): an alias is served by its model and reported as asked; no ``model``
        is the default model; an unknown one is 404 ``model_not_found``."""
        if isinstance(body, bytes | str):
            body = loads_lenient(body)
        asked = body.get("model") if isinstance(body, dict) else None
        asked = asked if isinstance(asked, str) else None  # else the intake says why
        try:
            served = self.models.resolve(asked)
        except redis.RedisError as exc:
            raise backbone_unavailable() from exc
        except NotFound:
            # A body that is wrong in itself says so first (400), as with one model.
            self.intake.prepare(endpoint, {**body, "model": self.model_name}, **options)
            raise
        if asked is not None and asked != served:
            body = {**body, "model": served}
        prepared = self.intake_for(served).prepare(endpoint, body, **options)
        if asked is not None and asked != served:
            record = prepared.record.model_copy(update={"model_alias": asked})
            prepared = dataclasses.replace(prepared, record=record, shape=shape_of(record))
        return prepared

    def _log_start(self, prepared: PreparedRequest, body: Any, span: RequestTrace | None) -> None:
        """Name the request in this thread's log lines (``app.logs``); with the debug
        setting ``log_prompts``, log its body, prompt and all."""
        record = prepared.record
        trace_id = span.trace_id if span is not None else ""
        logs.bind(request_id=record.request_id, model=record.model, trace_id=trace_id)
        if self.settings.log_prompts and body is not None:
            logger.info("request %s body (log_prompts): %s", record.request_id, body)

    def intake_for(self, served: str) -> Intake:
        """The intake of a served model, built on first use from its card (the directory
        its workers registered), the last ``MAX_CARDS`` kept."""
        with self._models_lock:
            hit = self._intakes.get(served)
            if hit is not None:
                self._intakes.move_to_end(served)
                return hit
        try:
            card = self.cards.card(served)
            entry = self.models.entries().get(served)
        except ModelError as exc:
            raise ServiceUnavailable(
                f"The model '{served}' cannot be loaded here: {exc}",
                code="model_unavailable",
                retry_after=RETRY_AFTER_S,
            ) from exc
        except redis.RedisError as exc:
            raise backbone_unavailable() from exc
        intake = Intake.for_model(
            self.settings,
            card,
            clock=lambda: self.clock(),
            new_id=lambda: self.new_id(),
            model_name=served,
            echo=None if entry is None else entry.engine == "echo",
        )
        with self._models_lock:
            self._intakes[served] = intake
            while len(self._intakes) > MAX_CARDS:
                oldest = next(k for k in self._intakes if k != self.model_name)
                del self._intakes[oldest]
        return intake

    def _router(self, model: str) -> PrefixRouter | None:
        if not self.settings.prefix_routing:
            return None
        with self._models_lock:
            router = self._routers.get(model)
            if router is None:
                router = PrefixRouter(
                    self.redis,
                    self.keys,
                    self.workers,
                    model,
                    queues=self.celery_redis,
                    clock=self.clock,
                )
                observe = self.route_observer
                if observe is not None:
                    router.observe = lambda outcome: observe(model, outcome)
                self._routers[model] = router
            return router

    def follow(
        self,
        prepared: PreparedRequest,
        *,
        cursor: str | None = None,
        route: str | None = None,
        notify: threading.Event | None = None,
        trace: RequestTrace | None = None,
    ) -> Run:
        """A run over a request already submitted (a batch line, a resumed stream);
        ``trace``: its web span, told of its delivery (and passing it on to metrics)."""
        observer: RunObserver | None = None
        if self.metrics is not None:
            observer = self.metrics.observer(prepared, route or prepared.endpoint.value)
        if trace is not None:
            trace.inner, observer = observer, trace
        return Run(self, prepared, cursor=cursor, observer=observer, notify=notify, trace=trace)

    def resume(
        self,
        request_id: str,
        cursor: str | None,
        *,
        route: str | None = None,
        scope: str | None = None,
        trace: Mapping[str, str] | None = None,
        framed: Collection[Endpoint] = tuple(Endpoint),
    ) -> Run:
        """A run that continues request ``request_id``'s output after ``cursor`` (from
        the start when None): what a client that lost its connection reconnects to, on
        any web process, until the request's output expires. It is not admitted again
        and its generation is not cancelled when the reconnected client leaves early
        unless nothing else is following it (the run's own close decides, as ever).

        ``scope``: the owner the caller may see (the key that made the stream; None:
        any, for a stored response its caller may see already); another owner's stream
        is answered as if it did not exist. ``trace``: the client's trace context
        headers; the resumed run's span continues the request's own trace. ``framed``:
        the endpoints whose events the caller can frame; another's stream is a 400 that
        says where it resumes."""
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
        made_as = Endpoint(loaded[0].api or prepared.endpoint)  # a response runs as a chat
        if made_as not in framed:
            raise InvalidRequest(
                f"Stream '{request_id}' is a {made_as.value} stream: resume it with "
                f"GET /v1/responses/{response_id_of(request_id)}?stream=true&starting_after="
                "<its last sequence_number> (one made with store: false cannot be resumed).",
                param="request_id",
            )
        if prepared.endpoint is Endpoint.MESSAGES:
            # Anthropic's events number their content blocks from the message's start:
            # replayed from there, and the route skips what the client has seen.
            cursor = None
        elif cursor is not None and cursor.count("/") != 1:
            raise invalid_event_id()  # a Messages event's id (``web.resume``)
        label = route or prepared.endpoint.value
        span = request_trace(label, trace, resumed_from=prepared.record.trace)
        self._log_start(prepared, None, span)
        if span is not None:
            span.describe(prepared.record)
            span.event("resume", **{"tokenrelay.cursor": cursor or ""})
        return self.follow(
            prepared, cursor=self._within(request_id, cursor), route=route, trace=span
        )

    def _within(self, rid: str, cursor: str | None) -> str | None:
        """``cursor``, or, past the end of a stream that ended, the end itself: the run
        then ends at once instead of waiting for a chunk that never comes."""
        if not cursor:
            return cursor
        try:
            end = self.outputs.ended_at(rid)
        except redis.RedisError as exc:
            raise backbone_unavailable() from exc
        if end is None or int(split_cursor(cursor)[0]) <= end:
            return cursor
        return f"{end}/{PAST_EVERY_EVENT}"

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
        self.abandoned.follows.queue(pipe, rid, change)  # if this process dies

    def cancel(self, rid: str) -> None:
        """Stop generating ``rid`` and free its admission slot."""
        self.store.cancel(rid)
        self.store.release(rid)

    def cancel_later(self, rid: str) -> None:
        """Cancel ``rid`` after the resume grace unless a client follows it again (by
        this process or another: ``broker.abandon``)."""
        try:
            self.abandoned.later(rid)
        except redis.RedisError as exc:
            logger.warning("could not note abandoned request %s: %s", rid, exc)

    def _admit_and_submit(self, prepared: PreparedRequest) -> PreparedRequest:
        """Admit and submit; the request as submitted (with its ``route``)."""
        record = prepared.record
        settings = self.settings
        if record.num_choices > settings.max_request_choices:
            raise QuotaExceeded(
                f"This request asks for {record.num_choices} choices (prompts x n); the "
                f"quota is {settings.max_request_choices} per request (max_request_choices)."
            )
        if record.owner and settings.api_keys and settings.key_max_output_bytes:
            self._check_output_quota(record.owner)
        router = self._router(record.model)
        route = router.choose(record) if router is not None else None
        if route is not None:
            record = record.model_copy(update={"route": route})
        elif settings.fair_share and settings.api_keys and record.queue == "interactive":
            record = record.model_copy(update={"fair": True})  # broker.fair_queue
        prepared = dataclasses.replace(prepared, record=record)
        try:
            admitted, ahead = self._admit(record)
            if not admitted:
                raise self._refusal(record, admitted)
            try:
                weight = self.policy.weight(record.owner)
                if record.fair:
                    self.fair.push(record.model, record.owner, record.request_id,
                                   priority=record.priority, weight=weight)  # fmt: skip
                    step = 0
                else:  # kombu's priority steps: coarse, but what a routed turn can have
                    turns = ahead // weight if settings.fair_share else 0
                    step = fair_priority(max(turns + record.priority, 0))
                self.store.send(record, self.celery, priority=step, placement=self.placement)
                if router is not None and route is not None:
                    router.sent(route)
            except Exception:
                # The record is written without its task (Redis went away between the
                # two): cancel it, or a streamer would send the task again for a client
                # that was told 503.
                with contextlib.suppress(redis.RedisError):
                    self.store.cancel(record.request_id)
                self.store.release(record.request_id)
                raise
        except (redis.RedisError, OperationalError) as exc:
            self._ready_until.clear()
            raise backbone_unavailable() from exc
        return prepared

    def _check_output_quota(self, owner: str) -> None:
        """Refuse a key whose requests' output in Redis (kept ``stream_ttl_s`` for
        resumes and replays) is at its quota, until the oldest leaves the window."""
        limit = self.settings.key_max_output_bytes
        try:
            used = self.output_usage.used(owner)
        except redis.RedisError as exc:
            raise backbone_unavailable() from exc
        if used >= limit:
            full = QuotaExceeded(
                f"This API key's requests wrote {limit} bytes of output in the last "
                f"{self.settings.stream_ttl_s} s, which are kept for resumes and replays: "
                "its quota (key_max_output_bytes); retry when older output has expired."
            )
            full.retry_after = self.output_usage.frees_in()  # type: ignore[attr-defined]
            raise full

    def key_revoked(self, owner: str) -> bool:
        """Whether ``owner`` is a managed API key revoked since (its streams end)."""
        cache = self.policy.cache
        return cache is not None and bool(owner) and cache.revoked(owner)

    def settle(self, record: RequestRecord, usage: dict[str, Any] | None) -> None:
        """A request ended with its usage: give back the tokens its key reserved for
        it and did not use (only a key with a tokens-per-minute limit reserved any)."""
        owner = record.owner if self.settings.api_keys else ""
        if owner and record.queue == "interactive" and self.policy.rate(owner)[1]:
            unused = unused_tokens(record, usage)
            self.store.settle_tokens(record.request_id, owner, record.created, unused)

    def _refusal(self, record: RequestRecord, answer: Admission) -> TokenRelayError:
        """What a client is told when ``RequestStore.admit`` said ``answer`` (not
        ``ADMITTED``): 429 for its key's quotas and rates, 503 for shared capacity."""
        if answer is Admission.OWNER_FULL:
            full = QuotaExceeded(
                f"This API key already has {self.policy.in_flight_limit(record.owner)} "
                "requests in flight, its quota (key_max_in_flight); retry when one has "
                "finished."
            )
            full.retry_after = RETRY_AFTER_S  # type: ignore[attr-defined]
            return full
        if answer is Admission.MODEL_FULL:
            return QueueFull(
                f"The model '{record.model}' is at capacity (model_max_queue); please "
                "retry shortly.",
                retry_after=RETRY_AFTER_S,
            )
        if answer not in (Admission.RPM_FULL, Admission.TPM_FULL):
            return QueueFull(
                "The server is at capacity; please retry shortly.", retry_after=RETRY_AFTER_S
            )
        rpm, tpm = self.policy.rate(record.owner)
        wait = max(int(60 - record.created % 60) + 1, 1)
        if answer is Admission.RPM_FULL:
            what = f"{rpm} requests per minute"
        elif reserved_tokens(record) > tpm:
            what = f"{tpm} tokens per minute, less than this request may use "
            what += f"({reserved_tokens(record)} tokens: prompt + max_tokens x choices)"
        else:
            what = f"{tpm} tokens per minute (prompt + max_tokens reserved per request)"
        return RateLimited(f"Rate limit reached for this API key: {what}.", retry_after=wait)

    def _admit(self, record: RequestRecord) -> tuple[Admission, int]:
        """Admit ``record`` and write it, in one call (``RequestStore.admit``); with how
        many of its key's requests were in flight before it."""
        settings = self.settings
        # Only with keys configured does an owner stand for one client.
        owner = record.owner if settings.api_keys else ""
        try:
            admitted = self.store.admit(
                record.request_id,
                record.deadline,
                settings.max_queue,
                self.clock(),
                weight=record.num_choices,
                owner=owner,
                owner_limit=self.policy.in_flight_limit(owner),
                model=record.model,
                model_limit=settings.model_max_queue,
                rate=self.policy.rate_for(record) if owner else RateLimit(),
                rate_at=record.created,
                create=record,
            )
            return admitted.answer, admitted.ahead
        except redis.ResponseError:
            # The script may have counted the request before a command in it failed
            # (a full Redis refuses the record's write): free its slot, which Redis
            # allows even then. (Not after a connection error: then nothing answers.)
            with contextlib.suppress(redis.RedisError):
                self.store.release(record.request_id)
            raise

    # -- readiness -----------------------------------------------------------------------
    def readiness(self, model: str | None = None) -> tuple[bool, str]:
        """(ready, reason): Redis reachable, a live worker for ``model`` (the default
        model when None), a live streamer."""
        ok, reason, _no_worker = self._readiness(model or self.model_name)
        return ok, reason

    def _readiness(self, model: str) -> tuple[bool, str, bool]:
        try:
            workers = [w for w in self.workers.live() if w.model == model]
            streamers = self.streamers.live()
        except redis.RedisError:
            return False, "Redis is unreachable.", False
        if not streamers:
            return False, "No live streamer.", False
        if not workers:
            return False, f"No live worker serves model '{model}'.", True
        return True, "ok", False

    def check_ready(self, model: str | None = None) -> None:
        """Fail fast: 503 + Retry-After before anything is submitted or streamed. A
        known model with no live worker is queued instead when ``model_wait_s`` is set
        (its first worker may be starting: an autoscaler scaling it from zero); the
        streamers fail it if none comes within that time."""
        model = model or self.model_name
        now = time.monotonic()
        if now < self._ready_until.get(model, 0.0):
            return
        ok, reason, no_worker = self._readiness(model)
        if not ok and not (no_worker and self.settings.model_wait_s > 0):
            raise ServiceUnavailable(reason, code="not_ready", retry_after=RETRY_AFTER_S)
        if ok:
            self._ready_until[model] = now + READY_CACHE_S


def _wants_stream(body: Any, stream: bool | None) -> bool:
    if stream is not None:
        return stream
    return isinstance(body, dict) and body.get("stream") is True
