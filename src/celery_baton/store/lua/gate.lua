-- gate: decide ALL of a request's conditions at once; grant all of them or none.
--
-- KEYS[i]   the key of condition i, 1 <= i <= n (n: the number of kind/a/b triples in
--           ARGV); same {hash tag} for all, so Cluster can run it
-- KEYS[n+1] (only when a lease is asked for) the family's store epoch, see "E" below
-- KEYS[n+2] (with KEYS[n+1], on one server only) the store-wide epoch, see "G" below
-- ARGV[1]   owner: "<task id>|<worker>|<nonce>", unique per delivery
-- ARGV[2]   lease ttl in milliseconds
-- ARGV[3]   reservation window in microseconds (0: none): a rate slot that comes free
--           within it is reserved now, and the run starts when the slot comes
-- ARGV[4+3(i-1)..]  per condition i, three values: kind, a, b
--   kind "L"  lease:  a = limit (1 = exclusive), b = "1" to issue a fencing token
--   kind "R"  GCRA rate: a = emission interval in microseconds, b = burst
--   kind "W"  weighted GCRA rate (a named limit shared by tasks, docs/guides/limits-shared.md):
--             a = increment in microseconds (cost x emission interval), b = tolerance in
--             microseconds (burst x emission interval); a <= b (checked by the caller)
--   kind "P"  a named limit's penalty (`penalize`): denied while the key holds an instant
--             (us, server clock) still to come; retry_after = the rest of the penalty
--   kind "D"  done marker of a task id: a sorted set of the publishes whose run finished
--             (member: the publish stamp, '' for a message sent without one; score: when
--             it is forgotten, ms), release.lua. a = this delivery's stamp, b = its task
--             id. Denied (retry_after -1, holder = b) when a is recorded (a copy of a
--             publish that ran), or a is '' and the key exists (an unstamped message is
--             judged by its id: any finished run), or the key is an older version's
--             marker (a string: any finished run)
--   kind "U"  unique claim to free on start: deleted if its value is a (the task id)
--   kind "K"  unique claim to keep for the run: if its value is a (the task id), it
--             expires b milliseconds from now (never denies)
--   kind "S"  publish order of an exclusive key whose duplicates supersede each other
--             (exclusive_conflict "replace"/"keep_last"), a hash {n: last order given,
--             top: the newest order seen here, id: its task id}: a = this delivery's order
--             (from its publish; '' : given one now, max(n + 1, now_us), and returned), b
--             = its task id. Denied (retry_after -1, holder = the newer task id) when a
--             newer publish reached the gate already; else it becomes the newest. This
--             record is written on denial too: what a later condition refuses still
--             supersedes what came before it. Kept for a day.
--   kind "N"  not superseded (unique_conflict "replace"): denied (retry_after -1, holder =
--             the replacing task id) when the key names a task id; on grant set to 'run'
--             for a milliseconds, so a replace that comes later leaves this run alone
--   kind "O"  runtime override of the NEXT condition's a and b: read field a of the hash
--             KEYS[i] ("<a> [<b>]"), set at runtime by `celery baton limits set`
--   kind "F"  fairness of the shared limit decided by condition i-1 (an "L" or "R"),
--             fairness.py: KEYS[i] hash (n:<key> workers holding <key>, vt), KEYS[i+1]
--             the waiting keys by pass, KEYS[i+2] presences "<key>|<worker>" by expiry
--             (ms), KEYS[i+3] passes of keys that left ahead of vt; those three come as
--             kind "-" (keys only). a = the fair key (a digest), b = "<stride> <more>
--             <presence ms>": more = 1 when the asking worker holds other requests of
--             the key. Passes only if the key is among the first `free` waiting keys
--             by pass (free: what condition i-1 admits now). Denied here or by i-1, the
--             key is registered as waiting (the only other writes a denial makes).
-- The store epochs, once every condition passed (no kind of their own, no ARGV: the
-- script runs for every admitted task, and each argument costs):
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
-- returns   {1, fence, start_in_us, at_us, epoch, order} granted (fence 0 when no lease
--                                         asked for one; epoch '' without KEYS[n+1]);
--                                         start no earlier than start_in_us from now,
--                                         which is at_us on the server's clock (us)
--           {0, i, retry_after_us, holder, order} denied by condition i; nothing was
--                                         written (but an "S" record, and its order).
--           order: what an "S" condition without one was given (0: none).
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
-- What to write once every condition passed, one record per condition (positional: the
-- script runs for every admitted task, and array tables are the cheapest):
--   {'L', key, expired fields or nil, fence asked, my current value or nil, last fence,
--    latest deadline of the others, "_e" (key expires no earlier), key existed}
--   {'R', key, new TAT, stored TAT or nil}      {'U', key, task id}
--   {'K', key, task id, ttl in ms}
local writes = {}
local override = nil
local epoch = ''
local start_at = now_us  -- a reserved rate slot may start later than now
-- fairness ("F"): what the condition before it admits now, and, for a rate, when the
-- slot after the next one comes (a key denied its turn asks again then)
local free, fair_retry_us = 0, 0

local n = (#ARGV - 3) / 3
-- The fairness functions (kind "F"), made only when a call has an "F": most calls have
-- none, and a function definition run costs every call that runs it (a closure and its
-- upvalues each time). The call sites test `fair_wait` (nil: no "F" in this call).
local fair_of, fair_vt, fair_leave, fair_sweep, fair_pass, fair_touch, fair_present
local fair_wait
for fair_i = 1, n do
  if ARGV[3 * fair_i + 1] == 'F' then
    fair_of = function(i)
      local stride, more, presence = string.match(ARGV[3 * i + 3], '^(%S+) (%S+) (%S+)$')
      return {n = KEYS[i], q = KEYS[i + 1], p = KEYS[i + 2], s = KEYS[i + 3],
        k = ARGV[3 * i + 2], stride = tonumber(stride), more = more == '1',
        presence = tonumber(presence),
        worker = string.match(owner, '^[^|]*|([^|]*)') or owner}  -- of the owner
    end

    -- The pass of the latest grant, read once per call.
    fair_vt = function(f)
      if not f.vt then f.vt = tonumber(call('HGET', f.n, 'vt') or '0') end
      return f.vt
    end

    -- A key no worker holds any more leaves the queue; its pass is kept while ahead of vt.
    fair_leave = function(f, k, pass)
      call('HDEL', f.n, 'n:' .. k)
      pass = pass or tonumber(call('ZSCORE', f.q, k) or '0')
      call('ZREM', f.q, k)
      if pass > fair_vt(f) then call('ZADD', f.s, pass, k) end
    end

    -- Presences not renewed in time: their worker died, or its requests left unannounced.
    fair_sweep = function(f)
      local gone = call('ZRANGEBYSCORE', f.p, '-inf', now_ms, 'LIMIT', 0, 64)
      for _, member in ipairs(gone) do
        call('ZREM', f.p, member)
        local k = string.match(member, '^([^|]*)')
        if call('HINCRBY', f.n, 'n:' .. k, -1) <= 0 then fair_leave(f, k) end
      end
    end

    -- The pass key f.k has, or would have if it started waiting now.
    fair_pass = function(f)
      local pass = call('ZSCORE', f.q, f.k)
      if pass then return tonumber(pass), true end
      local vt = fair_vt(f)
      local saved = tonumber(call('ZSCORE', f.s, f.k) or '0')
      if saved > vt then return saved, false end
      return vt, false
    end

    fair_touch = function(f)
      local ms = 2 * f.presence
      call('PEXPIRE', f.n, ms); call('PEXPIRE', f.q, ms)
      call('PEXPIRE', f.p, ms); call('PEXPIRE', f.s, ms)
    end

    -- This worker holds (other) requests of f.k: the key waits, at `pass`.
    fair_present = function(f, pass)
      call('ZADD', f.q, pass, f.k)
      call('ZREM', f.s, f.k)
      if call('ZADD', f.p, now_ms + f.presence, f.k .. '|' .. f.worker) == 1 then
        call('HINCRBY', f.n, 'n:' .. f.k, 1)
      end
      fair_touch(f)
    end

    -- Condition i (an "L" or "R") denied: if an "F" follows, its key now waits.
    fair_wait = function(i)
      if ARGV[3 * (i + 1) + 1] ~= 'F' then return end
      local f = fair_of(i + 1)
      fair_sweep(f)
      fair_present(f, (fair_pass(f)))
    end
    break
  end
end
local assigned = 0  -- the publish order an "S" condition was given here
local SUPERSEDE_TTL_MS = 86400000

for i = 1, n do
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
      if fair_wait then fair_wait(i) end
      return {0, i, (earliest - now_ms) * 1000, string.sub(holder, 3), assigned}
    end
    free = limit - live
    if mine then free = 1e9 end  -- a retried call of the same owner keeps its lease
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
    -- Slots free within the reservation window (for an "F" after this condition).
    if fair_wait and ARGV[base + 4] == 'F' then
      free = math.floor((now_us + reserve_us - tat) / interval) + burst
      fair_retry_us = math.max(allow_at + interval - now_us, 1)
    end
    if now_us < allow_at then
      if allow_at - now_us > reserve_us then
        if fair_wait then fair_wait(i) end
        return {0, i, allow_at - now_us, '', assigned}
      end
      -- Reserve the slot: the schedule advances exactly one interval, however late
      -- the waiter wakes, so the rate holds without crediting lateness.
      if allow_at > start_at then start_at = allow_at end
    end
    writes[#writes + 1] = {'R', key, new_tat, stored}
  elseif kind == 'W' then
    -- The same strict GCRA as "R", weighted: a call of cost n moves TAT n intervals.
    local stored = call('GET', key)
    local tat = tonumber(stored) or now_us
    if tat < now_us then tat = now_us end
    local new_tat = tat + tonumber(a)
    local allow_at = new_tat - tonumber(b)
    if now_us < allow_at then
      if allow_at - now_us > reserve_us then
        return {0, i, allow_at - now_us, '', assigned}
      end
      if allow_at > start_at then start_at = allow_at end
    end
    writes[#writes + 1] = {'R', key, new_tat, stored}
  elseif kind == 'P' then
    local until_us = tonumber(call('GET', key))
    if until_us and until_us > now_us then
      return {0, i, until_us - now_us, '', assigned}
    end
  elseif kind == 'O' then
    local value = call('HGET', key, a)
    local limit, extra = nil, nil
    if value then limit, extra = string.match(value, '^(%S+)%s*(%S*)$') end
    if limit then override = {limit, extra} end  -- (`limits set` validates what it writes)
  elseif kind == 'F' then
    local f = fair_of(i)
    fair_sweep(f)
    local pass, waiting = fair_pass(f)
    -- Keys ahead: a lower pass (ties: the one already waiting, then by name).
    local ahead = call('ZCOUNT', f.q, '-inf', '(' .. format('%.17g', pass))
    if waiting then ahead = call('ZRANK', f.q, f.k) end
    if ahead >= free then
      fair_present(f, pass)
      local retry = fair_retry_us
      if ARGV[3 * i - 2] == 'L' then
        call('HSET', KEYS[i - 1], '_w', '1')  -- woken by the next release
        retry = f.presence / 3 * 1000  -- and renews its presence by then
      end
      return {0, i, retry, '', assigned}
    end
    writes[#writes + 1] = {'F', f, pass}
  elseif kind == 'D' then
    local done
    if a == '' then
      done = call('EXISTS', key) == 1
    else
      local until_ms = redis.pcall('ZSCORE', key, a)
      -- an error: an older version's marker (a string), which refuses any run of the id
      done = type(until_ms) == 'table' or (until_ms and tonumber(until_ms) > now_ms)
    end
    if done then return {0, i, -1, b, assigned} end
  elseif kind == 'S' then
    local order = call('HMGET', key, 'n', 'top', 'id')
    local seq = tonumber(a)
    if not seq then
      seq = math.max((tonumber(order[1]) or 0) + 1, now_us)
      call('HSET', key, 'n', format('%d', seq))
      assigned = seq
    end
    local newest = tonumber(order[2]) or 0
    if seq < newest then return {0, i, -1, order[3] or '', assigned} end
    if seq > newest then
      call('HSET', key, 'top', format('%d', seq), 'id', b)
      call('PEXPIRE', key, SUPERSEDE_TTL_MS)
    end
  elseif kind == 'N' then
    local by = call('GET', key)
    if by and by ~= 'q' and by ~= 'run' then return {0, i, -1, by, assigned} end
    writes[#writes + 1] = {'N', key, a}
  elseif kind == 'U' then
    writes[#writes + 1] = {'U', key, a}
  elseif kind == 'K' then
    writes[#writes + 1] = {'K', key, a, b}
  end
end

-- Every condition passed: the store epochs, when a lease is asked for (see the top):
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

-- A rate key expires at the end of the second its TAT falls in (EXPIRE_GRAIN below).
-- While the TAT stays within that second, the key's expiry is already right and the write
-- keeps it (KEEPTTL); so a busy rate key moves its expiry once a second, not on every
-- decision. The key is gone at most a second after its schedule ran out (a missing key
-- means the same as a TAT in the past).
local EXPIRE_GRAIN = 1000000

local fence = 0
for n_write = 1, #writes do
  local w = writes[n_write]
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
    local expires_at = new_tat - new_tat % EXPIRE_GRAIN + EXPIRE_GRAIN
    if old and old - old % EXPIRE_GRAIN + EXPIRE_GRAIN == expires_at then
      call('SET', key, format('%d', new_tat), 'KEEPTTL')
    else
      call('SET', key, format('%d', new_tat), 'PX', format('%d', (expires_at - now_us) / 1000 + 1))
    end
  elseif w[1] == 'F' then
    -- The turn is taken: the key's pass moves on by its stride (1e6 / weight).
    local f, pass = w[2], w[3]
    if pass > fair_vt(f) then
      f.vt = pass
      call('HSET', f.n, 'vt', format('%.17g', pass))
    end
    call('ZREMRANGEBYSCORE', f.s, '-inf', format('%.17g', f.vt))
    pass = pass + f.stride
    if f.more then
      fair_present(f, pass)
    else
      if call('ZREM', f.p, f.k .. '|' .. f.worker) == 1 then
        call('HINCRBY', f.n, 'n:' .. f.k, -1)
      end
      if tonumber(call('HGET', f.n, 'n:' .. f.k) or '0') <= 0 then
        fair_leave(f, f.k, pass)
      else
        call('ZADD', f.q, pass, f.k)
      end
      fair_touch(f)
    end
  elseif w[1] == 'N' then
    call('SET', key, 'run', 'PX', w[3])
  elseif w[1] == 'U' then
    if call('GET', key) == w[3] then call('DEL', key) end
  elseif w[1] == 'K' then
    -- Only this task id's claim: a claim that lapsed may belong to a later publish now.
    if call('GET', key) == w[3] then call('PEXPIRE', key, w[4]) end
  end
end
return {1, fence, start_at - now_us, start_at, epoch, assigned}
