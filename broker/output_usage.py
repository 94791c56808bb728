"""The output one API key keeps in Redis: the bytes its requests' output streams hold.

Output streams are kept ``stream_ttl_s`` after their last write, for resumes and
replays, whoever asked for them; one key's top-20-logprobs streams (~525 B a token) or
one n=8 request (112 MB) filled Redis for every other key (issue 47). The streamers count
what they write for each key (``add``, in memory) and add it to a counter per key and
``BUCKET_S`` period every heartbeat (``flush``); each counter expires when the streams
written in its period have. The web tier refuses a key's new request while the counters
of the last ``stream_ttl_s`` add up to its quota (``used``): an approximate, cheap count
(one round trip a second per streamer, one MGET per start), exact to a bucket and a
heartbeat, which is what a quota needs.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import redis

from broker.keys import Keys

BUCKET_S = 300


class OutputUsage:
    """Bytes of output written per key, per ``BUCKET_S`` period, kept ``window_s``."""

    def __init__(
        self,
        client: redis.Redis,
        keys: Keys,
        *,
        window_s: int,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.redis = client
        self.keys = keys
        self.window_s = window_s
        self.clock = clock
        self._pending: Counter[str] = Counter()

    def add(self, owner: str, size: int) -> None:
        """Count ``size`` bytes written for ``owner`` (a key's hash; "" is not counted)."""
        if owner:
            self._pending[owner] += size

    def flush(self) -> None:
        """Add what was counted since the last flush to the counters (one round trip);
        kept to be added again if Redis is away."""
        if not self._pending:
            return
        bucket = int(self.clock() // BUCKET_S)
        pipe = self.redis.pipeline(transaction=False)
        for owner, size in self._pending.items():
            key = self.keys.owner_output_bytes(owner, bucket)
            pipe.incrby(key, size)
            pipe.expire(key, self.window_s + BUCKET_S)
        pipe.execute()
        self._pending.clear()

    def _buckets(self) -> list[int]:
        now = int(self.clock() // BUCKET_S)
        return list(range(now - math.ceil(self.window_s / BUCKET_S), now + 1))

    def used(self, owner: str) -> int:
        """The bytes of output ``owner``'s requests wrote in the last ``window_s``."""
        keys = [self.keys.owner_output_bytes(owner, b) for b in self._buckets()]
        values: Any = self.redis.mget(keys)
        return sum(int(v) for v in values if v)

    def frees_in(self) -> int:
        """Seconds until the oldest period counted leaves the window (a Retry-After)."""
        buckets = self._buckets()
        leaves_at = (buckets[0] + len(buckets)) * BUCKET_S  # when it is no longer counted
        return max(1, math.ceil(leaves_at - self.clock()))
