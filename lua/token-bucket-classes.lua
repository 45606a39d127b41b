-- token-bucket-classes: one key of a token bucket with traffic classes, shared by the fleet.
-- The twin of src/algorithms/bucket-classes.ts (the memory token bucket decides with it): each
-- class keeps a ledger of its guarantee and of its ceiling, and the class whose head takes tokens
-- next is chosen by the same rule (owed first in arrival order, then borrowers by priority, the
-- first blocking the rest until the bucket holds its cost). Callers who cannot go line up in one
-- line per class, first in, first out across processes. Nothing is reserved ahead of time: each
-- call of this script grants, at its own instant, every head the rule lets go then, and tells the
-- rest how long until that may change; a waiting process asks again then.
--
-- KEYS[1] bucket   HASH  tokens, updatedAt (ms), factor, penalizedAt (ms) as token-bucket-take
--                        (updatedAt is never ahead of now here), last (the latest grant's member),
--                        seq (arrivals), and per class i (1-based) g<i>, c<i>, a<i>: the tokens
--                        of its guarantee and of its ceiling, as of a<i> (ms)
-- KEYS[2] queue    ZSET  member "<token>-<n>~<class>:<cost>" -> band of its class + arrival
-- KEYS[3] since    ZSET  member -> when it lined up (ms)
-- KEYS[4] granted  ZSET  member -> when it was granted (ms), until its process takes it (a
--                        message, or asking again) or it is too late to go
-- KEYS[5] procs    ZSET  token of each waiting process -> end of its last sign of life (ms)
--
-- ARGV[1]  now              ms, or "" for the server's TIME
-- ARGV[2]  capacity         tokens
-- ARGV[3]  refillPerSecond  tokens per second
-- ARGV[4]  recoveryMs       ms
-- ARGV[5]  initial          tokens a fresh key starts with
-- ARGV[6]  shares           per class "rate,capacity,ceiling,ceilingCapacity,kept,priority",
--                           joined by ";" (bucketShares in src/algorithms/bucket-classes.ts)
-- ARGV[7]  op               "wait" | "try" | "leave" | "refund" | "settle" | "penalize"
-- ARGV[8]  member           the caller (wait, try, leave) or the grant (refund, settle)
-- ARGV[9]  wait: "1" when `member` asked before; refund: tokens to give back; settle: actual
--          cost minus estimated; penalize: "<factor>:<minFactor>"
-- ARGV[10] livenessMs       how long a wait counts as a sign of life of its process, ms
-- ARGV[11] channel          base of the grant channels: a grant goes to "<channel>:<token>"
-- ARGV[12] lateMs           how late a grant may still be taken whatever its cost, ms
-- ARGV[13] key              the bucket's key, as the caller names it (for the hints below)
--
-- Returns {status, waitMs, grants, now, tick}:
--   status 1: `member` was granted (wait, try); 0: not (it waits in line on wait); -1: it asked
--             again but is neither in line nor granted in time (dropped while its process was
--             silent, or its grant came too late): it lines up again under a new member
--   waitMs: ms until the decision may change (-1: nobody waits); a waiting process asks again then
--   grants: this process's waiters granted here, each "<member>|<now>"; others' are PUBLISHed
--   now: the time the call decided at (server ms)
--   tick: 1 when this caller's process is to ask again in waitMs (its head stands first, or no
--         head does), 0 when another's is (it was sent a hint)
-- refund and settle return the same shape (status 1 when tokens came back or were charged).
local bucket   = KEYS[1]
local queue    = KEYS[2]
local since    = KEYS[3]
local granted  = KEYS[4]
local procs    = KEYS[5]
local now      = floodgate_now(ARGV[1])
local capacity = tonumber(ARGV[2])
local refill   = tonumber(ARGV[3])
local recoveryMs = tonumber(ARGV[4])
local initial  = tonumber(ARGV[5])
local op       = ARGV[7]
local member   = ARGV[8]
local channel  = ARGV[11]
local lateMs   = tonumber(ARGV[12])
local EPS      = 1e-9
local INF      = math.huge

-- The classes' shares.
local rate, cap, ceil, ceilCap, kept, prio = {}, {}, {}, {}, {}, {}
local n = 0
for part in string.gmatch(ARGV[6], '[^;]+') do
  n = n + 1
  local r, c, ce, cc, k, p = string.match(part, '^([^,]+),([^,]+),([^,]+),([^,]+),([^,]+),([^,]+)$')
  rate[n], cap[n], ceil[n], ceilCap[n], kept[n], prio[n] =
    tonumber(r), tonumber(c), tonumber(ce), tonumber(cc), tonumber(k), tonumber(p)
end

-- The bucket and its ledgers, read in one HMGET.
local fields = { 'tokens', 'updatedAt', 'factor', 'penalizedAt', 'last', 'seq' }
for i = 1, n do
  fields[#fields + 1] = 'g' .. i
  fields[#fields + 1] = 'c' .. i
  fields[#fields + 1] = 'a' .. i
end
local v = redis.call('HMGET', bucket, unpack(fields))
local s
if v[1] then
  s = { tokens = tonumber(v[1]), updatedAt = tonumber(v[2]), factor = tonumber(v[3]),
    penalizedAt = tonumber(v[4]) }
else
  s = { tokens = initial, updatedAt = now, factor = 1, penalizedAt = now }
end
local last = v[5]
local seq = tonumber(v[6]) or 0
local G, C, A = {}, {}, {}
for i = 1, n do
  local at = tonumber(v[6 + 3 * i])
  if at then
    G[i], C[i], A[i] = tonumber(v[4 + 3 * i]), tonumber(v[5 + 3 * i]), at
  else
    G[i], C[i], A[i] = cap[i], ceilCap[i], now
  end
end

-- Ledger arithmetic (guaranteeAt, ceilingAt, chargeClass, creditClass in bucket-classes.ts).
local function refilled(t, perSecond, most, ms)
  if not (ms > 0) then return math.min(t, most) end
  local x = t + ms * perSecond / 1000
  if x < most then return x end
  return most
end

local function ms_until(t, need, perSecond)
  local ms = math.ceil((need - t) * 1000 / perSecond - EPS)
  if ms >= 1 then return ms end
  return 1
end

local function guarantee_at(i, at, headCost, from)
  local g, t = G[i], A[i]
  if from > t then
    g = refilled(g, rate[i], cap[i], math.min(from, at) - t)
    t = from
  end
  return refilled(g, rate[i], cap[i] + headCost, at - t)
end

local function ceiling_at(i, at)
  return refilled(C[i], refill * ceil[i], ceilCap[i], at - A[i])
end

local function advance(i, headCost, from)
  if not (now > A[i]) then return end
  G[i] = guarantee_at(i, now, headCost, from)
  C[i] = ceiling_at(i, now)
  A[i] = now
end

local function charge(i, cost, from)
  advance(i, cost, from)
  G[i] = math.max(0, G[i] - cost)
  C[i] = math.max(-capacity, C[i] - cost)
end

-- The heads of the class lines: member, cost, arrival, since; nil where nobody waits. A head
-- whose process stopped giving a sign of life leaves the line on the way (it is never granted).
local heads = {}
local band = floodgate_band

local function load_head(i)
  for _ = 1, 256 do
    local r = redis.call('ZRANGEBYSCORE', queue, floodgate_num((i - 1) * band), '(' .. floodgate_num(i * band),
      'WITHSCORES', 'LIMIT', 0, 1)
    if not r[1] then
      heads[i] = nil
      return
    end
    local token = floodgate_token(r[1])
    local alive = token and floodgate_alive_until(procs, token)
    if not alive or alive > now then
      heads[i] = { member = r[1], cost = floodgate_cost(r[1]), at = tonumber(r[2]) - (i - 1) * band,
        since = tonumber(redis.call('ZSCORE', since, r[1])) or now }
      return
    end
    redis.call('ZREM', queue, r[1])
    redis.call('ZREM', since, r[1])
  end
  heads[i] = nil
end

local function credit(i, amount)
  local h = heads[i]
  local headCost, from = 0, now
  if h then headCost, from = h.cost, h.since end
  advance(i, headCost, from)
  G[i] = math.min(cap[i] + headCost, G[i] + amount)
  C[i] = math.min(ceilCap[i], C[i] + amount)
end

-- Whether head a goes before head b: owed first, then priority among borrowers, then arrival.
local function ahead(a, aOwed, b, bOwed)
  if aOwed ~= bOwed then return aOwed end
  if not aOwed and prio[a] ~= prio[b] then return prio[a] > prio[b] end
  return heads[a].at < heads[b].at
end

-- The class whose head stands first when none may go (pick sets it): the one the bucket is
-- filling for, or, when every head waits at its ceiling, the one whose ceiling clears first.
local waitingOn = nil

-- The class whose head goes now, or -1 and the ms until that may change (nextBucketClass).
local function pick()
  local first, owed, changes = -1, false, INF
  local soonest, soonestMs = nil, INF
  for i = 1, n do
    local h = heads[i]
    if h then
      local c = ceiling_at(i, now)
      if c + EPS < h.cost then
        local ms = ms_until(c, h.cost, refill * ceil[i])
        changes = math.min(changes, ms)
        if ms < soonestMs or (ms == soonestMs and h.at < heads[soonest].at) then
          soonest, soonestMs = i, ms
        end
      else
        local g = guarantee_at(i, now, h.cost, h.since)
        local isOwed = g + EPS >= h.cost
        if not isOwed then changes = math.min(changes, ms_until(g, h.cost, rate[i])) end
        if first == -1 or ahead(i, isOwed, first, owed) then
          first, owed = i, isOwed
        end
      end
    end
  end
  if first == -1 then
    waitingOn = soonest
    return -1, changes
  end
  local need = heads[first].cost
  if not owed then
    for i = 1, n do
      if i ~= first then
        local h = heads[i]
        local g = h and guarantee_at(i, now, h.cost, h.since) or guarantee_at(i, now, 0, now)
        need = need + math.min(math.max(0, g), kept[i])
      end
    end
  end
  if floodgate_tokens_at(s, capacity, refill, recoveryMs, now) + EPS >= need then return first, 0 end
  waitingOn = first
  return -1, math.min(floodgate_wait_ms(s, capacity, refill, recoveryMs, need, now), changes)
end

local function take_tokens(cost)
  s.tokens = floodgate_tokens_at(s, capacity, refill, recoveryMs, now) - cost
  s.updatedAt = math.max(now, s.updatedAt)
end

local own = floodgate_token(member)
local mine = {}
local changed = false
-- The process whose head stands first when serve stops (nil: nobody's, or no head stands first).
local owner = nil

-- Grant every head the rule lets go now. `extra`, when given, is the class of the caller
-- looked at as a head that arrived after everyone (its class has nobody in line); returns
-- whether it was granted, and the ms until the next decision may change.
local function serve(extra)
  for i = 1, n do
    if i ~= extra then load_head(i) end
  end
  local took = false
  for _ = 1, 10000 do
    local cls, wait = pick()
    if cls < 0 then
      owner = waitingOn and floodgate_token(heads[waitingOn].member)
      return took, wait
    end
    local h = heads[cls]
    take_tokens(h.cost)
    charge(cls, h.cost, h.since)
    last = h.member
    changed = true
    if cls == extra and h.member == member then
      took = true
      extra = nil
    else
      redis.call('ZREM', queue, h.member)
      redis.call('ZREM', since, h.member)
      redis.call('ZADD', granted, now, h.member)
      local message = h.member .. '|' .. floodgate_num(now)
      local token = floodgate_token(h.member)
      if token == own then
        mine[#mine + 1] = message
      else
        redis.call('PUBLISH', channel .. ':' .. token, message)
      end
    end
    load_head(cls)
  end
  return took, 0
end

-- Write the bucket and its ledgers back; every key of it expires once it would be fresh again.
local function save()
  if not changed then return end
  local fill = (capacity - s.tokens) * 1000 / refill
  if s.factor < 1 then fill = math.max(fill / s.factor, recoveryMs) end
  local args = { 'tokens', floodgate_num(s.tokens), 'updatedAt', floodgate_num(s.updatedAt),
    'factor', floodgate_num(s.factor), 'penalizedAt', floodgate_num(s.penalizedAt), 'seq', seq }
  for i = 1, n do
    fill = math.max(fill, (cap[i] - G[i]) * 1000 / rate[i], (ceilCap[i] - C[i]) * 1000 / (refill * ceil[i]))
    args[#args + 1] = 'g' .. i
    args[#args + 1] = floodgate_num(G[i])
    args[#args + 1] = 'c' .. i
    args[#args + 1] = floodgate_num(C[i])
    args[#args + 1] = 'a' .. i
    args[#args + 1] = floodgate_num(A[i])
  end
  if last then
    args[#args + 1] = 'last'
    args[#args + 1] = last
  end
  redis.call('HSET', bucket, unpack(args))
  -- The lines go with it: a waiting process writes it at least once per sign of life.
  local ttl = string.format('%d', math.min(math.ceil(fill) + 2 * tonumber(ARGV[10]) + 1000, 9007199254740991))
  redis.call('PEXPIRE', bucket, ttl)
  redis.call('PEXPIRE', queue, ttl)
  redis.call('PEXPIRE', since, ttl)
  redis.call('PEXPIRE', granted, ttl)
end

-- The longest a grant of `cost` may still be taken after it was made: while the bucket could
-- not have filled the room above that cost, and at least lateMs (src/redis/token-bucket.ts).
local function late_ms(cost)
  return math.max(lateMs, (capacity - cost) * 1000 / refill)
end

-- The reply. The process whose head stands first asks again when the decision may change (its
-- call grants whoever the rule picks then, whichever process it is in): a caller of another
-- process tells it so, with a hint "~<waitMs>|<key>" on its channel; its own callers' slow polls
-- cover a hint lost, or a process gone. With no head first, every waiting process asks again.
local function reply(status, wait)
  save()
  if wait == INF then wait = -1 end
  local tick = 1
  if owner and owner ~= own then
    tick = 0
    if wait >= 0 then redis.call('PUBLISH', channel .. ':' .. owner, '~' .. floodgate_num(wait) .. '|' .. ARGV[13]) end
  end
  return { status, wait, mine, now, tick }
end

-- Grants nobody took in time are forgotten.
redis.call('ZREMRANGEBYSCORE', granted, '-inf', '(' .. floodgate_num(now - late_ms(0)))

if op == 'wait' or op == 'try' then
  local k = floodgate_class(member) + 1
  local cost = floodgate_cost(member)
  if op == 'wait' then floodgate_sign_of_life(procs, member, now, tonumber(ARGV[10])) end
  if ARGV[9] == '1' then
    -- Asking again: granted meanwhile (taken while fresh, else gone), in line, or gone.
    local status = 0
    local at = tonumber(redis.call('ZSCORE', granted, member))
    if at then
      redis.call('ZREM', granted, member)
      status = now - at <= late_ms(cost) and 1 or -1
    elseif not redis.call('ZSCORE', queue, member) then
      status = -1
    end
    local _, wait = serve(nil)
    return reply(status, wait)
  end
  -- A newcomer: looked at as the head of its class when nobody of it waits.
  load_head(k)
  if not heads[k] then
    heads[k] = { member = member, cost = cost, at = INF, since = now }
    local took, wait = serve(k)
    if took then return reply(1, wait) end
    heads[k] = nil
  end
  if op == 'wait' then
    seq = seq + 1
    changed = true
    redis.call('ZADD', queue, (k - 1) * band + seq, member)
    redis.call('ZADD', since, now, member)
  end
  -- Heads due before it may go now (a try that stood first and could not go stands aside for
  -- them); behind them, a waiting caller itself, whose grant is then among this process's
  -- grants in the reply.
  local _, wait = serve(nil)
  return reply(0, wait)
end

if op == 'leave' then
  redis.call('ZREM', queue, member)
  redis.call('ZREM', since, member)
  -- A grant its process never took: its tokens come back while it is the latest.
  if redis.call('ZREM', granted, member) == 1 and last == member then
    local k = floodgate_class(member) + 1
    local cost = floodgate_cost(member)
    load_head(k)
    s.tokens = math.min(capacity, floodgate_tokens_at(s, capacity, refill, recoveryMs, now) + cost)
    s.updatedAt = math.max(now, s.updatedAt)
    credit(k, cost)
    last = nil
    redis.call('HDEL', bucket, 'last')
    changed = true
  end
  local _, wait = serve(nil)
  return reply(0, wait)
end

if op == 'refund' or op == 'settle' then
  local k = floodgate_class(member) + 1
  local amount = tonumber(ARGV[9])
  local status = 0
  load_head(k)
  if op == 'settle' and amount > 0 then
    take_tokens(amount)
    charge(k, amount, now)
    status = 1
  elseif last == member then
    local back = op == 'refund' and amount or -amount
    s.tokens = math.min(capacity, floodgate_tokens_at(s, capacity, refill, recoveryMs, now) + back)
    s.updatedAt = math.max(now, s.updatedAt)
    credit(k, back)
    status = 1
    if op == 'refund' then
      last = nil
      redis.call('HDEL', bucket, 'last')
    end
  end
  changed = status == 1
  local _, wait = serve(nil)
  return reply(status, wait)
end

if op == 'penalize' then
  local factor = tonumber(string.match(ARGV[9], '^([^:]+)'))
  local minFactor = tonumber(string.match(ARGV[9], ':(.+)$'))
  local t = math.max(now, s.updatedAt)
  local tokens = floodgate_tokens_at(s, capacity, refill, recoveryMs, t)
  local next = math.max(minFactor, math.min(1, floodgate_rate_factor(s, recoveryMs, t) * factor))
  s = { tokens = tokens, updatedAt = t, factor = next, penalizedAt = t }
  changed = true
  local _, wait = serve(nil)
  return reply(math.floor(next * 1000), wait)
end

return redis.error_reply('token-bucket-classes: unknown op ' .. tostring(op))
