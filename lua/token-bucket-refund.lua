-- token-bucket-refund: give `cost` unused tokens back to one key's bucket (never above capacity).
--
-- KEYS[1] bucket  HASH  tokens, updatedAt (ms), factor, penalizedAt (ms)
--
-- ARGV[1] now              ms, or "" for the server's TIME
-- ARGV[2] capacity         tokens
-- ARGV[3] refillPerSecond  tokens per second
-- ARGV[4] recoveryMs       ms
-- ARGV[5] cost             tokens to give back
-- ARGV[6] initial          tokens a fresh key starts with
--
-- Returns the tokens now held, times 1000, rounded down.
local bucket          = KEYS[1]
local now             = floodgate_now(ARGV[1])
local capacity        = tonumber(ARGV[2])
local refillPerSecond = tonumber(ARGV[3])
local recoveryMs      = tonumber(ARGV[4])
local cost            = tonumber(ARGV[5])
local initial         = tonumber(ARGV[6])

local s = floodgate_bucket(bucket, initial, now)
s.tokens = math.min(capacity, floodgate_tokens_at(s, capacity, refillPerSecond, recoveryMs, now) + cost)
s.updatedAt = math.max(now, s.updatedAt)
floodgate_save_bucket(bucket, s, capacity, refillPerSecond, recoveryMs)
return math.floor(s.tokens * 1000)
