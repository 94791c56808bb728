"""Request records, claims, cancellation, resume and the token streams, on Redis.

One ``RequestStore`` per process, built from a redis client and the key prefix; the
web tier creates requests, workers claim and publish, streamers read and resume.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import orjson
import redis
from celery import Celery
from redis.client import Pipeline

from app.messages import EngineFinish, TokenDelta
from app.records import RequestRecord, RequestState
from broker import scripts
from broker.celery_app import send_generate
from broker.chunks import Chunk, encode_prior, expand
from broker.connection import as_str
from broker.direct import DirectConnection
from broker.keys import Keys
from broker.step_lines import READ_LOG_TRIES, TailAt, last_entries, read_checkpointed, step_head


class ClaimResult(str, Enum):
    OK = "ok"
    MISSING = "missing"  # record expired or never written
    STALE = "stale"  # a newer attempt exists (e.g. Celery redelivered an old task)
    DONE = "done"  # already finished
    HELD = "held"  # another worker holds the lease for this attempt
    CANCELLED = "cancelled"  # cancelled before any worker started it


class Admission(int, Enum):
    """``RequestStore.admit``'s answer; only ``ADMITTED`` is truthy."""

    ADMITTED = 1
    FULL = 0  # the shared in-flight limit
    OWNER_FULL = -1  # the key's own in-flight quota

    def __bool__(self) -> bool:
        return self is Admission.ADMITTED


class PublishStatus(int, Enum):
    OK = 0
    FENCED = 1  # the lease is no longer ours: stop generating, publish nothing more
    CANCEL = 2  # a cancel was requested: stop generating


@dataclass(slots=True)
class ChoiceProgress:
    """What a token stream says about one choice (used to resume it elsewhere)."""

    token_ids: list[int] = field(default_factory=list)
    finish: EngineFinish | None = None


@dataclass(slots=True)
class TokenLog:
    """What ``RequestStore.read_log`` read: the chunks, the ordinal of the token
    stream's last entry, and the chunks after it (from its worker's step stream)."""

    chunks: list[Chunk]
    recorded: int = 0
    tail: list[Chunk] = field(default_factory=list)
    steps: str | None = None  # the step stream the tail is read from, if any
    sid: str = "0-0"  # ... from after this entry (the last checkpoint's)

    def progress(self, num_choices: int) -> list[ChoiceProgress]:
        out = [ChoiceProgress() for _ in range(num_choices)]
        for c in self.chunks:
            for d in decode_deltas(c.payload):
                p = out[d.choice]
                p.token_ids.extend(d.token_ids)
                if d.finish is not None:
                    p.finish = d.finish
        return out


@dataclass(frozen=True, slots=True)
class FencedTail:
    """What an attempt that was fenced had published since its last checkpoint
    (``ChunkLog.unsealed``), to seal (``RequestStore.seal_fenced``)."""

    request_id: str
    attempt: int
    checkpointed: int  # the ordinal of its last checkpoint (the token stream's last entry)
    chunks: list[tuple[int, bytes]]  # (ordinal, payload), in order; not empty


def _seal_call(
    keys: Keys, rid: str, lease: str, attempt: int, recorded: int, chunks: list[tuple[int, bytes]]
) -> tuple[list[str], list[Any]]:
    """``scripts.SEAL``'s keys and arguments: seal ``chunks`` after ordinal ``recorded``."""
    (*prior, (n, payload)) = chunks
    args = [lease, attempt, publish_stamp(), recorded, n, payload, encode_prior(prior)]
    return [keys.lease(rid), keys.tokens(rid)], args


@dataclass(slots=True)
class PublishItem:
    """One request's contribution to one engine step's publish round trip.

    ``payload`` is already encoded (``encode_deltas``; empty = a lease refresh only):
    the engine thread encodes each request on its own, so one request whose deltas
    cannot be encoded fails alone instead of failing the whole step's round trip.
    """

    request_id: str
    lease_value: str
    attempt: int
    payload: bytes
    first: bool = False
    done: bool = False
    refresh: bool = True  # extend the lease (False: it was extended recently)
    # The chunk's ordinal (``broker.chunks``); 0: the next after the token stream's last
    # entry, written there whatever (a publisher that keeps no ``ChunkLog``).
    ordinal: int = 0
    checkpoint: bool = False  # write it (and ``prior``) to the request's token stream
    prior: bytes = b""  # ``encode_prior``: the chunks since the last checkpoint


@dataclass(frozen=True, slots=True)
class RequestStatus:
    """What a streamer's watchdog needs to know about one request, read in one batch."""

    state: RequestState
    attempt: int
    claimed: float | None  # unix time a worker first claimed it (queue time ends)
    lease_alive: bool


# What ``RequestStore.load`` reads of a record (``loaded`` parses them in this order).
LOAD_FIELDS = ("body", "state", "attempt")


def lease_value(worker_id: str, attempt: int) -> str:
    return f"{worker_id}:{attempt}"


# A plain publish item's parts (``RequestStore._plain_parts_of``): worker id, attempt,
# lease value, (lease key, cancel key), step line head.
_PlainParts = tuple[str, int, str, tuple[str, str], bytes]
# Kept for this many requests at most (a worker holds far fewer at once).
PLAIN_PARTS_KEPT = 4096


class RequestStore:
    """Typed access to request records and their token streams."""

    def __init__(self, client: redis.Redis, keys: Keys, *, stream_ttl_s: int = 3600):
        self.redis = client
        self.keys = keys
        self.stream_ttl_s = stream_ttl_s
        self._claim = client.register_script(scripts.CLAIM)
        self._resume = client.register_script(scripts.RESUME)
        self._publish = client.register_script(scripts.PUBLISH)
        self._seal = client.register_script(scripts.SEAL)
        self._refresh_leases = client.register_script(scripts.REFRESH_LEASES)
        self._admit = client.register_script(scripts.ADMIT)
        self._plain_parts: dict[str, _PlainParts] = {}  # request id -> ``_plain_parts_of``

    # -- web tier -----------------------------------------------------------------
    def create(self, record: RequestRecord) -> None:
        """Write a new record (state queued, attempt 0) and hand it to the streamers."""
        pipe = self.redis.pipeline(transaction=True)
        self.queue_create(pipe, record)
        pipe.execute()

    def queue_create(self, pipe: Pipeline, record: RequestRecord) -> None:
        """Add ``create``'s commands to a caller's transaction (the batch driver fences
        them with WATCH on its batch lock, so a driver that lost its batch cannot submit)."""
        k = self.keys.request(record.request_id)
        pipe.hset(
            k,
            mapping={
                "body": record.encode(),
                "state": RequestState.QUEUED.value,
                "attempt": 0,
                "worker": "",
            },
        )
        pipe.expire(k, self.stream_ttl_s)
        pipe.xadd(
            self.keys.new_requests, {"r": record.request_id}, maxlen=100_000, approximate=True
        )

    def submit(self, record: RequestRecord, celery_app: Celery) -> None:
        """Write the record, hand it to the streamers, and queue ``generate`` for it."""
        self.create(record)
        self.send(record, celery_app)

    def send(self, record: RequestRecord, celery_app: Celery) -> None:
        """Queue ``generate`` for a record already written (``create``, or ``admit``
        with ``create=``): on its ``route`` worker's own queue when it has one."""
        send_generate(
            celery_app,
            record.request_id,
            0,
            queue=record.queue,
            model=record.model,
            worker=record.route or None,
        )

    @property
    def inflight_weights(self) -> str:
        return self.keys.inflight_weights

    def admit(
        self,
        rid: str,
        deadline: float,
        limit: int,
        now: float,
        *,
        weight: int = 1,
        owner: str = "",
        owner_limit: int = 0,
        create: RequestRecord | None = None,
    ) -> Admission:
        """Count ``rid`` (``weight`` choices) against the shared in-flight limit and
        one request against ``owner``'s ``owner_limit`` (0: none); falsy when refused.

        ``create``: ``rid``'s record, written (as ``create`` writes it) in the same
        atomic call when it is admitted, and not at all when it is refused."""
        keys = [self.keys.inflight, self.inflight_weights]
        args: list[Any] = [now, limit, rid, deadline, max(weight, 1), owner, owner_limit]
        if create is not None:
            keys += [self.keys.request(rid), self.keys.new_requests]
            args += [create.encode(), RequestState.QUEUED.value, self.stream_ttl_s]
        return Admission(int(self._admit(keys=keys, args=args)))

    def release(self, rid: str) -> None:
        """The request's reader is done with it: free its admission slot. ZREM and
        HDEL only free memory, so Redis allows them even at maxmemory."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.zrem(self.keys.inflight, rid)
        pipe.hdel(self.inflight_weights, rid)
        pipe.execute()

    def in_flight(self, now: float) -> int:
        """Requests holding an admission slot (those past their deadline not counted;
        ``admit`` prunes them, with their weights)."""
        return int(self.redis.zcount(self.keys.inflight, f"({now}", "+inf"))

    def cancel(self, rid: str) -> None:
        """Ask whoever generates ``rid`` to stop (durable key + a wake-up)."""
        pipe = self.redis.pipeline(transaction=False)
        self.queue_cancel(pipe, rid)
        pipe.execute()

    def queue_cancel(self, pipe: Pipeline, rid: str) -> None:
        """``cancel(rid)``'s commands, added to ``pipe``."""
        pipe.set(self.keys.cancel(rid), "1", ex=self.stream_ttl_s)
        # After the key: a publish that sees the new epoch sees the cancel too.
        pipe.set(self.keys.fence_epoch, "x" + secrets.token_hex(8))
        pipe.publish(self.keys.cancel_channel, rid)

    def is_cancelled(self, rid: str) -> bool:
        return bool(self.redis.exists(self.keys.cancel(rid)))

    # -- readers ------------------------------------------------------------------
    def load(self, rid: str) -> tuple[RequestRecord, RequestState, int] | None:
        """The record, its state and current attempt; None if it does not exist."""
        return self.loaded(self.redis.hmget(self.keys.request(rid), *LOAD_FIELDS))

    def queue_load(self, pipe: Pipeline, rid: str) -> None:
        """``load(rid)``'s read, added to ``pipe``; ``loaded`` reads its reply."""
        pipe.hmget(self.keys.request(rid), *LOAD_FIELDS)

    @staticmethod
    def loaded(raw: Any) -> tuple[RequestRecord, RequestState, int] | None:
        if raw[0] is None:
            return None
        return RequestRecord.decode(raw[0]), RequestState(as_str(raw[1])), int(raw[2] or 0)

    def state(self, rid: str) -> tuple[RequestState, int] | None:
        raw = self.redis.hmget(self.keys.request(rid), "state", "attempt")
        if raw[0] is None:
            return None
        return RequestState(as_str(raw[0])), int(raw[1] or 0)

    def claimed_at(self, rid: str) -> float | None:
        """When a worker first claimed ``rid`` (None: never, or the record is gone)."""
        raw: Any = self.redis.hget(self.keys.request(rid), "claimed")
        return None if raw is None else float(raw)

    def statuses(self, rids: Sequence[str]) -> list[RequestStatus | None]:
        """The status of many requests in one round trip (None: the record is gone)."""
        if not rids:
            return []
        pipe = self.redis.pipeline(transaction=False)
        for rid in rids:
            pipe.hmget(self.keys.request(rid), "state", "attempt", "claimed")
            pipe.exists(self.keys.lease(rid))
        raw = pipe.execute()
        out: list[RequestStatus | None] = []
        for i in range(len(rids)):
            (state, attempt, claimed), lease = raw[2 * i], raw[2 * i + 1]
            if state is None:
                out.append(None)
                continue
            out.append(
                RequestStatus(
                    RequestState(as_str(state)),
                    int(attempt or 0),
                    None if claimed is None else float(claimed),
                    bool(lease),
                )
            )
        return out

    def read_tokens(
        self, rid: str, cursor: str = "0-0", count: int | None = None
    ) -> list[tuple[str, int, list[TokenDelta]]]:
        """Token stream entries after ``cursor``: (entry id, attempt, deltas)."""
        entries: Any = self.redis.xrange(
            self.keys.tokens(rid), min=f"({cursor}" if cursor != "0-0" else "-", count=count
        )
        return [(as_str(eid), int(f[b"a"]), decode_deltas(f[b"d"])) for eid, f in entries]

    def read_chunks(self, rid: str, after: int = 0) -> list[Chunk]:
        """The request's chunks after ordinal ``after``, in order (``broker.chunks``)."""
        return self.read_log(rid, after).chunks

    def read_log(self, rid: str, after: int = 0) -> TokenLog:
        """The request's token stream, then the tail of its last checkpoint's step
        stream: two round trips. If the step stream moved past the checkpoint's entry
        in between, the token stream has a newer checkpoint (or there was no tail): it
        is read again."""

        def parse(entries: Any) -> tuple[TokenLog, TailAt | None]:
            log = TokenLog(list(expand(entries, after)))
            last = entries[-1][1] if entries else {}
            log.recorded = int(last.get(b"n", 0))
            worker, sid = last.get(b"w"), last.get(b"s")
            if not worker or not sid:
                return log, None
            log.steps, log.sid = self.keys.steps(as_str(worker)), as_str(sid)
            return log, (log.steps, log.sid, log.recorded)

        log, tail = read_checkpointed(self.redis, self.keys.tokens(rid), parse)
        log.tail = [Chunk(n, int(attempt), payload, t) for n, attempt, payload, t in tail]
        log.chunks += [c for c in log.tail if c.n > after]
        return log

    def progress(self, rid: str, num_choices: int) -> list[ChoiceProgress]:
        """Per choice: the token ids published so far and whether it finished."""
        return self.read_log(rid).progress(num_choices)

    def resume_point(
        self, rid: str, num_choices: int, lease: str
    ) -> tuple[list[ChoiceProgress], int]:
        """For a resumed attempt holding ``lease``: its ``progress`` and the ordinal of
        the last chunk, after sealing its predecessor's tail (``scripts.SEAL``)."""
        for _ in range(READ_LOG_TRIES):
            log = self.read_log(rid)
            if not log.tail:
                break
            last = log.tail[-1]
            tail = [(c.n, c.payload) for c in log.tail]
            keys, args = _seal_call(self.keys, rid, lease, last.attempt, log.recorded, tail)
            res = self._seal(keys=keys, args=args)
            if int(res) >= 0:  # sealed, or fenced: its first publish will say so
                break
        else:
            raise RuntimeError(f"request {rid}: its token stream kept changing while sealed")
        last_n = log.chunks[-1].n if log.chunks else 0
        return log.progress(num_choices), last_n

    def seal_fenced(self, tails: Sequence[FencedTail]) -> list[int]:
        """Attempts that a publish just fenced seal the chunks they published since
        their last checkpoint into their token streams, in one round trip
        (``scripts.SEAL`` without a lease: a successor that has written wins).
        Per tail: 1 sealed, -1 a successor wrote first (it read the tail itself)."""
        pipe = self.redis.pipeline(transaction=False)
        for t in tails:
            keys, args = _seal_call(
                self.keys, t.request_id, "", t.attempt, t.checkpointed, t.chunks
            )
            self._seal(keys=keys, args=args, client=pipe)
        return [int(r) for r in pipe.execute()]

    # -- workers ------------------------------------------------------------------
    def claim(
        self, rid: str, attempt: int, worker_id: str, lease_ttl_s: float, now: float
    ) -> ClaimResult:
        """Take the lease for ``attempt`` of ``rid``; only then may a worker generate.

        The first claim's time is kept (field ``claimed``): queue time = claimed - created.
        """
        return ClaimResult(as_str(self._run_claim(rid, attempt, worker_id, lease_ttl_s, now, "0")))

    def claim_and_load(
        self, rid: str, attempt: int, worker_id: str, lease_ttl_s: float, now: float
    ) -> tuple[ClaimResult, RequestRecord | None, bool]:
        """``claim``, and the record when the claim succeeds, in the same round trip;
        also whether the request was claimed before (by any attempt: the new one goes
        on from what was published, ``resume_point``)."""
        res = self._run_claim(rid, attempt, worker_id, lease_ttl_s, now, "1")
        if not isinstance(res, list):
            return ClaimResult(as_str(res)), None, False
        body = res[1]  # a Lua false (no body field) arrives as None
        record = None if body is None else RequestRecord.decode(body)
        return ClaimResult(as_str(res[0])), record, bool(res[2])

    def _run_claim(
        self, rid: str, attempt: int, worker_id: str, lease_ttl_s: float, now: float, load: str
    ) -> Any:
        return self._claim(
            keys=[
                self.keys.request(rid),
                self.keys.lease(rid),
                self.keys.cancel(rid),
                self.keys.fence_epoch,
            ],
            args=[attempt, lease_value(worker_id, attempt), int(lease_ttl_s * 1000), now, load],
        )

    def publish(
        self,
        items: Sequence[PublishItem],
        lease_ttl_s: float,
        worker_id: str | None = None,
        stamp: str | None = None,
    ) -> list[PublishStatus]:
        """Append one engine step's deltas for many requests in ONE round trip.

        Also extends the leases of the items that ask (``refresh``) and reports cancels
        and lost leases. With ``worker_id``, the token entries appended are also written,
        together, as one entry of the worker's step stream (``Keys.steps``). The engine
        thread uses ``publish_begin`` (on its own connection, the reply read after its
        next step); this is the same call, whole. ``stamp`` (``publish_stamp()``, by
        default a new one) is the call's publish time, written in each entry it appends:
        ``landed`` tells from it whether a call whose reply was lost ran.
        """
        if not items:
            return []
        keys, args, order, plain, _ = self._publish_args(items, lease_ttl_s, worker_id, stamp, "")
        return publish_reply(self._publish(keys=keys, args=args), order, plain).statuses

    def publish_begin(
        self,
        items: Sequence[PublishItem],
        lease_ttl_s: float,
        via: DirectConnection,
        worker_id: str | None = None,
        stamp: str | None = None,
        known: KnownEpoch | None = None,
    ) -> PendingPublish:
        """``publish``, split in two: send it now, read its statuses later with the
        result's ``statuses()``, so the engine can run its next step meanwhile.

        ``known``: the fence epoch this sender's publishes on ``via`` ran under, kept
        up to date by ``statuses()``; while it is current the script skips checking
        each request's lease and cancel key (``scripts.PUBLISH``)."""
        generation = via.connect()
        epoch = known.argument(generation) if known is not None else ""
        keys, args, order, plain, plain_keys = self._publish_args(
            items, lease_ttl_s, worker_id, stamp, epoch
        )
        via.send_evalsha(self._publish, keys, args)
        return PendingPublish(
            via, self._publish, keys, args, order, plain, known, generation, plain_keys
        )

    def _publish_args(
        self,
        items: Sequence[PublishItem],
        lease_ttl_s: float,
        worker_id: str | None,
        stamp: str | None,
        epoch: str,
    ) -> tuple[list[str], list[Any], list[int], int, list[str]]:
        """``scripts.PUBLISH``'s keys and arguments, the items' indexes in the order of
        its reply: those written out, then the plain ones (see the script), whose step
        lines are written here, as the step entry holds them; how many are plain; and
        their keys. Those are in the call's keys only without an ``epoch`` expected: under
        one the script needs them only if the epoch changed, and then asks for them
        (``PendingPublish.statuses`` sends the call again with them)."""
        k = self.keys
        keys: list[str] = [k.fence_epoch]
        plain_keys: list[str] = []
        lines: list[bytes] = []
        order: list[int] = []
        plain: list[int] = []
        each: list[Any] = []
        # Once per request per step, on the way to every token: the key prefixes are
        # concatenated rather than built by ``Keys``' methods.
        known = self._plain_parts
        for i, it in enumerate(items):
            rid = it.request_id
            if (
                worker_id is not None
                and it.payload
                and it.ordinal
                and not (it.first or it.done or it.refresh or it.checkpoint)
            ):
                parts = known.get(rid)
                if parts is None or parts[0] != worker_id or parts[1] != it.attempt:
                    parts = self._plain_parts_of(rid, worker_id, it.attempt)
                if it.lease_value == parts[2]:
                    plain_keys += parts[3]
                    lines.append(b"%s%d\n%s" % (parts[4], it.ordinal, it.payload))
                    plain.append(i)
                    continue
            elif it.done:
                known.pop(rid, None)
            keys += [k.lease(rid), k.tokens(rid), k.request(rid), k.cancel(rid)]
            flags = it.first | 2 * it.done | (0 if it.refresh else 4) | 8 * it.checkpoint
            each += [it.lease_value, it.attempt, it.payload, flags | it.ordinal << 4]
            order.append(i)
        if not epoch:
            keys += plain_keys
        # The publish time travels with each entry so the relay's added latency can be
        # measured to the microsecond (entry ids only carry milliseconds); it also names
        # the call, for ``landed``.
        stamp = stamp or publish_stamp()
        args: list[Any] = [int(lease_ttl_s * 1000), self.stream_ttl_s, stamp, epoch]
        args += [len(order), len(plain), b"\n".join(lines), *each]
        if worker_id is not None:
            keys.append(k.steps(worker_id))
            args.append(worker_id)
            args += [it.prior for it in items if it.checkpoint and it.payload]
        return keys, args, order + plain, len(plain), plain_keys

    def _plain_parts_of(self, rid: str, worker_id: str, attempt: int) -> _PlainParts:
        """What a plain item of ``rid``'s ``attempt`` published by ``worker_id`` needs in
        the publish's arguments, built once per attempt, not per step: its expected
        lease value, its lease and cancel keys, and its step line's head
        (``step_head``). Forgotten at the attempt's last publish, or all at once when
        more than ``PLAIN_PARTS_KEPT`` are kept (attempts that ended elsewhere)."""
        if len(self._plain_parts) >= PLAIN_PARTS_KEPT:
            self._plain_parts.clear()
        k = self.keys
        parts = (
            worker_id,
            attempt,
            lease_value(worker_id, attempt),
            (k.lease(rid), k.cancel(rid)),
            step_head(k.tokens(rid), attempt),
        )
        self._plain_parts[rid] = parts
        return parts

    def landed(
        self, calls: Sequence[tuple[str, int, str]], worker_id: str | None = None
    ) -> list[bool]:
        """For each ``(request_id, attempt, stamp)`` of a publish whose reply was lost
        (the connection broke, Redis restarted): whether it ran. One round trip.

        A publish is not idempotent: retrying one that ran appends its tokens twice. Its
        sender publishes nothing more until it knows. So, with ``worker_id`` (the call
        wrote that worker's step stream), the call ran if the step stream's last entry
        is the one it appended (a part fenced there is fenced again when retried);
        without, if the last entry of the request's token stream is. A call that ran
        but that Redis lost with its AOF tail counts as not landed, which is what it is
        now."""
        if worker_id is not None:
            (last,) = last_entries(self.redis, [self.keys.steps(worker_id)])
            ran = all(last.get(b"t") == stamp.encode() for _rid, _a, stamp in calls)
            return [ran] * len(calls)
        lasts = last_entries(self.redis, [self.keys.tokens(rid) for rid, _a, _s in calls])
        return [
            last.get(b"a") == str(attempt).encode() and last.get(b"t") == stamp.encode()
            for (_rid, attempt, stamp), last in zip(calls, lasts, strict=True)
        ]

    def refresh_leases(self, leases: Sequence[tuple[str, str]], lease_ttl_s: float) -> int:
        """Extend the leases ``(request_id, lease_value)`` still held with those values;
        how many were. Only the lease: tokens and cancels wait for the next publish."""
        if not leases:
            return 0
        keys = [self.keys.lease(rid) for rid, _ in leases]
        args: list[int | str] = [int(lease_ttl_s * 1000), *(value for _, value in leases)]
        return int(self._refresh_leases(keys=keys, args=args))

    # -- lost-worker detection (streamers) -----------------------------------------
    def lease_alive(self, rid: str) -> bool:
        return bool(self.redis.exists(self.keys.lease(rid)))

    def resume(self, rid: str) -> int | None:
        """If ``rid`` is running with an expired lease, requeue it; the new attempt."""
        keys = [self.keys.request(rid), self.keys.lease(rid), self.keys.fence_epoch]
        res = int(self._resume(keys=keys))
        return None if res < 0 else res


@dataclass(slots=True)
class KnownEpoch:
    """The fence epoch (``Keys.fence_epoch``) one sender's last publish ran under, and
    the connection generation (``DirectConnection.generation``) it came over.

    Trusted only on the same connection: a new one may be to a Redis that restarted
    without its last writes (a claim's lease lost, then claimed again by another worker
    under an epoch this sender already knows), so the first publish on it checks every
    request again."""

    generation: int = -1
    value: str = ""

    def argument(self, generation: int) -> str:
        """The publish script's epoch argument for a call on ``generation``."""
        return "e:" + self.value if generation == self.generation else ""

    def learn(self, generation: int, value: str) -> None:
        self.generation, self.value = generation, value


@dataclass(frozen=True, slots=True)
class PublishReply:
    statuses: list[PublishStatus]
    epoch: str  # the fence epoch the call ran under
    # The call ran nothing: the epoch changed, and it left the plain items' keys out.
    recheck: bool = False


def publish_reply(res: Any, order: Sequence[int], plain: int) -> PublishReply:
    """``scripts.PUBLISH``'s reply, parsed: the statuses of the items whose indexes
    ``order`` lists, in that order, put back in the items' order. The last ``plain`` of
    them are the plain items, whose statuses the reply holds only when the script
    checked them; otherwise each was published."""
    *replied, epoch = res
    if replied == [b"recheck"]:
        return PublishReply([], as_str(epoch), recheck=True)
    if len(replied) not in (len(order), len(order) - plain):
        raise ValueError(f"publish replied {len(replied)} statuses for {len(order)} items")
    statuses = [PublishStatus.OK] * len(order)
    for i, x in zip(order, replied, strict=False):
        statuses[i] = PublishStatus(int(x))
    return PublishReply(statuses, as_str(epoch))


@dataclass(slots=True)
class PendingPublish:
    """A publish sent on ``via`` whose reply has not been read yet."""

    via: DirectConnection
    script: Any  # the registered publish script (reloaded if Redis lost it)
    keys: list[str]
    args: list[Any]
    order: list[int]  # the items' indexes in the reply's order
    plain: int  # how many of them (the last) are plain
    known: KnownEpoch | None = None  # updated from the reply
    generation: int = 0  # ``via``'s when it was sent
    plain_keys: list[str] = field(default_factory=list)  # when left out of ``keys``

    def statuses(self) -> list[PublishStatus]:
        """Read the reply (waits for it if Redis has not answered yet). A call that
        asks for the plain items' keys (the epoch changed since the last) is sent again
        with them, now: it ran nothing."""
        res = self.via.evalsha_reply(self.script, self.keys, self.args)
        reply = publish_reply(res, self.order, self.plain)
        if reply.recheck:
            # Before the step stream key, the last (there is one: plain items need it).
            self.keys = [*self.keys[:-1], *self.plain_keys, self.keys[-1]]
            self.plain_keys = []
            self.via.send_evalsha(self.script, self.keys, self.args)
            res = self.via.evalsha_reply(self.script, self.keys, self.args)
            reply = publish_reply(res, self.order, self.plain)
        if self.known is not None and self.via.generation == self.generation:
            self.known.learn(self.generation, reply.epoch)
        return reply.statuses


def publish_stamp() -> str:
    """A publish call's time (unix seconds, full precision), as its entries carry it."""
    return repr(time.time())


def encode_deltas(deltas: Sequence[TokenDelta]) -> bytes:
    return orjson.dumps([d.encode() for d in deltas])


def decode_deltas(raw: str | bytes) -> list[TokenDelta]:
    return [TokenDelta.decode(x) for x in orjson.loads(raw)]
