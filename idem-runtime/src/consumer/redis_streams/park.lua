-- park.lua: moves an entry to the parking stream: the copy first, the ack
-- only once the copy is written.
--
-- A MULTI {XADD, XACK} does not roll back: with the parking key holding
-- another type (WRONGTYPE), EXEC still ran the XACK, and the entry was
-- neither pending nor parked. Here a failed XADD raises and ends the script
-- before the XACK, so the entry stays pending and comes back.
--
-- KEYS[1]  the stream
-- KEYS[2]  the parking stream
-- ARGV[1]  the group
-- ARGV[2]  the entry id
-- ARGV[3…] the parked copy's fields and values
--
-- Returns the parked copy's id.

local parked = redis.call('XADD', KEYS[2], '*', unpack(ARGV, 3))
redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
return parked
