-- unindex.lua: removes a record from a scope's recovery index
-- (recovery.rs), only if its score is still the one the worker read: a
-- recoverable claim of the same key since then has set another.
--
-- KEYS[1]  the scope's index (a sorted set)
-- ARGV[1]  the member (the key's hex)
-- ARGV[2]  the score the worker read

local score = redis.call('ZSCORE', KEYS[1], ARGV[1])
if score and tonumber(score) == tonumber(ARGV[2]) then
  return redis.call('ZREM', KEYS[1], ARGV[1])
end
return 0
