"""Lua scripts: every check-and-set on request state happens inside Redis.

The lease is the fence. A worker may publish tokens for a request only while the lease
key holds its own ``worker:attempt`` value; a resume bumps ``attempt``, so a worker that
was presumed dead (or Celery's later redelivery of the original task) can never publish
a second copy of the tokens.
"""

from __future__ import annotations

# KEYS: req, lease, cancel          ARGV: attempt, lease_value, lease_ttl_ms, now
# -> 'ok' | 'missing' | 'stale' | 'done' | 'held' | 'cancelled'
CLAIM = """
local state = redis.call('HGET', KEYS[1], 'state')
if not state then return 'missing' end
if state == 'done' then return 'done' end
if redis.call('HGET', KEYS[1], 'attempt') ~= ARGV[1] then return 'stale' end
if redis.call('EXISTS', KEYS[2]) == 1 then return 'held' end
if redis.call('EXISTS', KEYS[3]) == 1 then
  redis.call('HSET', KEYS[1], 'state', 'done')
  return 'cancelled'
end
redis.call('SET', KEYS[2], ARGV[2], 'PX', ARGV[3])
redis.call('HSET', KEYS[1], 'state', 'running', 'worker', ARGV[2])
redis.call('HSETNX', KEYS[1], 'claimed', ARGV[4])
return 'ok'
"""

# KEYS: req, lease                  ARGV: (none)
# A running request whose lease expired goes back to queued with attempt + 1.
# -> the new attempt, or -1 when there is nothing to resume.
RESUME = """
if redis.call('HGET', KEYS[1], 'state') ~= 'running' then return -1 end
if redis.call('EXISTS', KEYS[2]) == 1 then return -1 end
redis.call('HSET', KEYS[1], 'state', 'queued', 'worker', '')
return redis.call('HINCRBY', KEYS[1], 'attempt', 1)
"""

# KEYS: per request i (4 each): lease, tokens, req, cancel
# ARGV: lease_ttl_ms, stream_ttl_s, now (publish time, unix s), then per request (4 each):
#       lease_value, attempt, payload ('' = lease refresh only), flags (1 first, 2 done)
# -> per request: 0 published, 1 fenced (lease lost: stop generating), 2 cancel requested
PUBLISH = """
local out = {}
local n = #KEYS / 4
for i = 0, n - 1 do
  local k = i * 4
  local lease, tok, req, cancel = KEYS[k + 1], KEYS[k + 2], KEYS[k + 3], KEYS[k + 4]
  local a = 4 + k
  if redis.call('GET', lease) ~= ARGV[a] then
    out[i + 1] = 1
  else
    local flags = tonumber(ARGV[a + 3])
    if ARGV[a + 2] ~= '' then
      redis.call('XADD', tok, '*', 'a', ARGV[a + 1], 't', ARGV[3], 'd', ARGV[a + 2])
    end
    if flags % 2 == 1 then redis.call('EXPIRE', tok, ARGV[2]) end
    if flags >= 2 then
      redis.call('DEL', lease)
      redis.call('HSET', req, 'state', 'done', 'worker', '')
      out[i + 1] = 0
    else
      redis.call('PEXPIRE', lease, ARGV[1])
      out[i + 1] = redis.call('EXISTS', cancel) * 2
    end
  end
end
return out
"""

# KEYS: inflight zset              ARGV: now, limit, rid, deadline
# Admission across every web process: requests in flight (pruned at their deadline,
# so a crashed web process cannot leak capacity). -> 1 admitted, 0 full
ADMIT = """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[1])
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[2]) then return 0 end
redis.call('ZADD', KEYS[1], ARGV[4], ARGV[3])
return 1
"""
