-- token-bucket-take: take `cost` tokens from one key's bucket; when they are not there, reserve
-- them and say when the caller goes; or, when that is later than the caller will wait, reserve
-- nothing and say how long it would take.
--
-- A reservation is a place in the key's one line across the fleet. The bucket is kept as of the
-- end of the line: updatedAt is the time the last reserved caller goes (ahead of now while
-- anyone is reserved) and tokens what is left then. A caller goes at once only when nobody is
-- reserved and its tokens are there; otherwise it goes after the last, once the refill from
-- then has brought its tokens, which are taken as of that time (so the cap throws away any
-- refill it would have). Callers go in the order Redis saw them ask, wherever they run, each as
-- if it had waited at the head of one line.
--
-- KEYS[1] bucket  HASH  tokens, updatedAt (ms), factor, penalizedAt (ms), last (latest grant id);
--                       expires when idle (updatedAt is ahead of now while callers are reserved)
--
-- ARGV[1] now              ms, or "" for the server's TIME
-- ARGV[2] capacity         tokens, integer >= 1
-- ARGV[3] refillPerSecond  tokens per second, > 0
-- ARGV[4] recoveryMs       ms for a penalised rate to recover
-- ARGV[5] cost             tokens, integer in [1, capacity]
-- ARGV[6] initial          tokens a fresh key starts with
-- ARGV[7] grant            id of this grant (or reservation); only a key's latest can be refunded
-- ARGV[8] maxWaitMs        the longest the caller will wait, ms; -1 for as long as it takes
--
-- Returns {1, 0} when taken now; {2, waitMs, fromMs} when reserved: the caller goes in waitMs
-- whole ms (at least 1), and its place in the line began fromMs whole ms from now (when the
-- caller before it goes, or now), the refill since then being its own; or {0, waitMs} when
-- nothing was reserved because waitMs is above maxWaitMs. Waits are at most 2^53 - 1 (a reply
-- above what Redis can send as an integer would arrive garbled).
local LONGEST_MS      = 9007199254740991  -- ms: the longest wait or TTL written or returned
local bucket          = KEYS[1]
local now             = floodgate_now(ARGV[1])
local capacity        = tonumber(ARGV[2])
local refillPerSecond = tonumber(ARGV[3])
local recoveryMs      = tonumber(ARGV[4])
local cost            = tonumber(ARGV[5])
local initial         = tonumber(ARGV[6])
local grant           = ARGV[7]
local maxWaitMs       = tonumber(ARGV[8])

-- The common case first: a key that exists, was never penalised (factor "1") and has nobody
-- reserved. The same arithmetic as floodgate_tokens_at and floodgate_save_bucket, without
-- building the state.
local v = redis.call('HMGET', bucket, 'tokens', 'updatedAt', 'factor', 'penalizedAt')
local updatedAt = tonumber(v[2])
if v[1] and v[3] == '1' and now >= updatedAt then
  local tokens    = tonumber(v[1])
  if now > updatedAt then
    tokens = tokens + (now - updatedAt) * refillPerSecond / 1000
    if tokens > capacity then tokens = capacity end
  end
  if tokens + 1e-9 >= cost then
    tokens = math.max(0, tokens - cost)
    local ttl = floodgate_num(math.min(math.ceil((capacity - tokens) * 1000 / refillPerSecond) + 1000, LONGEST_MS))
    if now > updatedAt then
      redis.call('HSET', bucket, 'tokens', floodgate_num(tokens), 'updatedAt', floodgate_num(now), 'last', grant)
    else
      redis.call('HSET', bucket, 'tokens', floodgate_num(tokens), 'last', grant)
    end
    redis.call('PEXPIRE', bucket, ttl)
    return {1, 0}
  end
end

local s = floodgate_bucket(bucket, initial, now, false, v)
local from = math.max(now, s.updatedAt)  -- the end of the line: when the last reserved caller goes
local tokens = floodgate_tokens_at(s, capacity, refillPerSecond, recoveryMs, from)
if from == now and tokens + 1e-9 >= cost then
  s.tokens = math.max(0, tokens - cost)
  s.updatedAt = now
  floodgate_save_bucket(bucket, s, capacity, refillPerSecond, recoveryMs, grant, now)
  return {1, 0}
end
local waitMs = math.ceil(from + floodgate_wait_ms(s, capacity, refillPerSecond, recoveryMs, cost, from) - now - 1e-9)
waitMs = math.min(math.max(1, waitMs), LONGEST_MS)
if maxWaitMs >= 0 and waitMs > maxWaitMs then
  -- A key seen for the first time starts refilling now, granted or not.
  if s.whole then floodgate_save_bucket(bucket, s, capacity, refillPerSecond, recoveryMs, nil, now) end
  return {0, waitMs}
end
local at = now + waitMs
s.tokens = math.max(0, floodgate_tokens_at(s, capacity, refillPerSecond, recoveryMs, at) - cost)
s.updatedAt = at
floodgate_save_bucket(bucket, s, capacity, refillPerSecond, recoveryMs, grant, now)
return {2, waitMs, math.max(0, math.ceil(from - now - 1e-9))}
