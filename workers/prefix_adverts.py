"""When a worker tells the web tier what its engine holds (``broker.prefix_routes``).

The engine thread calls ``tick`` after every iteration; this decides whether to write.
The names of the cached prefixes (``Engine.prefix_blocks``) are written when a choice
finished (its KV is now cached: the client may send the next turn the moment it sees
the reply end, so this runs before that step's tokens are published), otherwise at
most every ``EVERY_S`` when they changed (running prompts, evictions), and whole every
``REFRESH_S`` (a Redis restarted without its data). The load (requests running or
waiting here) is written with them, or alone, whenever it changed: the web tier's room
check reads it because the heartbeat's is up to a beat old. A failed write is retried
on the next tick.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import redis

from workers.engines.base import Engine

logger = logging.getLogger(__name__)

EVERY_S = 1.0
REFRESH_S = 30.0

# (names, the names the last write left in Redis or None to rewrite them all, load)
Write = Callable[[frozenset[bytes], frozenset[bytes] | None, int], None]


class PrefixAdvertiser:
    """The state of one worker's advertisement (module doc); engine thread only."""

    def __init__(self, write: Write, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.write = write
        self.clock = clock
        self._names: frozenset[bytes] | None = None  # as written; None: rewrite them all
        self._load = -1
        self._checked = 0.0
        self._sent = -REFRESH_S

    def tick(self, engine: Engine, finished: bool, load: int) -> None:
        now = self.clock()
        names = self._names
        if names is None or finished or now - self._checked >= EVERY_S:
            self._checked = now
            try:
                names = engine.prefix_blocks()
            except Exception:
                logger.exception("engine prefix_blocks failed")
                return
            if names is None:
                return
        refresh = now - self._sent >= REFRESH_S
        if names == self._names and load == self._load and not refresh:
            return
        try:
            self.write(names, None if refresh else self._names, load)
        except redis.RedisError as exc:
            logger.debug("advertising cached prefixes failed: %s", exc)
            self._names = None  # not known what Redis holds now: rewrite it next
            return
        self._names = names
        self._load = load
        if refresh:
            self._sent = now
