"""Batches on Redis, typed, with TTLs; the batch lock and per-line progress (the files
they read and write are ``broker.files``).

Batches (``Keys.batch``): a hash whose ``body`` holds what never changes (endpoint,
input file, window, metadata, created/expires times) and whose other fields change as
the batch runs: ``status`` and one timestamp per status, ``total``/``completed``/
``failed``, ``submitted`` (lines before this index have been handed to workers),
``output_file_id``/``error_file_id`` and ``errors``. It expires ``batch_ttl_s`` after
creation. ``Keys.batches`` indexes batches for listing; ``Keys.active_batches`` lists
those not yet terminal, which is where drivers look for work.

Every status change is one Lua script (check the current status, and for a driver the
lock, then write), so a client's cancel and a driver's progress never overwrite each
other. A driver holds ``Keys.batch_lock`` (its id, with a TTL it refreshes); every write
it makes is fenced by that lock, so a driver presumed dead cannot write once another has
taken the batch over. Each line's result is written once (HSETNX into
``Keys.batch_results``) together with its counter, so a takeover that folds a line again
can neither count it twice nor lose it.
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import Enum
from typing import Any

import redis
from pydantic import BaseModel, ConfigDict

from app.batches import (
    BatchErrors,
    BatchObject,
    BatchOutputLine,
    BatchStatus,
    ListPage,
    RequestCounts,
)
from app.records import RequestRecord
from broker.connection import as_str
from broker.files import hgetall_many, index_page, list_page, ms, visible
from broker.keys import Keys
from broker.requests import RequestStore

# KEYS: batch, active, lock, results
# ARGV: driver ('' = not fenced), to_status, timestamp field, now, terminal ('' or the

#       batch id, to take off the work list), n_from, from_status * n_from, then
#       field, value pairs to set
# -> 1 done, 0 not in an allowed status, -1 lock not held, -2 no such batch
TRANSITION = """
if ARGV[1] ~= '' and redis.call('GET', KEYS[3]) ~= ARGV[1] then return -1 end
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return -2 end
local n = tonumber(ARGV[6])
local allowed = false
for i = 1, n do
  if status == ARGV[6 + i] then allowed = true end
end
if not allowed then return 0 end
redis.call('HSET', KEYS[1], 'status', ARGV[2], ARGV[3], ARGV[4])
for j = 7 + n, #ARGV - 1, 2 do
  redis.call('HSET', KEYS[1], ARGV[j], ARGV[j + 1])
end
if ARGV[5] ~= '' then
  redis.call('ZREM', KEYS[2], ARGV[5])
  redis.call('DEL', KEYS[3], KEYS[4])
end
return 1
"""

# KEYS: lock, batch, results        ARGV: driver, line index, counter ('' = none), line JSON
# -> 1 recorded, 0 already recorded (a takeover folded it again), -1 lock not held
RECORD = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return -1 end
if redis.call('HSETNX', KEYS[3], ARGV[2], ARGV[4]) == 0 then return 0 end
if ARGV[3] ~= '' then redis.call('HINCRBY', KEYS[2], ARGV[3], 1) end
local ttl = redis.call('PTTL', KEYS[2])
if ttl > 0 then redis.call('PEXPIRE', KEYS[3], ttl) end
return 1
"""

# KEYS: lock                        ARGV: driver, ttl_ms   -> 1 still ours, 0 lost
REFRESH = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
"""

# KEYS: lock                        ARGV: driver
RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('DEL', KEYS[1]) end
return 1
"""

_TIMESTAMP_FIELD = {
    BatchStatus.VALIDATING: "created_at",
    BatchStatus.IN_PROGRESS: "in_progress_at",
    BatchStatus.FINALIZING: "finalizing_at",
    BatchStatus.COMPLETED: "completed_at",
    BatchStatus.FAILED: "failed_at",
    BatchStatus.EXPIRED: "expired_at",
    BatchStatus.CANCELLING: "cancelling_at",
    BatchStatus.CANCELLED: "cancelled_at",
}
_INT_FIELDS = (*(f for f in _TIMESTAMP_FIELD.values() if f != "created_at"),)


class Transition(int, Enum):
    """The outcome of ``BatchStore.transition``."""

    DONE = 1
    WRONG_STATUS = 0  # the batch is not in one of the allowed statuses
    NOT_LOCKED = -1  # a driver's write, but the lock is not (or no longer) its own
    MISSING = -2  # no such batch (or it expired)


class BatchBody(BaseModel):
    """The immutable part of a batch (the ``body`` field of its hash)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    id: str
    endpoint: str
    input_file_id: str
    completion_window: str
    created_at: int
    expires_at: int
    metadata: dict[str, str] | None = None


class BatchStore:
    """Batch objects, their status machine, per-line results and the drivers' locks."""

    def __init__(self, client: redis.Redis, keys: Keys, *, ttl_s: int) -> None:
        self.redis = client
        self.keys = keys
        self.ttl_s = ttl_s
        self._transition = client.register_script(TRANSITION)
        self._record = client.register_script(RECORD)
        self._refresh = client.register_script(REFRESH)
        self._release = client.register_script(RELEASE)

    # -- clients (web) --------------------------------------------------------------------
    def create(self, body: BatchBody, now: float, owner: str = "") -> BatchObject:
        """A new batch of ``owner`` in ``validating``, put on the drivers' work list."""
        key = self.keys.batch(body.id)
        pipe = self.redis.pipeline(transaction=True)
        pipe.hset(
            key,
            mapping={
                "body": body.model_dump_json(),
                "owner": owner,
                "status": BatchStatus.VALIDATING.value,
                "total": 0,
                "completed": 0,
                "failed": 0,
                "submitted": 0,
            },
        )
        pipe.expire(key, self.ttl_s)
        pipe.zadd(self.keys.batches, {body.id: now})
        pipe.zadd(self.keys.owner_batches(owner), {body.id: now})
        pipe.expire(self.keys.owner_batches(owner), self.ttl_s)
        pipe.zadd(self.keys.active_batches, {body.id: now})
        pipe.execute()
        batch = self.get(body.id)
        assert batch is not None
        return batch

    def get(self, bid: str, scope: str | None = None) -> BatchObject | None:
        """The batch, if it exists and ``scope`` (an owner; None = any) may see it."""
        raw: Any = self.redis.hgetall(self.keys.batch(bid))
        if raw and not visible(raw.get(b"owner"), scope):
            return None
        return _batch_from_hash(raw)

    def owner(self, bid: str) -> str:
        """Who created ``bid`` ("" without keys, or for a batch that is gone): the owner
        its output and error files are stored for."""
        return as_str(self.redis.hget(self.keys.batch(bid), "owner") or b"")

    def page(
        self, *, after: str | None = None, limit: int = 20, scope: str | None = None
    ) -> ListPage[BatchObject]:
        """Newest first; ``after`` is the last id of the previous page; ``scope`` lists
        one owner's batches (None: everyone's)."""
        found, more = index_page(
            self.redis,
            self.keys.batches if scope is None else self.keys.owner_batches(scope),
            after,
            limit,
            lambda ids: hgetall_many(self.redis, [self.keys.batch(i) for i in ids]),
            _batch_from_hash,
        )
        return list_page(found, more)

    def request_cancel(self, bid: str, now: float, scope: str | None = None) -> Transition:
        """A client's cancel: ``cancelling`` now; the driver finishes it (``cancelled``).
        A batch ``scope`` may not see is ``MISSING``."""
        if scope is not None and self.get(bid, scope) is None:
            return Transition.MISSING
        return self.transition(
            bid,
            BatchStatus.CANCELLING,
            now,
            allowed_from=(BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS),
        )

    # -- status machine ---------------------------------------------------------------------
    def transition(
        self,
        bid: str,
        to: BatchStatus,
        now: float,
        *,
        allowed_from: Iterable[BatchStatus],
        driver: str = "",
        fields: dict[str, str | int] | None = None,
    ) -> Transition:
        """Move ``bid`` to ``to`` (stamping its timestamp) if its status allows it.

        With ``driver`` the write happens only while that driver holds the batch's lock.
        A terminal status takes the batch off the work list and drops its lock and
        per-line results (the output/error files hold them by then).
        """
        allowed = [s.value for s in allowed_from]
        args: list[Any] = [
            driver,
            to.value,
            _TIMESTAMP_FIELD[to],
            int(now),
            bid if to.terminal else "",
            len(allowed),
            *allowed,
        ]
        for name, value in (fields or {}).items():
            args += [name, value]
        keys = [
            self.keys.batch(bid),
            self.keys.active_batches,
            self.keys.batch_lock(bid),
            self.keys.batch_results(bid),
        ]
        return Transition(int(self._transition(keys=keys, args=args)))

    # -- drivers ----------------------------------------------------------------------------
    def active(self) -> list[str]:
        """Batches not yet terminal, oldest first (so old batches are driven first)."""
        return [as_str(x) for x in self.redis.zrange(self.keys.active_batches, 0, -1)]

    def forget(self, bid: str) -> None:
        """Drop a batch that expired from Redis from the work list."""
        self.redis.zrem(self.keys.active_batches, bid)

    def acquire(self, bid: str, driver: str, ttl_s: float) -> bool:
        return bool(self.redis.set(self.keys.batch_lock(bid), driver, nx=True, px=ms(ttl_s)))

    def refresh(self, bid: str, driver: str, ttl_s: float) -> bool:
        """Extend our lock; False when it is no longer ours (stop driving the batch)."""
        return bool(self._refresh(keys=[self.keys.batch_lock(bid)], args=[driver, ms(ttl_s)]))

    def release(self, bid: str, driver: str) -> None:
        self._release(keys=[self.keys.batch_lock(bid)], args=[driver])

    def progress(self, bid: str) -> tuple[BatchStatus, int] | None:
        """(status, submitted): how far the batch got (None: it expired)."""
        raw = self.redis.hmget(self.keys.batch(bid), "status", "submitted")
        if raw[0] is None:
            return None
        return BatchStatus(as_str(raw[0])), int(raw[1] or 0)

    def submit_line(
        self,
        bid: str,
        driver: str,
        index: int,
        record: RequestRecord,
        requests: RequestStore,
    ) -> bool:
        """Write line ``index``'s request record and move ``submitted`` past it, in one
        transaction fenced by our lock (WATCH): a driver that lost the batch, or a
        record that already exists, writes nothing. The caller then sends the task."""
        lock = self.keys.batch_lock(bid)
        if self.keys.clustered:
            return self._submit_line_apart(bid, driver, index, record, requests)
        with self.redis.pipeline(transaction=True) as pipe:
            try:
                pipe.watch(lock, self.keys.request(record.request_id))  # type: ignore[no-untyped-call]
                if as_str(pipe.get(lock)) != driver or pipe.exists(
                    self.keys.request(record.request_id)
                ):
                    return False
                pipe.multi()
                requests.queue_create(pipe, record)
                pipe.hset(self.keys.batch(bid), "submitted", index + 1)
                pipe.execute()
            except redis.WatchError:
                return False
        return True

    def _submit_line_apart(
        self, bid: str, driver: str, index: int, record: RequestRecord, requests: RequestStore
    ) -> bool:
        """``submit_line`` on a Redis Cluster, where the line's record (in its request's
        shard) and the batch (under the global tag) cannot share a transaction: the
        record is written first, only if absent (WATCH on it alone), then ``submitted``
        moves under the lock. A driver that stops between the two leaves a record the
        next one finds: it moves ``submitted`` and sends the task all the same (a second
        task for one request is refused by its claim). A driver that lost the batch
        writes at most the record, which the new owner then submits."""
        rid = record.request_id
        lock = self.keys.batch_lock(bid)
        if as_str(self.redis.get(lock)) != driver:
            return False
        with self.redis.pipeline(transaction=True) as pipe:
            try:
                pipe.watch(self.keys.request(rid))  # type: ignore[no-untyped-call]
                if not pipe.exists(self.keys.request(rid)):
                    pipe.multi()
                    requests.queue_create(pipe, record)
                    pipe.execute()
            except redis.WatchError:
                pass  # written meanwhile: by a driver that had the batch before us
        with self.redis.pipeline(transaction=True) as pipe:
            try:
                pipe.watch(lock)  # type: ignore[no-untyped-call]
                if as_str(pipe.get(lock)) != driver:
                    return False
                pipe.multi()
                pipe.hset(self.keys.batch(bid), "submitted", index + 1)
                pipe.execute()
            except redis.WatchError:
                return False
        return True

    def record(self, bid: str, driver: str, index: int, line: BatchOutputLine, counter: str) -> int:
        """Store line ``index``'s result once; ``counter`` is "completed", "failed" or ""
        (lines a cancel or expiry left unrun are listed but not counted)."""
        return int(
            self._record(
                keys=[
                    self.keys.batch_lock(bid),
                    self.keys.batch(bid),
                    self.keys.batch_results(bid),
                ],
                args=[driver, index, counter, line.to_line()],
            )
        )

    def ending(self, bid: str) -> str | None:
        """Why a finalizing batch is winding down ("batch_expired"/"batch_cancelled"),
        or None when it simply finished."""
        raw: Any = self.redis.hget(self.keys.batch(bid), "ending")
        return raw.decode() if raw else None

    def recorded(self, bid: str) -> set[int]:
        """Indices of the lines whose result is stored."""
        return {int(x) for x in self.redis.hkeys(self.keys.batch_results(bid))}

    def results(self, bid: str) -> list[tuple[int, BatchOutputLine]]:
        """Every stored result, in line order."""
        raw: Any = self.redis.hgetall(self.keys.batch_results(bid))
        out = [(int(k), BatchOutputLine.model_validate_json(v)) for k, v in raw.items()]
        out.sort(key=lambda item: item[0])
        return out


def _batch_from_hash(raw: Any) -> BatchObject | None:
    if not raw or b"body" not in raw:
        return None
    f = {as_str(k): as_str(v) for k, v in raw.items()}
    body = BatchBody.model_validate_json(f["body"])
    errors = f.get("errors")
    return BatchObject(
        **body.model_dump(),
        status=BatchStatus(f["status"]),
        request_counts=RequestCounts(
            total=int(f.get("total", 0)),
            completed=int(f.get("completed", 0)),
            failed=int(f.get("failed", 0)),
        ),
        errors=BatchErrors.model_validate_json(errors) if errors else None,
        output_file_id=f.get("output_file_id") or None,
        error_file_id=f.get("error_file_id") or None,
        **{name: int(f[name]) for name in _INT_FIELDS if f.get(name)},
    )
