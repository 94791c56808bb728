"""The streamer's decoding and writing: token chunks in, output entries out.

``Relay`` holds the requests a streamer decodes (``tracked``) and, for each read cycle,
runs their choice Decoders over the token chunks read (the plain path for one-choice
requests, the general one for the rest), stages the events as output entries and writes
them in one round trip (``_commit``, ``_flush``), fenced by the hand-off entries' owner
(``scripts.WRITE_OUTPUTS``). The process's loop around it (claims, reads, takeovers, the
watchdog) is ``workers.streamer.Streamer``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, TypedDict

import redis
from celery import Celery
from orjson import loads
from tokenizers import Tokenizer

from app.messages import EngineFinish, OutputEvent, OutputKind, TokenDelta
from app.settings import Settings
from app.usage import UsageCount
from broker.chunks import TokenEntry
from broker.connection import as_str
from broker.direct import DirectConnection
from broker.fair_queue import FairQueue
from broker.handoff import RequestHandoff
from broker.keys import Keys
from broker.models import ModelCards
from broker.output_usage import OutputUsage
from broker.outputs import OutputEntry, OutputStreams, encode_events, encode_text
from broker.publish import decode_deltas
from broker.requests import RequestStore
from broker.step_lines import below_ms
from broker.tracing import relay_span
from workers.streamer_state import (
    BACKBONE_ERRORS,
    DECODE_FAULT,
    REQUEST_FAULT,
    Commit,
    RequestFault,
    Tracked,
    cmp_ids,
)

logger = logging.getLogger(__name__)


class RelayOptions(TypedDict, total=False):
    """``Relay``'s keyword options, for the classes that extend it to pass on."""

    consumer: str | None
    clock: Callable[[], float]
    cards: ModelCards | None
    keys: Keys | None


class Relay:
    """Decode tracked requests' token chunks and write their outputs (module doc)."""

    def __init__(
        self,
        settings: Settings,
        client: redis.Redis,
        tokenizer: Tokenizer,
        celery_app: Celery,
        *,
        consumer: str | None = None,
        clock: Callable[[], float] = time.time,
        cards: ModelCards | None = None,
        keys: Keys | None = None,
    ) -> None:
        self.settings = settings
        self.redis = client
        self.tokenizer = tokenizer
        # The other models' tokenizers, loaded on first use (broker.models).
        self.cards = cards
        self.celery = celery_app
        self.clock = clock
        self.consumer = consumer or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        # On a Redis Cluster: bound to the one shard this relay serves (``ShardedStreamer``).
        keys = keys or Keys(settings.key_prefix)
        self.keys = keys
        self.store = RequestStore(client, keys, stream_ttl_s=settings.stream_ttl_s)
        self.fair = FairQueue(client, keys, ttl_s=settings.stream_ttl_s)
        self.outputs = OutputStreams(
            client, keys, ttl_s=settings.stream_ttl_s, ledger_days=settings.usage_ledger_days
        )
        # What each key's output streams hold: its output quota (key_max_output_bytes).
        self.usage = OutputUsage(client, keys, window_s=settings.stream_ttl_s, clock=clock)
        self._count_usage = bool(settings.api_keys and settings.key_max_output_bytes)
        self.handoff = RequestHandoff(client, keys)
        # The loop's read (and the write it carries) go on a connection of their own.
        self.direct = DirectConnection(client, keys.new_requests if keys.clustered else None)
        self.tracked: dict[str, Tracked] = {}
        self._step_cursors: dict[str, str] = {}  # worker step stream -> read position
        self._commits: deque[Commit] = deque()
        # Output writes staged so far: the clock of the requests' output ChunkLogs (the
        # index of the write the next commit makes).
        self._writes = 0

    def _decode_all(self, got: dict[str, list[Any]]) -> Commit:
        """Every request's new chunks of this cycle (``got``: request id -> its token
        entries and step lines) decoded into this cycle's commit. A request with one
        step line and a plain decoder (most, at most steps) takes ``_decode_plain``."""
        c = Commit([], [], [], [])
        now = self.clock()
        for rid, entries in got.items():
            t = self.tracked.get(rid)
            if t is None:  # dropped meanwhile (taken over)
                continue
            try:
                if t.plain is not None and len(entries) == 1 and entries[0][0] is None:
                    out = self._decode_plain(t, entries[0][1], now)
                else:
                    out = self._decode_entries(t, entries)
            except BACKBONE_ERRORS:
                raise
            except Exception:
                logger.exception("request %s: failed while decoding; ending it", rid)
                c.outputs.append(self._fail(t, REQUEST_FAULT, 500))
                c.failed.append(t)
                c.cancels.append(rid)  # no worker should spend more on it
                continue
            if t.choices.all_done:
                c.ended.append(t)
            if out is not None:
                c.outputs.append(out)
        return c

    def _append_commit(self, c: Commit) -> None:
        """Queue ``c``, numbered as the next write (its outputs were staged for it)."""
        if c.outputs:
            c.stamp = str(self._writes)
            self._writes += 1
        self._commits.append(c)

    def _restage_due(self, outputs: list[OutputEntry]) -> None:
        """Add a checkpoint for every request whose output chunks since its last one are
        due one (broker/chunks.py) and that this write carries nothing for: it stopped
        producing, and its tail would otherwise outlive the step entries holding it."""
        writing = {e.request_id for e in outputs}
        index = self._writes
        for rid, t in self.tracked.items():
            if rid not in writing and t.out.due(index):
                outputs.append(t.restaged(index))

    def _output(
        self,
        t: Tracked,
        events: list[OutputEvent],
        *,
        first: bool,
        terminal: bool = False,
        published: bytes | None = None,
    ) -> OutputEntry:
        """``t``'s events of this cycle as its next output chunk, staged for the next
        write: a checkpoint when it is this streamer's first for ``t`` or its last. The
        last carries the request's usage count: the usage ledger counts it in the same
        write (``broker.usage_ledger``)."""
        payload = encode_events(events)
        n, mark, prior = t.out.stage(payload, self._writes, t.mark_next or terminal)
        t.mark_next = False
        t.out_source = str(t.n)
        out = t.staged(n, mark, prior, payload, events, first, published)
        if terminal:
            out.usage = t.usage_count(events, self.clock())
            if t.record.trace:
                self._trace(t, out.usage)
        return out

    def _trace(self, t: Tracked, count: UsageCount) -> None:
        """The request's relay span (``broker.tracing``), made as its last chunk is."""
        try:
            relay_span(
                t.record,
                started=t.adopted_at,
                first_token_at=t.first_token_at,
                finish_reasons=t.finish_reasons(),
                count=count,
                took_over=t.took_over,
                consumer=self.consumer,
            )
        except Exception:  # tracing must never fail a request
            logger.exception("request %s: could not record its trace", t.record.request_id)

    def _commit(
        self,
        outputs: Sequence[OutputEntry],
        ended: Sequence[Tracked] = (),
        failed: Sequence[Tracked] = (),
        cancels: Sequence[str] = (),
    ) -> None:
        """Write ``outputs`` in one round trip, then end the requests they end.

        Once a request's decoders have moved on, their events must be committed before
        any other round trip that could fail and lose them."""
        self._append_commit(Commit(list(outputs), list(ended), list(failed), list(cancels)))
        self._flush()

    def _flush(self) -> None:
        while self._commits:
            c = self._commits[0]
            if not c.written:
                c.tries += 1
                if c.tries > 1 and c.outputs and self.outputs.landed(self.consumer, c.stamp):
                    # The failed round trip ran after all (Redis answered too late, or
                    # ran it and died before answering): written again, every chunk
                    # would be read twice by nobody, but its ordinals would be taken.
                    self._mark_written(c, set())
                else:
                    # Fenced: written only for requests whose hand-off entry is still
                    # ours. A retry sends the same chunks, numbered the same.
                    written = self.outputs.write(c.outputs, owner=self.consumer, stamp=c.stamp)
                    self._mark_written(c, written)
            self._settle(c)
            self._commits.popleft()

    def _mark_written(self, c: Commit, taken: set[str]) -> None:
        """``c``'s outputs are in Redis, but for ``taken`` (fenced: another streamer
        has those requests now, so we leave them alone). No round trip: this runs the
        moment the write's reply arrives."""
        c.written = True
        if taken:
            self._forget_taken_over(taken)
            c.drop(taken)
        if self._count_usage:  # only keys have quotas: nothing to count on the hot path
            for entry in c.outputs:
                t = self.tracked.get(entry.request_id)
                if t is not None and t.record.owner:
                    self.usage.add(t.record.owner, len(entry.encoded()))

    def _settle(self, c: Commit) -> None:
        """After ``c``'s outputs are written: cancel what it cancels, end the requests
        it ends (each step idempotent: safe to redo after an outage)."""
        # One round trip for the whole commit: the requests of a burst end together.
        pipe = self.redis.pipeline(transaction=False)
        for rid in c.cancels:
            self.store.queue_cancel(pipe, rid)
        for t in c.ended:
            if len(t.engine_finished) < t.record.num_choices:
                # Stopped locally: the worker may stop spending on it.
                self.store.queue_cancel(pipe, t.record.request_id)
        for t in (*c.ended, *c.failed):
            self.handoff.queue_ack(pipe, t.entry_id)
        if len(pipe):
            pipe.execute()
        c.cancels = []
        for t in (*c.ended, *c.failed):  # ending is idempotent: safe to redo after an outage
            self.tracked.pop(t.record.request_id, None)

    def _decode_plain(
        self, t: Tracked, line: tuple[int, bytes, bytes | None], now: float
    ) -> OutputEntry | None:
        """``_decode_entries`` for one step line of a request with a plain decoder
        (``Tracked.plain``), which ``_take_steps`` found to be its next chunk.

        Why: the streamer's decode of a step's requests is the largest part of the
        chain each step's tokens go through (docs/benchmarks.md, issue 12). For a chunk
        that is one delta of token ids for choice 0, this steps the Decoder directly and
        writes the text's chunk (``encode_text``) with no ``TokenDelta``, no event and no
        call per layer: the same text and the same output, about half the time. Any
        other chunk, an ended choice, and a first or last output take the general path
        (``_events_output``)."""
        n, payload, published = line
        try:
            deltas = loads(payload)
        except Exception as exc:
            raise RequestFault(f"malformed token chunk {n}") from exc
        dec = t.plain
        if (
            dec is None
            or dec.done
            or type(deltas) is not list
            or len(deltas) != 1
            or type(delta := deltas[0]) is not dict
            or len(delta) != 2
            or delta.get("c") != 0
            or type(ids := delta.get("t")) is not list
        ):
            return self._decode_entries(t, [(None, line)])
        if ids and t.first_token_at is None:
            t.first_token_at = now
        events: list[OutputEvent] | None
        try:
            text = dec.step(ids)
        except Exception:
            events = self._choice_fault(t, 0)
        else:
            events = None
        t.n = n
        t.progress_at = now
        if events is None:
            if dec.done:
                events = t.choices.ended(text)
            elif not text:
                return None
            elif t.mark_next or not t.wrote_output:
                events = [OutputEvent(OutputKind.DELTA, 0, text)]
            else:  # the plain chunk: not a checkpoint unless its log says it is due
                chunk = encode_text(text)
                n_out, mark, prior = t.out.stage(chunk, self._writes, False)
                t.out_source = str(n)
                return t.staged(n_out, mark, prior, chunk, None, False, published)
        return self._events_output(t, events, published)

    def _decode_entries(self, t: Tracked, entries: list[Any]) -> OutputEntry | None:
        """One request's new token entries and step lines (id None, then the line's
        ordinal, payload and publish time) -> its output entry for this cycle. Chunks it
        has are skipped by their ordinals."""
        events: list[OutputEvent] = []
        follow: TokenEntry | None = None  # the last token entry naming its worker
        published: bytes | None = None
        for eid, fields in entries:
            if eid is None:  # a step line
                chunks, published = [fields[:2]], fields[2]
            else:
                try:
                    entry = TokenEntry.of(fields)
                except Exception as exc:
                    raise RequestFault(f"malformed token entry {as_str(eid)}") from exc
                chunks, published = entry.chunks, entry.published
                if entry.worker:
                    follow = entry
            for n, payload in chunks:
                if n <= t.n:
                    continue
                if n != t.n + 1:  # a token stream is whole from its start: a bug
                    raise RequestFault(f"token chunks {t.n + 1}..{n - 1} are missing")
                try:
                    deltas = decode_deltas(payload)
                except Exception as exc:
                    raise RequestFault(f"malformed token chunk {n}") from exc
                events += self._apply(t, deltas)
                t.n = n
            if eid is not None:
                t.cursor = as_str(eid)
        t.progress_at = self.clock()
        if follow is not None and follow.worker:  # read what follows from its step stream
            start = follow.step_id or below_ms(t.cursor)
            self._follow_step(t, self.keys.steps(follow.worker), start)
        return self._events_output(t, events, published)

    def _events_output(
        self, t: Tracked, events: list[OutputEvent], published: bytes | None
    ) -> OutputEntry | None:
        """``t``'s output entry for this cycle's ``events`` (None when there are none),
        with its usage event when they end it. ``published``: the worker's publish time
        of the last chunk they were decoded from."""
        done = t.choices.all_done
        if done:
            events.append(self._usage_event(t))
        if not events:
            return None
        out = self._output(t, events, first=not t.wrote_output, terminal=done, published=published)
        t.wrote_output = True
        return out

    def _follow_step(self, t: Tracked, key: str, start: str) -> None:
        """Read ``t``'s next chunks from its worker's step stream ``key``, from the
        entry ``start`` (its last checkpoint's) on at the latest (chunks read twice are
        skipped by their ordinals)."""
        t.step = key
        t.watch = False
        current = self._step_cursors.get(key)
        if current is None or cmp_ids(start, current) < 0:
            self._step_cursors[key] = start

    def _apply(self, t: Tracked, deltas: list[TokenDelta]) -> list[OutputEvent]:
        events: list[OutputEvent] = []
        for d in deltas:
            if t.first_token_at is None and d.token_ids:
                t.first_token_at = self.clock()
            if d.finish is not None:
                t.engine_finished.add(d.choice)
            try:
                events += t.choices.feed(d)
            except Exception:
                events += self._choice_fault(t, d.choice)
        return events

    def _choice_fault(self, t: Tracked, choice: int) -> list[OutputEvent]:
        """A decoder fault ends that choice with an error; the others go on."""
        rid = t.record.request_id
        if not 0 <= choice < t.record.num_choices:
            logger.error("request %s: token entry for invalid choice index %s", rid, choice)
            raise RequestFault(f"invalid choice index {choice}")
        logger.exception("request %s: decode error on choice %d; ending that choice", rid, choice)
        ending = TokenDelta(
            choice, [], finish=EngineFinish.ERROR, error=DECODE_FAULT, error_code=500
        )
        return t.choices.feed(ending)

    def _usage_event(self, t: Tracked) -> OutputEvent:
        usage = dict(t.choices.usage)
        if t.claimed_by_worker is None:  # finished before the watchdog saw the claim
            with contextlib.suppress(redis.RedisError):  # timings are not worth the text
                t.claimed_by_worker = self.store.claimed_at(t.record.request_id)
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

    def _unadoptable_count(self, raw_record: Any) -> UsageCount | None:
        """The usage count of a request that ends with an error because it cannot be
        adopted (``raw_record``: its record as read), when its record is readable."""
        try:
            loaded = self.store.loaded(raw_record)
        except Exception:
            return None
        if loaded is None:
            return None
        record = loaded[0]
        prompt = {"prompt_tokens": sum(len(p) for p in record.prompts)}
        return UsageCount.of(record, prompt, error=True, at=self.clock())

    def _forget_taken_over(self, rids: set[str]) -> None:
        """Requests whose output another streamer writes now (our write was fenced):
        stop decoding them, and leave their hand-off entries to their new owner."""
        for rid in rids:
            logger.warning(
                "request %s was taken over by another streamer; its output was not "
                "written twice; dropping it",
                rid,
            )
            self.tracked.pop(rid, None)

    def _fail(self, t: Tracked, message: str, code: int) -> OutputEntry:
        """End every open choice, then the request, with an error.

        ``first`` (set the TTL) always: after Redis lost its data the output stream is
        a new key, and setting a TTL again on an existing one is harmless."""
        try:
            events = t.choices.finish_all(EngineFinish.ERROR, message, code)
        except Exception:  # a broken decoder still gets its request-level error
            logger.exception("request %s: cannot close its choices", t.record.request_id)
            events = []
        events.append(OutputEvent(OutputKind.ERROR, error=message, code=code))
        return self._output(t, events, first=True, terminal=True)
