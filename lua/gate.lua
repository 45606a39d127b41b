-- gate: a whole Gate's admission, or release, in one call. Each step is one of the stage scripts
-- (step_<script>, its body run as a function of its own KEYS and ARGV, exactly as alone), and
-- every step decides at the same instant: the call's `now`.
--
-- KEYS[1] line  ZSET  member "<token>-<n>" -> arrival sequence: the gate's callers a permit stage
--                     refused, in arrival order across the fleet
-- KEYS[2] lexp  ZSET  member -> expiry (ms): a waiter not heard from for waiterTtlMs is dropped
-- KEYS[3] gmeta HASH  seq (arrivals, shared by the permit line and every lane); fr: the ms its
--                     firsts have kept their place in the permit line waiting for a rate, in
--                     all (see admit()), each ms once; fru: when the latest such wait ends; frk:
--                     the first key of the step it waits for
-- KEYS[4] held  HASH  "s:<member>" -> the steps of a waiter in the permit line (its latest try's,
--                     sent "hold"), so that a release can admit it; "g:<member>" -> "<try>|<replies>"
--                     once a release has (see grants, below); "p:<member>" -> its arrival
--                     sequence, when a release passed it over while its process did not listen
--                     (see decide(), below); "j:<member>" -> "<when>|<fr then>|<permit key>" once
--                     the permit line took it with its lane (see admit()), until its next try
-- KEYS[5] hexp  ZSET  member -> expiry (ms) of its grant record, or of its place kept once passed
--                     over: one not collected by then goes
-- KEYS[6…]            per call: its lane (ZSET member -> arrival sequence: the callers of the
--                     call's key and host that only token buckets or interval gates refused),
--                     the lane's expiries (ZSET, as lexp), then its steps' own keys in order;
--                     none for a call that repeats the one before it (see ARGV[5])
--
-- ARGV[1] now          ms, or "" for the server's TIME
-- ARGV[2] op           "all": admissions, each all or nothing; "each": releases, refunds and
--                      settles, each step run as it would alone; "leave": callers leave the lines;
--                      "grant": permits were freed outside the gate (a stage's own caller, another
--                      gate): the permit line's first is decided as on a release (one call, no steps)
-- ARGV[3] waiterTtlMs  how long a waiter stays in line without asking again, ms
-- ARGV[4] channel      base of the wake channels: a member is told "<member>" on channel:<token>
-- ARGV[5] calls        the number of calls; then one argument per call, a JSON list of strings (a
--                      client pays for each argument far more than for its length): its member (its
--                      place in line, "" for none), its mode ("wait": a refused caller keeps or
--                      takes its place in line; "hold": so does it, and its steps are kept while it
--                      waits in the permit line, for a release to run; "try": never), its try's
--                      number, the number of its earlier try whose steps were kept ("" for none),
--                      its number of steps and, per step, its script name, its number of keys, its
--                      number of arguments and the arguments (the first, its `now`, is replaced by
--                      this call's). A step with the script and the keys of an earlier step of this
--                      script call comes as "=", that step's number (steps are numbered from 1
--                      across the calls), the number of arguments that differ and, for each, its
--                      place and its value: a turn's calls, and a turn's releases, mostly differ in
--                      their members alone. A call whose steps are those of the call before it
--                      (the same scripts and keys, and the same arguments but its own: see OWN),
--                      in the same lane, comes as "*" for its number of steps, then its own
--                      arguments alone, and without its lane's keys (its steps are not numbered).
--                      A call that is the repeat before it with a name of its own wherever that
--                      one had its name (its member, and each own argument equal to that member:
--                      a fused call's leases and grant take its name) comes as that name alone, a
--                      string that is not a JSON list (floodgate_call).
--                      A step that differs from the earlier step it would repeat only in its own
--                      arguments may come as "~", that step's number and its own arguments (it is
--                      not numbered either). A turn's releases of one stage's leases may also come
--                      as one step, their own arguments one after another, as the release scripts
--                      take a turn's (its reply is then the list of theirs, or that list in
--                      short: see short(), below): the client sends releases so. Calls are
--                      decided in turn, exactly as if each had come alone.
--
-- Returns one reply per call, {status, waitMs, inLine, woken, replies, held}:
--   status  1: every step admitted (or, for "each", ran); 0: refused, nothing is held anywhere;
--           2: its earlier try's kept steps were admitted by a release (`held` is their replies,
--           as the grant message gave them) and this try's steps did not run
--   waitMs  when a token bucket or interval gate refused a caller first in its lane, or first
--           in the permit line (permits being there): ms until it could admit; else -1 (wait to
--           be woken)
--   inLine  1 when `member` waits in the permit line, 2 in its lane, 0 in neither
--   woken   the members told to ask again (their process may be this one), and the grant
--           messages of the waiters a release admitted (see grants, below); 0 for none
--   replies each step's reply, as its script would answer; a step rolled back answers as refused
--           but with -2 for its first field (a refusal of its own is 0); a step not run (someone
--           is ahead in line) answers false
--   held    1 when the call waits in the permit line with its steps kept (mode "hold"); else 0,
--           or the replies of status 2 (as a grant message gives them: one per step, then fr and
--           frk of gmeta when the grant was made)
--   now     (admissions) the time they decided at, server ms
--   rate    (admissions waiting in the permit line) fr of gmeta once the call was decided, as
--           far as it has passed (see passed(); but for a first's own wait for a rate, begun by
--           this call), and frk: the callers behind a first that waits for a rate wait for it too
--   moved   (admissions the permit line took with their lane since their latest try) "<when>|<fr
--           then>|<key>": the server ms it moved, fr at that moment, and the first key of the
--           permit stage that refused its lane's first; it waited for permits from then on
--   ahead   (admissions right behind the first of their line, which their steps did not run for)
--           ms until that first's place ends unless it asks again: the caller asks then, not at
--           its poll, should the first's process have frozen or died (fields before it that a
--           reply has not are false)
-- but for the leading admissions decided in one pass (see fast(), below): each answers 1, and one
-- more element follows the last call's reply: their steps' replies, flat, then that time.
--
-- All or nothing: the permit steps run first (all of them), then the metering steps (the interval
-- gates, then the token buckets), up to the first refusal (a permit refusal ends the try before
-- the rates: the call then waits to be told permits are free, whatever the rates say); if any
-- refused, those that admitted are rolled back in reverse, so nothing is held anywhere. A permit
-- step rolls back through its release; an interval gate's step puts back the slot it replaced
-- (its reply names it); a token bucket step is restored as it was (DUMP before, RESTORE after;
-- the last metering step needs no copy), so a refused admission leaves the buckets' keys exactly
-- as they were and the hosts' slots as they were. The decision is the one the stages would
-- make taken in turn at this instant with everything rolled back on the first refusal: they
-- all admit, or not.
--
-- The lines, in which a refused caller waits holding nothing, in arrival order across the fleet:
-- one for the gate's permits, and one per lane for its rates. While anyone waits for permits, a
-- caller that is not first in that line waits behind (permits are the gate's, whatever the
-- lane); otherwise, while anyone waits in its lane, behind them. Callers of other lanes are not
-- held up by a lane waiting for its tokens or its host's spacing. The first in the permit line is
-- told to ask again whenever permits are freed through the gate (or the one before it is
-- admitted with room left, or leaves); the first in a lane, when the one before it leaves it,
-- and otherwise asks again itself when its wait is over. A lane whose first a permit stage
-- refuses joins the permit line whole, in its order; the first in the permit line that only a
-- rate refuses keeps its place for a wait of up to a poll (`waiterTtlMs / 3`), and steps aside
-- into its lane, keeping its arrival, for a longer one.
--
-- Grants: a waiter that asked with mode "hold" and waits in the permit line has its steps kept.
-- When permits are freed through the gate (a release, a leave, an admission with room left), the
-- first in the permit line whose steps are kept is decided there and then, at that instant,
-- exactly as its own try would be: when every step admits, it is admitted (its steps' replies
-- are recorded and PUBLISHed as "g|<member>|<try>|<replies as JSON>", a JSON list of one reply
-- per step and, last, the line's rate waits then: see decide()), and the next is decided
-- the same way; when a rate refuses it, it is told to ask again; when permits do not suffice, it
-- stays first. The waiter's process builds its tickets from the message, without asking again.
-- Its next try, if the message never came, collects the record (status 2); a waiter that gives up
-- takes its grant back with its leave (permits freed, tokens refunded while the bucket's latest,
-- the host's slot handed back while the host's latest). A record nobody collects ends with the
-- waiter's expiry; its leases then end with their lease, as a holder's that stopped.
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
local held    = KEYS[4]
local hexp    = KEYS[5]
local op      = ARGV[2]
-- Admissions decide at one instant, read here. Releases and leaves read the server's time only
-- when they need it (`clock()`, someone waiting); each of their steps reads its own.
local now     = (op == 'all' or ARGV[1] ~= '') and floodgate_now(ARGV[1]) or nil
local ttl     = tonumber(ARGV[3])
local channel = ARGV[4]
-- (Its steps' releases decide this gate's line here, and tell only other gates waiting at their
-- stages: floodgate_freed.)
floodgate_by  = channel
local nowArg  = now and floodgate_num(now) or ''

local function clock()
  now = now or floodgate_now('')
  return now
end

-- Of the permit line's firsts' waits for rates (gmeta fr, see admit()), the ms that have passed
-- by now (a first's wait is added whole as it begins, up to fru; the part still to come is left
-- out, so a caller's stretch counts it once it has passed), from an HMGET of fr, fru and frk.
local function passed(g)
  return floodgate_passed(g, clock())
end

-- passed(), read now, and frk: what a reply (or a grant) says of the line's rate waits.
local function lineRate()
  local g = redis.call('HMGET', gmeta, 'fr', 'fru', 'frk')
  return passed(g), g[3] or ''
end

-- Undo what permit step `s` granted (its lease) as a rollback; returns the release's reply.
local function giveBackPermit(s)
  local g = s.args
  return step_semaphore_release(s.keys, { nowArg, g[2], g[3], g[7], 'lease', g[13], g[12], g[14] })
end

-- A copy of `key` for restore(): its dump (false when it does not exist) and its expiry.
local function copyOf(key)
  return { redis.call('DUMP', key), redis.call('PTTL', key) }
end

-- Put `key` back as `copy` (copyOf) saw it.
local function restore(key, copy)
  if copy[1] then
    redis.call('RESTORE', key, math.max(0, copy[2]), copy[1], 'REPLACE')
  else
    redis.call('DEL', key)
  end
end

-- A call that repeats the one before it (its number of steps "*", see ARGV[5]) comes as its
-- own arguments alone: per step, the values at its script's places in OWN, in that order; a
-- step that repeats an earlier one of its script on its keys ("~"), as that step's number and its
-- own arguments. (Made on the first repeat: a script call pays for every table and function it
-- makes.)
local OWN, REPEAT, REPEAT_STEP

local function repeating()
  OWN = floodgate_own()
  -- The arguments of a step that repeats `base` with its own arguments (OWN) as they came, from
  -- `vals[at]` on; and `touched` (see the parsing of "=" steps) with the places that changed.
  local function withOwn(base, vals, at)
    local args = { unpack(base.args) }
    local touched = base.touched or 0
    for x, j in ipairs(OWN[base.name]) do
      local v = vals[at + x - 1]
      if v ~= args[j] then
        args[j] = v
        touched = bit.bor(touched, bit.lshift(1, j))
      end
    end
    return args, touched
  end
  -- The steps of `call`, a repeat, built whole: each as its run's first call's step (the run:
  -- the calls that repeat one another) with the call's own arguments in their places.
  local function stepsOf(call)
    local steps, at = {}, 6
    for i, base in ipairs(call.run.steps) do
      local args, touched = withOwn(base, call.vals, at)
      steps[i] = { name = base.name, keys = base.keys, args = args, root = base.root or base, touched = touched }
      at = at + #OWN[base.name]
    end
    return steps
  end
  -- A repeat's steps are built when first asked for: the one-pass way (fast()) reads its own
  -- arguments where they came (`vals`) and builds none.
  REPEAT = {
    __index = function(call, field)
      if field ~= 'steps' then return nil end
      local steps = stepsOf(call)
      rawset(call, 'steps', steps)
      return steps
    end,
  }
  -- A repeating step's arguments, built when first asked for: its earlier step's, with its own
  -- in their places.
  REPEAT_STEP = {
    __index = function(step, field)
      if field ~= 'args' then return nil end
      local args = withOwn(step.base, step.vals, step.at)
      rawset(step, 'args', args)
      return args
    end,
  }
end

-- The calls, each {member, mode, lane, laneExp, steps}; each step {name, keys, args}.
local calls = {}
local sent = {}
-- Per reply of a call right behind the first of its line: ms until that first's place ends (see
-- behind(), in admit()).
local ahead = {}
local k = 6
local lastRepeat = nil
for c = 1, tonumber(ARGV[5]) do
  -- (The first pass may have decoded it already: lua/gate-first.lua.)
  local f = gate_first_calls and gate_first_calls[c] or floodgate_call(ARGV[5 + c], lastRepeat)
  if not f then return redis.error_reply('gate: a call comes as a name with no repeat before it') end
  if type(f) ~= 'table' then return redis.error_reply('gate: a call is not a list') end
  lastRepeat = f[5] == '*' and f or nil
  if f[5] == '*' then
    if not REPEAT then repeating() end
    local before = calls[c - 1]
    if not before then return redis.error_reply('gate: the first call repeats none before it') end
    local run = before.run or before
    local want = run.want
    if not want then
      want = 5
      for _, s in ipairs(run.steps) do
        if not OWN[s.name] then return redis.error_reply('gate: a call repeats a step of ' .. s.name) end
        want = want + #OWN[s.name]
      end
      run.want = want
    end
    if #f ~= want then return redis.error_reply('gate: a repeating call has the wrong number of arguments') end
    calls[c] = setmetatable({ member = f[1], mode = f[2], try = f[3], held = f[4],
      lane = before.lane, laneExp = before.laneExp, run = run, vals = f }, REPEAT)
  else
    local lane, laneExp = KEYS[k], KEYS[k + 1]
    k = k + 2
    local call = { member = f[1], mode = f[2], try = f[3], held = f[4],
      lane = lane, laneExp = laneExp, steps = {} }
    local n = tonumber(f[5])
    local a = 6
    for i = 1, n do
      local name = f[a]
      local nk = tonumber(f[a + 1])
      local na = tonumber(f[a + 2])
      if name == '~' then
        if not REPEAT then repeating() end
        local base = sent[nk]
        local own = base and OWN[base.name]
        if not own then return redis.error_reply('gate: a step repeats none before it') end
        local touched = base.touched or 0
        for _, j in ipairs(own) do touched = bit.bor(touched, bit.lshift(1, j)) end
        call.steps[i] = setmetatable({ name = base.name, keys = base.keys, base = base, vals = f, at = a + 2,
          root = base.root or base, touched = touched }, REPEAT_STEP)
        a = a + 2 + #own
      elseif name == '=' then
        local base = sent[nk]
        if not base then return redis.error_reply('gate: a step repeats none before it') end
        -- (A table built whole is sized once: one built element by element grows step by step.)
        local args = { unpack(base.args) }
        -- The first step of the chain this one repeats, and the places that changed on the way
        -- (bit j for argument j; -1 for all): many() compares no more than those.
        local touched = base.touched or 0
        for x = 1, na do
          local j = tonumber(f[a + 1 + 2 * x])
          args[j] = f[a + 2 + 2 * x]
          touched = (j and j >= 1 and j <= 30) and bit.bor(touched, bit.lshift(1, j)) or -1
        end
        call.steps[i] = { name = base.name, keys = base.keys, args = args, root = base.root or base, touched = touched }
        a = a + 3 + 2 * na
      else
        local keys = { unpack(KEYS, k, k + nk - 1) }
        local args = { nowArg, unpack(f, a + 3, a + 1 + na) }
        if not STEPS[name] then return redis.error_reply('gate: unknown step ' .. tostring(name)) end
        call.steps[i] = { name = name, keys = keys, args = args }
        k = k + nk
        a = a + 2 + na
      end
      if name ~= '~' then sent[#sent + 1] = call.steps[i] end
    end
    calls[c] = call
  end
end

-- The process (and gate) that sent the call: the first call's member's token (a release's or a
-- grant call's member is its token). What its steps' releases say to other gates waiting at
-- their stages (floodgate_freed) names this gate and it.
local sender = nil
do
  local first = calls[1] and calls[1].member or ''
  sender = floodgate_token(first) or string.match(first, '^%x*$') or ''
  floodgate_said = channel .. '|' .. sender
  floodgate_clock = clock
end

local woken

-- Tell `member` to ask again: on its process's channel, unless the call's own process and gate
-- sent the call (it tells its waiter from the reply's `woken`: told twice, it would ask twice).
local function tell(member)
  local token = floodgate_token(member)
  if token ~= sender then redis.call('PUBLISH', channel .. ':' .. token, member) end
  woken[#woken + 1] = member
end

-- Decides calls in one pass when nothing stands in their way (see below).
local fast
-- Decides the first waiters of the permit line whose steps are kept (see grants, above).
local grantHeads

-- Forget the kept steps of `members`, who no longer wait in the permit line.
local function forgetSteps(members)
  local fields = {}
  for i = 1, #members do
    fields[2 * i - 1] = 's:' .. members[i]
    fields[2 * i] = 'j:' .. members[i]
  end
  for from = 1, #fields, 2000 do
    redis.call('HDEL', held, unpack(fields, from, math.min(from + 1999, #fields)))
  end
end

-- Take out of line `z` the waiters that stopped asking (their expiries in `e`), when its first
-- has: a line whose first still asks is left as it is (the others are taken out when they come
-- first). Returns the first waiter left, or nil.
local function prune(z, e)
  local first = redis.call('ZRANGE', z, 0, 0)[1]
  if not first then return nil end
  local until_ = tonumber(redis.call('ZSCORE', e, first))
  if until_ and until_ > clock() then return first end
  local gone = floodgate_expired(e, now)
  if #gone > 0 then
    redis.call('ZREM', z, unpack(gone))
    if z == line then forgetSteps(gone) end
  end
  first = redis.call('ZRANGE', z, 0, 0)[1]
  -- A member with no expiry left is one whose expiry was lost: it goes too.
  if first and not redis.call('ZSCORE', e, first) then
    redis.call('ZREM', z, first)
    if z == line then forgetSteps({ first }) end
    first = redis.call('ZRANGE', z, 0, 0)[1]
  end
  return first
end

-- Tell the first of line `z` (with expiries `e`) to ask again, on its process's channel.
local function wake(z, e)
  local first = prune(z, e)
  if first then tell(first) end
end

-- Take `member` out of line `z` (with expiries `e`); when it was first there, wake the next.
-- `first`, when known, is the first in `z`.
local function leave(member, z, e, first)
  first = first or redis.call('ZRANGE', z, 0, 0)[1]
  if redis.call('ZREM', z, member) == 1 then
    redis.call('ZREM', e, member)
    if z ~= line then
      if first == member then wake(z, e) end
    else
      forgetSteps({ member })
      if first == member then grantHeads() end
    end
  end
end

-- How long a first told to come back in `waitMs` keeps its place without asking (ms): until its
-- wait or its longest poll (a waiter sleeps for one or the other, whichever is shorter: half of
-- ttl at most), and a sixth of ttl more (half a poll) for a timer that fires late on a busy event
-- loop. A first whose process froze holds its line up no longer than that, where ttl (three polls)
-- would hold everyone behind it; one that comes later than that asks again from the end.
local function turnMs(waitMs)
  return math.min(waitMs, ttl / 2) + ttl / 6
end

-- Keep (or take) `member`'s place in line `z` (with expiries `e`).
-- `seq`, when given, is its place (arrival sequence) from the line it comes from. `steps`, for
-- the permit line: the call's steps, at whose permit stages this gate then has a caller waiting
-- (`<stage's wake channel>:gates`, this gate's wake channel -> until when, ms): a release through
-- another gate that frees permits there says so (floodgate_freed), for this gate to decide its line.
-- `again`: the call asked before (a try after its first), so it may have been passed over in the
-- permit line while its process did not listen (see decide()): it then gets its place back, and
-- join() returns true.
local function join(member, z, e, seq, steps, again)
  local back = false
  if not redis.call('ZSCORE', z, member) then
    if again and not seq and z == line then
      seq = redis.call('HGET', held, 'p:' .. member)
      if seq then
        redis.call('HDEL', held, 'p:' .. member)
        redis.call('ZREM', hexp, member)
        back = true
      end
    end
    redis.call('ZADD', z, seq or redis.call('HINCRBY', gmeta, 'seq', 1), member)
  end
  local until_ = clock() + ttl
  redis.call('ZADD', e, until_, member)
  redis.call('PEXPIRE', z, ttl)
  redis.call('PEXPIRE', e, ttl)
  redis.call('PEXPIRE', gmeta, ttl)
  if not steps then return back end
  for i = 1, #steps do
    local s = steps[i]
    if PERMIT[s.name] then
      local gates = s.args[7] .. ':gates'
      redis.call('ZADD', gates, until_, channel)
      redis.call('PEXPIRE', gates, ttl)
    end
  end
  return back
end

-- Keep `call`'s steps while it waits in the permit line, for a release to run.
local function keepSteps(call)
  local steps = {}
  for i, s in ipairs(call.steps) do steps[i] = { s.name, s.keys, s.args } end
  redis.call('HSET', held, 's:' .. call.member, cjson.encode({ call.try, call.lane, call.laneExp, steps }))
  redis.call('PEXPIRE', held, ttl)
end

-- Take back the grant a release made to `member`, if it was not collected: permits freed (and
-- granted on), tokens refunded while the bucket's latest grant, slots handed back while the
-- host's latest. Returns the grant record ("<try>|<replies>") when there was one.
local function giveBackGrant(member)
  local record = redis.call('HGET', held, 'g:' .. member)
  if not record then return nil end
  local kept = redis.call('HGET', held, 's:' .. member)
  redis.call('HDEL', held, 'g:' .. member, 's:' .. member)
  redis.call('ZREM', hexp, member)
  if not kept then return record end
  local steps = cjson.decode(kept)[4]
  local replies = cjson.decode(string.sub(record, string.find(record, '|', 1, true) + 1))
  for i = #steps, 1, -1 do
    local name, keys, args = steps[i][1], steps[i][2], steps[i][3]
    if PERMIT[name] then
      giveBackPermit({ keys = keys, args = args })
    elseif name == 'token-bucket-take' then
      step_token_bucket_refund(keys, { nowArg, args[2], args[3], args[4], args[5], args[6], args[7] })
    elseif name == 'interval-gate-take' then
      local r = replies[i]
      step_interval_gate_refund(keys, { nowArg, r[3], r[2] })
    end
  end
  grantHeads()
  return record
end

-- Whether step `b` repeats step `a` (the same keys) with none of the arguments in `shared`
-- changed: then they are alike there without comparing them one by one.
local function repeats(a, b, shared)
  return (a.root or a) == (b.root or b) and bit.band((a.touched or 0), shared) == 0
    and bit.band((b.touched or 0), shared) == 0
end

-- A turn's release replies `r` (a list, one per lease, as the release script answers them) in
-- short (floodgate_short), with the figures of the last of them, when none of them granted
-- anything or took anyone out of the stage's own line; else `r` itself. (The first pass answers
-- so too.)
local function short(name, r)
  local flags = {}
  for x = 1, #r do
    local a = r[x]
    local grants = a[#a]
    if type(grants) ~= 'table' or #grants > 0 or (name == 'semaphore-release' and a[2] ~= 0) then return r end
    flags[x] = a[1]
  end
  local last = r[#r]
  if name == 'semaphore-release' then return floodgate_short(flags, last[3]) end
  return floodgate_short(flags, last[2], last[3], last[4])
end

-- Releases, refunds and settles: every step as alone; freed permits wake the permit line. (The
-- client sends a turn's releases of one stage's leases as one step, which the release script
-- runs as a turn's, answering the list of their replies: see short().)
local function each(call)
  local steps = call.steps
  local replies = {}
  local freed = false
  for i = 1, #steps do
    local s = steps[i]
    local r = STEPS[s.name](s.keys, s.args)
    replies[i] = r
    if s.name == 'semaphore-release' or s.name == 'aimd-release' then
      if r[1] == 1 then freed = true end
      if type(r[1]) == 'table' then
        for x = 1, #r do
          if r[x][1] == 1 then freed = true end
        end
        replies[i] = short(s.name, r)
      end
    end
  end
  if freed then grantHeads() end
  return {1, -1, 0, woken, replies}
end

-- The pass a step runs in: the permit steps (1), the interval gates (2), the rest (3).
local function passOf(name)
  if PERMIT[name] then return 1 end
  if name == 'interval-gate-take' then return 2 end
  return 3
end

-- One admission, all or nothing (see above). `granting`: a release decides a waiter whose steps
-- were kept (it stays where it is when refused, and the caller goes on to the next).
local function admit(call, granting)
  local member, mode, lane, laneExp, steps = call.member, call.mode, call.lane, call.laneExp, call.steps
  local waits = mode ~= 'try'
  local again = (tonumber(call.try) or 0) > 1

  -- Its earlier try's steps admitted by a release, and the message maybe lost: collected now.
  -- (A record of another try, or of one given up, is taken back: see giveBackGrant.)
  if call.held ~= '' then
    local record = redis.call('HGET', held, 'g:' .. member)
    local bar = record and string.find(record, '|', 1, true)
    if record and string.sub(record, 1, bar - 1) == call.held then
      redis.call('HDEL', held, 'g:' .. member, 's:' .. member)
      redis.call('ZREM', hexp, member)
      local replies = {}
      for i = 1, #steps do replies[i] = false end
      return {2, -1, 0, woken, replies, string.sub(record, bar + 1)}
    end
    if record then giveBackGrant(member) end
  end

  -- Its steps kept while it waits in the permit line (mode "hold"), else forgotten.
  local function done(reply)
    if mode == 'hold' and reply[3] == 1 then
      keepSteps(call)
      reply[6] = 1
    elseif call.held ~= '' then
      redis.call('HDEL', held, 's:' .. member)
    end
    return reply
  end

  -- Someone ahead: nothing is looked at, and `member` waits behind (in line `z`, numbered `n`,
  -- with expiries `e`, when it waits). Right behind the first, it is told when the first's place
  -- ends unless the first asks again (`ahead`, ms): a first whose process froze or died holds
  -- the line up until then, and the next asks then rather than at its poll.
  local function behind(z, e, n)
    local replies = {}
    for i = 1, #steps do replies[i] = false end
    if not waits then return {0, -1, 0, woken, replies} end
    -- (Its place back and first now: it asks again at once, to be decided as the first.)
    if join(member, z, e, nil, z == line and steps, again) and redis.call('ZRANGE', line, 0, 0)[1] == member then
      return done({0, 0, n, woken, replies})
    end
    local r = done({0, -1, n, woken, replies})
    local two = redis.call('ZRANGE', z, 0, 1)
    if two[2] == member then
      local ends = tonumber(redis.call('ZSCORE', e, two[1]))
      if ends then ahead[r] = math.max(0, math.ceil(ends - clock())) end
    end
    return r
  end

  local head = prune(line, lexp)
  local laneHead = prune(lane, laneExp)
  if head and head ~= member then
    if laneHead then leave(member, lane, laneExp, laneHead) end
    return behind(line, lexp, 1)
  end
  if not head and laneHead and laneHead ~= member then return behind(lane, laneExp, 2) end

  -- The permit steps first, all of them: a refusal there ends the try once they have run (the
  -- rates are not looked at: the call waits to be told permits are free). Then the metering
  -- steps, up to the first that refuses: the interval gates, whose reply says how to put their
  -- host's slot back, then the token buckets, each but the last saved first (DUMP), so it can be
  -- put back as it was.
  local replies = {}
  local taken = {}
  local saved = {}
  local refusal = nil
  local waitMs = -1
  local rateKey = nil
  -- The first key of the first permit step that refused.
  local permitKey = nil
  local last = 0
  for pass = 2, 3 do
    for i = 1, #steps do if passOf(steps[i].name) == pass then last = i end end
  end
  for pass = 1, 3 do
    for i = 1, #steps do
      local s = steps[i]
      -- Every permit step runs, even after one refused: each learns of a data loss (and starts
      -- its quarantine) at the same call, not one after the other.
      if (pass == 1 or not refusal) and passOf(s.name) == pass then
        if pass == 3 and i ~= last then
          saved[i] = copyOf(s.keys[1])
        end
        local reply = STEPS[s.name](s.keys, s.args)
        replies[i] = reply
        if reply[1] == 1 then
          taken[#taken + 1] = i
        elseif pass == 1 then
          refusal = 'permit'
          permitKey = permitKey or s.keys[1]
        else
          refusal = 'rate'
          waitMs = tonumber(reply[2]) or 0
          rateKey = s.keys[1]
        end
      end
    end
  end
  for i = 1, #steps do
    if replies[i] == nil then replies[i] = false end
  end

  if not refusal then
    if head then
      redis.call('ZREM', line, member)
      redis.call('ZREM', lexp, member)
      -- Room left behind an admitted first waiter goes to the next.
      local room = true
      for i = 1, #steps do
        local r = replies[i]
        if PERMIT[steps[i].name] and tonumber(r[3]) >= tonumber(r[4]) then room = false end
      end
      if room and not granting then grantHeads() end
    end
    if laneHead then leave(member, lane, laneExp, laneHead) end
    if granting then return {1, -1, 0, woken, replies} end
    return done({1, -1, 0, woken, replies})
  end

  -- Refused: roll back what admitted, last first, so nothing is held anywhere.
  for n = #taken, 1, -1 do
    local i = taken[n]
    local s = steps[i]
    local r = replies[i]
    if PERMIT[s.name] then
      local undone = giveBackPermit(s)
      r[1] = -2
      r[2] = -1
      r[3] = undone[3]
      r[6] = undone[4]
    else
      local key = s.keys[1]
      if not saved[i] then
        -- An interval gate's host: its slot back to the one the step replaced (none: the field
        -- goes, and with it a key that held nothing else). Its expiry may stay later than it
        -- was, which no decision reads: the slot it keeps has passed.
        if r[2] == '' then
          redis.call('HDEL', key, 'nextAt')
        else
          redis.call('HSET', key, 'nextAt', r[2])
        end
      else
        restore(key, saved[i])
      end
      r[1] = -2
      r[2] = 0
    end
  end
  if refusal == 'permit' then
    -- It waits for permits, in the permit line. When it was first in its lane, the whole lane
    -- comes with it, in its order (each would be refused the same way, one round trip each).
    if laneHead == member then
      local all = redis.call('ZRANGE', lane, 0, -1, 'WITHSCORES')
      -- Each one moved waits for permits from now on, not for its lane's rate: its next try's
      -- reply says when it moved, and how long the permit line's firsts had waited for rates by
      -- then (fr), and which stage refused (see `moved` below).
      local moved, since = {}, nil
      for j = 1, #all, 2 do
        local m = all[j]
        local expires = redis.call('ZSCORE', laneExp, m)
        if m ~= member and expires then
          redis.call('ZADD', line, 'NX', all[j + 1], m)
          redis.call('ZADD', lexp, expires, m)
          since = since or (floodgate_num(clock()) .. '|' .. floodgate_num(lineRate()) .. '|' .. permitKey)
          moved[#moved + 1] = 'j:' .. m
          moved[#moved + 1] = since
        end
      end
      for from = 1, #moved, 2000 do
        redis.call('HSET', held, unpack(moved, from, math.min(from + 1999, #moved)))
      end
      if #moved > 0 then redis.call('PEXPIRE', held, ttl) end
      if waits then join(member, line, lexp, all[2], steps) end
      redis.call('DEL', lane, laneExp)
      redis.call('PEXPIRE', line, ttl)
      redis.call('PEXPIRE', lexp, ttl)
      return done({0, -1, waits and 1 or 0, woken, replies})
    end
    if laneHead then leave(member, lane, laneExp, laneHead) end
    if not waits then return {0, -1, 0, woken, replies} end
    join(member, line, lexp, nil, steps, again)
    return done({0, -1, 1, woken, replies})
  end
  -- A rate refused: permits are there. First in the permit line, it keeps its place for a short
  -- wait (a poll's length at most: the next would mostly wait the same); for a longer one it
  -- steps aside into its lane, keeping its arrival, and the permit line goes on without it.
  if not waits then return {0, waitMs, 0, woken, replies} end
  local seq = nil
  if head == member then
    if waitMs <= ttl / 3 then
      -- Its wait counts from now on (a wait counted already, its first asking again meanwhile, is
      -- not counted twice); its reply says the waits counted before it. (Written before join(),
      -- which gives gmeta its expiry.)
      local g = redis.call('HMGET', gmeta, 'fr', 'fru', 'frk')
      local fr = tonumber(g[1]) or 0
      local from = math.max(clock(), tonumber(g[2]) or 0)
      local to = clock() + math.ceil(waitMs)
      if to > from then redis.call('HSET', gmeta, 'fr', fr + to - from, 'fru', to, 'frk', rateKey) end
      join(member, line, lexp, nil, steps)
      redis.call('ZADD', lexp, clock() + turnMs(waitMs), member)
      local r = done({0, waitMs, 1, woken, replies, 0, now})
      r[8], r[9] = passed(g), g[3] or ''
      return r
    end
    seq = redis.call('ZSCORE', line, member)
    leave(member, line, lexp, head)
  end
  join(member, lane, laneExp, seq)
  if redis.call('ZRANGE', lane, 0, 0)[1] ~= member then
    waitMs = -1
  else
    redis.call('ZADD', laneExp, clock() + turnMs(waitMs), member)
  end
  return done({0, waitMs, 2, woken, replies})
end

-- Keep `value` as field `field` of `member`'s in `held` until `ttl` from now (hexp): its grant
-- record, or its place once passed over (see decide()).
local function remember(member, field, value)
  redis.call('HSET', held, field, value)
  redis.call('ZADD', hexp, clock() + ttl, member)
  redis.call('PEXPIRE', held, ttl)
  redis.call('PEXPIRE', hexp, ttl)
end

-- Decide `head`, first in the permit line, by its kept steps (`kept`), as its own try would be
-- decided now (see grants, above). Returns true when it was admitted or left the line: the next
-- is decided then; and, with it, the permit stages (their leases' keys) left with no permit free
-- and no lease there ended, whose steps refuse the next as its try would (`full`, from the one
-- before: a waiter that left passes it on).
local swept = false
local function decide(head, kept, full)
  local to = channel .. ':' .. floodgate_token(head)
  -- A waiter keeps its steps only once its process listens for grants: when nobody listens on
  -- its channel any more, its process died (its connections closed), or its pub/sub connection
  -- is reconnecting. It leaves the line, and the next is decided; its place is kept for as long as
  -- a waiter's lasts without asking (`ttl`), and a next try of its call within that takes it back
  -- (see join()): a live process loses no place to a reconnection, a dead one holds nobody up.
  if redis.call('PUBSUB', 'NUMSUB', to)[2] == 0 then
    local seq = redis.call('ZSCORE', line, head)
    redis.call('ZREM', line, head)
    redis.call('ZREM', lexp, head)
    forgetSteps({ head })
    remember(head, 'p:' .. head, seq)
    return true, full
  end
  local h = cjson.decode(kept)
  -- The one before took the last permit of one of its permit stages, and no lease there has
  -- ended for its try to reap: that step would refuse it (a permit step asks for one permit at
  -- least: a cost of 0 sends none), so it stays first, its steps not run.
  if full then
    for _, s in ipairs(h[4]) do
      if PERMIT[s[1]] and full[s[2][1]] then return false end
    end
  end
  local at = floodgate_num(clock())
  local steps = {}
  for i, s in ipairs(h[4]) do
    local args = s[3]
    args[1] = at
    -- A permit's lease lasts its claim window (the acquire's claimMs) until the waiter's process
    -- renews it: a waiter whose process died holds it no longer than that. (Its fence, the
    -- acquire's lastFence, is left out: a data loss starts its quarantine, a lease long, at the
    -- waiter's own next try.)
    if PERMIT[s[1]] then
      if tonumber(args[13]) < tonumber(args[4]) then args[4] = args[13] end
      args[9] = '0'
    end
    steps[i] = { name = s[1], keys = s[2], args = args }
  end
  local call = { member = head, mode = 'try', held = '', lane = h[2], laneExp = h[3], steps = steps }
  -- Nothing in its way at its stages: decided in one pass, as admit() would decide it (it leaves
  -- the permit line, and its lane, admitted).
  local flat = {}
  local r
  if fast({ call }, flat, true) == 1 then
    redis.call('ZREM', line, head)
    redis.call('ZREM', lexp, head)
    local laneHead = prune(call.lane, call.laneExp)
    if laneHead then leave(head, call.lane, call.laneExp, laneHead) end
    local names = {}
    for i = 1, #steps do names[i] = steps[i].name end
    r = { 1, -1, 0, woken, floodgate_admitted(names, flat, now) }
  else
    r = admit(call, true)
  end
  if r[1] ~= 1 then
    -- A rate refused it: it asks again, and waits as its reply says. Too few permits: it stays first.
    if tonumber(r[2]) >= 0 then tell(head) end
    return false
  end
  if not swept then
    swept = true
    for _, m in ipairs(floodgate_expired(hexp, now)) do redis.call('HDEL', held, 'g:' .. m, 's:' .. m, 'p:' .. m) end
  end
  -- A permit's reply says when its lease ends (server ms), and no time of its own: the waiter's
  -- process judges the lease by what it knows of the server's clock, not by when it asked.
  for i, s in ipairs(steps) do
    local p = r[5][i]
    if PERMIT[s.name] and p[1] == 1 then
      p[8] = 'grant'
      p[9] = p[9] or ''
      p[10] = now + tonumber(s.args[4])
    end
  end
  -- After the steps' replies, how long the permit line's firsts have waited for rates, in all,
  -- and the key of the latest's step (fr and frk of gmeta): the waiter counts its wait since its
  -- latest try by them, as from a reply. (A process that reads the steps' replies alone, one
  -- per step, never reads it.)
  r[5][#steps + 1] = { lineRate() }
  local record = h[1] .. '|' .. floodgate_encode(r[5])
  remember(head, 'g:' .. head, record)
  local message = 'g|' .. head .. '|' .. record
  redis.call('PUBLISH', to, message)
  woken[#woken + 1] = message
  -- The stages it left full (see above). (Not a stage with classes: there the next one's try
  -- may ask borrowed permits back for its class, which its own try would then do.)
  local filled = nil
  for i, s in ipairs(steps) do
    local p = r[5][i]
    if PERMIT[s.name] and s.args[14] == '' and tonumber(p[3]) >= tonumber(p[4])
      and not redis.call('ZRANGEBYSCORE', s.keys[1], '-inf', now, 'LIMIT', 0, 1)[1] then
      filled = filled or {}
      filled[s.keys[1]] = true
    end
  end
  return true, filled
end

-- Decide the first of the permit line with steps kept, and each after it while they are
-- admitted; a first without kept steps is told to ask again.
local deciding = false
grantHeads = function()
  if deciding then return end
  deciding = true
  local full = nil
  for _ = 1, 1000 do
    local head = prune(line, lexp)
    if not head then break end
    local kept = redis.call('HGET', held, 's:' .. head)
    if not kept then
      wake(line, lexp)
      break
    end
    local went
    went, full = decide(head, kept, full)
    if not went then break end
  end
  deciding = false
end

-- The scripts whose steps a turn's admissions can take together (many(), fast()).
local TOGETHER = { ['semaphore-acquire'] = true, ['token-bucket-take'] = true, ['interval-gate-take'] = true }

-- The arguments calls of a turn share at a permit step (3 to 14 but 10) and at a token bucket's
-- (2 to 6 but 5), as bits (see the parsing of "=" steps).
local PERMIT_SHARED = 32760 - 1024
local BUCKET_SHARED = 4 + 8 + 16 + 64

-- A turn's admissions together, while nobody waits in the gate's line or in the calls' lanes:
-- each step runs once for the leading calls that have the same steps (a permit step on the same
-- keys with the same arguments but the member and its "again"; a token bucket with the same
-- settings; an interval gate's host spaced apart at most once), as its script decides a turn of
-- callers, each in turn exactly as if alone. The permit steps first: from the first call one
-- refuses, those calls are given back what they were granted and left out. Then the metering
-- steps, each key's callers in one run: when one refuses a call, every metering key is put back
-- as it was before the turn and the steps run again for the calls before it. Returns how many
-- leading calls were admitted (their replies in `out`), each exactly as admit() would have
-- admitted it alone; 0 when this way does not apply. The calls after them go admit()'s way.
local function many(out, from)
  -- (The calls from `from` on, as 1, 2, …)
  local calls = calls
  if from > 1 then
    local all = calls
    calls = {}
    for c = from, #all do calls[c - from + 1] = all[c] end
  end
  local n = #calls
  local steps = calls[1].steps
  for i = 1, #steps do
    if not TOGETHER[steps[i].name] or (PERMIT[steps[i].name] and #steps[i].args ~= 14) then return 0 end
  end
  -- The leading calls alike: the same steps, and no host spaced apart twice.
  local spaced = {}
  local m = 0
  while m < n do
    local call = calls[m + 1]
    if #call.steps ~= #steps or call.held ~= '' then break end
    local alike = true
    for i = 1, #steps do
      local a, b = steps[i], call.steps[i]
      if a.name ~= b.name then alike = false
      elseif PERMIT[a.name] then
        -- (A call asking again for a grant it may hold goes alone: given back, it would lose it.)
        if #b.args ~= 14 or b.args[10] == '1' then alike = false
        elseif not repeats(a, b, PERMIT_SHARED) then
          for j = 1, #a.keys do if a.keys[j] ~= b.keys[j] then alike = false end end
          for j = 3, 14 do if j ~= 10 and a.args[j] ~= b.args[j] then alike = false end end
        end
      elseif a.name == 'token-bucket-take' then
        if not repeats(a, b, BUCKET_SHARED) then
          for j = 2, 6 do if j ~= 5 and a.args[j] ~= b.args[j] then alike = false end end
        end
      elseif tonumber(b.args[2]) > 0 then
        local host = i .. ':' .. b.keys[1]
        if spaced[host] then alike = false end
        spaced[host] = true
      end
      if not alike then break end
    end
    if not alike then break end
    m = m + 1
  end
  if m < 2 then return 0 end
  -- (Each lane once, in chunks that unpack can take: a turn may hold thousands of calls.)
  local busy, seen = { line }, {}
  for c = 1, m do
    local lane = calls[c].lane
    if not seen[lane] then
      seen[lane] = true
      busy[#busy + 1] = lane
    end
  end
  for from = 1, #busy, 1000 do
    if redis.call('EXISTS', unpack(busy, from, math.min(from + 999, #busy))) > 0 then return 0 end
  end

  -- Every metering key as it was before the turn.
  local saved = {}
  for i = 1, #steps do
    if not PERMIT[steps[i].name] then
      for c = 1, m do
        local key = calls[c].steps[i].keys[1]
        if not saved[key] then saved[key] = copyOf(key) end
      end
    end
  end

  local replies = {}
  for c = 1, m do replies[c] = {} end
  -- Give calls `from`..`m` back the permits they were granted.
  local function giveBack(from)
    for c = from, m do
      for i = 1, #steps do
        local r = replies[c][i]
        if PERMIT[steps[i].name] and r and r[1] == 1 then giveBackPermit(calls[c].steps[i]) end
      end
    end
  end

  for i = 1, #steps do
    local s = steps[i]
    if PERMIT[s.name] and m > 0 then
      local args = {}
      for j = 1, 14 do args[j] = s.args[j] end
      for c = 2, m do
        local g = calls[c].steps[i].args
        args[#args + 1] = g[2]
        args[#args + 1] = g[10]
      end
      local r = STEPS[s.name](s.keys, args)
      if m == 1 then r = { r } end
      local refused = m + 1
      for c = 1, m do
        replies[c][i] = r[c]
        if r[c][1] ~= 1 and refused > m then refused = c end
      end
      giveBack(refused)
      m = refused - 1
    end
  end

  -- The metering steps for calls 1..m; returns the first call refused (m + 1 when none).
  local function meter()
    for i = 1, #steps do
      if not PERMIT[steps[i].name] then
        local groups, order = {}, {}
        for c = 1, m do
          local key = calls[c].steps[i].keys[1]
          if not groups[key] then
            groups[key] = {}
            order[#order + 1] = key
          end
          table.insert(groups[key], c)
        end
        local refused = m + 1
        for _, key in ipairs(order) do
          local group = groups[key]
          if steps[i].name == 'token-bucket-take' then
            local g = calls[group[1]].steps[i].args
            local args = { g[1], g[2], g[3], g[4], g[6] }
            for _, c in ipairs(group) do
              local b = calls[c].steps[i].args
              args[#args + 1] = b[5]
              args[#args + 1] = b[7]
              args[#args + 1] = b[8]
            end
            local r = step_token_bucket_take_many({ key }, args)
            for x, c in ipairs(group) do
              if r[3 * x - 2] == 1 then
                replies[c][i] = {1, 0}
              else
                replies[c][i] = {r[3 * x - 2], r[3 * x - 1], r[3 * x]}
                if c < refused then refused = c end
              end
            end
          else
            local args = { nowArg }
            for _, c in ipairs(group) do args[#args + 1] = calls[c].steps[i].args[2] end
            local r = step_interval_gate_take({ key }, args)
            if #group == 1 then r = { r } end
            for x, c in ipairs(group) do
              replies[c][i] = r[x]
              if r[x][1] ~= 1 and c < refused then refused = c end
            end
          end
        end
        if refused <= m then return refused end
      end
    end
    return m + 1
  end

  while m > 0 do
    local refused = meter()
    if refused > m then break end
    for key, copy in pairs(saved) do restore(key, copy) end
    giveBack(refused)
    m = refused - 1
  end
  for c = 1, m do out[c] = {1, -1, 0, 0, replies[c]} end
  return m
end

-- The leading calls of a turn of admissions that nothing stands in the way of, decided in one
-- pass: nobody waits in the gate's line or in their lanes, and every step admits at once the
-- way its script would when nothing is in its way (a permit stage without classes, quarantine or
-- anyone in its own line, with room: its uncontended grant; a token bucket with the tokens now;
-- an interval gate whose host's slot has come), the calls decided in turn exactly as if each
-- came alone. Each call is looked at whole before anything of it is written, so a call that
-- would be refused anywhere stops the pass before it: it, and every call after it, goes the
-- general way (many(), admit()), which then reads what this pass wrote. Each state is read once
-- and written once for the turn, as the stages' scripts do for a turn of their own callers.
-- A release decides the first of the permit line whose steps are kept this way too (`granting`:
-- the gate's line and its lane are not looked at, since nobody is ahead of it; see decide()).
-- Returns how many leading calls were admitted; their replies go in `flat`, one after another,
-- per step: a permit's fence, used, limit and epoch; nothing for a token bucket; an interval
-- gate's replaced slot and claimed slot (the rest of each step's reply is known: see link.ts).
fast = function(list, flat, granting, careful)
  -- Per key, its state as this turn has left it so far (false: not for this pass); per lane and
  -- per permit stage's own line, whether it is empty.
  local permits, buckets, hosts, empty = {}, {}, {}, {}
  local first = list[1]
  if not first then return 0 end
  -- The leases of two calls or more go in with one command per permit stage, once every member
  -- is known to be new (ZMSCORE, Redis 6.2; scripts are told the server's version from 7.0, so
  -- older servers take them one by one, `careful`, as when one is not).
  local batch = not careful and list[2] ~= nil and (redis.REDIS_VERSION_NUM or 0) >= 0x060200
  local nflat = #flat
  -- The gate's line, the first call's lane and its permit stages' lines, looked at in one
  -- command. (`granting`: the first of the permit line, decided on a release: nobody is ahead.)
  if not granting then
    local probe = { line, first.lane }
    for i = 1, #first.steps do
      if first.steps[i].name == 'semaphore-acquire' then probe[#probe + 1] = first.steps[i].keys[2] end
    end
    if redis.call('EXISTS', unpack(probe)) == 0 then
      for i = 2, #probe do empty[probe[i]] = true end
    elseif redis.call('EXISTS', line) == 1 then
      return 0
    end
  end
  local took = 0
  -- Per step of the call at hand: what taking it needs (a permit's cost, a bucket's tokens left
  -- once taken), and its own arguments (see OWN): a permit's member, a bucket's grant, a host's
  -- spacing.
  local want, own = {}, {}
  local from = nflat
  for c = 1, #list do
    local call = list[c]
    -- A repeat (see OWN) is read where it came: its run's first call's steps, its own values.
    local run = rawget(call, 'run')
    local steps = run and run.steps or call.steps
    local vals = run and call.vals
    local at = 6
    if call.held ~= '' then break end
    local lane = call.lane
    if not granting then
      if empty[lane] == nil then empty[lane] = redis.call('EXISTS', lane) == 0 end
      if not empty[lane] then break end
    end
    -- Look at the whole call first, keeping what taking it needs (`want`: a permit's cost, a
    -- bucket's tokens left once taken).
    local ok = true
    for i = 1, #steps do
      local st = steps[i]
      local a, key, name = st.args, st.keys[1], st.name
      if not vals and not TOGETHER[name] then ok = false break end
      -- (Two steps on one key would each see the state before the other. A repeat's keys are
      -- its run's first call's, looked at already: calls go in order, and stop at a refusal.)
      if not vals then
        for j = 1, i - 1 do
          if steps[j].keys[1] == key then ok = false end
        end
        if not ok then break end
      end
      -- Its own arguments: a permit's member, fence and "again"; a bucket's cost and grant; a
      -- host's spacing.
      local v1, v2, v3
      if vals then
        v1, v2, v3 = vals[at], vals[at + 1], vals[at + 2]
        at = at + #OWN[name]
      elseif name == 'semaphore-acquire' then
        v1, v2, v3 = a[2], a[9], a[10]
      elseif name == 'token-bucket-take' then
        v1, v2 = a[5], a[7]
      else
        v1 = a[2]
      end
      own[i] = name == 'token-bucket-take' and v2 or v1
      if name == 'semaphore-acquire' then
        local p = permits[key]
        if p == nil then
          p = false
          local queue = st.keys[2]
          if empty[queue] == nil then empty[queue] = redis.call('EXISTS', queue) == 0 end
          if #a == 14 and a[14] == '' and empty[queue] then
            p = floodgate_open(st.keys[4], a[3], now) or false
            if p then
              p.meta = st.keys[4]
              if batch then p.adds, p.na = {}, 0 end
            end
          end
          permits[key] = p
        end
        if not p or #a ~= 14 or a[14] ~= '' or v3 == '1' or (tonumber(v2) or 0) > p.seq then
          ok = false break
        end
        local cost = floodgate_cost(v1)
        if p.used + cost > p.limit then ok = false break end
        want[i] = cost
      elseif name == 'token-bucket-take' then
        local b = buckets[key]
        if b == nil then
          b = { s = floodgate_bucket(key, tonumber(a[6]), now) }
          buckets[key] = b
        end
        local s = b.s
        if s.updatedAt > now then ok = false break end
        -- (Taken from already at this instant: no refill since.)
        local tokens = s.updatedAt == now and s.tokens
          or floodgate_tokens_at(s, tonumber(a[2]), tonumber(a[3]), tonumber(a[4]), now)
        local cost = tonumber(v1)
        if tokens + 1e-9 < cost then ok = false break end
        want[i] = tokens - cost
      else
        local h = hosts[key]
        if h == nil then
          h = { previous = redis.call('HGET', key, 'nextAt') or '' }
          h.nextAt = tonumber(h.previous)
          hosts[key] = h
        end
        local nextAt = h.nextAt
        if nextAt and nextAt > now then ok = false break end
      end
    end
    if not ok then break end
    -- Then take it.
    for i = 1, #steps do
      local st = steps[i]
      local a, key = st.args, st.keys[1]
      local n = nflat
      if st.name == 'semaphore-acquire' then
        local p = permits[key]
        if batch then
          -- (A repeat's lease is its run's first call's: its expiry is worked out once.)
          -- (As text: Redis would write a number out for each lease.)
          if p.leaseOf ~= a then p.leaseOf, p.expiry = a, floodgate_num(now + tonumber(a[4])) end
          local adds, na = p.adds, p.na
          adds[na + 1], adds[na + 2] = p.expiry, own[i]
          p.na = na + 2
          p.used = p.used + want[i]
        elseif redis.call('ZADD', st.keys[1], now + tonumber(a[4]), own[i]) == 1 then
          p.used = p.used + want[i]
        end
        p.seq = p.seq + 1
        p.took = true
        flat[n + 1], flat[n + 2], flat[n + 3], flat[n + 4] = p.seq, p.used, p.limit, p.epoch
        nflat = n + 4
      elseif st.name == 'token-bucket-take' then
        local b = buckets[key]
        b.s.tokens = math.max(0, want[i])
        b.s.updatedAt = now
        b.args, b.grant = a, own[i]
      else
        local h = hosts[key]
        -- (Calls spaced alike claim alike slots: each one's written once.)
        local spacing, claimed = own[i], nil
        if spacing == h.spaced then
          claimed = h.claims
        else
          claimed = floodgate_num(now + tonumber(spacing))
          h.spaced, h.claims, h.claimsAt = spacing, claimed, tonumber(claimed)
        end
        flat[n + 1], flat[n + 2] = h.previous, claimed
        nflat = n + 2
        h.previous, h.nextAt, h.spacing = claimed, h.claimsAt, spacing
      end
    end
    took = c
  end
  -- The leases, each stage's in one command, when none of their members is there already (nor
  -- twice): else nothing is written, and the pass starts again taking them one by one (a member
  -- already there is not counted again, as its stage's script would not).
  if batch then
    local ok = true
    for key, p in pairs(permits) do
      if p and p.na > 2 then
        local members = {}
        for x = 2, p.na, 2 do members[x / 2] = p.adds[x] end
        local seen = {}
        for x = 1, #members do
          if seen[members[x]] then ok = false end
          seen[members[x]] = true
        end
        for from = 1, #members, 1000 do
          local had = redis.call('ZMSCORE', key, unpack(members, from, math.min(from + 999, #members)))
          for x = 1, #had do if had[x] then ok = false end end
        end
      end
    end
    -- (A stage's one lease goes in at once: one that was there already sends the pass back too,
    -- those put in before it taken out again.)
    local added = {}
    if ok then
      for key, p in pairs(permits) do
        if p and p.na == 2 then
          if redis.call('ZADD', key, p.adds[1], p.adds[2]) == 0 then ok = false break end
          added[#added + 1] = { key, p.adds[2] }
        end
      end
    end
    if not ok then
      for _, x in ipairs(added) do redis.call('ZREM', x[1], x[2]) end
      for x = nflat, from + 1, -1 do flat[x] = nil end
      return fast(list, flat, granting, true)
    end
    for key, p in pairs(permits) do
      if p and p.na > 2 then
        for from = 1, p.na, 2000 do
          redis.call('ZADD', key, unpack(p.adds, from, math.min(from + 1999, p.na)))
        end
      end
    end
  end
  -- Each state written once.
  for _, p in pairs(permits) do
    if p and p.took then floodgate_set_used(p.meta, p.used, nil, p.seq) end
  end
  for key, b in pairs(buckets) do
    if b.grant then
      local a = b.args
      floodgate_save_bucket(key, b.s, tonumber(a[2]), tonumber(a[3]), tonumber(a[4]), b.grant, now)
    end
  end
  for key, h in pairs(hosts) do
    if h.spacing then floodgate_hold_slot(key, h.previous, tonumber(h.spacing)) end
  end
  return took
end

local out = {}
local from = 1
local flat = nil
-- Per call, "<when>|<fr then>|<key>" when the permit line took it with its lane since its latest
-- try (see admit()).
local moved = {}
if op == 'all' then
  flat = {}
  from = fast(calls, flat) + 1
  for c = 1, from - 1 do out[c] = 1 end
end
if op == 'all' and #calls - from >= 1 then
  local part = {}
  local m = many(part, from)
  for c = 1, m do out[from + c - 1] = part[c] end
  from = from + m
end
for c = from, #calls do
  woken = {}
  local call = calls[c]
  if op == 'each' then
    out[c] = each(call)
  elseif op == 'leave' then
    giveBackGrant(call.member)
    leave(call.member, line, lexp)
    leave(call.member, call.lane, call.laneExp)
    out[c] = {1, -1, 0, woken, {}}
  elseif op == 'grant' then
    grantHeads()
    out[c] = {1, -1, 0, woken, {}}
  else
    -- A waiter the permit line took with its lane since its latest try (see admit()): when.
    local at = call.mode ~= 'try' and (tonumber(call.try) or 0) > 1 and redis.call('HGET', held, 'j:' .. call.member)
    if at then
      redis.call('HDEL', held, 'j:' .. call.member)
      moved[c] = at
    end
    out[c] = admit(call)
  end
end
-- (No one woken: 0, not an empty table, which costs the reply more.)
for c = 1, #out do
  local w = out[c] ~= 1 and out[c][4]
  if w and w ~= 0 and w[1] == nil then out[c][4] = 0 end
end
-- (Every reply says when the admissions decided, for the caller's view of the server's clock;
-- one that waits in the permit line, how long its firsts have waited for rates.)
if op == 'all' then
  local rate = nil
  for c = 1, #out do
    if out[c] ~= 1 then
      out[c][6] = out[c][6] or 0
      out[c][7] = now
      if (out[c][3] == 1 or moved[c]) and out[c][8] == nil then
        rate = rate or { lineRate() }
        out[c][8] = rate[1]
        out[c][9] = rate[2]
      end
      out[c][10] = moved[c]
      if ahead[out[c]] then
        -- (After the fields before it, those it has not as false: a nil would end the reply.)
        for x = 8, 10 do
          if out[c][x] == nil then out[c][x] = false end
        end
        out[c][11] = ahead[out[c]]
      end
    end
  end
  -- The calls admitted in one pass (fast()) answer 1; their replies follow the last call's, with
  -- the time they decided at.
  if out[1] == 1 then
    flat[#flat + 1] = now
    out[#calls + 1] = flat
  end
end
return out
