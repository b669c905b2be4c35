-- limit_penalize: hold every admission under a named limit until now + ARGV[1] (a 429's
-- Retry-After, seen by one worker, stops all of them). Only ever extends a penalty.
--
-- KEYS[1]   the named limit's penalty key (gate.lua, kind "P")
-- ARGV[1]   the penalty in microseconds
-- returns   the instant the penalty ends (us, server clock), extended or not

local t = redis.call('TIME')
local now_us = t[1] * 1000000 + t[2]
local until_us = now_us + tonumber(ARGV[1])
local current = tonumber(redis.call('GET', KEYS[1]))
if current and current >= until_us then
  return current
end
redis.call('SET', KEYS[1], string.format('%d', until_us),
  'PX', string.format('%d', (until_us - now_us) / 1000 + 1))
return until_us
