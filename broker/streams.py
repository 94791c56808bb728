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

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import orjson
import redis

from app.messages import OutputEvent, OutputKind
from broker.keys import Keys

GROUP = "streamers"


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
    source: str  # token-stream cursor these events were decoded up to
    first: bool = False
    published: bytes | None = None  # worker publish time of the source entry (latency)


class OutputStreams:
    """Write and read per-request output streams."""

    def __init__(self, client: redis.Redis, keys: Keys, *, ttl_s: int = 3600) -> None:
        self.redis = client
        self.keys = keys
        self.ttl_s = ttl_s

    def write(self, entries: Sequence[OutputEntry]) -> None:
        """Append many requests' events in one round trip."""
        if not entries:
            return
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

    def last_source(self, rid: str) -> tuple[str, bool] | None:
        """(token cursor of the last written entry, whether the stream has ended)."""
        last: Any = self.redis.xrevrange(self.keys.output(rid), count=1)
        if not last:
            return None
        fields = last[0][1]
        events = decode_events(fields[b"e"])
        return _s(fields[b"s"]), any(is_terminal(ev) for ev in events)

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
        """Reset the idle time of entries we still work on (we are alive)."""
        if entry_ids:
            self.redis.xclaim(
                self.keys.new_requests, GROUP, consumer, 0, list(entry_ids), justid=True
            )

    def take_over(self, consumer: str, min_idle_ms: int, count: int = 64) -> list[tuple[str, str]]:
        """Claim entries a dead streamer left pending for longer than ``min_idle_ms``."""
        res: Any = self.redis.xautoclaim(
            self.keys.new_requests, GROUP, consumer, min_idle_ms, start_id="0-0", count=count
        )
        out = []
        for eid, fields in res[1]:
            if fields:  # entries trimmed away come back without fields
                out.append((_s(eid), _s(fields[b"r"])))
            else:
                self.redis.xack(self.keys.new_requests, GROUP, eid)
        return out

    def ack(self, entry_id: str) -> None:
        self.redis.xack(self.keys.new_requests, GROUP, entry_id)


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)
