-- token-bucket-take-many: take for several callers of one key at once, in order, exactly as if
-- each had run token-bucket-take in turn at the same time: each is taken, reserved a place in
-- the key's line, or told how long it would wait. One read and one write of the bucket, however
-- many callers.
--
-- KEYS[1] bucket  HASH  tokens, updatedAt (ms), factor, penalizedAt (ms), last (latest grant id);
--                       expires when idle (updatedAt is ahead of now while callers are reserved)
--
-- ARGV[1] now              ms, or "" for the server's TIME
-- ARGV[2] capacity         tokens, integer >= 1
-- ARGV[3] refillPerSecond  tokens per second, > 0
-- ARGV[4] recoveryMs       ms for a penalised rate to recover
-- ARGV[5] initial          tokens a fresh key starts with
-- ARGV[6] cost             tokens the first caller asks for, integer in [1, capacity]
-- ARGV[7] grant            the first caller's grant id
-- ARGV[8] maxWaitMs        the longest the first caller will wait, ms, or -1 for as long as it
--                          takes; then ARGV[9..11] are the second caller's cost, grant and
--                          maxWaitMs, and so on
--
-- Returns {taken1, waitMs1, fromMs1, taken2, ...}, three per caller, as token-bucket-take answers
-- each (fromMs 0 unless reserved): {1, 0, 0} taken now, {2, waitMs, fromMs} reserved, {0, waitMs,
-- 0} nothing reserved (waitMs at most 2^53 - 1, so the reply stays an integer Redis can send).
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
for i = 6, #ARGV, 3 do
  local cost = tonumber(ARGV[i])
  local from = math.max(now, s.updatedAt)
  local tokens = floodgate_tokens_at(s, capacity, refillPerSecond, recoveryMs, from)
  local k = #replies
  if from == now and tokens + 1e-9 >= cost then
    s.tokens = math.max(0, tokens - cost)
    s.updatedAt = now
    last = ARGV[i + 1]
    replies[k + 1], replies[k + 2], replies[k + 3] = 1, 0, 0
  else
    local waitMs = math.ceil(from + floodgate_wait_ms(s, capacity, refillPerSecond, recoveryMs, cost, from) - now - 1e-9)
    waitMs = math.min(math.max(1, waitMs), LONGEST_MS)
    if tonumber(ARGV[i + 2]) >= 0 and waitMs > tonumber(ARGV[i + 2]) then
      replies[k + 1], replies[k + 2], replies[k + 3] = 0, waitMs, 0
    else
      local at = now + waitMs
      s.tokens = math.max(0, floodgate_tokens_at(s, capacity, refillPerSecond, recoveryMs, at) - cost)
      s.updatedAt = at
      last = ARGV[i + 1]
      replies[k + 1], replies[k + 2], replies[k + 3] = 2, waitMs, math.max(0, math.ceil(from - now - 1e-9))
    end
  end
end
-- A key seen for the first time starts refilling now, granted or not.
if last or s.whole then floodgate_save_bucket(bucket, s, capacity, refillPerSecond, recoveryMs, last, now) end
return replies
