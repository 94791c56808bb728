"""``tokenrelay batcher``: runs batches (the OpenAI Batches API) through the generation path.

The web tier only stores files and batch objects (``broker.files``, ``broker.batches``);
this process does the work. One loop per process (several may run, on any host):

1. every half second: refresh the lock of each batch it drives (a batch whose lock was
   lost belongs to another driver now: drop it without touching its requests), notice
   cancels and expired completion windows, heartbeat, and take any batch on the work
   list whose lock is free (new batches, or those of a driver that died);
2. a newly taken batch is planned: every line of its input file is validated and built
   into a request up front (``app.batches.plan_batch`` + ``app.intake.Intake``, the
   HTTP routes' own intake); bad lines are recorded as failed; a file that is unusable
   as a whole fails the batch; otherwise it moves to ``in_progress``;
3. lines are submitted in order on the ``batch`` Celery queue (interactive requests go
   first), at most ``batch_max_in_flight`` of a batch at once. Line ``i`` of batch ``b``
   is request ``b-i``; its record and the batch's ``submitted`` counter are written in
   one transaction fenced by the lock;
4. every running line is a ``broker.run.Run`` followed by the process's one output hub
   (the reader the web tier uses); the loop waits on one event the hub sets for any of
   them; each line's events are folded (``app.fold.ResponseFold``) into the body the
   non-streaming endpoint would return, and its result is recorded exactly once (Lua:
   HSETNX + counter);
5. when every line has a result (or a cancel/expiry has wound the batch down), the output
   and error files are written and the batch ends: completed, cancelled or expired.

Recovery: everything is in Redis. A driver that takes a batch over plans it again (the
same lines give the same records), skips lines with a result, follows lines below
``submitted`` by reading their output streams from ``0-0`` (nothing is resubmitted, so
nothing generates twice), and submits the rest. Because results are write-once and
every write is fenced by the lock, a takeover neither loses nor duplicates a line.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import redis
from kombu.exceptions import OperationalError

from app.batches import (
    NOT_RUN_MESSAGES,
    BatchError,
    BatchErrors,
    BatchOutputLine,
    BatchStatus,
    PlannedLine,
    RejectedLine,
    failed_line,
    not_run_line,
    plan_batch,
    rejected_line,
    success_line,
)
from app.fold import ResponseFold
from app.intake import Endpoint, PreparedRequest, shape_of
from app.records import RequestRecord, RequestState
from app.responses_events import ResponsesFold
from app.settings import Settings
from broker import drive, tracing
from broker.batches import BatchBody, BatchStore, Transition
from broker.files import FileQuota, FileStore
from broker.registry import BatcherInfo, batcher_registry
from broker.runner import Runner
from workers.batch_state import (
    DrivenBatch,
    LineRun,
    LockLost,
    WakingEvent,
    line_request_id,
    write_result_files,
)
from workers.service_main import run_service

logger = logging.getLogger(__name__)

MAINTAIN_S = 0.5
HEARTBEAT_S = 2.0
READ_BLOCK_S = 0.1
# After a cancel or expiry, in-flight lines get this long to end (a cancelled request
# ends within an engine step; one still waiting in the Celery queue never reports).
WIND_DOWN_S = 10.0
# A batch that meets an unexpected error this many times on one driver fails,
# instead of being released, retaken and failing again every half second forever.
MAX_STRIKES = 3

Plan = list[PlannedLine[PreparedRequest] | RejectedLine]


class BatchDriver:
    def __init__(
        self,
        settings: Settings,
        runner: Runner,
        *,
        driver_id: str | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.settings = settings
        self.runner = runner
        client = runner.redis
        self.clock = clock
        self.driver_id = driver_id or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        keys = runner.keys
        self.batches = BatchStore(client, keys, ttl_s=settings.batch_ttl_s)
        self.files = FileStore(
            client,
            keys,
            ttl_s=settings.batch_file_ttl_s,
            quota=FileQuota(settings.key_max_files, settings.key_max_file_bytes),
        )
        self.requests = runner.store
        self.registry = batcher_registry(client, keys, ttl_s=5 * HEARTBEAT_S)
        self.output_ready = threading.Event()  # set by the hub for any line's output
        self.driven: dict[str, DrivenBatch] = {}
        self.stopping: threading.Event = WakingEvent(self.output_ready)
        self.started = clock()
        self._last_maintain = -MAINTAIN_S
        self._last_heartbeat = -HEARTBEAT_S
        self._last_refresh = 0.0
        self._maintained = 0.0  # monotonic end of the last ``maintain`` that got through
        self._strikes: dict[str, int] = {}

    # -- main loop ---------------------------------------------------------------------
    def run(self) -> None:
        """Drive batches until stopped. Redis going away pauses the loop (backoff
        0.1 s doubling to 2 s, one log line when it goes and one when it is back);
        nothing a batch or a line does ends it."""
        backoff = 0.0
        down_since: float | None = None
        while not self.stopping.is_set():
            try:
                self.iterate()
                # Back only once ``maintain`` got through: most iterations touch no
                # Redis at all (nothing to submit, the hub's queues are local).
                if down_since is not None and self._maintained > down_since:
                    logger.info("redis is back after %.1fs", time.monotonic() - down_since)
                    down_since, backoff = None, 0.0
            except (redis.RedisError, OperationalError) as exc:
                if down_since is None:
                    down_since = time.monotonic()
                    logger.warning("redis unavailable (%s); retrying with backoff", exc)
                backoff = min(max(backoff * 2, 0.1), 2.0)
                self.stopping.wait(backoff)
            except Exception:  # a bug outside any one batch: log it, keep serving
                logger.exception("unexpected error in the batch driver loop")
                self.stopping.wait(1.0)
        with contextlib.suppress(redis.RedisError):
            for bid in list(self.driven):
                self.batches.release(bid, self.driver_id)  # let another take over at once
            self.registry.unregister(self.driver_id)

    def iterate(self) -> None:
        # Intervals run on the monotonic clock; ``clock`` is the batches' time (created,
        # expires, timestamps), which tests move.
        now = time.monotonic()
        if now - self._last_maintain >= MAINTAIN_S:
            self._last_maintain = now
            self.maintain()
        for b in list(self.driven.values()):
            self._guarded(b, self._submit)
        # With no batch, nothing happens before the next ``maintain``: sleep until then
        # (two wake-ups a second, not ten, on the cores the engine computes on).
        idle = MAINTAIN_S - (time.monotonic() - self._last_maintain)
        self.read(block_s=READ_BLOCK_S if self.driven else max(idle, 0.0))

    def _guarded(self, b: DrivenBatch, step: Callable[[DrivenBatch], None]) -> None:
        """Run one step for one batch; a lost lock or a bug drops only that batch."""
        try:
            step(b)
        except LockLost:
            logger.warning("lost the lock of batch %s; another driver has it", b.id)
            self._drop(b.id)
        except (redis.RedisError, OperationalError):
            raise  # an outage: the loop waits it out; the batch stays ours
        except Exception:
            logger.exception("batch %s: unexpected error; releasing it", b.id)
            self._drop(b.id)
            if not self._strike(b.id):
                self.batches.release(b.id, self.driver_id)

    def _strike(self, bid: str) -> bool:
        """Count an unexpected error of ``bid``; at ``MAX_STRIKES`` fail the batch (a bug
        that recurs would otherwise loop: release, retake, fail). True when it failed."""
        strikes = self._strikes[bid] = self._strikes.get(bid, 0) + 1
        if strikes < MAX_STRIKES:
            return False
        del self._strikes[bid]
        message = "The batch stopped on an internal error; not every line was run."
        self.batches.transition(
            bid,
            BatchStatus.FAILED,
            self.clock(),
            allowed_from=[s for s in BatchStatus if not s.terminal],
            driver=self.driver_id,
            fields={
                "errors": BatchErrors(
                    data=[BatchError(code="internal_error", message=message)]
                ).model_dump_json()
            },
        )
        logger.error("batch %s failed after %d unexpected errors", bid, strikes)
        return True

    def _drop(self, bid: str) -> None:
        """Stop driving a batch: stop following its lines, end none of them (whoever
        drives it next follows them again)."""
        b = self.driven.pop(bid, None)
        if b is not None:
            for line in b.running.values():
                line.run.detach()

    # -- locks, cancels, expiry, new batches -----------------------------------------------
    def maintain(self) -> None:
        now = time.monotonic()
        ttl = self.settings.batch_lock_ttl_s
        for b in list(self.driven.values()):
            if not self.batches.refresh(b.id, self.driver_id, ttl):
                logger.warning("lost the lock of batch %s; another driver has it", b.id)
                self._drop(b.id)
                continue
            self._guarded(b, self._check)
        for bid in self.batches.active():
            if bid in self.driven:
                continue
            # Ours already when adopting it was cut short by an outage (the lock
            # outlived the attempt): take it up again now, not after the lock expires.
            if self.batches.acquire(bid, self.driver_id, ttl) or self.batches.refresh(
                bid, self.driver_id, ttl
            ):
                self._adopt(bid)
        if now - self._last_heartbeat >= HEARTBEAT_S:
            self._last_heartbeat = now
            self.registry.heartbeat(
                BatcherInfo(
                    batcher_id=self.driver_id,
                    hostname=socket.gethostname(),
                    pid=os.getpid(),
                    started=self.started,
                    batches=sorted(self.driven),
                )
            )
        self._maintained = time.monotonic()

    def _check(self, b: DrivenBatch) -> None:
        progress = self.batches.progress(b.id)
        if progress is None:  # the batch itself expired from Redis
            self._drop(b.id)
            self.batches.forget(b.id)
            return
        status, _submitted = progress
        now = self.clock()
        if b.ending is None:
            if status is BatchStatus.CANCELLING:
                self._wind_down(b, "batch_cancelled")
            elif now >= b.body.expires_at:
                self._wind_down(b, "batch_expired")
            elif not b.pending and not b.running:
                self._finalize(b)
        waited = time.monotonic() - b.wind_down_since
        if b.ending is not None and (not b.running or waited > WIND_DOWN_S):
            self._finalize(b)

    def _wind_down(self, b: DrivenBatch, ending: str) -> None:
        """Stop submitting and cancel what runs; lines that still finish are kept."""
        logger.info("batch %s: %s; cancelling %d running lines", b.id, ending, len(b.running))
        b.ending = ending
        b.wind_down_since = time.monotonic()
        b.pending.clear()
        for rid in b.running:
            self.runner.cancel(rid)

    # -- taking a batch ----------------------------------------------------------------------
    def _adopt(self, bid: str) -> None:
        batch = self.batches.get(bid)
        if batch is None or batch.status.terminal:
            self.batches.forget(bid)
            self.batches.release(bid, self.driver_id)
            return
        body = BatchBody(
            id=batch.id,
            endpoint=batch.endpoint,
            input_file_id=batch.input_file_id,
            completion_window=batch.completion_window,
            created_at=batch.created_at,
            expires_at=batch.expires_at or batch.created_at,
            metadata=batch.metadata,
        )
        b = DrivenBatch(body)
        self.driven[bid] = b
        logger.info("driving batch %s (status %s)", bid, batch.status.value)
        try:
            self._guarded(b, lambda b: self._plan(b, batch.status))
        except (redis.RedisError, OperationalError):
            # A plan cut short would look like a batch with nothing left to run (and
            # be finalized with lines missing): forget it; the next ``maintain``
            # adopts it again from what Redis holds.
            self._drop(bid)
            raise

    def _plan(self, b: DrivenBatch, status: BatchStatus) -> None:
        now = self.clock()
        content = self.files.content(b.body.input_file_id)
        if content is None:
            self._fail(b, "missing_file", "The input file no longer exists.")
            return
        plan = plan_batch(
            content,
            endpoint=b.body.endpoint,
            build=self._builder(b.body.endpoint, self.batches.owner(b.id)),
            max_line_bytes=self.settings.max_body_bytes,
            max_requests=self.settings.batch_max_requests,
        )
        if plan.errors:
            self._fail(b, errors=BatchErrors(data=plan.errors[:100]))
            return
        b.total = plan.total
        for line in plan.lines:
            if isinstance(line, RejectedLine):
                rid = line_request_id(b.id, line.index)
                self._record(b, line.index, rejected_line(line.custom_id, line.error, rid))
        if status is BatchStatus.VALIDATING:
            done = self.batches.transition(
                b.id,
                BatchStatus.IN_PROGRESS,
                now,
                allowed_from=(BatchStatus.VALIDATING,),
                driver=self.driver_id,
                fields={"total": plan.total},
            )
            if done is Transition.NOT_LOCKED:
                raise LockLost
        progress = self.batches.progress(b.id)
        if progress is None:
            raise LockLost
        status, submitted = progress
        recorded = self.batches.recorded(b.id)
        following = []
        for line in plan.lines:
            if isinstance(line, RejectedLine):
                continue
            b.custom_ids[line.index] = line.custom_id
            if line.index in recorded:
                continue
            if line.index < submitted:
                following.append(line)
            else:
                b.pending.append(line)
        self._follow(b, following)
        if status is BatchStatus.CANCELLING:
            self._wind_down(b, "batch_cancelled")
        elif status is BatchStatus.FINALIZING:
            b.ending = self.batches.ending(b.id)
            b.pending.clear()
            self._finalize(b)

    def _builder(self, endpoint: str, owner: str) -> Callable[[dict[str, Any]], PreparedRequest]:
        """Each line's request, made for the key that created the batch (``owner``):
        its usage, its prefix-cache scope and who may read its output are that key's."""
        target = Endpoint(endpoint)

        def build(body: dict[str, Any]) -> PreparedRequest:
            self._keep_locks()  # planning a big file takes longer than a lock lives
            return self.runner.prepare(target, body, queue="batch", stream=False, owner=owner)

        return build

    def _keep_locks(self) -> None:
        """Refresh every lock now and then during long work (a lock found lost here is
        dropped by the next ``maintain``)."""
        now = time.monotonic()
        if now - self._last_refresh < MAINTAIN_S:
            return
        self._last_refresh = now
        for bid in list(self.driven):
            self.batches.refresh(bid, self.driver_id, self.settings.batch_lock_ttl_s)

    def _follow(self, b: DrivenBatch, lines: list[PlannedLine[PreparedRequest]]) -> None:
        """Resume lines a previous driver submitted: read their output from the start."""
        for line in lines:
            rid = line_request_id(b.id, line.index)
            if self.runner.outputs.lost(rid):  # record and output expired: it failed
                msg = "The request expired before its result was collected."
                self._record(b, line.index, failed_line(line.custom_id, rid, msg, 504))
                continue
            prepared = self._for_line(line.request, rid)
            span = None
            if tracing.tracer() is not None and (loaded := self.requests.load(rid)):
                # The same trace as the line's first driver's (its record carries it).
                span = self._line_trace(b, line, resumed_from=loaded[0].trace)
            b.running[rid] = self._line_run(line, prepared, span)
        if lines:
            logger.info("batch %s: following %d lines already submitted", b.id, len(b.running))

    def _for_line(self, prepared: PreparedRequest, rid: str) -> PreparedRequest:
        """Line ``rid``'s request: its deterministic id, created now."""
        now = self.clock()
        record = prepared.record.model_copy(
            update={
                "request_id": rid,
                "created": now,
                "deadline": now + self.settings.request_timeout_s,
            }
        )
        return replace(prepared, record=record, shape=shape_of(record))

    def _line_trace(
        self, b: DrivenBatch, line: PlannedLine[PreparedRequest], **resumed: Any
    ) -> tracing.RequestTrace | None:
        return tracing.batch_line_trace(
            b.body.endpoint, b.id, line.index, line.custom_id, **resumed
        )

    def _line_run(
        self,
        line: PlannedLine[PreparedRequest],
        prepared: PreparedRequest,
        span: tracing.RequestTrace | None = None,
    ) -> LineRun:
        fold: ResponseFold | ResponsesFold = ResponseFold.for_shape(prepared.shape)
        if prepared.responses is not None:  # a /v1/responses line: a response object
            fold = ResponsesFold(prepared.responses, prepared.record)
        if span is not None:
            span.describe(prepared.record)
        run = self.runner.follow(prepared, notify=self.output_ready, trace=span)
        return LineRun(line.index, line.custom_id, run, fold)

    # -- running lines ---------------------------------------------------------------------
    def _submit(self, b: DrivenBatch) -> None:
        if b.ending is not None:
            return
        most = self.settings.batch_max_in_flight
        while b.pending and len(b.running) < most:
            line = b.pending[0]
            rid = line_request_id(b.id, line.index)
            prepared = self._for_line(line.request, rid)
            span = self._line_trace(b, line)  # its trace travels in its record
            prepared = tracing.traced(prepared, span) if span is not None else prepared
            record = prepared.record
            if not self.batches.submit_line(
                b.id, self.driver_id, line.index, record, self.requests
            ):
                if not self.batches.refresh(b.id, self.driver_id, self.settings.batch_lock_ttl_s):
                    raise LockLost
                state = self.requests.state(rid)
                if state is None:
                    return  # a concurrent write touched a watched key: retry next loop
                # Already written (by us before an outage cut the send short): follow
                # it; send its task again while it is still queued (a duplicate is
                # harmless: only one worker can claim an attempt).
                if state == (RequestState.QUEUED, 0):
                    self._send(record)
            else:
                self._send(record)
            b.pending.popleft()
            b.running[rid] = self._line_run(line, prepared, span)

    def _send(self, record: RequestRecord) -> None:
        """Queue the line's ``generate`` task. When Redis is away kombu raises its own
        ``OperationalError``: ``_guarded`` passes it to the loop as an outage (not a bug
        of this batch), and the next ``_submit`` finds the line written and sends it."""
        self.runner.store.send(record, self.runner.celery)

    def read(self, block_s: float) -> None:
        """Fold what every running line's run has; wait for the hub when nothing had."""
        self.output_ready.clear()
        progressed = False
        for b in list(self.driven.values()):
            for run in list(b.running.values()):
                progressed = drive.drain(run.run, run.fold.feed) or progressed
                if run.fold.done and b.id in self.driven:
                    self._guarded(b, lambda b, run=run: self._complete(b, run))  # type: ignore[misc]
        if not progressed and not self.stopping.is_set():  # a stop sets output_ready
            self.output_ready.wait(block_s)

    def _complete(self, b: DrivenBatch, run: LineRun) -> None:
        fold = run.fold
        if fold.failure is not None:
            line = failed_line(
                run.custom_id, run.request_id, fold.failure.message, fold.failure.status
            )
        elif fold.aborted and b.ending is not None:
            line = not_run_line(run.custom_id, b.ending, NOT_RUN_MESSAGES[b.ending])
        elif fold.aborted:
            line = failed_line(run.custom_id, run.request_id, "The request was cancelled.", 500)
        else:
            line = success_line(run.custom_id, run.request_id, fold.response().to_dict())
        self._record(b, run.index, line)
        b.running.pop(run.request_id, None)
        run.run.close()

    def _record(self, b: DrivenBatch, index: int, line: BatchOutputLine) -> None:
        if line.ok:
            counter = "completed"
        elif line.response is None:
            counter = ""  # not run: listed in the error file, counted in neither
        else:
            counter = "failed"
        if self.batches.record(b.id, self.driver_id, index, line, counter) < 0:
            raise LockLost

    # -- ending ------------------------------------------------------------------------------
    def _fail(
        self,
        b: DrivenBatch,
        code: str = "",
        message: str = "",
        *,
        errors: BatchErrors | None = None,
    ) -> None:
        errors = errors or BatchErrors(data=[BatchError(code=code, message=message)])
        logger.info("batch %s failed validation: %s", b.id, errors.data[0].message)
        done = self.batches.transition(
            b.id,
            BatchStatus.FAILED,
            self.clock(),
            allowed_from=(BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS, BatchStatus.CANCELLING),
            driver=self.driver_id,
            fields={"errors": errors.model_dump_json()},
        )
        self._drop(b.id)
        if done is Transition.NOT_LOCKED:
            raise LockLost

    def _finalize(self, b: DrivenBatch) -> None:
        """Write the output and error files and end the batch."""
        now = self.clock()
        if b.ending != "batch_cancelled" and not self._enter_finalizing(b, now):
            return
        if b.ending is not None:
            self._record_not_run(b)
        # ``total`` again: a batch cancelled while validating never went in_progress.
        fields = {**write_result_files(self.batches, self.files, b.id, now), "total": b.total}
        final, previous = {
            None: (BatchStatus.COMPLETED, BatchStatus.FINALIZING),
            "batch_expired": (BatchStatus.EXPIRED, BatchStatus.FINALIZING),
            "batch_cancelled": (BatchStatus.CANCELLED, BatchStatus.CANCELLING),
        }[b.ending]
        done = self.batches.transition(
            b.id, final, now, allowed_from=(previous,), driver=self.driver_id, fields=fields
        )
        if done is Transition.NOT_LOCKED:
            raise LockLost
        logger.info("batch %s %s", b.id, final.value)
        for line in b.running.values():  # wound down: what still runs is cancelled
            line.run.close()
        b.running.clear()
        self._drop(b.id)

    def _enter_finalizing(self, b: DrivenBatch, now: float) -> bool:
        """Move to ``finalizing``; False when a client's cancel came first (the batch
        then winds down as cancelled)."""
        done = self.batches.transition(
            b.id,
            BatchStatus.FINALIZING,
            now,
            allowed_from=(BatchStatus.IN_PROGRESS, BatchStatus.FINALIZING),
            driver=self.driver_id,
            fields={"ending": b.ending or ""},
        )
        if done is Transition.NOT_LOCKED:
            raise LockLost
        if done is Transition.DONE:
            return True
        if b.ending is None:
            self._wind_down(b, "batch_cancelled")
        else:
            b.ending = "batch_cancelled"
        return False

    def _record_not_run(self, b: DrivenBatch) -> None:
        """Lines a cancel or expiry left without a result go to the error file."""
        assert b.ending is not None
        recorded = self.batches.recorded(b.id)
        for index, custom_id in b.custom_ids.items():
            if index not in recorded:
                self._record(
                    b, index, not_run_line(custom_id, b.ending, NOT_RUN_MESSAGES[b.ending])
                )


def build_driver(settings: Settings) -> BatchDriver:
    return BatchDriver(settings, Runner(settings, max_connections=16))


def main(argv: list[str] | None = None) -> int:
    return run_service("batcher", __doc__.split("\n")[0], build_driver, argv)


if __name__ == "__main__":
    sys.exit(main())
