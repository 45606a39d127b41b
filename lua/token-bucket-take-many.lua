-- token-bucket-take-many: take for several callers of one key at once, in order, exactly as if
-- each had run token-bucket-take in turn at the same time: each is granted, or told how long
-- until its cost is there. One read and one write of the bucket, however many callers.
--
-- KEYS[1] bucket  HASH  tokens, updatedAt (ms), factor, penalizedAt (ms), last (latest grant id);
--                       expires when idle
--
-- ARGV[1] now              ms, or "" for the server's TIME
-- ARGV[2] capacity         tokens, integer >= 1
-- ARGV[3] refillPerSecond  tokens per second, > 0
-- ARGV[4] recoveryMs       ms for a penalised rate to recover
-- ARGV[5] initial          tokens a fresh key starts with
-- ARGV[6] cost             tokens the first caller asks for, integer in [1, capacity]
-- ARGV[7] grant            the first caller's grant id; then ARGV[8] and ARGV[9] are the second
--                          caller's cost and grant, and so on
--
-- Returns {taken1, waitMs1, taken2, waitMs2, ...}: taken = 1 and waitMs = 0 when granted, else
-- taken = 0 and waitMs the whole milliseconds until that caller's cost is there (at most
-- 2^53 - 1, so the reply stays an integer Redis can send).
local LONGEST_MS      = 9007199254740991  -- ms: the longest wait returned
local bucket          = KEYS[1]
local now             = floodgate_now(ARGV[1])
local capacity        = tonumber(ARGV[2])
local refillPerSecond = tonumber(ARGV[3])
local recoveryMs      = tonumber(ARGV[4])
local initial         = tonumber(ARGV[5])

local s = floodgate_bucket(bucket, initial, now)
local replies = {}
local last = nil
for i = 6, #ARGV, 2 do
  local cost = tonumber(ARGV[i])
  local tokens = floodgate_tokens_at(s, capacity, refillPerSecond, recoveryMs, now)
  if tokens + 1e-9 < cost then
    replies[#replies + 1] = 0
    replies[#replies + 1] = math.min(floodgate_wait_ms(s, capacity, refillPerSecond, recoveryMs, cost, now), LONGEST_MS)
  else
    s.tokens = math.max(0, tokens - cost)
    s.updatedAt = math.max(now, s.updatedAt)
    last = ARGV[i + 1]
    replies[#replies + 1] = 1
    replies[#replies + 1] = 0
  end
end
-- A key seen for the first time starts refilling now, granted or not.
if last or s.whole then floodgate_save_bucket(bucket, s, capacity, refillPerSecond, recoveryMs, last) end
return replies
