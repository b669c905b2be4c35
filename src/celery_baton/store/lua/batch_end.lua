-- batch_end: the request that carried a batch into the pool ended (its runner's main
-- process saw it leave). A run that did not mark its calls done (the pool process died,
-- a time limit) gives them back to the waiting ones; the carrier's own call leaves the
-- key unless done: its message is Celery's now (acked as failed, or requeued and
-- registered again when delivered).
--
-- KEYS[1] pending   KEYS[2] calls   KEYS[3] holder   KEYS[4] workers
-- KEYS[5] claimed   KEYS[6] done    KEYS[7] runs     KEYS[8] finished   KEYS[9] epoch
-- KEYS[10] label (unused here)
-- KEYS[11] here (unused here)
-- ARGV[1] the run's id   ARGV[2] the carrier's call id
-- ARGV[3] how long a done call is remembered (ms; optional)
-- ARGV[4..] the batch's call ids when its body returned (its runner knows it ran): they
--   are done, whether or not batch_done's marker is here (written on a master that was
--   replaced since by a replica it had not reached, it is not)
-- returns {1 when the run's calls were given back, 0 when it had ended (done or lapsed);
--          how many of ARGV[4..] were not done here (their marker lost): done now}

-- @include batch/done.lua

local redone = 0
if #ARGV > 3 then
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  local keep = now + tonumber(ARGV[3])
  local inbox = {}
  for i = 4, #ARGV do
    local id = ARGV[i]
    if not redis.call('ZSCORE', KEYS[6], id) then
      redone = redone + 1
      local holder = mark_done(id, keep)
      if holder then
        to_inbox(inbox, holder, id)
      end
    end
  end
  tell_holders(inbox)
end
local gave_back = end_run(ARGV[1])
if not redis.call('ZSCORE', KEYS[6], ARGV[2]) then
  redis.call('ZREM', KEYS[1], ARGV[2])
  redis.call('HDEL', KEYS[5], ARGV[2])
  redis.call('HDEL', KEYS[2], ARGV[2])
  redis.call('HDEL', KEYS[3], ARGV[2])
end
return {gave_back, redone}
