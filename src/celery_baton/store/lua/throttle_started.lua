-- throttle_started: a throttled run starts late (its pool process took it late): its
-- window counts from its start, not from its admission.
--
-- Called by the pool process just before the run starts, when it starts later than its
-- admission by more than a hand-over takes (worker/pool/throttle_start.py).
--
-- KEYS[1]  the key's state hash (throttle_decide.lua): until (ms), runner, pending
-- ARGV[1]  the run's task id
-- ARGV[2]  the window in milliseconds
-- ARGV[3]  retention in milliseconds
-- returns  {1}       start now: the key's window runs from now (never shortened)
--          {0, ms}   another run opened a window after this one's ran out: ask
--                    again in ms (when it ends)

local id, window, retention = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
local state = redis.call('HMGET', KEYS[1], 'until', 'runner')
local until_ms, runner = tonumber(state[1]), state[2]

if runner ~= id and until_ms ~= nil and now < until_ms then
  return {0, until_ms - now}
end
-- Its own window (moved to now), or none open: this start opens one. A pending
-- trailing delivery is left as it is; it asks again when this window ends.
if until_ms == nil or now + window > until_ms then
  redis.call('HSET', KEYS[1], 'until', now + window, 'runner', id)
  redis.call('PEXPIRE', KEYS[1], window + retention)
end
return {1}
