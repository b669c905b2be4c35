-- unique_replace: a publish with unique_conflict "replace" takes the unique key from the
-- task that holds it. Its message was sent before this call: a publisher that dies in
-- between leaves both messages to run, never neither.
--
-- KEYS[1]  unique key
-- KEYS[2]  the replacing task id's marker (gate.lua "N"): 'q' while it is queued
-- KEYS[3]  the marker of the task id the caller believes holds the key (any key of the
--          family when it believes nobody does: then it is never read)
-- ARGV[1]  replacing task id
-- ARGV[2]  the task id the caller believes holds the key ('' : nobody)
-- ARGV[3]  ttl in milliseconds, of the claim and of the markers
-- returns  {status, holder}:
--          'claimed'     nobody held the key (or this task id did): now this task id does
--          'superseded'  holder was queued: it will never run (its marker names ARGV[1])
--          'running'     holder started already (or was published without "replace", so
--                        nothing stops it): it goes on; the key is this task id's now
--          'moved'       another task id than ARGV[2] holds the key: call again with it

local holder = redis.call('GET', KEYS[1])
local me, ttl = ARGV[1], ARGV[3]
if holder and holder ~= me and holder ~= ARGV[2] then
  return {'moved', holder}
end
-- NX: the worker may have started this task already (marker 'run').
redis.call('SET', KEYS[2], 'q', 'NX', 'PX', ttl)
redis.call('SET', KEYS[1], me, 'PX', ttl)
if not holder or holder == me then
  return {'claimed', ''}
end
if redis.call('GET', KEYS[3]) == 'q' then
  redis.call('SET', KEYS[3], me, 'PX', ttl)
  return {'superseded', holder}
end
return {'running', holder}
