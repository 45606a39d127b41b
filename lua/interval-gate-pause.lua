-- interval-gate-pause: let no call start to one host for `ms` from now (a Retry-After), for every
-- process. Never shortens an earlier pause or the current spacing.
--
-- KEYS[1] host  HASH  nextAt (ms): earliest start of the next call; pausedUntil (ms): end of
--                     the latest pause, which a refunded slot never reaches back inside
--
-- ARGV[1] now  ms, or "" for the server's TIME
-- ARGV[2] ms   pause length, ms >= 0
--
-- Returns the whole milliseconds until the host's next slot.
local host = KEYS[1]
local now  = floodgate_now(ARGV[1])
local ms   = tonumber(ARGV[2])

local state       = redis.call('HMGET', host, 'nextAt', 'pausedUntil')
local nextAt      = math.max(tonumber(state[1] or '-1'), now + ms)
local pausedUntil = math.max(tonumber(state[2] or '-1'), now + ms)
redis.call('HSET', host, 'nextAt', floodgate_num(nextAt), 'pausedUntil', floodgate_num(pausedUntil))
redis.call('PEXPIRE', host, floodgate_num(math.ceil(nextAt - now) + 1000))
return math.ceil(nextAt - now)
