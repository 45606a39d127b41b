-- aimd-release: give back lease `id` of an AIMD limiter and move the fleet's limit with the
-- call's outcome (Netflix AIMD): a drop from a call admitted in the current epoch cuts the limit
-- to floor(limit * ratio) and starts a new epoch, so one burst of drops cuts once; a success
-- while at least half the limit is in use adds one. Clamped to [min, max]. A lease already gone
-- (released, or expired) teaches nothing.
--
-- KEYS[1] holders  ZSET  lease id -> lease expiry (ms)
-- KEYS[2] costs    HASH  lease or waiter id -> cost (permits)
-- KEYS[3] queue    ZSET  waiter id -> arrival sequence
-- KEYS[4] qexp     ZSET  waiter id -> waiter expiry (ms)
-- KEYS[5] meta     HASH  used, seq, limit, epoch
--
-- ARGV[1] now      ms, or "" for the server's TIME
-- ARGV[2] id       lease id
-- ARGV[3] channel  pub/sub channel to wake waiters on
-- ARGV[4] outcome  "success" | "dropped" | "ignored" | "refund"
-- ARGV[5] epoch    the epoch the call was admitted in
-- ARGV[6] min      lowest limit
-- ARGV[7] max      highest limit
-- ARGV[8] ratio    backoff ratio in [0.5, 1)
-- ARGV[9] slow     "1" when the call ran longer than slowCallMs (counts as a drop)
--
-- Returns {released, limit, epoch, used, woken}: woken = the waiter told (by PUBLISH on
-- `channel`) to ask again, or "".
local holders     = KEYS[1]
local costs       = KEYS[2]
local queue       = KEYS[3]
local qexp        = KEYS[4]
local meta        = KEYS[5]
local now         = floodgate_now(ARGV[1])
local id          = ARGV[2]
local channel     = ARGV[3]
local outcome     = ARGV[4]
local ticketEpoch = tonumber(ARGV[5])
local minLimit    = tonumber(ARGV[6])
local maxLimit    = tonumber(ARGV[7])
local ratio       = tonumber(ARGV[8])
local slow        = ARGV[9] == '1'

local state = redis.call('HMGET', meta, 'limit', 'epoch', 'used')
local limit = tonumber(state[1]) or maxLimit
local epoch = tonumber(state[2]) or 0
local used  = tonumber(state[3]) or 0

local dead = floodgate_expired(holders, now)
if #dead > 0 then
  local deadCosts = redis.call('HMGET', costs, unpack(dead))
  for i = 1, #deadCosts do used = used - (tonumber(deadCosts[i]) or 0) end
  redis.call('HDEL', costs, unpack(dead))
end

local cost = tonumber(redis.call('HGET', costs, id)) or 0
local released = redis.call('ZREM', holders, id)
redis.call('ZREM', queue, id)
redis.call('ZREM', qexp, id)
redis.call('HDEL', costs, id)

if released == 1 and (outcome == 'success' or outcome == 'dropped') then
  if outcome == 'dropped' or slow then
    if ticketEpoch == epoch then
      limit = math.max(minLimit, math.min(maxLimit, math.floor(limit * ratio)))
      epoch = epoch + 1
    end
  elseif used * 2 >= limit and limit < maxLimit then
    limit = limit + 1
  end
end
if released == 1 then used = used - cost end
if redis.call('ZCARD', holders) == 0 or used < 0 then used = 0 end
redis.call('HSET', meta, 'used', used, 'limit', limit, 'epoch', epoch)

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
return {released, limit, epoch, used, woken}
