-- unlock: the operator frees a lease key by hand (`celery baton unlock KEY`).
-- A live holder is never removed unless forced: it may still be running. A forced
-- holder's next renewal finds its lease gone under an unchanged store epoch and reports
-- it lost (renew.lua): it is not written back.
--
-- KEYS[1]  lease key
-- ARGV[1]  "1" to remove live holders too
-- ARGV[2]  notice channel
-- returns  {removed, live holder owners...}: removed is the number of owners removed;
--          the owners listed are those still live before the call

local t = redis.call('TIME')
local now_ms = math.floor((tonumber(t[1]) * 1000000 + tonumber(t[2])) / 1000)
local flat = redis.call('HGETALL', KEYS[1])
local live, remove = {}, {}
for j = 1, #flat, 2 do
  if string.sub(flat[j], 1, 2) == 'o:' then
    local deadline = tonumber(string.match(flat[j + 1], '^(%d+)'))
    if deadline > now_ms then
      live[#live + 1] = string.sub(flat[j], 3)
      if ARGV[1] == '1' then remove[#remove + 1] = flat[j] end
    else
      remove[#remove + 1] = flat[j]
    end
  end
end
if #remove > 0 then
  redis.call('HDEL', KEYS[1], unpack(remove))
  redis.call('PUBLISH', ARGV[2], KEYS[1])
end
local result = {#remove}
for _, owner in ipairs(live) do result[#result + 1] = owner end
return result
