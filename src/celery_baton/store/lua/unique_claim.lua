-- unique_claim: claim a unique key for a task id at publish time.
--
-- KEYS[1]  unique key
-- KEYS[2]  the give-back mark of this task id's claim (keys.given_back)
-- KEYS[3]  (optional) where the key's words are kept (store/inspect.label_key)
-- ARGV[1]  task id of the message about to be published
-- ARGV[2]  ttl in milliseconds (bounded: a message lost by the broker frees it eventually)
-- ARGV[3]  (optional) the moment its publisher stops waiting for the reply, in ms of
--          this server's clock (0 or absent: none)
-- ARGV[4]  (optional, with KEYS[3]) the key in words (keys.words), for `locks` and the
--          web view: written with the claim, for as long
-- returns  '' when claimed (or already held by this task id, as when a task retries),
--          -1 when run after ARGV[3] (nothing written), else the task id that holds it
--
-- A claim run after its publisher gave up (the store was paused with it in its input
-- buffer) writes nothing: the publish failed, and its message is never sent. Without
-- this, the claim held the key until the publisher's give-back landed, and a publish
-- from another process in between was deduplicated into the message never sent (the
-- 30-minute soak, seed 1106).
--
-- A claim whose publisher gave up waiting for this reply, and that the store still ran
-- before ARGV[3] (the publisher's reading of this clock was off), was given back:
-- unique_give_back left a mark, and the late claim writes nothing, so no later publish
-- is deduplicated into a message that was never sent.

local deadline = tonumber(ARGV[3] or '0') or 0
if deadline > 0 then
  local t = redis.call('TIME')
  if t[1] * 1000 + math.floor(t[2] / 1000) > deadline then
    return -1
  end
end
if redis.call('DEL', KEYS[2]) == 1 then
  return ''
end
local holder = redis.call('GET', KEYS[1])
if holder and holder ~= ARGV[1] then
  return holder
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
if KEYS[3] and ARGV[4] and ARGV[4] ~= '' then
  redis.call('SET', KEYS[3], ARGV[4], 'PX', ARGV[2])
end
return ''
