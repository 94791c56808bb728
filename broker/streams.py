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
from typing import Any

import orjson
import redis
from redis.client import Pipeline

from app.messages import OutputEvent, OutputKind
from broker import scripts
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


def decode_events(raw: str | bytes) -> list[OutputEvent]:
    return [OutputEvent.decode(x) for x in orjson.loads(raw)]


@dataclass(slots=True)
class OutputEntry:
    request_id: str
    events: list[OutputEvent]
    source: str  # the ordinal of the last token chunk these events were decoded from
    first: bool = False
    published: bytes | None = None  # worker publish time of the source entry (latency)
    handoff_id: str = ""  # the request's hand-off entry: written only while we own it


class OutputStreams:
    """Write and read per-request output streams."""

    def __init__(self, client: redis.Redis, keys: Keys, *, ttl_s: int = 3600) -> None:
        self.redis = client
        self.keys = keys
        self.ttl_s = ttl_s
        self._write_fenced = client.register_script(scripts.WRITE_OUTPUTS)
        # The hand-off epoch under which the owner last found which of its hand-off
        # entries are its own (``RequestHandoff.owners``); None: check every entry.
        self.fence_epoch: str | None = None

    def write(self, entries: Sequence[OutputEntry], owner: str | None = None) -> set[str]:
        """Append many requests' events in one round trip.

        ``owner`` (a streamer's consumer name) fences the entries that carry a
        ``handoff_id``: each is written only if that streamer still owns the request's
        hand-off entry. Returns the ids of the requests not written because another
        streamer has taken them over."""
        if not entries:
            return set()
        if owner is not None:
            return self._write_owned(entries, owner)
        pipe = self.redis.pipeline(transaction=False)
        for e in entries:
            key = self.keys.output(e.request_id)
            fields: dict[Any, Any] = {"e": encode_events(e.events), "s": e.source}
            if e.published is not None:
                fields["p"] = e.published
            pipe.xadd(key, fields)
            if e.first:
                pipe.expire(key, self.ttl_s)
        pipe.execute()
        return set()

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
    ) -> Any:
        """``write(entries, owner)`` and then a blocking XREAD of ``streams``, sent as one
        round trip: a streamer's steady cycle costs one wake-up instead of two, and the
        outputs are in Redis as soon as they would have been written alone.

        The write's reply is read before the read's, and ``on_written`` gets the fenced
        request ids at once: if the connection breaks while the read blocks, the caller
        still knows its entries are written (and must not write them again into a Redis
        that has come back empty). If Redis lost the script (restarted), the write is
        redone with the script loaded before the read's reply is handed back.
        Returns the XREAD reply."""
        keys, args = self._fenced_args(entries, owner)
        via.send(
            ("EVALSHA", self._write_fenced.sha, len(keys), *keys, *args),
            xread_command(streams, count=count, block_ms=block_ms),
        )
        try:
            fenced: Any = via.reply("EVALSHA")
        except redis.ResponseError as exc:
            fenced = exc  # the read's reply follows all the same
        else:
            on_written(self._fenced_ids(entries, fenced))
        read = via.reply("XREAD")
        if isinstance(fenced, redis.exceptions.NoScriptError):
            on_written(self._write_owned(entries, owner))
        elif isinstance(fenced, Exception):
            raise fenced
        return read

    def _fenced_args(
        self, entries: Sequence[OutputEntry], owner: str
    ) -> tuple[list[str], list[Any]]:
        keys = [self.keys.new_requests, self.keys.handoff_epoch]
        keys += [self.keys.output(e.request_id) for e in entries]
        keys.append(self.keys.output_steps(owner))
        epoch = "" if self.fence_epoch is None else f"e:{self.fence_epoch}"
        args: list[Any] = [GROUP, owner, self.ttl_s, epoch]
        for e in entries:
            args += [e.handoff_id, "1" if e.first else "0", encode_events(e.events)]
            args += [e.source, e.published if e.published is not None else ""]
        return keys, args

    @staticmethod
    def _fenced_ids(entries: Sequence[OutputEntry], fenced: Any) -> set[str]:
        return {entries[int(i) - 1].request_id for i in fenced or []}

    def _write_owned(self, entries: Sequence[OutputEntry], owner: str) -> set[str]:
        keys, args = self._fenced_args(entries, owner)
        return self._fenced_ids(entries, self._write_fenced(keys=keys, args=args))

    def last_source(self, rid: str) -> tuple[str, bool] | None:
        """(the token chunk ordinal of the last written entry, whether the stream has ended)."""
        return self.last_source_of(self.redis.xrevrange(self.keys.output(rid), count=1))

    def queue_last_source(self, pipe: Pipeline, rid: str) -> None:
        """``last_source(rid)``'s read, added to ``pipe``; ``last_source_of`` reads it."""
        pipe.xrevrange(self.keys.output(rid), count=1)

    @staticmethod
    def last_source_of(last: Any) -> tuple[str, bool] | None:
        if not last:
            return None
        fields = last[0][1]
        events = decode_events(fields[b"e"])
        return _s(fields[b"s"]), any(is_terminal(ev) for ev in events)

    def lost(self, rid: str) -> bool:
        """Neither the request's record nor its output exists (expired, or Redis was
        restarted without persistence): nothing will ever be written for it."""
        found: Any = self.redis.exists(self.keys.request(rid), self.keys.output(rid))
        return not found

    def read(
        self, rid: str, cursor: str = "0-0", *, block_ms: int | None = None, count: int = 256
    ) -> list[tuple[str, list[OutputEvent]]]:
        """Entries after ``cursor`` (blocking up to ``block_ms`` for the first)."""
        res: Any = self.redis.xread({self.keys.output(rid): cursor}, count=count, block=block_ms)
        if not res:
            return []
        return [(_s(eid), decode_events(f[b"e"])) for eid, f in res[0][1]]

    def follow(
        self, rid: str, cursor: str = "0-0", *, timeout_s: float = 600.0, block_ms: int = 1000
    ) -> Iterator[tuple[str, OutputEvent]]:
        """Every event after ``cursor`` until the terminal one, as (entry id, event).

        Raises TimeoutError when nothing arrives for ``timeout_s`` (the streamers'
        watchdog ends every stream long before that; this only guards the reader).
        """
        last_progress = time.monotonic()
        while True:
            entries = self.read(rid, cursor, block_ms=block_ms)
            if not entries:
                if time.monotonic() - last_progress > timeout_s:
                    raise TimeoutError(f"no output for request {rid} in {timeout_s}s")
                continue
            last_progress = time.monotonic()
            for eid, events in entries:
                cursor = eid
                for ev in events:
                    yield eid, ev
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


def step_entries(
    key: str, entries: list[Any]
) -> Iterator[tuple[dict[bytes, Any], list[tuple[str, str, int, bytes]]]]:
    """The fields and lines (``split_step``) of each entry read from step stream ``key``.
    A malformed entry is logged and skipped: a bug upstream, and the streams in it find
    their gap."""
    for eid, fields in entries:
        try:
            items = split_step(fields[b"d"])
        except Exception:
            logger.error("malformed step entry %s in %s", _s(eid), key)
            continue
        yield fields, items


def _hub_events(raw: bytes, eid: str, key: str) -> list[OutputEvent]:
    """An output entry's events, as the hub hands them over: a malformed entry ends
    that request (``MALFORMED_OUTPUT``), nothing else."""
    try:
        return decode_events(raw)
    except Exception:
        logger.exception("output hub: malformed entry %s of %s", eid, key)
        return [MALFORMED_OUTPUT]


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
_WAKE: tuple[str, list[OutputEvent], int] = ("", [], 0)


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
    cursor: str
    entries: queue.SimpleQueue[tuple[str, list[OutputEvent], int]]
    notify: threading.Event | None = None  # set on every entry (one wait for many streams)
    on_drop: Callable[[], None] | None = None
    buffered: int = 0
    taken_at: float = field(default_factory=time.monotonic)
    dropped: bool = False
    pump: Callable[[str, list[OutputEvent]], Pumped] | None = None
    _count_lock: threading.Lock = field(default_factory=threading.Lock)

    def put(self, eid: str, events: list[OutputEvent], size: int) -> None:
        """Hand an entry to the reader: to its pump if it has one, else to its queue."""
        with self._count_lock:
            pump = self.pump
            if pump is not None:
                verdict = pump(eid, events)
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
            self.entries.put((eid, events, size))

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
        eid, events, size = entry
        with self._count_lock:
            self.buffered -= size
            self.taken_at = time.monotonic()
        return eid, events

    def full(self, limit: int | None) -> bool:
        return limit is not None and self.buffered >= limit


@dataclass(slots=True, eq=False)
class _Follow:
    """An output stream the hub follows through a streamer's output step stream:
    its lone reader, the ordinal of the entry at the reader's cursor, and when the last
    entry came (``steps`` None: read the stream on its own for now)."""

    sub: Subscription
    n: int
    steps: str | None
    at: float


class OutputHub:
    """One reader thread per process for every output stream its clients follow.

    A web process may hold hundreds of open streams. Reading each with its own blocking
    XREAD costs a Redis connection per stream and a round trip per token per stream;
    the hub reads them all with one blocking XREAD and hands each entry to its
    subscriber's queue. A subscription wakes the hub through a small stream of its own
    (a plain XREAD key), so a new request waits for no timeout.
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
        # Output streams followed through their streamer's output step stream, and where
        # each step stream is read from (the reading thread's own state).
        self._follow: dict[str, _Follow] = {}
        self._step_cursors: dict[str, str] = {}
        self._bad_steps: set[str] = set()  # not streams (overwritten): never followed
        self.stepped = 0  # entries handed over from step streams (tests, diagnostics)
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
        cursor: str = "0-0",
        *,
        notify: threading.Event | None = None,
        on_drop: Callable[[], None] | None = None,
        wake: bool = True,
    ) -> Subscription:
        """Follow ``rid`` from ``cursor``; entries arrive in order (``sub.take``).

        ``on_drop`` is called (on the hub's thread) when the reader stalls with a full
        buffer and the hub drops it. The wake-up is best effort: with Redis down the
        hub's next read (after its reconnect) picks the new subscription up anyway.
        ``wake=False``: the caller sends it, in its own round trip (``queue_wake``).
        """
        sub = Subscription(rid, self.keys.output(rid), cursor, queue.SimpleQueue(), notify, on_drop)
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
            # read on their own from now on.
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
        with self._lock:
            # A subscription whose buffer is full is paused: its entries wait in Redis.
            streams: dict[Any, Any] = {}
            via_steps: dict[str, Subscription] = {}  # followed through a step stream
            paused = False
            for key, subs in self._subs.items():
                open_subs = [sub for sub in subs if not sub.full(limit)]
                paused = paused or len(open_subs) < len(subs)
                if not open_subs:
                    continue
                f = self._follow.get(key)
                if (
                    f is not None
                    and f.steps is not None
                    and len(subs) == 1
                    and subs[0] is f.sub
                    and now - f.at < STEP_QUIET_S
                ):
                    via_steps[key] = f.sub
                else:
                    streams[key] = min((sub.cursor for sub in open_subs), key=_id_order)
            for key in [key for key in self._follow if key not in self._subs]:
                del self._follow[key]
        steps = {
            f.steps: self._step_cursors.get(f.steps) or below_ms(f.sub.cursor)
            for key, f in self._follow.items()
            if key in via_steps and f.steps is not None
        }
        self._step_cursors = dict(steps)  # the step streams no stream needs are dropped
        streams[self.wake_key] = self._wake_cursor
        streams.update(steps)
        # Paused readers free room by taking, which does not wake the hub: look again soon.
        block = min(self.block_ms, PAUSED_POLL_MS) if paused else self.block_ms
        res: Any = self._direct.call(*xread_command(streams, count=256, block_ms=block))
        res = read_rest(self._direct, streams, res, count=256, quiet=(self.wake_key, *steps))
        read_steps: list[tuple[str, list[Any]]] = []
        for key_raw, entries in res or []:
            key = _s(key_raw)
            if not entries:
                continue
            if key == self.wake_key:
                self._wake_cursor = _s(entries[-1][0])
                continue
            if key in steps:
                read_steps.append((key, entries))
                continue
            with self._lock:
                subs = list(self._subs.get(key, ()))  # none: unsubscribed meanwhile
            # A subscription made during this read, from a cursor below the one the read
            # began at, waits for the next read (from its own cursor): handed these
            # entries, it would skip the ones between its cursor and the read's.
            began = _id_order(streams[key])
            alone = len(subs) == 1
            subs = [sub for sub in subs if _id_order(sub.cursor) >= began]
            last: Any = None  # the fields of the last entry handed to a lone reader
            for eid_raw, fields in entries:
                eid = _s(eid_raw)
                raw = fields[b"e"]
                events = _hub_events(raw, eid, key)
                for sub in subs:
                    # A full buffer takes no more: its cursor stays, and the entries
                    # after it are read again once its reader has caught up.
                    if _id_order(eid) > _id_order(sub.cursor) and not sub.full(limit):
                        sub.cursor = eid
                        sub.put(eid, events, len(raw))
                        last = fields
            if alone and len(subs) == 1 and last is not None:
                self._track(key, subs[0], last, now)
            else:
                self._follow.pop(key, None)
            for sub in subs:
                if sub.notify is not None:
                    sub.notify.set()
        for key, entries in read_steps:  # after the streams read on their own (gaps)
            self._take_steps(key, entries, via_steps, now)
        if res:
            # Let the readers just handed entries run now (sleep(0) releases the GIL)
            # rather than after this thread has built its next read and blocked in it:
            # a reader of a step's 64 streams got them ~0.14 ms sooner (relay paced run).
            time.sleep(0)

    def _track(self, key: str, sub: Subscription, fields: Any, now: float) -> None:
        """After ``sub``, alone on ``key``, was handed an entry read from the stream
        itself: follow the stream through the step stream of the streamer that wrote
        the entry (its ``w``), from the entry's ordinal (``n``) on. The step stream is
        read from the millisecond before the entry at the latest (its step entry was
        appended after it, in the same call); lines read twice are skipped by id."""
        n, writer = fields.get(b"n"), fields.get(b"w")
        steps = self.keys.output_steps(_s(writer)) if n and writer else None
        if steps is None or steps in self._bad_steps:
            self._follow.pop(key, None)
            return
        self._follow[key] = _Follow(sub, int(n), steps, now)
        start = below_ms(sub.cursor)
        current = self._step_cursors.get(steps)
        if current is None or _id_order(start) < _id_order(current):
            self._step_cursors[steps] = start

    def _take_steps(
        self, key: str, entries: list[Any], via_steps: dict[str, Subscription], now: float
    ) -> None:
        """Entries of output step stream ``key``: each holds the output entries one
        streamer write appended. A line is handed to the lone reader of its stream when it
        is the stream's next entry (its ordinal says so); one it has is skipped; after a
        gap (the reader's buffer filled, a second reader came, the step stream was
        trimmed past us) the stream is read on its own again."""
        limit = self.buffer_bytes
        self._step_cursors[key] = _s(entries[-1][0])
        with self._lock:  # the streams whose reader is still their only one
            alone = {
                okey
                for okey, sub in via_steps.items()
                if (subs := self._subs.get(okey)) and len(subs) == 1 and subs[0] is sub
            }
        handed: list[Subscription] = []
        for _fields, items in step_entries(key, entries):
            for okey, oid, n, payload in items:
                sub = via_steps.get(okey)
                f = self._follow.get(okey)
                if sub is None or f is None or f.steps != key or f.sub is not sub:
                    continue
                if _id_order(oid) <= _id_order(sub.cursor):
                    continue  # handed already (read on its own, or an earlier line)
                if okey not in alone or sub.full(limit) or n != f.n + 1:
                    f.steps = None
                    del via_steps[okey]
                    continue
                events = _hub_events(payload, oid, okey)
                sub.cursor = oid
                sub.put(oid, events, len(payload))
                f.n, f.at = n, now
                self.stepped += 1
                handed.append(sub)
        for sub in dict.fromkeys(handed):
            if sub.notify is not None:
                sub.notify.set()
