-- gate: the store epochs, once every condition passed (no kind of their own, no ARGV:
-- the script runs for every admitted task, and each argument costs). Sets `epoch`.
--   "G"       KEYS[n+2] (one server, not Cluster), the store-wide epoch: "<since ms>
--             <replication id>", the moment the store was found new, without its data
--             (restarted empty), or promoted from a replica since it was written
--             (master_replid changed, master_replid2 set: the replica may have been
--             behind, and lack leases the old master granted). Live holders write their
--             leases back at their next renewal (renew.lua); until each had the chance
--             (one lease ttl, ARGV[2], since that moment) no new lease is granted:
--             denied (as condition n+2) with retry_after = the rest of the grace. A
--             store found new or emptied (no key) dates the moment from the server's
--             start (INFO server, on this rare path only): a lease from before then
--             cannot outlive its start + ttl, so a server up longer than a ttl gets no
--             grace (nor does one emptied by FLUSHALL while up: docs/failure.md); a
--             promoted replica dates it from now (its old master's leases live on). A value
--             without a replication id (declared new, `celery baton end-grace`), or
--             written before a restart (the server kept what its persistence kept), is
--             adopted without a grace. The one write a denial may make: this key.
--   "E"       KEYS[n+1], the family's store epoch: "<id> <replication id>[ <grace
--             until, ms>]", read, created when missing, and returned; the holder renews
--             under it (renew.lua: a lease gone under an unchanged epoch id is never
--             written back). Written before a promotion (as for "G"): a new id, so that
--             holders write their leases back, and -- without "G" (Cluster, where each
--             shard has its own history) -- a grace of one lease ttl for the family
--             (denied as condition n+1, and this key written). Missing on a Cluster
--             shard (without "G"; INFO server says cluster mode), where no key tells
--             a family never used from one the shard forgot, the server is asked
--             (INFO, on this rare path only): created with a grace when the server
--             started less than one ttl ago (restarted empty, maybe: until its start
--             + ttl, when every lease it had has run out) or was promoted from a
--             replica (master_replid2 set: it may lack the family's first leases, its
--             old master's last writes; one ttl from now). The price: a family's first
--             lease on such a shard waits the grace once (the epoch is never deleted).
--
-- "G" and "E" (and INFO, which costs 7-12 us: the whole section is formatted) are read
-- once a second per family: a grant that passed them keeps the family's epoch for a
-- second in "<E's key>:here" (same hash tag), written with replication off, so that
-- it never reaches a replica nor the AOF. The key says "this server found no grace for
-- the family within the last second"; the grants of that second take the epoch from it.
-- A server that could need a grace does not have it: one that lost its data lost the
-- key too; a promoted replica never had it (not replicated). A snapshot of the dataset
-- carries it (an RDB file, an AOF rewrite, a replica's full sync, a slot migrated on
-- Cluster) with its expiry, so only within that second could another history read
-- it: a restart keeps what persistence kept (no grace then, as when G and E are read);
-- a migrated slot keeps its data; and no replica is promoted within a second of its
-- sync, nor a master demoted and promoted again (a failover waits out a node timeout
-- first, and a planned one loses nothing).
--: epochs
-- Every condition passed: the store epochs, when a lease is asked for (see above):
-- the family's verified epoch if this server kept it, else G and E as below.
local VERIFIED_MS = 1000  -- how long a family's verified epoch is kept here
local epoch_key = KEYS[n + 1]
if epoch_key then
  local verified_key = epoch_key .. ':here'
  epoch = call('GET', verified_key)
  if not epoch then
    -- The server's replication id, and whether it was promoted from a replica since it
    -- started: a promoted replica takes a new id and keeps its old master's as
    -- master_replid2; a restarted master also takes a new id, but its second one is
    -- zeros (it kept what its persistence kept, as before). pcall: a server that
    -- refuses INFO in scripts (a renamed command) keeps the behaviour without it: no
    -- promotion is ever seen.
    local info = redis.pcall('INFO', 'replication')
    if type(info) ~= 'string' then info = '' end
    local here = string.match(info, 'master_replid:(%w+)') or ''
    local second = string.match(info, 'master_replid2:(%w+)')
    local promoted = second ~= nil and second ~= string.rep('0', 40)
    local new_epoch_id = t[1] .. string.rep('0', 6 - #t[2]) .. t[2]
    local grace_key = KEYS[n + 2]
    if grace_key then
      local found = call('GET', grace_key)
      local since, seen = nil, ''
      if found then
        since, seen = string.match(found, '^(%d+) ?(%w*)')
        since = tonumber(since)
      end
      if not since and not promoted then
        -- New or emptied: a lease from before can only have been granted before the
        -- server started, so none outlives its start + ttl; a server up longer than a
        -- ttl needs no grace. (FLUSHALL of a live server looks the same and gets none:
        -- docs/failure.md.) The server counts its uptime as floor(now) - floor(start):
        -- up to a second more than it was up, so a second less of it gives a start
        -- never earlier than the real one.
        local info = redis.pcall('INFO', 'server')
        local up = type(info) == 'string' and tonumber(string.match(info, 'uptime_in_seconds:(%d+)'))
        since = up and now_ms - math.max(0, up - 1) * 1000 or now_ms
        call('SET', grace_key, format('%d %s', since, here))
      elseif not since or (seen ~= '' and seen ~= here and promoted) then
        since = now_ms  -- a promoted replica (it may have been behind): from now
        call('SET', grace_key, format('%d %s', since, here))
      elseif seen ~= here then
        call('SET', grace_key, format('%d %s', since, here))  -- declared new, or restarted
      end
      if since + ttl_ms > now_ms then
        return {0, n + 2, (since + ttl_ms - now_ms) * 1000, '', assigned}
      end
    end
    -- The SET happens once per family (and again only after the store lost its data or
    -- changed master). Without the store-wide key (Cluster: each shard has its own
    -- history), the family's epoch holds the grace after a promotion.
    epoch = call('GET', epoch_key)
    local grace_until = nil
    if not epoch then
      epoch = new_epoch_id .. ' ' .. here
      -- On a Cluster shard (no "G"), a grace if the server may have forgotten it ("E"
      -- above): "redis_mode:cluster" (Valkey 8: "server_mode:cluster"); a start never
      -- earlier than the real one from the uptime, as for "G" above.
      local info = not grace_key and redis.pcall('INFO', 'server')
      if type(info) == 'string' and string.find(info, '_mode:cluster', 1, true) then
        local up = tonumber(string.match(info, 'uptime_in_seconds:(%d+)'))
        local since = up and now_ms - math.max(0, up - 1) * 1000 or now_ms
        if promoted then
          grace_until = now_ms + ttl_ms
        elseif since + ttl_ms > now_ms then
          grace_until = since + ttl_ms
        end
        if grace_until then epoch = format('%s %d', epoch, grace_until) end
      end
      call('SET', epoch_key, epoch)
    else
      local id, seen, until_ms = string.match(epoch, '^(%d+) ?(%w*) ?(%d*)')
      if seen ~= here and not (promoted and seen ~= '') then
        epoch = id .. ' ' .. here  -- an older version's, or restarted: adopted, same id
        call('SET', epoch_key, epoch)
      elseif seen ~= here then
        epoch = new_epoch_id .. ' ' .. here
        if not grace_key then
          grace_until = now_ms + ttl_ms
          epoch = format('%s %d', epoch, grace_until)
        end
        call('SET', epoch_key, epoch)
      elseif until_ms ~= '' then
        grace_until = tonumber(until_ms)
      end
    end
    if grace_until and grace_until > now_ms then
      return {0, n + 1, (grace_until - now_ms) * 1000, '', assigned}
    end
    redis.set_repl(redis.REPL_NONE)  -- this server's own finding (see the top)
    call('SET', verified_key, epoch, 'PX', VERIFIED_MS)
    redis.set_repl(redis.REPL_ALL)
  end
end
