-- beat_mark: pause, resume or trigger one entry (the runtime API).
--
-- KEYS[1]  entry hash       KEYS[2]  version counter
-- ARGV[1]  'pause' | 'resume' | 'trigger'
--
-- pause sets the paused flag; resume clears it and clears the next slot, so the
-- leader computes it from now (slots passed while paused are not run); trigger asks
-- the leader to fire one extra run now, stamped with the server's time.
-- Returns 1 done, or 0 when there is no such entry.
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
if ARGV[1] == 'pause' then
  redis.call('HSET', KEYS[1], 'paused', '1')
elseif ARGV[1] == 'resume' then
  if redis.call('HGET', KEYS[1], 'paused') == '1' then
    redis.call('HDEL', KEYS[1], 'paused')
    redis.call('HSET', KEYS[1], 'next', '')
  end
else
  local t = redis.call('TIME')
  -- Epoch milliseconds as a string (a Lua number would be stored as a float).
  local now = t[1] .. string.format('%03d', math.floor(tonumber(t[2]) / 1000))
  redis.call('HSET', KEYS[1], 'trigger', now)
end
redis.call('INCR', KEYS[2])
return 1
