-- recovery_info.lua: the recovery state of a live PROCESSING record with
-- arguments stored (Store::recovery_info), and an operator's retry
-- (Store::retry_recovery) that clears its count, backoff and parking.
--
-- KEYS[1]  the record's key
-- KEYS[2]  its recovery hash
-- ARGV[1]  'retry' to clear, anything else to read
--
-- Returns false when there is none, else {scope, attempts, next_at, parked
-- (0 or 1), the parking note or '', the arguments' length}.

local h = redis.call('HMGET', KEYS[2], 'token', 'scope', 'attempts', 'next_at', 'parked')
if not h[1] then
  return false
end
local v = redis.call('GET', KEYS[1])
if not v or string.sub(v, 1, 2) ~= 'P1' or string.sub(v, 3, 18) ~= h[1] then
  return false
end
if ARGV[1] == 'retry' then
  redis.call('HSET', KEYS[2], 'attempts', '0', 'next_at', '0')
  redis.call('HDEL', KEYS[2], 'parked')
  return {h[2], 0, 0, 0, '', redis.call('HSTRLEN', KEYS[2], 'args')}
end
return {h[2], tonumber(h[3]), tonumber(h[4]), h[5] and 1 or 0, h[5] or '',
  redis.call('HSTRLEN', KEYS[2], 'args')}
