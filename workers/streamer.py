"""``tokenrelay streamer``: token ids in, text events out, for many requests at once.

One loop per process (several processes may run):

1. claim new requests from the hand-off consumer group (woken by a plain XREAD on the
   hand-off stream, so a new request waits for no timeout);
2. read the token streams of every request it holds in ONE blocking XREAD;
3. run each request's choice Decoders and append the resulting events to each
   request's output stream in ONE pipelined round trip (deltas coalesced per cycle,
   each entry carrying the token cursor it was decoded up to);
4. when every choice has ended, append usage, cancel the request upstream if it
   stopped locally (stop string / stop token), and acknowledge the hand-off entry;
5. every half second, the watchdog: resume requests whose worker lost its lease,
   resend requests left queued, fail requests past their deadline or with no worker,
   touch its own hand-off entries (liveness) and take over those of dead streamers.
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
from dataclasses import dataclass, field
from typing import Any

import redis
from celery import Celery
from tokenizers import Tokenizer

from app.decoder import RequestDecoder
from app.messages import EngineFinish, OutputEvent, OutputKind, TokenDelta
from app.model_card import load_model_card, load_tokenizer
from app.settings import Settings
from broker.celery_app import create_celery, send_generate
from broker.connection import redis_client
from broker.keys import Keys
from app.records import RequestRecord, RequestState
from broker.registry import StreamerInfo, streamer_registry, worker_registry
from broker.requests import RequestStore, decode_deltas
from broker.streams import OutputEntry, OutputStreams, RequestHandoff
from workers.service_main import run_service

logger = logging.getLogger(__name__)

WATCHDOG_S = 0.5
HEARTBEAT_S = 2.0
READ_BLOCK_MS = 50


def request_decoder(tokenizer: Tokenizer, record: RequestRecord) -> RequestDecoder:
    """The Decoders of all of a request's choices (choice c runs on prompt c // n)."""
    return RequestDecoder(
        tokenizer,
        record.prompts[0],
        record.stop,
        n=record.n,
        skip_special_tokens=record.skip_special_tokens,
        logprobs=record.sampling.logprobs is not None,
        more_prompts=record.prompts[1:],
    )


@dataclass
class Tracked:
    """A request this streamer decodes."""

    entry_id: str  # hand-off entry, acknowledged when the request ends
    record: RequestRecord
    choices: RequestDecoder
    cursor: str = "0-0"  # token stream read position
    wrote_output: bool = False
    engine_finished: set[int] = field(default_factory=set)
    first_token_at: float | None = None
    claimed_at: float = 0.0
    queued_since: float | None = None
    last_sent: float = 0.0
    no_worker_since: float | None = None
    claimed_by_worker: float | None = None  # when a worker first started it (queue time)


class Streamer:
    def __init__(
        self,
        settings: Settings,
        client: redis.Redis,
        tokenizer: Tokenizer,
        celery_app: Celery,
        *,
        consumer: str | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.settings = settings
        self.redis = client
        self.tokenizer = tokenizer
        self.celery = celery_app
        self.clock = clock
        self.consumer = consumer or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        keys = Keys(settings.key_prefix)
        self.keys = keys
        self.store = RequestStore(client, keys, stream_ttl_s=settings.stream_ttl_s)
        self.outputs = OutputStreams(client, keys, ttl_s=settings.stream_ttl_s)
        self.handoff = RequestHandoff(client, keys)
        self.workers = worker_registry(client, keys)
        self.registry = streamer_registry(client, keys, ttl_s=5 * HEARTBEAT_S)
        self.tracked: dict[str, Tracked] = {}
        self._handoff_cursor = "0-0"
        self._last_watchdog = 0.0
        self._last_heartbeat = 0.0
        self.started = clock()
        self.stopping = threading.Event()

    # -- main loop ---------------------------------------------------------------------
    def run(self) -> None:
        logger.info("streamer %s serving", self.consumer)
        self.handoff.ensure_group()
        self._handoff_cursor = self.handoff.last_id()
        self._watchdog(force=True)
        while not self.stopping.is_set():
            try:
                self.iterate()
            except redis.RedisError:
                logger.exception("redis error in the streamer loop; retrying")
                time.sleep(0.5)
        with contextlib.suppress(redis.RedisError):
            self.registry.unregister(self.consumer)

    def iterate(self) -> None:
        for entry_id, rid in self.handoff.claim_new(self.consumer):
            self._adopt(entry_id, rid)
        self._read_and_decode()
        now = self.clock()
        if now - self._last_watchdog >= WATCHDOG_S:
            self._watchdog()

    def _read_and_decode(self) -> None:
        streams: dict[str, str] = {self.keys.new_requests: self._handoff_cursor}
        by_key: dict[str, Tracked] = {}
        for rid, t in self.tracked.items():
            key = self.keys.tokens(rid)
            streams[key] = t.cursor
            by_key[key] = t
        res = self.redis.xread(streams, count=512, block=READ_BLOCK_MS)
        outputs: list[OutputEntry] = []
        ended: list[Tracked] = []
        for key_raw, entries in res or []:
            key = key_raw.decode() if isinstance(key_raw, bytes) else key_raw
            if key == self.keys.new_requests:
                self._handoff_cursor = _s(entries[-1][0])
                continue
            t = by_key.get(key)
            if t is None or not entries:
                continue
            events: list[OutputEvent] = []
            for eid, fields in entries:
                events += self._apply(t, decode_deltas(fields[b"d"]))
                t.cursor = _s(eid)
            if t.choices.all_done:
                events.append(self._usage_event(t))
                ended.append(t)
            if events:
                outputs.append(
                    OutputEntry(
                        t.record.request_id,
                        events,
                        t.cursor,
                        first=not t.wrote_output,
                        published=entries[-1][1].get(b"t"),
                    )
                )
                t.wrote_output = True
        self.outputs.write(outputs)
        for t in ended:
            self._end(t)

    def _apply(self, t: Tracked, deltas: list[TokenDelta]) -> list[OutputEvent]:
        events: list[OutputEvent] = []
        for d in deltas:
            if t.first_token_at is None and d.token_ids:
                t.first_token_at = self.clock()
            if d.finish is not None:
                t.engine_finished.add(d.choice)
            events += t.choices.feed(d)
        return events

    def _usage_event(self, t: Tracked) -> OutputEvent:
        usage = dict(t.choices.usage)
        if t.claimed_by_worker is None:  # finished before the watchdog saw the claim
            raw = self.redis.hget(self.keys.request(t.record.request_id), "claimed")
            t.claimed_by_worker = float(raw) if raw is not None else None  # type: ignore[arg-type]
        now = self.clock()
        rec = t.record
        usage["timings"] = {
            "queue_s": None
            if t.claimed_by_worker is None
            else round(t.claimed_by_worker - rec.created, 4),
            "ttft_s": None
            if t.first_token_at is None
            else round(t.first_token_at - rec.created, 4),
            "decode_s": None if t.first_token_at is None else round(now - t.first_token_at, 4),
            "e2e_s": round(now - rec.created, 4),
        }
        usage["streamer"] = self.consumer  # internal: the web tier drops it
        return OutputEvent(OutputKind.USAGE, usage=usage)

    def _end(self, t: Tracked) -> None:
        rid = t.record.request_id
        if len(t.engine_finished) < t.record.num_choices:
            self.store.cancel(rid)  # stopped locally: the worker may stop spending on it
        self.handoff.ack(t.entry_id)
        self.tracked.pop(rid, None)

    # -- adopting requests (new or taken over) ---------------------------------------------
    def _adopt(self, entry_id: str, rid: str) -> None:
        loaded = self.store.load(rid)
        if loaded is None:
            self.handoff.ack(entry_id)  # expired before anyone decoded it
            return
        record, _state, _attempt = loaded
        t = Tracked(
            entry_id, record, request_decoder(self.tokenizer, record), claimed_at=self.clock()
        )
        last = self.outputs.last_source(rid)
        if last is not None:
            source, ended = last
            if ended:
                self.handoff.ack(entry_id)
                return
            # Taking over: replay silently up to what is already written.
            for eid, _attempt_no, deltas in self.store.read_tokens(rid):
                if _cmp_ids(eid, source) > 0:
                    break
                self._apply(t, deltas)
                t.cursor = eid
            t.wrote_output = True
            logger.info("took over request %s at token cursor %s", rid, source)
        self.tracked[rid] = t

    # -- watchdog --------------------------------------------------------------------------
    def _watchdog(self, force: bool = False) -> None:
        now = self.clock()
        self._last_watchdog = now
        if force or now - self._last_heartbeat >= HEARTBEAT_S:
            self._last_heartbeat = now
            self.registry.heartbeat(
                StreamerInfo(
                    streamer_id=self.consumer,
                    hostname=socket.gethostname(),
                    pid=os.getpid(),
                    started=self.started,
                    active_requests=len(self.tracked),
                )
            )
            self.handoff.touch(self.consumer, [t.entry_id for t in self.tracked.values()])
            min_idle = int(self.settings.streamer_takeover_s * 1000)
            for entry_id, rid in self.handoff.take_over(self.consumer, min_idle):
                if rid not in self.tracked:
                    self._adopt(entry_id, rid)
        if not self.tracked:
            return
        rids = list(self.tracked)
        pipe = self.redis.pipeline(transaction=False)
        for rid in rids:
            pipe.hmget(self.keys.request(rid), "state", "attempt", "claimed")
            pipe.exists(self.keys.lease(rid))
        raw = pipe.execute()
        live_models: set[str] | None = None
        failures: list[OutputEntry] = []
        for i, rid in enumerate(rids):
            t = self.tracked[rid]
            (state_raw, attempt_raw, claimed_raw), lease = raw[2 * i], raw[2 * i + 1]
            if claimed_raw is not None and t.claimed_by_worker is None:
                t.claimed_by_worker = float(claimed_raw)
            if state_raw is None:
                failures.append(self._fail(t, "The request expired.", 504))
                continue
            state, attempt = RequestState(_s(state_raw)), int(attempt_raw or 0)
            if now > t.record.deadline:
                self.store.cancel(rid)
                failures.append(self._fail(t, "The request exceeded its deadline.", 504))
            elif state is RequestState.RUNNING:
                t.queued_since = None
                if not lease:
                    self._resume(t, failures)
            elif state is RequestState.QUEUED:
                t.queued_since = t.queued_since or now
                if live_models is None:
                    live_models = {w.model for w in self.workers.live()}
                if t.record.model not in live_models:
                    t.no_worker_since = t.no_worker_since or now
                    if now - t.no_worker_since > self.settings.no_worker_timeout_s:
                        failures.append(
                            self._fail(t, f"No worker is serving model {t.record.model!r}.", 503)
                        )
                        continue
                else:
                    t.no_worker_since = None
                if now - max(t.queued_since, t.last_sent) > self.settings.requeue_after_s:
                    t.last_sent = now
                    send_generate(
                        self.celery, rid, attempt, queue=t.record.queue, model=t.record.model
                    )
            elif state is RequestState.DONE:
                self._finish_done(t, failures)
        self.outputs.write([f for f in failures if f.events])
        for f in failures:
            t2 = self.tracked.get(f.request_id)
            if t2 is not None:
                self._end_failed(t2)

    def _resume(self, t: Tracked, failures: list[OutputEntry]) -> None:
        rid = t.record.request_id
        attempt = self.store.resume(rid)
        if attempt is None:
            return
        if attempt >= self.settings.max_attempts:
            self.store.cancel(rid)
            failures.append(
                self._fail(t, f"The request lost its worker {attempt} times; giving up.", 503)
            )
            return
        logger.warning("request %s lost its worker; resuming as attempt %d", rid, attempt)
        t.last_sent = self.clock()
        send_generate(self.celery, rid, attempt, queue=t.record.queue, model=t.record.model)

    def _finish_done(self, t: Tracked, failures: list[OutputEntry]) -> None:
        """The worker side is done; drain what is left and close open choices."""
        rid = t.record.request_id
        events: list[OutputEvent] = []
        for eid, _a, deltas in self.store.read_tokens(rid, t.cursor):
            events += self._apply(t, deltas)
            t.cursor = eid
        if not t.choices.all_done:
            # e.g. cancelled before any worker started it: nothing was generated.
            events += t.choices.finish_all(EngineFinish.CANCELLED)
        events.append(self._usage_event(t))
        failures.append(OutputEntry(rid, events, t.cursor, first=not t.wrote_output))

    def _fail(self, t: Tracked, message: str, code: int) -> OutputEntry:
        events = t.choices.finish_all(EngineFinish.ERROR, message, code)
        events.append(OutputEvent(OutputKind.ERROR, error=message, code=code))
        return OutputEntry(t.record.request_id, events, t.cursor, first=not t.wrote_output)

    def _end_failed(self, t: Tracked) -> None:
        self.handoff.ack(t.entry_id)
        self.tracked.pop(t.record.request_id, None)


def _cmp_ids(a: str, b: str) -> int:
    am, _, asq = a.partition("-")
    bm, _, bsq = b.partition("-")
    ka, kb = (int(am), int(asq or 0)), (int(bm), int(bsq or 0))
    return (ka > kb) - (ka < kb)


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def build_streamer(settings: Settings) -> Streamer:
    card = load_model_card(settings.model_path())
    tokenizer = load_tokenizer(card)
    client = redis_client(settings.redis_url, max_connections=16)
    return Streamer(settings, client, tokenizer, create_celery(settings))


def main(argv: list[str] | None = None) -> int:
    return run_service("streamer", __doc__.split("\n")[0], build_streamer, argv)


if __name__ == "__main__":
    sys.exit(main())
