-- interval-gate-take: start a call to one host if its next slot has come, and move the slot on.
--
-- KEYS[1] host  HASH  nextAt (ms): the earliest start of the next call; expires when passed
--
-- ARGV[1] now      ms, or "" for the server's TIME
-- ARGV[2] spacing  ms until the following call may start: minIntervalMs plus this call's jitter
-- ARGV[3] spacing2 more callers of this turn, each its spacing (ARGV[4], and so on): each is
--                  decided in turn, exactly as if each had called alone
--
-- Returns {1, previous, claimed} when started (the slot it replaced and the one it set, as
-- strings, for a refund), or {0, waitMs} with waitMs as a string (may be fractional; at most
-- 2^53 - 1). The key expires once its slot has passed, at most 2^53 - 1 ms from now. With more
-- than one caller, returns one such reply per caller, in order, with one read and one write.
local LONGEST_MS = 9007199254740991  -- ms: the longest wait returned
local host       = KEYS[1]
local now        = floodgate_now(ARGV[1])
local spacing    = tonumber(ARGV[2])

-- A host with no slot yet may start at once, whatever the clock reads (it may be negative).
local previous = redis.call('HGET', host, 'nextAt') or ''
if #ARGV > 2 then
  local replies = {}
  local last = nil
  for i = 2, #ARGV do
    local nextAt = tonumber(previous)
    if nextAt and nextAt > now then
      replies[i - 1] = {0, floodgate_num(math.min(nextAt - now, LONGEST_MS))}
    else
      local claimed = floodgate_num(now + tonumber(ARGV[i]))
      replies[i - 1] = {1, previous, claimed}
      previous = claimed
      last = tonumber(ARGV[i])
    end
  end
  if last then floodgate_hold_slot(host, previous, last) end
  return replies
end
if previous ~= '' then
  local nextAt = tonumber(previous)
  if nextAt > now then
    return {0, floodgate_num(math.min(nextAt - now, LONGEST_MS))}
  end
end
local claimed = floodgate_num(now + spacing)
floodgate_hold_slot(host, claimed, spacing)
return {1, previous, claimed}
