-- reclaim.lua: the rare path of a claim (Store::claim), run only when the
-- plain `SET … NX PX … GET` of claim.rs found a record it could not settle by
-- reading it: RELEASED, or PROCESSING under another token.
--
-- KEYS[1]  the record's key
-- KEYS[2]  (a recoverable claim only) the record's recovery hash
-- ARGV[1]  the PROCESSING head the claim wrote: 'P1' token[16] fingerprint
-- ARGV[2]  lease, milliseconds
-- ARGV[3]  ttl, milliseconds
-- ARGV[4]  (a recoverable claim only) the call's scope
-- ARGV[5]  (a recoverable claim only) its sealed arguments
--
-- A recoverable claim (recovery.rs) comes here at once, absent key included,
-- so its arguments are written with the claim, by the same script.
--
-- Returns one of
--   {'acquired', fence, takeover (0 or 1)}
--   {'busy', lease remaining in ms, fingerprint ('' for none)}
--   {'done', the DONE record}
-- or an IDEM_UNREADABLE error (the record is left untouched).
--
-- It reads again: the record may have changed since the SET saw it. The lease
-- of a PROCESSING record ends `margin` ms before its key expires (record.rs),
-- so PTTL alone says whether it has run out; no clock is read. A takeover or
-- a claim over a RELEASED record counts on from the fence in the value, so
-- fences never go backwards while the key lives.

local key, head = KEYS[1], ARGV[1]
local lease, ttl = tonumber(ARGV[2]), tonumber(ARGV[3])
local token = string.sub(head, 3, 18)

local function unreadable()
  return redis.error_reply(string.format(
    'IDEM_UNREADABLE record %s holds a value this version cannot read; left as it is', key))
end

-- GET fails with WRONGTYPE on a value that is not a string (a hash of the
-- earlier layout): the error reaches the caller, nothing is written.
local v = redis.call('GET', key)
local fence, takeover = 1, 0
if v then
  local kind = string.sub(v, 1, 2)
  if kind == 'D1' then
    return {'done', v}
  elseif kind == 'R1' then
    local f = string.match(v, '^R1(%d+)$')
    if not f then return unreadable() end
    fence = tonumber(f) + 1
  elseif kind == 'P1' then
    local marker = string.sub(v, 19, 19)
    local at = (marker == '#') and 52 or 20
    local f, margin = string.match(v, '^(%d+):%d+:(%d+)$', at)
    if (marker ~= '#' and marker ~= '-') or not f then return unreadable() end
    if string.sub(v, 3, 18) == token then
      -- The same claim re-sent (the cluster client retries after an I/O
      -- error): it is ours.
      return {'acquired', tonumber(f), 0}
    end
    local remaining = redis.call('PTTL', key) - tonumber(margin)
    if remaining > 0 then
      return {'busy', remaining, string.sub(v, 20, at - 1)}
    end
    -- Still PROCESSING past its lease: the owner crashed or stalled.
    fence, takeover = tonumber(f) + 1, 1
  else
    return unreadable()
  end
end

-- As claim.rs writes it: the key lives max(ttl, lease), the lease ends
-- `margin` before that. Integers as digits: a Lua number may print as 1e+15.
local lives = math.max(ttl, lease)
redis.call('SET', key,
  head .. string.format('%d:%d:%d', fence, ttl, lives - lease),
  'PX', string.format('%d', lives))
if KEYS[2] then
  -- The arguments, under this claim's token. A takeover continues the
  -- abandoned call: its count, backoff and parking stay; any other claim
  -- starts them afresh. The hash lives as long as the claim's record.
  local hash = KEYS[2]
  if takeover == 0 then
    redis.call('DEL', hash)
  end
  redis.call('HSET', hash, 'token', token, 'scope', ARGV[4], 'args', ARGV[5])
  redis.call('HSETNX', hash, 'attempts', '0')
  redis.call('HSETNX', hash, 'next_at', '0')
  redis.call('PEXPIRE', hash, string.format('%d', lives))
end
return {'acquired', fence, takeover}
