-- interval-gate-refund: hand a slot back when the call that claimed it was never sent, but only
-- if nothing has moved the host on since (a later call, a pause).
--
-- KEYS[1] host  HASH  nextAt (ms)
--
-- ARGV[1] now       ms, or "" for the server's TIME (unused; every script takes it first)
-- ARGV[2] claimed   the nextAt the grant set, as returned by interval-gate-take
-- ARGV[3] previous  the nextAt it replaced ("" when the host had none)
--
-- Returns 1 when the slot was handed back, 0 when the host had moved on.
local host     = KEYS[1]
local claimed  = ARGV[2]
local previous = ARGV[3]

if redis.call('HGET', host, 'nextAt') ~= claimed then return 0 end
if previous == '' then
  redis.call('DEL', host)
else
  redis.call('HSET', host, 'nextAt', previous)
end
return 1
