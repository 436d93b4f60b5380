-- take.lua: a worker's turn at an abandoned claim (Store::take_recovery,
-- recovery.rs), one at a time: a second turn finds the backoff moved.
--
-- KEYS[1]  the record's key
-- KEYS[2]  its recovery hash
-- ARGV[1]  the fence the worker saw
-- ARGV[2]  the attempt limit (0: park at once, whatever the backoff)
-- ARGV[3]  the note a parking keeps
-- ARGV[4]  ms from now to the next turn
--
-- Returns {'gone'}, {'parked', attempts, scope} or {'run', attempt, scope}.
-- The record must still be PROCESSING at that fence under the token that
-- stored the arguments, its lease run out. Time is this server's: the hash
-- and the record live on one node.

local h = redis.call('HMGET', KEYS[2], 'token', 'scope', 'attempts', 'next_at', 'parked')
if not h[1] or h[5] then
  return {'gone'}
end
local v = redis.call('GET', KEYS[1])
if not v or string.sub(v, 1, 2) ~= 'P1' or string.sub(v, 3, 18) ~= h[1] then
  return {'gone'}
end
local at = (string.sub(v, 19, 19) == '#') and 52 or 20
local f, margin = string.match(v, '^(%d+):%d+:(%d+)$', at)
if not f or f ~= ARGV[1] then
  return {'gone'}
end
if redis.call('PTTL', KEYS[1]) - tonumber(margin) > 0 then
  return {'gone'}
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local limit = tonumber(ARGV[2])
if limit ~= 0 and tonumber(h[4]) > now then
  return {'gone'}
end
local attempts = tonumber(h[3])
if attempts >= limit then
  redis.call('HSET', KEYS[2], 'parked', ARGV[3])
  return {'parked', attempts, h[2]}
end
redis.call('HSET', KEYS[2], 'attempts', string.format('%d', attempts + 1),
  'next_at', string.format('%d', now + tonumber(ARGV[4])))
return {'run', attempts + 1, h[2]}
