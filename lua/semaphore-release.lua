-- semaphore-release: give back lease `member`, or take waiter `member` out of the line.
-- Idempotent: a member that holds nothing (released twice, or reaped after its lease ran out)
-- frees nothing, so a late or foreign release never frees someone else's permit.
--
-- KEYS[1] holders  ZSET  member "<lease id>:<cost>" -> lease expiry (ms)
-- KEYS[2] queue    ZSET  member -> arrival sequence
-- KEYS[3] qexp     ZSET  member -> waiter expiry (ms)
-- KEYS[4] meta     HASH  used, seq, limit, epoch
--
-- ARGV[1] now      ms, or "" for the server's TIME (unused: a release decides nothing by time)
-- ARGV[2] member   "<id>:<cost>"
-- ARGV[3] limit    permits, or "" to read `limit` from meta
-- ARGV[4] channel  pub/sub channel to wake waiters on
--
-- Returns {released, dequeued, used, woken}: released = 1 when the lease was held and is now
-- freed, dequeued = 1 when the member was in line and is no longer, woken = the waiter told (by
-- PUBLISH on `channel`) to ask again, or "".
local holders = KEYS[1]
local queue   = KEYS[2]
local qexp    = KEYS[3]
local meta    = KEYS[4]
local member  = ARGV[2]
local channel = ARGV[4]

local used
local released = redis.call('ZREM', holders, member)
if released == 1 then
  used = redis.call('HINCRBY', meta, 'used', -floodgate_cost(member))
  if used < 0 then
    used = 0
    redis.call('HSET', meta, 'used', 0)
  end
else
  used = tonumber(redis.call('HGET', meta, 'used')) or 0
end
local dequeued = redis.call('ZREM', queue, member)
if dequeued == 1 then redis.call('ZREM', qexp, member) end

local limit = tonumber(ARGV[3])
local woken = ''
local head = redis.call('ZRANGE', queue, 0, 0)[1]
if head then
  if ARGV[3] == '' then limit = tonumber(redis.call('HGET', meta, 'limit')) or 0 end
  if used + floodgate_cost(head) <= limit then
    redis.call('PUBLISH', channel, head)
    woken = head
  end
end
return {released, dequeued, used, woken}
