-- cancel_read: what a worker learns of the cancels (core/cancels.py): the marker's live
-- fields, or one task's live key cancels, with the server's clock to read them by.
--
-- KEYS[1]  the cancel marker (cancel_mark.lua) or a task's key cancels (cancel_key.lua)
-- returns  {now ms, name, until ms, name, until ms, ...}: the live fields or members

local call = redis.call
local t = call('TIME')
local now_ms = t[1] * 1000 + (t[2] - t[2] % 1000) / 1000
local reply = {string.format('%d', now_ms)}
local kind = call('TYPE', KEYS[1])['ok']
if kind == 'hash' then
  local fields = call('HGETALL', KEYS[1])
  for i = 1, #fields, 2 do
    if (tonumber(fields[i + 1]) or 0) > now_ms then
      reply[#reply + 1] = fields[i]
      reply[#reply + 1] = fields[i + 1]
    end
  end
elseif kind == 'zset' then
  local live = call('ZRANGEBYSCORE', KEYS[1], '(' .. now_ms, '+inf', 'WITHSCORES')
  for i = 1, #live do reply[#reply + 1] = live[i] end
end
return reply
