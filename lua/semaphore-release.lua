-- semaphore-release: give back lease `member`, or take waiter `member` out of the line, then
-- grant the freed permits to the head of the line (floodgate_grant_heads).
-- Idempotent: a member that holds nothing (released twice, or reaped after its lease ran out)
-- frees nothing, so a late or foreign release never frees someone else's permit.
--
-- KEYS[1] holders  ZSET  member "<lease id>:<cost>" -> lease expiry (ms)
-- KEYS[2] queue    ZSET  member -> arrival sequence
-- KEYS[3] qexp     ZSET  member -> waiter expiry (ms)
-- KEYS[4] meta     HASH  used, seq, limit, epoch, quarantine, and u0, u1, … with classes
-- KEYS[5] procs    ZSET  token of each waiting process -> end of its last sign of life (ms)
--
-- ARGV[1] now      ms, or "" for the server's TIME (read only when someone is in line)
-- ARGV[2] member   "<id>:<cost>"
-- ARGV[3] limit    permits, or "" to read `limit` from meta
-- ARGV[4] channel  pub/sub channel grants are announced on
-- ARGV[5] what     "lease": `member` is a granted lease (never in line); "any": it may be either
-- ARGV[6] claimMs  longest a grant made here stays unclaimed, ms
-- ARGV[7] listeners "1": pass over waiters nobody listens for (see floodgate_grant_heads); ""
--                   on a cluster, where pub/sub counts are per node
-- ARGV[8] classes  the stage's traffic classes (floodgate_classes), or "" for none: the freed
--                  permits then go by classes.grant (floodgate_classes)
-- ARGV[9] member2  more releases of this turn, each a member and its "what" (ARGV[10]), and so
--                  on: each is done in turn, exactly as if each had called alone
--
-- Returns {released, dequeued, used, grants}: released = 1 when the lease was held and is now
-- freed, dequeued = 1 when the member was in line and is no longer, grants = the waiters granted
-- here, each as the message PUBLISHed on `channel`. With more than one member, returns one such
-- reply per member, in order. Run alone (not as a fused gate's step), a call that freed permits
-- says so on `channel`:freed (floodgate_freed).
local holders = KEYS[1]
local queue   = KEYS[2]
local qexp    = KEYS[3]
local meta    = KEYS[4]
local procs   = KEYS[5]
local channel = ARGV[4]
local classes = floodgate_classes(KEYS, ARGV[8])

-- Take what `member` held off its class's count, on a stage with classes.
local function lowerClass(member)
  local field = 'u' .. floodgate_class(member)
  if redis.call('HINCRBY', meta, field, -floodgate_cost(member)) < 0 then
    redis.call('HSET', meta, field, 0)
  end
end

-- Grant the head of the line what is free now. `used` is the count when known (else read).
-- Returns the grants made and the permits used after them.
local function grantFreed(used)
  if not redis.call('ZRANGE', queue, 0, 0)[1] then
    return {}, used or tonumber(redis.call('HGET', meta, 'used')) or 0
  end
  local state = redis.call('HMGET', meta, 'used', 'limit', 'epoch', 'quarantine')
  used = tonumber(state[1]) or 0
  local limit = tonumber(ARGV[3]) or tonumber(state[2]) or 0
  local now = floodgate_now(ARGV[1])
  if (tonumber(state[4]) or 0) > now then return {}, used end
  local grants
  if classes then
    classes.load(meta)
    grants, used = classes.grant(used, limit, now, tonumber(ARGV[6]),
      tonumber(state[3]) or 0, channel, ARGV[7] == '1', floodgate_token(ARGV[2]))
    if #grants > 0 then floodgate_set_used(meta, used, classes) end
    return grants, used
  end
  local head = floodgate_live_head(queue, qexp, procs, now)
  if not head or used >= limit then return {}, used end
  grants, used = floodgate_grant_heads(KEYS, head, used, limit, now, tonumber(ARGV[6]),
    tonumber(state[3]) or 0, channel, ARGV[7] == '1', floodgate_token(ARGV[2]))
  redis.call('HSET', meta, 'used', used)
  return grants, used
end

local function release(member, what)
  local used
  local released = redis.call('ZREM', holders, member)
  if released == 1 then
    used = floodgate_lower_used(meta, floodgate_cost(member))
    if classes then lowerClass(member) end
  end
  local dequeued = 0
  if what ~= 'lease' then
    dequeued = redis.call('ZREM', queue, member)
    if dequeued == 1 then redis.call('ZREM', qexp, member) end
  end
  local grants
  grants, used = grantFreed(used)
  if released == 1 or dequeued == 1 then floodgate_freed(channel, ARGV[7]) end
  return {released, dequeued, used, grants}
end

if #ARGV <= 8 then return release(ARGV[2], ARGV[5]) end

local leasesOnly = ARGV[5] == 'lease' and not classes
for i = 10, #ARGV, 2 do leasesOnly = leasesOnly and ARGV[i] == 'lease' end
if not leasesOnly then
  local replies = { release(ARGV[2], ARGV[5]) }
  for i = 9, #ARGV, 2 do replies[#replies + 1] = release(ARGV[i], ARGV[i + 1]) end
  return replies
end

-- Many leases given back: free them all with one write of `used`, then grant the head of the
-- line what is free now, as the last of them would have. Each reply says whether its lease was
-- held; the grants go with the last.
local replies = {}
local freed = 0
local function free(member)
  local released = redis.call('ZREM', holders, member)
  if released == 1 then freed = freed + floodgate_cost(member) end
  replies[#replies + 1] = {released, 0, 0, {}}
end
free(ARGV[2])
for i = 9, #ARGV, 2 do free(ARGV[i]) end
local used
if freed > 0 then
  used = floodgate_lower_used(meta, freed)
  floodgate_freed(channel, ARGV[7])
end
local last = replies[#replies]
last[4], used = grantFreed(used)
for i = 1, #replies do replies[i][3] = used end
return replies
