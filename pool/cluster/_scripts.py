"""The Lua scripts of the lease ledger and the budget counters. Redis runs each one
atomically, so no other client's command lands between a script's check and its write.

They name keys outside ``KEYS`` (a lease's own key, from its id, to see whether it is
still alive): fine on one Redis or Valkey, not on Redis Cluster.
"""

from __future__ import annotations

# Take (or resize, or re-assert) one lease over one or more GPUs, all or nothing.
#
# KEYS[1]  the lease's key
# KEYS[2]  the host's budgets hash (GPU index -> MiB)
# KEYS[2+i] GPU i's index of leases (lease id -> MiB), i = 1..n, in GPU index order
# ARGV[1]  the prefix of lease keys        ARGV[2] the lease id
# ARGV[3]  holder   ARGV[4] purpose   ARGV[5] host   ARGV[6] ttl ms
# ARGV[7]  '1': take it whatever the budgets say (re-asserting memory already held)
# ARGV[8]  the events channel
# ARGV[8+4(i-1)+1 ..] per GPU: index, MiB, budget MiB (-1: the stored one, or none),
#          free MiB as the caller's NVML reading says (-1: unknown)
#
# Returns {1, acquired-at ms} when taken; {0, GPU index, reason, leased MiB, limit MiB}
# when a GPU has no room (reason 'budget': live leases + MiB > budget; 'free': MiB >
# what NVML reads free).
ACQUIRE = """
local lease_key, budgets = KEYS[1], KEYS[2]
local lease_prefix, id = ARGV[1], ARGV[2]
local ttl, force, channel = tonumber(ARGV[6]), ARGV[7] == '1', ARGV[8]
local n = #KEYS - 2
local gpus = {}
for i = 1, n do
  local base = 8 + (i - 1) * 4
  local index, mib = ARGV[base + 1], tonumber(ARGV[base + 2])
  local budget, free = tonumber(ARGV[base + 3]), tonumber(ARGV[base + 4])
  if budget < 0 then
    budget = tonumber(redis.call('HGET', budgets, index) or '-1')
  end
  local leased = 0
  local entries = redis.call('HGETALL', KEYS[2 + i])
  for j = 1, #entries, 2 do
    local other = entries[j]
    if redis.call('EXISTS', lease_prefix .. other) == 0 then
      redis.call('HDEL', KEYS[2 + i], other)
    elseif other ~= id then
      leased = leased + tonumber(entries[j + 1])
    end
  end
  if not force then
    if budget >= 0 and leased + mib > budget then
      return {0, tonumber(index), 'budget', leased, budget}
    end
    if free >= 0 and mib > free then
      return {0, tonumber(index), 'free', leased, free}
    end
  end
  gpus[#gpus + 1] = {tonumber(index), mib}
end
local now = redis.call('TIME')
local now_ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
redis.call('DEL', lease_key)
redis.call('HSET', lease_key, 'id', id, 'holder', ARGV[3], 'purpose', ARGV[4],
  'host', ARGV[5], 'gpus', cjson.encode(gpus), 'acquired_ms', now_ms)
redis.call('PEXPIRE', lease_key, ttl)
for i = 1, n do
  redis.call('HSET', KEYS[2 + i], id, gpus[i][2])
end
redis.call('PUBLISH', channel, cjson.encode({kind = 'lease', op = 'acquire', id = id,
  host = ARGV[5], gpus = gpus}))
return {1, now_ms}
"""

# Drop a lease and its GPU index entries, and say so on the events channel.
#
# KEYS[1] the lease's key; KEYS[2..] the index of each GPU it names
# ARGV[1] the lease id; ARGV[2] the events channel; ARGV[3] its host
# Returns 1 when the lease was still there, 0 when it had expired or gone.
RELEASE = """
local existed = redis.call('DEL', KEYS[1])
for i = 2, #KEYS do
  redis.call('HDEL', KEYS[i], ARGV[1])
end
redis.call('PUBLISH', ARGV[2], cjson.encode({kind = 'lease', op = 'release', id = ARGV[1],
  host = ARGV[3]}))
return existed
"""

# The live leases on some GPUs: a flat list of GPU index, lease id, MiB, holder.
#
# KEYS[i] GPU i's index of leases; ARGV[1] the prefix of lease keys; ARGV[1+i] GPU i's
# index. Read only: expired entries are skipped here and dropped by the next acquire.
USAGE = """
local out = {}
for i = 1, #KEYS do
  local entries = redis.call('HGETALL', KEYS[i])
  for j = 1, #entries, 2 do
    local holder = redis.call('HGET', ARGV[1] .. entries[j], 'holder')
    if holder then
      out[#out + 1] = ARGV[1 + i]
      out[#out + 1] = entries[j]
      out[#out + 1] = entries[j + 1]
      out[#out + 1] = holder
    end
  end
end
return out
"""


# Add one numbered piece of a pool's budget spending to a window's counter, once: a piece
# whose reply was lost (Redis stopped, the reply timed out, the command ran later) is
# sent again under the same number, and this adds nothing the second time.
#
# KEYS[1] the window's counter (INCRBY)   KEYS[2] its hash of the last number applied
# per sender (sender -> number)
# ARGV[1] the sender (node id and boot)   ARGV[2] the piece's number (rising per sender)
# ARGV[3] tokens   ARGV[4] when both keys expire (seconds since the epoch)
#
# Returns the counter's value after it.
ADD_ONCE = """
local last = tonumber(redis.call('HGET', KEYS[2], ARGV[1]) or '0')
if tonumber(ARGV[2]) > last then
  redis.call('INCRBY', KEYS[1], ARGV[3])
  redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
end
redis.call('EXPIREAT', KEYS[1], ARGV[4])
redis.call('EXPIREAT', KEYS[2], ARGV[4])
return redis.call('GET', KEYS[1]) or '0'
"""
