-- batch_end: the request that carried a batch into the pool ended (its runner's main
-- process saw it leave). A run that did not mark its calls done (the pool process died,
-- a time limit) gives them back to the waiting ones; the carrier's own call leaves the
-- key unless done: its message is Celery's now (acked as failed, or requeued and
-- registered again when delivered).
--
-- KEYS[1] pending   KEYS[2] calls   KEYS[3] holder   KEYS[4] workers
-- KEYS[5] claimed   KEYS[6] done    KEYS[7] runs     KEYS[8] finished   KEYS[9] epoch
-- KEYS[10] label (unused here)
-- ARGV[1] the run's id   ARGV[2] the carrier's call id
-- returns 1 when the run's calls were given back, 0 when it had ended (done or lapsed).

local gave_back = 0
if redis.call('ZREM', KEYS[7], ARGV[1]) == 1 then
  local claimed = redis.call('HGETALL', KEYS[5])
  for i = 1, #claimed, 2 do
    local run, since = string.match(claimed[i + 1], '^(%S+) (%d+)$')
    if run == ARGV[1] then
      redis.call('HDEL', KEYS[5], claimed[i])
      redis.call('ZADD', KEYS[1], since, claimed[i])
    end
  end
  gave_back = 1
end
if not redis.call('ZSCORE', KEYS[6], ARGV[2]) then
  redis.call('ZREM', KEYS[1], ARGV[2])
  redis.call('HDEL', KEYS[5], ARGV[2])
  redis.call('HDEL', KEYS[2], ARGV[2])
  redis.call('HDEL', KEYS[3], ARGV[2])
end
return gave_back
