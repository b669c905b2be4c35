-- unique_give_back: undo a claim whose publish did not happen and whose reply may have
-- been lost (the claim may still be buffered by a paused store and run later).
--
-- KEYS[1]  unique key
-- KEYS[2]  the give-back mark of this task id's claim (keys.given_back)
-- ARGV[1]  task id
-- ARGV[2]  how long the mark waits for a late claim, in milliseconds
-- returns  1 when the claim was there and freed, 0 when it was not (yet) written: then
--          the mark makes the late claim write nothing (unique_claim)

if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  return 1
end
redis.call('SET', KEYS[2], '1', 'PX', ARGV[2])
return 0
