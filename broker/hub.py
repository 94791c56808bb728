"""The output hub: one thread per web process that reads every output stream its
requests follow and hands each reader its entries (``broker.subscription``), within a
buffer per reader, or lets a pump write them from the hub's thread (``web.sse_pump``).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis
from redis.client import Pipeline

from broker.chunks import entry_chunks
from broker.connection import as_str
from broker.direct import DirectConnection, read_rest, xread_command
from broker.keys import Keys
from broker.outputs import MALFORMED_OUTPUT
from broker.step_lines import step_entry_columns
from broker.subscription import Subscription

# How often the hub looks again at a paused subscription (full buffer) for room.
PAUSED_POLL_MS = 100
# A stream the hub follows through a streamer's output step stream and that got nothing
# from it for this long is read on its own again (one XREAD key more) until an entry
# comes: its request may have moved to another streamer, or just be slow.
STEP_QUIET_S = 1.0
# A stream read from behind (a replay from its start, a reader whose buffer filled) is
# read with XRANGE in pieces of this many entries, each a checkpoint of at most about
# CHECKPOINT_BYTES (2 MiB in all): about what one reader's buffer takes. In the one
# XREAD of the live streams it would come 256 entries (16 MiB) at a time, almost all
# dropped again for a reader with 1 MiB of room, and read again on its next turn: 300
# replays of a 14 MB stream took a web process from 120 MB to 1.2 GB (issue 47).
REPLAY_ENTRIES = 32
# ... and at most this many such streams in one read (the others on the next), so one
# read holds at most about REPLAY_STREAMS x REPLAY_ENTRIES checkpoints (32 MiB).
REPLAY_STREAMS = 16

logger = logging.getLogger(__name__)


def _min_id(a: str, b: str) -> str:
    return a if _id_order(a) <= _id_order(b) else b


def _id_order(entry_id: str) -> tuple[int, int]:
    """A stream entry id as a comparable pair (ids compare numerically, not as text)."""
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


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
        # The reader thread's own connection (to its shard's master on a cluster).
        self._direct = DirectConnection(client, self.wake_key if keys.clustered else None)
        self._wake_cursor = "0-0"
        # Per output stream: the step stream it is followed through, and where each
        # step stream is read from (the reading thread's own state).
        self._follow: dict[str, _Follow] = {}
        self._step_cursors: dict[str, str] = {}
        self._replay_turn = 0  # where the next read starts among streams read from behind
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

    def wake_all(self) -> None:
        """Wake every reader waiting here (the process is handing its streams over)."""
        with self._lock:
            subs = [sub for subs in self._subs.values() for sub in subs]
        for sub in subs:
            sub.wake()

    def stop(self) -> None:
        """End the reader thread at its next read (a benchmark's or test's hub)."""
        self.stopping.set()

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the reader and close its connection, which it keeps between threads
        (a process's hub lives as long as the process; a test's or benchmark's does
        not, and a connection left for the collector fails a warnings-strict run)."""
        self.stopping.set()
        self._kick.set()  # a reader waiting out a backoff
        thread = self._thread
        if thread is not None:
            thread.join(timeout_s)
        self._direct.close()

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
        now = time.monotonic()
        streams, steps, planned, paused = self._plan(now)
        replays = self._replays(planned, streams)
        streams[self.wake_key] = self._wake_cursor
        streams.update(steps)
        pieces: dict[str, list[Any]] = {}
        if replays:  # what is there now, without waiting: the pieces are waiting already
            res, pieces = self._read_pieces(replays, streams)
        else:
            # Paused readers free room by taking, which does not wake the hub: look
            # again soon.
            block = min(self.block_ms, PAUSED_POLL_MS) if paused else self.block_ms
            res = self._direct.call(*xread_command(streams, count=256, block_ms=block))
            res = read_rest(self._direct, streams, res, count=256, quiet=(self.wake_key, *steps))
        got: dict[str, list[Any]] = dict(pieces)
        read_steps: list[tuple[str, list[Any]]] = []
        for key_raw, entries in res or []:
            key = as_str(key_raw)
            if not entries:
                continue
            if key == self.wake_key:
                self._wake_cursor = as_str(entries[-1][0])
            elif key in steps:
                read_steps.append((key, entries))
            else:
                got[key] = entries
        handed: list[Subscription] = []
        rewind: dict[str, str] = {}  # step streams to read again from a checkpoint's entry
        for key, subs in planned.items():  # the streams read on their own come first
            if key in streams or key in pieces:  # (not a replay left for the next read)
                more = len(pieces.get(key, ())) >= REPLAY_ENTRIES
                self._take_entries(key, subs, got.get(key, []), now, handed, rewind, more)
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

    def _replays(
        self, planned: dict[str, list[Subscription]], streams: dict[Any, Any]
    ) -> dict[str, str]:
        """The streams to read from behind this time (a subscriber reads the stream
        itself: ``reload``), taken out of ``streams``: ``REPLAY_STREAMS`` of them, in
        turn; the others wait for the next read."""
        behind = [key for key, subs in planned.items() if any(sub.reload for sub in subs)]
        if not behind:
            return {}
        start = self._replay_turn % len(behind)
        self._replay_turn += REPLAY_STREAMS
        chosen = (behind[start:] + behind[:start])[:REPLAY_STREAMS]
        cursors = {key: streams.pop(key) for key in behind}
        return {key: cursors[key] for key in chosen}

    def _read_pieces(
        self, replays: dict[str, str], streams: dict[Any, Any]
    ) -> tuple[Any, dict[str, list[Any]]]:
        """One round trip: the next ``REPLAY_ENTRIES`` entries of each stream in
        ``replays`` (after its cursor), and what the other ``streams`` hold now."""
        commands: list[Any] = [
            ("XRANGE", key, f"({cursor}", "+", "COUNT", REPLAY_ENTRIES)
            for key, cursor in replays.items()
        ]
        commands.append(xread_command(streams, count=256, block_ms=None))
        self._direct.send(*commands)
        pieces: dict[str, list[Any]] = {}
        error: redis.ResponseError | None = None
        for key in replays:  # every reply is read, or the next ones would be out of step
            try:
                pieces[key] = self._direct.reply("XRANGE") or []
            except redis.ResponseError as exc:
                error = error or exc
        try:
            res = self._direct.reply("XREAD")
        except redis.ResponseError as exc:
            error = error or exc
        if error is not None:
            raise error
        return res, pieces

    def _plan(
        self, now: float
    ) -> tuple[dict[Any, Any], dict[str, str], dict[str, list[Subscription]], bool]:
        """What the next read asks for: the output streams read on their own (each from
        its slowest subscriber's cursor), the step streams their chunks flow through,
        which subscribers each own read serves, and whether a full reader was skipped."""
        limit = self.buffer_bytes
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
        return streams, steps, planned, paused

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
        more: bool = False,
    ) -> None:
        """Entries read from output stream ``key`` itself (checkpoints), for the
        subscriptions that needed it: their chunks in order; then follow the stream
        through the step stream its last entry names, from that entry's step entry
        (``rewind``: read again from there once this read's step entries are taken).
        ``more``: a piece of a stream read from behind, with more after it: the stream
        itself is read again next, from where each subscriber got to."""
        with self._lock:  # unsubscribed meanwhile: not handed anything
            current = self._subs.get(key, [])
            subs = [sub for sub in subs if sub in current]
        whole = {id(sub): True for sub in subs}  # every chunk read handed to it
        for eid_raw, fields in entries:
            eid = as_str(eid_raw)
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
            sub.reload = more or not whole[id(sub)]
        if not more:
            self._follow_on(key, entries, now, rewind)

    def _follow_on(self, key: str, entries: list[Any], now: float, rewind: dict[str, str]) -> None:
        """After a read of output stream ``key`` to its end: follow it through the step
        stream its last entry names, from that entry's step entry (``rewind``)."""
        f = self._follow.get(key)
        if entries:
            fields = entries[-1][1]
            writer, sid = fields.get(b"w"), fields.get(b"i")
            steps = self.keys.output_steps(as_str(writer)) if writer and sid else None
            if steps in self._bad_steps:
                steps = None
            f = _Follow(steps, as_str(sid) if steps and sid else "0-0", now)
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
        self._step_cursors[key] = as_str(entries[-1][0])
        follow, subs_of = self._follow, self._subs
        for _published, (okeys, ordinals, payloads) in step_entry_columns(key, entries):
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
