-- semaphore-renew: extend lease `member` while its holder is still running, and give a sign of
-- life of the holder's process (its waiters stay in line and can be granted only while it does).
-- With no member it only gives the sign of life (a process that waits and holds nothing).
--
-- KEYS[1] holders    ZSET  member "<lease id>:<cost>" -> lease expiry (ms)
-- KEYS[2] procs      ZSET  token of each waiting process -> end of its last sign of life (ms)
--
-- ARGV[1] now        ms, or "" for the server's TIME
-- ARGV[2] member     "<token>-<n>:<cost>", or "" for a sign of life only
-- ARGV[3] leaseMs    new lease length from now, ms
-- ARGV[4] token      the process's token, or "" to give no sign of life
-- ARGV[5] livenessMs how long the sign of life lasts, ms
--
-- Returns {renewed, now}: renewed = 1 when renewed, 0 when the lease is gone (released, or
-- expired: the permit is lost) or no member was given; now = the time decided at (server ms).
local holders    = KEYS[1]
local procs      = KEYS[2]
local now        = floodgate_now(ARGV[1])
local id         = ARGV[2]
local leaseMs    = tonumber(ARGV[3])
local token      = ARGV[4]

if token ~= '' then floodgate_sign_of_life(procs, token, now, tonumber(ARGV[5])) end
if id == '' then return {0, now} end
local expiry = redis.call('ZSCORE', holders, id)
if not expiry or tonumber(expiry) <= now then return {0, now} end
redis.call('ZADD', holders, 'XX', now + leaseMs, id)
return {1, now}
