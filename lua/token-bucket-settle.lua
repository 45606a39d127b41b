-- token-bucket-settle: a call admitted at an estimated cost turned out to cost `delta` more
-- (delta > 0: charge it now; the key may go into debt, below zero, and later calls wait until
-- it is paid back) or less (delta < 0: give the difference back, but only while grant `grant` is
-- still the key's latest, so the bucket never ends up fuller than if the right cost had been
-- asked; never above capacity).
--
-- KEYS[1] bucket  HASH  tokens, updatedAt (ms), factor, penalizedAt (ms), last (latest grant id)
--
-- ARGV[1] now              ms, or "" for the server's TIME
-- ARGV[2] capacity         tokens
-- ARGV[3] refillPerSecond  tokens per second
-- ARGV[4] recoveryMs       ms
-- ARGV[5] delta            actual cost minus estimated cost, tokens (integer, may be negative)
-- ARGV[6] initial          tokens a fresh key starts with
-- ARGV[7] grant            id of the grant being settled
--
-- Returns the tokens now held times 1000, rounded down (negative in debt); or the string
-- "unchanged" when a refund was refused because another grant came after.
local bucket          = KEYS[1]
local now             = floodgate_now(ARGV[1])
local capacity        = tonumber(ARGV[2])
local refillPerSecond = tonumber(ARGV[3])
local recoveryMs      = tonumber(ARGV[4])
local delta           = tonumber(ARGV[5])
local initial         = tonumber(ARGV[6])
local grant           = ARGV[7]

local s, last = floodgate_bucket(bucket, initial, now, true)
local tokens = floodgate_tokens_at(s, capacity, refillPerSecond, recoveryMs, now)
if delta > 0 then
  s.tokens = tokens - delta
else
  if last ~= grant then return 'unchanged' end
  s.tokens = math.min(capacity, tokens - delta)
end
s.updatedAt = math.max(now, s.updatedAt)
floodgate_save_bucket(bucket, s, capacity, refillPerSecond, recoveryMs, nil, now)
return math.floor(s.tokens * 1000)
