-- peek.lua: where a recoverable claim stands, for the worker's listing
-- (Store::abandoned, recovery.rs), and the tidying of what no longer counts.
--
-- KEYS[1]  the record's key
-- KEYS[2]  its recovery hash
--
-- Returns one of
--   {'none'}                 no arguments stored (the hash expired or was deleted)
--   {'gone'}                 the record is not PROCESSING under the token that
--                            stored them (done, released, taken over by a plain
--                            claim, expired): the hash is deleted
--   {'live', ms}             its lease still runs for ms
--   {'abandoned', fence, args, attempts, ms to the next attempt (<= 0: due),
--    parked (0 or 1), ms since the lease ended}
-- The lease is judged as reclaim.lua judges it, by PTTL and the margin.

local h = redis.call('HMGET', KEYS[2], 'token', 'args', 'attempts', 'next_at', 'parked')
if not h[1] then
  return {'none'}
end
local v = redis.call('GET', KEYS[1])
if not v or string.sub(v, 1, 2) ~= 'P1' or string.sub(v, 3, 18) ~= h[1] then
  redis.call('DEL', KEYS[2])
  return {'gone'}
end
local at = (string.sub(v, 19, 19) == '#') and 52 or 20
local f, margin = string.match(v, '^(%d+):%d+:(%d+)$', at)
if not f then
  return {'none'}
end
local remaining = redis.call('PTTL', KEYS[1]) - tonumber(margin)
if remaining > 0 then
  return {'live', remaining}
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
return {'abandoned', tonumber(f), h[2], tonumber(h[3]), tonumber(h[4]) - now,
  h[5] and 1 or 0, -remaining}
