-- complete.lua: marks a record DONE with its result (Store::complete).
--
-- KEYS[1]  the record's hash
-- ARGV[1]  the owner token
-- ARGV[2]  outcome code
-- ARGV[3]  the encoded result
-- ARGV[4]  ttl of the DONE record, milliseconds from now
--
-- Returns 1 if it did, or if the record is already DONE under this same token
-- (the same completion re-sent: the cluster client re-sends a request after an
-- I/O error, and the first attempt may have run); 0 if the token does not own
-- the record (it was taken over, released, evicted or expired, or another
-- owner completed it): a stale owner never overwrites the record of the
-- caller that took over.

local key = KEYS[1]
local r = redis.call('HMGET', key, 'state', 'token')
if r[2] ~= ARGV[1] then
  return 0
elseif r[1] == 'done' then
  -- Already done by this token: report the success, change nothing (not even
  -- the expiry, which counts from the first completion).
  return 1
elseif r[1] ~= 'processing' then
  return 0
end

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local expires_at = string.format('%d', now + tonumber(ARGV[4]))

-- The token stays in the DONE hash on purpose: it is how a re-sent completion
-- recognises itself. Every other fenced script checks the state first, so it
-- grants nothing else once DONE.
redis.call('HSET', key,
  'state', 'done',
  'outcome', ARGV[2],
  'result', ARGV[3],
  'expires_at', expires_at)
-- The ttl of a DONE record counts from completion.
redis.call('PEXPIREAT', key, expires_at)
return 1
