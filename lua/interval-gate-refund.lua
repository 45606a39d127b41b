-- interval-gate-refund: hand a slot back when the call that claimed it was never sent, but only
-- if no later call has claimed one since, and never back inside a pause.
--
-- KEYS[1] host  HASH  nextAt (ms), pausedUntil (ms)
--
-- ARGV[1] now       ms, or "" for the server's TIME (unused; every script takes it first)
-- ARGV[2] claimed   the nextAt the grant set, as returned by interval-gate-take
-- ARGV[3] previous  the nextAt it replaced ("" when the host had none)
--
-- Returns 1 when the slot was handed back, 0 when the host had moved on.
local host     = KEYS[1]
local claimed  = ARGV[2]
local previous = tonumber(ARGV[3] ~= '' and ARGV[3] or '-1')

local state = redis.call('HMGET', host, 'nextAt', 'pausedUntil')
if state[1] ~= claimed then return 0 end
local pausedUntil = tonumber(state[2] or '-1')
redis.call('HSET', host, 'nextAt', floodgate_num(math.max(previous, pausedUntil)))
return 1
