"""Lua scripts: every check-and-set on request state happens inside Redis.

The lease is the fence. A worker may publish tokens for a request only while the lease
key holds its own ``worker:attempt`` value; a resume bumps ``attempt``, so a worker that
was presumed dead (or Celery's later redelivery of the original task) can never publish
a second copy of the tokens.

The fence epoch (``Keys.fence_epoch``) spares the publish checking every request's lease
and cancel key at every step: it changes (to a value it never had) with everything that
can fence a worker or cancel a request (a resume, a second claim of an attempt, a cancel),
so a worker whose last publish checked everything, on the same connection, under the
epoch that is still current knows nothing changed since (``PUBLISH``).
"""

from __future__ import annotations

# The end of the plain requests' check (PUBLISH, WRITE_OUTPUTS): the step entry's data
# ``d`` is the lines this call built, then the plain lines it kept, one per line.
_JOIN_STEP_LINES = """  plain = table.concat(kept, '\\n')
end
local d = table.concat(lines, '\\n')
if plain ~= '' then
  if d == '' then d = plain else d = d .. '\\n' .. plain end
end
"""

# KEYS: req, lease, cancel, fence epoch    ARGV: attempt, lease_value, lease_ttl_ms, now[, load]
# -> 'ok' | 'missing' | 'stale' | 'done' | 'held' | 'cancelled'; with load = '1', a claim
#    that succeeds returns {'ok', body, again}: the worker's start is one round trip, not
#    two; again = 1 when some attempt was claimed before (it may have published chunks)
# A second claim (of a newer attempt, or of the same one by Celery's redelivery after
# its lease expired) changes the fence epoch: the worker that held it before must check
# its leases at its next publish.
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
local again = 1 - redis.call('HSETNX', KEYS[1], 'claimed', ARGV[4])
if again == 1 then redis.call('SET', KEYS[4], 'c' .. ARGV[4] .. ':' .. ARGV[2]) end
if ARGV[5] == '1' then return {'ok', redis.call('HGET', KEYS[1], 'body'), again} end
return 'ok'
"""

# KEYS: req, lease, fence epoch     ARGV: (none)
# A running request whose lease expired goes back to queued with attempt + 1, and the
# fence epoch changes (to a value no other call sets: the request and its new attempt).
# -> the new attempt, or -1 when there is nothing to resume.
RESUME = """
if redis.call('HGET', KEYS[1], 'state') ~= 'running' then return -1 end
if redis.call('EXISTS', KEYS[2]) == 1 then return -1 end
redis.call('HSET', KEYS[1], 'state', 'queued', 'worker', '')
local attempt = redis.call('HINCRBY', KEYS[1], 'attempt', 1)
redis.call('SET', KEYS[3], 'r' .. KEYS[1] .. ':' .. attempt)
return attempt
"""

# KEYS: the fence epoch, then per request written out (4 each): lease, tokens, req,
#       cancel; then per plain request (2 each, or none: below): lease, cancel; then,
#       optionally, the worker's step stream (always there with plain requests)
# ARGV: lease_ttl_ms, stream_ttl_s, now (publish time, unix s), epoch ('' = unknown; else
#       'e:' and the epoch this connection's last publish returned), the number of
#       requests written out, the number of plain ones, the plain requests' step lines
#       (below), then per request written out (4 each): lease_value, attempt, payload
#       ('' = lease refresh only), flags + 16 x ordinal (flags: 1 first, 2 done, 4 keep
#       the lease's TTL: the worker refreshes it only every fifth of a lease, 8
#       checkpoint; ordinal 0: the next after the token stream's last entry); then, with
#       a step stream, the worker id and the prior chunks of each request written out
#       with flag 8 and a payload, in order (only checkpoints carry them)
# Each payload is a chunk of the request's tokens with its ordinal (n, 1-based, counted
# over every attempt). Without a step stream every chunk is an entry of the request's
# token stream. With one, the step stream gets one entry per call holding every chunk
# it published, one line each: token stream key, attempt, ordinal, payload (a streamer
# reads one entry per step instead of one per request; docs/architecture.md), trimmed
# to about 256 entries; and a chunk goes into the request's own token stream only at a
# checkpoint (flag 8, or no ordinal given), which the worker asks for on an attempt's
# first chunk, its last, and at least once every ``broker.chunks.CHECKPOINT_STEPS``
# publishes: that entry holds the chunks since the last checkpoint (``prior``, see
# broker/chunks.py), the worker (w) and its step entry (s). So the token stream plus
# the step entries after its last entry's s hold every chunk, and a request costs one
# entry of its own per checkpoint instead of one per step (the floor benchmark measured
# the per-request XLEN and XADD as two fifths of the relay's Redis time).
# The token stream gets its TTL on an attempt's first publish and again on the last (an
# EXPIRE on a stream not created yet does nothing: a first publish without tokens would
# otherwise leave the stream without a TTL for ever).
# Each request's lease and cancel key are checked only when the fence epoch is not the
# one the worker knows (a GET and an EXISTS per request per step were two fifths of the
# script's time at 64 requests: benchmarks/relay_floor.py). Nothing that can fence or
# cancel a request leaves it as it was (CLAIM, RESUME, ``RequestStore.cancel``), and the
# worker forgets it whenever its connection is new (Redis may have restarted without the
# last writes: ``KnownEpoch``), so an unchanged epoch means every request's lease is still
# the worker's own (or expired with no one else holding it: still its attempt) and none
# was cancelled since the check. A missing epoch is created (from this call's time): a
# Redis that lost it makes every worker check.
# A plain request is one whose chunk needs nothing but its step line: a payload with its
# ordinal, not its attempt's first or last, no checkpoint, no lease extension, its lease
# value the worker's own (worker:attempt). Most requests are plain at most steps, and
# the worker writes their step lines itself, joined as the step entry holds them: under
# the known epoch the script only appends them, with no argument and no command per
# request (the per-request arguments, about 8 each, were most of the publish's cost on
# both sides: benchmarks/relay_floor.py). When the epoch changed, it checks each plain
# request's lease (against worker:attempt, the attempt read from its line) and cancel
# key, and leaves the lines of those fenced out.
# A worker that expects the epoch it knows leaves the plain requests' keys out (KEYS:
# the epoch, four per request written out, then the step stream): two keys per request
# per step that the script would not touch (a third of the bare call's cost at 64). If
# the epoch changed after all, the script writes nothing and replies 'recheck' and the
# epoch, and the worker sends the same call again with them.
# -> per request written out, then per plain request when they were checked (the epoch
#    changed; unchecked, every one is published): 0 published, 1 fenced (lease lost:
#    stop generating), 2 cancel requested; then the epoch the call ran under. (Leaving
#    the plain ones out when unchecked took a fifth of the call's time: 64 zeros.)
#    'recheck' and the epoch: checked, but the plain requests' keys were left out.
PUBLISH = (
    """
local out = {}
local n, np = tonumber(ARGV[5]), tonumber(ARGV[6])
local steps = nil
local worker = nil
local keyed = true  -- the plain requests' lease and cancel keys are given
if #KEYS > 1 + n * 4 then
  steps = KEYS[#KEYS]
  worker = ARGV[8 + n * 4]
  keyed = #KEYS > 2 + n * 4
end
local epoch = redis.call('GET', KEYS[1])
if not epoch then
  epoch = 'p' .. ARGV[3]
  redis.call('SET', KEYS[1], epoch)
end
local check = ARGV[4] ~= 'e:' .. epoch
if check and np > 0 and not keyed then
  return {'recheck', epoch}  -- nothing written (but a lost epoch): sent again with the keys
end
local lines = {}
local marks = {}  -- the checkpoints, written once the step entry's id is known
local prior = 8 + n * 4  -- the last prior chunks argument taken
for i = 0, n - 1 do
  local k = 1 + i * 4
  local lease, tok, req, cancel = KEYS[k + 1], KEYS[k + 2], KEYS[k + 3], KEYS[k + 4]
  local a = 8 + i * 4
  local f = tonumber(ARGV[a + 3])
  local payload = ARGV[a + 2]
  local p = ''  -- its prior chunks (taken whether it is fenced or not: they are in order)
  if steps and f % 16 >= 8 and payload ~= '' then
    prior = prior + 1
    p = ARGV[prior]
  end
  if check and redis.call('GET', lease) ~= ARGV[a] then
    out[i + 1] = 1
  else
    local flags = f % 4
    local keep = f % 8 >= 4
    if payload ~= '' then
      local seq = math.floor(f / 16)
      local mark = seq == 0 or f % 16 >= 8 or not steps
      if seq == 0 then seq = redis.call('XLEN', tok) + 1 end
      if steps then
        local m = #lines  -- four lines per chunk, joined once at the end
        lines[m + 1], lines[m + 2], lines[m + 3], lines[m + 4] = tok, ARGV[a + 1], seq, payload
        if mark then marks[#marks + 1] = {tok, ARGV[a + 1], payload, seq, p, flags} end
      else
        redis.call('XADD', tok, '*', 'a', ARGV[a + 1], 't', ARGV[3], 'd', payload, 'n', seq)
        if flags ~= 0 then redis.call('EXPIRE', tok, ARGV[2]) end
      end
    elseif flags ~= 0 then
      redis.call('EXPIRE', tok, ARGV[2])
    end
    if flags >= 2 then
      redis.call('DEL', lease)
      redis.call('HSET', req, 'state', 'done', 'worker', '')
      out[i + 1] = 0
    else
      if not keep then redis.call('PEXPIRE', lease, ARGV[1]) end
      out[i + 1] = check and redis.call('EXISTS', cancel) * 2 or 0
    end
  end
end
local plain = ARGV[7]
if np > 0 and check then
  local parts = {}
  for line in string.gmatch(plain, '[^\\n]+') do parts[#parts + 1] = line end
  local kept = {}
  local base = 1 + n * 4
  for j = 0, np - 1 do
    local q = j * 4
    if redis.call('GET', KEYS[base + j * 2 + 1]) ~= worker .. ':' .. parts[q + 2] then
      out[n + j + 1] = 1
    else
      for r = 1, 4 do kept[#kept + 1] = parts[q + r] end
      out[n + j + 1] = redis.call('EXISTS', KEYS[base + j * 2 + 2]) * 2
    end
  end
"""
    + _JOIN_STEP_LINES
    + """if d ~= '' then
  local sid = redis.call('XADD', steps, 'MAXLEN', '~', 256, '*', 't', ARGV[3], 'd', d)
  redis.call('EXPIRE', steps, ARGV[2])
  for _, m in ipairs(marks) do
    local fields = {'a', m[2], 't', ARGV[3], 'd', m[3], 'n', m[4], 'w', worker, 's', sid}
    if m[5] ~= '' then fields[13], fields[14] = 'p', m[5] end
    redis.call('XADD', m[1], '*', unpack(fields))
    if m[6] ~= 0 then redis.call('EXPIRE', m[1], ARGV[2]) end
  end
end
out[#out + 1] = epoch
return out
"""
)

# KEYS: lease, tokens       ARGV: lease_value ('' = none: see below), attempt, now,
#                                 ordinal of the token stream's last entry as read (0 =
#                                 empty), then the chunks to seal: last ordinal, last
#                                 payload, prior chunks
# A resumed attempt seals the chunks its predecessor published after its last checkpoint
# (they are only in that worker's step stream, which goes on being trimmed) into the
# token stream, under its own lease, before it publishes anything: the record is whole
# at every attempt's start. The entry names no worker: there is no tail after it.
# The predecessor itself seals them too, without a lease, the moment a publish tells it
# it was fenced (``RequestStore.seal_fenced``): a worker that lost some leases but goes
# on serving its other requests trims its step stream, and the new attempt may start
# only after the tail is gone from it (it waits for a free slot). The predecessor knows
# its tail (``ChunkLog``) and learns of the fence before it has published a tenth of the
# step entries a step stream keeps. Without a lease the fence is the ordinal: only the
# attempt that wrote the token stream's last entry appends to it, and a successor's
# first write (its seal, or its first publish, a checkpoint) changes it.
# -> 1 sealed, 0 fenced (the lease is not ours), -1 the token stream changed since read
SEAL = """
if ARGV[1] ~= '' and redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
local last = redis.call('XREVRANGE', KEYS[2], '+', '-', 'COUNT', 1)
local have = 0
if last[1] then
  local f = last[1][2]
  for i = 1, #f, 2 do
    if f[i] == 'n' then have = tonumber(f[i + 1]) end
  end
end
if have ~= tonumber(ARGV[4]) then return -1 end
local fields = {'a', ARGV[2], 't', ARGV[3], 'd', ARGV[6], 'n', ARGV[5]}
if ARGV[7] ~= '' then fields[9], fields[10] = 'p', ARGV[7] end
redis.call('XADD', KEYS[2], '*', unpack(fields))
return 1
"""

# The end of WRITE_OUTPUTS: the usage ledger's counts (see there). ``wrote``: the
# entries written out that were written.
_COUNT_USAGE = """local counts = tonumber(ARGV[#ARGV])
if counts > 0 then
  local a0 = #ARGV - 3 - counts * 6
  local total = KEYS[#KEYS - counts * 3]
  local done_ttl, period_ttl = ARGV[#ARGV - 2], ARGV[#ARGV - 1]
  for j = 0, counts - 1 do
    local a, k = a0 + j * 6, #KEYS - counts * 3 + j * 3
    if wrote[tonumber(ARGV[a + 1])]
      and redis.call('SET', KEYS[k + 1], '1', 'NX', 'EX', done_ttl) then
      local label = ARGV[a + 2]
      for _, h in ipairs({KEYS[k + 2], KEYS[k + 3], total}) do
        redis.call('HINCRBY', h, label .. 'n', 1)
        for m, code in ipairs({'p', 'k', 'c', 'e'}) do
          local v = tonumber(ARGV[a + 2 + m])
          if v ~= 0 then redis.call('HINCRBY', h, label .. code, v) end
        end
      end
      redis.call('EXPIRE', KEYS[k + 2], period_ttl)
      redis.call('EXPIRE', KEYS[k + 3], period_ttl)
    end
  end
end
"""

# KEYS: the hand-off stream, the hand-off epoch, then one output stream per entry
#       written out, then (with a consumer) the streamer's output step stream, then the
#       usage ledger's (below)
# ARGV: group, consumer ('' = none: no fence, no step stream), ttl_s, epoch ('' =
#       unknown; else 'e:' and the epoch the streamer last checked its entries under),
#       call stamp, the number of entries written out, the plain entries' step lines
#       (below), their hand-off entry ids (one space between each; '-' = not fenced),
#       then per entry written out (5 each): hand-off entry id ('' = not fenced), flags +
#       16 x ordinal (flags: 1 first (set the TTL), 8 checkpoint; ordinal 0: the next
#       after the stream's last entry, written as a checkpoint), encoded events, source
#       (the token chunk ordinal they were decoded up to), publish time ('' = none); then
#       the prior chunks of each entry with flag 8, in order; then the usage ledger's
#       (below; the last is the number of counts, 0 = none)
# A streamer writes a request's output only while it still owns the request's hand-off
# entry: one that stalled (a pause, SIGSTOP) after it decoded and before this write must
# not append stale text after the streamer that took the request over (XAUTOCLAIM moves
# the entry's owner atomically). An entry pending for no one (Redis lost it) does not
# fence: the request must still be able to end with its error. Checking each entry's
# owner (XPENDING) was two fifths of this script's cost, so it is done only when the
# hand-off epoch is not the one the streamer knows: every takeover (TAKE_OVER) sets a
# new one first, and a streamer learns the epoch together with its entries' owners
# (``RequestHandoff.owners``), so an unchanged epoch means no entry changed hands since.
# Each output entry is a chunk of the request's events with its ordinal (n, 1-based,
# counted over every streamer that wrote the request), as token chunks are
# (broker/chunks.py). The step stream gets one entry per call holding every chunk
# written, one line each: output stream key, source, ordinal, events (a web process's
# hub reads one entry per write instead of one per request; docs/architecture.md),
# and the call's stamp (c: how a streamer whose reply was lost finds out whether the
# call ran), trimmed to about 256 entries. A plain entry (with a step stream, an
# ordinal, neither the request's first nor a checkpoint: most of them, at most writes)
# needs nothing but its step line, which the streamer writes itself, joined as the step
# entry holds them: under the known epoch the script only appends them, with no key, no
# argument and no command per entry (as ``PUBLISH`` does for plain requests); when the
# epoch changed it checks each one's owner and leaves out the lines of those fenced.
# A chunk goes into the request's own output stream only at a checkpoint (flag 8; every
# chunk without a step stream), which the streamer asks for on a request's first write,
# its last, and at least once every
# ``broker.chunks.CHECKPOINT_STEPS`` writes: that entry holds the chunks since the last
# checkpoint (p), its own (d, n, s), the streamer (w) and the step entry of its call
# (i), and the publish time of its tokens (t, for the latency benchmarks). So the output
# stream plus the step entries after its last entry's i hold every chunk.
# The usage ledger (``broker.usage_ledger``): the request a terminal entry ends is
# counted in the same call, so no crash can come between its end and its count. Its
# arguments come last, read from the end: per count (6 each) the index of its entry
# among those written out, the fields' label, prompt, cached and completion tokens and
# errors (0/1), then the guard's TTL, the period hashes' TTL and the number of counts
# (always there: 0 = none); its keys, after the step stream: the all-time hash, then per
# count its guard (``Keys.usage_done``), its day's and its hour's hash. A count is added
# only when its entry was written (not fenced: the streamer that took the request over
# counts it) and its guard was not set yet (SET NX): a write redone after a lost reply,
# a takeover that finds the end written, a second terminal entry, none counts twice.
# It runs after the call's first write, so a Redis at maxmemory that refuses the call
# refuses all of it, and one that ran the outputs runs the count too (a script's later
# writes are not refused: Redis does not stop a script half way).
# -> the 1-based indexes of the entries not written (fenced), counting those written out
#    first, then the plain ones
WRITE_OUTPUTS = (
    """
local n = tonumber(ARGV[6])
local owner = ARGV[2]
local steps = nil
if owner ~= '' then steps = KEYS[n + 3] end
local check = steps and ARGV[4] ~= 'e:' .. (redis.call('GET', KEYS[2]) or '')
local fenced = {}
local wrote = {}  -- the entries written out that were ours (the ledger counts those)
local lines = {}
local marks = {}  -- the checkpoints, written once the step entry's id is known
local prior = 8 + n * 5  -- the last prior chunks argument taken
for i = 1, n do
  local key = KEYS[i + 2]
  local a = 9 + (i - 1) * 5
  local f = tonumber(ARGV[a + 1])
  local seq = math.floor(f / 16)
  local p = ''  -- its prior chunks (taken whether it is fenced or not: they are in order)
  if f % 16 >= 8 then
    prior = prior + 1
    p = ARGV[prior]
  end
  local ours = true
  if check and ARGV[a] ~= '' then
    local pend = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[a], ARGV[a], 1)
    if pend[1] and pend[1][2] ~= owner then ours = false end
  end
  if ours then
    wrote[i] = true
    local mark = f % 16 >= 8 or seq == 0 or not steps
    if seq == 0 then
      seq = 1
      local last = redis.call('XREVRANGE', key, '+', '-', 'COUNT', 1)
      if last[1] then
        local lf = last[1][2]
        for j = 1, #lf, 2 do
          if lf[j] == 'n' then seq = tonumber(lf[j + 1]) + 1 end
        end
      end
    end
    if steps then
      local m = #lines  -- four lines per chunk, joined once at the end
      lines[m + 1], lines[m + 2], lines[m + 3], lines[m + 4] = key, ARGV[a + 3], seq, ARGV[a + 2]
    end
    if mark then marks[#marks + 1] = {key, seq, ARGV[a + 2], ARGV[a + 3], ARGV[a + 4], p, f % 2} end
  else
    fenced[#fenced + 1] = i
  end
end
local plain = ARGV[7]
if plain ~= '' and check then
  local parts = {}
  for line in string.gmatch(plain, '[^\\n]+') do parts[#parts + 1] = line end
  local kept = {}
  local j = 0
  for hid in string.gmatch(ARGV[8], '%S+') do
    local ours = true
    if hid ~= '-' then
      local pend = redis.call('XPENDING', KEYS[1], ARGV[1], hid, hid, 1)
      if pend[1] and pend[1][2] ~= owner then ours = false end
    end
    if ours then
      for r = 1, 4 do kept[#kept + 1] = parts[j * 4 + r] end
    else
      fenced[#fenced + 1] = n + j + 1
    end
    j = j + 1
  end
"""
    + _JOIN_STEP_LINES
    + """local sid = nil
if d ~= '' then
  sid = redis.call('XADD', steps, 'MAXLEN', '~', 256, '*', 'c', ARGV[5], 'd', d)
  redis.call('EXPIRE', steps, ARGV[3])
end
for _, m in ipairs(marks) do
  local fields = {'d', m[3], 'n', m[2], 's', m[4]}
  if sid then
    fields[#fields + 1], fields[#fields + 2] = 'w', owner
    fields[#fields + 1], fields[#fields + 2] = 'i', sid
  end
  if m[6] ~= '' then fields[#fields + 1], fields[#fields + 2] = 'p', m[6] end
  if m[5] ~= '' then fields[#fields + 1], fields[#fields + 2] = 't', m[5] end
  redis.call('XADD', m[1], '*', unpack(fields))
  if m[7] == 1 then redis.call('EXPIRE', m[1], ARGV[3]) end
end
"""
    + _COUNT_USAGE
    + """return fenced
"""
)

# KEYS: the hand-off stream, the hand-off epoch
# ARGV: group, consumer, min_idle_ms, count, a new epoch (random)
# XAUTOCLAIM of the entries idle longer than min_idle_ms (their streamer stopped touching
# them), and, when it claimed any, the new epoch: writers that trusted the old one check
# their entries' owners again (WRITE_OUTPUTS). One call, so no write can slip between.
# -> XAUTOCLAIM's reply
TAKE_OVER = """
local res = redis.call('XAUTOCLAIM', KEYS[1], ARGV[1], ARGV[2], ARGV[3], '0-0', 'COUNT', ARGV[4])
if #res[2] > 0 then redis.call('SET', KEYS[2], ARGV[5]) end
return res
"""

# KEYS: the hand-off stream; ARGV: group, consumer, then entry ids
# Resets the idle time of the consumer's entries that are still its own (XCLAIM with a
# min-idle of 0 takes an entry from whoever holds it: one taken over by another streamer
# since the caller last looked must stay taken, and no takeover may bypass the epoch).
# -> how many were touched
TOUCH = """
local n = 0
for i = 3, #ARGV do
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
  if p[1] and p[1][2] == ARGV[2] then
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i], 'JUSTID')
    n = n + 1
  end
end
return n
"""

# KEYS: leases; ARGV: lease_ttl_ms, then the lease value expected for each key
# Keeps the leases of requests still ours alive while one engine step runs long (see
# workers/lease_keeper.py); a lease that is gone or another's is left alone.
# -> how many were refreshed
REFRESH_LEASES = """
local n = 0
for i, lease in ipairs(KEYS) do
  if redis.call('GET', lease) == ARGV[i + 1] then
    redis.call('PEXPIRE', lease, ARGV[1])
    n = n + 1
  end
end
return n
"""

# KEYS: inflight zset, inflight weights hash, the owner's requests and tokens counters
#       of this minute[, request hash, new-requests stream]
# ARGV: now, limit, rid, deadline, weight, owner, owner_limit, model, model_limit,
#       rpm, tpm, tokens to reserve, counter TTL[, body, state, ttl]
# Admission across every web process: requests in flight (pruned at their deadline,
# so a crashed web process cannot leak capacity), each weighing its choices (prompts x
# n) against ``limit``, and counted against its owner's ``owner_limit`` (0 or owner ""
# = none). The weights hash holds "<weight> <owner>" per request; a member without an
# entry weighs 1 and has no owner. A request that weighs more than the limit gets in
# only when nothing else is in flight, so it is never refused forever. With the last two
# keys an admitted request's record is written and handed to the streamers in the same
# call (``RequestStore.create``'s commands): a start's one round trip, not two.
# Rate limits (rpm/tpm > 0): the owner's requests and reserved tokens in this minute
# (fixed one-minute windows: the counters' keys name the minute), counted only for an
# admitted request; its reservation is corrected at its end (``SETTLE_TOKENS``).
# -> {answer, requests this minute, tokens this minute}; answer: 1 + the owner's
#    requests in flight before this one when admitted (0 without an owner), 0 full, -1
#    the owner's quota is full, -2 the model's, -3 requests per minute, -4 tokens
ADMIT = """
local function each_chunk(list, fn)
  for i = 1, #list, 1000 do
    fn(unpack(list, i, math.min(i + 999, #list)))
  end
end
local expired = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1])
if #expired > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[1])
  each_chunk(expired, function(...) redis.call('HDEL', KEYS[2], ...) end)
end
local members = redis.call('ZRANGE', KEYS[1], 0, -1)
local total, mine, theirs = 0, 0, 0
local owner, owner_limit = ARGV[6], tonumber(ARGV[7])
local model, model_limit = ARGV[8], tonumber(ARGV[9])
each_chunk(members, function(...)
  for _, v in ipairs(redis.call('HMGET', KEYS[2], ...)) do
    if v then
      local w, o, m = string.match(v, '^(%d+) ([^\\n]*)\\n?(.*)$')
      total = total + tonumber(w)
      if owner ~= '' and o == owner then mine = mine + 1 end
      if m == model then theirs = theirs + tonumber(w) end
    else
      total = total + 1
    end
  end
end)
local rpm, tpm, reserve = tonumber(ARGV[10]), tonumber(ARGV[11]), tonumber(ARGV[12])
local used_r = tonumber(redis.call('GET', KEYS[3]) or '0')
local used_t = tonumber(redis.call('GET', KEYS[4]) or '0')
if owner ~= '' and owner_limit > 0 and mine >= owner_limit then return {-1, used_r, used_t} end
if rpm > 0 and used_r + 1 > rpm then return {-3, used_r, used_t} end
if tpm > 0 and used_t + reserve > tpm then return {-4, used_r, used_t} end
local weight = tonumber(ARGV[5])
if model_limit > 0 and theirs > 0 and theirs + weight > model_limit then
  return {-2, used_r, used_t}
end
if total > 0 and total + weight > tonumber(ARGV[2]) then return {0, used_r, used_t} end
if rpm > 0 or tpm > 0 then
  used_r = redis.call('INCR', KEYS[3])
  redis.call('EXPIRE', KEYS[3], ARGV[13])
  used_t = redis.call('INCRBY', KEYS[4], reserve)
  redis.call('EXPIRE', KEYS[4], ARGV[13])
end
redis.call('ZADD', KEYS[1], ARGV[4], ARGV[3])
redis.call('HSET', KEYS[2], ARGV[3], ARGV[5] .. ' ' .. owner .. '\\n' .. model)
if KEYS[6] then
  redis.call('HSET', KEYS[5], 'body', ARGV[14], 'state', ARGV[15], 'attempt', 0, 'worker', '')
  redis.call('EXPIRE', KEYS[5], ARGV[16])
  redis.call('XADD', KEYS[6], 'MAXLEN', '~', 100000, '*', 'r', ARGV[3])
end
return {1 + mine, used_r, used_t}
"""

# A finished request's token reservation (``ADMIT``: prompt + max completion tokens)
# corrected to what it used, once (KEYS[2], a flag): the window's count goes down by
# the difference, if that minute's counter still exists.
# KEYS: [tokens counter, settled flag]; ARGV: [reserved - used, flag TTL s]
SETTLE_TOKENS = """
if redis.call('SET', KEYS[2], '1', 'NX', 'EX', ARGV[2]) and redis.call('EXISTS', KEYS[1]) == 1 then
  return redis.call('DECRBY', KEYS[1], ARGV[1])
end
return -1
"""
