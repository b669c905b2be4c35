-- beat_claim: claim due slots of one entry and advance it, atomically.
--
-- This is what makes each slot fire once: only the current leader (owner AND fence
-- match) can claim, and only from the next slot it expects (so two beats, or a beat
-- with a stale view after an edit or a failover, can never claim a slot twice). The
-- claimed slots go to the outbox in the same step; the caller publishes them under
-- task ids derived from (entry, slot) and then calls beat_sent. A new leader re-sends
-- whatever is still in the outbox, under the same ids.
--
-- KEYS[1]  leader hash
-- KEYS[2]  entry hash
-- KEYS[3]  outbox hash (task id -> JSON {entry, slot, kind})
-- KEYS[4]  entry's history list (newest first)
-- ARGV[1]  owner token          ARGV[2]  fence
-- ARGV[3]  expected next slot (ms); ignored for a trigger
-- ARGV[4]  expected fingerprint
-- ARGV[5]  new next slot (ms), or '' to leave it (a trigger)
-- ARGV[6]  expected trigger value, or '' when this is not a trigger
-- ARGV[7]  last slot to record, or ''       ARGV[8]  last task id to record, or ''
-- ARGV[9]  history length bound
-- ARGV[10] fired count      ARGV[11] missed count      ARGV[12] suppressed count
-- ARGV[13] expected last slot ('' none yet; '*' not checked): each fired slot's message
--          names the entry's fired slot before it (policy/slot_runs.py), so that one
--          must be the stored one
-- ARGV[14] n outbox pairs, then n * (task id, JSON)
-- then     n history lines, then that many JSON lines (oldest first)
--
-- Returns {1} claimed; {0} not the leader; {-1, next, trigger} the slot moved;
-- {-2} no such entry; {-3, fp} the fingerprint changed; {-4} paused.
if redis.call('HGET', KEYS[1], 'owner') ~= ARGV[1]
    or redis.call('HGET', KEYS[1], 'fence') ~= ARGV[2] then
  return {0}
end
if redis.call('EXISTS', KEYS[2]) == 0 then return {-2} end
local cur = redis.call('HMGET', KEYS[2], 'next', 'fp', 'paused', 'trigger', 'last_slot')
if cur[2] ~= ARGV[4] then return {-3, cur[2] or ''} end
if ARGV[13] ~= '*' and (cur[5] or '') ~= ARGV[13] then return {-1, cur[1] or '', cur[4] or ''} end
if ARGV[6] ~= '' then
  if cur[4] ~= ARGV[6] then return {-1, cur[1] or '', cur[4] or ''} end
  redis.call('HDEL', KEYS[2], 'trigger')
else
  if cur[3] == '1' then return {-4} end
  if cur[1] ~= ARGV[3] then return {-1, cur[1] or '', cur[4] or ''} end
  redis.call('HSET', KEYS[2], 'next', ARGV[5])
end
if ARGV[7] ~= '' then redis.call('HSET', KEYS[2], 'last_slot', ARGV[7]) end
if ARGV[8] ~= '' then redis.call('HSET', KEYS[2], 'last_id', ARGV[8]) end
if ARGV[10] ~= '0' then redis.call('HINCRBY', KEYS[2], 'fired', ARGV[10]) end
if ARGV[11] ~= '0' then redis.call('HINCRBY', KEYS[2], 'missed', ARGV[11]) end
if ARGV[12] ~= '0' then redis.call('HINCRBY', KEYS[2], 'suppressed', ARGV[12]) end
local i = 14
local n = tonumber(ARGV[i])
for j = 1, n do
  redis.call('HSET', KEYS[3], ARGV[i + 2 * j - 1], ARGV[i + 2 * j])
end
i = i + 2 * n + 1
n = tonumber(ARGV[i])
for j = 1, n do
  redis.call('LPUSH', KEYS[4], ARGV[i + j])
end
if n > 0 then redis.call('LTRIM', KEYS[4], 0, tonumber(ARGV[9]) - 1) end
return {1}
