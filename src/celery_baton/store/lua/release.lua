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
-- ARGV[7]     (with ARGV[3] > 0) the stamp of the publish whose run finished ('' : none)
-- returns     number of leases this owner actually held and freed
--
-- The done marker is a sorted set of the task id's publishes that finished: member the
-- publish stamp, score when it is forgotten (ms, the server's clock); the key lives as
-- long as its latest member (gate.lua, "D", reads it). At most MAX_STAMPS are kept (a
-- task that replaces itself in a loop publishes its id again and again): the oldest go.
local MAX_STAMPS = 1000

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
  local key, stamp = KEYS[next_key], ARGV[7] or ''
  local t = redis.call('TIME')
  local now_ms = t[1] * 1000 + math.floor(t[2] / 1000)
  local forget_at = string.format('%d', now_ms + done_ttl)
  if type(redis.pcall('ZADD', key, forget_at, stamp)) == 'table' then
    redis.call('DEL', key)  -- an older version's marker (a string)
    redis.call('ZADD', key, forget_at, stamp)
  end
  redis.call('ZREMRANGEBYSCORE', key, '-inf', string.format('%d', now_ms))
  local count = redis.call('ZCARD', key)
  if count > MAX_STAMPS then redis.call('ZREMRANGEBYRANK', key, 0, count - MAX_STAMPS - 1) end
  if redis.call('PTTL', key) < done_ttl then redis.call('PEXPIRE', key, done_ttl) end
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
