-- cancel_key: a cancel of every call of one key of a task published until now
-- (baton.cancel(task=..., key={...})). The worker that receives such a call matches its
-- arguments and its publish time against the members (core/cancels.py: KeyCancel).
--
-- KEYS[1]  the task's key cancels: a sorted set, member "<cut ms> <key JSON>" (calls
--          published at or before the cut are cancelled), score: until (ms, the
--          server's clock) it is kept
-- ARGV[1]  how long it is kept, ms
-- ARGV[2]  the member
-- ARGV[3]  the notice channel
-- ARGV[4]  the notice (core/cancels.py: cancel_notice)
-- returns  the number of live key cancels of the task

local call, format = redis.call, string.format
local t = call('TIME')
local now_ms = t[1] * 1000 + (t[2] - t[2] % 1000) / 1000
local until_ms = now_ms + tonumber(ARGV[1])
call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now_ms)  -- the expired ones go
local old = tonumber(call('ZSCORE', KEYS[1], ARGV[2]) or '0') or 0
if old < until_ms then call('ZADD', KEYS[1], format('%d', until_ms), ARGV[2]) end
local last = call('ZRANGE', KEYS[1], -1, -1, 'WITHSCORES')
call('PEXPIRE', KEYS[1], tonumber(last[2]) - now_ms)
call('PUBLISH', ARGV[3], ARGV[4])
return call('ZCARD', KEYS[1])
