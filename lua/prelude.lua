-- floodgate prelude: definitions shared by the scripts. In front of each script go only the
-- definitions it uses (src/redis/scripts.ts finds them), so a script pays for nothing else.

-- ARGV[1] is always the time in milliseconds to decide with, or "" to read the Redis server's
-- clock (TIME). Workers' own clocks never decide a lease or a refill; tests pass a fake time.
local function floodgate_now(arg)
  if arg ~= nil and arg ~= '' then
    return tonumber(arg)
  end
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- Remove every member of the sorted set `zset` scored at or below `now`; returns them.
local function floodgate_expired(zset, now)
  local members = redis.call('ZRANGEBYSCORE', zset, '-inf', now, 'LIMIT', 0, 1000)
  if #members > 0 then
    redis.call('ZREM', zset, unpack(members))
  end
  return members
end

-- Token bucket math, ported from src/algorithms/token-bucket.ts (same table tests).
-- State: tokens at updatedAt; rate multiplier `factor` right after the penalty at penalizedAt,
-- climbing back linearly to 1 over recoveryMs.
local function floodgate_factor_integral(f0, recoveryMs, x)
  if x <= 0 then return 0 end
  if f0 >= 1 then return x end
  if x >= recoveryMs then return recoveryMs * (1 + f0) / 2 + (x - recoveryMs) end
  return f0 * x + (1 - f0) * x * x / (2 * recoveryMs)
end

local function floodgate_tokens_at(s, capacity, refillPerSecond, recoveryMs, now)
  if now <= s.updatedAt then return s.tokens end
  local effectiveMs
  if s.factor >= 1 then
    effectiveMs = now - s.updatedAt
  else
    local from = math.max(0, s.updatedAt - s.penalizedAt)
    effectiveMs = floodgate_factor_integral(s.factor, recoveryMs, now - s.penalizedAt)
      - floodgate_factor_integral(s.factor, recoveryMs, from)
  end
  local tokens = s.tokens + effectiveMs * refillPerSecond / 1000
  if tokens < capacity then return tokens end
  return capacity
end

local function floodgate_rate_factor(s, recoveryMs, now)
  if s.factor >= 1 then return 1 end
  local x = now - s.penalizedAt
  if x <= 0 then return s.factor end
  if x >= recoveryMs then return 1 end
  return s.factor + (1 - s.factor) * x / recoveryMs
end

-- Whole ms until `cost` tokens are there: 0 when they are, else at least 1 (however fast the
-- refill), so a waiter that sleeps that long never finds them short again at the same instant.
local function floodgate_wait_ms(s, capacity, refillPerSecond, recoveryMs, cost, now)
  local need = cost - floodgate_tokens_at(s, capacity, refillPerSecond, recoveryMs, now)
  if need <= 1e-9 then return 0 end
  local needMs = need * 1000 / refillPerSecond
  local t = math.max(now, s.updatedAt)
  local x = t - s.penalizedAt
  if s.factor >= 1 or x >= recoveryMs then return math.max(1, math.ceil(needMs - 1e-9)) end
  local f0 = s.factor
  local r = recoveryMs
  local at = math.max(0, x)
  local before = floodgate_factor_integral(f0, r, r) - floodgate_factor_integral(f0, r, at)
  if needMs > before then return math.max(1, math.ceil(r - at + (needMs - before) - 1e-9)) end
  local target = floodgate_factor_integral(f0, r, at) + needMs
  local a = (1 - f0) / (2 * r)
  local y = (-f0 + math.sqrt(f0 * f0 + 4 * a * target)) / (2 * a)
  return math.max(1, math.ceil(y - at - 1e-9))
end

-- A number as Redis would write it, with every digit (%.17g), so it reads back exactly; a whole
-- number up to 2^53 goes through the cheaper '%d' (the same text, never an exponent, so a TTL
-- up to 2^53 - 1 ms written with it is an integer PEXPIRE takes). Cheaper than letting
-- redis.call convert.
local function floodgate_num(x)
  if x % 1 == 0 and x >= -9007199254740991 and x <= 9007199254740991 then
    return string.format('%d', x)
  end
  return string.format('%.17g', x)
end

-- Read a bucket hash, and its latest grant id (`last`, false when none, read only when `withLast`);
-- a missing key is a fresh bucket holding `initial` tokens. `read`, when given, is the reply of
-- an HMGET of tokens, updatedAt, factor, penalizedAt already made. `whole` marks a state whose
-- every field must be written; `storedAt` is updatedAt as stored, so an unchanged one is not
-- rewritten.
local function floodgate_bucket(key, initial, now, withLast, read)
  local v = read
  if withLast then
    v = redis.call('HMGET', key, 'tokens', 'updatedAt', 'factor', 'penalizedAt', 'last')
  elseif not v then
    v = redis.call('HMGET', key, 'tokens', 'updatedAt', 'factor', 'penalizedAt')
  end
  if not v[1] then
    return { tokens = initial, updatedAt = now, factor = 1, penalizedAt = now, whole = true }, v[5]
  end
  local updatedAt = tonumber(v[2])
  return { tokens = tonumber(v[1]), updatedAt = updatedAt, factor = tonumber(v[3]),
    penalizedAt = tonumber(v[4]), whole = false, storedAt = updatedAt }, v[5]
end

-- Write a bucket back in one HSET, with `last` set to `grant` unless it is nil, and let it expire
-- once it would be full again anyway (an idle key costs nothing): the refill counts from
-- updatedAt, which is ahead of `now` while callers are reserved (token-bucket-take); at most
-- 2^53 - 1 ms from now (a refill too slow, or a debt too deep, to wait out). Unless `s.whole`, only what a take,
-- refund or settle can move is written: tokens, and updatedAt when it moved. Everything is
-- worked out before the first write, so nothing is left half written.
local function floodgate_save_bucket(key, s, capacity, refillPerSecond, recoveryMs, grant, now)
  -- Time until idle is at most the refill at the slowest (penalised) rate, or the recovery.
  local fillMs = (capacity - s.tokens) * 1000 / refillPerSecond
  if s.factor < 1 then fillMs = math.max(fillMs / s.factor, recoveryMs) end
  if s.updatedAt > now then fillMs = fillMs + (s.updatedAt - now) end
  local ttl = string.format('%d', math.min(math.ceil(fillMs) + 1000, 9007199254740991))
  local tokens = floodgate_num(s.tokens)
  if s.whole then
    local updatedAt = floodgate_num(s.updatedAt)
    local factor = floodgate_num(s.factor)
    local penalizedAt = floodgate_num(s.penalizedAt)
    if grant then
      redis.call('HSET', key, 'tokens', tokens, 'updatedAt', updatedAt, 'factor', factor,
        'penalizedAt', penalizedAt, 'last', grant)
    else
      redis.call('HSET', key, 'tokens', tokens, 'updatedAt', updatedAt, 'factor', factor,
        'penalizedAt', penalizedAt)
    end
  elseif s.updatedAt ~= s.storedAt then
    local updatedAt = floodgate_num(s.updatedAt)
    if grant then
      redis.call('HSET', key, 'tokens', tokens, 'updatedAt', updatedAt, 'last', grant)
    else
      redis.call('HSET', key, 'tokens', tokens, 'updatedAt', updatedAt)
    end
  elseif grant then
    redis.call('HSET', key, 'tokens', tokens, 'last', grant)
  else
    redis.call('HSET', key, 'tokens', tokens)
  end
  redis.call('PEXPIRE', key, ttl)
end

-- A lease or waiter member is "<id>:<cost>": its cost travels with it, so no side table. (A
-- one-digit cost, as most are, is read without a pattern; so is a member with no cost, as a fused
-- gate's caller of cost 1 is: a plain find of ':' costs half the pattern that would find none.)
local function floodgate_cost(member)
  if string.byte(member, -2) == 58 then
    local digit = string.byte(member, -1) - 48
    if digit >= 0 and digit <= 9 then return digit end
  end
  if not string.find(member, ':', 1, true) then return 1 end
  return tonumber(string.match(member, ':(%d+)$')) or 1
end

-- An AIMD limiter's limit and epoch once a lease it held is given back with `outcome` (see
-- lua/aimd-release.lua): a drop, or a success slower than slowCallMs (`slow`), of a call admitted
-- in the current epoch (`ticketEpoch`) cuts the limit to floor(limit * ratio) within [minLimit,
-- maxLimit] and starts a new epoch; a success while at least half the limit is in use (`used`,
-- before the lease is given back) adds one; "ignored" and "refund" move nothing.
local function floodgate_aimd_moved(limit, epoch, used, outcome, ticketEpoch, slow, minLimit, maxLimit, ratio)
  if outcome ~= 'success' and outcome ~= 'dropped' then return limit, epoch end
  if outcome == 'dropped' or slow then
    if ticketEpoch == epoch then
      return math.max(minLimit, math.min(maxLimit, math.floor(limit * ratio))), epoch + 1
    end
  elseif used * 2 >= limit and limit < maxLimit then
    return limit + 1, epoch
  end
  return limit, epoch
end

-- A turn's releases of one stage's leases answered in short (a fused gate's each(), lua/gate.lua,
-- and its first pass): "n", one flag a lease (`flags`: 1 when it was still held), then the
-- stage's figures once they are all given back (a semaphore's used; an AIMD limiter's limit,
-- epoch and used). The client gives each lease the reply its script gives one release, with
-- those figures (src/redis/turn-releases.ts, settleTurn).
local function floodgate_short(flags, ...)
  return { 'n', table.concat(flags), ... }
end

-- Take `by` permits off a permit stage's count in `meta`; returns the permits still used (never
-- below zero: a count gone negative is set back to 0).
local function floodgate_lower_used(meta, by)
  local used = redis.call('HINCRBY', meta, 'used', -by)
  if used < 0 then
    used = 0
    redis.call('HSET', meta, 'used', 0)
  end
  return used
end

-- Set a host's next slot to `claimed` (a string, as floodgate_num writes it), claimed by a call
-- spaced `spacing` ms: its key expires once that spacing has passed, plus a second, at most
-- 2^53 - 1 ms from now.
local function floodgate_hold_slot(host, claimed, spacing)
  redis.call('HSET', host, 'nextAt', claimed)
  redis.call('PEXPIRE', host, floodgate_num(math.min(math.ceil(spacing) + 1000, 9007199254740991)))
end

-- A value as JSON as Redis would have sent it from a script: numbers as integers, true as 1,
-- false as null, a list up to its first nil (numbers go whole: the JSON library rounds to 14
-- digits). A fused gate's grant record and message (lua/gate.lua) are made so.
local function floodgate_encode(v)
  local t = type(v)
  if t == 'table' then
    local parts = {}
    local i = 1
    while v[i] ~= nil do
      parts[i] = floodgate_encode(v[i])
      i = i + 1
    end
    return '[' .. table.concat(parts, ',') .. ']'
  elseif t == 'number' then
    return string.format('%.0f', v >= 0 and math.floor(v) or math.ceil(v))
  elseif t == 'string' then
    return cjson.encode(v)
  end
  return v == true and '1' or 'null'
end

-- Where a fused gate's step that repeats an earlier one (the same script, keys and arguments but
-- its own) carries its own arguments, by its script's name: their places among the step's
-- arguments, in the order a repeat sends them (src/redis/gate-call.ts, OWN). Made when asked for: a
-- script call pays for every table it makes.
local function floodgate_own()
  return {
    ['semaphore-acquire'] = { 2, 9, 10 },
    ['token-bucket-take'] = { 5, 7, 8 },
    ['interval-gate-take'] = { 2 },
    ['semaphore-release'] = { 2, 5 },
    ['aimd-release'] = { 2, 4, 5, 9 },
  }
end

-- A fused gate's call as it came (lua/gate.lua, ARGV[5]): a JSON list, or its name alone, read
-- as the repeat before it (`before`; nil when there is none, and then so is the call) with that
-- name wherever `before` had its own (its member, and each own argument, a lease's or a grant's,
-- that was that member).
local function floodgate_call(arg, before)
  if string.byte(arg) == 91 then return cjson.decode(arg) end
  if not before then return nil end
  local was = before[1]
  local call = { unpack(before) }
  for x = 1, #call do
    if call[x] == was then call[x] = arg end
  end
  return call
end

-- The replies of the steps named `names` (in order) of a fused gate's call admitted in one pass, as
-- each step's script answers when it admits, from their figures in `flat` (a permit's fence,
-- used, limit and epoch; a host's slot replaced and claimed; nothing for a bucket), at `now`:
-- what src/redis/gate-reply.ts (admittedAtOnce) makes of them for a call answered in short.
local function floodgate_admitted(names, flat, now)
  local replies, at = {}, 1
  for i = 1, #names do
    if names[i] == 'semaphore-acquire' then
      replies[i] = { 1, flat[at], flat[at + 1], flat[at + 2], flat[at + 3], 0, 0, now }
      at = at + 4
    elseif names[i] == 'interval-gate-take' then
      replies[i] = { 1, flat[at], flat[at + 1] }
      at = at + 2
    else
      replies[i] = { 1, 0 }
    end
  end
  return replies
end

-- Of a fused gate's permit line's firsts' waits for rates (its gmeta's fr, fru, frk as an HMGET
-- gives them, `g`), the ms that have passed by `now` (lua/gate.lua, passed()).
local function floodgate_passed(g, now)
  return math.max(0, (tonumber(g[1]) or 0) - math.max(0, (tonumber(g[2]) or 0) - now))
end

-- The process of a lease or waiter member "<token>-<n>:<cost>", or nil for a member without one.
local function floodgate_token(member)
  return string.match(member, '^(%x+)%-')
end

-- When the process `token` stops counting as alive (ms), from `procs` (a sorted set of each
-- waiting process's token scored by the end of its last sign of life); nil when not known (the
-- set expired, or the entry was pruned long after its end): then only the waiter's own place in
-- line (qexp) bounds it.
local function floodgate_alive_until(procs, token)
  return tonumber(redis.call('ZSCORE', procs, token))
end

-- Record a sign of life of the process of `member` ("<token>-<n>:<cost>", or just a token),
-- lasting `livenessMs` from `now`; returns true. The set expires once no process has given one
-- for `livenessMs`, so processes that are gone leave nothing (an entry lost with it reads as not
-- known, which never drops a waiter).
local function floodgate_sign_of_life(procs, member, now, livenessMs)
  local token = floodgate_token(member) or member
  redis.call('ZADD', procs, now + livenessMs, token)
  redis.call('PEXPIRE', procs, livenessMs)
  return true
end

-- The first waiter in line whose process is alive. Waiters of a process that stopped renewing
-- its sign of life (killed, frozen) are taken out of the line on the way: they are never granted.
-- A member without a process token, or whose process's sign of life is not known, counts as alive.
local function floodgate_live_head(queue, qexp, procs, now)
  local head = redis.call('ZRANGE', queue, 0, 0)[1]
  for _ = 1, 256 do
    if not head then return nil end
    local token = floodgate_token(head)
    local alive = token and floodgate_alive_until(procs, token)
    if not alive or alive > now then return head end
    redis.call('ZREM', queue, head)
    redis.call('ZREM', qexp, head)
    head = redis.call('ZRANGE', queue, 0, 0)[1]
  end
  return head
end

-- Whether waiter `head` can be granted now. Returns 0 when its process went silent
-- (floodgate_alive_until): it is taken out of the line here; 1 when nobody listens on its
-- process's channel (the process was killed and its connections closed, or it is not subscribed
-- yet): it keeps its place but is passed over this time, so a permit never goes where no one can
-- take it; else 2, the channel to tell it on and when its process stops counting as alive (nil:
-- not known). `hears` remembers each process's listeners for the rest of the call; `own` is the
-- calling process's token (its grants come back in the reply, so it needs no listener).
local function floodgate_reach(keys, head, now, channel, listeners, own, hears)
  local token = floodgate_token(head)
  local alive = token and floodgate_alive_until(keys[5], token)
  if alive and alive <= now then
    redis.call('ZREM', keys[2], head)
    redis.call('ZREM', keys[3], head)
    return 0
  end
  local to = token and (channel .. ':' .. token) or channel
  if token and listeners and token ~= own then
    local heard = hears[token]
    if heard == nil then
      heard = tonumber(redis.call('PUBSUB', 'NUMSUB', to)[2]) > 0
      hears[token] = heard
    end
    if not heard then return 1 end
  end
  return 2, to, alive
end

-- Grant waiter `head`: it moves from the line into holders with a lease that ends at the
-- earliest of when its place in line would have (qexp), `claimMs` from now and when its process
-- stops counting as alive (`alive`), until its process claims it (its first renewal makes it a
-- full lease), and is told with PUBLISH "<member>|<fence>|<epoch>|<ends>|<now>" (server ms: its
-- process judges from them whether the grant is still good when the message reaches it) on
-- channel `to`. Returns the message, or nil when its place in line had already ended, or when it
-- holds a lease already (it leaves the line granted nothing).
local function floodgate_hand(keys, head, now, claimMs, alive, epoch, to)
  local expiry = tonumber(redis.call('ZSCORE', keys[3], head))
  redis.call('ZREM', keys[2], head)
  redis.call('ZREM', keys[3], head)
  if not expiry or expiry <= now then return nil end
  expiry = math.min(expiry, now + claimMs)
  if alive then expiry = math.min(expiry, alive) end
  -- (A waiter that holds a lease already is neither granted nor counted twice: NX leaves its
  -- lease as it is, not cut to a claim's end.)
  if redis.call('ZADD', keys[1], 'NX', expiry, head) == 0 then return nil end
  local fence = redis.call('HINCRBY', keys[4], 'seq', 1)
  local message = head .. '|' .. fence .. '|' .. epoch .. '|' .. floodgate_num(expiry) .. '|' .. floodgate_num(now)
  redis.call('PUBLISH', to, message)
  return message
end

-- Grant on release: give the waiters at the head of the line their permits while they fit, so a
-- freed permit goes straight to the next waiter with no round trip of its own. `keys` are the
-- permit stage's, in the order every permit script takes them: holders, queue, qexp, meta,
-- procs (passed in, not read from the global KEYS: in a gate call those are the gate's own).
-- `channel` is the stage's grant channel, `listeners` whether to ask Redis who listens
-- (pub/sub counts are exact on one server, not across a cluster's nodes) and `own` the token of
-- the calling process (its grants come back in this call's reply).
-- `head` is the first member in line. Waiter by waiter, from the head: one whose process went
-- silent leaves the line, one nobody listens for is passed over (floodgate_reach); one that does
-- not fit stops the granting, so a large waiter is not overtaken by small ones; else it is
-- granted (floodgate_hand) on `channel`:<token> when the member is "<token>-<n>:<cost>" (the
-- channel of its own process, so a grant wakes no other process), else on `channel`.
-- Returns the messages sent and the permits now used. At most 64 grants per call.
local function floodgate_grant_heads(keys, head, used, limit, now, claimMs, epoch, channel, listeners, own)
  local sent = {}
  local n = 0
  local passed = 0
  local hears = {}
  for _ = 1, 256 do
    if not head or n >= 64 then break end
    local state, to, alive = floodgate_reach(keys, head, now, channel, listeners, own, hears)
    if state == 1 then
      passed = passed + 1
    elseif state == 2 then
      local cost = floodgate_cost(head)
      if used + cost > limit then break end
      local message = floodgate_hand(keys, head, now, claimMs, alive, epoch, to)
      if message then
        used = used + cost
        n = n + 1
        sent[n] = message
      end
    end
    head = redis.call('ZRANGE', keys[2], passed, passed)[1]
  end
  return sent, used
end

-- Traffic classes on Redis. A member of class i (0-based, in the order the stage declares its
-- classes) is "<token>-<n>~<i>:<cost>"; one without "~" is of class 0. Each class waits in its
-- own band of the queue's scores, i * 2^48 + its arrival sequence: the line of a stage without
-- classes is band 0, scored as before, and each band is in arrival order. (2^48 arrivals per
-- stage; 16 classes keep every score below 2^52, exact in a double.)
local floodgate_band = 281474976710656

-- The class (0-based) of a member.
local function floodgate_class(member)
  return tonumber(string.match(member, '~(%d+):')) or 0
end

-- A lease of a stage with classes (`~k:` in its member) taken back by a process that built the
-- stage without them: take its permits off its class's count in `meta` (u0, u1, …) all the
-- same, so no class keeps counting a permit nobody holds.
local function floodgate_unclass(meta, member)
  local k = string.match(member, '~(%d+):')
  if not k then return end
  local field = 'u' .. k
  local left = (tonumber(redis.call('HGET', meta, field)) or 0) - floodgate_cost(member)
  redis.call('HSET', meta, field, math.max(0, left))
end

-- Nobody holds a permit: zero every class count in `meta`, for a process that built the stage
-- without classes (one with them zeroes its own).
local function floodgate_unclass_all(meta)
  local fields = redis.call('HKEYS', meta)
  for i = 1, #fields do
    if string.match(fields[i], '^u%d+$') then redis.call('HSET', meta, fields[i], 0) end
  end
end

-- A permit stage's state when it may grant at once, as far as `meta` says: its limit known (the
-- stage's `limitArg`, or meta's when that is "", as for an AIMD limiter) and no quarantine on at
-- `now`. Returns {used, limit, seq, epoch} (epoch 0 unless the limit is meta's), or nil. Its own
-- line, classes and the caller's fence are the caller's to look at.
local function floodgate_open(meta, limitArg, now)
  local v = redis.call('HMGET', meta, 'used', 'limit', 'epoch', 'seq', 'quarantine')
  local limit = tonumber(limitArg) or tonumber(v[2])
  if not limit or (tonumber(v[5]) or 0) > now then return nil end
  return { used = tonumber(v[1]) or 0, limit = limit, seq = tonumber(v[4]) or 0,
    epoch = limitArg == '' and (tonumber(v[3]) or 0) or 0 }
end

-- Write `used` (all permits held) to `meta` in one HSET, with what each class of `c` holds when
-- `c` is given, and the fencing sequence when `seq` is.
local function floodgate_set_used(meta, used, c, seq)
  if not c then
    if seq then
      redis.call('HSET', meta, 'used', used, 'seq', seq)
    else
      redis.call('HSET', meta, 'used', used)
    end
    return
  end
  local args = { 'used', used }
  for i = 1, c.n do
    args[2 * i + 1] = c.fields[i + 2]
    args[2 * i + 2] = math.max(0, c.used[i])
  end
  if seq then
    args[#args + 1] = 'seq'
    args[#args + 1] = seq
  end
  redis.call('HSET', meta, unpack(args))
end

-- The traffic classes of a permit stage from `spec`, "share,maxShare,lendable,priority" per
-- class in declaration order joined by ";", after a "!" when the stage asks borrowed leases back
-- (reclaim "signal"), or nil for "" (a stage without classes). What each class holds lives in
-- meta as u0, u1, …, read into c.used (1-based) by c.load, beside the classes of the last
-- process that acquired (`cls`, read into c.stored) and the leases asked back (`rc`, c.asked). The methods are
-- made here, so a script run for a stage without classes pays for none of them:
--   c.bounds(limit)    guarantees, ceilings and kept parts (the twin of `guarantees` in
--                      src/algorithms/classes.ts)
--   c.next(used, headCost, headAt, guarantee, ceiling, kept, free)
--                      the class whose head goes next (the twin of `nextClass`)
--   c.load(meta), c.free(member), c.goes(…), c.grant(…), c.reclaim(…): below
-- `keys` are the stage's own (as floodgate_grant_heads takes them): never the global KEYS, which
-- in a gate call are the gate's.
local function floodgate_classes(keys, spec)
  if spec == nil or spec == '' then return nil end
  local c = { n = 0, fields = { 'cls', 'rc' }, used = {}, spec = spec }
  -- A leading "!": the stage asks borrowed leases back (reclaim "signal", c.reclaim below).
  c.reclaims = string.sub(spec, 1, 1) == '!'

  local share, maxShare, lendable, priority = {}, {}, {}, {}
  local body = c.reclaims and string.sub(spec, 2) or spec
  for s, m, l, p in string.gmatch(body, '([^,;]+),([^,;]+),([^,;]+),([^,;]+)') do
    local n = c.n + 1
    c.n = n
    share[n] = tonumber(s)
    maxShare[n] = tonumber(m)
    lendable[n] = tonumber(l)
    priority[n] = tonumber(p)
    c.fields[n + 2] = 'u' .. (n - 1)
  end

  -- Divide `limit` permits by the shares, the leftovers to the largest remainders (the earlier
  -- class on a tie), at least one each; a ceiling is maxShare of the limit rounded down, never
  -- below the exact portion rounded up; what a class keeps is the part of its guarantee it does
  -- not lend.
  function c.bounds(limit)
    local n = c.n
    local total = 0
    for i = 1, n do total = total + share[i] end
    local guarantee, remainder, given = {}, {}, 0
    for i = 1, n do
      local exact = (limit * share[i]) / total
      guarantee[i] = math.floor(exact)
      remainder[i] = exact - guarantee[i]
      given = given + guarantee[i]
    end
    for _ = 1, limit - given do
      local best = 1
      for i = 2, n do
        if remainder[i] > remainder[best] then best = i end
      end
      guarantee[best] = guarantee[best] + 1
      remainder[best] = -1
    end
    local ceiling, kept = {}, {}
    for i = 1, n do
      guarantee[i] = math.max(1, guarantee[i])
      kept[i] = guarantee[i] - math.floor(lendable[i] * guarantee[i])
      ceiling[i] = math.max(math.ceil((limit * share[i]) / total - 1e-9), math.floor(limit * maxShare[i]))
    end
    return guarantee, ceiling, kept
  end

  -- The class (1-based) whose head goes next with `free` permits free, or 0. `headCost[i]` is
  -- false when nobody of class i waits; `headAt[i]` orders arrivals. Owed classes (holding less
  -- than their guarantee) first, in arrival order; then borrowers by priority, then arrival; the
  -- first in that order blocks the rest when its head does not fit; a head that would pass its
  -- ceiling is skipped; a borrower's head fits only in what stays free after what the others
  -- keep and do not use.
  function c.next(used, headCost, headAt, guarantee, ceiling, kept, free)
    local first, owed = 0, false
    for i = 1, #used do
      local cost = headCost[i]
      if cost and used[i] + cost <= ceiling[i] then
        local isOwed = used[i] < guarantee[i]
        local ahead
        if first == 0 then
          ahead = true
        elseif isOwed ~= owed then
          ahead = isOwed
        elseif not isOwed and priority[i] ~= priority[first] then
          ahead = priority[i] > priority[first]
        else
          ahead = headAt[i] < headAt[first]
        end
        if ahead then
          first = i
          owed = isOwed
        end
      end
    end
    if first == 0 then return 0 end
    local room = free
    if not owed then
      for i = 1, #used do
        if i ~= first then room = room - math.max(0, kept[i] - used[i]) end
      end
    end
    if headCost[first] <= room then return first end
    return 0
  end

  -- Read what each class holds from `meta` into c.used, and the classes stored there.
  function c.load(meta)
    local v = redis.call('HMGET', meta, unpack(c.fields))
    c.stored = v[1]
    c.asked = v[2]
    for i = 1, c.n do c.used[i] = tonumber(v[i + 2]) or 0 end
  end

  -- Store this caller's classes in `meta` (c.load done) when they are not what is there; returns
  -- what was there when it differed (another process built the stage with other classes), else "".
  function c.agree(meta)
    if c.stored == c.spec then return '' end
    redis.call('HSET', meta, 'cls', c.spec)
    return c.stored or ''
  end

  -- Permits of `member` no longer held by its class (a release, a lapsed grant, a reaped lease).
  function c.free(member)
    local k = floodgate_class(member) + 1
    if c.used[k] then c.used[k] = math.max(0, c.used[k] - floodgate_cost(member)) end
  end

  -- The bounds at `limit`, worked out once per limit per call.
  local function limits(limit)
    if c.limit ~= limit then
      c.guarantee, c.ceiling, c.kept = c.bounds(limit)
      c.limit = limit
    end
  end

  -- The member at place `offset` (0: the head) of class i's line (1-based), its cost and its
  -- arrival sequence; nil, false, 0 when there is none.
  local function head(i, offset)
    local low = (i - 1) * floodgate_band
    local r = redis.call('ZRANGEBYSCORE', keys[2], low, '(' .. floodgate_num(low + floodgate_band),
      'WITHSCORES', 'LIMIT', offset, 1)
    if not r[1] then return nil, false, 0 end
    return r[1], floodgate_cost(r[1]), tonumber(r[2]) - low
  end

  -- Whether `member` (class k, 1-based, costing `cost`) goes now with `used` of `limit` permits
  -- held (c.load done): nobody of its class is ahead of it, and c.next picks its class with it
  -- at the head of its line (arrived after everyone when it is not in line yet). `waiting`:
  -- whether anyone is in line at all, as the caller has read it.
  function c.goes(k, member, cost, used, limit, waiting)
    local headCost, headAt = {}, {}
    for i = 1, c.n do
      headCost[i] = false
      headAt[i] = 0
    end
    if waiting then
      for i = 1, c.n do
        local first
        first, headCost[i], headAt[i] = head(i, 0)
        if i == k and first and first ~= member then return false end
      end
    end
    if not headCost[k] then headAt[k] = math.huge end
    headCost[k] = cost
    limits(limit)
    return c.next(c.used, headCost, headAt, c.guarantee, c.ceiling, c.kept, limit - used) == k
  end

  -- Grant on release (c.load done): as floodgate_grant_heads, with a line per class and the
  -- head that goes next chosen by c.next each time, so a freed permit goes to a class below its
  -- guarantee before any borrower, then to borrowers by priority, and each class is served in
  -- arrival order. A head whose process went silent leaves the line and one nobody listens for
  -- is passed over, as there; granting stops when the head picked does not fit. Keeps c.used up
  -- to date (the caller writes it, floodgate_set_used). The caller has seen someone in line.
  -- Returns the messages sent and the permits now used.
  function c.grant(used, limit, now, claimMs, epoch, channel, listeners, own)
    local sent = {}
    limits(limit)
    local heads, headCost, headAt, passed, hears = {}, {}, {}, {}, {}
    for i = 1, c.n do
      passed[i] = 0
      heads[i], headCost[i], headAt[i] = head(i, 0)
    end
    local n = 0
    for _ = 1, 256 do
      if n >= 64 then break end
      local k = c.next(c.used, headCost, headAt, c.guarantee, c.ceiling, c.kept, limit - used)
      if k == 0 then break end
      local state, to, alive = floodgate_reach(keys, heads[k], now, channel, listeners, own, hears)
      if state == 1 then
        passed[k] = passed[k] + 1
      elseif state == 2 then
        local message = floodgate_hand(keys, heads[k], now, claimMs, alive, epoch, to)
        if message then
          used = used + headCost[k]
          c.used[k] = c.used[k] + headCost[k]
          n = n + 1
          sent[n] = message
        end
      end
      heads[k], headCost[k], headAt[k] = head(k, passed[k])
    end
    return sent, used
  end

  -- Ask borrowed leases back (reclaim "signal"; c.load done, c.used up to date): the twin of
  -- `reclaimPlan` in src/algorithms/classes.ts. The owed classes that wait want what their
  -- guarantee lacks, up to what their calls in line cost; what is free and what was asked back
  -- already (meta field `rc`: the members asked, those still held) cover part of it; the rest is
  -- asked of borrowers, lowest priority first (the later class on a tie), each at most what it
  -- borrows beyond what it was asked, its leases ending last first. Each lease asked is told on
  -- its process's channel as "reclaim|<member>".
  function c.reclaim(meta, used, limit, channel)
    limits(limit)
    local asked, still = {}, {}
    for i = 1, c.n do asked[i] = 0 end
    for member in string.gmatch(c.asked or '', '[^ ]+') do
      if redis.call('ZSCORE', keys[1], member) then
        local k = floodgate_class(member) + 1
        asked[k] = asked[k] + floodgate_cost(member)
        still[#still + 1] = member
      end
    end
    local short, wanted = used - limit, false
    for i = 1, c.n do
      short = short - asked[i]
      local lack = c.guarantee[i] - c.used[i]
      if lack > 0 then
        local inLine, offset = 0, 0
        while inLine < lack do
          local member, cost = head(i, offset)
          if not member then break end
          inLine = inLine + cost
          offset = offset + 1
        end
        short = short + math.min(lack, inLine)
        wanted = wanted or inLine > 0
      end
    end
    -- Those asked already are told again while an owed class still waits: a holder that was not
    -- listening yet (its first lease), or whose message was lost, hears it on the next ask.
    if wanted then
      for _, member in ipairs(still) do
        local token = floodgate_token(member)
        redis.call('PUBLISH', token and (channel .. ':' .. token) or channel, 'reclaim|' .. member)
      end
    end
    if short > 0 then
      local order = {}
      for i = 1, c.n do order[i] = i end
      table.sort(order, function(a, b)
        if priority[a] ~= priority[b] then return priority[a] < priority[b] end
        return a > b
      end)
      local want = {}
      for _, j in ipairs(order) do
        local borrowed = c.used[j] - c.guarantee[j] - asked[j]
        want[j] = 0
        if borrowed > 0 and short > 0 then
          want[j] = math.min(borrowed, short)
          short = short - want[j]
        end
      end
      -- Leases by their end, then by their number within a process (the later taken last).
      local r = redis.call('ZRANGE', keys[1], 0, -1, 'WITHSCORES')
      local held = {}
      for x = 1, #r, 2 do
        held[#held + 1] = { member = r[x], ends = tonumber(r[x + 1]),
          n = tonumber(string.match(r[x], '%-(%d+)[~:]')) or 0 }
      end
      table.sort(held, function(a, b)
        if a.ends ~= b.ends then return a.ends < b.ends end
        return a.n < b.n
      end)
      for x = #held, 1, -1 do
        local member = held[x].member
        local k = floodgate_class(member) + 1
        if (want[k] or 0) > 0 and not string.find(' ' .. (c.asked or '') .. ' ', ' ' .. member .. ' ', 1, true) then
          want[k] = want[k] - floodgate_cost(member)
          still[#still + 1] = member
          local token = floodgate_token(member)
          redis.call('PUBLISH', token and (channel .. ':' .. token) or channel, 'reclaim|' .. member)
        end
      end
    end
    local joined = table.concat(still, ' ')
    if joined ~= (c.asked or '') then
      if joined == '' then redis.call('HDEL', meta, 'rc') else redis.call('HSET', meta, 'rc', joined) end
      c.asked = joined
    end
  end

  return c
end

-- The wake channel of the fused gate whose script runs a stage's script as its step (lua/gate.lua
-- sets it), or '' when the stage's script runs alone.
local floodgate_by = ''

-- What a release through that gate says when it frees permits another gate waits for: "<wake
-- channel>|<token>", the token naming the gate in the process that sent the call (lua/gate.lua).
local floodgate_said = ''

-- The time that gate decides by (lua/gate.lua sets it), ms.
local floodgate_clock = nil

-- The stages whose freed permits this script call has dealt with already, by wake channel.
local floodgate_told = nil

-- Permits were freed at the stage whose grants go on `channel`: say so on `channel`:freed, where
-- the process of a fused gate's first waiter listens, since only a release through a gate decides
-- that gate's permit line. Said by the stage's own script run alone (a caller of the stage itself,
-- a lease or place in line given back), as ''; and by a release through a gate, as who it was
-- (floodgate_said), only while another gate has callers waiting for this stage's permits (its wake
-- channel in `channel`:gates, put there by lua/gate.lua): a release through a gate decides its own
-- line. Not on a cluster (`listeners` ""), where no gate is fused and a message would go to every
-- node.
local function floodgate_freed(channel, listeners)
  if listeners ~= '1' then return end
  if floodgate_by == '' then
    redis.call('PUBLISH', channel .. ':freed', '')
    return
  end
  -- (Once per stage and script call: what the set says does not change within it.)
  floodgate_told = floodgate_told or {}
  if floodgate_told[channel] then return end
  floodgate_told[channel] = true
  local gates = channel .. ':gates'
  local waiting = redis.call('ZRANGE', gates, 0, -1, 'WITHSCORES')
  for i = 1, #waiting, 2 do
    local gate = waiting[i]
    if gate ~= floodgate_by then
      -- (One whose callers stopped waiting goes.)
      if tonumber(waiting[i + 1]) > floodgate_clock() then
        redis.call('PUBLISH', channel .. ':freed', floodgate_said)
        return
      end
      redis.call('ZREM', gates, gate)
    end
  end
end
