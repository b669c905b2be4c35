-- renew: extend a batch of leases in one call (a worker renews all of its leases at once).
--
-- A lease whose field is gone was either removed on purpose -- released by its owner,
-- freed by an operator (`celery baton unlock`), or expired -- or forgotten by the store
-- (restarted empty, failover to a replica that was behind). Only the second may be
-- written back: a renewal can reach the store after its owner's release (sent on
-- another connection, or re-sent by a client after a timeout), and writing that lease
-- back would hold the key for a run that is over. The family's epoch key tells them
-- apart: the gate creates it once and returns it with every grant, and only a store that
-- forgot its data loses it. A holder whose epoch is still the store's lost its lease;
-- a holder whose epoch is gone or replaced re-asserts its lease (when the key has room)
-- and is told the new epoch, which it renews under from then on. An epoch is
-- "<id> <replication id>[ <grace until, ms>]" (gate.lua, "E"); only the id is compared.
-- One written before the server was promoted from a replica (master_replid changed
-- and master_replid2 set; it may have been behind: it can hold the epoch but not the
-- lease) counts as replaced: it gets a new id, and (without a store-wide epoch, i.e. on
-- Cluster) a grace of one ttl in which the gate grants the family no new lease, so
-- that the other holders write theirs back first. An epoch missing on a Cluster shard
-- that started less than a ttl ago or was promoted from a replica is created with the
-- grace the gate would give it (gate.lua, "E"), so that a renewal that comes first does
-- not end it.
--
-- KEYS[2i-1]           lease key i
-- KEYS[2i]             the epoch key of lease i's family (same {hash tag})
-- ARGV[4(i-1)+1..+4]   owner, limit, ttl in milliseconds, epoch it was granted under
-- ARGV[last]           present (after the leases' values) when the store has a
--                      store-wide epoch (one server, gate.lua "G"): it holds the grace
--                      after a promotion, so the family epoch gets no grace of its own
-- returns              a list of two values per lease: status (1 renewed, 2 re-asserted,
--                      0 lost: gone on purpose or taken, 3 ended: freed by its run's own
--                      process at the body's end, release.lua's "x:<owner>"), and when
--                      re-asserted the store's epoch (else '')

local call = redis.call
local t = call('TIME')
local now_ms = math.floor((tonumber(t[1]) * 1000000 + tonumber(t[2])) / 1000)
local result = {}
local store_wide = #ARGV > 2 * #KEYS
-- The server's replication ids (gate.lua: a promoted replica has a second one); '' and
-- nil when the server refuses INFO in scripts.
local function replication()
  local info = redis.pcall('INFO', 'replication')
  if type(info) ~= 'string' then return '', nil end
  return string.match(info, 'master_replid:(%w+)') or '',
    string.match(info, 'master_replid2:(%w+)')
end
-- A missing epoch's grace (gate.lua, "E"): nil, or until when (ms); INFO read once.
local info_server = nil
local function forgotten_until(ttl_ms)
  if info_server == nil then
    info_server = redis.pcall('INFO', 'server')
    if type(info_server) ~= 'string' then info_server = '' end
  end
  if not string.find(info_server, '_mode:cluster', 1, true) then return nil end
  local _, second = replication()
  if second ~= nil and second ~= string.rep('0', 40) then return now_ms + ttl_ms end
  -- The uptime is floor(now) - floor(start): a second less gives a start never
  -- earlier than the real one (gate.lua, "G").
  local up = tonumber(string.match(info_server, 'uptime_in_seconds:(%d+)'))
  local since = up and now_ms - math.max(0, up - 1) * 1000 or now_ms
  if since + ttl_ms > now_ms then return since + ttl_ms end
  return nil
end
for i = 1, #KEYS / 2 do
  local key, epoch_key = KEYS[2 * i - 1], KEYS[2 * i]
  local base = 4 * (i - 1)
  local owner_field = 'o:' .. ARGV[base + 1]
  local limit = tonumber(ARGV[base + 2])
  local ttl_ms = tonumber(ARGV[base + 3])
  local current = call('HGET', key, owner_field)
  local status, epoch = 0, ''
  local fence = '0'
  if current then
    fence = string.match(current, ' (%d+)$') or '0'
    status = 1
  elseif call('HEXISTS', key, 'x:' .. ARGV[base + 1]) == 1 then
    status = 3  -- its run ended; the store did not forget it (the mark is there)
  else
    -- Read only here: a renewal of a lease that is there (nearly all) costs no more.
    local known = call('GET', epoch_key)
    local known_id, seen = nil, ''
    if known then known_id, seen = string.match(known, '^(%d+) ?(%w*)') end
    local held_id = string.match(ARGV[base + 4], '^(%d*)')
    local promoted = false
    if known and seen ~= '' then
      local here, second = replication()
      if seen ~= here and second ~= nil and second ~= string.rep('0', 40) then
        -- Promoted (leases since its last sync may be gone): a new id, and on Cluster a
        -- grace for the family, as the gate gives one when it sees this first.
        known = t[1] .. string.rep('0', 6 - #t[2]) .. t[2] .. ' ' .. here
        if not store_wide then known = string.format('%s %.0f', known, now_ms + ttl_ms) end
        call('SET', epoch_key, known)
        promoted = true
      end
    end
    if promoted or known_id ~= held_id then
      -- The store forgot (or this holder never knew an epoch): re-assert if there is room.
      if not known then
        known = t[1] .. string.rep('0', 6 - #t[2]) .. t[2] .. ' ' .. (replication())
        local grace_until = not store_wide and forgotten_until(ttl_ms)
        if grace_until then known = string.format('%s %.0f', known, grace_until) end
        call('SET', epoch_key, known)
      end
      local live = 0
      local flat = call('HGETALL', key)
      for j = 1, #flat, 2 do
        if string.sub(flat[j], 1, 2) == 'o:' and
           tonumber(string.match(flat[j + 1], '^(%d+)')) > now_ms then
          live = live + 1
        end
      end
      if live < limit then status, epoch = 2, known end
    end
  end
  if status == 1 or status == 2 then
    call('HSET', key, owner_field, string.format('%.0f', now_ms + ttl_ms) .. ' ' .. fence)
    if call('PTTL', key) < ttl_ms then call('PEXPIRE', key, ttl_ms) end
  end
  result[2 * i - 1] = status
  result[2 * i] = epoch
end
return result
