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
--   kind "K"  unique claim to keep for the run: if its value is a (the task id), it
--             expires b milliseconds from now (never denies)
--   kind "O"  runtime override of the NEXT condition's a and b: read field a of the hash
--             KEYS[i] ("<a> [<b>]"), set at runtime by `celery baton limits set`
--   kind "G"  the store-wide epoch (one server, not Cluster; only when a lease is asked
--             for): "<since ms> <replication id>", the moment the store was found new,
--             without its data (restarted empty), or promoted from a replica since it
--             was written (master_replid changed, master_replid2 set: the replica may
--             have been behind, and lack leases the old master granted). Live holders write their
--             leases back at their next renewal (renew.lua); until each had the chance
--             (one lease ttl, ARGV[2], since that moment) no new lease is granted: denied
--             with retry_after = the rest of the grace. A value without a replication id
--             (declared new, `celery baton end-grace`), or written before a restart
--             (the server kept what its persistence kept), is adopted without a grace.
--             The one write a denial may make: this key.
--   kind "E"  the family's store epoch (last, and only when a lease is asked for):
--             "<id> <replication id>[ <grace until, ms>]", read, created when missing, and
--             returned; the holder renews under it (renew.lua: a lease gone under an
--             unchanged epoch id is never written back). Written before a promotion
--             (as for "G"): a new id, so that holders write their leases back, and --
--             without a "G" condition (Cluster, where each shard has its own history)
--             -- a grace of one lease ttl for the family (denied, and this key written).
-- returns   {1, fence, start_in_us, at_us, epoch} granted (fence 0 when no lease asked
--                                         for one; epoch '' without an "E" condition);
--                                         start no earlier than start_in_us from now,
--                                         which is at_us on the server's clock (us)
--           {0, i, retry_after_us, holder} denied by condition i; nothing was written.
--           retry_after_us (microseconds) is -1 when waiting cannot help (a done marker).
-- Time is the server's TIME, so workers' clocks never matter.
--
-- Every admitted task runs this script, so it is written for the store's CPU: numbers
-- are formatted with %d (exact for integers, and a third of the cost of %.0f), tables
-- are made only when something needs them, and expiries are set only when they must
-- move (a key's expiry is the costliest part of a write).

local call, format = redis.call, string.format
local t = call('TIME')
local now_us = t[1] * 1000000 + t[2]
local now_ms = (now_us - now_us % 1000) / 1000
local owner = ARGV[1]
local ttl_ms = tonumber(ARGV[2])
local owner_field = 'o:' .. owner
local reserve_us = tonumber(ARGV[3])
-- The server's replication id, and whether it was promoted from a replica since it
-- started: a promoted replica takes a new id and keeps its old master's as
-- master_replid2; a restarted master also takes a new id, but its second one is zeros
-- (it kept what its persistence kept, as before).
local replid, promoted = nil, false
local function replication_id()
  if not replid then
    -- pcall: a server that refuses INFO in scripts (a renamed command) keeps the
    -- behaviour without it: no promotion is ever seen.
    local info = redis.pcall('INFO', 'replication')
    if type(info) ~= 'string' then info = '' end
    replid = string.match(info, 'master_replid:(%w+)') or ''
    local second = string.match(info, 'master_replid2:(%w+)')
    promoted = second ~= nil and second ~= string.rep('0', 40)
  end
  return replid
end
local function new_epoch_id() return t[1] .. string.rep('0', 6 - #t[2]) .. t[2] end
-- What to write once every condition passed, one record per condition (positional: the
-- script runs for every admitted task, and array tables are the cheapest):
--   {'L', key, expired fields or nil, fence asked, my current value or nil, last fence,
--    latest deadline of the others, "_e" (key expires no earlier), key existed}
--   {'R', key, new TAT, stored TAT or nil}      {'U', key, task id}
--   {'K', key, task id, ttl in ms}
local writes = {}
local override = nil
local epoch = ''
local store_wide = false  -- a "G" condition was asked: it holds the grace, not "E"
local start_at = now_us  -- a reserved rate slot may start later than now

for i = 1, #KEYS do
  local key = KEYS[i]
  local base = 3 * i
  local kind, a, b = ARGV[base + 1], ARGV[base + 2], ARGV[base + 3]
  if override then
    a = override[1]
    if override[2] ~= '' then b = override[2] end
    override = nil
  end
  if kind == 'L' then
    local limit = tonumber(a)
    local flat = call('HGETALL', key)
    local live, mine, expired = 0, nil, nil
    local earliest, holder, latest, last_fence, expire_at = nil, '', 0, 0, 0
    for j = 1, #flat, 2 do
      local field = flat[j]
      if string.byte(field, 1) == 111 then  -- 'o': "o:<owner>", a lease
        local value = flat[j + 1]
        local deadline = tonumber(string.match(value, '^%d+'))
        if deadline <= now_ms then
          if expired then expired[#expired + 1] = field else expired = {field} end
        elseif field == owner_field then
          mine = value
        else
          live = live + 1
          if deadline > latest then latest = deadline end
          if earliest == nil or deadline < earliest then
            earliest, holder = deadline, field
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
      call('HSET', key, '_w', '1')
      return {0, i, (earliest - now_ms) * 1000, string.sub(holder, 3)}
    end
    writes[#writes + 1] = {'L', key, expired, b == '1', mine, last_fence, latest, expire_at,
      #flat > 0}
  elseif kind == 'R' then
    local interval = tonumber(a)
    local burst = tonumber(b)
    local stored = call('GET', key)
    local tat = tonumber(stored) or now_us
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
    writes[#writes + 1] = {'R', key, new_tat, stored}
  elseif kind == 'O' then
    local value = call('HGET', key, a)
    local limit, extra = nil, nil
    if value then limit, extra = string.match(value, '^(%S+)%s*(%S*)$') end
    if limit then override = {limit, extra} end  -- (`limits set` validates what it writes)
  elseif kind == 'D' then
    local done_by = call('GET', key)
    if done_by then
      return {0, i, -1, done_by}
    end
  elseif kind == 'U' then
    writes[#writes + 1] = {'U', key, a}
  elseif kind == 'K' then
    writes[#writes + 1] = {'K', key, a, b}
  elseif kind == 'G' then
    store_wide = true
    local found = call('GET', key)
    local since, seen = nil, ''
    if found then
      since, seen = string.match(found, '^(%d+) ?(%w*)')
      since = tonumber(since)
    end
    local here = replication_id()
    if not since or (seen ~= '' and seen ~= here and promoted) then
      since = now_ms  -- new, emptied, or a promoted replica: the grace starts now
      call('SET', key, format('%d %s', since, here))
    elseif seen ~= here then
      call('SET', key, format('%d %s', since, here))  -- declared new, or restarted: adopted
    end
    if since + ttl_ms > now_ms then
      return {0, i, (since + ttl_ms - now_ms) * 1000, ''}
    end
  elseif kind == 'E' then
    -- Last: every condition passed. One GET per grant; the SET happens once per family
    -- (and again only after the store lost its data or changed master).
    local here = replication_id()
    epoch = call('GET', key)
    local grace_until = nil
    if not epoch then
      epoch = new_epoch_id() .. ' ' .. here
      call('SET', key, epoch)
    else
      local id, seen, until_ms = string.match(epoch, '^(%d+) ?(%w*) ?(%d*)')
      if seen ~= here and not (promoted and seen ~= '') then
        epoch = id .. ' ' .. here  -- an older version's, or restarted: adopted, same id
        call('SET', key, epoch)
      elseif seen ~= here then
        epoch = new_epoch_id() .. ' ' .. here
        if not store_wide then epoch = format('%s %d', epoch, now_ms + ttl_ms) end
        call('SET', key, epoch)
        if not store_wide then grace_until = now_ms + ttl_ms end
      elseif until_ms ~= '' then
        grace_until = tonumber(until_ms)
      end
    end
    if grace_until and grace_until > now_ms then
      return {0, i, (grace_until - now_ms) * 1000, ''}
    end
  end
end

-- A rate key expires at the end of the second its TAT falls in (EXPIRE_GRAIN below).
-- While the TAT stays within that second, the key's expiry is already right and the write
-- keeps it (KEEPTTL); so a busy rate key moves its expiry once a second, not on every
-- decision. The key is gone at most a second after its schedule ran out (a missing key
-- means the same as a TAT in the past).
local EXPIRE_GRAIN = 1000000
local function grain_end(tat) return tat - tat % EXPIRE_GRAIN + EXPIRE_GRAIN end

local fence = 0
for _, w in ipairs(writes) do
  local key = w[2]
  if w[1] == 'L' then
    if w[3] then call('HDEL', key, unpack(w[3])) end
    local deadline = now_ms + ttl_ms
    local token = 0
    local value
    local counter = nil
    if not w[4] then
      value = format('%d 0', deadline)
    elseif w[5] then
      -- The same owner asks again (a retried call): its token does not change.
      local kept = string.match(w[5], ' (%d+)$') or '0'
      value = format('%d %s', deadline, kept)
      token = tonumber(kept)
    else
      -- Strictly increasing per key, even after the key expired: never below the clock
      -- (the start instant, for a reserved slot).
      token = math.max(w[6] + 1, start_at)
      value = format('%d %d', deadline, token)
      counter = format('%d', token)
    end
    if w[4] and fence == 0 then fence = token end
    -- The key must outlive its longest lease. "_e" is a lower bound of when the key
    -- expires (renew only ever extends it). A key in use by others or holding a fence
    -- counter (a busy concurrency or exclusive key) is extended by one more ttl than
    -- needed, so that its next acquisitions need not extend it again; a new key gets
    -- exactly its lease's ttl and vanishes with its release (a task id's guard key).
    local needed = math.max(deadline, w[7])
    local expire_in, expire_field = nil, nil
    if not w[9] then
      expire_in = needed - now_ms
    elseif w[8] < needed then
      expire_in = needed + ttl_ms - now_ms
      expire_field = format('%d', needed + ttl_ms)
    end
    if counter and expire_field then
      call('HSET', key, owner_field, value, '_fence', counter, '_e', expire_field)
    elseif counter then
      call('HSET', key, owner_field, value, '_fence', counter)
    elseif expire_field then
      call('HSET', key, owner_field, value, '_e', expire_field)
    else
      call('HSET', key, owner_field, value)
    end
    if expire_in then call('PEXPIRE', key, expire_in) end
  elseif w[1] == 'R' then
    local new_tat, old = w[3], tonumber(w[4])
    local expires_at = grain_end(new_tat)
    if old and grain_end(old) == expires_at then
      call('SET', key, format('%d', new_tat), 'KEEPTTL')
    else
      call('SET', key, format('%d', new_tat), 'PX', format('%d', (expires_at - now_us) / 1000 + 1))
    end
  elseif w[1] == 'U' then
    if call('GET', key) == w[3] then call('DEL', key) end
  elseif w[1] == 'K' then
    -- Only this task id's claim: a claim that lapsed may belong to a later publish now.
    if call('GET', key) == w[3] then call('PEXPIRE', key, w[4]) end
  end
end
return {1, fence, start_at - now_us, start_at, epoch}
