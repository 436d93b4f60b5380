-- inspect.lua: reads a record and its expiry in one step (Store::inspect).
--
-- KEYS[1]  the record's key
--
-- Returns {value or false, PEXPIRETIME}. The lease end is not stored as such:
-- it is the expiry minus the margin in the value (record.rs), so both must be
-- read at the same instant. WRONGTYPE on a value that is not a string.

local key = KEYS[1]
return {redis.call('GET', key), redis.call('PEXPIRETIME', key)}
