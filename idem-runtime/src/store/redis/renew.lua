-- renew.lua: extends the lease of a live claim (Store::renew), the heartbeat
-- of a long body.
--
-- KEYS[1]  the record's hash
-- ARGV[1]  the owner token
-- ARGV[2]  the new lease, milliseconds from now
--
-- Returns 1 if it did, 0 if the token no longer owns a PROCESSING record.
--
-- The record's expiry moves too, to the claim's ttl counted from now (and
-- never before the new lease end): a body that heartbeats is alive however
-- long it runs, and Redis must not delete its record under it, which would
-- let a newcomer claim the key as absent and run the body a second time. The
-- ttl rather than just the lease end, so that if the owner then dies the
-- record is still there when its lease runs out, and the next caller takes it
-- over as such, with the next fence, instead of starting again from fence 1.

local key = KEYS[1]
local r = redis.call('HMGET', key, 'state', 'token', 'expires_at', 'ttl')
if r[1] ~= 'processing' or r[2] ~= ARGV[1] then
  return 0
end

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local lease = tonumber(ARGV[2])
-- A record claimed before claim.lua kept the ttl has none: the lease end is
-- then the least it must live.
local lives = math.max(tonumber(r[4]) or 0, lease)
local expires_at = math.max(tonumber(r[3]) or 0, now + lives)
expires_at = string.format('%d', expires_at)
redis.call('HSET', key,
  'lease_until', string.format('%d', now + lease),
  'expires_at', expires_at)
redis.call('PEXPIREAT', key, expires_at)
return 1
