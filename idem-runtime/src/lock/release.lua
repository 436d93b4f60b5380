-- lock/release.lua: deletes a lock, only for the token that holds it.
--
-- KEYS[1]  the lock
-- ARGV[1]  the caller's token
--
-- Returns 1 if it released. Check and delete are one step: a holder whose
-- lease ran out cannot delete the lock a later holder took ("lock deleted by
-- mistake").

if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
