-- fair_leave: a worker no longer holds requests of a fair key it waited with (they left
-- while held: revoked, cancelled, skipped, handed back): its presence goes now instead
-- of lapsing fairness.PRESENCE after its last ask, which kept the key in the turn, ahead
-- of the others, with nothing of it waiting here. The key leaves the turn when no worker
-- holds it any more, its pass kept while ahead of vt (as gate/fair.lua's fair_leave).
--
-- KEYS[1]  the fairness hash (n:<key> workers holding <key>, vt)
-- KEYS[2]  the waiting keys by pass
-- KEYS[3]  presences "<key>|<worker>" by expiry (ms)
-- KEYS[4]  passes of keys that left ahead of vt
-- ARGV[1]  the fair key (a digest)
-- ARGV[2]  the owner its requests asked as (its worker: what follows the first "|")
-- returns  1 when this worker's presence was there (and went), else 0

local call = redis.call
local k = ARGV[1]
local worker = string.match(ARGV[2], '^[^|]*|([^|]*)') or ARGV[2]
if call('ZREM', KEYS[3], k .. '|' .. worker) == 0 then
  return 0
end
if call('HINCRBY', KEYS[1], 'n:' .. k, -1) <= 0 then
  call('HDEL', KEYS[1], 'n:' .. k)
  local pass = tonumber(call('ZSCORE', KEYS[2], k) or '0')
  call('ZREM', KEYS[2], k)
  if pass > tonumber(call('HGET', KEYS[1], 'vt') or '0') then
    call('ZADD', KEYS[4], pass, k)
  end
end
return 1
