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

local ours = {}
for i = 3, #ARGV do
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
  if p[1] and p[1][2] == ARGV[2] then
    ours[#ours + 1] = ARGV[i]
  end
end
-- What XCLAIM answers, not what was asked: it leaves out an entry deleted
-- from the stream meanwhile (XDEL, a trim), which must not be run.
-- In slices of 1000 ids: unpack is bounded by Lua's stack. The arguments are
-- built whole first: an `unpack(...)` followed by another argument expands
-- to its first value only.
local kept = {}
for first = 1, #ours, 1000 do
  local args = {'XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0}
  for i = first, math.min(first + 999, #ours) do
    args[#args + 1] = ours[i]
  end
  args[#args + 1] = 'JUSTID'
  for _, id in ipairs(redis.call(unpack(args))) do
    kept[#kept + 1] = id
  end
end
return kept
