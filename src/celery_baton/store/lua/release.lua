-- release: free a run's leases (owner compared: never another owner's), and optionally
-- mark its task id done and free its unique claim (or keep it a while longer, for the
-- copy of a message whose ack failed). Publishes each freed lease key on the notice
-- channel, when someone waits for it, so that held requests wake at once instead of
-- polling.
--
-- KEYS[1..n]  lease keys held by ARGV[1]
-- KEYS[n+1]   (optional) done-marker key, when ARGV[3] > 0
-- KEYS[n+2]   (optional) unique key, when ARGV[4] ~= ''
-- ARGV[1]     owner
-- ARGV[2]     n: number of lease keys
-- ARGV[3]     done-marker ttl in milliseconds (0: do not mark)
-- ARGV[4]     task id owning the unique key ('' : leave it)
-- ARGV[5]     notice channel
-- ARGV[6]     (optional) > 0: keep the unique claim this many ms instead of freeing it
-- returns     number of leases this owner actually held and freed

local owner_field = 'o:' .. ARGV[1]
local n = tonumber(ARGV[2])
local done_ttl = tonumber(ARGV[3])
local unique_owner = ARGV[4]
local freed = 0
for i = 1, n do
  if redis.call('HDEL', KEYS[i], owner_field) == 1 then
    freed = freed + 1
    -- Only when the gate saw someone wait for this key: most releases have no waiter.
    if redis.call('HDEL', KEYS[i], '_w') == 1 then
      redis.call('PUBLISH', ARGV[5], KEYS[i])
    end
  end
end
local next_key = n + 1
if done_ttl > 0 then
  local task_id = string.match(ARGV[1], '^([^|]*)')
  redis.call('SET', KEYS[next_key], task_id, 'PX', done_ttl)
  next_key = next_key + 1
end
if unique_owner ~= '' and redis.call('GET', KEYS[next_key]) == unique_owner then
  local keep_ms = tonumber(ARGV[6] or '0') or 0
  if keep_ms > 0 then
    redis.call('PEXPIRE', KEYS[next_key], keep_ms)
  else
    redis.call('DEL', KEYS[next_key])
  end
end
return freed
