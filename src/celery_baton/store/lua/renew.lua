-- renew: extend a batch of leases in one call (a worker renews all of its leases at once).
-- A lease whose field vanished (the store lost it, e.g. restarted without persistence)
-- is re-asserted when the key still has room, so a live run keeps its key; not when an
-- operator removed it on purpose (an "x:<owner>" field, written by unlock).
--
-- KEYS[i]              lease key i
-- ARGV[3(i-1)+1..+3]   owner, limit, ttl in milliseconds for lease i
-- returns              a list, per lease: 1 renewed, 2 re-asserted, 0 lost (another holds it)

local t = redis.call('TIME')
local now_ms = math.floor((tonumber(t[1]) * 1000000 + tonumber(t[2])) / 1000)
local result = {}
for i = 1, #KEYS do
  local key = KEYS[i]
  local field = 'o:' .. ARGV[3 * i - 2]
  local limit = tonumber(ARGV[3 * i - 1])
  local ttl_ms = tonumber(ARGV[3 * i])
  local current = redis.call('HGET', key, field)
  local status = 0
  local fence = '0'
  if current then
    fence = string.match(current, ' (%d+)$') or '0'
    status = 1
  elseif redis.call('HEXISTS', key, 'x:' .. ARGV[3 * i - 2]) == 1 then
    status = 0  -- an operator freed it (`celery baton unlock --force`): lost, for good
  else
    local live = 0
    local flat = redis.call('HGETALL', key)
    for j = 1, #flat, 2 do
      if string.sub(flat[j], 1, 2) == 'o:' and
         tonumber(string.match(flat[j + 1], '^(%d+)')) > now_ms then
        live = live + 1
      end
    end
    if live < limit then status = 2 end
  end
  if status > 0 then
    redis.call('HSET', key, field, string.format('%.0f', now_ms + ttl_ms) .. ' ' .. fence)
    if redis.call('PTTL', key) < ttl_ms then redis.call('PEXPIRE', key, ttl_ms) end
  end
  result[i] = status
end
return result
