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

A web process that dies without closing its streams (SIGKILL, the OOM killer, a lost
node) never counts its clients as gone, so ``Follows`` keeps how many of its clients
follow each request in Redis too (a hash per process, beside a registry of the
processes' heartbeats, both on the global tag). A process not heard from for
``DEAD_AFTER_S`` is taken for dead by the first sweep that sees it: one Lua call takes
its hash and registry entry (so exactly one process does this), its clients are
counted out of each request's followers, and a request left with none gets the resume
grace from the dead process's last heartbeat, then the same sweep cancels it unless a
client resumed it elsewhere meanwhile. A live process wrongly taken for dead (stopped
for longer than that) counts its clients in again on its next heartbeat, before a
cancel checks the count; the counts it mirrors may run ahead of its own between two
heartbeats (a follow racing a heartbeat), which errs on the side of not cancelling.

Every time here (deadlines, heartbeats) is Redis's clock, read in the Lua calls or with
``TIME``, never a host's: web hosts whose clocks differ must neither cancel early nor
take each other for dead.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
from collections.abc import Callable
from typing import Any

import redis
from redis.client import Pipeline

from broker.keys import Keys

logger = logging.getLogger(__name__)

# How often a web process looks for other processes' due deadlines: a request of a
# stopped process is cancelled at most this long after its grace.
SWEEP_S = 5.0
SWEEP_BATCH = 100
# A web process that has not heartbeat (once a sweep) for this long is taken for dead.
DEAD_AFTER_S = 20.0

# Every time here is Redis's clock (TIME), never a host's: web hosts' clocks may differ.
# ARGV[1] (a request id) is due ARGV[2] seconds from now.
LATER = """
local t = redis.call('TIME')
redis.call('ZADD', KEYS[1], tonumber(t[1]) + tonumber(t[2]) / 1e6 + tonumber(ARGV[2]), ARGV[1])
"""

# Take ARGV[1] (a request id) out of the set if its deadline has passed.
TAKE_DUE = """
local t = redis.call('TIME')
local due = redis.call('ZSCORE', KEYS[1], ARGV[1])
if due and tonumber(due) <= tonumber(t[1]) + tonumber(t[2]) / 1e6 then
  redis.call('ZREM', KEYS[1], ARGV[1])
  return 1
end
return 0
"""

# Take a dead web process's follows (KEYS: the registry, its hash; ARGV[1]: its id,
# ARGV[2]: the cutoff): {its last heartbeat, rid, count, rid, count, ...}, or {} when it
# has heartbeat since (or another process took them first).
REAP = """
local seen = redis.call('ZSCORE', KEYS[1], ARGV[1])
if not seen or tonumber(seen) > tonumber(ARGV[2]) then
  return {}
end
redis.call('ZREM', KEYS[1], ARGV[1])
local follows = redis.call('HGETALL', KEYS[2])
redis.call('DEL', KEYS[2])
table.insert(follows, 1, seen)
return follows
"""

# Count ARGV[1] followers out of KEYS[1]; the count left. A count gone (expired) stays
# gone, and one reaching 0 is deleted: never negative, so a later follower counts.
UNFOLLOW = """
if redis.call('EXISTS', KEYS[1]) == 0 then
  return 0
end
local left = redis.call('DECRBY', KEYS[1], ARGV[1])
if left <= 0 then
  redis.call('DEL', KEYS[1])
end
return left
"""

# The server's clock, as {seconds, microseconds} (KEYS[1]: only routes the call to the
# registry's node on a Redis Cluster).
SERVER_TIME = """
local t = redis.call('TIME')
return {t[1], t[2]}
"""


class Follows:
    """How many of this process's clients follow each request: kept here, and in Redis
    for the other processes to count them out if this one dies (module doc)."""

    def __init__(
        self, client: redis.Redis, keys: Keys, ttl_s: int, *, process_id: str = ""
    ) -> None:
        self.redis = client
        self.keys = keys
        self.ttl_s = ttl_s
        self.id = process_id or f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"
        self.key = keys.web_follows(self.id)
        self._counts: dict[str, int] = {}
        self._lock = threading.Lock()
        self._registered = False

    def queue(self, pipe: Pipeline, rid: str, change: int) -> None:
        """Count ``change`` of this process's clients in (+) or out (-) of ``rid``'s
        followers, the commands added to ``pipe``."""
        with self._lock:
            left = self._counts.get(rid, 0) + change
            if left > 0:
                self._counts[rid] = left
            else:
                self._counts.pop(rid, None)
        if left > 0:
            pipe.hincrby(self.key, rid, change)
        else:
            pipe.hdel(self.key, rid)
        pipe.expire(self.key, self.ttl_s)

    def empty(self) -> bool:
        with self._lock:
            return not self._counts

    def leave(self) -> None:
        pipe = self.redis.pipeline(transaction=False)
        pipe.zrem(self.keys.web_processes, self.id)
        pipe.delete(self.key)
        pipe.execute()

    def beat(self, now: float) -> None:
        """Say this process is alive, and mirror its counts as they are here. If it
        had been taken for dead (or Redis lost the registry), its clients are counted
        in again: whoever took it for dead counted them out."""
        with self._lock:
            counts = dict(self._counts)
        pipe: Any = self.redis.pipeline(transaction=False)
        pipe.zadd(self.keys.web_processes, {self.id: now})
        pipe.delete(self.key)
        if counts:
            pipe.hset(self.key, mapping=counts)
            pipe.expire(self.key, self.ttl_s)
        added = pipe.execute()[0]
        if added and self._registered and counts:
            logger.warning(
                "this web process was taken for dead (its heartbeats stopped for longer "
                "than web_dead_after_s): counting its clients of %d streams in again",
                len(counts),
            )
            pipe = self.redis.pipeline(transaction=False)
            for rid, n in counts.items():
                pipe.incrby(self.keys.followers(rid), n)
                pipe.expire(self.keys.followers(rid), self.ttl_s)
            pipe.execute()
        self._registered = True


class Abandoned:
    """The abandoned streams' deadlines (module doc); ``cancel`` cancels a request."""

    def __init__(
        self,
        client: redis.Redis,
        keys: Keys,
        grace_s: float,
        cancel: Callable[[str], None],
        *,
        sweep_s: float = SWEEP_S,
        dead_after_s: float = DEAD_AFTER_S,
        ttl_s: int = 3600,
    ) -> None:
        self.redis = client
        self.keys = keys
        self.grace_s = grace_s
        self.cancel = cancel
        self.sweep_s = sweep_s
        self.dead_after_s = dead_after_s
        # This process's clients (``ttl_s``: how long a count outlives its last change).
        self.follows = Follows(client, keys, ttl_s)
        self._later = client.register_script(LATER)
        self._take_due = client.register_script(TAKE_DUE)
        self._reap = client.register_script(REAP)
        self._unfollow = client.register_script(UNFOLLOW)
        self._server_time = client.register_script(SERVER_TIME)
        self._sweeper: threading.Thread | None = None
        self._lock = threading.Lock()
        self.stopping = threading.Event()

    def later(self, rid: str) -> None:
        """Cancel ``rid`` after the grace unless a client follows it again by then."""
        self._later(keys=[self.keys.abandoned], args=[rid, self.grace_s])
        timer = threading.Timer(self.grace_s, self._due, (rid,))
        timer.daemon = True
        timer.start()

    def leave(self) -> None:
        """This process is exiting: stop sweeping, and take it out of the registry if
        none of its clients follows anything (else the others count them out)."""
        self.stopping.set()
        if self.follows.empty():
            self.follows.leave()

    def start_sweeping(self) -> None:
        """Start this process's sweeper thread, once: a web server's processes do (its
        thread keeps this object, and what ``cancel`` holds, for the process's life)."""
        with self._lock:
            if self._sweeper is None:
                self._sweeper = threading.Thread(
                    target=self._sweep_loop, name="abandoned-sweeper", daemon=True
                )
                self._sweeper.start()

    def tick(self) -> int:
        """One sweep: this process's heartbeat, the dead processes' clients counted
        out, then every due deadline; how many requests were cancelled."""
        now = self.now()
        self.follows.beat(now)
        self.reap(now)
        return self.sweep(now)

    def now(self) -> float:
        """Redis's clock (the registry's node on a cluster), which every time here is."""
        seconds, micros = self._server_time(keys=[self.keys.web_processes])
        return int(seconds) + int(micros) / 1e6

    def reap(self, now: float) -> int:
        """Count the clients of every web process not heard from for ``dead_after_s``
        out of their requests' followers; a request left with none gets its grace from
        the process's last heartbeat. How many processes were taken for dead."""
        cutoff = now - self.dead_after_s
        dead: Any = self.redis.zrangebyscore(
            self.keys.web_processes, "-inf", cutoff, start=0, num=SWEEP_BATCH
        )
        taken = 0
        for raw in dead:
            wid = raw.decode() if isinstance(raw, bytes) else raw
            if wid == self.follows.id:
                continue  # this process, between its heartbeats
            keys = [self.keys.web_processes, self.keys.web_follows(wid)]
            got: Any = self._reap(keys=keys, args=[wid, cutoff])
            if not got:
                continue  # it heartbeat since, or another process took it
            taken += 1
            seen, follows = float(got[0]), got[1:]
            pairs = [(r.decode() if isinstance(r, bytes) else r, int(n))
                     for r, n in zip(follows[::2], follows[1::2], strict=True)]  # fmt: skip
            logger.log(
                logging.WARNING if pairs else logging.INFO,
                "web process %s has not heartbeat for %.1f s: counting its clients out "
                "of %d streams", wid, now - seen, len(pairs),
            )  # fmt: skip
            deadline = max(now, seen + self.grace_s)
            for rid, n in pairs:
                if n > 0 and int(self._unfollow(keys=[self.keys.followers(rid)], args=[n])) <= 0:
                    # GT: a later disconnect's deadline (another process's) stands.
                    self.redis.zadd(self.keys.abandoned, {rid: deadline}, gt=True)
        return taken

    def sweep(self, now: float | None = None) -> int:
        """Act on every due deadline, any process's; how many were cancelled."""
        due: Any = self.redis.zrangebyscore(
            self.keys.abandoned, "-inf", self.now() if now is None else now, start=0,
            num=SWEEP_BATCH,
        )  # fmt: skip
        return sum(self._act(rid.decode() if isinstance(rid, bytes) else rid) for rid in due)

    def _due(self, rid: str) -> None:
        try:
            self._act(rid)
        except redis.RedisError as exc:  # the sweep tries again
            logger.warning("could not cancel abandoned request %s yet: %s", rid, exc)

    def _act(self, rid: str) -> bool:
        """Take ``rid``'s deadline if due and cancel it unless it is followed again."""
        if not self._take_due(keys=[self.keys.abandoned], args=[rid]):
            return False  # not due (a later disconnect pushed it back), or taken
        if int(self.redis.get(self.keys.followers(rid)) or 0) > 0:
            return False  # a client resumed it
        self.cancel(rid)
        return True

    def _sweep_loop(self) -> None:
        while True:  # a heartbeat at once: the process is registered from its start
            try:
                self.tick()
            except redis.RedisError as exc:
                logger.debug("abandoned streams' sweep failed: %s", exc)
            except Exception:  # a bug must not end the sweeps
                logger.exception("abandoned streams' sweep failed")
            if self.stopping.wait(self.sweep_s):
                return
