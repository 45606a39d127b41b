-- token-bucket-refund: give `cost` unused tokens back to one key's bucket (never above capacity),
-- but only when grant `grant` is still the key's latest: then the bucket ends up no fuller than
-- if the call had never been admitted. After another grant the refill the cap threw away can no
-- longer be told apart, so nothing comes back. A reservation whose time has not come is refunded
-- the same way, only while the latest: the reservations after it keep their times, so giving an
-- earlier one back would open a gap in the line that a newcomer could fill at the very time a
-- waiter behind it goes, two calls' worth at once.
--
-- KEYS[1] bucket  HASH  tokens, updatedAt (ms), factor, penalizedAt (ms), last (latest grant id)
--
-- ARGV[1] now              ms, or "" for the server's TIME
-- ARGV[2] capacity         tokens
-- ARGV[3] refillPerSecond  tokens per second
-- ARGV[4] recoveryMs       ms
-- ARGV[5] cost             tokens to give back
-- ARGV[6] initial          tokens a fresh key starts with
-- ARGV[7] grant            id of the grant to refund
--
-- Returns the tokens now held, times 1000, rounded down; -1 when nothing was given back.
local bucket          = KEYS[1]
local now             = floodgate_now(ARGV[1])
local capacity        = tonumber(ARGV[2])
local refillPerSecond = tonumber(ARGV[3])
local recoveryMs      = tonumber(ARGV[4])
local cost            = tonumber(ARGV[5])
local initial         = tonumber(ARGV[6])
local grant           = ARGV[7]

local s, last = floodgate_bucket(bucket, initial, now, true)
if last ~= grant then return -1 end
s.tokens = math.min(capacity, floodgate_tokens_at(s, capacity, refillPerSecond, recoveryMs, now) + cost)
s.updatedAt = math.max(now, s.updatedAt)
floodgate_save_bucket(bucket, s, capacity, refillPerSecond, recoveryMs, nil, now)
redis.call('HDEL', bucket, 'last')
return math.floor(s.tokens * 1000)
