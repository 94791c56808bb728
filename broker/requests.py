"""Request records, claims, cancellation, resume and the token streams, on Redis.

One ``RequestStore`` per process, built from a redis client and the key prefix; the
web tier creates requests, workers claim and publish, streamers read and resume.
"""

from __future__ import annotations

import contextlib
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, NamedTuple

import redis
from celery import Celery
from redis.client import Pipeline

from app.messages import EngineFinish, TokenDelta
from app.records import RequestRecord, RequestState
from broker import scripts
from broker.celery_app import send_generate
from broker.chunks import Chunk, expand
from broker.connection import as_str
from broker.keys import Keys
from broker.placement import ShardPlacement
from broker.publish import TokenPublishing, decode_deltas, lease_value, seal_call
from broker.step_lines import READ_LOG_TRIES, TailAt, named_tail, read_checkpointed

# How long a worker's task tries to claim its request while Redis is away.
CLAIM_RETRY_S = 15.0


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
    MODEL_FULL = -2  # the model's share of the in-flight limit (Settings.model_max_queue)
    RPM_FULL = -3  # the key's requests per minute
    TPM_FULL = -4  # the key's tokens per minute

    def __bool__(self) -> bool:
        return self is Admission.ADMITTED


@dataclass(frozen=True, slots=True)
class RateLimit:
    """A key's limits per minute for one admission (0: none) and what it reserves."""

    requests_per_minute: int = 0
    tokens_per_minute: int = 0
    reserve_tokens: int = 0

    def __bool__(self) -> bool:
        return bool(self.requests_per_minute or self.tokens_per_minute)


class Admitted(NamedTuple):
    """``RequestStore.admit``'s answer, how many of the owner's requests were in flight
    before it, and the owner's requests and tokens counted in this minute (after it,
    when admitted; 0 without rate limits)."""

    answer: Admission
    ahead: int
    used_requests: int = 0
    used_tokens: int = 0


#: How long a minute's rate counters live: past their minute, and the next one's reset.
RATE_WINDOW_TTL_S = 120


def rate_window(now: float) -> int:
    """The unix minute ``now`` falls in: the rate counters' window."""
    return int(now // 60)


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
class RequestStatus:
    """What a streamer's watchdog needs to know about one request, read in one batch."""

    state: RequestState
    attempt: int
    claimed: float | None  # unix time a worker first claimed it (queue time ends)
    lease_alive: bool


# What ``RequestStore.load`` reads of a record (``loaded`` parses them in this order).
LOAD_FIELDS = ("body", "state", "attempt")


class RequestStore(TokenPublishing):
    """Typed access to request records and their token streams."""

    def __init__(self, client: redis.Redis, keys: Keys, *, stream_ttl_s: int = 3600):
        self.redis = client
        self.keys = keys
        self.stream_ttl_s = stream_ttl_s
        self._claim = client.register_script(scripts.CLAIM)
        self._resume = client.register_script(scripts.RESUME)
        self._refresh_leases = client.register_script(scripts.REFRESH_LEASES)
        self._admit = client.register_script(scripts.ADMIT)
        self._settle = client.register_script(scripts.SETTLE_TOKENS)
        self._init_publishing(client)

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
        new = self.keys.of(record.request_id).new_requests
        pipe.xadd(new, {"r": record.request_id}, maxlen=100_000, approximate=True)

    def submit(self, record: RequestRecord, celery_app: Celery) -> None:
        """Write the record, hand it to the streamers, and queue ``generate`` for it."""
        self.create(record)
        self.send(record, celery_app)

    def send(
        self,
        record: RequestRecord,
        celery_app: Celery,
        *,
        priority: int = 0,
        placement: ShardPlacement | None = None,
    ) -> None:
        """Queue ``generate`` for a record already written (``create``, or ``admit``
        with ``create=``): on its ``route`` worker's own queue when it has one, at
        ``priority`` (``fair_priority``: 0 is taken first); on a Redis Cluster to its
        shard's queue when ``placement`` says a worker of its model is at home there."""
        rid = record.request_id
        shard = placement.queue_shard(record.model, rid) if placement is not None else None
        send_generate(
            celery_app,
            record.request_id,
            0,
            queue=record.queue,
            model=record.model,
            worker=record.route or None,
            priority=priority,
            fair=record.fair,
            trace=record.trace,
            shard=shard,
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
        model: str = "",
        model_limit: int = 0,
        rate: RateLimit = RateLimit(),
        rate_at: float | None = None,
        create: RequestRecord | None = None,
    ) -> Admitted:
        """Count ``rid`` (``weight`` choices) against the shared in-flight limit, one
        request against ``owner``'s ``owner_limit`` (0: none) and ``weight`` choices
        against ``model``'s ``model_limit`` (0: none; a model with nothing in flight is
        always admitted, as the shared limit admits a first request): the answer, and how
        many of ``owner``'s requests were in flight before this one (what orders the
        queue between keys: ``fair_priority``).

        ``create``: ``rid``'s record, written (as ``create`` writes it) in the same
        atomic call when it is admitted, and not at all when it is refused."""
        window = rate_window(now if rate_at is None else rate_at)
        keys = [self.keys.inflight, self.inflight_weights]
        keys += [self.keys.rate_requests(owner, window), self.keys.rate_tokens(owner, window)]
        args: list[Any] = [now, limit, rid, deadline, max(weight, 1), owner, owner_limit]
        args += [model, model_limit, rate.requests_per_minute, rate.tokens_per_minute]
        args += [rate.reserve_tokens, RATE_WINDOW_TTL_S]
        # On a cluster the record is in its shard, not with the admission's keys: written
        # after (``later``), in a call of its own; if that fails, the admission is given
        # back. Otherwise it is written in the same call.
        later = create if self.keys.clustered else None
        if create is not None and later is None:
            keys += [self.keys.request(rid), self.keys.of(rid).new_requests]
            args += [create.encode(), RequestState.QUEUED.value, self.stream_ttl_s]
        answer, used_r, used_t = (int(x) for x in self._admit(keys=keys, args=args))
        if answer >= 1:
            if later is not None:
                try:
                    self.create(later)
                except BaseException:
                    with contextlib.suppress(redis.RedisError):
                        self.release(rid)
                    raise
            return Admitted(Admission.ADMITTED, answer - 1, used_r, used_t)
        return Admitted(Admission(answer), 0, used_r, used_t)

    def settle_tokens(self, rid: str, owner: str, admitted_at: float, unused: int) -> None:
        """Give back what a finished request reserved and did not use (once)."""
        if unused <= 0:
            return
        keys = [self.keys.rate_tokens(owner, rate_window(admitted_at)), self.keys.rate_settled(rid)]
        self._settle(keys=keys, args=[unused, RATE_WINDOW_TTL_S])

    def rate_used(self, owner: str, now: float) -> tuple[int, int]:
        """The owner's requests and tokens counted in this minute."""
        window = rate_window(now)
        raw = self.redis.mget(
            [self.keys.rate_requests(owner, window), self.keys.rate_tokens(owner, window)]
        )
        return int(raw[0] or 0), max(int(raw[1] or 0), 0)

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
        pipe.set(self.keys.of(rid).fence_epoch, "x" + secrets.token_hex(8))

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
            at = named_tail(last, b"s", self.keys.of(rid).steps, log.recorded)
            if at is not None:
                log.steps, log.sid, _n = at
            return log, at

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
            keys, args = seal_call(self.keys, rid, lease, last.attempt, log.recorded, tail)
            res = self._seal(keys=keys, args=args)
            if int(res) >= 0:  # sealed, or fenced: its first publish will say so
                break
        else:
            raise RuntimeError(f"request {rid}: its token stream kept changing while sealed")
        last_n = log.chunks[-1].n if log.chunks else 0
        return log.progress(num_choices), last_n

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

    def claim_through_outage(
        self,
        rid: str,
        attempt: int,
        worker_id: str,
        lease_ttl_s: float,
        *,
        within_s: float = CLAIM_RETRY_S,
    ) -> tuple[ClaimResult, RequestRecord | None, bool]:
        """``claim_and_load``, tried again while Redis is away, for up to ``within_s``: a
        task that gives up waits for the streamers' requeue (``requeue_after_s``), and
        on a Redis Cluster a shard's master can be away while the request was admitted
        on the others. A claim whose reply was lost may have run: one that then finds
        the lease held by this very attempt of this worker is its own."""
        deadline = time.monotonic() + within_s
        delay, retried = 0.05, False
        while True:
            try:
                claim, record, again = self.claim_and_load(
                    rid, attempt, worker_id, lease_ttl_s, time.time()
                )
                break
            except (redis.ConnectionError, redis.TimeoutError):
                if time.monotonic() + delay > deadline:
                    raise
                time.sleep(delay)
                delay, retried = min(delay * 2, 1.0), True
        mine = lease_value(worker_id, attempt)
        if (
            claim is ClaimResult.HELD
            and retried
            and as_str(self.redis.get(self.keys.lease(rid)) or b"") == mine
        ):
            loaded = self.load(rid)
            return ClaimResult.OK, loaded[0] if loaded else None, True
        return claim, record, again

    def _run_claim(
        self, rid: str, attempt: int, worker_id: str, lease_ttl_s: float, now: float, load: str
    ) -> Any:
        return self._claim(
            keys=[
                self.keys.request(rid),
                self.keys.lease(rid),
                self.keys.cancel(rid),
                self.keys.of(rid).fence_epoch,
            ],
            args=[attempt, lease_value(worker_id, attempt), int(lease_ttl_s * 1000), now, load],
        )

    def refresh_leases(self, leases: Sequence[tuple[str, str]], lease_ttl_s: float) -> int:
        """Extend the leases ``(request_id, lease_value)`` still held with those values;
        how many were. Only the lease: tokens and cancels wait for the next publish."""
        if not leases:
            return 0
        if self.keys.clustered:  # one call per shard: a script's keys share a slot
            shards: dict[int, list[tuple[str, str]]] = {}
            for lease in leases:
                shards.setdefault(self.keys.index_of(lease[0]), []).append(lease)
            if len(shards) > 1:
                return sum(self.refresh_leases(group, lease_ttl_s) for group in shards.values())
        keys = [self.keys.lease(rid) for rid, _ in leases]
        args: list[int | str] = [int(lease_ttl_s * 1000), *(value for _, value in leases)]
        return int(self._refresh_leases(keys=keys, args=args))

    # -- lost-worker detection (streamers) -----------------------------------------
    def lease_alive(self, rid: str) -> bool:
        return bool(self.redis.exists(self.keys.lease(rid)))

    def resume(self, rid: str) -> int | None:
        """If ``rid`` is running with an expired lease, requeue it; the new attempt."""
        keys = [self.keys.request(rid), self.keys.lease(rid), self.keys.of(rid).fence_epoch]
        res = int(self._resume(keys=keys))
        return None if res < 0 else res
