-- limit_give_back: return what a gate call took from named limits whose keys live on
-- another Redis Cluster slot than the task's own, when the task's own call then refused
-- (reserve-then-confirm; see Gate.decide). Never gives back more than was taken:
--
-- KEYS[i]   a weighted rate key ("W" in gate.lua) the refused call moved
-- ARGV[i]   "<increment_us> <deadline_us>": the increment it added, and the instant
--           before which the key's TAT cannot have run out since it was written (the
--           write's server time + the increment). Past it, another call may have found
--           the TAT in the past and started from its own now: subtracting then could
--           give back capacity that was never taken, so nothing is given back (a
--           refused call then costs at most its own increment, never an over-admission).
-- returns   how many keys were given back

local t = redis.call('TIME')
local now_us = t[1] * 1000000 + t[2]
local given = 0
for i = 1, #KEYS do
  local increment, deadline = string.match(ARGV[i], '^(%d+) (%d+)$')
  local tat = tonumber(redis.call('GET', KEYS[i]))
  if tat and now_us < tonumber(deadline) then
    redis.call('SET', KEYS[i], string.format('%d', tat - tonumber(increment)), 'KEEPTTL')
    given = given + 1
  end
end
return given
