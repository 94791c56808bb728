"""The web tier's one door to the rest of the system (through ``broker/`` only).

``GenerationService`` turns a validated OpenAI request into a ``RequestRecord``
(template, tokenize, context check, stop conditions: ``broker.records.RecordBuilder``,
which the batch driver shares), admits it against the shared
in-flight limit, submits it, and reads its output stream from a cursor. Routes for
HTTP/SSE, WebSocket and batches all use it, so they cannot disagree on what a request
means. One instance per web process, built from settings (no module-level globals).
"""

from __future__ import annotations

import queue
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import redis
from celery import Celery

from app.chat_template import PromptBuilder
from app.errors import QueueFull
from app.messages import OutputEvent
from app.model_card import ModelCard, load_model_card
from app.protocol import ChatCompletionRequest, CompletionRequest
from app.settings import Settings
from broker.celery_app import create_celery
from broker.connection import redis_client
from broker.keys import Keys
from app.records import QueueName, RecordBuilder, RequestRecord
from broker.registry import streamer_registry, worker_registry
from broker.requests import RequestStore
from broker.streams import OutputHub, OutputStreams, is_terminal


@dataclass(frozen=True, slots=True)
class Submitted:
    """A request that was admitted and handed to workers and streamers."""

    record: RequestRecord
    prompt_tokens: int

    @property
    def request_id(self) -> str:
        return self.record.request_id


class GenerationService:
    def __init__(
        self,
        settings: Settings,
        *,
        card: ModelCard | None = None,
        client: redis.Redis | None = None,
        celery_app: Celery | None = None,
        clock: Callable[[], float] = time.time,
        new_id: Callable[[], str] = lambda: uuid.uuid4().hex,
    ) -> None:
        self.settings = settings
        self.card = card or load_model_card(settings.model_path())
        self.prompts = PromptBuilder.from_card(self.card)
        self.tokenizer = self.prompts.tokenizer
        self.model_name = settings.served_name
        # Streams are read by one hub thread; the other connections serve request
        # threads (submit, cancel, ready), at most one each at a time.
        self.redis = client or redis_client(
            settings.redis_url, max_connections=settings.web_threads + 16
        )
        keys = Keys(settings.key_prefix)
        self.store = RequestStore(self.redis, keys, stream_ttl_s=settings.stream_ttl_s)
        self.outputs = OutputStreams(self.redis, keys, ttl_s=settings.stream_ttl_s)
        # Every open stream of this process is read by one hub thread, one XREAD for all.
        self.hub = OutputHub(self.redis, keys, ttl_s=settings.stream_ttl_s)
        self.workers = worker_registry(self.redis, keys)
        self.streamers = streamer_registry(self.redis, keys)
        self.celery = celery_app or create_celery(settings)
        self.clock = clock
        self.new_id = new_id
        # Lambdas, not the callables themselves: tests may replace service.clock/new_id.
        self.builder = RecordBuilder(
            self.card,
            self.prompts,
            model_name=self.model_name,
            request_timeout_s=settings.request_timeout_s,
            clock=lambda: self.clock(),
            new_id=lambda: self.new_id(),
        )

    # -- models and records (built by broker.records.RecordBuilder, shared with batches) -----
    def check_model(self, model: str | None) -> None:
        """Only the served model exists here (a missing model field means ours)."""
        self.builder.check_model(model)

    def chat_record(
        self, req: ChatCompletionRequest, *, queue: QueueName = "interactive"
    ) -> RequestRecord:
        return self.builder.chat(req, queue=queue)

    def completion_record(
        self, req: CompletionRequest, *, queue: QueueName = "interactive"
    ) -> RequestRecord:
        return self.builder.completion(req, queue=queue)

    # -- running ----------------------------------------------------------------------------
    def submit(self, record: RequestRecord) -> Submitted:
        """Admit (429 when the shared in-flight limit is reached) and submit."""
        now = self.clock()
        if not self.store.admit(record.request_id, record.deadline, self.settings.max_queue, now):
            raise QueueFull("The server is at capacity; please retry shortly.", retry_after=1)
        try:
            self.store.submit(record, self.celery)
        except Exception:
            self.store.release(record.request_id)
            raise
        return Submitted(record, sum(len(p) for p in record.prompts))

    def events(
        self, rid: str, cursor: str = "0-0", *, block_ms: int = 1000
    ) -> Iterator[tuple[str, OutputEvent] | None]:
        """The output stream from ``cursor``: (entry id, event) pairs until the terminal
        event; ``None`` whenever ``block_ms`` passes without output (for keep-alives)."""
        sub = self.hub.subscribe(rid, cursor)
        try:
            while True:
                try:
                    eid, events = sub.entries.get(timeout=block_ms / 1000)
                except queue.Empty:
                    yield None
                    continue
                for ev in events:
                    yield eid, ev
                    if is_terminal(ev):
                        return
        finally:
            self.hub.unsubscribe(sub)

    def finish(self, rid: str) -> None:
        """The client has everything (or is gone): free the admission slot."""
        self.store.release(rid)

    def cancel(self, rid: str) -> None:
        """Client disconnect or explicit cancel: stop generation and free the slot."""
        self.store.cancel(rid)
        self.store.release(rid)

    # -- health -----------------------------------------------------------------------------
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
