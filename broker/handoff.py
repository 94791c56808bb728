"""The hand-off of new requests to streamers.

New requests reach streamers through the ``Keys.new_requests`` stream and the consumer
group ``streamers``: a streamer keeps its claimed entries pending (unacknowledged) until
the request ends and touches them every second; entries idle longer than the takeover
time belong to a dead streamer and are claimed by a live one (XAUTOCLAIM).
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

import redis
from redis.client import Pipeline

from broker import scripts
from broker.connection import as_str
from broker.keys import Keys

GROUP = "streamers"


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
        return [(as_str(eid), as_str(f[b"r"])) for eid, f in res[0][1]]

    def last_id(self) -> str:
        """The newest hand-off entry id (a wake-up cursor for plain XREAD)."""
        info: Any = self.redis.xrevrange(self.keys.new_requests, count=1)
        return as_str(info[0][0]) if info else "0-0"

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
            out[eid] = as_str(pending[0]["consumer"]) if pending else None
        return out, "" if epoch is None else as_str(epoch)

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
                out.append((as_str(eid), as_str(values[b"r"])))
            else:
                self.redis.xack(self.keys.new_requests, GROUP, eid)
        return out

    def release(self, consumer: str, entry_ids: Sequence[str], idle_ms: int) -> None:
        """A stopping streamer's entries, left for the others to take over at once:
        still pending for it, but marked idle for ``idle_ms`` (longer than the takeover
        time), so the next live streamer's takeover claims them instead of waiting for
        them to age (``XCLAIM ... IDLE``; an entry another streamer took meanwhile is not
        ours to touch, as in ``touch``)."""
        owners, _epoch = self.owners(entry_ids)
        mine: list[Any] = [eid for eid in entry_ids if owners.get(eid) == consumer]
        if mine:
            self.redis.xclaim(
                self.keys.new_requests, GROUP, consumer, 0, mine, idle=idle_ms, justid=True
            )

    def ack(self, entry_id: str) -> None:
        self.redis.xack(self.keys.new_requests, GROUP, entry_id)

    def queue_ack(self, pipe: Pipeline, entry_id: str) -> None:
        """``ack(entry_id)``, added to ``pipe``."""
        pipe.xack(self.keys.new_requests, GROUP, entry_id)
