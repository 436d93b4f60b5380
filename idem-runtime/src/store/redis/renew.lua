-- renew.lua: extends the lease of a live claim (Store::renew), the heartbeat
-- of a long body.
--
-- KEYS[1]  the record's hash
-- ARGV[1]  the owner token
-- ARGV[2]  the new lease, milliseconds from now
--
-- Returns 1 if it did, 0 if the token no longer owns a PROCESSING record.
-- The record's own expiry is left alone: a lease never outlives the ttl.

local key = KEYS[1]
local r = redis.call('HMGET', key, 'state', 'token')
if r[1] ~= 'processing' or r[2] ~= ARGV[1] then
  return 0
end

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('HSET', key, 'lease_until', string.format('%d', now + tonumber(ARGV[2])))
return 1
