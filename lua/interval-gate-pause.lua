-- interval-gate-pause: let no call start to one host for `ms` from now (a Retry-After), for every
-- process. Never shortens an earlier pause or the current spacing.
--
-- KEYS[1] host  HASH  nextAt (ms): earliest start of the next call; pausedUntil (ms): end of
--                     the latest pause, which a refunded slot never reaches back inside
--
-- ARGV[1] now  ms, or "" for the server's TIME
-- ARGV[2] ms   pause length, ms >= 0
--
-- Returns the whole milliseconds until the host's next slot, at most 2^53 - 1; the key expires
-- then (plus a second), at most 2^53 - 1 ms from now. Nothing is written unless all of it is.
local LONGEST_MS = 9007199254740991  -- ms: the longest wait returned or TTL set
local host       = KEYS[1]
local now        = floodgate_now(ARGV[1])
local ms         = tonumber(ARGV[2])

-- A field not yet written holds nothing back, whatever the clock reads (it may be negative).
local state       = redis.call('HMGET', host, 'nextAt', 'pausedUntil')
local nextAt      = now + ms
local pausedUntil = now + ms
if state[1] then nextAt = math.max(tonumber(state[1]), nextAt) end
if state[2] then pausedUntil = math.max(tonumber(state[2]), pausedUntil) end
local waitMs      = math.min(math.ceil(nextAt - now), LONGEST_MS)
local ttl         = floodgate_num(math.min(waitMs + 1000, LONGEST_MS))
redis.call('HSET', host, 'nextAt', floodgate_num(nextAt), 'pausedUntil', floodgate_num(pausedUntil))
redis.call('PEXPIRE', host, ttl)
return waitMs
