-- beat_remove: delete an entry, its history and its unsent outbox items.
--
-- KEYS[1]  entry hash       KEYS[2]  names set        KEYS[3]  leader hash
-- KEYS[4]  version counter  KEYS[5]  history list     KEYS[6]  outbox hash
-- ARGV[1]  owner token, or '' for the runtime API (no leader check)
-- ARGV[2]  fence            ARGV[3]  entry name
-- ARGV[4]  'config': remove only an entry that does not come from the API (the
--          leader dropping entries gone from beat_schedule); 'api': only one that does
-- ARGV[5]  the calling app's schedule name: an entry another app defined is never
--          removed (each app's keys are its own; this holds even if two names met)
--
-- Returns 1 removed; 0 not the leader; -2 no such entry; -3 wrong source;
-- -4 defined by another app.
if ARGV[1] ~= '' and (redis.call('HGET', KEYS[3], 'owner') ~= ARGV[1]
    or redis.call('HGET', KEYS[3], 'fence') ~= ARGV[2]) then
  return 0
end
local source = redis.call('HGET', KEYS[1], 'source')
if not source then
  redis.call('SREM', KEYS[2], ARGV[3])
  return -2
end
if (ARGV[4] == 'api') ~= (source == 'api') then return -3 end
local app = redis.call('HGET', KEYS[1], 'app')
if app and app ~= ARGV[5] then return -4 end
redis.call('DEL', KEYS[1], KEYS[5])
redis.call('SREM', KEYS[2], ARGV[3])
local outbox = redis.call('HGETALL', KEYS[6])
for i = 1, #outbox, 2 do
  if cjson.decode(outbox[i + 1])['entry'] == ARGV[3] then
    redis.call('HDEL', KEYS[6], outbox[i])
  end
end
redis.call('INCR', KEYS[4])
return 1
