-- semaphore-acquire: take permits for lease `member`, or line `member` up in arrival order.
-- Used by semaphores, bounded queues and AIMD limiters (whose limit lives in `meta`).
--
-- KEYS[1] holders  ZSET  member "<lease id>:<cost>" -> lease expiry (ms)
-- KEYS[2] queue    ZSET  member "<waiter id>:<cost>" -> arrival sequence (FIFO order); with
--                       traffic classes, class i's waiters in band i (floodgate_band)
-- KEYS[3] qexp     ZSET  member -> waiter expiry (ms); a waiter not heard from is dropped
-- KEYS[4] meta     HASH  used (permits held), seq (arrivals and fencing tokens), limit, epoch,
--                       quarantine (ms: no grants before, after Redis lost its data), and
--                       with classes u0, u1, … (permits each class holds)
-- KEYS[5] procs    ZSET  token of each waiting process -> end of its last sign of life (ms)
--
-- ARGV[1]  now         ms, or "" for the server's TIME
-- ARGV[2]  member      "<id>:<cost>", the cost in permits (integer >= 1); "<id>~<class>:<cost>"
--                      on a stage with classes
-- ARGV[3]  limit       permits, or "" to read `limit` from meta (AIMD)
-- ARGV[4]  leaseMs     lease length, ms
-- ARGV[5]  mode        "wait": line up when refused; "try": never line up
-- ARGV[6]  waiterTtlMs how long a waiter in line stays without asking again, ms
-- ARGV[7]  channel     pub/sub channel grants are announced on
-- ARGV[8]  initial     AIMD: limit to start from when meta has none; "" otherwise
-- ARGV[9]  lastFence   the highest fencing token this process has seen, or 0
-- ARGV[10] again       "1" when `member` asked before (it may have been granted on a release)
-- ARGV[11] livenessMs  "wait" mode: how long this call counts as a sign of life of the caller's
--                      process (the token of `member`), ms
-- ARGV[12] listeners   "1": pass over waiters nobody listens for (see floodgate_grant_heads);
--                      "" on a cluster, where pub/sub counts are per node
-- ARGV[13] claimMs     longest a grant made here to another waiter stays unclaimed, ms
-- ARGV[14] classes     the stage's traffic classes (floodgate_classes), or "" for none; a
--                      leading "!" asks borrowed leases back for a waiting owed class
--                      ("reclaim|<member>" on its process's channel)
-- ARGV[15] member2     more callers of this turn, each a member and its "again" flag (ARGV[16]),
--                      and so on: each is decided in turn, exactly as if each had called alone
--
-- Returns {granted, fenceOrWaitMs, used, limit, epoch, grants, quarantineMs, now, elsewhere}:
--   granted = 1: fenceOrWaitMs is the fencing token (increases with every grant)
--   granted = 0: fenceOrWaitMs is ms until the nearest lease expires or the quarantine ends
--                (-1: neither)
--   granted = -1: `member` asked again but is neither in line nor holding a grant that is still
--                good (its grant ended unclaimed, or it was dropped from the line while its
--                process was silent); it is not lined up again: the caller asks under a new
--                member, so a member is granted at most once
--   now: the time the call decided at (server ms), by which the caller judges grant messages
--   grants: the waiters this call granted at the head of the line (see floodgate_grant_heads),
--           each as the message PUBLISHed on `channel`; `member` itself may be among them; 0
--           for none when granted at once (a table costs the reply more than a number)
--   quarantineMs: > 0 while grants are held back because Redis lost this stage's data
--   elsewhere: on a stage with classes only: the classes another process stored (meta field
--              `cls`) when they differ from this caller's ARGV[14], else ""; this caller's are
--              stored in their place
-- With more than one member, returns one such reply per member, in order.
--
-- Data loss (a restart without persistence, FLUSHALL, a failover to a stale replica) shows as a
-- fencing sequence below one a process has already seen. Leases held then are forgotten while
-- their calls still run, so nothing is granted for one lease length (a quarantine), after which
-- every such lease has ended; the sequence is restored so fencing tokens keep increasing.
--
-- Expired leases are reaped only when they stand in the way (no room, or someone in line), so
-- an uncontended grant is four commands (HMGET, ZRANGE, ZADD, HSET), and TIME.
--
-- With traffic classes (floodgate_classes), a call goes at once only when nobody of its class is
-- ahead of it and the class rule picks its class (classes.goes); room made by reaping goes to
-- the line first; grants on the way choose the class the same way (classes.grant). Classes only
-- choose who gets a permit: the limit bounds them all together, as without.
local holders     = KEYS[1]
local queue       = KEYS[2]
local qexp        = KEYS[3]
local meta        = KEYS[4]
local now         = floodgate_now(ARGV[1])
local leaseMs     = tonumber(ARGV[4])           -- ms
local mode        = ARGV[5]                     -- "wait" | "try"
local waiterTtlMs = tonumber(ARGV[6])           -- ms
local channel     = ARGV[7]
local lastFence   = tonumber(ARGV[9]) or 0
local procs       = KEYS[5]
local claimMs     = tonumber(ARGV[13])          -- ms
local listeners   = ARGV[12] == '1'
local classes     = floodgate_classes(KEYS, ARGV[14])

-- A caller that lines up is a sign of life of its process: its waiters stay in line, and grants
-- are made to them, only while it keeps giving one. Given once per call, and only by one that
-- waits: a grant at once needs none.
local signed = false

-- Grant the waiters what is free (floodgate_grant_heads from `head`, the first in line, or
-- classes.grant; `head` nil when not known, read then), for a call of `member`. Returns the grants and the permits now used;
-- the caller writes them (floodgate_set_used) when there are any.
local function serve(head, used, limit, epoch, member)
  if classes then
    if not head and not redis.call('ZRANGE', queue, 0, 0)[1] then return {}, used end
    return classes.grant(used, limit, now, claimMs, epoch, channel, listeners, floodgate_token(member))
  elseif head and used < limit then
    return floodgate_grant_heads(KEYS, head, used, limit, now, claimMs, epoch, channel, listeners, floodgate_token(member))
  end
  return {}, used
end

-- Classes another process stored in meta that differ from this caller's ("" when none): the
-- ninth field of every reply on a stage with classes.
local elsewhere = nil

local function decide(member, again)
  local cost = floodgate_cost(member)      -- permits
  local k = classes and floodgate_class(member) + 1 or 1    -- its class (1-based)
  local state = redis.call('HMGET', meta, 'used', 'limit', 'epoch', 'seq', 'quarantine')
  if classes then
    classes.load(meta)
    if not elsewhere then elsewhere = classes.agree(meta) end
  end
  local used  = tonumber(state[1]) or 0
  local limit = tonumber(ARGV[3])
  local epoch = 0
  if ARGV[3] == '' then
    limit = tonumber(state[2])
    epoch = tonumber(state[3]) or 0
    if limit == nil then
      limit = tonumber(ARGV[8])
      redis.call('HSET', meta, 'limit', limit, 'epoch', 0)
    end
  end

  -- Quarantine after data loss: no grants until every lease of before could have ended.
  local quarantine = tonumber(state[5]) or 0
  if lastFence > (tonumber(state[4]) or 0) then
    quarantine = now + leaseMs
    redis.call('HSET', meta, 'seq', lastFence, 'quarantine', quarantine)
  end
  if quarantine > now then
    -- A member that asks again may hold a grant already (made on a release before the quarantine
    -- began, its process not told yet): it is not lined up again, or once the quarantine is over
    -- it would be granted, and counted in `used` and its class, a second time.
    if mode == 'wait' and not redis.call('ZSCORE', holders, member) then
      if not redis.call('ZSCORE', queue, member) then
        redis.call('ZADD', queue, (k - 1) * floodgate_band + redis.call('HINCRBY', meta, 'seq', 1), member)
      end
      redis.call('ZADD', qexp, now + waiterTtlMs, member)
    end
    if mode == 'wait' and not signed then
      signed = floodgate_sign_of_life(procs, member, now, tonumber(ARGV[11]))
    end
    return {0, quarantine - now, used, limit, epoch, {}, quarantine - now, now}
  end

  -- Granted on someone's release while this call was on its way (or its message was lost): claim
  -- the permit with a full lease and a fencing token of its own. A grant left unclaimed past its
  -- end is taken back; a member neither holding nor in line is gone (see the reply).
  local head
  if again == '1' then
    local held = redis.call('ZSCORE', holders, member)
    local gone = false
    if held then
      if tonumber(held) > now then
        redis.call('ZADD', holders, now + leaseMs, member)
        return {1, redis.call('HINCRBY', meta, 'seq', 1), used, limit, epoch, {}, 0, now}
      end
      redis.call('ZREM', holders, member)
      used = math.max(0, used - cost)
      if classes then classes.free(member) end
      floodgate_set_used(meta, used, classes)
      gone = true
    elseif not redis.call('ZSCORE', queue, member) then
      gone = true
    end
    if gone then
      redis.call('ZREM', qexp, member)
      -- What the lapsed grant held goes to the head of the line.
      if not classes then head = floodgate_live_head(queue, qexp, procs, now) end
      local grants
      grants, used = serve(head, used, limit, epoch, member)
      if #grants > 0 then floodgate_set_used(meta, used, classes) end
      return {-1, -1, used, limit, epoch, grants, 0, now}
    end
  end

  head = redis.call('ZRANGE', queue, 0, 0)[1]
  local goes
  if classes then
    goes = classes.goes(k, member, cost, used, limit, head ~= nil)
  else
    goes = used + cost <= limit and (not head or head == member)
  end
  local grants = {}
  if not goes then
    -- Something stands in the way: first take back the leases of dead holders, drop waiters
    -- that stopped asking and those whose process stopped giving a sign of life.
    local dead = floodgate_expired(holders, now)
    -- (A count with no lease left behind it, however it came to be, would keep its permits from
    -- everyone for good: nothing held, nothing counted.)
    local counted = used ~= 0
    if classes then
      for i = 1, classes.n do
        if classes.used[i] ~= 0 then counted = true end
      end
    end
    if #dead > 0 or (counted and redis.call('ZCARD', holders) == 0) then
      for i = 1, #dead do
        used = used - floodgate_cost(dead[i])
        if classes then classes.free(dead[i]) else floodgate_unclass(meta, dead[i]) end
      end
      if used < 0 or redis.call('ZCARD', holders) == 0 then
        used = 0
        if classes then
          for i = 1, classes.n do classes.used[i] = 0 end
        else
          floodgate_unclass_all(meta)
        end
      end
      floodgate_set_used(meta, used, classes)
    end
    local gone = floodgate_expired(qexp, now)
    if #gone > 0 then redis.call('ZREM', queue, unpack(gone)) end
    -- Signs of life that ended ten minutes ago are of processes long gone.
    redis.call('ZREMRANGEBYSCORE', procs, '-inf', '(' .. floodgate_num(now - 600000))
    if classes then
      -- What reaping freed goes to the line first; then this call is looked at again.
      grants, used = serve(nil, used, limit, epoch, member)
      if #grants > 0 then floodgate_set_used(meta, used, classes) end
      -- A member asking again may have been granted just now, as the head of its class's line
      -- (in holders, counted): it goes, on that permit. Looked at again as a new arrival, it
      -- would be lined up again while it holds it, and granted (and counted) a second time.
      if #grants > 0 and redis.call('ZSCORE', holders, member) then
        goes = true
      else
        goes = classes.goes(k, member, cost, used, limit, redis.call('ZRANGE', queue, 0, 0)[1] ~= nil)
      end
    else
      if head and head ~= member then head = floodgate_live_head(queue, qexp, procs, now) end
      goes = used + cost <= limit and (not head or head == member)
    end
  end

  if goes then
    if redis.call('ZADD', holders, now + leaseMs, member) == 1 then
      used = used + cost
      if classes then classes.used[k] = classes.used[k] + cost end
    end
    if head then
      redis.call('ZREM', queue, member)
      redis.call('ZREM', qexp, member)
      head = redis.call('ZRANGE', queue, 0, 0)[1]
    end
    -- (Grants made on the way moved the fencing sequence: this one is then read from Redis too.)
    if head or #grants > 0 then
      local fence = redis.call('HINCRBY', meta, 'seq', 1)
      local more
      more, used = serve(head, used, limit, epoch, member)
      for i = 1, #more do grants[#grants + 1] = more[i] end
      floodgate_set_used(meta, used, classes)
      return {1, fence, used, limit, epoch, grants, 0, now}
    end
    -- Nobody else in line: the count and the fencing sequence go in one write.
    local fence = (tonumber(state[4]) or 0) + 1
    floodgate_set_used(meta, used, classes, fence)
    return {1, fence, used, limit, epoch, #grants > 0 and grants or 0, 0, now}
  end

  if mode == 'wait' then
    if not redis.call('ZSCORE', queue, member) then
      redis.call('ZADD', queue, (k - 1) * floodgate_band + redis.call('HINCRBY', meta, 'seq', 1), member)
    end
    redis.call('ZADD', qexp, now + waiterTtlMs, member)
    if not signed then signed = floodgate_sign_of_life(procs, member, now, tonumber(ARGV[11])) end
    -- Room made by reaping (or a raised limit) goes to the head of the line.
    local more
    more, used = serve(head or member, used, limit, epoch, member)
    if #more > 0 then floodgate_set_used(meta, used, classes) end
    for i = 1, #more do grants[#grants + 1] = more[i] end
    -- Classes below their guarantee still waiting ask borrowed leases back (reclaim "signal").
    if classes and classes.reclaims then classes.reclaim(meta, used, limit, channel) end
  end
  local first = redis.call('ZRANGE', holders, 0, 0, 'WITHSCORES')
  local waitMs = -1
  if first[2] then waitMs = math.max(0, tonumber(first[2]) - now) end
  return {0, waitMs, used, limit, epoch, grants, 0, now}
end

local function acquire(member, again)
  local reply = decide(member, again)
  if classes then reply[9] = elsewhere end
  return reply
end

if #ARGV <= 14 then return acquire(ARGV[2], ARGV[10]) end

-- Many callers. While nobody is in line, no quarantine holds and they fit, the first ones are
-- granted with one read and one write of meta (what one call each would have done); the first
-- that does not fit, or asks again, and every one after it, go the general way, as does every
-- one on a stage with classes.
local members = { ARGV[2] }
local agains = { ARGV[10] }
for i = 15, #ARGV, 2 do
  members[#members + 1] = ARGV[i]
  agains[#agains + 1] = ARGV[i + 1]
end
local replies = {}
local open = not classes and floodgate_open(meta, ARGV[3], now)
local next = 1
if open and lastFence <= open.seq and not redis.call('ZRANGE', queue, 0, 0)[1] then
  local used, limit, seq, epoch = open.used, open.limit, open.seq, open.epoch
  -- (The leases' expiry as text, once: Redis would write the number out for each.)
  local expiry = floodgate_num(now + leaseMs)
  while next <= #members and agains[next] ~= '1' do
    local member = members[next]
    local cost = floodgate_cost(member)
    if used + cost > limit then break end
    if redis.call('ZADD', holders, expiry, member) == 1 then used = used + cost end
    seq = seq + 1
    replies[next] = {1, seq, used, limit, epoch, 0, 0, now}
    next = next + 1
  end
  if next > 1 then redis.call('HSET', meta, 'used', used, 'seq', seq) end
end
for i = next, #members do replies[i] = acquire(members[i], agains[i]) end
return replies
