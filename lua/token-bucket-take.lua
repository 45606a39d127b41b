-- token-bucket-take: take `cost` tokens from one key's bucket, or say how long until it can.
--
-- KEYS[1] bucket  HASH  tokens, updatedAt (ms), factor, penalizedAt (ms), last (latest grant id);
--                       expires when idle
--
-- ARGV[1] now              ms, or "" for the server's TIME
-- ARGV[2] capacity         tokens, integer >= 1
-- ARGV[3] refillPerSecond  tokens per second, > 0
-- ARGV[4] recoveryMs       ms for a penalised rate to recover
-- ARGV[5] cost             tokens, integer in [1, capacity]
-- ARGV[6] initial          tokens a fresh key starts with
-- ARGV[7] grant            id of this grant; only the latest grant of a key can be refunded
--
-- Returns {1, 0} when taken, or {0, waitMs}: the whole milliseconds until `cost` tokens are there,
-- at most 2^53 - 1 (a reply above what Redis can send as an integer would arrive garbled).
local LONGEST_MS      = 9007199254740991  -- ms: the longest wait or TTL written or returned
local bucket          = KEYS[1]
local now             = floodgate_now(ARGV[1])
local capacity        = tonumber(ARGV[2])
local refillPerSecond = tonumber(ARGV[3])
local recoveryMs      = tonumber(ARGV[4])
local cost            = tonumber(ARGV[5])
local initial         = tonumber(ARGV[6])
local grant           = ARGV[7]

-- The common case first: a key that exists and was never penalised (factor "1"). The same
-- arithmetic as floodgate_tokens_at and floodgate_save_bucket, without building the state.
local v = redis.call('HMGET', bucket, 'tokens', 'updatedAt', 'factor', 'penalizedAt')
if v[1] and v[3] == '1' then
  local tokens    = tonumber(v[1])
  local updatedAt = tonumber(v[2])
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
local tokens = floodgate_tokens_at(s, capacity, refillPerSecond, recoveryMs, now)
if tokens + 1e-9 < cost then
  -- A key seen for the first time starts refilling now, granted or not.
  if s.whole then floodgate_save_bucket(bucket, s, capacity, refillPerSecond, recoveryMs, nil) end
  return {0, math.min(floodgate_wait_ms(s, capacity, refillPerSecond, recoveryMs, cost, now), LONGEST_MS)}
end
s.tokens = math.max(0, tokens - cost)
s.updatedAt = math.max(now, s.updatedAt)
floodgate_save_bucket(bucket, s, capacity, refillPerSecond, recoveryMs, grant)
return {1, 0}
