"""Fair share between API keys, decided where a worker takes its next job.

Why there: the workers' Celery queue is a list served in arrival order, so a key that
queued 200 requests made every other key wait behind all 200. Ordering in admission
cannot fix that once they are queued, and kombu's four priority steps are too coarse to
(``broker.celery_app.fair_priority``). So with keys configured and ``fair_share`` on, an
interactive request is queued twice: its id in its key's own queue here (a sorted set
by ``priority``, then arrival), and a Celery task that says only "take the next fair
request of this model" (``fair=True``). Whichever worker runs such a task pops from
here: the key with the smallest virtual start time (start-time fair queuing: each
request a key takes moves its clock on by ``1 / weight``), then that key's first
request. A key that was idle starts ``BURST_TURNS`` of its turns behind the current
virtual time (or where its clock stopped, if later): it may take that many turns in a
row, then it shares; it cannot bank more. One
task per request keeps the Celery queue's length the number of requests waiting (what
KEDA and the gauges read); which request a task runs is decided at the last moment.

A popped id whose request is not waiting any more (cancelled, or claimed by a resend of
the streamers' watchdog) is skipped by the worker, which pops the next.

Keys (one hash tag per model, for Redis Cluster): ``{p}fq:{<model>}`` the keys with
waiting requests by virtual start, ``{p}fq:{<model>}:s`` the clock, each key's weight and
last finish, ``{p}fq:{<model>}:o:<owner>`` one key's waiting request ids.
"""

from __future__ import annotations

import redis
from celery import Celery

from app.records import RequestRecord
from broker.celery_app import send_generate
from broker.keys import Keys

# KEYS: owners zset, state hash, the owner's requests zset
# ARGV: owner, rid, priority, weight (0: keep the key's), ttl s, burst turns. A request
# already queued keeps its place (a resend). A key that starts waiting starts its clock
# ``burst`` of its turns behind the current time, or where it stopped if that is later.
PUSH = """
local seq = redis.call('HINCRBY', KEYS[2], 'seq', 1)
redis.call('ZADD', KEYS[3], 'NX', tonumber(ARGV[3]) * 4294967296 + seq, ARGV[2])
if tonumber(ARGV[4]) > 0 then redis.call('HSET', KEYS[2], 'w:' .. ARGV[1], ARGV[4]) end
if not redis.call('ZSCORE', KEYS[1], ARGV[1]) then
  local v = tonumber(redis.call('HGET', KEYS[2], 'v') or '0')
  local f = tonumber(redis.call('HGET', KEYS[2], 'f:' .. ARGV[1]) or '-1e18')
  local w = tonumber(redis.call('HGET', KEYS[2], 'w:' .. ARGV[1]) or '1')
  redis.call('ZADD', KEYS[1], math.max(v - tonumber(ARGV[6]) / w, f), ARGV[1])
end
for i = 1, 3 do redis.call('EXPIRE', KEYS[i], ARGV[5]) end
return seq
"""

# KEYS: owners zset, state hash; ARGV: the owners' request zsets' key prefix
# -> the next request id, or false when nothing waits
POP = """
while true do
  local top = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
  if #top == 0 then return false end
  local owner, start = top[1], tonumber(top[2])
  local mine = ARGV[1] .. owner
  local got = redis.call('ZPOPMIN', mine)
  local w = tonumber(redis.call('HGET', KEYS[2], 'w:' .. owner) or '1')
  local finish = start + 1 / w
  redis.call('HSET', KEYS[2], 'v', start)
  if redis.call('ZCARD', mine) > 0 then
    redis.call('ZADD', KEYS[1], finish, owner)
  else
    redis.call('ZREM', KEYS[1], owner)
    redis.call('HSET', KEYS[2], 'f:' .. owner, finish)
  end
  if #got > 0 then return got[1] end
end
"""

#: Priority is clamped to this range (vLLM's field is any integer; lower runs first).
MAX_PRIORITY = 1_000_000
#: Turns a key that was idle may take in a row before it shares with the keys already
#: waiting: a light user's few requests go ahead of a flood's backlog (its time to first
#: token stays near what it is alone), but no returning key holds the workers for
#: more than this many of its requests.
BURST_TURNS = 16


class FairQueue:
    """The per-key queues of one Redis (every model's)."""

    def __init__(self, client: redis.Redis, keys: Keys, *, ttl_s: int) -> None:
        self.redis = client
        self.keys = keys
        self.ttl_s = ttl_s
        self._push = client.register_script(PUSH)
        self._pop = client.register_script(POP)

    def push(self, model: str, owner: str, rid: str, *, priority: int = 0, weight: int = 1) -> None:
        """Queue ``rid`` as ``owner``'s, behind its requests of the same priority (where
        it is already queued, it keeps its place); ``weight`` 0 keeps the key's."""
        pri = max(-MAX_PRIORITY, min(priority, MAX_PRIORITY))
        keys = [self.keys.fair_owners(model), self.keys.fair_state(model)]
        keys.append(self.keys.fair_requests(model, owner))
        self._push(keys=keys, args=[owner, rid, pri, max(weight, 0), self.ttl_s, BURST_TURNS])

    def pop(self, model: str) -> str | None:
        """The next request by fair share, removed from its queue; None: none waits."""
        keys = [self.keys.fair_owners(model), self.keys.fair_state(model)]
        got = self._pop(keys=keys, args=[self.keys.fair_requests(model, "")])
        if not got:
            return None
        return got.decode() if isinstance(got, bytes) else str(got)


def send_again(celery: Celery, fair: FairQueue, record: RequestRecord, attempt: int) -> None:
    """A streamer's resend of a request still queued (its task may be lost): a fair-share
    request is put back in its key's queue, where it keeps its place if it is still there,
    with a task to take the next one, so a resend never lets a request past the others;
    any other request is sent for its attempt as before."""
    if record.fair and attempt == 0:
        fair.push(record.model, record.owner, record.request_id, priority=record.priority, weight=0)
    send_generate(
        celery,
        record.request_id,
        attempt,
        queue=record.queue,
        model=record.model,
        fair=record.fair and attempt == 0,
        trace=record.trace,
    )
