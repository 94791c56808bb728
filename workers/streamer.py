"""``tokenrelay streamer``: token ids in, text events out, for many requests at once.

One loop per process (several processes may run):

1. claim new requests from the hand-off consumer group (woken by a plain XREAD on the
   hand-off stream, so a new request waits for no timeout);
2. read what every request it holds got in ONE blocking XREAD: a request's own token
   stream until its first entry names its worker, then that worker's step stream (one
   entry per engine step for all its requests), back to its own stream after a gap;
3. run each request's choice Decoders and append the resulting events to each
   request's output stream in ONE pipelined round trip (deltas coalesced per cycle,
   each entry carrying the ordinal of the last token chunk it was decoded from; this
   step is ``workers.streamer_relay.Relay``, which ``Streamer`` extends);
4. when every choice has ended, append usage, cancel the request upstream if it
   stopped locally (stop string / stop token), and acknowledge the hand-off entry;
5. every half second, the watchdog: resume requests whose worker lost its lease,
   resend requests left queued, fail requests past their deadline or with no worker,
   touch its own hand-off entries (liveness) and take over those of dead streamers.

The loop survives its backbone and its inputs:

- Redis unreachable (restart, failover): every round trip error pauses the loop with a
  growing backoff (one warning per outage) and the loop goes on where it was. When Redis
  is back it recreates the hand-off group if Redis lost it (a restart without
  persistence), heart-beats at once, and resends every request still queued (a worker
  may have dropped its Celery message with the old connection). A request whose record
  is gone ends with a 503 error event.
- One bad request is one bad request: a decoder fault ends that choice with
  ``finish_reason: "error"`` (as Dynamo's ``backend.rs``); a malformed token entry, an
  invalid choice index or any other fault while handling a request ends that request
  with an error event. The loop keeps serving every other request.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any, Unpack

import redis
from celery import Celery
from tokenizers import Tokenizer

from app.decoder import RequestDecoder
from app.errors import ModelError, NotFound
from app.messages import EngineFinish, OutputEvent, OutputKind
from app.model_card import load_model_card, load_tokenizer
from app.records import RequestRecord, RequestState
from app.settings import Settings
from broker.celery_app import create_celery, send_generate
from broker.chunks import ChunkLog, entry_ordinal, phase_of
from broker.connection import as_str, open_redis
from broker.direct import read_rest, xread_command
from broker.fair_queue import send_again
from broker.models import ModelCards, catalog_of, settings_directory
from broker.outputs import OutputEntry
from broker.publish import decode_deltas
from broker.registry import StreamerInfo, streamer_registry, worker_registry
from broker.requests import RequestStatus
from broker.step_lines import below_ms, step_entry_columns
from workers.backoff import Backoff
from workers.service_main import run_service
from workers.streamer_relay import Relay, RelayOptions
from workers.streamer_shards import ShardedStreamer
from workers.streamer_state import (
    BACKBONE_ERRORS,
    DEADLINE_MESSAGE,
    EXPIRED_MESSAGE,
    LOST_MESSAGE,
    REQUEST_FAULT,
    LiveModels,
    Tracked,
)

logger = logging.getLogger(__name__)

WATCHDOG_S = 0.5
HEARTBEAT_S = 2.0
# The loop's blocking read lasts until the watchdog is due (at most this long, at least
# 1 ms: BLOCK 0 would wait for ever). A fixed short block woke an idle streamer 20 times
# a second, and at an engine step rate close to it (llama.cpp at 8 streams here: a step
# every ~47 ms against a 50 ms block) it timed out between steps, an empty cycle per step.
READ_BLOCK_MAX_MS = int(WATCHDOG_S * 1000)
CLAIM_BATCH = 64  # new requests claimed per round trip
READ_COUNT = 512  # token entries per stream per read
# A request read through a worker's step stream that has had nothing for this long
# reads its own token stream again (it may have moved to another worker).
STEP_QUIET_S = 1.0


class Streamer(Relay):
    """The streamer process's loop: claims, reads, takeovers and the watchdog; the
    decoding and writing of outputs is ``Relay``'s (``workers.streamer_relay``)."""

    def __init__(
        self,
        settings: Settings,
        client: redis.Redis,
        tokenizer: Tokenizer,
        celery_app: Celery,
        **options: Unpack[RelayOptions],
    ) -> None:
        super().__init__(settings, client, tokenizer, celery_app, **options)
        self.workers = worker_registry(client, self.keys)
        self.registry = streamer_registry(client, self.keys, ttl_s=5 * HEARTBEAT_S)
        self._handoff_cursor = "0-0"
        self._last_watchdog = 0.0
        self._last_heartbeat = 0.0
        # Touch our hand-off entries well within the takeover time: at a period close to
        # it, a live streamer's entries look idle to the others between two touches and
        # requests ping-pong between live streamers (each hand-off redoes the replay).
        self._heartbeat_s = min(HEARTBEAT_S, settings.streamer_takeover_s / 4)
        self._set_up = False  # hand-off group ensured since the last outage
        self._resend_queued = False  # after an outage: resend queued requests at once
        self._take_over_from = 0.0  # no takeovers before (set after an outage)
        # Ask the group for new requests only when the wake-up read saw one (or the
        # watchdog says so): one round trip less per cycle while requests stream.
        self._claim_due = True
        self._outage = Backoff(initial_s=0.1, max_s=1.0)
        self._faults = Backoff(initial_s=0.1, max_s=2.0)
        self.started = self.clock()
        self.stopping = threading.Event()

    # -- main loop ---------------------------------------------------------------------
    def run(self) -> None:
        logger.info("streamer %s serving", self.consumer)
        while not self.stopping.is_set():
            try:
                if not self._set_up:
                    self._set_up_loop()
                self.iterate()
            except BACKBONE_ERRORS as exc:
                self._on_backbone_error(exc)
                continue
            except Exception:  # a bug outside any one request: log, pause, go on
                logger.exception("streamer loop iteration failed")
                self._faults.failed(time.monotonic())
                self.stopping.wait(self._faults.delay_s)
                continue
            self._faults.recovered()
            if self._outage.recovered():
                logger.info("redis is reachable again; streamer %s resumes", self.consumer)
        with contextlib.suppress(*BACKBONE_ERRORS):
            self._flush()  # the last cycle's outputs: its next read never came
            # A drain: the other streamers take our requests over at their next look,
            # not a takeover time from now (they replay each one's tokens to where its
            # output stands, so nothing is repeated or lost).
            idle_ms = int(self.settings.streamer_takeover_s * 1000) * 2 + 1000
            self.handoff.release(
                self.consumer, [t.entry_id for t in self.tracked.values()], idle_ms
            )
            self.registry.unregister(self.consumer)

    def _set_up_loop(self) -> None:
        """At start and after an outage: the hand-off group (Redis may have lost it),
        the wake-up cursor, and a heartbeat before anything else.

        After an outage every streamer's hand-off entries look idle for as long as Redis
        was away; taking any over before their owners are back to touch them would have
        two streamers decode one request. So takeovers wait one takeover period."""
        self.handoff.ensure_group()
        self._flush()  # what the outage interrupted comes first
        self._handoff_cursor = self.handoff.last_id()
        self._claim_due = True  # entries before the new cursor wake no one
        if self._resend_queued:  # set by an outage
            self._take_over_from = self.clock() + self.settings.streamer_takeover_s
        self._set_up = True
        self._watchdog(force=True)

    def _on_backbone_error(self, exc: Exception) -> None:
        self._set_up = False
        self._resend_queued = True
        if isinstance(exc, redis.ResponseError) and "NOGROUP" in str(exc):
            # Redis came back without its data: recreate the group now, no pause.
            logger.warning("the hand-off group is gone (Redis lost its data?); recreating it")
            return
        if self._outage.failed(time.monotonic()):
            logger.warning("redis unreachable (%s); reconnecting with backoff", exc)
        self.stopping.wait(self._outage.delay_s)

    def iterate(self) -> None:
        """One cycle. The outputs a cycle decodes are written by the next cycle's read
        round trip (``_read_and_decode``), unless something else must talk to Redis
        first: then they are flushed before it, so outputs never wait behind it."""
        if self._claim_due:
            self._flush()
            claimed = self.handoff.claim_new(self.consumer, count=CLAIM_BATCH)
            self._claim_due = len(claimed) >= CLAIM_BATCH  # more may be waiting
            self._adopt_all(claimed)
        self._read_and_decode()
        now = self.clock()
        if now - self._last_watchdog >= WATCHDOG_S:
            self._flush()
            self._watchdog()

    def _read_and_decode(self) -> None:
        streams: dict[str, str] = {self.keys.new_requests: self._handoff_cursor}
        # Token stream key (bytes, as replies hold it) -> its request.
        by_key: dict[bytes, Tracked] = {}
        steps: dict[str, str] = {}
        prefix = self.keys.tokens_prefix()  # once per request per cycle: no method call each
        for rid, t in self.tracked.items():
            key = prefix + rid
            by_key[key.encode()] = t
            if t.step is None or t.watch:
                streams[key] = t.cursor
            if t.step is not None:
                steps[t.step] = self._step_cursors.get(t.step) or below_ms(t.cursor)
        self._step_cursors = steps  # the step streams no request needs are dropped
        streams.update(steps)
        res = read_rest(
            self.direct,
            streams,
            self._write_and_read(streams),
            count=READ_COUNT,
            quiet=(self.keys.new_requests,),
        )
        if self.clock() - self._last_heartbeat > self.settings.streamer_takeover_s / 2:
            # We were stalled (a pause, a slow round trip): another streamer may own
            # some of these requests now, and writing them too would repeat text.
            self._drop_taken_over()
        # request id -> its new token entries and step lines (id None), in order
        got: dict[str, list[Any]] = {}
        ends: dict[str, int] = {}  # request id -> the last chunk's ordinal in got
        read_steps: list[tuple[str, list[Any]]] = []
        for key_raw, entries in res or []:
            key = as_str(key_raw)
            if key == self.keys.new_requests:
                self._handoff_cursor = as_str(entries[-1][0])
                self._claim_due = True
                continue
            if key in steps:
                read_steps.append((key, entries))
                continue
            owner = by_key.get(key_raw if isinstance(key_raw, bytes) else key.encode())
            if owner is None or not entries:
                continue
            rid = owner.record.request_id
            got[rid] = entries
            ends[rid] = max(owner.n, entry_ordinal(entries[-1][1]))
        for key, entries in read_steps:  # after the requests' own streams (their gaps)
            self._take_steps(key, entries, by_key, got, ends)
        c = self._decode_all(got)
        if c.outputs:
            self._restage_due(c.outputs)
        if c.outputs or c.ended or c.failed or c.cancels:
            # Written by the next read's round trip, or by whatever talks to Redis first.
            self._append_commit(c)

    def _take_steps(
        self,
        key: str,
        entries: list[Any],
        by_key: dict[bytes, Tracked],
        got: dict[str, list[Any]],
        ends: dict[str, int],
    ) -> None:
        """Entries of worker step stream ``key``: each holds the chunks one publish
        wrote, a line each. One is taken for a request we hold when it is the request's
        next chunk (its ordinal says so); one we have is skipped; after a gap (the step
        stream was trimmed past us) the request reads its own token stream as well,
        where a checkpoint holds what it missed (broker/chunks.py)."""
        self._step_cursors[key] = as_str(entries[-1][0])
        for published, (tok_keys, ordinals, payloads) in step_entry_columns(key, entries):
            for tok_key, n, payload in zip(tok_keys, ordinals, payloads, strict=True):
                t = by_key.get(tok_key)
                if t is None:
                    continue
                rid = t.record.request_id
                last = ends.get(rid, t.n)
                if n <= last:
                    continue  # read already (from its own stream, or an earlier step)
                if n != last + 1:
                    t.watch = True
                    continue
                got.setdefault(rid, []).append((None, (n, payload, published)))
                ends[rid] = n
                t.step = key

    def _write_and_read(self, streams: dict[str, str]) -> Any:
        """The blocking read of ``streams``, carrying the last cycle's output write when
        that is all there is to write (one round trip per cycle while requests stream).
        Anything older (a write that failed and is being retried) is flushed first."""
        fresh = self._commits[-1] if self._commits else None
        if fresh is None or len(self._commits) > 1 or fresh.tries or not fresh.outputs:
            self._flush()
            read = xread_command(streams, count=READ_COUNT, block_ms=self._block_ms())
            return self.direct.call(*read)
        fresh.tries = 1
        res = self.outputs.write_then_read(
            fresh.outputs,
            self.consumer,
            streams,
            count=READ_COUNT,
            block_ms=self._block_ms(),
            on_written=lambda taken: self._mark_written(fresh, taken),
            via=self.direct,
            stamp=fresh.stamp,
        )
        self._flush()  # ends what the write ended (no write left to do)
        return res

    def _block_ms(self) -> int:
        """How long the next read may block: until the watchdog is due."""
        due_s = self._last_watchdog + WATCHDOG_S - self.clock()
        return max(1, min(int(due_s * 1000), READ_BLOCK_MAX_MS))

    # -- adopting requests (new or taken over) ---------------------------------------------
    def _adopt_all(self, claimed: Sequence[tuple[str, str]]) -> None:
        """Adopt ``claimed`` (hand-off entry id, request id) with their records and the
        ends of their outputs read in one round trip for them all: a burst of new
        requests is adopted without two round trips each, one after the other, which
        on a busy machine each cost a wait for the CPU before the next."""
        if not claimed:
            return
        pipe = self.redis.pipeline(transaction=False)
        for _entry_id, rid in claimed:
            self.store.queue_load(pipe, rid)
            pipe.exists(self.keys.output(rid))
        # A reply error (a key of the wrong type) fails its request alone, in _adopt.
        replies = pipe.execute(raise_on_error=False)
        seals: list[OutputEntry] = []
        for i, (entry_id, rid) in enumerate(claimed):
            seal = self._adopt(entry_id, rid, (replies[2 * i], replies[2 * i + 1]))
            if seal is not None:
                seals.append(seal)
        if seals:
            self._commit(seals)

    def _adopt(self, entry_id: str, rid: str, read: tuple[Any, Any]) -> OutputEntry | None:
        """``read``: the replies of ``queue_load`` and an EXISTS of its output stream.
        Returns the checkpoint that seals the output chunks its last streamer wrote
        after its last checkpoint, if any, for the caller to write."""
        try:
            return self._adopt_or_raise(entry_id, rid, read)
        except BACKBONE_ERRORS:
            raise
        except Exception as exc:
            # e.g. a record or output entry that does not decode, or a model whose
            # tokenizer cannot be loaded here: end it for its client.
            logger.exception("request %s: cannot adopt it; ending it with an error", rid)
            self.tracked.pop(rid, None)
            message, code = (str(exc), 503) if isinstance(exc, ModelError) else (REQUEST_FAULT, 500)
            error = OutputEvent(OutputKind.ERROR, error=message, code=code)
            count = self._unadoptable_count(read[0])  # counted in the usage ledger
            self._commit([OutputEntry(rid, [error], "0", first=True, usage=count)])
            self.store.cancel(rid)
            self.handoff.ack(entry_id)
            return None

    def tokenizer_for(self, record: RequestRecord) -> Tokenizer:
        """The tokenizer of the request's model: this process's own, or another served
        model's (``ModelError`` when its card cannot be read here)."""
        if record.model == self.settings.served_name or self.cards is None:
            return self.tokenizer
        try:
            return self.cards.tokenizer(record.model)
        except ModelError as exc:
            raise ModelError(f"The model '{record.model}' cannot be decoded here: {exc}") from exc
        except NotFound as exc:
            raise ModelError(f"The model '{record.model}' is not registered here.") from exc

    def _adopt_or_raise(self, entry_id: str, rid: str, read: tuple[Any, Any]) -> OutputEntry | None:
        raw_record, written = read
        for reply in read:
            if isinstance(reply, Exception):
                raise reply
        loaded = self.store.loaded(raw_record)
        if loaded is None:
            self.handoff.ack(entry_id)  # expired before anyone decoded it
            return None
        record, _state, _attempt = loaded
        t = Tracked(entry_id, record, RequestDecoder.for_record(self.tokenizer_for(record), record))
        t.out.phase = phase_of(rid)
        seal = None
        if written:
            out = self.outputs.read_log(rid)
            if out.ended:
                self.handoff.ack(entry_id)
                return None
            source = out.source or "0"
            # Taking over: replay silently up to what is already written.
            log = self.store.read_log(rid)
            for c in log.chunks:
                if c.n > int(source):
                    break
                self._apply(t, decode_deltas(c.payload))
                t.n = c.n
                if c.entry is not None:
                    t.cursor = c.entry
            if log.steps is not None:  # the rest: from the tail's step stream on
                self._follow_step(t, log.steps, log.sid)
                t.watch = True  # and its token stream (a new attempt starts there)
            # Its output chunks go on from the last written, and those after the last
            # checkpoint (only in the old streamer's step stream, which may go on being
            # trimmed) are checkpointed under this one's name at once.
            t.out = ChunkLog.following(out.recorded, [(n, ev) for n, _s, ev in out.tail])
            t.out_source = source
            if out.tail:
                seal = t.restaged(self._writes)
                t.mark_next = False
            t.wrote_output = True
            t.took_over = True
            logger.info("took over request %s at token chunk %s", rid, source)
        self.tracked[rid] = t
        return seal

    # -- watchdog --------------------------------------------------------------------------
    def _watchdog(self, force: bool = False) -> None:
        now = self.clock()
        self._last_watchdog = now
        self._claim_due = True  # a safety net: a wake-up read can miss an entry
        if force or now - self._last_heartbeat >= self._heartbeat_s:
            self._last_heartbeat = now
            self._heartbeat_and_take_over()
        if self.tracked:
            self._check_requests(now)

    def _heartbeat_and_take_over(self) -> None:
        """Say we are alive (registry + our pending hand-off entries); adopt the requests
        of streamers that stopped saying so."""
        self.registry.heartbeat(
            StreamerInfo(
                streamer_id=self.consumer,
                hostname=socket.gethostname(),
                pid=os.getpid(),
                started=self.started,
                active_requests=len(self.tracked),
            )
        )
        self._drop_taken_over()
        self.handoff.touch(self.consumer, [t.entry_id for t in self.tracked.values()])
        self.usage.flush()
        if self.clock() < self._take_over_from:
            return  # just back from an outage: the others have not touched theirs yet
        min_idle = int(self.settings.streamer_takeover_s * 1000)
        taken: dict[str, str] = {}  # rid -> its first hand-off entry not ours yet
        for entry_id, rid in self.handoff.take_over(self.consumer, min_idle):
            if rid not in self.tracked:
                taken.setdefault(rid, entry_id)
        self._adopt_all([(entry_id, rid) for rid, entry_id in taken.items()])

    def _drop_taken_over(self) -> None:
        """Stop decoding requests another streamer took over (we were silent too long,
        e.g. stalled): two streamers writing one output stream would repeat text."""
        owners, epoch = self.handoff.owners([t.entry_id for t in self.tracked.values()])
        dropped = set()
        for rid, t in list(self.tracked.items()):
            owner = owners.get(t.entry_id)
            if owner is not None and owner != self.consumer:
                logger.warning("request %s was taken over by streamer %s; dropping it", rid, owner)
                del self.tracked[rid]
                dropped.add(rid)
        for c in self._commits:  # decoded, not written yet: no longer ours to write
            if not c.written:
                c.drop(dropped)
        # Every entry we keep is ours under this epoch: our writes need not check each
        # one's owner again while it lasts (a takeover changes it first).
        self.outputs.fence_epoch = epoch

    def _check_requests(self, now: float) -> None:
        """Every tracked request's state, read in one round trip, then acted on."""
        rids = list(self.tracked)
        statuses = self.store.statuses(rids)
        live = LiveModels(self.workers)
        for rid, status in zip(rids, statuses, strict=True):
            t = self.tracked.get(rid)
            if t is None:  # ended meanwhile
                continue
            if t.step is not None and now - t.progress_at > STEP_QUIET_S:
                # A safety net: the request may have moved to a worker whose step
                # stream we do not read (its own token stream says which).
                t.watch = True
            try:
                ending = self._check(t, status, now, live)
            except BACKBONE_ERRORS:
                raise
            except Exception:
                logger.exception("request %s: watchdog failed on it; ending it", rid)
                self.store.cancel(rid)
                ending = self._fail(t, REQUEST_FAULT, 500)
            if ending is not None:  # committed at once: its decoders have moved on
                self._commit([ending] if ending.events else [], failed=[t])
        self._resend_queued = False

    def _check(
        self, t: Tracked, status: RequestStatus | None, now: float, live: LiveModels
    ) -> OutputEntry | None:
        """One request's watchdog step; an output entry when it ends here."""
        rid = t.record.request_id
        if status is None:
            # Gone before its time: Redis lost it (a restart without persistence).
            lost = now < t.record.created + self.settings.stream_ttl_s
            return self._fail(t, LOST_MESSAGE, 503) if lost else self._fail(t, EXPIRED_MESSAGE, 504)
        if status.claimed is not None and t.claimed_by_worker is None:
            t.claimed_by_worker = status.claimed
        if now > t.record.deadline:
            self.store.cancel(rid)
            return self._fail(t, DEADLINE_MESSAGE, 504)
        if status.state is RequestState.RUNNING:
            t.queued_since = None
            return None if status.lease_alive else self._resume(t)
        if status.state is RequestState.QUEUED:
            return self._check_queued(t, status.attempt, now, live)
        return self._finish_done(t)

    def _check_queued(
        self, t: Tracked, attempt: int, now: float, live: LiveModels
    ) -> OutputEntry | None:
        """Fail a request no worker can serve; resend one left queued too long."""
        t.queued_since = t.queued_since or now
        model = t.record.model
        if model in live.models():
            t.no_worker_since = None
        else:
            t.no_worker_since = t.no_worker_since or now
            # A model scaled to zero gets model_wait_s for its first worker to start.
            patience = max(self.settings.no_worker_timeout_s, self.settings.model_wait_s)
            if now - t.no_worker_since > patience:
                return self._fail(t, f"No worker is serving model {model!r}.", 503)
        waited = now - max(t.queued_since, t.last_sent)
        routed_to_the_dead = bool(t.route) and t.route not in live.ids()
        if routed_to_the_dead:
            # It waits in the own queue of a worker that is gone: any worker will do.
            logger.info(
                "request %s: its worker %s is gone; sending it to any", t.record.request_id, t.route
            )
            t.route = ""
        if routed_to_the_dead or self._resend_queued or waited > self.settings.requeue_after_s:
            t.last_sent = now
            send_again(self.celery, self.fair, t.record, attempt)
        return None

    def _resume(self, t: Tracked) -> OutputEntry | None:
        rid = t.record.request_id
        attempt = self.store.resume(rid)
        if attempt is None:
            return None
        if attempt >= self.settings.max_attempts:
            self.store.cancel(rid)
            return self._fail(t, f"The request lost its worker {attempt} times; giving up.", 503)
        logger.warning("request %s lost its worker; resuming as attempt %d", rid, attempt)
        t.step = None  # the next worker publishes to a step stream of its own
        t.last_sent = self.clock()
        rec = t.record
        send_generate(self.celery, rid, attempt, queue=rec.queue, model=rec.model, trace=rec.trace)
        return None

    def _finish_done(self, t: Tracked) -> OutputEntry:
        """The worker side is done; drain what is left and close open choices."""
        rid = t.record.request_id
        events: list[OutputEvent] = []
        for c in self.store.read_chunks(rid, after=t.n):
            events += self._apply(t, decode_deltas(c.payload))
            t.n = c.n
        if not t.choices.all_done:
            # e.g. cancelled before any worker started it: nothing was generated.
            events += t.choices.finish_all(EngineFinish.CANCELLED)
        events.append(self._usage_event(t))
        return self._output(t, events, first=not t.wrote_output, terminal=True)


def build_streamer(settings: Settings) -> Streamer | ShardedStreamer:
    card = load_model_card(settings.card_path())
    tokenizer = load_tokenizer(card)
    client, keys = open_redis(settings, max_connections=16)
    catalog = catalog_of(client, keys, worker_registry(client, keys), settings)
    cards = ModelCards(catalog, card, fallback=settings_directory(settings))
    celery = create_celery(settings, results=False, shards=keys.shards)
    shards = keys.all_shards()  # a Redis Cluster's: a relay loop each (workers.streamer_shards)
    loops = [Streamer(settings, client, tokenizer, celery, cards=cards, keys=k) for k in shards]
    return loops[0] if len(loops) == 1 else ShardedStreamer(loops)


def main(argv: list[str] | None = None) -> int:
    return run_service("streamer", __doc__.split("\n")[0], build_streamer, argv)


if __name__ == "__main__":
    sys.exit(main())
