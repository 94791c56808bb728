"""What the streamer keeps per request, and the messages and errors it deals in.

Split out of ``workers.streamer`` (the loop) so each module reads on its own.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import redis
from kombu.exceptions import OperationalError

from app.decoder import Decoder, RequestDecoder
from app.messages import FinishReason, OutputEvent, OutputKind
from app.records import RequestRecord
from app.usage import UsageCount
from broker.chunks import ChunkLog
from broker.outputs import OutputEntry
from broker.registry import Registry, WorkerInfo

# Errors that mean "the backbone is away", not "this request is bad": Redis's own, and
# Celery's (kombu) when sending a task finds no broker.
BACKBONE_ERRORS: tuple[type[Exception], ...] = (redis.RedisError, OperationalError)

# What a client reads when we fail its request; details go to the log, not the client.
DECODE_FAULT = "The streamer could not decode this choice's tokens."
REQUEST_FAULT = "The streamer failed while handling this request; please retry."
LOST_MESSAGE = (
    "The request was lost by the broker (Redis restarted without its data); please retry."
)
EXPIRED_MESSAGE = "The request expired."
DEADLINE_MESSAGE = "The request exceeded its deadline."


class RequestFault(Exception):
    """Something about one request cannot be handled; that request ends with an error."""


@dataclass
class Tracked:
    """A request this streamer decodes."""

    entry_id: str  # hand-off entry, acknowledged when the request ends
    record: RequestRecord
    choices: RequestDecoder
    cursor: str = "0-0"  # token stream read position (the last entry decoded)
    n: int = 0  # the ordinal of the last chunk decoded (broker/chunks.py; 0: none yet)
    # The worker step stream its chunks are read from, or None: its own token stream
    # (at the start, and after a resume).
    step: str | None = None
    # Read its own token stream as well: after a gap in the step stream (the chunks
    # are in a checkpoint) or a quiet spell (it may have moved to another worker).
    watch: bool = False
    progress_at: float = 0.0  # when an entry of its stream was last consumed
    wrote_output: bool = False
    # Its output chunks (broker/chunks.py): numbered on from what was written before a
    # takeover; the source of the last one; whether the next write is a checkpoint
    # (the first of this streamer's: readers learn from it where to read the rest).
    out: ChunkLog = field(default_factory=ChunkLog)
    out_source: str = "0"
    mark_next: bool = True
    engine_finished: set[int] = field(default_factory=set)
    first_token_at: float | None = None
    adopted_at: float = field(default_factory=time.time)  # its trace's relay span starts
    took_over: bool = False  # adopted from another streamer, part-written
    queued_since: float | None = None
    last_sent: float = 0.0
    no_worker_since: float | None = None
    # Its record's ``route`` (the worker the web tier sent it to), until the watchdog
    # finds that worker gone and sends it to the shared queue ("" then, or never routed).
    route: str = field(init=False)
    claimed_by_worker: float | None = None  # when a worker first started it (queue time)
    # Its Decoder when its chunks are decoded by the plain path (one choice, no
    # logprobs, no parsers: ``RequestDecoder.plain_decoder``), else None.
    plain: Decoder | None = field(init=False)

    def __post_init__(self) -> None:
        self.plain = self.choices.plain_decoder()
        self.route = self.record.route

    def staged(
        self,
        n: int,
        checkpoint: bool,
        prior: bytes,
        payload: bytes,
        events: list[OutputEvent] | None = None,
        first: bool = False,
        published: bytes | None = None,
    ) -> OutputEntry:
        """Its output chunk ``n`` as ``out`` staged it (``ChunkLog.stage`` or ``restage``),
        for the next write, fenced by its hand-off entry. The one place a staged entry is
        built: once per request per write, so positional (a keyword call costs more)."""
        return OutputEntry(
            self.record.request_id,
            events if events is not None else [],
            self.out_source,
            first,
            published,
            self.entry_id,
            n,
            checkpoint,
            prior,
            payload,
        )

    def finish_reasons(self) -> list[str]:
        """Each choice's finish reason so far ("" while open, or when unreadable)."""
        try:
            return [d.finish_reason.value if d.finish_reason else "" for d in self.choices.choices]
        except Exception:  # a broken decoder: its trace says less
            return []

    def usage_count(self, events: Sequence[OutputEvent], at: float) -> UsageCount:
        """What the usage ledger counts for this request when ``events`` end it: the
        usage its client reads, or after a request-level error the tokens so far; an
        error when it ended with one or a choice did (``finish_reason: "error"``)."""
        usage = next((e.usage for e in events if e.kind is OutputKind.USAGE and e.usage), None)
        error = any(e.kind is OutputKind.ERROR and e.choice is None for e in events)
        try:
            error = error or any(
                d.finish_reason is FinishReason.ERROR for d in self.choices.choices
            )
            if usage is None:
                usage = self.choices.usage
        except Exception:  # a broken decoder: its prompt is still known
            usage = usage or {"prompt_tokens": sum(len(p) for p in self.record.prompts)}
        return UsageCount.of(self.record, usage, error=error, at=at)

    def restaged(self, index: int) -> OutputEntry:
        """A checkpoint of its output chunks since the last one, with no new chunk, for
        write number ``index`` (``ChunkLog.restage``): a request whose tail is due one
        though it produced nothing, or one just taken over with a tail in its last
        streamer's step stream."""
        n, payload, prior = self.out.restage(index)
        return self.staged(n, True, prior, payload)


@dataclass
class Commit:
    """One cycle's output entries and the requests they end. Written first, then the
    requests ended; if Redis goes away in between, the rest is done once it is back,
    before anything else is written (the decoders have moved on: dropping the entries
    would lose text)."""

    outputs: list[OutputEntry]
    ended: list[Tracked]  # ended normally (usage written)
    failed: list[Tracked]  # ended with an error event
    cancels: list[str]  # requests to cancel upstream once their error is written
    written: bool = False
    tries: int = 0
    stamp: str = ""  # names its write in the step stream (``OutputStreams.landed``)

    def drop(self, rids: set[str]) -> None:
        """Leave out requests another streamer took over: their text is its to write,
        and their hand-off entries its to acknowledge."""
        if rids:
            self.outputs = [e for e in self.outputs if e.request_id not in rids]
            self.ended = [t for t in self.ended if t.record.request_id not in rids]
            self.failed = [t for t in self.failed if t.record.request_id not in rids]
            self.cancels = [rid for rid in self.cancels if rid not in rids]


class LiveModels:
    """The models live workers serve, read from the registry at most once per watchdog."""

    def __init__(self, workers: Registry[WorkerInfo]) -> None:
        self._workers = workers
        self._models: set[str] | None = None
        self._ids: set[str] | None = None

    def models(self) -> set[str]:
        if self._models is None:
            self._read()
        assert self._models is not None
        return self._models

    def ids(self) -> set[str]:
        """The live workers' ids."""
        if self._ids is None:
            self._read()
        assert self._ids is not None
        return self._ids

    def _read(self) -> None:
        live = self._workers.live()
        self._models = {w.model for w in live}
        self._ids = {w.worker_id for w in live}


def cmp_ids(a: str, b: str) -> int:
    am, _, asq = a.partition("-")
    bm, _, bsq = b.partition("-")
    ka, kb = (int(am), int(asq or 0)), (int(bm), int(bsq or 0))
    return (ka > kb) - (ka < kb)
