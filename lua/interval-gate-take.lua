-- interval-gate-take: start a call to one host if its next slot has come, and move the slot on.
--
-- KEYS[1] host  HASH  nextAt (ms): the earliest start of the next call; expires when passed
--
-- ARGV[1] now      ms, or "" for the server's TIME
-- ARGV[2] spacing  ms until the following call may start: minIntervalMs plus this call's jitter
--
-- Returns {1, previous, claimed} when started (the slot it replaced and the one it set, as
-- strings, for a refund), or {0, waitMs} with waitMs as a string (may be fractional).
local host    = KEYS[1]
local now     = floodgate_now(ARGV[1])
local spacing = tonumber(ARGV[2])

local previous = redis.call('HGET', host, 'nextAt') or ''
local nextAt = tonumber(previous ~= '' and previous or '-1')
if nextAt > now then
  return {0, floodgate_num(nextAt - now)}
end
local claimed = floodgate_num(now + spacing)
redis.call('HSET', host, 'nextAt', claimed)
redis.call('PEXPIRE', host, floodgate_num(math.ceil(spacing) + 1000))
return {1, previous, claimed}
