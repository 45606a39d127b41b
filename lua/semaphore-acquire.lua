-- semaphore-acquire: take `cost` permits for lease `id`, or queue `id` in FIFO order.
-- Used by semaphores, bounded queues and AIMD limiters (whose limit lives in `meta`).
--
-- KEYS[1] holders  ZSET  lease id -> lease expiry (ms)
-- KEYS[2] costs    HASH  lease or waiter id -> cost (permits)
-- KEYS[3] queue    ZSET  waiter id -> arrival sequence (FIFO order)
-- KEYS[4] qexp     ZSET  waiter id -> waiter expiry (ms); a waiter not heard from is dropped
-- KEYS[5] meta     HASH  used (permits held), seq (arrivals and fencing tokens), limit, epoch
--
-- ARGV[1] now         ms, or "" for the server's TIME
-- ARGV[2] id          lease id (also the waiter id while waiting)
-- ARGV[3] cost        permits, integer >= 1
-- ARGV[4] limit       permits, or "" to read `limit` from meta (AIMD)
-- ARGV[5] leaseMs     lease length, ms
-- ARGV[6] mode        "wait": queue when refused; "try": never queue
-- ARGV[7] waiterTtlMs how long a queued waiter stays without retrying, ms
-- ARGV[8] channel     pub/sub channel to wake waiters on
-- ARGV[9] initial     AIMD: limit to start from when meta has none; "" otherwise
--
-- Returns {granted, fenceOrWaitMs, used, limit, epoch, woken}:
--   granted = 1: fenceOrWaitMs is the fencing token (increases with every grant)
--   granted = 0: fenceOrWaitMs is ms until the nearest lease expires (-1: none held)
--   woken: the waiter told (by PUBLISH on `channel`) to ask again, or ""
local holders     = KEYS[1]
local costs       = KEYS[2]
local queue       = KEYS[3]
local qexp        = KEYS[4]
local meta        = KEYS[5]
local now         = floodgate_now(ARGV[1])
local id          = ARGV[2]                 -- lease / waiter id
local cost        = tonumber(ARGV[3])       -- permits
local leaseMs     = tonumber(ARGV[5])       -- ms
local mode        = ARGV[6]                 -- "wait" | "try"
local waiterTtlMs = tonumber(ARGV[7])       -- ms
local channel     = ARGV[8]

-- The limit: given, or the adaptive one kept in meta.
local limit = tonumber(ARGV[4])
local epoch = 0
if ARGV[4] == '' then
  local state = redis.call('HMGET', meta, 'limit', 'epoch')
  limit = tonumber(state[1])
  epoch = tonumber(state[2]) or 0
  if limit == nil then
    limit = tonumber(ARGV[9])
    redis.call('HSET', meta, 'limit', limit, 'epoch', 0)
  end
end

-- Reap leases of dead holders, then waiters that stopped asking.
local used = tonumber(redis.call('HGET', meta, 'used')) or 0
local dead = floodgate_expired(holders, now)
if #dead > 0 then
  local deadCosts = redis.call('HMGET', costs, unpack(dead))
  for i = 1, #deadCosts do used = used - (tonumber(deadCosts[i]) or 0) end
  redis.call('HDEL', costs, unpack(dead))
end
local gone = floodgate_expired(qexp, now)
if #gone > 0 then
  redis.call('ZREM', queue, unpack(gone))
  redis.call('HDEL', costs, unpack(gone))
end
if redis.call('ZCARD', holders) == 0 then used = 0 end
if used < 0 then used = 0 end

-- Tell the waiter at the head to ask again when it fits now; returns its id, or "".
local function wakeHead()
  local head = redis.call('ZRANGE', queue, 0, 0)[1]
  if head then
    local c = tonumber(redis.call('HGET', costs, head)) or 1
    if used + c <= limit then
      redis.call('PUBLISH', channel, head)
      return head
    end
  end
  return ''
end

local function nearestExpiry()
  local first = redis.call('ZRANGE', holders, 0, 0, 'WITHSCORES')
  if first[2] then return math.max(0, tonumber(first[2]) - now) end
  return -1
end

-- Already holding (a retried call): report the grant again.
if redis.call('ZSCORE', holders, id) then
  redis.call('HSET', meta, 'used', used)
  return {1, tonumber(redis.call('HGET', meta, 'seq')) or 0, used, limit, epoch, ''}
end

local head = redis.call('ZRANGE', queue, 0, 0)[1]
if used + cost <= limit and (head == false or head == nil or head == id) then
  redis.call('ZADD', holders, now + leaseMs, id)
  redis.call('HSET', costs, id, cost)
  redis.call('ZREM', queue, id)
  redis.call('ZREM', qexp, id)
  used = used + cost
  redis.call('HSET', meta, 'used', used)
  local fence = redis.call('HINCRBY', meta, 'seq', 1)
  return {1, fence, used, limit, epoch, wakeHead()}
end

redis.call('HSET', meta, 'used', used)
local woken = ''
if mode == 'wait' then
  if not redis.call('ZSCORE', queue, id) then
    redis.call('ZADD', queue, redis.call('HINCRBY', meta, 'seq', 1), id)
    redis.call('HSET', costs, id, cost)
  end
  redis.call('ZADD', qexp, now + waiterTtlMs, id)
  woken = wakeHead()
end
return {0, nearestExpiry(), used, limit, epoch, woken}
