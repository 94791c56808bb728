"""The engine thread: the only thread that touches the engine.

Celery task threads hand it ``WorkItem`` values through a queue and block on the
returned handle until the request ends, so Flower shows true task states and the
worker's thread count is its backpressure. Each loop iteration:

1. admits new jobs (without blocking while the engine has work),
2. runs one ``engine.step()``,
3. publishes every request's new token ids in ONE Redis round trip (a Lua script that
   also refreshes each lease and reports cancels and lost leases; a step that runs longer
   than a third of a lease has them refreshed meanwhile by ``workers.lease_keeper``),
4. cancels jobs whose request was cancelled, fenced, or ran past its deadline.

The publish overlaps the next step: it is sent after step N and its reply read after
step N+1 (at once when the engine has nothing more to run), so the engine never waits
for Redis while it has work; what the reply says (fenced, cancelled) acts one step
later, which the lease already allows for.

A job that fails is reported as an error on its token stream; nothing a job does can
end the loop. When Redis is unreachable the loop keeps stepping and keeps the unpublished
deltas, retrying the publish with a growing backoff (one warning per outage); a job
whose lease expired meanwhile is fenced on the first publish after the outage and
resumed elsewhere from what it had published.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable

import redis

from app.messages import EngineFinish, TokenDelta
from broker.celery_app import GenerateResult, TaskOutcome
from broker.chunks import ChunkLog, phase_of
from broker.publish import (
    FencedTail,
    PublishItem,
    PublishLinks,
    PublishStatus,
    encode_deltas,
    publish_stamp,
)
from broker.requests import RequestStore
from workers.backoff import Backoff
from workers.breaker import LEASE_GIVEN_BACK_S, MAX_FAILED_STEPS, unrecoverable
from workers.engine_state import Active, InFlight, Unsure
from workers.engines.base import Engine, JobRejected
from workers.lease_keeper import LeaseKeeper
from workers.prefix_adverts import PrefixAdvertiser
from workers.work_items import JobHandle, WorkItem

logger = logging.getLogger(__name__)

DEADLINE_MESSAGE = "The request exceeded its deadline."
ENGINE_FAILURE_MESSAGE = "The engine failed while generating; please retry."
JOB_FAILURE_MESSAGE = "The worker failed while handling this request; please retry."


class EngineThread(threading.Thread):
    """Owns the engine; see the module docstring for one iteration."""

    def __init__(
        self,
        engine: Engine,
        store: RequestStore,
        *,
        lease_ttl_s: float,
        clock: Callable[[], float] = time.time,
        idle_wait_s: float = 0.05,
        worker_id: str | None = None,
        advertiser: PrefixAdvertiser | None = None,
        max_failed_steps: int = MAX_FAILED_STEPS,
    ) -> None:
        super().__init__(name="engine", daemon=True)
        self.engine = engine
        self.store = store
        self.worker_id = worker_id  # names the step stream each publish also writes
        self.lease_ttl_s = lease_ttl_s
        self.clock = clock
        self.idle_wait_s = idle_wait_s
        self.inbox: queue.Queue[JobHandle] = queue.Queue()
        self._active: dict[str, Active] = {}
        self._job_owner: dict[str, str] = {}
        self._stopping = threading.Event()
        # The circuit breaker: after this many failed steps in a row, or one error an
        # engine cannot come back from, the thread stops as ``broken`` (the reason) and
        # sets ``broke``; the worker then leaves the fleet (``WorkerRuntime``).
        self.max_failed_steps = max_failed_steps
        self._failed_steps = 0
        self.broken: str | None = None
        self.broke = threading.Event()
        self._publish_backoff = Backoff(initial_s=0.05, max_s=1.0)
        self.steps = 0
        self.tokens_total = 0  # token ids produced (monitoring: rate() gives tokens/s)
        self.batch_size = 0  # choices running at the last step
        self.engine_stats: dict[str, float] = {}
        # When the running engine step began (monotonic; None between steps): the lease
        # keeper refreshes leases while a step outlasts a third of a lease.
        self.step_started: float | None = None
        self.lease_keeper = LeaseKeeper(self, store, lease_ttl_s=lease_ttl_s)
        # This thread publishes once per step: on a connection of its own (broker/direct.py;
        # one per shard on a Redis Cluster), with the fence epoch the last publish on it
        # ran under: while it stays the same, the publish skips checking each request's
        # lease and cancel key.
        self._links = PublishLinks.of(store.redis, store.keys)
        self._in_flight: InFlight | None = None  # sent, reply not read yet
        self._unsure = False  # some request has a failed publish that may have run
        self._publishes = 0  # publish calls sent (``ChunkLog``'s clock)
        # Tails of fenced attempts not sealed yet (``_seal_fenced``): sealed in one round
        # trip after the reply that fenced them, retried with the next publish if Redis
        # failed meanwhile.
        self._fenced_tails: list[FencedTail] = []
        # Writes the engine's cached prefixes and this worker's load to Redis for the
        # web tier's routing (``workers.prefix_adverts``); None: not routed to.
        self.advertiser = advertiser

    # -- called from task threads ---------------------------------------------------
    def submit(self, item: WorkItem) -> JobHandle:
        handle = JobHandle(item)
        self.inbox.put(handle)
        return handle

    def stop(self) -> None:
        self._stopping.set()

    @property
    def active_requests(self) -> int:
        return len(self._active)

    def held_leases(self) -> list[tuple[str, str]]:
        """``(request_id, lease_value)`` of every request this thread generates, and of
        those submitted but not admitted yet (for the lease keeper, from its own
        thread). A task claims its request, then submits it: one that arrives during a
        long step waits in the inbox until the step ends, and nobody else refreshes its
        lease (it expired, and the request was resumed, again and again, on a loaded
        machine whose steps took longer than a lease)."""
        held = [(rid, act.handle.item.lease_value) for rid, act in dict(self._active).items()]
        with self.inbox.mutex:  # queue.Queue's own lock: a consistent copy
            waiting = [(h.item.request_id, h.item.lease_value) for h in self.inbox.queue]
        return held + waiting

    # -- the loop --------------------------------------------------------------------
    def run(self) -> None:
        faults = Backoff(initial_s=0.1, max_s=2.0)  # a bug that repeats must not spin
        self.lease_keeper.start()
        while not self._stopping.is_set():
            try:
                self.iterate()
            except Exception:  # pragma: no cover - last resort, keep serving
                logger.exception("engine loop iteration failed")
                faults.failed(time.monotonic())
                self._stopping.wait(faults.delay_s)
            else:
                faults.recovered()
        self.lease_keeper.stop()
        with contextlib.suppress(redis.RedisError):
            self._finish_publish()  # what the last step published
            # Broken, or stopped with requests still here (a drain that ran out): they
            # resume on another worker at once, not when their leases run out. Each
            # lease still ours expires now (the streamers' watchdog sees it within a
            # second); the tokens published so far are where the next attempt goes on.
            self.store.refresh_leases(self.held_leases(), LEASE_GIVEN_BACK_S)
        self._abandon_all(self.broken or "worker shutting down")
        self._links.close()
        if self.broken is not None:
            self.broke.set()

    def iterate(self) -> None:
        # Wait for work only while the engine has none: finished jobs are published in
        # the iteration that finished them, and a publish that failed is retried when
        # its backoff allows, so nothing here can spin.
        self._admit(block=not self.engine.has_work())
        steps = []
        if self.engine.has_work():
            self.step_started = time.monotonic()
            try:
                steps = self.engine.step()
            except Exception as exc:
                self._failed_steps += 1
                if unrecoverable(exc) or self._failed_steps >= self.max_failed_steps:
                    logger.critical("engine step failed (%s); the engine is broken", exc)
                    self.broken = f"{type(exc).__name__}: {exc}"[:500]
                    self._stopping.set()  # ``run`` hands every request on and stops
                    return
                logger.exception("engine step failed; failing its active jobs")
                self._fail_all_jobs(ENGINE_FAILURE_MESSAGE)
            else:
                self._failed_steps = 0
            finally:
                self.step_started = None
            self.steps += 1
        for s in steps:
            rid = self._job_owner.get(s.job_id)
            act = self._active.get(rid) if rid else None
            if act is None:
                continue  # fenced or abandoned: its tokens are no longer ours
            try:
                self._record(act, s.delta)
            except Exception:
                logger.exception("request %s: bad engine step; failing it", rid)
                self._fail_job(act, JOB_FAILURE_MESSAGE)
        self.batch_size = sum(len(a.open_choices) for a in self._active.values())
        if steps:
            try:
                self.engine_stats = self.engine.stats()
            except Exception:
                logger.exception("engine stats failed")
        self._check_deadlines()
        # Before the tokens go out: a client that sees its reply end can send the next
        # turn at once, and the web tier should already know where its prefix is.
        self._advertise(any(s.delta.finish is not None for s in steps))
        self._finish_publish()  # the last step's, sent before this step ran
        self._publish()
        if not self.engine.has_work():
            self._finish_publish()  # nothing to overlap it with: read it now

    def _advertise(self, finished: bool) -> None:
        if self.advertiser is not None:
            load = self.inbox.qsize() + sum(1 for a in self._active.values() if a.open_choices)
            self.advertiser.tick(self.engine, finished, load)

    def _admit(self, block: bool) -> None:
        try:
            handle = self.inbox.get(timeout=self.idle_wait_s) if block else self.inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._start(handle)
            try:
                handle = self.inbox.get_nowait()
            except queue.Empty:
                return

    def _start(self, handle: JobHandle) -> None:
        item = handle.item
        older = self._active.get(item.request_id)
        if older is not None:
            # The same request again, here, while its older run is still in the engine:
            # that run lost its lease (a step outlasted it) and the request was claimed
            # anew. The older run would be fenced at its next publish; drop it now so
            # the two never share the request's state or collide in the engine.
            logger.warning(
                "request %s: attempt %s supersedes attempt %s still running here",
                item.request_id,
                item.attempt,
                older.handle.item.attempt,
            )
            older.outcome = TaskOutcome.FENCED
            self._cancel_jobs(older)
            self._release(older)
        choices = {c.index for job in item.jobs for c in job.choices}
        act = Active(
            handle=handle,
            open_choices=set(choices),
            started=self.clock(),
            log=ChunkLog(ordinal=item.ordinal, phase=phase_of(item.request_id)),
        )
        self._active[item.request_id] = act
        for job in item.jobs:
            spent = [c for c in job.choices if c.max_new_tokens <= 0]
            for c in spent:  # resumed right after its last token: only the finish is left
                self._record(act, TokenDelta(c.index, [], finish=EngineFinish.LENGTH))
            job.choices = [c for c in job.choices if c.max_new_tokens > 0]
            if not job.choices:
                continue
            try:
                self.engine.submit(job)
                self._job_owner[job.job_id] = item.request_id
            except JobRejected as exc:
                for c in job.choices:
                    self._record(
                        act,
                        TokenDelta(
                            c.index, [], finish=EngineFinish.ERROR, error=str(exc), error_code=400
                        ),
                    )
            except Exception:
                logger.exception("engine rejected job %s unexpectedly", job.job_id)
                for c in job.choices:
                    self._record(
                        act,
                        TokenDelta(
                            c.index,
                            [],
                            finish=EngineFinish.ERROR,
                            error=ENGINE_FAILURE_MESSAGE,
                            error_code=500,
                        ),
                    )
        if act.open_choices and len(act.open_choices) < len(choices):
            # Part of the request was rejected: stop the rest rather than run it half.
            self._cancel_jobs(act)

    def _record(self, act: Active, delta: TokenDelta) -> None:
        if delta.choice not in act.open_choices:
            return
        if delta.finish is EngineFinish.CANCELLED and act.deadline_hit:
            delta = TokenDelta(
                delta.choice,
                delta.token_ids,
                delta.logprobs,
                EngineFinish.ERROR,
                DEADLINE_MESSAGE,
                504,
            )
        produced = len(delta.token_ids)  # before any change: a malformed delta raises here
        act.unpublished.append(delta)
        act.tokens[delta.choice] = act.tokens.get(delta.choice, 0) + produced
        self.tokens_total += produced
        if produced and act.step != self.steps:
            act.step = self.steps
            act.steps += 1
            if act.first_token_at is None:
                act.first_token_at = self.clock()
        if delta.finish is not None:
            act.open_choices.discard(delta.choice)
            act.finishes[delta.choice] = delta.finish.value

    def _check_deadlines(self) -> None:
        now = self.clock()
        for act in self._active.values():
            if not act.deadline_hit and act.open_choices and now > act.handle.item.deadline:
                act.deadline_hit = True
                self._cancel_jobs(act)

    def _cancel_jobs(self, act: Active) -> None:
        if act.cancel_sent:
            return
        act.cancel_sent = True
        for job in act.handle.item.jobs:
            try:
                self.engine.cancel(job.job_id)
            except Exception:
                logger.exception("engine cancel of job %s failed", job.job_id)

    def _fail_job(self, act: Active, message: str) -> None:
        """End every open choice of one request with an error; stop its engine jobs."""
        act.outcome = TaskOutcome.FAILED
        for c in sorted(act.open_choices):
            self._record(
                act, TokenDelta(c, [], finish=EngineFinish.ERROR, error=message, error_code=500)
            )
        self._cancel_jobs(act)

    def _publish(self) -> None:
        """Send this step's deltas (and the leases due a refresh); the reply is read by
        ``_finish_publish``, after the next step."""
        now = self.clock()
        if not self._publish_backoff.ready(now):
            return  # Redis was unreachable: keep the deltas until the next try
        if not self._settle_unsure(now):
            return
        if self._fenced_tails:
            self._seal_fenced()
        items: list[tuple[Active, PublishItem, list[TokenDelta]]] = []
        for rid, act in list(self._active.items()):
            pitem = self._stage(rid, act, now)
            if pitem is not None:
                items.append((act, pitem, act.unpublished))
                act.unpublished = []  # in flight now; put back if the publish fails
        if not items:
            return
        self._publishes += 1
        stamp = publish_stamp()
        try:
            pending = self.store.publish_shards(
                [p for _, p, _ in items], self.lease_ttl_s, self._links, self.worker_id, stamp
            )
        except redis.RedisError as exc:
            self._publish_failed(items, now, stamp, exc)
            return
        self._in_flight = InFlight(pending, items, now, stamp)

    def _stage(self, rid: str, act: Active, now: float) -> PublishItem | None:
        """What this step publishes for one request (None: nothing is due): its new
        chunk, or a checkpoint of its chunks so far, or only a lease refresh."""
        index = self._publishes
        done = not act.open_choices
        # A lease is refreshed every third of it even when nothing was generated, and
        # extended every fifth of it, not every step: at a thousand steps a second the
        # PEXPIRE was a fifth of the publish script's commands.
        if (
            not act.unpublished
            and not done
            and now - act.last_publish < self.lease_ttl_s / 3
            and not act.log.due(index)
        ):
            return None
        payload = self._payload(act)  # may fail the request: ``done`` is read after
        done = not act.open_choices
        if payload:
            ordinal, mark, prior = act.log.stage(payload, index, force=act.first or done)
        elif act.log.due(index):  # its chunks since the last checkpoint: one now
            ordinal, payload, prior = act.log.restage(index)
            mark = True
        else:
            ordinal, mark, prior = 0, False, b""
        item = act.handle.item
        return PublishItem(
            rid,
            item.lease_value,
            item.attempt,
            payload,
            first=act.first,
            done=done,
            refresh=now - act.last_refresh >= self.lease_ttl_s / 5,
            ordinal=ordinal,
            checkpoint=mark,
            prior=prior,
        )

    def _finish_publish(self) -> None:
        """Read the reply of the publish in flight, if any, and act on it."""
        flight, self._in_flight = self._in_flight, None
        if flight is None:
            return
        try:
            statuses = flight.pending.statuses()
        except redis.RedisError as exc:
            self._publish_failed(flight.items, flight.sent_at, flight.stamp, exc)
            return
        if self._publish_backoff.recovered():
            logger.info("publishing to redis again")
        for (act, pitem, _deltas), status in zip(flight.items, statuses, strict=True):
            self._settle(act, pitem, status, flight.sent_at)
        if self._fenced_tails:
            self._seal_fenced()

    def _settle(
        self, act: Active, pitem: PublishItem, status: PublishStatus, sent_at: float
    ) -> None:
        """Act on what one request's part of a publish sent at ``sent_at`` came to."""
        if self._active.get(pitem.request_id) is not act:
            return  # superseded meanwhile by a newer attempt here: released already
        if pitem.payload:  # "first" sets the stream's TTL: it must exist by then
            act.first = False
        act.last_publish = sent_at
        if pitem.refresh:
            act.last_refresh = sent_at
        if status is PublishStatus.FENCED:
            if pitem.payload:
                act.log.unstage()  # the script wrote nothing for it
            checkpointed, chunks = act.log.unsealed()
            if chunks:
                item = act.handle.item
                self._fenced_tails.append(
                    FencedTail(item.request_id, item.attempt, checkpointed, chunks)
                )
            act.outcome = TaskOutcome.FENCED
            self._cancel_jobs(act)
            self._release(act)
        elif pitem.done:
            if act.cancel_sent and not act.deadline_hit and act.outcome is TaskOutcome.DONE:
                act.outcome = TaskOutcome.CANCELLED
            self._release(act)
        elif status is PublishStatus.CANCEL:
            self._cancel_jobs(act)

    def _seal_fenced(self) -> None:
        """Seal the tails of the attempts just fenced into their token streams: a
        successor may read them only after this worker's step stream was trimmed past
        them (``scripts.SEAL``). Redis away: kept for the next publish's try."""
        try:
            self.store.seal_fenced(self._fenced_tails)
        except redis.RedisError as exc:
            logger.warning("could not seal the tails of fenced requests yet (%s)", exc)
            return
        self._fenced_tails = []

    def _publish_failed(
        self,
        items: list[tuple[Active, PublishItem, list[TokenDelta]]],
        now: float,
        stamp: str,
        exc: Exception,
    ) -> None:
        """Keep the deltas (ahead of any recorded since) and retry after a growing pause,
        with one warning per outage. The call may have run all the same (its reply was
        lost, or Redis ran it and then lost the connection): each request's part that
        carried tokens is unsure until ``_settle_unsure`` asks."""
        for act, pitem, deltas in items:
            act.unpublished = deltas + act.unpublished
            if pitem.payload:
                act.unsure = Unsure(stamp, pitem, len(deltas), now)
                self._unsure = True
        if self._publish_backoff.failed(now):
            logger.warning("publishing to redis failed (%s); retrying with backoff", exc)

    def _settle_unsure(self, now: float) -> bool:
        """Before publishing again after a failure, find out which of the failed call's
        parts ran: those are settled as published and their deltas dropped (a retry
        would append the same tokens twice: a reader sees them twice), the rest go out
        again. False while Redis cannot say: publish nothing yet."""
        if not self._unsure:  # the common case: no scan of the requests per step
            return True
        unsure = [act for act in self._active.values() if act.unsure is not None]
        if not unsure:  # released meanwhile
            self._unsure = False
            return True
        calls = []
        for act in unsure:
            assert act.unsure is not None
            calls.append((act.handle.item.request_id, act.handle.item.attempt, act.unsure.stamp))
        try:
            landed = self.store.landed(calls, self.worker_id)
        except redis.RedisError as exc:
            if self._publish_backoff.failed(now):
                logger.warning("publishing to redis failed (%s); retrying with backoff", exc)
            return False
        for act, ran in zip(unsure, landed, strict=True):
            was, act.unsure = act.unsure, None
            assert was is not None
            if ran:
                del act.unpublished[: was.deltas]
                self._settle(act, was.item, PublishStatus.OK, was.sent_at)
            else:
                act.log.unstage()  # its chunk goes out again, numbered the same
        self._unsure = False
        return True

    def _payload(self, act: Active) -> bytes:
        """The request's unpublished deltas, encoded; a request whose deltas cannot be
        encoded (an engine bug) ends with an error instead of failing the whole step."""
        if not act.unpublished:
            return b""
        try:
            return encode_deltas(act.unpublished)
        except Exception:
            logger.exception(
                "request %s: cannot encode its deltas; failing it", act.handle.item.request_id
            )
        act.unpublished = []
        self._fail_job(act, JOB_FAILURE_MESSAGE)
        return encode_deltas(act.unpublished)

    def _release(self, act: Active) -> None:
        item = act.handle.item
        first = act.first_token_at
        self._active.pop(item.request_id, None)
        for job in item.jobs:
            self._job_owner.pop(job.job_id, None)
        act.handle.result = GenerateResult(
            request_id=item.request_id,
            attempt=item.attempt,
            outcome=act.outcome,
            finish_reasons=dict(sorted(act.finishes.items())),
            completion_tokens=dict(sorted(act.tokens.items())),
            run_s=round(self.clock() - act.started, 4),
            prefill_s=None if first is None else round(first - act.started, 4),
            steps=act.steps,
        )
        act.handle.done.set()

    def _fail_all_jobs(self, message: str) -> None:
        for act in list(self._active.values()):
            self._fail_job(act, message)

    def _abandon_all(self, reason: str) -> None:
        """On shutdown: release waiting tasks; leases expire and streamers resume."""
        for act in list(self._active.values()):
            act.outcome = TaskOutcome.ABANDONED
            self._release(act)
        while True:
            try:
                h = self.inbox.get_nowait()
            except queue.Empty:
                break
            h.result = GenerateResult(
                request_id=h.item.request_id,
                attempt=h.item.attempt,
                outcome=TaskOutcome.ABANDONED,
                error=reason,
            )
            h.done.set()
