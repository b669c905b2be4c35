-- beat_lead: take or renew the beat leader lease (one leader among any number of beats).
--
-- KEYS[1]  leader hash      {owner, fence, since}; expires with the lease
-- KEYS[2]  fence counter    grows with every new leadership, never reused
-- KEYS[3]  version counter  bumped by every schedule change (read here for free)
-- ARGV[1]  owner token of the calling beat process
-- ARGV[2]  lease ttl, milliseconds
--
-- Returns {leading (1/0), fence, server_now_ms, version, holder_owner, holder_ttl_ms}.
-- A free lease is taken with a new fence; the holder's call renews it (same fence).
-- The caller's clock is never used: server_now_ms lets beats share the server's clock.
local t = redis.call('TIME')
-- Epoch milliseconds as a string: HSET would format a Lua number as a float.
local now_s = t[1] .. string.format('%03d', math.floor(tonumber(t[2]) / 1000))
local now = tonumber(now_s)
local version = tonumber(redis.call('GET', KEYS[3]) or '0')
local owner = redis.call('HGET', KEYS[1], 'owner')
if not owner then
  local fence = redis.call('INCR', KEYS[2])
  redis.call('HSET', KEYS[1], 'owner', ARGV[1], 'fence', fence, 'since', now_s)
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return {1, fence, now, version, ARGV[1], tonumber(ARGV[2])}
end
local fence = tonumber(redis.call('HGET', KEYS[1], 'fence'))
if owner == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return {1, fence, now, version, owner, tonumber(ARGV[2])}
end
return {0, fence, now, version, owner, redis.call('PTTL', KEYS[1])}
