-- throttle_decide: may this delivery of a throttled task run now?
--
-- Leading edge: the first delivery of a quiet key runs at once and opens a window.
-- Within the window, mode "drop" skips every other delivery; mode "trailing" keeps the
-- newest one (the ones before it are superseded) and runs it when the window ends,
-- which opens the next window.
--
-- KEYS[1]  the key's state hash: until (ms, the window's end), runner, pending
-- KEYS[2]  the set of task ids superseded by the pending trailing delivery
-- ARGV[1]  the delivery's task id
-- ARGV[2]  the window in milliseconds
-- ARGV[3]  mode: "drop" or "trailing"
-- ARGV[4]  retention in milliseconds
-- ARGV[5]  notice channel ('' none)
-- returns  {1, id...}  run now (opens a window); the ids are those it stands for
--          {0, ms}     wait: the pending trailing delivery; ask again in ms
--          {2, id}     skip: dropped (id: the window's run) or superseded (id: the
--                      pending delivery that stands for it)

local id, window, mode, retention = ARGV[1], tonumber(ARGV[2]), ARGV[3], ARGV[4]
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
local state = redis.call('HMGET', KEYS[1], 'until', 'runner', 'pending')
local until_ms, runner, pending = tonumber(state[1]), state[2], state[3]

if until_ms == nil or now >= until_ms then
  -- No open window: this one runs and opens one. A pending trailing delivery that has
  -- not asked yet is covered by this run (newer arguments, same moment).
  local reply = {1}
  if pending and pending ~= id then reply[#reply + 1] = pending end
  for _, other in ipairs(redis.call('SMEMBERS', KEYS[2])) do
    if other ~= id then reply[#reply + 1] = other end
  end
  redis.call('DEL', KEYS[2])
  redis.call('HDEL', KEYS[1], 'pending')
  redis.call('HSET', KEYS[1], 'until', now + window, 'runner', id)
  redis.call('PEXPIRE', KEYS[1], window + tonumber(retention))
  if pending and pending ~= id and ARGV[5] ~= '' then redis.call('PUBLISH', ARGV[5], KEYS[1]) end
  return reply
end

if runner == id then
  -- A redelivered copy of the window's run (its worker died): it runs again.
  return {1}
end
if mode ~= 'trailing' then
  return {2, runner}
end
if pending == id then
  return {0, until_ms - now}
end
if redis.call('SISMEMBER', KEYS[2], id) == 1 then
  return {2, pending}
end
if pending then
  redis.call('SADD', KEYS[2], pending)
  if ARGV[5] ~= '' then redis.call('PUBLISH', ARGV[5], KEYS[1]) end
end
redis.call('HSET', KEYS[1], 'pending', id)
redis.call('PEXPIRE', KEYS[1], window + tonumber(retention))
redis.call('PEXPIRE', KEYS[2], window + tonumber(retention))
return {0, until_ms - now}
