-- beat_missed: a worker did not run a beat slot it held (coalesced into a later slot of
-- its entry, or past its misfire grace): the entry counts it as missed, with a history
-- line, as the beat counts the slots it did not send (worker/misfire.py).
--
-- KEYS[1]  entry hash       KEYS[2]  history list (JSON lines, newest first)
-- ARGV[1]  the history line (JSON)    ARGV[2]  how many history lines are kept
--
-- Returns 1, or 0 when the entry is gone (removed meanwhile: nothing is written, so
-- no entry hash is made again for it).
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('HINCRBY', KEYS[1], 'missed', 1)
redis.call('LPUSH', KEYS[2], ARGV[1])
redis.call('LTRIM', KEYS[2], 0, tonumber(ARGV[2]) - 1)
return 1
