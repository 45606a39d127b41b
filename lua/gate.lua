-- gate: a whole Gate's admission, or release, in one call. Each step is one of the stage scripts
-- (step_<script>, its body run as a function of its own KEYS and ARGV, exactly as alone), and
-- every step decides at the same instant: the call's `now`.
--
-- KEYS[1] line  ZSET  member "<token>-<n>" -> arrival sequence: the gate's callers a permit stage
--                     refused, in arrival order across the fleet
-- KEYS[2] lexp  ZSET  member -> expiry (ms): a waiter not heard from for waiterTtlMs is dropped
-- KEYS[3] gmeta HASH  seq (arrivals, shared by both lines)
-- KEYS[4] lane  ZSET  member -> arrival sequence: the callers of the call's lane (its key and
--                     host) that only token buckets or interval gates refused
-- KEYS[5] laneExp ZSET member -> expiry (ms), as lexp
-- KEYS[6…]            the steps' own keys, in step order
--
-- ARGV[1] now          ms, or "" for the server's TIME
-- ARGV[2] op           "all": an admission, all or nothing; "each": releases, refunds and
--                      settles, each step run as it would alone; "leave": `member` leaves the lines
-- ARGV[3] member       the caller's place in line, "" for none (a release)
-- ARGV[4] mode         "wait": a refused caller keeps (or takes) its place in line; "try": never
-- ARGV[5] waiterTtlMs  how long a waiter stays in line without asking again, ms
-- ARGV[6] channel      base of the wake channels: a member is told "<member>" on channel:<token>
-- ARGV[7] steps        the number of steps; then, per step, its script name, its number of keys,
--                      its number of arguments and the arguments (the first, its `now`, is
--                      replaced by this call's)
--
-- Returns {status, waitMs, inLine, woken, replies}:
--   status  1: every step admitted (or, for "each", ran); 0: refused, nothing is held anywhere
--   waitMs  when token buckets or interval gates alone refused a caller first in its lane: the
--           longest of their waits (ms until each could admit); else -1 (wait to be woken)
--   inLine  1 when `member` waits in the permit line, 2 in its lane, 0 in neither
--   woken   the members told to ask again (their process may be this one)
--   replies each step's reply, as its script would answer; a step rolled back answers as refused
--           but with -2 for its first field (a refusal of its own is 0); a step not run (someone
--           is ahead in line) answers false
--
-- All or nothing: the permit steps run first, then the metering steps, each to the end whatever
-- the others said (their replies say how long each would wait); if any refused, those that
-- admitted are rolled back in reverse, so nothing is held anywhere. A permit step rolls back
-- through its release; a token bucket or interval gate step is restored as it was (DUMP before,
-- RESTORE after), so a refused admission leaves their keys exactly as they were.
--
-- The lines, in which a refused caller waits holding nothing, in arrival order across the fleet:
-- one for the gate's permits, and one per lane for its rates. While anyone waits for permits, a
-- caller that is not first in that line waits behind (permits are the gate's, whatever the
-- lane); otherwise, while anyone waits in its lane, behind them. Callers of other lanes are not
-- held up by a lane waiting for its tokens or its host's spacing. The first in the permit line is
-- told to ask again whenever permits are freed through the gate (or the one before it is
-- admitted with room left, or leaves); the first in a lane, when the one before it leaves it,
-- and otherwise asks again itself when its wait is over.
local PERMIT = { ['semaphore-acquire'] = true }
local STEPS = {
  ['semaphore-acquire'] = step_semaphore_acquire,
  ['semaphore-release'] = step_semaphore_release,
  ['aimd-release'] = step_aimd_release,
  ['token-bucket-take'] = step_token_bucket_take,
  ['token-bucket-refund'] = step_token_bucket_refund,
  ['token-bucket-settle'] = step_token_bucket_settle,
  ['interval-gate-take'] = step_interval_gate_take,
  ['interval-gate-refund'] = step_interval_gate_refund,
}
local line    = KEYS[1]
local lexp    = KEYS[2]
local gmeta   = KEYS[3]
local lane    = KEYS[4]
local laneExp = KEYS[5]
local now     = floodgate_now(ARGV[1])
local op      = ARGV[2]
local member  = ARGV[3]
local mode    = ARGV[4]
local ttl     = tonumber(ARGV[5])
local channel = ARGV[6]
local nowArg  = floodgate_num(now)

-- The steps, each {name, keys, args}.
local steps = {}
local k = 6
local a = 8
for i = 1, tonumber(ARGV[7]) do
  local name = ARGV[a]
  local nk = tonumber(ARGV[a + 1])
  local na = tonumber(ARGV[a + 2])
  local keys = {}
  for j = 1, nk do keys[j] = KEYS[k + j - 1] end
  local args = { nowArg }
  for j = 2, na do args[j] = ARGV[a + 1 + j] end
  if not STEPS[name] then return redis.error_reply('gate: unknown step ' .. tostring(name)) end
  steps[i] = { name = name, keys = keys, args = args }
  k = k + nk
  a = a + 2 + na
end

local woken = {}

-- Tell the first of line `z` to ask again, on its process's channel.
local function wake(z)
  local first = redis.call('ZRANGE', z, 0, 0)[1]
  if first then
    redis.call('PUBLISH', channel .. ':' .. floodgate_token(first), first)
    woken[#woken + 1] = first
  end
end

-- Take `member` out of line `z` (with expiries `e`); when it was first there, wake the next.
local function leave(z, e)
  local first = redis.call('ZRANGE', z, 0, 0)[1]
  if redis.call('ZREM', z, member) == 1 then
    redis.call('ZREM', e, member)
    if first == member then wake(z) end
  end
end

-- Keep (or take) `member`'s place in line `z` (with expiries `e`).
local function join(z, e)
  if not redis.call('ZSCORE', z, member) then
    redis.call('ZADD', z, redis.call('HINCRBY', gmeta, 'seq', 1), member)
  end
  redis.call('ZADD', e, now + ttl, member)
  redis.call('PEXPIRE', z, ttl)
  redis.call('PEXPIRE', e, ttl)
  redis.call('PEXPIRE', gmeta, ttl)
end

-- Take out of both lines the waiters that stopped asking.
local function prune(z, e)
  local gone = floodgate_expired(e, now)
  if #gone > 0 then redis.call('ZREM', z, unpack(gone)) end
end
prune(line, lexp)

if op == 'each' then
  local replies = {}
  local freed = false
  for i = 1, #steps do
    local s = steps[i]
    replies[i] = STEPS[s.name](s.keys, s.args)
    if (s.name == 'semaphore-release' or s.name == 'aimd-release') and replies[i][1] == 1 then freed = true end
  end
  if freed then wake(line) end
  return {1, -1, 0, woken, replies}
end

prune(lane, laneExp)

if op == 'leave' then
  leave(line, lexp)
  leave(lane, laneExp)
  return {1, -1, 0, woken, {}}
end

-- Someone ahead: nothing is looked at, and `member` waits behind (in line `z`, numbered `n`, with
-- expiries `e`, when it waits).
local function behind(z, e, n)
  local replies = {}
  for i = 1, #steps do replies[i] = false end
  if mode ~= 'wait' then return {0, -1, 0, woken, replies} end
  join(z, e)
  return {0, -1, n, woken, replies}
end

local head = redis.call('ZRANGE', line, 0, 0)[1]
if head and head ~= member then
  leave(lane, laneExp)
  return behind(line, lexp, 1)
end
local laneHead = redis.call('ZRANGE', lane, 0, 0)[1]
if not head and laneHead and laneHead ~= member then return behind(lane, laneExp, 2) end

-- Permit steps first, then the metering ones, each run to the end.
local order = {}
for i = 1, #steps do if PERMIT[steps[i].name] then order[#order + 1] = i end end
for i = 1, #steps do if not PERMIT[steps[i].name] then order[#order + 1] = i end end

local replies = {}
local saved = {}
local refused = false
local permitRefused = false
local waitMs = -1
for _, i in ipairs(order) do
  local s = steps[i]
  if not PERMIT[s.name] then
    local key = s.keys[1]
    saved[i] = { redis.call('DUMP', key), redis.call('PTTL', key) }
  end
  local reply = STEPS[s.name](s.keys, s.args)
  replies[i] = reply
  if reply[1] ~= 1 then
    refused = true
    if PERMIT[s.name] then
      permitRefused = true
    else
      waitMs = math.max(waitMs, tonumber(reply[2]) or 0)
    end
  end
end

if not refused then
  if head then
    redis.call('ZREM', line, member)
    redis.call('ZREM', lexp, member)
    -- Room left behind an admitted first waiter goes to the next.
    local room = true
    for i = 1, #steps do
      local r = replies[i]
      if PERMIT[steps[i].name] and tonumber(r[3]) >= tonumber(r[4]) then room = false end
    end
    if room then wake(line) end
  end
  leave(lane, laneExp)
  return {1, -1, 0, woken, replies}
end

-- Refused: roll back what admitted, last first, so nothing is held anywhere.
for n = #order, 1, -1 do
  local i = order[n]
  local s = steps[i]
  local r = replies[i]
  if r[1] == 1 then
    if PERMIT[s.name] then
      local g = s.args
      local undone = step_semaphore_release(s.keys, { nowArg, g[2], g[3], g[7], 'lease', g[13], g[12], g[14] })
      r[1] = -2
      r[2] = -1
      r[3] = undone[3]
      r[6] = undone[4]
    else
      local key = s.keys[1]
      local dump, pttl = saved[i][1], saved[i][2]
      if dump then
        redis.call('RESTORE', key, math.max(0, pttl), dump, 'REPLACE')
      else
        redis.call('DEL', key)
      end
      r[1] = -2
      r[2] = 0
    end
  end
end
if permitRefused then
  -- It waits for permits: in the permit line, out of its lane.
  leave(lane, laneExp)
  if mode ~= 'wait' then return {0, -1, 0, woken, replies} end
  join(line, lexp)
  return {0, -1, 1, woken, replies}
end
-- Only rates refused: permits are there. It waits first in its lane (or behind those there), and
-- the permit line goes on without it.
if head == member then leave(line, lexp) end
if mode ~= 'wait' then return {0, waitMs, 0, woken, replies} end
join(lane, laneExp)
if redis.call('ZRANGE', lane, 0, 0)[1] ~= member then waitMs = -1 end
return {0, waitMs, 2, woken, replies}
