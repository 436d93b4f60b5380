-- adopt.lua: moves a record written under the earlier layout's name
-- (`<prefix>{<64 hex>}`, earlier.rs) to its name in this layout, with its
-- expiry and its recovery arguments, so every operation after it sees the
-- state the earlier record held (DONE replays, a live claim stays Busy, a
-- released or abandoned one is taken over with its next fence).
--
-- KEYS[1]  the record's key (this layout)
-- KEYS[2]  its recovery hash (this layout)
-- ARGV[1]  what the key must hold for the move: '' for absent, else the exact
--          PROCESSING record this caller's own claim wrote there
-- ARGV[2]  the earlier record's value
-- ARGV[3]  its PTTL in ms (-1: no expiry)
-- ARGV[4]  its recovery hash's PTTL in ms (-2: none), then its fields and
--          values from ARGV[5] on
--
-- Returns {1, the value now held} if it moved the record, else {0, the value
-- the key holds (false if none)}: someone else's claim or adoption came
-- first, and that one counts. The earlier keys are deleted by the caller
-- (they live in another slot).

local v = redis.call('GET', KEYS[1])
if (ARGV[1] == '' and v) or (ARGV[1] ~= '' and v ~= ARGV[1]) then
  return {0, v}
end
local pttl = tonumber(ARGV[3])
if pttl > 0 then
  redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
else
  redis.call('SET', KEYS[1], ARGV[2])
end
-- The hash this caller's claim may have written is not the earlier
-- record's: the earlier one's (or none) replaces it.
redis.call('DEL', KEYS[2])
if #ARGV > 4 then
  redis.call('HSET', KEYS[2], unpack(ARGV, 5))
  if tonumber(ARGV[4]) > 0 then
    redis.call('PEXPIRE', KEYS[2], ARGV[4])
  end
end
return {1, ARGV[2]}
