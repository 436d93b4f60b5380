-- claim.lua: the one atomic claim of an idempotency record (Store::claim).
--
-- KEYS[1]  the record's hash
-- ARGV[1]  the caller's owner token (16 raw bytes)
-- ARGV[2]  lease, milliseconds
-- ARGV[3]  ttl, milliseconds
-- ARGV[4]  the payload fingerprint (32 raw bytes), or '' for none
--
-- Returns one of
--   {'acquired', fence, takeover (0 or 1)}
--   {'busy', lease remaining in ms, fingerprint or nil}
--   {'done', outcome code, result, fingerprint or nil}
-- or an IDEM_UNKNOWN_STATE error when the key holds a hash whose state it
-- does not know, which it leaves untouched.
--
-- Everything about a record lives in this one hash and changes in this one
-- script, so no crash can leave a status without its owner, lease or result.
--
-- Time is the server's: every client reads the same clock, so a lease means
-- the same to all of them whatever their own clocks say. Redis 7 replicates a
-- script's effects rather than the script, so reading TIME before writing is
-- allowed.

local key = KEYS[1]
local token, fp = ARGV[1], ARGV[4]
local lease, ttl = tonumber(ARGV[2]), tonumber(ARGV[3])

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

local r = redis.call('HMGET', key,
  'state', 'token', 'fence', 'lease_until', 'fingerprint', 'outcome', 'result')
local state = r[1]
local fence, takeover = 1, 0 -- absent (or expired, which Redis has deleted)

if state == 'done' then
  return {'done', tonumber(r[6]), r[7], r[5]}
elseif state == 'processing' then
  if r[2] == token then
    -- The same claim re-sent: redis-rs's cluster client retries a request
    -- after an I/O error, and the first attempt may have run. It is ours.
    fence = tonumber(r[3])
  else
    local lease_until = tonumber(r[4])
    if lease_until > now then
      return {'busy', lease_until - now, r[5]}
    end
    -- Still PROCESSING past its lease: the owner crashed or stalled.
    fence, takeover = tonumber(r[3]) + 1, 1
  end
elseif state == 'released' then
  -- release.lua kept the hash for exactly this: the fence goes on growing.
  fence = tonumber(r[3]) + 1
elseif state then
  -- A state this version does not know (a newer version's, a hand edit):
  -- claiming over it could run a body twice, so fail closed and touch nothing.
  return redis.error_reply(string.format(
    "IDEM_UNKNOWN_STATE record %s has an unknown state '%s'; left as it is",
    key, string.sub(state, 1, 64)))
elseif redis.call('EXISTS', key) == 1 then
  -- Only an absent record pays for this check. A hash without a state is not
  -- one of ours, or not whole: the same, fail closed.
  return redis.error_reply(string.format(
    'IDEM_UNKNOWN_STATE record %s exists but has no state; left as it is', key))
end

-- Integers as digits: Lua numbers are doubles, and a plain number argument to
-- redis.call could be formatted in exponent notation.
-- One HSET for every field, an empty fingerprint meaning none: a redis.call
-- costs more than the work it does, and a claim is on every request's path.
-- The record outlives its lease even when a caller asks for a ttl shorter
-- than the lease: Redis deleting a live claim would let a newcomer run the
-- body beside it. The ttl is kept for renew.lua, which counts it again from
-- each heartbeat.
local expires_at = string.format('%d', now + math.max(ttl, lease))
redis.call('HSET', key,
  'state', 'processing',
  'token', token,
  'fence', string.format('%d', fence),
  'lease_until', string.format('%d', now + lease),
  'expires_at', expires_at,
  'ttl', ARGV[3],
  'fingerprint', fp)
-- Redis itself deletes the record when its ttl ends.
redis.call('PEXPIREAT', key, expires_at)
return {'acquired', fence, takeover}
