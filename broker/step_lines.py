"""Step streams: one entry per publish (a worker's) or output write (a streamer's), with
a line per request chunk it appended; their codec, and reading a stream's tail from
its last checkpoint (``broker/chunks.py`` says what chunks and checkpoints are).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import redis

from broker.chunks import CHECKPOINT_STEPS
from broker.connection import as_str

logger = logging.getLogger(__name__)

# How often a reader reads a stream again when it changed under it.
READ_LOG_TRIES = 5
L = TypeVar("L")


# A chunk read from a step stream: ordinal, the line's second field (a token chunk's
# attempt, an output chunk's source), payload, and its entry's ``t`` (publish time).
StepChunk = tuple[int, str, bytes, bytes | None]
# Where a stream's last checkpoint says its tail is: step stream, entry id, ordinal.
TailAt = tuple[str, str, int]


def step_tail(
    client: redis.Redis, key: str, steps: str, sid: str, recorded: int
) -> list[StepChunk] | None:
    """The chunks of stream ``key`` after ordinal ``recorded`` in the entries of step
    stream ``steps`` after ``sid`` (the last checkpoint's); None when ``sid`` is
    trimmed away. A checkpoint comes at least every ``CHECKPOINT_STEPS`` entries, so
    the tail is within that many."""
    entries: Any = client.xrange(steps, min=sid, count=CHECKPOINT_STEPS + 1)
    if not entries or as_str(entries[0][0]) != sid:
        return None
    tail: list[StepChunk] = []
    for _eid, fields in entries[1:]:
        for okey, second, n, payload in split_step(fields[b"d"]):
            if okey == key and n == recorded + len(tail) + 1:
                tail.append((n, second, payload, fields.get(b"t")))
    return tail


def read_checkpointed(
    client: redis.Redis, key: str, parse: Callable[[Any], tuple[L, TailAt | None]]
) -> tuple[L, list[StepChunk]]:
    """Stream ``key`` (token or output: both are checkpointed, broker/chunks.py), as
    ``parse`` makes it into a log, and the tail its last checkpoint names: two round
    trips. If the step stream moved past the checkpoint's entry in between, the stream
    has a newer checkpoint (or there was no tail): it is read again."""
    entries: Any = client.xrange(key)
    for _ in range(READ_LOG_TRIES):
        log, at = parse(entries)
        if at is None:
            return log, []
        tail = step_tail(client, key, *at)
        if tail is not None:
            return log, tail
        again: Any = client.xrange(key)
        if again == entries:  # the checkpoint's step entry is gone: no tail
            return log, []
        entries = again
    raise RuntimeError(f"{key} kept changing while read")


def named_tail(
    last: Any, sid_field: bytes, steps_of: Callable[[str], str], recorded: int
) -> TailAt | None:
    """Where the tail of a checkpoint entry ``last`` is: the step stream of the writer it
    names (``w``), after that writer's entry (``sid_field``); None when it names none."""
    writer, sid = last.get(b"w"), last.get(sid_field)
    if not writer or not sid:
        return None
    return steps_of(as_str(writer)), as_str(sid), recorded


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


def step_line(key: str, second: str | int, n: int, payload: bytes) -> bytes:
    """One chunk's four lines in a step entry (``split_step`` reads them back): the
    worker and the streamer write the lines of their plain chunks themselves (the
    scripts write the others, in the same form)."""
    return f"{key}\n{second}\n{n}\n".encode() + payload


def step_head(key: str, second: str | int) -> bytes:
    """The first two of a chunk's four lines: ``step_line(key, second, n, payload)`` is
    ``b"%s%d\\n%s" % (step_head(key, second), n, payload)``. What a writer that formats
    one stream's lines at every step keeps (the worker, per request attempt)."""
    return f"{key}\n{second}\n".encode()


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


def step_columns(raw: bytes) -> tuple[list[bytes], list[int], list[bytes]]:
    """``split_step`` by columns: the stream keys (bytes, not decoded), the ordinals and
    the payloads. Why: a streamer splits every line of every worker step, one per
    request per engine step; columns cost no tuple and no decoded key per line."""
    parts = raw.split(b"\n")
    end = len(parts) - len(parts) % 4
    return parts[0:end:4], [int(n) for n in parts[2:end:4]], parts[3:end:4]


def step_entry_columns(
    key: str, entries: list[Any]
) -> Iterator[tuple[bytes | None, tuple[list[bytes], list[int], list[bytes]]]]:
    """The publish time (``t``; None: not stamped) and lines (``step_columns``) of each
    entry read from step stream ``key``. A malformed entry is logged and skipped: a bug
    upstream, and the streams in it find their gap."""
    for eid, fields in entries:
        try:
            columns = step_columns(fields[b"d"])
        except Exception:
            logger.error("malformed step entry %s in %s", as_str(eid), key)
            continue
        yield fields.get(b"t"), columns
