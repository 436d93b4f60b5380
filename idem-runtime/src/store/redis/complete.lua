-- complete.lua: marks a record DONE with its result (Store::complete), a
-- compare-and-set on the owner token.
--
-- KEYS[1]  the record's key
-- ARGV[1]  the owner token (16 raw bytes)
-- ARGV[2]  outcome code (one digit)
-- ARGV[3]  the encoded result
-- ARGV[4]  ttl of the DONE record, milliseconds from now
--
-- Returns 1 if it did, or if the record is already DONE under this same token
-- (the same completion re-sent: the cluster client re-sends a request after an
-- I/O error, and the first attempt may have run); 0 if the token does not own
-- the record (taken over, released, evicted, expired, or completed by another
-- owner): a stale owner never overwrites the record of the caller that took
-- over. Two commands, GET and SET: the DONE record is one string value.

local key = KEYS[1]
-- WRONGTYPE on a hash of the earlier layout: an error, nothing written.
local v = redis.call('GET', key)
if not v or string.sub(v, 3, 18) ~= ARGV[1] then
  return 0
end
local kind = string.sub(v, 1, 2)
if kind == 'D1' then
  -- Already done by this token: a success that changes nothing (not even the
  -- expiry, which counts from the first completion).
  return 1
elseif kind ~= 'P1' then
  return 0
end

local at = (string.sub(v, 19, 19) == '#') and 52 or 20
local fence = string.match(v, '^(%d+):', at)
if not fence then
  return 0
end
-- The token stays in the DONE record: it is how a re-sent completion
-- recognises itself. The fingerprint stays for replays to compare.
redis.call('SET', key,
  'D1' .. string.sub(v, 3, at - 1) .. fence .. ':' .. ARGV[2] .. ':' .. ARGV[3],
  'PX', ARGV[4])
return 1
