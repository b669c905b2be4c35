-- limit_give_back: return what a gate call took from named limits whose keys live on
-- another Redis Cluster slot than the task's own, when the task's own call then refused
-- (reserve-then-confirm; see Gate.decide). Never gives back more than was taken:
--
-- KEYS[i]   a weighted rate key ("W" in gate.lua) the refused call moved
-- ARGV[i]   "<increment_us> <deadline_us>": the increment it added, and the instant
--           before which the key's TAT cannot have run out since it was written (the
--           write's server time + the increment).
-- Only what is left of the increment at the give-back, `deadline - now`, is returned.
-- A take that came after the write, at its own now t, may have counted from the TAT
-- this write had moved; had the write never been, that take would have counted from
-- no earlier than t. So the TAT without the write is at most `now - written` above
-- `TAT - increment`: giving back the whole increment could set it lower than that and
-- let the next take through early (an over-admission). Past the deadline nothing is
-- given back (a refused call then costs at most its own increment).
-- returns   how many keys were given back (in part or whole)

local t = redis.call('TIME')
local now_us = t[1] * 1000000 + t[2]
local given = 0
for i = 1, #KEYS do
  local increment, deadline = string.match(ARGV[i], '^(%d+) (%d+)$')
  local back = math.min(tonumber(increment), tonumber(deadline) - now_us)
  local tat = tonumber(redis.call('GET', KEYS[i]))
  if tat and back > 0 then
    redis.call('SET', KEYS[i], string.format('%d', tat - back), 'KEEPTTL')
    given = given + 1
  end
end
return given
