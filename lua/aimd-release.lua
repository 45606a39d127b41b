-- aimd-release: give back lease `member` of an AIMD limiter and move the fleet's limit with the
-- call's outcome (Netflix AIMD): a drop from a call admitted in the current epoch cuts the limit
-- to floor(limit * ratio) and starts a new epoch, so one burst of drops cuts once; a success
-- while at least half the limit is in use adds one. Clamped to [min, max]. A lease already gone
-- (released, or reaped after it expired) teaches nothing.
--
-- KEYS[1] holders  ZSET  member "<lease id>:<cost>" -> lease expiry (ms)
-- KEYS[2] queue    ZSET  member -> arrival sequence
-- KEYS[3] qexp     ZSET  member -> waiter expiry (ms)
-- KEYS[4] meta     HASH  used, seq, limit, epoch, and u0, u1, … with classes
-- KEYS[5] procs    ZSET  token of each waiting process -> end of its last sign of life (ms)
--
-- ARGV[1] now      ms, or "" for the server's TIME (read only when someone is in line)
-- ARGV[2] member   "<id>:<cost>"
-- ARGV[3] channel  pub/sub channel to wake waiters on
-- ARGV[4] outcome  "success" | "dropped" | "ignored" | "refund"
-- ARGV[5] epoch    the epoch the call was admitted in
-- ARGV[6] min      lowest limit
-- ARGV[7] max      highest limit
-- ARGV[8] ratio    backoff ratio in [0.5, 1)
-- ARGV[9] slow     "1" when the call ran longer than slowCallMs (counts as a drop)
-- ARGV[10] claimMs longest a grant made here stays unclaimed, ms
-- ARGV[11] listeners "1": pass over waiters nobody listens for (see floodgate_grant_heads); ""
--                   on a cluster, where pub/sub counts are per node
-- ARGV[12] initial  the limit to start from when meta has none (as semaphore-acquire starts)
-- ARGV[13] classes  the stage's traffic classes (floodgate_classes), or "" for none: their
--                   shares are of the limit as moved here, and the freed permits go by
--                   classes.grant (floodgate_classes)
-- ARGV[14] member2  without classes: more releases of this turn, each a member, its outcome
--                   (ARGV[15]), its epoch (ARGV[16]) and its slow flag (ARGV[17]), and so on:
--                   each is done in turn, exactly as if each had called alone (while nobody
--                   waits in the line, with one read and one write of meta)
--
-- Returns {released, limit, epoch, used, grants}: grants = the waiters granted the freed permits
-- (floodgate_grant_heads), each as the message PUBLISHed on `channel`. With more than one
-- member, returns one such reply per member, in order. Run alone (not as a fused gate's step), a
-- call that freed permits says so on `channel`:freed (floodgate_freed).
local holders     = KEYS[1]
local queue       = KEYS[2]
local qexp        = KEYS[3]
local meta        = KEYS[4]
local procs       = KEYS[5]
local member      = ARGV[2]
local channel     = ARGV[3]
local outcome     = ARGV[4]
local ticketEpoch = tonumber(ARGV[5])
local minLimit    = tonumber(ARGV[6])
local maxLimit    = tonumber(ARGV[7])
local ratio       = tonumber(ARGV[8])
local slow        = ARGV[9] == '1'
local classes     = floodgate_classes(KEYS, ARGV[13])

local state = redis.call('HMGET', meta, 'limit', 'epoch', 'used', 'quarantine')
local limit = tonumber(state[1]) or tonumber(ARGV[12]) or maxLimit
local epoch = tonumber(state[2]) or 0
local used  = tonumber(state[3]) or 0

-- One release on the state in hand (limit, epoch, used), as alone but for writing meta and
-- granting; returns whether its lease was held. `lineEmpty`: nobody waits, so `member` is not in
-- the line.
local function release(member, outcome, ticketEpoch, slow, lineEmpty)
  local released = redis.call('ZREM', holders, member)
  if not lineEmpty and redis.call('ZREM', queue, member) == 1 then redis.call('ZREM', qexp, member) end

  if released == 1 then
    limit, epoch = floodgate_aimd_moved(limit, epoch, used, outcome, ticketEpoch, slow, minLimit, maxLimit, ratio)
    used = used - floodgate_cost(member)
  end
  if used < 0 then used = 0 end
  return released
end

-- The permits free now to the head of the line, for a release of `member`; returns the grants.
local function grantFreed(member)
  local grants = {}
  if redis.call('ZRANGE', queue, 0, 0)[1] then
    local now = floodgate_now(ARGV[1])
    if (tonumber(state[4]) or 0) <= now then
      if classes then
        grants, used = classes.grant(used, limit, now, tonumber(ARGV[10]), epoch,
          channel, ARGV[11] == '1', floodgate_token(member))
        if #grants > 0 then floodgate_set_used(meta, used, classes) end
      else
        local head = floodgate_live_head(queue, qexp, procs, now)
        if head and used < limit then
          grants, used = floodgate_grant_heads(KEYS, head, used, limit, now, tonumber(ARGV[10]), epoch,
            channel, ARGV[11] == '1', floodgate_token(member))
          redis.call('HSET', meta, 'used', used)
        end
      end
    end
  end
  return grants
end

-- One release exactly as if alone: its lease, meta written, the freed permits granted.
local function alone(member, outcome, ticketEpoch, slow)
  local released = release(member, outcome, ticketEpoch, slow, false)
  redis.call('HSET', meta, 'used', used, 'limit', limit, 'epoch', epoch)
  if classes then
    classes.load(meta)
    if released == 1 then
      classes.free(member)
      floodgate_set_used(meta, used, classes)
    end
  end
  -- (`used` as before the grants, as the reply has always said.)
  local reply = {released, limit, epoch, used, grantFreed(member)}
  if released == 1 then floodgate_freed(channel, ARGV[11]) end
  return reply
end

if #ARGV <= 13 then return alone(member, outcome, ticketEpoch, slow) end
if classes then return redis.error_reply('aimd-release: a turn of leases on a stage with classes') end

-- A turn of leases. While nobody waits in the line, nothing is granted between them: each is
-- given back on the state in hand, and meta is written once. Otherwise each goes as alone, in
-- turn, its freed permits granted before the next.
local turn = { {member, outcome, ticketEpoch, slow} }
for i = 14, #ARGV, 4 do turn[#turn + 1] = {ARGV[i], ARGV[i + 1], tonumber(ARGV[i + 2]), ARGV[i + 3] == '1'} end
local replies = {}
if redis.call('ZRANGE', queue, 0, 0)[1] then
  for i, t in ipairs(turn) do replies[i] = alone(t[1], t[2], t[3], t[4]) end
  return replies
end
local freed = false
for i, t in ipairs(turn) do
  replies[i] = {release(t[1], t[2], t[3], t[4], true), limit, epoch, used, {}}
  freed = freed or replies[i][1] == 1
end
redis.call('HSET', meta, 'used', used, 'limit', limit, 'epoch', epoch)
if freed then floodgate_freed(channel, ARGV[11]) end
return replies
