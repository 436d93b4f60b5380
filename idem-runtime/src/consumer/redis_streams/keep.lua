-- keep.lua: keeps the entries a consumer has read and not handed out yet
-- (its buffer, redis_streams/mod.rs) from going idle while they wait.
--
-- Redis counts an entry's idle time from its last delivery, not from when a
-- handler started on it: left in the buffer behind a slow handler, an entry
-- passes claim_idle, another consumer's XAUTOCLAIM (or this one's) takes it
-- and counts a delivery that never ran. Each entry still pending on this
-- consumer gets its idle time set back to 0 by an XCLAIM to itself with
-- JUSTID, which does not count a delivery; one another consumer has taken
-- over (or that was acked or deleted) is left alone and not handed out here.
--
-- KEYS[1]  the stream
-- ARGV[1]  the group
-- ARGV[2]  this consumer
-- ARGV[3…] the entry ids
--
-- Returns the ids kept: still this consumer's, idle time now 0.

local kept = {}
for i = 3, #ARGV do
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
  if p[1] and p[1][2] == ARGV[2] then
    kept[#kept + 1] = ARGV[i]
  end
end
-- In slices: unpack is bounded by Lua's stack (a few thousand values).
for first = 1, #kept, 1000 do
  redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0,
    unpack(kept, first, math.min(first + 999, #kept)), 'JUSTID')
end
return kept
