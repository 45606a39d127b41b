-- interval-gate-pause: let no call start to one host for `ms` from now (a Retry-After), for every
-- process. Never shortens an earlier pause or the current spacing.
--
-- KEYS[1] host  HASH  nextAt (ms)
--
-- ARGV[1] now  ms, or "" for the server's TIME
-- ARGV[2] ms   pause length, ms >= 0
--
-- Returns the whole milliseconds until the host's next slot.
local host = KEYS[1]
local now  = floodgate_now(ARGV[1])
local ms   = tonumber(ARGV[2])

local nextAt = math.max(tonumber(redis.call('HGET', host, 'nextAt') or '-1'), now + ms)
redis.call('HSET', host, 'nextAt', string.format('%.17g', nextAt))
redis.call('PEXPIRE', host, math.ceil(nextAt - now) + 1000)
return math.ceil(nextAt - now)
