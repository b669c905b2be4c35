-- batch_end: the request that carried a batch into the pool ended (its runner's main
-- process saw it leave). A run that did not mark its calls done (the pool process died,
-- a time limit) gives them back to the waiting ones; the carrier's own call leaves the
-- key unless done: its message is Celery's now (acked as failed, or requeued and
-- registered again when delivered).
--
-- KEYS[1] pending   KEYS[2] calls   KEYS[3] holder   KEYS[4] workers
-- KEYS[5] claimed   KEYS[6] done    KEYS[7] run      KEYS[8] finished
-- ARGV[1] the run's id   ARGV[2] the carrier's call id
-- returns 1 when the run's calls were given back, 0 when it had ended (done or lapsed).

local gave_back = 0
if redis.call('GET', KEYS[7]) == ARGV[1] then
  local back = redis.call('ZRANGE', KEYS[5], 0, -1, 'WITHSCORES')
  for i = 1, #back, 2 do
    redis.call('ZADD', KEYS[1], back[i + 1], back[i])
  end
  redis.call('DEL', KEYS[5])
  redis.call('DEL', KEYS[7])
  gave_back = 1
end
if not redis.call('ZSCORE', KEYS[6], ARGV[2]) then
  redis.call('ZREM', KEYS[1], ARGV[2])
  redis.call('ZREM', KEYS[5], ARGV[2])
  redis.call('HDEL', KEYS[2], ARGV[2])
  redis.call('HDEL', KEYS[3], ARGV[2])
end
return gave_back
