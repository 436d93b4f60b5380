-- release.lua: gives up a claim so a retry can run at once (Store::release).
--
-- KEYS[1]  the record's key
-- ARGV[1]  the owner token
--
-- Returns 1 if it did, 0 if the token no longer owns a PROCESSING record.
--
-- The key stays, as a RELEASED record holding only the fence, rather than
-- being deleted: the next claim counts on from it (reclaim.lua), so fences
-- never go backwards while the record lives (until the claim's expiry, kept
-- as it was, or until purge_expired deletes it).

local key = KEYS[1]
local v = redis.call('GET', key)
if not v or string.sub(v, 1, 2) ~= 'P1' or string.sub(v, 3, 18) ~= ARGV[1] then
  return 0
end
local at = (string.sub(v, 19, 19) == '#') and 52 or 20
local fence = string.match(v, '^(%d+):', at)
if not fence then
  return 0
end
redis.call('SET', key, 'R1' .. fence, 'KEEPTTL')
return 1
