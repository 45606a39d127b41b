-- gate-first: the first pass of a gate call (lua/gate.lua), put in front of everything else of it
-- (src/redis/scripts.ts): the one admission, or the one release, that nothing stands in the way
-- of, decided before the rest of the script is made. Lua makes every function and table of a
-- script call as it runs it, and the rest of the gate is large: a call decided here pays for none
-- of it. A call this pass does not decide goes on to the rest, with nothing written: every check
-- comes before the first write.
--
-- KEYS and ARGV are the gate call's, as lua/gate.lua lists them; this pass reads:
-- KEYS[1] line   the gate's permit line
-- KEYS[2] lexp, KEYS[3] gmeta, KEYS[4] held, KEYS[5] hexp: the gate's other keys (lua/gate.lua),
--                for a release handed to the first waiter and a try put in line behind it
-- KEYS[6] lane, KEYS[7] its expiries: the call's lane, for an admission put at its back or taken
--                out of it as its first; then (KEYS[8…]) the call's steps' own keys in order
--
-- ARGV[1] now    ms, or "" for the server's TIME
-- ARGV[2] op     "all" (admissions) or "each" (releases) are decided here; any other goes on
-- ARGV[3]        (waiterTtlMs: not read here)
-- ARGV[4] channel base of the gate's wake channels ("" sends the call on)
-- ARGV[5] calls  the number of calls: one is decided here; for admissions, up to 64 as below
-- ARGV[6] call   the call, a JSON list: its member, mode, try, earlier try kept, number of steps
--                and per step its script name, number of keys, number of arguments and the
--                arguments but the first
-- ARGV[7…]       (admissions) the turn's other calls, each one that repeats the call before it:
--                its member, mode, try, earlier try kept, "*", then its steps' own arguments; or,
--                from the second on, its name alone (floodgate_call)
--
-- An admission (op "all", one call) is decided here when its process holds no grant of an earlier
-- try, every step is a semaphore's or AIMD limiter's acquire (without classes, not asking again
-- for a grant), a token bucket's take or an interval gate's take, no two on one key, and nobody
-- waits in the gate's permit line, in the call's lane or in any of its permit stages' own lines.
-- It is then decided exactly as fast() in lua/gate.lua decides a lone call: each step looked at
-- first (a permit stage open and with room, the caller's fence not ahead of the stage's, the
-- tokens there now, the host's slot come), then all taken; it answers as fast() does, {1, flat}.
-- Any step that would refuse sends the call on to the rest, which decides it as before. Its
-- first try while someone else is first in the gate's permit line (and nobody in its lane) is
-- not looked at: it takes its place at the back of the permit line here (first_join, below);
-- and so, while nobody is in the permit line, its first try while someone else is first in its
-- lane takes its place at the back of the lane (first_lane, below).
--
-- A turn of admissions (up to 64 calls, on Redis 7.0 or later: see ZMSCORE below) is decided here
-- the same way when every call after the first repeats the one before it (the same lane, steps
-- and keys, with arguments of its own only: lua/gate.lua, ARGV[5]) and none holds a grant or asks
-- again for one: each stage's state read once, the calls looked at in turn as fast() looks at
-- them (each on what the ones before it took), then, when every call admits and none of their
-- leases is there already, all of it written once, each stage's leases in one ZADD. It answers
-- as fast() does, {1, …, 1, flat}. A call that would be refused sends the whole turn on to the
-- rest, with nothing written; the rest decides the calls before it as this pass would have. A
-- turn of first tries that all wait, while someone else is first in the permit line and nobody
-- in their lane, is not looked at: its calls take their places at the line's back here, in turn
-- (first_join, below).
--
-- A release (op "each", one call) is run here when every step gives back leases of a semaphore
-- or an AIMD limiter without classes (one, or a turn's as one step: every one a lease, "lease",
-- for a semaphore), nobody waits in those stages' own lines, and (where Redis counts listeners)
-- no other gate waits at those stages (`<stage's channel>:gates` holds this gate's own wake
-- channel at most, which a release through this gate passes over). With nobody in the gate's
-- permit line, each step then does what its script does with nobody in line, for one lease or
-- for a turn's (lua/semaphore-release.lua, lua/aimd-release.lua), and the call answers as each()
-- does. With callers in the permit line, a release of one lease a stage hands its permits to the
-- first of them here when the rest would admit it and stop there (first_handoff, below).
--
-- The calls as this pass decoded them (tables, read only, by their number), for the rest to take
-- as they are instead of decoding them again; nil when this pass decoded none.
local gate_first_calls = nil

-- Whether `member` of the gate's permit line asks still: its expiry (lexp, KEYS[2]) not passed
-- by `now` (prune() in lua/gate.lua). Returns that expiry when it does, else nil.
local function first_asks(member, now)
  local ends = tonumber(redis.call('ZSCORE', KEYS[2], member))
  if ends and ends > now then return ends end
  return nil
end

-- The wake channel of `member`'s process when that process listens on it, else nil (decide() in
-- lua/gate.lua passes over a waiter nobody listens for).
local function first_listens(member)
  local token = floodgate_token(member)
  local to = token and ARGV[4] .. ':' .. token
  if to and redis.call('PUBSUB', 'NUMSUB', to)[2] > 0 then return to end
  return nil
end

-- A permit stage's count as its meta says (the fields floodgate_open() reads), and the fields
-- to write back (`write`).
local function first_stage(meta, write)
  local v = redis.call('HMGET', meta, 'used', 'limit', 'epoch', 'seq', 'quarantine')
  return { used = tonumber(v[1]) or 0, limit = v[2], epoch = tonumber(v[3]) or 0,
    seq = tonumber(v[4]) or 0, quarantine = tonumber(v[5]) or 0, write = write }
end

-- An admission's first try (op "all", mode "hold" or "wait", no grant held), or a turn's first
-- tries (each a repeat of the call before it), while someone else is first in the gate's permit
-- line, asking still, and nobody waits in the calls' lane: nothing is looked at, and each call
-- takes its place at the back of the permit line in turn, as admit() in lua/gate.lua puts it
-- there (behind() and join()): numbered, its expiry set, the gate's wake channel put at each of
-- its permit stages, its steps kept ("hold": a repeat's are the first call's with its own
-- arguments, as lua/gate.lua builds them). The calls share one instant, so what the rest sets once
-- per call with the same value (an expiry, the wake channel's place) is set once here. Every read
-- comes before the first write: when any of it does not hold, nothing is written and the calls
-- go on to the rest. Returns the reply of the script call, or nil; and true when nobody is in the
-- permit line. (The caller has seen that every call is a first try that waits, by a member.) The
-- first call, when it is right behind the head, is told when the head's place ends, as the rest
-- tells it (`ahead`, in lua/gate.lua).
local function first_join(f, n, names, keyAt, argAt, argsOf, now, turn)
  local line, lexp, gmeta = KEYS[1], KEYS[2], KEYS[3]
  local firsts = redis.call('ZRANGE', line, 0, 1)
  local head = firsts[1]
  if not head then return nil, true end
  local members, seen = {}, {}
  for c = 1, turn do
    local m = gate_first_calls[c][1]
    if m == head or seen[m] then return nil end
    seen[m] = true
    members[c] = m
  end
  -- (Its expiry is kept for the reply below.)
  local headEnds = first_asks(head, now)
  if not headEnds then return nil end
  -- (The calls' lane, and its expiries: the first of their keys, after the gate's five.)
  local laneAt = 6
  if redis.call('ZRANGE', KEYS[laneAt], 0, 0)[1] then return nil end
  if turn == 1 then
    if redis.call('ZSCORE', line, members[1]) then return nil end
  else
    local had = redis.call('ZMSCORE', line, unpack(members))
    for c = 1, turn do if had[c] then return nil end end
  end
  local ttl = tonumber(ARGV[3])
  local ends = now + ttl
  -- Numbered in turn: the numbers the rest would give one call after another. (Numbers go as
  -- text: Redis would write each one out with a far slower format.)
  local last = redis.call('HINCRBY', gmeta, 'seq', turn)
  local places, expiries = {}, {}
  local endsText = floodgate_num(ends)
  for c = 1, turn do
    places[2 * c - 1], places[2 * c] = floodgate_num(last - turn + c), members[c]
    expiries[2 * c - 1], expiries[2 * c] = endsText, members[c]
  end
  redis.call('ZADD', line, unpack(places))
  redis.call('ZADD', lexp, unpack(expiries))
  redis.call('PEXPIRE', line, ttl)
  redis.call('PEXPIRE', lexp, ttl)
  redis.call('PEXPIRE', gmeta, ttl)
  -- The first call's steps as the rest reads them (a step's keys, and its arguments with this
  -- call's `now`); a repeat's, those with its own arguments in their places (floodgate_own).
  local at = floodgate_num(now)
  local steps, replies = {}, {}
  for i = 1, n do
    local g = argAt[i]
    local args = { at, unpack(f, g + 2, g + argsOf[i]) }
    steps[i] = { names[i], { unpack(KEYS, keyAt[i], keyAt[i] + tonumber(f[g]) - 1) }, args }
    replies[i] = false
    if names[i] == 'semaphore-acquire' then
      local gates = args[7] .. ':gates'
      redis.call('ZADD', gates, ends, ARGV[4])
      redis.call('PEXPIRE', gates, ttl)
    end
  end
  local kept = {}
  local own = turn > 1 and floodgate_own()
  for c = 1, turn do
    local v = gate_first_calls[c]
    if v[2] == 'hold' then
      local mine = steps
      if c > 1 then
        mine = {}
        local from = 6
        for i = 1, n do
          local args = { unpack(steps[i][3]) }
          for x, j in ipairs(own[names[i]]) do args[j] = v[from + x - 1] end
          from = from + #own[names[i]]
          mine[i] = { names[i], steps[i][2], args }
        end
      end
      kept[#kept + 1] = 's:' .. v[1]
      kept[#kept + 1] = cjson.encode({ v[3], KEYS[laneAt], KEYS[laneAt + 1], mine })
    end
  end
  if #kept > 0 then
    redis.call('HSET', KEYS[4], unpack(kept))
    redis.call('PEXPIRE', KEYS[4], ttl)
  end
  local g = redis.call('HMGET', gmeta, 'fr', 'fru', 'frk')
  local passed, key = floodgate_passed(g, now), g[3] or ''
  local out = {}
  for c = 1, turn do
    out[c] = { 0, -1, 1, 0, replies, gate_first_calls[c][2] == 'hold' and 1 or 0, now, passed, key }
  end
  -- The first call, right behind the head when the head was alone: when the head's place ends
  -- unless it asks again (as behind() in lua/gate.lua tells it).
  if not firsts[2] then out[1][10], out[1][11] = false, math.ceil(headEnds - now) end
  return out
end

-- A lone admission's first try (op "all", mode "hold" or "wait", no grant held) while nobody is
-- in the gate's permit line and someone else is first in the call's lane, asking still: nothing is
-- looked at, and the call takes its place at the back of its lane, as admit() in lua/gate.lua puts
-- it there (behind() and join()): numbered (its number kept should it be there already), its
-- expiry set. Every read comes before the first write. `n` is the number of steps, `now` the
-- call's time. Returns the reply of the script call, or nil. (The caller has seen the call is
-- a first try that waits, by a member, and first_join() that nobody is in the permit line.)
local function first_lane(f, n, now)
  local member = f[1]
  -- (The call's lane and its expiries: the first of its keys, after the gate's five.)
  local lane, laneExp = KEYS[6], KEYS[7]
  local head = redis.call('ZRANGE', lane, 0, 0)[1]
  if not head or head == member then return nil end
  -- (A first whose expiry has passed, or is lost, is taken out by the rest: see prune().)
  local until_ = tonumber(redis.call('ZSCORE', laneExp, head))
  if not until_ or until_ <= now then return nil end
  local ttl = tonumber(ARGV[3])
  if not redis.call('ZSCORE', lane, member) then
    redis.call('ZADD', lane, redis.call('HINCRBY', KEYS[3], 'seq', 1), member)
  end
  redis.call('ZADD', laneExp, now + ttl, member)
  redis.call('PEXPIRE', lane, ttl)
  redis.call('PEXPIRE', laneExp, ttl)
  redis.call('PEXPIRE', KEYS[3], ttl)
  local replies = {}
  for i = 1, n do replies[i] = false end
  local reply = { 0, -1, 2, 0, replies, 0, now }
  -- Right behind the first: when its place ends unless it asks again (as behind() in
  -- lua/gate.lua tells it; the fields before it false).
  if redis.call('ZRANGE', lane, 1, 1)[1] == member then
    reply[8], reply[9], reply[10], reply[11] = false, false, false, math.ceil(until_ - now)
  end
  return { reply }
end

-- A lone admission's later try (op "all", mode "hold" or "wait", no grant held, asking again)
-- that is first in its lane, asking still, while nobody is in the gate's permit line or in its
-- permit stages' own lines (`probe` less the lane), and that the permit line did not take with
-- its lane (no `j:` record: see admit() in lua/gate.lua). Returns the next in the lane (false
-- when nobody is next), or nil when any of that does not hold, or the next's expiry has passed or
-- is lost (the rest takes such a waiter out). Only reads; `now` is the call's time. (The caller
-- has seen the call is a later try that waits, by a member.)
local function first_lane_head(f, probe, now)
  local member = f[1]
  local others = { probe[1] }
  for i = 3, #probe do others[#others + 1] = probe[i] end
  if redis.call('EXISTS', unpack(others)) ~= 0 then return nil end
  local lane, laneExp = KEYS[6], KEYS[7]
  local firsts = redis.call('ZRANGE', lane, 0, 1)
  if firsts[1] ~= member then return nil end
  local until_ = tonumber(redis.call('ZSCORE', laneExp, member))
  if not until_ or until_ <= now then return nil end
  local next = firsts[2]
  if next then
    local ends = tonumber(redis.call('ZSCORE', laneExp, next))
    if not ends or ends <= now then return nil end
  end
  if redis.call('HEXISTS', KEYS[4], 'j:' .. member) == 1 then return nil end
  return next or false
end

-- The lane's first that first_lane_head() let through, admitted (its steps' figures in `flat`,
-- as the pass below writes them): it leaves its lane and the next there (`next`, or false) is
-- told to ask, on its process's channel unless it is this call's (leave() and wake() in
-- lua/gate.lua); the call answers as admit() does, each step's reply as its script gives it.
local function first_lane_leave(f, names, flat, next, now)
  local member = f[1]
  redis.call('ZREM', KEYS[6], member)
  redis.call('ZREM', KEYS[7], member)
  local woken = 0
  if next then
    local token = floodgate_token(next)
    if token ~= floodgate_token(member) then redis.call('PUBLISH', ARGV[4] .. ':' .. token, next) end
    woken = { next }
  end
  return { { 1, -1, 0, woken, floodgate_admitted(names, flat, now), 0, now } }
end

-- A lone release (op "each") through the gate while callers wait in its permit line, decided here
-- as the rest would decide it (each(), then grantHeads() and decide() in lua/gate.lua) when nothing
-- else is in the way: each step gives back one lease there (a semaphore's or an AIMD limiter's,
-- without classes) at a stage nobody waits at but this gate's callers; the first in the permit
-- line asks still (its expiry not passed), its steps are kept and its process listens; its lane
-- is empty; and every kept step admits it at this instant as fast() would: a permit stage's (its
-- lease from the claim window) open, with room once the leases are given back, its own line
-- empty and the lease new; a bucket's tokens there now; the host's slot come. The first is then
-- admitted and told (its grant recorded and published), and the permit line stops there: either
-- nobody is next, or the next (asking still, its steps kept, its process listening) needs a permit
-- stage the grant left with no permit free and no lease there ended. Every read comes before the
-- first write: when any of it does not hold, nothing is written and the call goes on to the rest.
-- Returns the reply of the script call, or nil; and true when nobody waits in the permit line.
local function first_handoff(f, n, names, keyAt, argAt, argsOf, queues)
  local line, lexp, held, hexp = KEYS[1], KEYS[2], KEYS[4], KEYS[5]
  -- The first in the permit line, and the one after it.
  local firsts = redis.call('ZRANGE', line, 0, 1)
  local head, second = firsts[1], firsts[2]
  if not head then return nil, true end
  local now = floodgate_now(ARGV[1])
  -- Each permit stage's count as the releases leave it (by its meta key), their replies, and the
  -- lease each gives back (by its holders' key).
  local stages, replies, gone = {}, {}, {}
  for i = 1, n do
    local g, key, meta = argAt[i], KEYS[keyAt[i]], KEYS[keyAt[i] + 3]
    local sem = names[i] == 'semaphore-release'
    local member = f[g + 2]
    if argsOf[i] ~= (sem and 8 or 13) or stages[meta] or not redis.call('ZSCORE', key, member) then
      return nil
    end
    local st = first_stage(meta, { 'used' })
    local cost = floodgate_cost(member)
    if sem then
      st.used = math.max(0, st.used - cost)
      replies[i] = { 1, 0, st.used, {} }
    else
      local maxLimit = tonumber(f[g + 7])
      local limit = tonumber(st.limit) or tonumber(f[g + 12]) or maxLimit
      limit, st.epoch = floodgate_aimd_moved(limit, st.epoch, st.used, f[g + 4], tonumber(f[g + 5]),
        f[g + 9] == '1', tonumber(f[g + 6]), maxLimit, tonumber(f[g + 8]))
      st.limit = limit
      st.used = math.max(0, st.used - cost)
      st.write = { 'used', 'limit', 'epoch' }
      replies[i] = { 1, limit, st.epoch, st.used, {} }
    end
    stages[meta] = st
    gone[key] = member
  end
  if not first_asks(head, now) then return nil end
  local kept = redis.call('HGET', held, 's:' .. head)
  local to = kept and first_listens(head)
  if not to then return nil end
  local h = cjson.decode(kept)
  if redis.call('EXISTS', h[2]) == 1 then return nil end
  -- Its kept steps at this instant (as decide() gives them to fast()), each looked at on the
  -- state the releases leave.
  local at = floodgate_num(now)
  -- (The releases' stages' own lines, seen empty by the caller: not looked at again.)
  local empty = {}
  for x = 1, #queues do empty[queues[x]] = true end
  -- (`permits`: each permit step's holders, and its stage's count and limit once it is taken.)
  local steps, grants, adds, buckets, hosts, permits = h[4], {}, {}, {}, {}, {}
  for i = 1, #steps do
    local name, keys, args = steps[i][1], steps[i][2], steps[i][3]
    args[1] = at
    for j = 1, i - 1 do
      if steps[j][2][1] == keys[1] then return nil end
    end
    if name == 'semaphore-acquire' then
      -- (A lease of the claim window, its fence left out: see decide().)
      if tonumber(args[13]) < tonumber(args[4]) then args[4] = args[13] end
      args[9] = '0'
      if #args ~= 14 or args[14] ~= '' or args[10] == '1' then return nil end
      if (not empty[keys[2]] and redis.call('EXISTS', keys[2]) == 1) or redis.call('ZSCORE', keys[1], args[2]) then
        return nil
      end
      local st = stages[keys[4]]
      if not st then
        st = first_stage(keys[4], {})
        stages[keys[4]] = st
      end
      -- (Open as floodgate_open() says: its limit known, no quarantine on.)
      local limit = tonumber(args[3]) or tonumber(st.limit)
      local cost = floodgate_cost(args[2])
      if not limit or st.quarantine > now or st.used + cost > limit then return nil end
      st.used, st.seq = st.used + cost, st.seq + 1
      st.took = true
      local ends = now + tonumber(args[4])
      adds[#adds + 1] = { keys[1], ends, args[2] }
      grants[i] = { 1, st.seq, st.used, limit, args[3] == '' and st.epoch or 0, 0, 0, 'grant', '', ends }
      permits[#permits + 1] = { keys[1], st.used, limit }
    elseif name == 'token-bucket-take' then
      local s = floodgate_bucket(keys[1], tonumber(args[6]), now)
      if s.updatedAt > now then return nil end
      local tokens = s.updatedAt == now and s.tokens
        or floodgate_tokens_at(s, tonumber(args[2]), tonumber(args[3]), tonumber(args[4]), now)
      local cost = tonumber(args[5])
      if not cost or tokens + 1e-9 < cost then return nil end
      s.tokens, s.updatedAt = math.max(0, tokens - cost), now
      buckets[#buckets + 1] = { keys[1], s, args }
      grants[i] = { 1, 0 }
    elseif name == 'interval-gate-take' then
      local previous = redis.call('HGET', keys[1], 'nextAt') or ''
      if (tonumber(previous) or now) > now then return nil end
      local claimed = floodgate_num(now + tonumber(args[2]))
      hosts[#hosts + 1] = { keys[1], claimed, tonumber(args[2]) }
      grants[i] = { 1, previous, claimed }
    else
      return nil
    end
  end
  -- The permit stages the grant leaves with no permit free and no lease there ended (but those
  -- given back here), and the one after it: it must need one of them.
  local full = {}
  for _, p in ipairs(permits) do
    local holders, used, limit = p[1], p[2], p[3]
    if used >= limit then
      local left = false
      for _, m in ipairs(redis.call('ZRANGEBYSCORE', holders, '-inf', now, 'LIMIT', 0, 2)) do
        if m ~= gone[holders] then left = true end
      end
      if not left then full[holders] = true end
    end
  end
  if second then
    if not first_asks(second, now) then return nil end
    local kept2 = redis.call('HGET', held, 's:' .. second)
    if not kept2 or not first_listens(second) then return nil end
    -- (Its kept steps searched as cjson wrote them, not decoded: a permit step is its script's
    -- name, then its keys, the stage's holders first. Inside a string of the record every quote
    -- is escaped, so the search matches a step and nothing else.)
    local waits = false
    for holders in pairs(full) do
      if string.find(kept2, '["semaphore-acquire",[' .. cjson.encode(holders), 1, true) then
        waits = true
        break
      end
    end
    if not waits then return nil end
  end
  -- All of it holds: written.
  for key, member in pairs(gone) do redis.call('ZREM', key, member) end
  for x = 1, #adds do redis.call('ZADD', adds[x][1], adds[x][2], adds[x][3]) end
  for meta, st in pairs(stages) do
    local fields = {}
    for x = 1, #st.write do
      local name = st.write[x]
      fields[#fields + 1] = name
      fields[#fields + 1] = st[name]
    end
    if st.took then
      if #st.write == 0 then
        fields[1], fields[2] = 'used', st.used
      end
      fields[#fields + 1] = 'seq'
      fields[#fields + 1] = st.seq
    end
    redis.call('HSET', meta, unpack(fields))
  end
  for x = 1, #buckets do
    local key, s, args = buckets[x][1], buckets[x][2], buckets[x][3]
    floodgate_save_bucket(key, s, tonumber(args[2]), tonumber(args[3]), tonumber(args[4]), args[7], now)
  end
  for x = 1, #hosts do floodgate_hold_slot(hosts[x][1], hosts[x][2], hosts[x][3]) end
  redis.call('ZREM', line, head)
  redis.call('ZREM', lexp, head)
  for _, m in ipairs(floodgate_expired(hexp, now)) do redis.call('HDEL', held, 'g:' .. m, 's:' .. m, 'p:' .. m) end
  local g = redis.call('HMGET', KEYS[3], 'fr', 'fru', 'frk')
  grants[#steps + 1] = { floodgate_passed(g, now), g[3] or '' }
  local record = h[1] .. '|' .. floodgate_encode(grants)
  local ttl = tonumber(ARGV[3])
  redis.call('HSET', held, 'g:' .. head, record)
  redis.call('ZADD', hexp, now + ttl, head)
  redis.call('PEXPIRE', held, ttl)
  redis.call('PEXPIRE', hexp, ttl)
  local message = 'g|' .. head .. '|' .. record
  redis.call('PUBLISH', to, message)
  return { { 1, -1, 0, { message }, replies } }
end
do
  local op = ARGV[2]
  local turn = op == 'all' and tonumber(ARGV[5]) or 1
  if (ARGV[5] == '1' and (op == 'all' or op == 'each') or turn > 1 and turn <= 64
      and (redis.REDIS_VERSION_NUM or 0) >= 0x060200) and ARGV[4] ~= '' then
    local decoded, f = pcall(cjson.decode, ARGV[6])
    if decoded and type(f) == 'table' then gate_first_calls = { f } end
    local n = decoded and type(f) == 'table' and f[4] == '' and tonumber(f[5])
    if n and n >= 1 and n <= 64 then
      -- The steps: each one's script name, its first key's place in KEYS, and where its
      -- arguments start (argument j of a step at `g` is f[g + j]; its first, `now`, is not sent).
      local names, keyAt, argAt, argsOf = {}, {}, {}, {}
      local probe = { KEYS[1] }
      -- (A release's stages' own lines, and where other gates wait at them: see below.)
      local queues, gates = {}, {}
      -- (The call's lane is the first of its keys, after the gate's five; its steps' keys follow
      -- the lane's two.)
      local lane = 6
      local a, k = 6, lane + 2
      if op == 'all' then probe[2] = KEYS[lane] end
      for i = 1, n do
        local name, nk, na = f[a], tonumber(f[a + 1]), tonumber(f[a + 2])
        if not nk or not na or nk < 1 or KEYS[k + nk - 1] == nil then n = nil break end
        local g = a + 1
        if op == 'all' then
          if name == 'semaphore-acquire' then
            -- (Arguments 10 and 14: asking again for a grant; the stage's classes.)
            if na ~= 14 or f[g + 10] == '1' or f[g + 14] ~= '' then n = nil break end
            probe[#probe + 1] = KEYS[k + 1]
          elseif name ~= 'token-bucket-take' and name ~= 'interval-gate-take' then
            n = nil break
          end
        elseif name == 'semaphore-release' then
          -- (Argument 8: the stage's classes; 4 its channel, 7 whether listeners are counted.)
          -- (A turn's releases of the stage's leases: each other's member and what it gives back,
          -- from argument 9, every one a lease.)
          if na < 8 or (na - 8) % 2 ~= 0 or f[g + 8] ~= '' then n = nil break end
          for x = 10, na, 2 do
            if f[g + x] ~= 'lease' or f[g + 5] ~= 'lease' then n = nil end
          end
          if not n then break end
          probe[#probe + 1] = KEYS[k + 1]
          queues[#queues + 1] = KEYS[k + 1]
          if f[g + 7] == '1' then
            probe[#probe + 1] = f[g + 4] .. ':gates'
            gates[#gates + 1] = probe[#probe]
          end
        elseif name == 'aimd-release' then
          -- (Argument 13: the stage's classes; 3 its channel, 11 whether listeners are counted.)
          -- (A turn's releases of the stage's leases: each other's member, outcome, epoch and slow
          -- flag, from argument 14.)
          if na < 13 or (na - 13) % 4 ~= 0 or f[g + 13] ~= '' then n = nil break end
          probe[#probe + 1] = KEYS[k + 1]
          queues[#queues + 1] = KEYS[k + 1]
          if f[g + 11] == '1' then
            probe[#probe + 1] = f[g + 3] .. ':gates'
            gates[#gates + 1] = probe[#probe]
          end
        else
          n = nil break
        end
        for j = 1, i - 1 do
          if KEYS[keyAt[j]] == KEYS[k] then n = nil end
        end
        if not n then break end
        names[i], keyAt[i], argAt[i], argsOf[i] = name, k, g, na
        k = k + nk
        a = a + 2 + na
      end
      -- The turn's other calls: each a repeat, with its own arguments (a permit's member, fence
      -- and "again"; a bucket's cost, grant and one more; a host's spacing) after its first five.
      if n and turn > 1 then
        local want = 5
        for i = 1, n do want = want + (names[i] == 'interval-gate-take' and 1 or 3) end
        for c = 2, turn do
          -- (A call that came as its name alone renames the repeat before it: from the third.)
          local ok, g = pcall(floodgate_call, ARGV[5 + c], c > 2 and gate_first_calls[c - 1] or nil)
          if not ok or type(g) ~= 'table' then n = nil break end
          gate_first_calls[c] = g
          if g[5] ~= '*' or g[4] ~= '' or #g ~= want then n = nil break end
        end
      end
      local clear = n and redis.call('EXISTS', unpack(probe)) == 0
      -- A release the probe stopped, when nobody waits in its stages' own lines and no other
      -- gate at them (this gate's own callers put its wake channel, ARGV[4], in their `:gates`,
      -- which a release through this gate passes over): with nobody in the permit line either,
      -- it is given back here as above; with callers there, its permits are handed to the first
      -- of them here when that can be done (first_handoff); else it goes on to the rest.
      if n and not clear and op == 'each' and redis.call('EXISTS', unpack(queues)) == 0 then
        local others = false
        for x = 1, #gates do
          local waiting = redis.call('ZRANGE', gates[x], 0, -1)
          for y = 1, #waiting do
            if waiting[y] ~= ARGV[4] then others = true end
          end
        end
        if not others then
          local handed, nobody = first_handoff(f, n, names, keyAt, argAt, argsOf, queues)
          if handed then return handed end
          clear = nobody
        end
      end
      -- A lone admission's first try behind someone in the permit line, or (nobody there)
      -- behind someone in its lane: it takes its place. A later try, first in its lane: decided
      -- below as a call nothing stands in the way of, then taken out of its lane.
      -- (Each of those is a call that waits, by a member: checked here for them all. `now`, read
      -- once for them, is the decision's below.)
      local laneNext, now = nil, nil
      -- (Every call waits, by a member, asking for the first time or again; `firsts`: every one
      -- for the first time. A turn is looked at here only when all are first tries.)
      local waits, firsts = n and not clear and op == 'all', true
      for c = 1, waits and turn or 0 do
        local v = gate_first_calls[c]
        if v[1] == '' or (v[2] ~= 'hold' and v[2] ~= 'wait') or (tonumber(v[3]) or 0) < 1 then waits = false end
        if v[3] ~= '1' then firsts = false end
      end
      if waits and (firsts or turn == 1) then
        now = floodgate_now(ARGV[1])
        if firsts then
          local joined, open = first_join(f, n, names, keyAt, argAt, argsOf, now, turn)
          if joined then return joined end
          if open and turn == 1 then
            local laned = first_lane(f, n, now)
            if laned then return laned end
          end
        else
          laneNext = first_lane_head(f, probe, now)
          clear = laneNext ~= nil
        end
      end
      if clear then
        if op == 'all' then
          now = now or floodgate_now(ARGV[1])
          -- Each step's state, read once: a permit stage's (not open: nil), a bucket's (reserved
          -- past now: nil), a host's slot.
          local state = {}
          for i = 1, n do
            local key, g = KEYS[keyAt[i]], argAt[i]
            if names[i] == 'semaphore-acquire' then
              state[i] = floodgate_open(KEYS[keyAt[i] + 3], f[g + 3], now)
              if state[i] then state[i].adds, state[i].na = {}, 0 end
            elseif names[i] == 'token-bucket-take' then
              local s = floodgate_bucket(key, tonumber(f[g + 6]), now)
              if s.updatedAt <= now then state[i] = s end
            else
              local previous = redis.call('HGET', key, 'nextAt') or ''
              state[i] = { previous = previous, nextAt = tonumber(previous) }
            end
            if not state[i] then n = nil break end
          end
          -- Each call in turn, on what the ones before it took: a permit's room and fence, the
          -- tokens, the host's slot. (Call 1's own arguments are in its steps; a repeat's after
          -- its first five.)
          local flat, nf = {}, 0
          for c = 1, n and turn or 0 do
            local v = gate_first_calls[c]
            local at = 6
            for i = 1, n do
              local name, g = names[i], argAt[i]
              local a1, a2, a3
              if c == 1 then
                if name == 'semaphore-acquire' then a1, a2, a3 = f[g + 2], f[g + 9], f[g + 10]
                elseif name == 'token-bucket-take' then a1, a2 = f[g + 5], f[g + 7]
                else a1 = f[g + 2] end
              else
                a1, a2, a3 = v[at], v[at + 1], v[at + 2]
                at = at + (name == 'interval-gate-take' and 1 or 3)
              end
              if name == 'semaphore-acquire' then
                local p = state[i]
                local cost = floodgate_cost(a1)
                -- (A fence read once for the calls that bring the same.)
                if a2 ~= p.fenceText then p.fenceText, p.fence = a2, tonumber(a2) or 0 end
                if a3 == '1' or p.fence > p.seq or p.used + cost > p.limit then n = nil break end
                p.na = p.na + 1
                p.adds[p.na] = a1
                p.used = p.used + cost
                p.seq = p.seq + 1
                flat[nf + 1], flat[nf + 2], flat[nf + 3], flat[nf + 4] = p.seq, p.used, p.limit, p.epoch
                -- (Where a lone call's count goes, should its lease be there already: see below.)
                p.usedAt, p.cost = nf + 2, cost
                nf = nf + 4
              elseif name == 'token-bucket-take' then
                local s = state[i]
                local cost = tonumber(a1)
                if not cost then n = nil break end
                -- (Taken from already at this instant: no refill since.)
                local tokens = s.updatedAt == now and s.tokens
                  or floodgate_tokens_at(s, tonumber(f[g + 2]), tonumber(f[g + 3]), tonumber(f[g + 4]), now)
                if tokens + 1e-9 < cost then n = nil break end
                local left = tokens - cost
                s.tokens = left > 0 and left or 0
                s.updatedAt = now
                s.grant = a2
              else
                local h = state[i]
                if h.nextAt and h.nextAt > now then n = nil break end
                -- (A call spaced as the one before it at this instant claims what that one did: its
                -- slot, worked out once.)
                local claimed, slot
                if a1 == h.spacing then
                  claimed, slot = h.previous, h.nextAt
                else
                  slot = now + tonumber(a1)
                  claimed = floodgate_num(slot)
                end
                flat[nf + 1], flat[nf + 2] = h.previous, claimed
                nf = nf + 2
                h.previous, h.nextAt, h.spacing = claimed, slot, a1
              end
            end
            if not n then break end
          end
          -- A turn's leases all new (none there already, none twice), looked at before anything is
          -- written. (A lone call's lease goes in alone below: one there already is not counted
          -- again, as its stage's script would not count it.)
          for i = 1, turn > 1 and n or 0 do
            if names[i] == 'semaphore-acquire' then
              local adds, seen = state[i].adds, {}
              for x = 1, #adds do
                if seen[adds[x]] then n = nil break end
                seen[adds[x]] = true
              end
              if not n then break end
              local had = redis.call('ZMSCORE', KEYS[keyAt[i]], unpack(adds))
              for x = 1, #adds do if had[x] then n = nil break end end
              if not n then break end
            end
          end
          if n then
            -- All admitted: each stage written once, its leases in one command.
            for i = 1, n do
              local name, key, g = names[i], KEYS[keyAt[i]], argAt[i]
              if name == 'semaphore-acquire' then
                local p = state[i]
                -- (As text once: Redis would write a number out for each lease.)
                local expiry = floodgate_num(now + tonumber(f[g + 4]))
                if turn == 1 then
                  if redis.call('ZADD', key, expiry, p.adds[1]) == 0 then
                    p.used = p.used - p.cost
                    flat[p.usedAt] = p.used
                  end
                else
                  local zadd = {}
                  for x = 1, #p.adds do zadd[2 * x - 1], zadd[2 * x] = expiry, p.adds[x] end
                  redis.call('ZADD', key, unpack(zadd))
                end
                floodgate_set_used(KEYS[keyAt[i] + 3], p.used, nil, p.seq)
              elseif name == 'token-bucket-take' then
                local s = state[i]
                floodgate_save_bucket(key, s, tonumber(f[g + 2]), tonumber(f[g + 3]), tonumber(f[g + 4]),
                  s.grant, now)
              else
                local h = state[i]
                floodgate_hold_slot(key, h.previous, tonumber(h.spacing))
              end
            end
            flat[nf + 1] = now
            if laneNext ~= nil then return first_lane_leave(f, names, flat, laneNext, now) end
            local out = {}
            for c = 1, turn do out[c] = 1 end
            out[turn + 1] = flat
            return out
          end
        else
          -- Each lease given back as its script gives it back alone, nobody being in line; a
          -- turn's leases of one stage as its script gives back a turn's, with one write (its
          -- reply is then the list of theirs in short, as each() in lua/gate.lua answers it:
          -- nothing granted, nobody taken out of the stage's line).
          local replies = {}
          for i = 1, n do
            local key, g = KEYS[keyAt[i]], argAt[i]
            local member, meta = f[g + 2], KEYS[keyAt[i] + 3]
            if names[i] == 'semaphore-release' then
              -- (Each lease's reply says the permits used once the turn's are all given back.)
              local flags, freed = {}, 0
              local members = { member }
              for x = 9, argsOf[i], 2 do members[#members + 1] = f[g + x] end
              for x = 1, #members do
                local m = members[x]
                local released = redis.call('ZREM', key, m)
                if released == 1 then freed = freed + floodgate_cost(m) end
                flags[x] = released
              end
              local used
              if freed > 0 then
                used = floodgate_lower_used(meta, freed)
              else
                used = tonumber(redis.call('HGET', meta, 'used')) or 0
              end
              if #flags == 1 then replies[i] = { flags[1], 0, used, {} }
              else replies[i] = floodgate_short(flags, used) end
            else
              local s = redis.call('HMGET', meta, 'limit', 'epoch', 'used')
              local maxLimit = tonumber(f[g + 7])
              local limit = tonumber(s[1]) or tonumber(f[g + 12]) or maxLimit
              local epoch = tonumber(s[2]) or 0
              local used = tonumber(s[3]) or 0
              local minLimit, ratio = tonumber(f[g + 6]), tonumber(f[g + 8])
              -- (Each lease's reply says the limit, epoch and permits used once it is given back.)
              local flags = {}
              for b = g + 9, g + argsOf[i] - 4, 4 do
                local m, outcome, ticketEpoch, slow = member, f[g + 4], f[g + 5], f[g + 9]
                if b > g + 9 then m, outcome, ticketEpoch, slow = f[b + 1], f[b + 2], f[b + 3], f[b + 4] end
                local released = redis.call('ZREM', key, m)
                if released == 1 then
                  limit, epoch = floodgate_aimd_moved(limit, epoch, used, outcome, tonumber(ticketEpoch),
                    slow == '1', minLimit, maxLimit, ratio)
                  used = used - floodgate_cost(m)
                end
                if used < 0 then used = 0 end
                flags[#flags + 1] = released
              end
              redis.call('HSET', meta, 'used', used, 'limit', limit, 'epoch', epoch)
              if #flags == 1 then replies[i] = { flags[1], limit, epoch, used, {} }
              else replies[i] = floodgate_short(flags, limit, epoch, used) end
            end
          end
          return { { 1, -1, 0, 0, replies } }
        end
      end
    end
  end
end
