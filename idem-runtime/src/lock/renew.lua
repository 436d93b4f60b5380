-- lock/renew.lua: extends a lock's lease, only for the token that holds it.
--
-- KEYS[1]  the lock
-- ARGV[1]  the caller's token
-- ARGV[2]  the new lease, in milliseconds from now
--
-- Returns 1 if it renewed. Check and extend are one step: a holder whose lease
-- ran out cannot extend the lock a later holder took.

if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
