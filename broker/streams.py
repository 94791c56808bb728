"""Output streams (streamer -> web) and the hand-off of new requests to streamers.

Output stream entries: ``e`` = JSON list of encoded ``OutputEvent`` values, ``s`` = the
token-stream entry id they were decoded up to. Entries are appended once per read cycle
(deltas coalesced), and the ``s`` checkpoint lets a streamer that takes a request over
replay the token stream silently up to exactly what was already written, so no text is
ever repeated or lost. Readers always read from an explicit cursor (``0-0`` or the last
id they saw), never ``$``.

The last event of every output stream is a USAGE event or a request-level ERROR event
(``choice`` None): a reader stops there.

New requests reach streamers through the ``Keys.new_requests`` stream and the consumer
group ``streamers``: a streamer keeps its claimed entries pending (unacknowledged) until
the request ends and touches them every second; entries idle longer than the takeover
time belong to a dead streamer and are claimed by a live one (XAUTOCLAIM).
"""

from __future__ import annotations

import enum
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import orjson
import redis
from redis.client import Pipeline

from app.messages import OutputEvent, OutputKind
from broker import scripts
from broker.chunks import CHECKPOINT_STEPS, entry_chunks
from broker.direct import DirectConnection, read_rest, xread_command
from broker.keys import Keys

GROUP = "streamers"
# What a reader gets for an output entry it cannot decode (a bug upstream).
MALFORMED_OUTPUT = OutputEvent(
    OutputKind.ERROR, error="The server produced an unreadable output for this request.", code=500
)

# How often the hub looks again at a paused subscription (full buffer) for room.
PAUSED_POLL_MS = 100
# A stream the hub follows through a streamer's output step stream and that got nothing
# from it for this long is read on its own again (one XREAD key more) until an entry
# comes: its request may have moved to another streamer, or just be slow.
STEP_QUIET_S = 1.0

logger = logging.getLogger(__name__)


def is_terminal(event: OutputEvent) -> bool:
    return event.kind is OutputKind.USAGE or (
        event.kind is OutputKind.ERROR and event.choice is None
    )


def encode_events(events: Sequence[OutputEvent]) -> bytes:
    return orjson.dumps([e.encode() for e in events])


_TEXT_HEAD = b'[{"k":"delta","c":0,"t":'


def encode_text(text: str) -> bytes:
    """``encode_events([OutputEvent(OutputKind.DELTA, 0, text)])``, byte for byte, for a
    non-empty ``text``: the chunk of a plain request at most steps (the streamer's
    ``_decode_plain``), without an event object and its dict (a fifth of the cost)."""
    return _TEXT_HEAD + orjson.dumps(text) + b"}]"


def decode_events(raw: str | bytes) -> list[OutputEvent]:
    # Most chunks are one text delta of choice 0 (``encode_text``): a web process reads
    # every one it relays, so its text is read without the list, the dict and the call.
    if type(raw) is bytes and raw.startswith(_TEXT_HEAD) and raw.endswith(b"}]"):
        try:
            text = orjson.loads(raw[len(_TEXT_HEAD) : -2])
        except orjson.JSONDecodeError:
            pass  # more than one event after all
        else:
            if type(text) is str:
                return [OutputEvent(OutputKind.DELTA, 0, text)]
    return [OutputEvent.decode(x) for x in orjson.loads(raw)]


@dataclass(slots=True)
class OutputEntry:
    """One request's events of one streamer write: a chunk of its output.

    ``n`` is the chunk's ordinal and ``checkpoint`` whether it goes into the request's
    own output stream too, with ``prior`` (the chunks since the last checkpoint), as the
    streamer's ``ChunkLog`` staged it; ``n`` 0: the next after the stream's last entry,
    as a checkpoint (a writer that keeps no log: tests, a request that cannot be adopted).
    """

    request_id: str
    events: list[OutputEvent]
    source: str  # the ordinal of the last token chunk these events were decoded from
    first: bool = False
    published: bytes | None = None  # worker publish time of the source entry (latency)
    handoff_id: str = ""  # the request's hand-off entry: written only while we own it
    n: int = 0
    checkpoint: bool = False
    prior: bytes = b""
    payload: bytes = b""  # ``encode_events(events)``, when the caller has it already

    def encoded(self) -> bytes:
        if not self.payload:
            self.payload = encode_events(self.events)
        return self.payload


@dataclass(slots=True)
class OutputLog:
    """What ``OutputStreams.read_log`` read: the chunks after the ordinal asked for,
    the ordinal of the output stream's last entry (``recorded``) and the chunks after
    it in its streamer's step stream (``tail``: ordinal, source, events)."""

    chunks: list[tuple[int, bytes]] = field(default_factory=list)
    recorded: int = 0
    source: str | None = None  # the token chunk the last chunk was decoded up to
    last_events: bytes = b""  # the last chunk's events
    tail: list[tuple[int, str, bytes]] = field(default_factory=list)
    steps: str | None = None  # the step stream the tail is read from, if any
    sid: str = "0-0"  # ... from after this entry (the last checkpoint's)

    @property
    def last(self) -> int:
        """The ordinal of the last chunk written (0: none)."""
        return self.tail[-1][0] if self.tail else self.recorded

    @property
    def ended(self) -> bool:
        """Whether the last chunk ends the stream (a usage or request-level error)."""
        return bool(self.last_events) and any(
            is_terminal(ev) for ev in decode_events(self.last_events)
        )


# How often a reader reads a stream again when it changed under it.
READ_LOG_TRIES = 5
L = TypeVar("L")


# A chunk read from a step stream: ordinal, the line's second field (a token chunk's
# attempt, an output chunk's source), payload, and its entry's ``t`` (publish time).
StepChunk = tuple[int, str, bytes, bytes | None]
# Where a stream's last checkpoint says its tail is: step stream, entry id, ordinal.
TailAt = tuple[str, str, int]


def step_tail(
    client: redis.Redis, key: str, steps: str, sid: str, recorded: int
) -> list[StepChunk] | None:
    """The chunks of stream ``key`` after ordinal ``recorded`` in the entries of step
    stream ``steps`` after ``sid`` (the last checkpoint's); None when ``sid`` is
    trimmed away. A checkpoint comes at least every ``CHECKPOINT_STEPS`` entries, so
    the tail is within that many."""
    entries: Any = client.xrange(steps, min=sid, count=CHECKPOINT_STEPS + 1)
    if not entries or _s(entries[0][0]) != sid:
        return None
    tail: list[StepChunk] = []
    for _eid, fields in entries[1:]:
        for okey, second, n, payload in split_step(fields[b"d"]):
            if okey == key and n == recorded + len(tail) + 1:
                tail.append((n, second, payload, fields.get(b"t")))
    return tail


def read_checkpointed(
    client: redis.Redis, key: str, parse: Callable[[Any], tuple[L, TailAt | None]]
) -> tuple[L, list[StepChunk]]:
    """Stream ``key`` (token or output: both are checkpointed, broker/chunks.py), as
    ``parse`` makes it into a log, and the tail its last checkpoint names: two round
    trips. If the step stream moved past the checkpoint's entry in between, the stream
    has a newer checkpoint (or there was no tail): it is read again."""
    entries: Any = client.xrange(key)
    for _ in range(READ_LOG_TRIES):
        log, at = parse(entries)
        if at is None:
            return log, []
        tail = step_tail(client, key, *at)
        if tail is not None:
            return log, tail
        again: Any = client.xrange(key)
        if again == entries:  # the checkpoint's step entry is gone: no tail
            return log, []
        entries = again
    raise RuntimeError(f"{key} kept changing while read")


class OutputStreams:
    """Write and read per-request output streams."""

    def __init__(self, client: redis.Redis, keys: Keys, *, ttl_s: int = 3600) -> None:
        self.redis = client
        self.keys = keys
        self.ttl_s = ttl_s
        self._write_script = client.register_script(scripts.WRITE_OUTPUTS)
        # The hand-off epoch under which the owner last found which of its hand-off
        # entries are its own (``RequestHandoff.owners``); None: check every entry.
        self.fence_epoch: str | None = None

    def write(
        self, entries: Sequence[OutputEntry], owner: str | None = None, stamp: str = ""
    ) -> set[str]:
        """Append many requests' events in one round trip.

        ``owner`` (a streamer's consumer name) fences the entries that carry a
        ``handoff_id``: each is written only if that streamer still owns the request's
        hand-off entry; and it writes the owner's step stream. ``stamp`` marks the call
        in it (``landed``). Returns the ids of the requests not written because another
        streamer has taken them over."""
        if not entries:
            return set()
        keys, args, order = self._write_args(entries, owner or "", stamp)
        return self._fenced_ids(entries, order, self._write_script(keys=keys, args=args))

    def write_then_read(
        self,
        entries: Sequence[OutputEntry],
        owner: str,
        streams: dict[str, str],
        *,
        count: int,
        block_ms: int,
        on_written: Callable[[set[str]], None],
        via: DirectConnection,
        stamp: str = "",
    ) -> Any:
        """``write(entries, owner, stamp)`` and then a blocking XREAD of ``streams``,
        sent as one round trip: a streamer's steady cycle costs one wake-up instead of
        two, and the outputs are in Redis as soon as they would have been written alone.

        The write's reply is read before the read's, and ``on_written`` gets the fenced
        request ids at once: if the connection breaks while the read blocks, the caller
        still knows its entries are written (and must not write them again into a Redis
        that has come back empty). If Redis lost the script (restarted), the write is
        redone with the script loaded before the read's reply is handed back.
        Returns the XREAD reply."""
        keys, args, order = self._write_args(entries, owner, stamp)
        via.send(
            ("EVALSHA", self._write_script.sha, len(keys), *keys, *args),
            xread_command(streams, count=count, block_ms=block_ms),
        )
        try:
            fenced: Any = via.reply("EVALSHA")
        except redis.ResponseError as exc:
            fenced = exc  # the read's reply follows all the same
        else:
            on_written(self._fenced_ids(entries, order, fenced))
        read = via.reply("XREAD")
        if isinstance(fenced, redis.exceptions.NoScriptError):
            on_written(self.write(entries, owner, stamp))
        elif isinstance(fenced, Exception):
            raise fenced
        return read

    def _write_args(
        self, entries: Sequence[OutputEntry], owner: str, stamp: str
    ) -> tuple[list[str], list[Any], list[int]]:
        """``scripts.WRITE_OUTPUTS``'s keys and arguments, and the entries' indexes in
        the order the script counts them: those written out, then the plain ones (see
        the script), whose step lines are written here, as the step entry holds them."""
        keys = [self.keys.new_requests, self.keys.handoff_epoch]
        each: list[Any] = []
        lines: list[bytes] = []
        handoffs: list[str] = []
        order: list[int] = []
        plain: list[int] = []
        prefix = self.keys.output("")  # concatenated, once per request per write
        for i, e in enumerate(entries):
            if owner and e.n and not (e.first or e.checkpoint):
                lines.append(step_line(prefix + e.request_id, e.source, e.n, e.encoded()))
                handoffs.append(e.handoff_id or "-")
                plain.append(i)
                continue
            keys.append(prefix + e.request_id)
            flags = (1 if e.first else 0) | (8 if e.checkpoint else 0) | e.n << 4
            each += [e.handoff_id, flags, e.encoded(), e.source]
            each.append(e.published if e.published is not None else "")
            order.append(i)
        if owner:
            keys.append(self.keys.output_steps(owner))
        epoch = "" if self.fence_epoch is None else f"e:{self.fence_epoch}"
        args: list[Any] = [GROUP, owner, self.ttl_s, epoch, stamp, len(order)]
        args += [b"\n".join(lines), " ".join(handoffs), *each]
        args += [e.prior for e in entries if e.checkpoint]
        return keys, args, order + plain

    @staticmethod
    def _fenced_ids(entries: Sequence[OutputEntry], order: Sequence[int], fenced: Any) -> set[str]:
        return {entries[order[int(i) - 1]].request_id for i in fenced or []}

    def landed(self, owner: str, stamp: str) -> bool:
        """Whether ``owner``'s write stamped ``stamp`` ran (its reply was lost): nothing
        else writes the owner's step stream, and it writes nothing more until it knows.
        A call that wrote no chunk (every one fenced) reads as not run: run again, it
        writes nothing again."""
        last = last_entries(self.redis, [self.keys.output_steps(owner)])[0]
        return last.get(b"c") == stamp.encode()

    def read_log(self, rid: str, after: int = 0) -> OutputLog:
        """The request's output stream, then the tail of its last checkpoint's step
        stream: two round trips. If the step stream moved past the checkpoint's entry
        in between, the output stream has a newer checkpoint (or there was no tail):
        it is read again."""

        def parse(entries: Any) -> tuple[OutputLog, TailAt | None]:
            log = OutputLog()
            for _eid, fields in entries:
                log.chunks += [c for c in entry_chunks(fields) if c[0] > after]
            if not entries:
                return log, None
            last = entries[-1][1]
            log.recorded = int(last[b"n"])
            log.source, log.last_events = _s(last[b"s"]), last[b"d"]
            writer, sid = last.get(b"w"), last.get(b"i")
            if not writer or not sid:
                return log, None
            log.steps, log.sid = self.keys.output_steps(_s(writer)), _s(sid)
            return log, (log.steps, log.sid, log.recorded)

        log, tail = read_checkpointed(self.redis, self.keys.output(rid), parse)
        log.tail = [(n, source, events) for n, source, events, _t in tail]
        log.chunks += [(n, events) for n, _source, events in log.tail if n > after]
        if log.tail:
            _n, log.source, log.last_events = log.tail[-1]
        return log

    def lost(self, rid: str) -> bool:
        """Neither the request's record nor its output exists (expired, or Redis was
        restarted without persistence): nothing will ever be written for it."""
        found: Any = self.redis.exists(self.keys.request(rid), self.keys.output(rid))
        return not found

    def read(self, rid: str, after: int = 0) -> list[tuple[str, list[OutputEvent]]]:
        """The chunks after ordinal ``after``, as (ordinal, events)."""
        return [(str(n), decode_events(raw)) for n, raw in self.read_log(rid, after).chunks]

    def follow(
        self, rid: str, after: int = 0, *, timeout_s: float = 600.0, poll_s: float = 0.02
    ) -> Iterator[tuple[str, OutputEvent]]:
        """Every event after chunk ``after`` until the terminal one, as (ordinal, event),
        polling (tests and tools; a web process follows its streams with an
        ``OutputHub``).

        Raises TimeoutError when nothing arrives for ``timeout_s`` (the streamers'
        watchdog ends every stream long before that; this only guards the reader).
        """
        last_progress = time.monotonic()
        while True:
            chunks = self.read(rid, after)
            if not chunks:
                if time.monotonic() - last_progress > timeout_s:
                    raise TimeoutError(f"no output for request {rid} in {timeout_s}s")
                time.sleep(poll_s)
                continue
            last_progress = time.monotonic()
            for n, events in chunks:
                after = int(n)
                for ev in events:
                    yield n, ev
                    if is_terminal(ev):
                        return


class RequestHandoff:
    """The consumer group through which streamers share out new requests."""

    def __init__(self, client: redis.Redis, keys: Keys) -> None:
        self.redis = client
        self.keys = keys
        self._take_over = client.register_script(scripts.TAKE_OVER)
        self._touch = client.register_script(scripts.TOUCH)

    def ensure_group(self) -> None:
        try:
            self.redis.xgroup_create(self.keys.new_requests, GROUP, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    def claim_new(self, consumer: str, count: int = 64) -> list[tuple[str, str]]:
        """New requests for this streamer: (hand-off entry id, request id)."""
        res: Any = self.redis.xreadgroup(
            GROUP, consumer, {self.keys.new_requests: ">"}, count=count
        )
        if not res:
            return []
        return [(_s(eid), _s(f[b"r"])) for eid, f in res[0][1]]

    def last_id(self) -> str:
        """The newest hand-off entry id (a wake-up cursor for plain XREAD)."""
        info: Any = self.redis.xrevrange(self.keys.new_requests, count=1)
        return _s(info[0][0]) if info else "0-0"

    def touch(self, consumer: str, entry_ids: Sequence[str]) -> None:
        """Reset the idle time of entries we still work on (we are alive); an entry
        another streamer took over meanwhile stays its."""
        if entry_ids:
            self._touch(keys=[self.keys.new_requests], args=[GROUP, consumer, *entry_ids])

    def owners(self, entry_ids: Sequence[str]) -> tuple[dict[str, str | None], str]:
        """The consumer each entry is pending for (None: pending for no one, e.g. the
        group was recreated after Redis lost its data), and the hand-off epoch read
        just before them: while the epoch stays that, no entry changed hands
        (``OutputStreams.fence_epoch``). A streamer whose entry another streamer now
        holds must stop decoding that request (two would write one output stream)."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.get(self.keys.handoff_epoch)
        for eid in entry_ids:
            pipe.xpending_range(self.keys.new_requests, GROUP, min=eid, max=eid, count=1)
        epoch, *pendings = pipe.execute()
        out: dict[str, str | None] = {}
        for eid, pending in zip(entry_ids, pendings, strict=True):
            out[eid] = _s(pending[0]["consumer"]) if pending else None
        return out, "" if epoch is None else _s(epoch)

    def take_over(self, consumer: str, min_idle_ms: int, count: int = 64) -> list[tuple[str, str]]:
        """Claim entries a dead streamer left pending for longer than ``min_idle_ms``
        (and, if any, set a new hand-off epoch in the same call)."""
        res: Any = self._take_over(
            keys=[self.keys.new_requests, self.keys.handoff_epoch],
            args=[GROUP, consumer, min_idle_ms, count, uuid.uuid4().hex],
        )
        out = []
        for eid, fields in res[1]:
            if fields:  # entries trimmed away come back without fields
                values = dict(zip(fields[::2], fields[1::2], strict=True))
                out.append((_s(eid), _s(values[b"r"])))
            else:
                self.redis.xack(self.keys.new_requests, GROUP, eid)
        return out

    def ack(self, entry_id: str) -> None:
        self.redis.xack(self.keys.new_requests, GROUP, entry_id)

    def queue_ack(self, pipe: Pipeline, entry_id: str) -> None:
        """``ack(entry_id)``, added to ``pipe``."""
        pipe.xack(self.keys.new_requests, GROUP, entry_id)


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def last_entries(client: redis.Redis, keys: Sequence[str]) -> list[dict[bytes, bytes]]:
    """The fields of each stream's last entry ({} for an empty or missing stream), in
    one round trip: how a writer whose reply was lost finds out whether its append ran
    (the streamer's output writes, the engine thread's publishes)."""
    pipe = client.pipeline(transaction=False)
    for key in keys:
        pipe.xrevrange(key, count=1)
    return [last[0][1] if last else {} for last in pipe.execute()]


def below_ms(entry_id: str) -> str:
    """The greatest stream id before every id of ``entry_id``'s millisecond: a cursor
    that reads all of another stream's entries from that millisecond on."""
    ms = int(entry_id.partition("-")[0])
    return f"{ms - 1}-18446744073709551615" if ms > 0 else "0-0"


def step_line(key: str, second: str | int, n: int, payload: bytes) -> bytes:
    """One chunk's four lines in a step entry (``split_step`` reads them back): the
    worker and the streamer write the lines of their plain chunks themselves (the
    scripts write the others, in the same form)."""
    return f"{key}\n{second}\n{n}\n".encode() + payload


def step_head(key: str, second: str | int) -> bytes:
    """The first two of a chunk's four lines: ``step_line(key, second, n, payload)`` is
    ``b"%s%d\\n%s" % (step_head(key, second), n, payload)``. What a writer that formats
    one stream's lines at every step keeps (the worker, per request attempt)."""
    return f"{key}\n{second}\n".encode()


def split_step(raw: bytes) -> list[tuple[str, str, int, bytes]]:
    """A step stream entry's ``d``: (stream key, entry id, ordinal, payload) for every
    entry the call appended: a worker's publish (token streams, ``Keys.steps``) or a
    streamer's output write (output streams, ``Keys.output_steps``). Four lines each;
    payloads are JSON, which never holds a raw newline."""
    parts = raw.split(b"\n")
    return [
        (parts[i].decode(), parts[i + 1].decode(), int(parts[i + 2]), parts[i + 3])
        for i in range(0, len(parts) - 3, 4)
    ]


def step_columns(raw: bytes) -> tuple[list[bytes], list[int], list[bytes]]:
    """``split_step`` by columns: the stream keys (bytes, not decoded), the ordinals and
    the payloads. Why: a streamer splits every line of every worker step, one per
    request per engine step; columns cost no tuple and no decoded key per line."""
    parts = raw.split(b"\n")
    end = len(parts) - len(parts) % 4
    return parts[0:end:4], [int(n) for n in parts[2:end:4]], parts[3:end:4]


def step_entry_columns(
    key: str, entries: list[Any]
) -> Iterator[tuple[dict[bytes, Any], tuple[list[bytes], list[int], list[bytes]]]]:
    """The fields and lines (``step_columns``) of each entry read from step stream
    ``key``. A malformed entry is logged and skipped: a bug upstream, and the streams in
    it find their gap."""
    for eid, fields in entries:
        try:
            columns = step_columns(fields[b"d"])
        except Exception:
            logger.error("malformed step entry %s in %s", _s(eid), key)
            continue
        yield fields, columns


def _hub_events(raw: bytes, eid: str, key: str) -> list[OutputEvent]:
    """An output entry's events, as the hub hands them over: a malformed entry ends
    that request (``MALFORMED_OUTPUT``), nothing else."""
    try:
        return decode_events(raw)
    except Exception:
        logger.exception("output hub: malformed entry %s of %s", eid, key)
        return [MALFORMED_OUTPUT]


def _min_id(a: str, b: str) -> str:
    return a if _id_order(a) <= _id_order(b) else b


def _id_order(entry_id: str) -> tuple[int, int]:
    """A stream entry id as a comparable pair (ids compare numerically, not as text)."""
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


class Pumped(enum.Enum):
    """What a subscription's pump did with an entry the hub offered it."""

    TAKEN = "taken"  # delivered; keep offering
    TAKEN_LAST = "taken_last"  # delivered, but offer no more: wake the reader
    DECLINED = "declined"  # not delivered: queue it (and all after it) for the reader


# Queued by a pump that stopped after taking its entry: wakes a reader blocked in
# ``take``, which then behaves as if its wait had timed out.
_WAKE: tuple[str, list[OutputEvent] | bytes, int] = ("", [], 0)


@dataclass(slots=True, eq=False)
class Subscription:
    """One reader's view of one output stream, fed by an ``OutputHub``.

    The hub hands it entries until ``buffered`` (encoded bytes not yet taken) reaches
    the hub's ``buffer_bytes``; the rest waits in Redis, so a client that does not read
    costs its web process at most that much. Readers take entries with ``take`` (which
    keeps the count); ``taken_at`` is when the reader last took one, which tells a
    stalled reader (dropped: ``dropped`` is set, ``on_drop`` called) from a slow one.

    A reader with nothing queued may install a *pump* (``start_pump``) before it waits:
    the hub then calls the pump with each entry, on the hub's thread, instead of
    queueing it and waking the reader, so a stream that flows costs no thread hand-off
    per entry (the SSE route writes its frames from there, ``web.sse_pump``). The pump
    runs under the subscription's lock, so ``stop_pump`` returns only once no call is
    running and none will start: the reader owns its state again. A pump that declines
    an entry (or takes it as its last) is removed, and the reader gets the entry (or a
    wake-up) in its queue as before.
    """

    request_id: str
    key: str
    n: int  # the ordinal of the last chunk handed over (0: none)
    entries: queue.SimpleQueue[tuple[str, list[OutputEvent] | bytes, int]]
    notify: threading.Event | None = None  # set on every entry (one wait for many streams)
    on_drop: Callable[[], None] | None = None
    buffered: int = 0
    taken_at: float = field(default_factory=time.monotonic)
    dropped: bool = False
    pump: Callable[[str, list[OutputEvent]], Pumped] | None = None
    # The output stream's entries up to this one hold no chunk after ``n``: where the
    # stream itself is read from when the subscription needs it (``reload``).
    cursor: str = "0-0"
    # Read the output stream itself next (at the start; after a chunk it could not
    # take from a step stream: its buffer was full, or the chunk came after a gap).
    reload: bool = True
    _count_lock: threading.Lock = field(default_factory=threading.Lock)

    def put(self, eid: str, chunk: list[OutputEvent] | bytes, size: int) -> None:
        """Hand an entry to the reader: to its pump if it has one, else to its queue.

        ``chunk``: its events, or the chunk as read (``encode_events``), decoded where it
        is read: by the pump, or on the reader's own thread in ``take``. Why: a reader
        that waits is woken only once the hub's thread lets go of the GIL, after it has
        handed every line of the step it read, so the hub's share of each line (the
        decode was a quarter of it) delays every queued reader's first line."""
        with self._count_lock:
            pump = self.pump
            if pump is not None:
                chunk = self._events(eid, chunk)
                verdict = pump(eid, chunk)
                if verdict is Pumped.TAKEN:
                    self.taken_at = time.monotonic()
                    return
                self.pump = None
                if verdict is Pumped.TAKEN_LAST:
                    self.taken_at = time.monotonic()
                    self.entries.put(_WAKE)
                    return
            self.buffered += size
            # Under the lock: a pump started between the count and the put would
            # deliver later entries ahead of this one.
            self.entries.put((eid, chunk, size))

    def start_pump(self, pump: Callable[[str, list[OutputEvent]], Pumped]) -> bool:
        """Let the hub deliver entries through ``pump`` until it declines one or
        ``stop_pump``. Refused (False) while entries wait in the queue: they come first."""
        with self._count_lock:
            if not self.entries.empty() or self.dropped:
                return False
            self.pump = pump
            return True

    def stop_pump(self) -> None:
        """No pump call is running or will start once this returns."""
        if self.pump is not None:
            with self._count_lock:
                self.pump = None

    def take(self, timeout_s: float | None) -> tuple[str, list[OutputEvent]]:
        """The next entry (``timeout_s`` None: do not wait); raises ``queue.Empty``
        (also when a pump that stopped woke the reader)."""
        if timeout_s is None:
            entry = self.entries.get_nowait()
        else:
            entry = self.entries.get(timeout=max(timeout_s, 0.0))
        if entry is _WAKE:
            raise queue.Empty
        eid, chunk, size = entry
        with self._count_lock:
            self.buffered -= size
            self.taken_at = time.monotonic()
        return eid, self._events(eid, chunk)

    def _events(self, eid: str, chunk: list[OutputEvent] | bytes) -> list[OutputEvent]:
        """A handed entry's events: decoded here, by whoever reads it, when the hub
        handed the chunk's bytes (``put``)."""
        return _hub_events(chunk, eid, self.key) if isinstance(chunk, bytes) else chunk

    def full(self, limit: int | None) -> bool:
        return limit is not None and self.buffered >= limit


@dataclass(slots=True, eq=False)
class _Follow:
    """Where the hub reads an output stream's chunks after its last checkpoint: the
    step stream of the streamer that wrote it (``steps``; None: the stream itself
    names none, read the stream only), from after ``sid``; and when a chunk last came."""

    steps: str | None
    sid: str
    at: float


class OutputHub:
    """One reader thread per process for every output stream its clients follow.

    A web process may hold hundreds of open streams. Reading each with its own blocking
    XREAD costs a Redis connection per stream and a round trip per token per stream;
    the hub reads them all with one blocking XREAD and hands each chunk to its
    subscriber's queue. A request's chunks are in its output stream up to its last
    checkpoint and in its streamer's output step stream after it (broker/chunks.py),
    so a stream is read on its own only when a subscription starts, after a gap, or
    after a quiet spell (it may have moved to another streamer); otherwise its chunks
    come from the step streams, one entry per streamer write for all its requests. A
    subscription wakes the hub through a small stream of its own (a plain XREAD key),
    so a new request waits for no timeout.
    """

    def __init__(
        self,
        client: redis.Redis,
        keys: Keys,
        *,
        block_ms: int = 1000,
        ttl_s: int = 3600,
        buffer_bytes: int | None = None,
        stall_s: float = 30.0,
    ) -> None:
        self.redis = client
        self.keys = keys
        self.block_ms = block_ms
        self.ttl_s = ttl_s
        # Per subscription: encoded output held for a reader that has not taken it
        # (None: unbounded), and how long a full one may go without taking anything
        # before it is dropped.
        self.buffer_bytes = buffer_bytes
        self.stall_s = stall_s
        self.wake_key = keys.hub_wake(uuid.uuid4().hex)
        self._direct = DirectConnection(client)  # the reader thread's own connection
        self._wake_cursor = "0-0"
        # Per output stream: the step stream it is followed through, and where each
        # step stream is read from (the reading thread's own state).
        self._follow: dict[str, _Follow] = {}
        self._step_cursors: dict[str, str] = {}
        self._bad_steps: set[str] = set()  # not streams (overwritten): never followed
        self.stepped = 0  # chunks handed over from step streams (tests, diagnostics)
        # Usually one subscriber per stream; two while a client resumes on this process
        # before its old connection noticed it was gone.
        self._subs: dict[str, list[Subscription]] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._down_since: float | None = None  # monotonic time of the first failed read
        # Cuts a reconnect backoff short: a new subscription means a request was just
        # admitted, so Redis is probably back and its client should not wait for the
        # rest of the backoff (up to 2 s) before its first event.
        self._kick = threading.Event()
        self.stopping = threading.Event()

    def subscribe(
        self,
        rid: str,
        after: int = 0,
        *,
        notify: threading.Event | None = None,
        on_drop: Callable[[], None] | None = None,
        wake: bool = True,
    ) -> Subscription:
        """Follow ``rid`` from the chunk after ordinal ``after``; chunks arrive in
        order (``sub.take``), as (ordinal, events).

        ``on_drop`` is called (on the hub's thread) when the reader stalls with a full
        buffer and the hub drops it. The wake-up is best effort: with Redis down the
        hub's next read (after its reconnect) picks the new subscription up anyway.
        ``wake=False``: the caller sends it, in its own round trip (``queue_wake``).
        """
        sub = Subscription(rid, self.keys.output(rid), after, queue.SimpleQueue(), notify, on_drop)
        with self._lock:
            self._subs.setdefault(sub.key, []).append(sub)
            if self._thread is None:  # started lazily: after gunicorn forked us
                self._thread = threading.Thread(target=self._run, name="output-hub", daemon=True)
                self._thread.start()
        self._kick.set()
        if wake:
            try:
                pipe = self.redis.pipeline(transaction=False)
                self.queue_wake(pipe, rid)
                pipe.execute()
            except redis.RedisError as exc:
                logger.warning("output hub: could not wake the reader (%s)", exc)
        return sub

    def queue_wake(self, pipe: Pipeline, rid: str) -> None:
        """Add the reader's wake-up for a new subscription to ``rid`` to ``pipe``: its
        blocking read returns and reads again with the new stream in it."""
        pipe.xadd(self.wake_key, {"r": rid}, maxlen=16, approximate=True)
        pipe.expire(self.wake_key, self.ttl_s)

    def unsubscribe(self, sub: Subscription) -> None:
        with self._lock:
            subs = self._subs.get(sub.key, [])
            if sub in subs:
                subs.remove(sub)
            if not subs:
                self._subs.pop(sub.key, None)

    @property
    def followed(self) -> int:
        return sum(len(subs) for subs in self._subs.values())

    def down_for(self) -> float:
        """Seconds the hub has been failing to read from Redis (0.0 when reading)."""
        since = self._down_since
        return 0.0 if since is None else max(time.monotonic() - since, 1e-6)

    def _run(self) -> None:
        backoff = 0.1
        while not self.stopping.is_set():
            with self._lock:
                if not self._subs:  # nothing to follow: exit; subscribe starts a new one
                    self._thread = None
                    self._down_since = None
                    self._follow.clear()
                    self._step_cursors.clear()
                    return
            try:
                self._drop_stalled()
                self._read_once()
                if self._down_since is not None:
                    logger.info("output hub: redis is back after %.1fs", self.down_for())
                self._down_since = None
                backoff = 0.1
            except redis.ResponseError as exc:  # Redis is up, but refuses one key
                self._drop_unreadable(exc)
            except redis.RedisError as exc:
                if self._down_since is None:
                    self._down_since = time.monotonic()
                    logger.warning("output hub: redis error (%s); reconnecting", exc)
                with self._lock:  # read every stream on its own once back
                    for subs in self._subs.values():
                        for sub in subs:
                            sub.reload = True
                self._kick.clear()
                kicked = self._kick.wait(backoff)
                backoff = 0.1 if kicked else min(backoff * 2, 2.0)
            except Exception:  # never let the reader die: one bad entry is skipped
                logger.exception("output hub: unexpected error")
                self.stopping.wait(0.5)

    def _drop_unreadable(self, exc: redis.ResponseError) -> None:
        """End the subscriptions whose stream XREAD refuses (a key that is not a stream,
        WRONGTYPE): one bad key must not stall every stream this process follows. Each
        gets the unreadable-output error, as for a malformed entry; the others go on."""
        with self._lock:
            streams = {
                key: min((sub.cursor for sub in subs), key=_id_order)
                for key, subs in self._subs.items()
            }
        streams[self.wake_key] = self._wake_cursor
        streams.update(self._step_cursors)
        try:
            pipe = self.redis.pipeline(transaction=False)
            for key, cursor in streams.items():
                pipe.xread({key: cursor}, count=1)
            results = pipe.execute(raise_on_error=False)
        except redis.RedisError:  # gone meanwhile: the next read reconnects
            return
        bad = [k for k, r in zip(streams, results, strict=True) if isinstance(r, Exception)]
        if self.wake_key in bad:  # our own key, overwritten: start it afresh
            bad.remove(self.wake_key)
            logger.error(
                "output hub: wake-up key %s is not a stream (%s); recreating it", self.wake_key, exc
            )
            self._wake_cursor = "0-0"
            try:
                self.redis.delete(self.wake_key)
            except redis.RedisError:
                return
            if not bad:
                return
        for key in [key for key in bad if key in self._step_cursors]:
            # A streamer's step stream overwritten by something else: its streams are
            # read on their own from now on (their chunks come at their checkpoints).
            logger.error("output hub: step stream %s is not a stream; not following it", key)
            bad.remove(key)
            self._bad_steps.add(key)
            del self._step_cursors[key]
            for f in self._follow.values():
                if f.steps == key:
                    f.steps = None
            if not bad:
                return
        if not bad:  # nothing to blame on one stream: do not spin on it
            logger.error("output hub: redis refused a read (%s)", exc)
            self.stopping.wait(0.5)
            return
        for key in bad:
            logger.error("output hub: cannot read %s (%s); ending its requests", key, exc)
            with self._lock:
                subs = self._subs.pop(key, [])
            for sub in subs:
                # "": made here, not read from the stream (the reader keeps its cursor).
                sub.put("", [MALFORMED_OUTPUT], 0)
                if sub.notify is not None:
                    sub.notify.set()

    def _drop_stalled(self) -> None:
        """Drop subscriptions whose buffer is full and whose reader has taken nothing
        for ``stall_s``: a client that stopped reading (its socket's buffers full) must
        not pin its generation and admission slot. A reader that keeps taking, however
        slowly, is never dropped: its buffer only pauses the hub's reads for it."""
        if self.buffer_bytes is None:
            return
        now = time.monotonic()
        with self._lock:
            stalled = [
                sub
                for subs in self._subs.values()
                for sub in subs
                if sub.full(self.buffer_bytes) and now - sub.taken_at > self.stall_s
            ]
            for sub in stalled:
                subs = self._subs.get(sub.key, [])
                subs.remove(sub)
                if not subs:
                    self._subs.pop(sub.key, None)
        for sub in stalled:
            logger.warning(
                "output hub: reader of %s took nothing for %.0fs with %d bytes waiting; "
                "dropping it",
                sub.request_id,
                now - sub.taken_at,
                sub.buffered,
            )
            sub.dropped = True
            if sub.notify is not None:
                sub.notify.set()
            if sub.on_drop is not None:
                try:
                    sub.on_drop()
                except Exception:  # the hub serves every other stream: never die here
                    logger.exception("output hub: dropping the reader of %s failed", sub.key)

    def _read_once(self) -> None:
        limit = self.buffer_bytes
        now = time.monotonic()
        streams: dict[Any, Any] = {}
        steps: dict[str, str] = {}
        planned: dict[str, list[Subscription]] = {}  # read on their own this time
        paused = False
        with self._lock:
            for key, subs in self._subs.items():
                open_subs = [sub for sub in subs if not sub.full(limit)]
                paused = paused or len(open_subs) < len(subs)
                if not open_subs:
                    continue
                f = self._follow.get(key)
                if f is not None and f.steps is not None:
                    cursor = self._step_cursors.get(f.steps) or f.sid
                    if any(sub.reload for sub in open_subs):
                        cursor = _min_id(cursor, f.sid)  # the tail after the checkpoint
                    steps[f.steps] = _min_id(steps.get(f.steps, cursor), cursor)
                if f is None or f.steps is None or now - f.at >= STEP_QUIET_S:
                    planned[key] = list(open_subs)
                elif any(sub.reload for sub in open_subs):
                    planned[key] = [sub for sub in open_subs if sub.reload]
                if key in planned:
                    streams[key] = min((sub.cursor for sub in planned[key]), key=_id_order)
            for key in [key for key in self._follow if key not in self._subs]:
                del self._follow[key]
        self._step_cursors = dict(steps)  # the step streams no stream needs are dropped
        streams[self.wake_key] = self._wake_cursor
        streams.update(steps)
        # Paused readers free room by taking, which does not wake the hub: look again soon.
        block = min(self.block_ms, PAUSED_POLL_MS) if paused else self.block_ms
        res: Any = self._direct.call(*xread_command(streams, count=256, block_ms=block))
        res = read_rest(self._direct, streams, res, count=256, quiet=(self.wake_key, *steps))
        got: dict[str, list[Any]] = {}
        read_steps: list[tuple[str, list[Any]]] = []
        for key_raw, entries in res or []:
            key = _s(key_raw)
            if not entries:
                continue
            if key == self.wake_key:
                self._wake_cursor = _s(entries[-1][0])
            elif key in steps:
                read_steps.append((key, entries))
            else:
                got[key] = entries
        handed: list[Subscription] = []
        rewind: dict[str, str] = {}  # step streams to read again from a checkpoint's entry
        for key, subs in planned.items():  # the streams read on their own come first
            self._take_entries(key, subs, got.get(key, []), now, handed, rewind)
        for key, entries in read_steps:
            self._take_steps(key, entries, now, handed)
        for key, sid in rewind.items():
            self._step_cursors[key] = _min_id(self._step_cursors.get(key, sid), sid)
        # Each event once: readers that wait for many streams on one event (``notify``)
        # are woken once per read, not once per stream (64 sets of one event cost more
        # than the hand-off of a line).
        for event in {sub.notify for sub in handed if sub.notify is not None}:
            event.set()
        if res:
            # Let the readers just handed entries run now (sleep(0) releases the GIL)
            # rather than after this thread has built its next read and blocked in it:
            # a reader of a step's 64 streams got them ~0.14 ms sooner (relay paced run).
            time.sleep(0)

    def _hand(self, sub: Subscription, n: int, raw: bytes, key: str, jump: bool = False) -> bool:
        """Hand chunk ``n`` to ``sub`` if it is the next one it needs and it has room;
        whether it has chunk ``n`` now (handed now or before). ``jump``: a chunk after a
        gap is handed all the same (read from the stream itself, whose entries hold every
        chunk from its first: a gap there means Redis lost data, and the reader must
        still get to the stream's end)."""
        if n <= sub.n:
            return True
        if sub.full(self.buffer_bytes):
            return False
        if n != sub.n + 1:
            if not jump:
                return False
            logger.warning(
                "output hub: %s lost chunks %d..%d (Redis lost data?)", key, sub.n + 1, n - 1
            )
        eid = str(n)
        sub.n = n
        sub.put(eid, raw, len(raw))
        return True

    def _take_entries(
        self,
        key: str,
        subs: list[Subscription],
        entries: list[Any],
        now: float,
        handed: list[Subscription],
        rewind: dict[str, str],
    ) -> None:
        """Entries read from output stream ``key`` itself (checkpoints), for the
        subscriptions that needed it: their chunks in order; then follow the stream
        through the step stream its last entry names, from that entry's step entry
        (``rewind``: read again from there once this read's step entries are taken)."""
        with self._lock:  # unsubscribed meanwhile: not handed anything
            current = self._subs.get(key, [])
            subs = [sub for sub in subs if sub in current]
        whole = {id(sub): True for sub in subs}  # every chunk read handed to it
        for eid_raw, fields in entries:
            eid = _s(eid_raw)
            try:
                chunks = entry_chunks(fields)
            except Exception:
                logger.exception("output hub: malformed entry %s of %s", eid, key)
                chunks = []
            for sub in subs:
                if _id_order(eid) <= _id_order(sub.cursor) or not whole[id(sub)]:
                    continue
                if not chunks:
                    # "": made here, not read from the stream (the reader keeps its cursor).
                    sub.put("", [MALFORMED_OUTPUT], 0)
                    handed.append(sub)
                    continue
                before = sub.n
                if all(self._hand(sub, n, raw, key, jump=True) for n, raw in chunks):
                    sub.cursor = eid
                else:
                    whole[id(sub)] = False  # its buffer filled: the rest on a later read
                if sub.n != before:
                    handed.append(sub)
        for sub in subs:
            sub.reload = not whole[id(sub)]
        f = self._follow.get(key)
        if entries:
            fields = entries[-1][1]
            writer, sid = fields.get(b"w"), fields.get(b"i")
            steps = self.keys.output_steps(_s(writer)) if writer and sid else None
            if steps in self._bad_steps:
                steps = None
            f = _Follow(steps, _s(sid) if steps and sid else "0-0", now)
            self._follow[key] = f
            if steps is not None:
                rewind[steps] = _min_id(rewind.get(steps, f.sid), f.sid)
        elif f is None:
            self._follow[key] = _Follow(None, "0-0", now)
        elif now - f.at >= STEP_QUIET_S:
            f.at = now  # quiet and nothing new: look at the stream again a second later

    def _take_steps(
        self, key: str, entries: list[Any], now: float, handed: list[Subscription]
    ) -> None:
        """Entries of output step stream ``key``: each holds the chunks one streamer
        write appended, a line each. A line is handed to each subscription of its
        stream that needs it next (its ordinal says so); one it has is skipped; after
        a gap (its buffer filled, the step stream was trimmed past it) the subscription
        reads the stream itself again (``reload``), where a checkpoint holds the rest."""
        self._step_cursors[key] = _s(entries[-1][0])
        follow, subs_of = self._follow, self._subs
        for _fields, (okeys, ordinals, payloads) in step_entry_columns(key, entries):
            # One pass: each line is handed as soon as it is split, not after every
            # line of the step was (a step's first lines reach their readers sooner).
            for okey_b, n, payload in zip(okeys, ordinals, payloads, strict=True):
                okey = okey_b.decode()
                f = follow.get(okey)
                if f is None or f.steps != key:
                    continue
                # No lock: one dict lookup and one copy of its list, each a single step
                # that the lock's holders (subscribe, unsubscribe) cannot split. A
                # subscription added meanwhile reads its stream itself first anyway.
                for sub in tuple(subs_of.get(okey, ())):
                    if sub.reload:
                        continue  # reads the stream itself next, then the tail
                    before = sub.n
                    if not self._hand(sub, n, payload, okey):
                        sub.reload = True
                    elif sub.n != before:
                        f.at = now
                        self.stepped += 1
                        handed.append(sub)
