-- renew.lua: extends the lease of a live claim (Store::renew), the heartbeat
-- of a long body; a compare-and-set on the owner token.
--
-- KEYS[1]  the record's key
-- ARGV[1]  the owner token
-- ARGV[2]  the new lease, milliseconds from now
--
-- Returns 0 if the token no longer owns a PROCESSING record, else the new
-- margin plus one (the owner keeps the exact record it holds, for a
-- completion by `SET … IFEQ`; complete.rs).
--
-- The key's expiry moves to the claim's ttl counted from now (never sooner
-- than it was, never before the new lease end): a body that heartbeats is
-- alive however long it runs, and Redis must not delete its record under it,
-- which would let a newcomer claim the key as absent and run the body a
-- second time. The ttl rather than just the lease end, so that if the owner
-- then dies the record is still there when its lease runs out, and the next
-- caller takes it over as such, with the next fence. The lease end is stored
-- as the margin between it and the key's expiry (record.rs).

local key = KEYS[1]
local v = redis.call('GET', key)
if not v or string.sub(v, 1, 2) ~= 'P1' or string.sub(v, 3, 18) ~= ARGV[1] then
  return 0
end
local at = (string.sub(v, 19, 19) == '#') and 52 or 20
local fence, ttl = string.match(v, '^(%d+):(%d+):%d+$', at)
if not fence then
  return 0
end
local lease = tonumber(ARGV[2])
local lives = math.max(redis.call('PTTL', key), tonumber(ttl), lease)
redis.call('SET', key,
  string.sub(v, 1, at - 1) .. fence .. ':' .. ttl .. ':' .. string.format('%d', lives - lease),
  'PX', string.format('%d', lives))
return lives - lease + 1
