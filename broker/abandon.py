"""Streams whose clients left: cancelled after the resume grace unless followed again,
by whichever web process gets there first.

A stream whose client disconnected (or whose web process handed it over while
stopping) keeps generating for ``resume_grace_s``, so that the client can resume it on
any web process; then it is cancelled if nobody follows it. The deadline is kept in
Redis (a sorted set on the global tag, request id scored by deadline), not only in a
timer of the process that saw the client go: that process may stop before the grace
is up (every rolling deploy hands its streams over and exits), and a timer dies with
it, leaving the request generating to its end for nobody. So each web process acts
on its own deadlines with a timer, and a web server's processes sweep the set every
few seconds for the deadlines of processes that are gone; one Lua call takes a due
entry out, so exactly one process acts on it, and a deadline pushed back by a later
disconnect is not taken early.

Not covered: a web process SIGKILLed while its client is still connected never counts
that client as gone (its follower count stays up until the key's TTL), so the request
runs to its end (``max_tokens``, the request deadline): docs/reliability.md.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import redis

from broker.keys import Keys

logger = logging.getLogger(__name__)

# How often a web process looks for other processes' due deadlines: a request of a
# stopped process is cancelled at most this long after its grace.
SWEEP_S = 5.0
SWEEP_BATCH = 100

# Take ARGV[1] (a request id) out of the set if its deadline has passed (ARGV[2]: now).
TAKE_DUE = """
local due = redis.call('ZSCORE', KEYS[1], ARGV[1])
if due and tonumber(due) <= tonumber(ARGV[2]) then
  redis.call('ZREM', KEYS[1], ARGV[1])
  return 1
end
return 0
"""


class Abandoned:
    """The abandoned streams' deadlines (module doc); ``cancel`` cancels a request."""

    def __init__(
        self,
        client: redis.Redis,
        keys: Keys,
        grace_s: float,
        cancel: Callable[[str], None],
        *,
        clock: Callable[[], float] = time.time,
        sweep_s: float = SWEEP_S,
    ) -> None:
        self.redis = client
        self.keys = keys
        self.grace_s = grace_s
        self.cancel = cancel
        self.clock = clock
        self.sweep_s = sweep_s
        self._take_due = client.register_script(TAKE_DUE)
        self._sweeper: threading.Thread | None = None
        self._lock = threading.Lock()
        self.stopping = threading.Event()

    def later(self, rid: str) -> None:
        """Cancel ``rid`` after the grace unless a client follows it again by then."""
        self.redis.zadd(self.keys.abandoned, {rid: self.clock() + self.grace_s})
        timer = threading.Timer(self.grace_s, self._due, (rid,))
        timer.daemon = True
        timer.start()

    def start_sweeping(self) -> None:
        """Start this process's sweeper thread, once: a web server's processes do (its
        thread keeps this object, and what ``cancel`` holds, for the process's life)."""
        with self._lock:
            if self._sweeper is None:
                self._sweeper = threading.Thread(
                    target=self._sweep_loop, name="abandoned-sweeper", daemon=True
                )
                self._sweeper.start()

    def sweep(self) -> int:
        """Act on every due deadline, any process's; how many were cancelled."""
        due: Any = self.redis.zrangebyscore(
            self.keys.abandoned, "-inf", self.clock(), start=0, num=SWEEP_BATCH
        )
        return sum(self._act(rid.decode() if isinstance(rid, bytes) else rid) for rid in due)

    def _due(self, rid: str) -> None:
        try:
            self._act(rid)
        except redis.RedisError as exc:  # the sweep tries again
            logger.warning("could not cancel abandoned request %s yet: %s", rid, exc)

    def _act(self, rid: str) -> bool:
        """Take ``rid``'s deadline if due and cancel it unless it is followed again."""
        if not self._take_due(keys=[self.keys.abandoned], args=[rid, self.clock()]):
            return False  # not due (a later disconnect pushed it back), or taken
        if int(self.redis.get(self.keys.followers(rid)) or 0) > 0:
            return False  # a client resumed it
        self.cancel(rid)
        return True

    def _sweep_loop(self) -> None:
        while not self.stopping.wait(self.sweep_s):
            try:
                self.sweep()
            except redis.RedisError as exc:
                logger.debug("abandoned streams' sweep failed: %s", exc)
            except Exception:  # a bug must not end the sweeps
                logger.exception("abandoned streams' sweep failed")
