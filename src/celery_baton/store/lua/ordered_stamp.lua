-- ordered_stamp: the place of one publish in its ordered key's line (ordered=, see
-- gate/ordered.lua for the record and core/ordered.py for the whole story): the next
-- position, one more than the last one given (when that is the next to start, the key
-- was idle: its gap clock starts at this publish). The record is created at the first
-- publish (or again after it was lost: a new epoch, so that a worker tells the calls
-- stamped under the old one from those of the new), and lives ORDERED_TTL_MS past its
-- last publish or advance.
--
-- KEYS[1]  the key's order record (a hash: e epoch, n last position given, q the next
--          position to start, t since when q's gap clock runs, ms; gate/ordered.lua)
-- ARGV[1]  the record's life in milliseconds
-- ARGV[2]  the key in words (what its digest was made of), kept as k for the operator
-- returns  {epoch, position}, both decimal strings

local call = redis.call
local t = call('TIME')
local now_ms = string.format('%d', t[1] * 1000 + math.floor(t[2] / 1000))
local e = call('HGET', KEYS[1], 'e')
if not e then
  e = t[1] .. string.rep('0', 6 - #t[2]) .. t[2]
  call('HSET', KEYS[1], 'e', e, 'q', '1', 'n', '0', 't', now_ms, 'k', ARGV[2])
end
local seq = call('HINCRBY', KEYS[1], 'n', 1)
if seq == tonumber(call('HGET', KEYS[1], 'q')) then
  -- The key was idle: this position is next from now, and its gap clock starts now
  -- (not when the call before it ended, which may be longer ago than the gap bound).
  call('HSET', KEYS[1], 't', now_ms)
end
call('PEXPIRE', KEYS[1], ARGV[1])
return {e, string.format('%d', seq)}
