-- unique_claim: claim a unique key for a task id at publish time.
--
-- KEYS[1]  unique key
-- ARGV[1]  task id of the message about to be published
-- ARGV[2]  ttl in milliseconds (bounded: a message lost by the broker frees it eventually)
-- returns  '' when claimed (or already held by this task id, as when a task retries),
--          else the task id that holds it

local holder = redis.call('GET', KEYS[1])
if holder and holder ~= ARGV[1] then
  return holder
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return ''
