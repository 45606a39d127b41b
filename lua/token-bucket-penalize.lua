-- token-bucket-penalize: after a drop, multiply one key's refill rate by `factor` (compounding,
-- never below `minFactor`); it climbs back linearly to full over recoveryMs.
--
-- KEYS[1] bucket  HASH  tokens, updatedAt (ms), factor, penalizedAt (ms)
--
-- ARGV[1] now              ms, or "" for the server's TIME
-- ARGV[2] capacity         tokens
-- ARGV[3] refillPerSecond  tokens per second
-- ARGV[4] recoveryMs       ms
-- ARGV[5] factor           multiplier in (0, 1)
-- ARGV[6] minFactor        floor in (0, 1]
-- ARGV[7] initial          tokens a fresh key starts with
--
-- Returns the new rate multiplier times 1000, rounded down.
local bucket          = KEYS[1]
local now             = floodgate_now(ARGV[1])
local capacity        = tonumber(ARGV[2])
local refillPerSecond = tonumber(ARGV[3])
local recoveryMs      = tonumber(ARGV[4])
local factor          = tonumber(ARGV[5])
local minFactor       = tonumber(ARGV[6])
local initial         = tonumber(ARGV[7])

local s = floodgate_bucket(bucket, initial, now)
local t = math.max(now, s.updatedAt)
local tokens = floodgate_tokens_at(s, capacity, refillPerSecond, recoveryMs, t)
local next = math.max(minFactor, math.min(1, floodgate_rate_factor(s, recoveryMs, t) * factor))
s = { tokens = tokens, updatedAt = t, factor = next, penalizedAt = t, whole = true }
floodgate_save_bucket(bucket, s, capacity, refillPerSecond, recoveryMs, nil, now)
return math.floor(next * 1000)
