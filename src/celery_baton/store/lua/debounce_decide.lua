-- debounce_decide: may this delivery of a debounced task run now?
--
-- Asked by the worker's consumer for every delivery, before the gate.
--
-- KEYS[1..4]  as debounce_record.lua: state hash, open burst's ids, ran, ran0
-- ARGV[1]  the delivery's task id
-- ARGV[2]  debounce (quiet time) in milliseconds
-- ARGV[3]  max wait in milliseconds from the burst's first publish (0: none)
-- ARGV[4]  retention in milliseconds
-- ARGV[5]  notice channel ('' none)
-- returns  {1, id...}  run now: the burst is closed; the ids are the superseded task ids
--                      this run stands for (its outcome is written to each of them)
--          {0, ms}     wait: ask again in ms (the latest, not quiet yet; or adopted)
--          {2, id}     skip: superseded; id is the run that stands for it (the burst's
--                      latest, or the run that closed its burst)
-- A delivery the store does not know (its publisher died between the broker and this
-- store, or the record is still on its way) is adopted as the burst's latest.

local id = ARGV[1]
local debounce, max_wait, retention = tonumber(ARGV[2]), tonumber(ARGV[3]), ARGV[4]
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)

local runner = redis.call('HGET', KEYS[3], id) or redis.call('HGET', KEYS[4], id)
if runner then
  if runner ~= id then
    return {2, runner}
  end
  -- A copy of a run that was admitted already (redelivered: its worker died before it
  -- finished): it runs again, for the same superseded ids.
  local listed = redis.call('HGET', KEYS[3], 'l:' .. id) or redis.call('HGET', KEYS[4], 'l:' .. id)
  local reply = {1}
  for other in string.gmatch(listed or '', '[^,]+') do reply[#reply + 1] = other end
  return reply
end

local latest = redis.call('HGET', KEYS[1], 'latest')
if latest == id then
  local last = tonumber(redis.call('HGET', KEYS[1], 'last'))
  local due = last + debounce
  if max_wait > 0 then
    local cut = tonumber(redis.call('HGET', KEYS[1], 'first')) + max_wait
    if cut < due then due = cut end
  end
  if now < due then
    return {0, due - now}
  end
  -- Close the burst: every id in it is now covered by this run.
  local ids = redis.call('SMEMBERS', KEYS[2])
  local since = tonumber(redis.call('HGET', KEYS[1], 'gen') or '0')
  if now - since > tonumber(retention) then
    -- A new generation of `ran`: the one before it is kept for one more retention,
    -- then dropped, so a busy key's memory stays bounded.
    if redis.call('EXISTS', KEYS[3]) == 1 then
      redis.call('RENAME', KEYS[3], KEYS[4])
    end
    redis.call('HSET', KEYS[1], 'gen', now)
  end
  local reply = {1}
  local others = {}
  for _, other in ipairs(ids) do
    redis.call('HSET', KEYS[3], other, id)
    if other ~= id then
      reply[#reply + 1] = other
      others[#others + 1] = other
    end
  end
  redis.call('HSET', KEYS[3], id, id, 'l:' .. id, table.concat(others, ','))
  redis.call('PEXPIRE', KEYS[3], retention)
  redis.call('DEL', KEYS[2])
  redis.call('HDEL', KEYS[1], 'latest', 'first', 'last')
  redis.call('PEXPIRE', KEYS[1], retention)
  -- Superseded deliveries still held wake up and learn who ran for them.
  if ARGV[5] ~= '' then redis.call('PUBLISH', ARGV[5], KEYS[1]) end
  return reply
end

if redis.call('SISMEMBER', KEYS[2], id) == 1 then
  return {2, latest}
end

-- Unknown: adopt it as the burst's latest (what debounce_record.lua would have done).
if not latest then
  redis.call('HSET', KEYS[1], 'first', now)
end
redis.call('HSET', KEYS[1], 'latest', id, 'last', now)
redis.call('SADD', KEYS[2], id)
redis.call('PEXPIRE', KEYS[1], retention)
redis.call('PEXPIRE', KEYS[2], retention)
if latest and ARGV[5] ~= '' then redis.call('PUBLISH', ARGV[5], KEYS[1]) end
local due = now + debounce
if max_wait > 0 then
  local cut = tonumber(redis.call('HGET', KEYS[1], 'first')) + max_wait
  if cut < due then due = cut end
end
return {0, math.max(due - now, 1)}
