"""Per-process worker state: the engine thread, the request store, the registration.

Created once in Celery's ``worker_init`` (so the model loads once per process, before
any task runs) and reached by tasks through the Celery app object.
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis

from app import logs
from app.model_card import ModelCard, load_model_card
from app.records import RequestRecord
from app.settings import Settings
from app.tracecontext import trace_id_of
from broker.celery_app import GenerateResult, TaskOutcome
from broker.connection import keys_for, open_redis
from broker.embeddings import send_reply
from broker.fair_queue import FairQueue
from broker.models import ModelCatalog, ModelEntry
from broker.prefix_routes import PrefixAdverts
from broker.publish import lease_value
from broker.registry import WorkerInfo, worker_registry
from broker.requests import ClaimResult, RequestStore
from broker.tracing import generation_spans
from workers.backoff import Backoff
from workers.embedder import Embedder, can_embed
from workers.engine_thread import DEADLINE_MESSAGE, EngineThread
from workers.engines import load_engine
from workers.engines.base import ChoiceJob, Engine, EngineJob
from workers.prefix_adverts import PrefixAdvertiser
from workers.work_items import WorkItem

logger = logging.getLogger(__name__)

HEARTBEAT_S = 2.0

# How long ``stop`` waits for the engine thread to finish its step and exit.
STOP_JOIN_S = 10.0


def new_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class WorkerRuntime:
    """Everything one worker process owns; ``generate`` is the task body."""

    def __init__(
        self,
        settings: Settings,
        card: ModelCard,
        engine: Engine,
        client: redis.Redis,
        *,
        worker_id: str | None = None,
        home: int = -1,
    ) -> None:
        self.settings = settings
        self.home = home  # its home shard on a Redis Cluster (broker.placement)
        self.card = card
        self.engine = engine
        # Read here, before the engine thread starts: the heartbeat and Flower report
        # them from other threads, which must never call into the engine.
        self.engine_mode = engine.mode
        self.engine_capacity = engine.capacity
        self.model_name = settings.served_name
        self.worker_id = worker_id or new_worker_id()
        keys = keys_for(client, settings)
        self.store = RequestStore(client, keys, stream_ttl_s=settings.stream_ttl_s)
        self.fair = FairQueue(client, keys, ttl_s=settings.stream_ttl_s)
        self.registry = worker_registry(client, keys, ttl_s=5 * HEARTBEAT_S)
        self.models = ModelCatalog(client, keys, self.registry, default=self.model_name)
        self.model_entry = ModelEntry(
            name=self.model_name,
            model_dir=str(Path(card.path).resolve()),
            engine=engine.name,
            context_length=card.context_length,
            registered=time.time(),
        )
        # Routed to (broker.prefix_routes) when its engine keeps a prefix cache.
        self.adverts = (
            PrefixAdverts(client, keys, ttl_s=5 * HEARTBEAT_S)
            if settings.prefix_routing and engine.prefix_blocks() is not None
            else None
        )
        self.thread = EngineThread(
            engine,
            self.store,
            lease_ttl_s=settings.lease_ttl_s,
            worker_id=self.worker_id,
            advertiser=(
                PrefixAdvertiser(functools.partial(self.adverts.publish, self.worker_id))
                if self.adverts
                else None
            ),
        )
        self._stop = threading.Event()
        self._submissions = itertools.count()
        self._heartbeat = threading.Thread(target=self._beat, name="heartbeat", daemon=True)
        self._breaker = threading.Thread(target=self._watch, name="breaker", daemon=True)
        # Called with the reason once the engine broke and this worker left the fleet:
        # the Celery worker exits then, non-zero, for its supervisor to restart it.
        self.on_broken: Callable[[str], None] = lambda _reason: None
        self.started = time.time()
        self.stop_join_s = STOP_JOIN_S
        self.draining = False  # SIGTERM came: see ``drain``
        self._drain_timer: threading.Timer | None = None
        # /v1/embeddings for this model, when it can (a GGUF, llama.cpp here).
        self.embedder = Embedder(card, settings) if can_embed(settings, card) else None

    @classmethod
    def from_settings(
        cls, settings: Settings, *, worker_id: str | None = None, home: int = -1
    ) -> WorkerRuntime:
        card = load_model_card(settings.card_path())
        engine = load_engine(settings, card)
        # Task threads (claims, loads), the engine thread and the heartbeat.
        client, _keys = open_redis(settings, max_connections=settings.worker_slots + 16)
        return cls(settings, card, engine, client, worker_id=worker_id, home=home)

    def start(self) -> None:
        self.thread.start()
        self._heartbeat.start()
        self._breaker.start()
        logger.info(
            "worker %s serving %s with the %s engine: mode %s, capacity %d sequences, %d slots",
            self.worker_id,
            self.model_name,
            self.engine.name,
            self.engine_mode,
            self.engine_capacity,
            self.settings.worker_slots,
        )

    def drain(self, drain_s: float) -> None:
        """SIGTERM: Celery takes no new jobs from now on (its warm shutdown); the jobs
        running here go on for at most ``drain_s`` and are then handed over
        (``hand_over``). Until then this worker takes no turns routed by prefix: it says
        so in its heartbeat at once, and what already waits in its own queue goes to the
        shared one."""
        if self.draining:
            return
        self.draining = True
        logger.info("worker %s draining: at most %.1f s, then the rest is handed over",
                    self.worker_id, drain_s)  # fmt: skip
        self._drain_timer = threading.Timer(drain_s, self.hand_over)
        self._drain_timer.daemon = True
        self._drain_timer.start()
        try:
            self.registry.heartbeat(self.info())
            if self.adverts is not None:
                self.adverts.remove(self.worker_id)
        except redis.RedisError as exc:
            logger.warning("could not announce the drain: %s", exc)

    def hand_over(self) -> None:
        """End the drain: stop the engine thread, which gives back the leases of the
        requests still here (they resume on other workers within a second, from the
        tokens published so far) and lets their tasks return, so the worker can exit."""
        if self.thread.active_requests:
            logger.info("worker %s: drain time is up; handing %d requests over",
                        self.worker_id, self.thread.active_requests)  # fmt: skip
        self.thread.stop()

    def stop(self) -> None:
        """Stop the engine thread, unregister, and close the engine once nothing else
        can touch it.

        If the thread is still inside a step when ``stop_join_s`` runs out, the engine
        is NOT closed from here: that would free the generator's cache under a forward
        pass running in the other thread. It stays open until the process exits (which
        follows a worker's stop), and the log says so."""
        self._stop.set()
        if self._drain_timer is not None:
            self._drain_timer.cancel()
        self.thread.stop()
        self.thread.join(timeout=self.stop_join_s)
        try:
            self.registry.unregister(self.worker_id)
            if self.adverts is not None:
                self.adverts.remove(self.worker_id)
        except redis.RedisError:
            logger.warning("could not unregister worker %s", self.worker_id)
        if self.thread.is_alive():
            logger.error(
                "the engine thread is still running %.0f s after the stop (a long engine "
                "step?): the %s engine is left open, freed when the process exits",
                self.stop_join_s,
                self.engine.name,
            )
            return
        self.engine.close()
        if self.embedder is not None:
            self.embedder.close()

    def _watch(self) -> None:
        """When the engine thread broke (``EngineThread.broken``): stop heart-beating
        and leave the registry (the web tier stops counting on this worker, the
        streamers resume its requests, whose leases it gave back), then ``on_broken``."""
        self.thread.broke.wait()
        if self._stop.is_set():
            return
        reason = self.thread.broken or "the engine failed"
        logger.critical("worker %s is broken (%s): leaving the fleet", self.worker_id, reason)
        self.stop()
        self.on_broken(reason)

    def describe(self) -> dict[str, str | int]:
        """What this worker is, for Flower's worker page (``celery inspect stats``)."""
        return {
            "tokenrelay_worker_id": self.worker_id,
            "tokenrelay_model": self.model_name,
            "tokenrelay_engine": self.engine.name,
            "tokenrelay_engine_mode": self.engine_mode,
            "tokenrelay_engine_capacity": self.engine_capacity,
            "tokenrelay_worker_slots": self.settings.worker_slots,
        }

    def info(self) -> WorkerInfo:
        return WorkerInfo(
            worker_id=self.worker_id,
            model=self.model_name,
            engine=self.engine.name,
            capacity=self.settings.worker_slots,
            mode=self.engine_mode,
            engine_capacity=self.engine_capacity,
            hostname=socket.gethostname(),
            pid=os.getpid(),
            home=self.home,
            started=self.started,
            active_jobs=self.thread.active_requests,
            batch_size=self.thread.batch_size,
            steps_total=self.thread.steps,
            tokens_total=self.thread.tokens_total,
            engine_stats=dict(self.thread.engine_stats),
            beat_at=time.time(),
            routed=self.adverts is not None and not self.draining,
            embeds=self.embedder is not None,
        )

    def embed(self, request_id: str, inputs: list[list[int]]) -> int:
        """The ``embed`` task: the vectors of ``inputs`` (token ids), answered on the
        request's reply list, or the error; how many vectors."""
        keys = self.store.keys
        if self.embedder is None:
            reply: dict[str, Any] = {"error": "This worker does not serve embeddings.", "code": 503}
        else:
            try:
                reply = {"embeddings": self.embedder.embed(inputs)}
            except ValueError as exc:
                reply = {"error": str(exc), "code": 400}
            except Exception:
                logger.exception("embedding request %s failed", request_id)
                reply = {"error": "The embedding failed on the worker.", "code": 500}
        send_reply(self.store.redis, keys, request_id, reply)
        return len(reply.get("embeddings", ()))

    def _beat(self) -> None:
        """Heart-beat every ``HEARTBEAT_S`` whatever Redis does: one warning when it
        goes away, one line when it is back (the web tier's readiness needs the beat)."""
        outage = Backoff(initial_s=HEARTBEAT_S, max_s=HEARTBEAT_S)
        while not self._stop.is_set():
            try:
                self.registry.heartbeat(self.info())
                # Known to the front door from now on, even once every worker is gone
                # (broker.models): written each beat, so a Redis that lost it has it again.
                self.models.register(self.model_entry)
                if self.adverts is not None:
                    self.adverts.touch(self.worker_id)
            except redis.RedisError as exc:
                if outage.failed(time.monotonic()):
                    logger.warning("worker heartbeat failed (%s); retrying", exc)
            except Exception:  # a bug in one beat must not end the heartbeat
                logger.exception("worker heartbeat failed")
            else:
                if outage.recovered():
                    logger.info("worker heartbeat reaches redis again")
            self._stop.wait(HEARTBEAT_S)

    # -- the task body -----------------------------------------------------------------
    def generate(self, request_id: str, attempt: int, *, fair: bool = False) -> GenerateResult:
        """Run ``attempt`` of a request to its end here, unless someone else owns it.
        ``fair``: run the model's next request by fair share (``broker.fair_queue``)
        instead; one that is not waiting any more is skipped for the one after."""
        logs.clear()  # this thread's last task named another request
        while fair:
            taken = self.fair.pop(self.model_name)
            if taken is None:
                logger.info("task for request %s: no fair-share request waits", request_id)
                skipped = TaskOutcome.SKIPPED
                return GenerateResult(
                    request_id=request_id, attempt=0, outcome=skipped, claim="none waiting"
                )
            claim, record, again = self.store.claim_through_outage(
                taken, 0, self.worker_id, self.settings.lease_ttl_s
            )
            if claim is ClaimResult.OK:
                request_id, attempt = taken, 0
                break
        else:
            claim, record, again = self.store.claim_through_outage(
                request_id, attempt, self.worker_id, self.settings.lease_ttl_s
            )
        if claim is not ClaimResult.OK:
            logger.info("request %s attempt %s not run here: %s", request_id, attempt, claim.value)
            return GenerateResult(
                request_id=request_id,
                attempt=attempt,
                outcome=TaskOutcome.SKIPPED,
                claim=claim.value,
            )
        if record is None:  # a record without its body (cannot happen but by hand)
            return GenerateResult(
                request_id=request_id,
                attempt=attempt,
                outcome=TaskOutcome.SKIPPED,
                claim=ClaimResult.MISSING.value,
            )
        claimed = time.time()
        logs.bind(
            request_id=request_id, model=record.model, trace_id=trace_id_of(record.trace)
        )  # this task's log lines name it
        handle = self.thread.submit(self.work_item(record, attempt, resumed=attempt > 0 or again))
        # The engine thread ends every job by its deadline; waking up now and then
        # guards against a stuck engine pinning this thread (and its slot) forever.
        while not handle.wait(timeout=max(1.0, record.give_up_at - time.time())):
            if time.time() > record.give_up_at:
                logger.error("request %s: engine thread did not finish it", request_id)
                return GenerateResult(
                    request_id=request_id,
                    attempt=attempt,
                    outcome=TaskOutcome.TIMEOUT,
                    error=DEADLINE_MESSAGE,
                )
        assert handle.result is not None  # set before ``done``
        if record.trace:
            self._trace(record, handle.result, claimed)
        return handle.result

    def _trace(self, record: RequestRecord, result: GenerateResult, claimed: float) -> None:
        """This attempt's spans in the request's trace (``broker.tracing``), made from
        the times the engine thread measured, after the fact: nothing on its steps."""
        try:
            generation_spans(
                record,
                attempt=result.attempt,
                worker_id=self.worker_id,
                claimed=claimed,
                ended=time.time(),
                result=result,
            )
        except Exception:  # tracing must never fail a request
            logger.exception("request %s: could not record its trace", record.request_id)

    def work_item(self, record: RequestRecord, attempt: int, resumed: bool = True) -> WorkItem:
        """The engine jobs for ``attempt``: when ``resumed`` (claimed before, by this
        attempt or another: its tokens may be published already), only unfinished
        choices, each continuing from the tokens it already published."""
        n_choices = record.num_choices
        lease = lease_value(self.worker_id, attempt)
        progress, ordinal = (
            self.store.resume_point(record.request_id, n_choices, lease) if resumed else (None, 0)
        )
        stop = record.stop
        eos = frozenset() if stop.ignore_eos else frozenset(self.card.eos_token_ids)
        jobs: list[EngineJob] = []
        for p, prompt in enumerate(record.prompts):
            choices = []
            for i in range(record.n):
                idx = p * record.n + i
                prefix = progress[idx].token_ids if progress else []
                if progress and progress[idx].finish is not None:
                    continue
                choices.append(ChoiceJob(idx, max(record.max_tokens - len(prefix), 0), prefix))
            if not choices:
                continue
            jobs.append(
                EngineJob(
                    # Unique per submission: a request claimed anew on this worker while
                    # its older run is still in the engine must not collide with it.
                    job_id=f"{record.request_id}/{attempt}.{next(self._submissions)}/{p}",
                    prompt_ids=prompt,
                    choices=choices,
                    sampling=record.sampling,
                    eos_token_ids=eos,
                    stop_token_ids=frozenset(stop.stop_token_ids),
                    min_tokens=stop.min_tokens,
                    echo_ids=record.echo_ids[p] if record.echo_ids else None,
                    cache_scope=record.engine_scope,
                    eos_token_id=self.card.eos_token_ids[0] if eos else None,
                )
            )
        for job in jobs:  # here, on the task's thread: not a step of the engine's
            self.engine.prepare(job)
        return WorkItem(
            request_id=record.request_id,
            attempt=attempt,
            lease_value=lease,
            jobs=jobs,
            deadline=record.deadline,
            ordinal=ordinal,
        )
