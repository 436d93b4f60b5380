-- complete.lua: marks a record DONE with its result (Store::complete).
--
-- KEYS[1]  the record's hash
-- ARGV[1]  the owner token
-- ARGV[2]  outcome code
-- ARGV[3]  the encoded result
-- ARGV[4]  ttl of the DONE record, milliseconds from now
--
-- Returns 1 if it did, 0 if the token no longer owns a PROCESSING record (it
-- was taken over, released, completed, evicted or expired): a stale owner
-- never overwrites the record of the caller that took over.

local key = KEYS[1]
local r = redis.call('HMGET', key, 'state', 'token')
if r[1] ~= 'processing' or r[2] ~= ARGV[1] then
  return 0
end

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local expires_at = string.format('%d', now + tonumber(ARGV[4]))

redis.call('HSET', key,
  'state', 'done',
  'outcome', ARGV[2],
  'result', ARGV[3],
  'expires_at', expires_at)
-- The old token and lease stay in the hash: every fenced script checks the
-- state first, so they are inert once DONE, and deleting them costs a call.
-- The ttl of a DONE record counts from completion.
redis.call('PEXPIREAT', key, expires_at)
return 1
