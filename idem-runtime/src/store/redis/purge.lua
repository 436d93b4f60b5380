-- purge.lua: deletes a record if it is released (Store::purge_expired, one
-- key at a time from a SCAN).
--
-- KEYS[1]  the record's hash
--
-- Returns 1 if it deleted it. Check and delete are one step, so a record that
-- was claimed again since the SCAN saw it is left alone.
--
-- Expired records need no purge: Redis deletes them itself at their ttl.

if redis.call('HGET', KEYS[1], 'state') == 'released' then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
