"""Output streams (streamer -> web): one stream per request, its entries and their codec.

Output stream entries: ``e`` = JSON list of encoded ``OutputEvent`` values, ``s`` = the
token-stream entry id they were decoded up to. Entries are appended once per read cycle
(deltas coalesced), and the ``s`` checkpoint lets a streamer that takes a request over
replay the token stream silently up to exactly what was already written, so no text is
ever repeated or lost. Readers always read from an explicit cursor (``0-0`` or the last
id they saw), never ``$``.

The last event of every output stream is a USAGE event or a request-level ERROR event
(``choice`` None): a reader stops there. Web processes read these streams through one
``broker.hub.OutputHub`` each; the step-stream lines both streams use are
``broker.step_lines``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson
import redis

from app.messages import OutputEvent, OutputKind
from app.usage import UsageCount
from broker import scripts
from broker.chunks import entry_chunks
from broker.connection import as_str
from broker.direct import DirectConnection, xread_command
from broker.handoff import GROUP
from broker.keys import Keys
from broker.step_lines import (
    TailAt,
    last_entries,
    named_tail,
    read_checkpointed,
    step_line,
)
from broker.usage_ledger import ledger_call

# What a reader gets for an output entry it cannot decode (a bug upstream).
MALFORMED_OUTPUT = OutputEvent(
    OutputKind.ERROR, error="The server produced an unreadable output for this request.", code=500
)

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
    ``usage``: on the entry that ends the request, what the usage ledger counts for it,
    in the same write (``broker.usage_ledger``).
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
    usage: UsageCount | None = None

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


class OutputStreams:
    """Write and read per-request output streams."""

    def __init__(
        self, client: redis.Redis, keys: Keys, *, ttl_s: int = 3600, ledger_days: int = 90
    ) -> None:
        self.redis = client
        self.keys = keys
        self.ttl_s = ttl_s
        self.ledger_days = ledger_days  # how long the usage ledger keeps a period's hash
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
        if self.keys.clustered and self.keys.shard is None:  # a script's keys: one shard
            shards: dict[int, list[OutputEntry]] = {}
            for e in entries:
                shards.setdefault(self.keys.index_of(e.request_id), []).append(e)
            if len(shards) > 1:
                return set().union(*(self.write(group, owner, stamp) for group in shards.values()))
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
        the script), whose step lines are written here, as the step entry holds them.
        An entry with a usage count is always written out (its count names its index)."""
        k = self.keys.of(entries[0].request_id)  # their shard (one Redis: the keys)
        keys = [k.new_requests, k.handoff_epoch]
        each: list[Any] = []
        lines: list[bytes] = []
        handoffs: list[str] = []
        order: list[int] = []
        plain: list[int] = []
        counts: list[tuple[int, str, UsageCount]] = []
        prefix = k.output_prefix()  # concatenated, once per request per write
        for i, e in enumerate(entries):
            if owner and e.n and not (e.first or e.checkpoint) and e.usage is None:
                lines.append(step_line(prefix + e.request_id, e.source, e.n, e.encoded()))
                handoffs.append(e.handoff_id or "-")
                plain.append(i)
                continue
            keys.append(prefix + e.request_id)
            flags = (1 if e.first else 0) | (8 if e.checkpoint else 0) | e.n << 4
            each += [e.handoff_id, flags, e.encoded(), e.source]
            each.append(e.published if e.published is not None else "")
            order.append(i)
            if e.usage is not None:
                counts.append((len(order), e.request_id, e.usage))
        if owner:
            keys.append(k.output_steps(owner))
        epoch = "" if self.fence_epoch is None else f"e:{self.fence_epoch}"
        args: list[Any] = [GROUP, owner, self.ttl_s, epoch, stamp, len(order)]
        args += [b"\n".join(lines), " ".join(handoffs), *each]
        args += [e.prior for e in entries if e.checkpoint]
        ledger_keys, ledger_args = ledger_call(
            k, counts, done_ttl_s=2 * self.ttl_s, days=self.ledger_days
        )
        keys += ledger_keys
        args += ledger_args
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
            log.source, log.last_events = as_str(last[b"s"]), last[b"d"]
            at = named_tail(last, b"i", self.keys.of(rid).output_steps, log.recorded)
            if at is not None:
                log.steps, log.sid, _n = at
            return log, at

        log, tail = read_checkpointed(self.redis, self.keys.output(rid), parse)
        log.tail = [(n, source, events) for n, source, events, _t in tail]
        log.chunks += [(n, events) for n, _source, events in log.tail if n > after]
        if log.tail:
            _n, log.source, log.last_events = log.tail[-1]
        return log

    def ended_at(self, rid: str) -> int | None:
        """The ordinal of the chunk that ended the request's output (None: not ended, or
        no output): one round trip. A stream's terminal chunk is always a checkpoint,
        an entry of the output stream itself, so its last entry says."""
        last = last_entries(self.redis, [self.keys.output(rid)])[0]
        if not last or not any(is_terminal(ev) for ev in decode_events(last[b"d"])):
            return None
        return int(last[b"n"])

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
