"""Long-lived connections per API key in this web worker: WebSockets and stream followers.

Each holds one of the worker's threads for as long as it is open (``web_threads``), and
neither goes through admission while it waits: 384 idle WebSockets of one key, or 400
followers of one key's own stream, took every thread and other keys timed out. So one
key may hold at most ``key_max_connections`` of them at once in one worker process;
past it, a 429 names the quota. A count per process, not in Redis: threads are per
process, and a count that dies with its process needs no cleaning up.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable

from app.errors import QuotaExceeded


class KeyConnections:
    """How many long-lived connections each key holds open in this process."""

    def __init__(self, limit: int) -> None:
        self.limit = limit  # 0: no limit
        self._open: Counter[str] = Counter()
        self._lock = threading.Lock()

    def open(self, owner: str) -> Callable[[], None]:
        """Count one more connection of ``owner`` (raises ``QuotaExceeded`` at the limit);
        the function that closes it, safe to call more than once."""
        if not owner or not self.limit:
            return lambda: None
        with self._lock:
            if self._open[owner] >= self.limit:
                raise QuotaExceeded(
                    f"This API key already holds {self.limit} WebSockets and stream "
                    "followers open on this server, its quota (key_max_connections); "
                    "close one first."
                )
            self._open[owner] += 1
        closed = threading.Event()

        def close() -> None:
            if closed.is_set():
                return
            closed.set()
            with self._lock:
                self._open[owner] -= 1
                if self._open[owner] <= 0:
                    del self._open[owner]

        return close

    def held(self, owner: str) -> int:
        with self._lock:
            return self._open[owner]
