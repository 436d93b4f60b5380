-- purge.lua: deletes a record if it is released (Store::purge_expired, one
-- key at a time from a SCAN).
--
-- KEYS[1]  the record's key
--
-- Returns 1 if it deleted it. Check and delete are one step, so a record that
-- was claimed again since the SCAN saw it is left alone.
--
-- Expired records need no purge: Redis deletes them itself at their ttl. A
-- value of another type (a hash of the earlier layout) is left to its own
-- expiry: TYPE first, so GET never fails on it and the walk goes on.

local key = KEYS[1]
if redis.call('TYPE', key)['ok'] ~= 'string' then
  return 0
end
if string.match(redis.call('GET', key), '^R1%d+$') then
  redis.call('DEL', key)
  return 1
end
return 0
