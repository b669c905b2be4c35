-- gate: decide ALL of a request's conditions at once; grant all of them or none.
--
-- KEYS[i]   the key of condition i (same {hash tag} for all, so Cluster can run it)
-- ARGV[1]   owner: "<task id>|<worker>|<nonce>", unique per delivery
-- ARGV[2]   lease ttl in milliseconds
-- ARGV[3]   reservation window in microseconds (0: none): a rate slot that comes free
--           within it is reserved now, and the run starts when the slot comes
-- ARGV[4+3(i-1)..]  per condition i, three values: kind, a, b
--   kind "L"  lease:  a = limit (1 = exclusive), b = "1" to issue a fencing token
--   kind "R"  GCRA rate: a = emission interval in microseconds, b = burst
--   kind "D"  done marker: denied while the key exists (a task id that already finished)
--   kind "U"  unique claim to free on start: deleted if its value is a (the task id)
--   kind "O"  runtime override of the NEXT condition's a and b: read field a of the hash
--             KEYS[i] ("<a> [<b>]"), set at runtime by `celery baton limits set`
-- returns   {1, fence, start_in_us, at_us} granted (fence 0 when no lease asked for one);
--                                         start no earlier than start_in_us from now,
--                                         which is at_us on the server's clock (us)
--           {0, i, retry_after_us, holder} denied by condition i; nothing was written.
--           retry_after_us (microseconds) is -1 when waiting cannot help (a done marker).
-- Time is the server's TIME, so workers' clocks never matter.

local t = redis.call('TIME')
local now_us = tonumber(t[1]) * 1000000 + tonumber(t[2])
local now_ms = math.floor(now_us / 1000)
local owner = ARGV[1]
local ttl_ms = tonumber(ARGV[2])
local owner_field = 'o:' .. owner
local reserve_us = tonumber(ARGV[3])
local writes = {}
local override = nil
local start_at = now_us  -- a reserved rate slot may start later than now

for i = 1, #KEYS do
  local key = KEYS[i]
  local kind = ARGV[3 * i + 1]
  local a = ARGV[3 * i + 2]
  local b = ARGV[3 * i + 3]
  if override then
    a = override[1]
    if override[2] then b = override[2] end
    override = nil
  end
  if kind == 'O' then
    local value = redis.call('HGET', key, a)
    if value then
      override = {string.match(value, '^(%S+)%s*(%S*)$')}
      if override[2] == '' then override[2] = nil end
    end
  elseif kind == 'L' then
    local limit = tonumber(a)
    local flat = redis.call('HGETALL', key)
    local live, mine, expired = 0, nil, {}
    local earliest, holder, latest, last_fence, expire_at = nil, '', 0, 0, 0
    for j = 1, #flat, 2 do
      local field = flat[j]
      if string.sub(field, 1, 2) == 'o:' then
        local value = flat[j + 1]
        local deadline = tonumber(string.match(value, '^%d+'))
        if deadline <= now_ms then
          expired[#expired + 1] = field
        elseif field == owner_field then
          mine = value
        else
          live = live + 1
          if deadline > latest then latest = deadline end
          if earliest == nil or deadline < earliest then
            earliest, holder = deadline, string.sub(field, 3)
          end
        end
      elseif field == '_fence' then
        last_fence = tonumber(flat[j + 1])
      elseif field == '_e' then
        expire_at = tonumber(flat[j + 1])
      end
    end
    if not mine and live >= limit then
      -- A hint for release: someone waits for this key, so publish a notice.
      redis.call('HSET', key, '_w', '1')
      return {0, i, (earliest - now_ms) * 1000, holder}
    end
    writes[#writes + 1] = {'L', key, expired, b == '1', mine, last_fence, latest, expire_at,
      #flat > 0}
  elseif kind == 'R' then
    local interval = tonumber(a)
    local burst = tonumber(b)
    local tat = tonumber(redis.call('GET', key)) or now_us
    -- Strict GCRA: a late start earns no credit, so in every window of length w at
    -- most burst + w * rate runs start. (Waiters wake on time to keep the rate.)
    if tat < now_us then tat = now_us end
    local new_tat = tat + interval
    local allow_at = new_tat - burst * interval
    if now_us < allow_at then
      if allow_at - now_us > reserve_us then
        return {0, i, allow_at - now_us, ''}
      end
      -- Reserve the slot: the schedule advances exactly one interval, however late
      -- the waiter wakes, so the rate holds without crediting lateness.
      if allow_at > start_at then start_at = allow_at end
    end
    writes[#writes + 1] = {'R', key, new_tat}
  elseif kind == 'D' then
    local done_by = redis.call('GET', key)
    if done_by then
      return {0, i, -1, done_by}
    end
  elseif kind == 'U' then
    writes[#writes + 1] = {'U', key, a}
  end
end

local fence = 0
for _, w in ipairs(writes) do
  local key = w[2]
  if w[1] == 'L' then
    if #w[3] > 0 then redis.call('HDEL', key, unpack(w[3])) end
    local token = 0
    local deadline = now_ms + ttl_ms
    local fields
    if w[4] then
      if w[5] then
        token = tonumber(string.match(w[5], ' (%d+)$')) or 0
        fields = {owner_field, string.format('%.0f %.0f', deadline, token)}
      else
        -- Strictly increasing per key, even after the key expired: never below the clock
        -- (the start instant, for a reserved slot).
        token = math.max(w[6] + 1, start_at)
        fields = {owner_field, string.format('%.0f %.0f', deadline, token),
          '_fence', string.format('%.0f', token)}
      end
      if fence == 0 then fence = token end
    else
      fields = {owner_field, string.format('%.0f 0', deadline)}
    end
    -- The key must outlive its longest lease. "_e" is a lower bound of when the key
    -- expires (renew only ever extends it). A key in use by others or holding a fence
    -- counter (a busy concurrency or exclusive key) is extended by one more ttl than
    -- needed, so that its next acquisitions need not extend it again; a new key gets
    -- exactly its lease's ttl and vanishes with its release (a task id's guard key).
    local needed = math.max(deadline, w[7])
    local expire_in = nil
    if not w[9] then
      expire_in = needed - now_ms
    elseif w[8] < needed then
      local expire_at = needed + ttl_ms
      fields[#fields + 1] = '_e'
      fields[#fields + 1] = string.format('%.0f', expire_at)
      expire_in = expire_at - now_ms
    end
    redis.call('HSET', key, unpack(fields))
    if expire_in then redis.call('PEXPIRE', key, expire_in) end
  elseif w[1] == 'R' then
    redis.call('SET', key, string.format('%.0f', w[3]),
      'PX', math.ceil((w[3] - now_us) / 1000) + 1)
  elseif w[1] == 'U' then
    if redis.call('GET', key) == w[3] then redis.call('DEL', key) end
  end
end
return {1, fence, start_at - now_us, start_at}
