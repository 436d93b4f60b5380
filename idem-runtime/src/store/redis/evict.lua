-- evict.lua: an operator's override (Store::evict) that ends a live record
-- whatever its state and keeps fences growing.
--
-- KEYS[1]  the record's key
-- ARGV[1]  a token no caller holds (16 raw bytes)
--
-- Returns 1 if there was a live record, 0 if the key is absent or released.
--
-- A PROCESSING record stays, under the token nobody holds and with its lease
-- ended (the margin becomes the key's whole remaining life, so lease end =
-- now): its owner, if still running, can neither renew nor complete, and the
-- next claim takes it over with the next fence. A DONE record is released,
-- keeping its fence. Deleting either would start the next claim at fence 1,
-- beside an owner that may still hold 1. Expiry is kept as it was.

local key = KEYS[1]
local v = redis.pcall('GET', key)
if type(v) == 'table' and v.err then
  -- Not a string (a hash of the earlier layout): unreadable to every other
  -- command, so deleting it is the operator's way out.
  redis.call('DEL', key)
  return 1
end
if not v then
  return 0
end
local kind = string.sub(v, 1, 2)
if kind == 'R1' then
  return 0
end
local at = (string.sub(v, 19, 19) == '#') and 52 or 20
if kind == 'P1' then
  local fence, ttl = string.match(v, '^(%d+):(%d+):%d+$', at)
  if fence then
    local left = redis.call('PTTL', key)
    redis.call('SET', key,
      'P1' .. ARGV[1] .. string.sub(v, 19, at - 1) .. fence .. ':' .. ttl .. ':' .. string.format('%d', left),
      'KEEPTTL')
    return 1
  end
elseif kind == 'D1' then
  local fence = string.match(v, '^(%d+):', at)
  if fence then
    redis.call('SET', key, 'R1' .. fence, 'KEEPTTL')
    return 1
  end
end
-- A value this version cannot read (and so never treats as absent): deleting
-- it is the operator's way out.
redis.call('DEL', key)
return 1
