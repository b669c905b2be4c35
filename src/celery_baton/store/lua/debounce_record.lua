-- debounce_record: a publish of a debounced task joins its key's burst, as the latest.
--
-- Called by the publisher AFTER the message was handed to the broker, so every id this
-- store names as a burst's latest exists as a message: a publisher killed between the
-- two steps leaves a message the store never heard of, and the worker adopts it on
-- arrival (debounce_decide.lua) -- an extra run at worst, never a lost one.
--
-- KEYS[1]  the key's state hash: latest (task id), first, last (ms, the store's clock)
-- KEYS[2]  the set of the open burst's task ids (the latest included)
-- KEYS[3]  ran: task id -> the id of the run that covered it (closed bursts)
-- KEYS[4]  ran0: the previous generation of ran (read only here)
-- ARGV[1]  task id of the message just sent
-- ARGV[2]  retention in milliseconds (how long the store remembers the burst)
-- ARGV[3]  notice channel ('' none): the previous latest's holder is woken to learn it
--          was superseded
-- returns  1 recorded as the latest; 0 already known (a worker adopted it first, or it
--          ran already): nothing written

local id = ARGV[1]
if redis.call('SISMEMBER', KEYS[2], id) == 1 or redis.call('HEXISTS', KEYS[3], id) == 1
    or redis.call('HEXISTS', KEYS[4], id) == 1 then
  return 0
end
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
local previous = redis.call('HGET', KEYS[1], 'latest')
if not previous then
  redis.call('HSET', KEYS[1], 'first', now)
end
redis.call('HSET', KEYS[1], 'latest', id, 'last', now)
redis.call('SADD', KEYS[2], id)
redis.call('PEXPIRE', KEYS[1], ARGV[2])
redis.call('PEXPIRE', KEYS[2], ARGV[2])
if previous and ARGV[3] ~= '' then
  redis.call('PUBLISH', ARGV[3], KEYS[1])
end
return 1
