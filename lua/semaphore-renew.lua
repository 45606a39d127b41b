-- semaphore-renew: extend lease `id` while its holder is still running.
--
-- KEYS[1] holders  ZSET  member "<lease id>:<cost>" -> lease expiry (ms)
--
-- ARGV[1] now      ms, or "" for the server's TIME
-- ARGV[2] member   "<lease id>:<cost>"
-- ARGV[3] leaseMs  new lease length from now, ms
--
-- Returns 1 when renewed, 0 when the lease is gone (released, or expired: the permit is lost).
local holders = KEYS[1]
local now     = floodgate_now(ARGV[1])
local id      = ARGV[2]
local leaseMs = tonumber(ARGV[3])

local expiry = redis.call('ZSCORE', holders, id)
if not expiry or tonumber(expiry) <= now then return 0 end
redis.call('ZADD', holders, 'XX', now + leaseMs, id)
return 1
