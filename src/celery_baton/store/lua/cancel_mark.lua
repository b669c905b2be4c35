-- cancel_mark: say, store-wide, that cancels of one kind live until a time, so that a
-- worker knows whether a delivery needs a cancel check at all (core/cancels.py). Written
-- BEFORE the cancel's record (cancel_id.lua, cancel_key.lua): a worker that reads the
-- marker without the record checks for nothing; never the other way round.
--
-- KEYS[1]  the cancel marker: a hash, field "id" or "key:<task>", value: until (ms,
--          the server's clock) cancels of that kind may live
-- ARGV[1]  the field
-- ARGV[2]  how long the cancel is kept, ms
-- returns  the field's until (ms), as a decimal string

local call, format = redis.call, string.format
local t = call('TIME')
local now_ms = t[1] * 1000 + (t[2] - t[2] % 1000) / 1000
local until_ms = now_ms + tonumber(ARGV[2])
local old = tonumber(call('HGET', KEYS[1], ARGV[1]) or '0') or 0
if old > until_ms then until_ms = old end
call('HSET', KEYS[1], ARGV[1], format('%d', until_ms))
-- A field whose cancels all expired goes; the hash lives as long as its latest field.
local latest = until_ms
local fields = call('HGETALL', KEYS[1])
for i = 1, #fields, 2 do
  local value = tonumber(fields[i + 1]) or 0
  if value <= now_ms then
    call('HDEL', KEYS[1], fields[i])
  elseif value > latest then
    latest = value
  end
end
call('PEXPIRE', KEYS[1], latest - now_ms)
return format('%d', until_ms)
