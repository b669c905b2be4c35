-- beat_define: create or update one entry's stored definition.
--
-- The next slot is set only for a new entry, an edited one (its fingerprint, i.e.
-- *when* it fires, changed) or one whose next slot was cleared (resumed); otherwise
-- the stored next slot stays, so restarting beat with an unchanged schedule never
-- fires anything extra, and an edit never fires at once (the next slot is computed
-- from now by the caller).
--
-- KEYS[1]  entry hash      KEYS[2]  names set      KEYS[3]  leader hash
-- KEYS[4]  version counter KEYS[5]  entry's history list
-- ARGV[1]  owner token, or '' for the runtime API (no leader check)
-- ARGV[2]  fence (ignored when ARGV[1] is '')
-- ARGV[3]  mode: 'sync' (leader; create or update, any source), 'add' (API; fails if
--          the entry exists), 'update' (API; fails unless it exists from the API)
-- ARGV[4]  entry name       ARGV[5]  fingerprint
-- ARGV[6]  next slot (ms) to use if the schedule is new or changed
-- ARGV[7]  history line recorded on an edit      ARGV[8]  history length bound
-- ARGV[9..] field, value pairs to store as they are (source, task, def, policy...)
--
-- Returns {status, next slot, changed (1/0)}: status 1 done; 0 not the leader;
-- -1 exists (add); -2 missing (update); -3 entry is not from the API (update).
if ARGV[1] ~= '' and (redis.call('HGET', KEYS[3], 'owner') ~= ARGV[1]
    or redis.call('HGET', KEYS[3], 'fence') ~= ARGV[2]) then
  return {0, '', 0}
end
local exists = redis.call('EXISTS', KEYS[1]) == 1
local cur = redis.call('HMGET', KEYS[1], 'next', 'fp', 'source')
if ARGV[3] == 'add' and exists then return {-1, cur[1] or '', 0} end
if ARGV[3] == 'update' then
  if not exists then return {-2, '', 0} end
  if cur[3] ~= 'api' then return {-3, cur[1] or '', 0} end
end
local changed = 0
for i = 9, #ARGV, 2 do
  if redis.call('HGET', KEYS[1], ARGV[i]) ~= ARGV[i + 1] then
    redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1])
    changed = 1
  end
end
local next_slot = cur[1]
if not exists or cur[2] ~= ARGV[5] or not next_slot or next_slot == '' then
  if exists and cur[2] and cur[2] ~= ARGV[5] then
    redis.call('LPUSH', KEYS[5], ARGV[7])
    redis.call('LTRIM', KEYS[5], 0, tonumber(ARGV[8]) - 1)
  end
  next_slot = ARGV[6]
  redis.call('HSET', KEYS[1], 'next', next_slot, 'fp', ARGV[5])
  changed = 1
end
redis.call('SADD', KEYS[2], ARGV[4])
if changed == 1 then redis.call('INCR', KEYS[4]) end
return {1, next_slot, changed}
