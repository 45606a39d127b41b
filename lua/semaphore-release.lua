-- semaphore-release: give back lease `id`, or take waiter `id` out of the queue. Idempotent: an
-- id that holds nothing (released twice, or reaped after its lease ran out) frees nothing, so a
-- late or foreign release never frees someone else's permit.
--
-- KEYS[1] holders  ZSET  lease id -> lease expiry (ms)
-- KEYS[2] costs    HASH  lease or waiter id -> cost (permits)
-- KEYS[3] queue    ZSET  waiter id -> arrival sequence
-- KEYS[4] qexp     ZSET  waiter id -> waiter expiry (ms)
-- KEYS[5] meta     HASH  used, seq, limit, epoch
--
-- ARGV[1] now      ms, or "" for the server's TIME
-- ARGV[2] id       lease / waiter id
-- ARGV[3] limit    permits, or "" to read `limit` from meta
-- ARGV[4] channel  pub/sub channel to wake waiters on
--
-- Returns {released, dequeued, used, woken}: released = 1 when the lease was held and is now
-- freed, dequeued = 1 when the id was waiting and is no longer, woken = the waiter told (by
-- PUBLISH on `channel`) to ask again, or "".
local holders = KEYS[1]
local costs   = KEYS[2]
local queue   = KEYS[3]
local qexp    = KEYS[4]
local meta    = KEYS[5]
local now     = floodgate_now(ARGV[1])
local id      = ARGV[2]
local channel = ARGV[4]

local limit = tonumber(ARGV[3])
if ARGV[3] == '' then limit = tonumber(redis.call('HGET', meta, 'limit')) or 0 end

local used = tonumber(redis.call('HGET', meta, 'used')) or 0
local dead = floodgate_expired(holders, now)
if #dead > 0 then
  local deadCosts = redis.call('HMGET', costs, unpack(dead))
  for i = 1, #deadCosts do used = used - (tonumber(deadCosts[i]) or 0) end
  redis.call('HDEL', costs, unpack(dead))
end

local cost = tonumber(redis.call('HGET', costs, id)) or 0
local released = redis.call('ZREM', holders, id)
local dequeued = redis.call('ZREM', queue, id)
redis.call('ZREM', qexp, id)
redis.call('HDEL', costs, id)
if released == 1 then used = used - cost end
if redis.call('ZCARD', holders) == 0 or used < 0 then used = 0 end
redis.call('HSET', meta, 'used', used)

-- Tell the waiter at the head to ask again when it fits now.
local woken = ''
local head = redis.call('ZRANGE', queue, 0, 0)[1]
if head then
  local c = tonumber(redis.call('HGET', costs, head)) or 1
  if used + c <= limit then
    redis.call('PUBLISH', channel, head)
    woken = head
  end
end
return {released, dequeued, used, woken}
