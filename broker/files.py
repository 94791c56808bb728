"""Files on Redis, typed, with TTLs, per owner, with a storage quota.

Files (``Keys.file``): a hash with ``meta`` (``FileObject`` JSON) and ``owner``, and the
bytes in ``Keys.file_data`` (a string, so a download reads it in ranges instead of
holding a whole file in a web process), both expiring ``batch_file_ttl_s`` after upload;
``Keys.files`` indexes them by time, ``Keys.owner_files`` per owner.

Owners: with API keys configured every file and batch records the hash of the key that
created it (``web.auth.key_owner``); the batch's output/error files get the batch's
owner. Reads take a ``scope``: an owner id (objects of other owners are reported missing,
as OpenAI answers 404) or None (every owner: admin keys, or no keys configured).
``Keys.owner_file_bytes`` counts each owner's stored files and bytes for its quota,
checked and updated in one WATCH transaction so parallel uploads cannot overshoot it.
The listing helpers here page files and batches (``broker.batches``) alike.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import redis

from app.batches import (
    FileObject,
    ListPage,
    new_file_id,
)
from app.errors import QuotaExceeded
from broker.connection import as_str
from broker.keys import Keys

# KEYS: batch, active, lock, results
# ARGV: driver ('' = not fenced), to_status, timestamp field, now, terminal ('' or the


@dataclass(frozen=True, slots=True)
class FileQuota:
    """What one owner may store at once (0: no limit), from ``Settings.key_max_*``."""

    max_files: int = 0
    max_bytes: int = 0

    @property
    def limited(self) -> bool:
        return self.max_files > 0 or self.max_bytes > 0


# Bytes per GETRANGE when a download streams a file.
DOWNLOAD_CHUNK = 1024 * 1024


class FileStore:
    """Uploaded files and generated output/error files."""

    def __init__(
        self, client: redis.Redis, keys: Keys, *, ttl_s: int, quota: FileQuota | None = None
    ) -> None:
        self.redis = client
        self.keys = keys
        self.ttl_s = ttl_s
        self.quota = quota or FileQuota()

    def create(
        self,
        *,
        filename: str,
        purpose: str,
        content: bytes,
        now: float,
        file_id: str | None = None,
        owner: str = "",
        enforce_quota: bool = True,
    ) -> FileObject:
        """Store a file for ``owner``; ``file_id`` is given for output files so a retried
        write (a driver's takeover) replaces the same file instead of leaving a second one.

        Raises ``QuotaExceeded`` when the file would take ``owner`` over its quota
        (``enforce_quota=False``, for a batch's results, still counts the file).
        """
        created = int(now)
        obj = FileObject(
            id=file_id or new_file_id(),
            bytes=len(content),
            created_at=created,
            filename=filename,
            purpose=purpose,
            expires_at=created + self.ttl_s,
        )
        usage = self.keys.owner_file_bytes(owner)
        with self.redis.pipeline(transaction=True) as pipe:
            while True:
                try:
                    gone: list[str] = []
                    if self.quota.limited:
                        pipe.watch(usage)  # type: ignore[no-untyped-call]
                        gone = self._check_quota(pipe, owner, obj, enforce_quota)
                    pipe.multi()
                    self._queue_write(pipe, obj, content, owner, now)
                    if self.quota.limited:
                        if gone:
                            pipe.hdel(usage, *gone)
                        pipe.hset(usage, obj.id, obj.bytes)
                        pipe.expire(usage, self.ttl_s)
                    pipe.execute()
                    return obj
                except redis.WatchError:
                    continue  # another upload of this owner changed its usage: recount

    def _check_quota(self, pipe: Any, owner: str, obj: FileObject, enforce: bool) -> list[str]:
        """Count ``owner``'s live files (returning those that expired, to drop from its
        usage) and raise ``QuotaExceeded`` if ``obj`` would not fit."""
        raw: Any = pipe.hgetall(self.keys.owner_file_bytes(owner))
        sizes = {as_str(k): int(v) for k, v in raw.items()}
        sizes.pop(obj.id, None)  # a rewrite replaces itself
        ids = list(sizes)
        check = self.redis.pipeline(transaction=False)
        for fid in ids:
            check.exists(self.keys.file(fid))
        alive = check.execute() if ids else []
        gone = [fid for fid, live in zip(ids, alive, strict=True) if not live]
        for fid in gone:
            del sizes[fid]
        if not enforce:
            return gone
        q = self.quota
        if q.max_files and len(sizes) + 1 > q.max_files:
            raise QuotaExceeded(
                f"Quota exceeded: this API key stores {len(sizes)} files, the most it may "
                f"store is {q.max_files} (key_max_files). Delete files to upload more.",
                param="file",
            )
        used = sum(sizes.values())
        if q.max_bytes and used + obj.bytes > q.max_bytes:
            raise QuotaExceeded(
                f"Quota exceeded: this API key stores {used} bytes of files; this file "
                f"({obj.bytes} bytes) would pass its limit of {q.max_bytes} bytes "
                "(key_max_file_bytes). Delete files to upload more.",
                param="file",
            )
        return gone

    def _queue_write(
        self, pipe: Any, obj: FileObject, content: bytes, owner: str, now: float
    ) -> None:
        key = self.keys.file(obj.id)
        pipe.hset(key, mapping={"meta": obj.model_dump_json(), "owner": owner})
        pipe.hdel(key, "content")  # the layout before file_data: a rewrite drops it
        pipe.expire(key, self.ttl_s)
        pipe.set(self.keys.file_data(obj.id), content, ex=self.ttl_s)
        pipe.zadd(self.keys.files, {obj.id: now})
        pipe.zadd(self.keys.owner_files(owner), {obj.id: now})
        pipe.expire(self.keys.owner_files(owner), self.ttl_s)

    def owner(self, fid: str) -> str | None:
        """Who stored ``fid`` (None: no such file)."""
        raw: Any = self.redis.hmget(self.keys.file(fid), "meta", "owner")
        if raw[0] is None:
            return None
        return as_str(raw[1]) if raw[1] is not None else ""

    def get(self, fid: str, scope: str | None = None) -> FileObject | None:
        """The file, if it exists and ``scope`` (an owner; None = any) may see it."""
        raw: Any = self.redis.hmget(self.keys.file(fid), "meta", "owner")
        if raw[0] is None or not visible(raw[1], scope):
            return None
        return FileObject.model_validate_json(raw[0])

    def content(self, fid: str) -> bytes | None:
        """The whole file (the batch driver reads input files this way)."""
        raw: Any = self.redis.get(self.keys.file_data(fid))
        if raw is None:
            raw = self.redis.hget(self.keys.file(fid), "content")
        return None if raw is None else bytes(raw)

    def chunks(self, fid: str, size: int, chunk: int = DOWNLOAD_CHUNK) -> Iterator[bytes]:
        """The file in ``chunk``-byte pieces read as they are sent, so a download holds
        one piece in memory, not the file. Stops early if the file is deleted meanwhile."""
        data = self.keys.file_data(fid)
        if not self.redis.exists(data):
            old = self.content(fid)  # a file stored before file_data existed
            if old is not None:
                yield old
            return
        for start in range(0, size, chunk):
            piece: Any = self.redis.getrange(data, start, min(start + chunk, size) - 1)
            if not piece:
                return
            yield bytes(piece)

    def delete(self, fid: str, scope: str | None = None) -> bool:
        """Delete ``fid`` if ``scope`` may see it; False when there was nothing to delete."""
        owner = self.owner(fid)
        if owner is None or not visible(owner, scope):
            return False
        # No MULTI: a Redis at maxmemory (noeviction) refuses MULTI, but never DEL,
        # ZREM or HDEL, which only free memory; deleting is how a full Redis gets room
        # back. Index and quota entries go first, so an interrupted delete leaves at
        # worst unlisted data that expires with its TTL, never a listed file without data.
        pipe = self.redis.pipeline(transaction=False)
        pipe.zrem(self.keys.files, fid)
        pipe.zrem(self.keys.owner_files(owner), fid)
        pipe.hdel(self.keys.owner_file_bytes(owner), fid)
        pipe.delete(self.keys.file(fid), self.keys.file_data(fid))
        return bool(pipe.execute()[-1])

    def page(
        self,
        *,
        after: str | None = None,
        limit: int = 20,
        purpose: str | None = None,
        scope: str | None = None,
    ) -> ListPage[FileObject]:
        """Newest first; ``after`` is the last id of the previous page; ``scope`` lists
        one owner's files (None: everyone's)."""

        def parse(raw: Any) -> FileObject | None:
            obj = FileObject.model_validate_json(raw)
            return obj if purpose is None or obj.purpose == purpose else None

        found, more = index_page(
            self.redis,
            self.keys.files if scope is None else self.keys.owner_files(scope),
            after,
            limit,
            lambda ids: [self.redis.hget(self.keys.file(i), "meta") for i in ids],
            parse,
        )
        return list_page(found, more)


def visible(owner: Any, scope: str | None) -> bool:
    """Whether an object stored for ``owner`` is visible to ``scope`` (None: all)."""
    return scope is None or as_str(owner or b"") == scope


def hgetall_many(client: redis.Redis, keys: list[str]) -> list[Any]:
    pipe = client.pipeline(transaction=False)
    for key in keys:
        pipe.hgetall(key)
    return list(pipe.execute())


def index_page(
    client: redis.Redis,
    index: str,
    after: str | None,
    limit: int,
    load: Any,
    parse: Any,
) -> tuple[list[Any], bool]:
    """Up to ``limit`` live objects of a time-scored index, newest first, after the id
    ``after``; ids whose object expired are dropped from the index on the way."""
    start = 0
    if after is not None:
        rank = client.zrevrank(index, after)
        if rank is None:
            return [], False
        start = int(rank) + 1  # type: ignore[arg-type]
    found: list[Any] = []
    while len(found) <= limit:
        ids = [as_str(x) for x in client.zrevrange(index, start, start + limit)]
        if not ids:
            return found, False
        gone = []
        for oid, raw in zip(ids, load(ids), strict=True):
            if raw is None or raw == {}:
                gone.append(oid)
                continue
            obj = parse(raw)
            if obj is not None:
                found.append(obj)
        if gone:
            client.zrem(index, *gone)
        start += len(ids) - len(gone)
    return found[:limit], True


def list_page(found: list[Any], more: bool) -> ListPage[Any]:
    return ListPage(
        data=found,
        first_id=found[0].id if found else None,
        last_id=found[-1].id if found else None,
        has_more=more,
    )


def ms(seconds: float) -> int:
    return max(1, int(seconds * 1000))
