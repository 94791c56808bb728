"""A request's token chunks: what a worker publishes, and how readers put them together.

Every publish of a request carries one chunk: its new token deltas, numbered by an
ordinal (1, 2, 3, ... over all its attempts). A worker with a step stream writes each
chunk as one line of its step entry (``Keys.steps``), which streamers read, and writes
the request's own token stream (``Keys.tokens``) only at a checkpoint: an attempt's
first chunk, its last, and at least every ``CHECKPOINT_STEPS`` publishes. A checkpoint
entry holds every chunk since the previous one and names the worker (``w``) and the
step entry of its call (``s``). So the chunks are the token stream's, then those of
that step stream's next entries (the tail, at most ``CHECKPOINT_STEPS`` entries on,
while step streams keep about 256): ``RequestStore.read_chunks`` reads both.

Why: one token-stream entry per request per step was two fifths of the relay's Redis
time (``benchmarks/relay_floor.py``); a checkpoint every ``CHECKPOINT_STEPS`` steps
keeps the record readers need (a resumed attempt, a takeover's replay, a streamer
that fell behind its step stream) for a small part of that.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

# A request's chunks since its last checkpoint were published by the next fewer than
# this many publishes of its worker: a reader's tail is within that many step entries
# after the checkpoint's, well within the ~256 a step stream keeps (scripts.PUBLISH).
CHECKPOINT_STEPS = 32
# ... and at most this many payload bytes: a checkpoint resends them.
CHECKPOINT_BYTES = 64 * 1024
_PERIOD = CHECKPOINT_STEPS - 1  # a checkpoint's publish index minus the last one's, at most


@dataclass(frozen=True, slots=True)
class Chunk:
    """One publish's deltas for one request, as a reader gets them."""

    n: int  # ordinal
    attempt: int
    payload: bytes  # ``encode_deltas``
    published: bytes | None = None  # the publish time (``publish_stamp``)
    entry: str | None = None  # the token-stream entry that ends with it; None: mid-entry or tail


def phase_of(request_id: str) -> int:
    """A request's ``ChunkLog.phase``: spread over the period, the same every time."""
    return zlib.crc32(request_id.encode()) % (CHECKPOINT_STEPS - 1)


def encode_prior(chunks: list[tuple[int, bytes]]) -> bytes:
    """A checkpoint's earlier chunks as its ``p`` field: ordinal and payload, a line
    each (payloads are JSON: never a raw newline)."""
    return b"\n".join([b"%d\n%s" % chunk for chunk in chunks])


def entry_chunks(fields: dict[bytes, Any]) -> list[tuple[int, bytes]]:
    """A token-stream entry's chunks, in order: those of its ``p`` field, then its own
    (``n``, ``d``). Raises ValueError/KeyError on a malformed entry."""
    out: list[tuple[int, bytes]] = []
    prior = fields.get(b"p")
    if prior:
        parts = prior.split(b"\n")
        if len(parts) % 2:
            raise ValueError("malformed prior chunks")
        out = [(int(parts[i]), parts[i + 1]) for i in range(0, len(parts), 2)]
    out.append((int(fields[b"n"]), fields[b"d"]))
    return out


@dataclass(frozen=True, slots=True)
class TokenEntry:
    """A token-stream entry as a reader uses it: its chunks in order; the worker's
    publish time (``t``); and, at a checkpoint with a step stream, the worker (``w``)
    and its step entry (``s``) after which the request's next chunks are lines."""

    chunks: list[tuple[int, bytes]]
    published: bytes | None
    worker: str | None
    step_id: str | None

    @classmethod
    def of(cls, fields: dict[bytes, Any]) -> TokenEntry:
        """Raises ValueError/KeyError on a malformed entry."""
        worker, sid = fields.get(b"w"), fields.get(b"s")
        return cls(
            entry_chunks(fields),
            fields.get(b"t"),
            worker.decode() if worker else None,
            sid.decode() if sid else None,
        )


def entry_ordinal(fields: dict[bytes, Any]) -> int:
    """A token entry's last ordinal; 0 if it has none (decoding it says what is wrong)."""
    try:
        return int(fields.get(b"n") or 0)
    except ValueError:
        return 0


def expand(entries: list[Any], after: int) -> Iterator[Chunk]:
    """The chunks after ordinal ``after`` of token-stream ``entries`` (id, fields)."""
    for eid, fields in entries:
        attempt = int(fields[b"a"])
        chunks = entry_chunks(fields)
        last = len(chunks) - 1
        for i, (n, payload) in enumerate(chunks):
            if n > after:
                entry = (eid.decode() if isinstance(eid, bytes) else eid) if i == last else None
                yield Chunk(n, attempt, payload, fields.get(b"t"), entry)


@dataclass(slots=True)
class ChunkLog:
    """A worker's record of one request attempt's chunks since its last checkpoint.

    ``stage`` numbers the next chunk, records it as published and says whether its
    publish is a checkpoint (and with which earlier chunks); ``unstage`` takes it back
    when that publish did not run (rare: the engine thread learns it from ``landed``).
    Recording first keeps the common path to one call per request and step. One publish
    per request is in flight at a time (the engine thread reads a publish's reply, or
    learns whether it landed, before it sends the next)."""

    ordinal: int = 0  # the last chunk published
    # The first checkpoint after the first chunk comes this many publishes early
    # (``phase_of``): requests that start together do not all checkpoint on one step.
    phase: int = 0
    # The chunks not checkpointed yet, encoded as a checkpoint's ``p`` field is (each
    # with a newline after it): one bytearray, not a list of tuples, because tuples
    # kept alive across steps made Python's cycle collector cost the engine thread
    # ~3 µs a token at 64 requests (a bytearray holds no references to track).
    since: bytearray = field(default_factory=bytearray)
    marked: int = 0  # the publish index of the last checkpoint
    # What ``unstage`` restores: the state before the last checkpoint staged, or None
    # when the last staged chunk was appended to ``since``.
    _undo: tuple[int, bytearray, int, int] | None = None

    @classmethod
    def following(cls, recorded: int, tail: list[tuple[int, bytes]]) -> ChunkLog:
        """The log of a writer that takes a stream over after its last checkpoint
        (ordinal ``recorded``) and the chunks after it (``tail``, in order): ``restage``
        checkpoints them under the new writer."""
        log = cls(ordinal=tail[-1][0] if tail else recorded)
        for n, payload in tail:
            log.since += b"%d\n%s\n" % (n, payload)
        return log

    def stage(self, payload: bytes, index: int, force: bool) -> tuple[int, bool, bytes]:
        """The next chunk, published by publish number ``index``: (ordinal, checkpoint,
        prior chunks). ``force``: a checkpoint whatever (an attempt's first or last)."""
        n = self.ordinal + 1
        since = self.since
        if force or index - self.marked >= _PERIOD or len(since) + len(payload) > CHECKPOINT_BYTES:
            return n, True, self._mark(n, index, len(since))
        self._undo = None
        self.ordinal = n
        since += b"%d\n%s\n" % (n, payload)
        return n, False, b""

    def due(self, index: int) -> bool:
        """Whether chunks not checkpointed yet must be by publish number ``index`` even
        without a new one (a request that stopped producing: its tail would otherwise
        outlive the step entries that hold it)."""
        return bool(self.since) and index - self.marked >= _PERIOD

    def restage(self, index: int) -> tuple[int, bytes, bytes]:
        """A checkpoint of the chunks since the last one without a new chunk (``due``):
        the last is sent again, with the same ordinal, which readers already have
        skip. (ordinal, payload, prior chunks)."""
        start, n, payload = self._last()
        return n, payload, self._mark(n, index, start)

    def _last(self) -> tuple[int, int, bytes]:
        """Where the last chunk of ``since`` starts in it, its ordinal and its payload
        (parsed: only the rare paths need it)."""
        since = self.since
        end = len(since) - 1  # its newline
        nl = since.rfind(b"\n", 0, end)
        start = since.rfind(b"\n", 0, nl) + 1
        return start, int(since[start:nl]), bytes(since[nl + 1 : end])

    def _mark(self, n: int, index: int, end: int) -> bytes:
        """Checkpoint at chunk ``n``: the prior chunks are ``since[:end]``."""
        since = self.since
        self._undo = (self.ordinal, since, self.marked, self.phase)
        self.ordinal = n
        self.since, self.marked, self.phase = bytearray(), index - self.phase, 0
        return bytes(since[: end - 1]) if end else b""

    def unsealed(self) -> tuple[int, list[tuple[int, bytes]]]:
        """The chunks published since the last checkpoint, and that checkpoint's
        ordinal (the last published chunk's when there are none): what an attempt
        that was fenced seals into the token stream (``RequestStore.seal_fenced``)."""
        parts = bytes(self.since).split(b"\n")[:-1]
        chunks = [(int(parts[i]), parts[i + 1]) for i in range(0, len(parts), 2)]
        return (chunks[0][0] - 1 if chunks else self.ordinal), chunks

    def unstage(self) -> None:
        """The last staged chunk's publish did not run: it goes out again, numbered the
        same, with the deltas recorded since (or as part of the next checkpoint)."""
        if self._undo is not None:
            self.ordinal, self.since, self.marked, self.phase = self._undo
            self._undo = None
            return
        del self.since[self._last()[0] :]
        self.ordinal -= 1
