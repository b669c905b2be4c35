-- cancel_id: the cancel record of one task id (baton.cancel(task_id)): any delivery of
-- that id, wherever its message is, is revoked by the worker that receives it, for as
-- long as the record lives. Then the workers are told (the notice channel).
--
-- KEYS[1]  the id's cancel record (its hash tag is the id: found from the id alone)
-- KEYS[2]  (optional) the id's held-for-later mark (held_for_later.lua; same hash tag)
-- ARGV[1]  how long it is kept, ms (a record that lives longer keeps its expiry)
-- ARGV[2]  the notice channel
-- ARGV[3]  the notice (core/cancels.py: cancel_notice)
-- returns  the unique key a worker holds the task under while it waits for its time
--          (read in the same step as the record is written: held_start.lua), else ''

local call = redis.call
local ttl_ms = tonumber(ARGV[1])
local left = call('PTTL', KEYS[1])
if left > ttl_ms then ttl_ms = left end
call('SET', KEYS[1], '1', 'PX', ttl_ms)
call('PUBLISH', ARGV[2], ARGV[3])
if KEYS[2] then
  return call('GET', KEYS[2]) or ''
end
return ''
