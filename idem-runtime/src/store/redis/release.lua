-- release.lua: gives up a claim so a retry can run at once (Store::release).
--
-- KEYS[1]  the record's hash
-- ARGV[1]  the owner token
--
-- Returns 1 if it did, 0 if the token no longer owns a PROCESSING record.
--
-- The hash stays, marked 'released', rather than being deleted: its fence is
-- what the next claim counts on from, so fences never go backwards while the
-- record lives (until its ttl, or until purge_expired deletes it).

local key = KEYS[1]
local r = redis.call('HMGET', key, 'state', 'token')
if r[1] ~= 'processing' or r[2] ~= ARGV[1] then
  return 0
end

redis.call('HSET', key, 'state', 'released')
redis.call('HDEL', key, 'token', 'lease_until', 'fingerprint')
return 1
