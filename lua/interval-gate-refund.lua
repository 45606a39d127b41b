-- interval-gate-refund: hand a slot back when the call that claimed it was never sent, but only
-- if no later call has claimed one since, and never back inside a pause.
--
-- KEYS[1] host  HASH  nextAt (ms), pausedUntil (ms)
--
-- ARGV[1] now       ms, or "" for the server's TIME (unused; every script takes it first)
-- ARGV[2] claimed   the nextAt the grant set, as returned by interval-gate-take
-- ARGV[3] previous  the nextAt it replaced ("" when the host had none)
--
-- Returns 1 when the slot was handed back, 0 when the host had moved on. A host that had no slot
-- before and was never paused has none again, whatever the clock reads (it may be negative).
local host     = KEYS[1]
local claimed  = ARGV[2]

local state = redis.call('HMGET', host, 'nextAt', 'pausedUntil')
if state[1] ~= claimed then return 0 end
local nextAt = tonumber(state[2])
if ARGV[3] ~= '' then nextAt = math.max(tonumber(ARGV[3]), nextAt or tonumber(ARGV[3])) end
if nextAt then
  redis.call('HSET', host, 'nextAt', floodgate_num(nextAt))
else
  redis.call('HDEL', host, 'nextAt')
end
return 1
