-- supersede_stamp: the publish order of one publish of an exclusive key whose duplicates
-- supersede each other (exclusive_conflict "replace" / "keep_last"; see gate.lua "S").
-- Strictly increasing per key and never below the server's clock (us), so it still
-- grows after the record expired.
--
-- KEYS[1]  the key's order record (a hash; field n: the last order given)
-- returns  the order, as a decimal string

local t = redis.call('TIME')
local now_us = t[1] * 1000000 + t[2]
local seq = math.max((tonumber(redis.call('HGET', KEYS[1], 'n')) or 0) + 1, now_us)
local text = string.format('%d', seq)
redis.call('HSET', KEYS[1], 'n', text)
redis.call('PEXPIRE', KEYS[1], 86400000)
return text
