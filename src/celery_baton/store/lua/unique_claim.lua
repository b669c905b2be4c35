-- unique_claim: claim a unique key for a task id at publish time.
--
-- KEYS[1]  unique key
-- KEYS[2]  the give-back mark of this task id's claim (keys.given_back)
-- ARGV[1]  task id of the message about to be published
-- ARGV[2]  ttl in milliseconds (bounded: a message lost by the broker frees it eventually)
-- returns  '' when claimed (or already held by this task id, as when a task retries),
--          else the task id that holds it
--
-- A claim whose publisher gave up waiting for this reply (the store was paused, and ran
-- the call when it resumed) was given back already: unique_give_back left a mark, and
-- the late claim writes nothing, so no later publish is deduplicated into a message
-- that was never sent.

if redis.call('DEL', KEYS[2]) == 1 then
  return ''
end
local holder = redis.call('GET', KEYS[1])
if holder and holder ~= ARGV[1] then
  return holder
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return ''
