-- batch_tick: one worker's tick of one batch key (core/batch.py): register the calls it
-- received, renew its presence and the batches it runs, tell it which of its held calls
-- ran, and claim the next batch when one is due and it holds one of its calls.
--
-- KEYS[1] pending   KEYS[2] calls   KEYS[3] holder   KEYS[4] workers
-- KEYS[5] claimed (hash: call id -> "<run> <registered ms>")
-- KEYS[6] done      KEYS[7] runs (sorted set: run id -> lease until ms)
-- KEYS[8] finished
-- KEYS[9] epoch: "<until when (ms) no batch is claimed> <the server's replication id>",
--   written when the key is first seen by this server (it may have forgotten it) and
--   when the server was promoted from a replica (it may lack its old master's last
--   writes); a value without a replication id is adopted without a grace
-- KEYS[10] label: the key in words, for the operator (`celery baton locks`, the web view)
-- KEYS[11] here: present while this server checked its replication id for the key within
--   the last second (never replicated: a promoted replica does not have it)
-- ARGV[1] worker    ARGV[2] presence ttl (ms)   ARGV[3] batch size   ARGV[4] batch wait (ms)
-- ARGV[5] run ttl (ms)   ARGV[6] the batches this worker runs of this key, space separated
-- ARGV[7] the key in words ('' : not written), kept as label while a worker ticks the key
-- ARGV[8] how many due batches this worker may claim (its free processes; 0: none)
-- ARGV[9] n, then n pairs (call id, encoded call) to register
-- then m, and m pairs (run, call id): this worker's runs' calls (at a full check; else 0)
-- then d, how long a done call is remembered (ms), and d call ids: calls of batches this
-- worker ran to their end (their body returned) within the last run ttl, at a full check
-- while the key is in a grace: marked done again if the store lacks it (a promoted
-- replica that was behind, a server restarted empty)
-- then g and g call ids this worker held no more (cancelled, or its connection was
-- lost: the broker has them again): they leave the key
-- then '1' and every call id this worker holds (a full check), or '0'
-- returns {finished ids, missing ids, ms until a batch is due (-1: none waits; 0: due),
--          claims: a list of {run, carrier id, id1, call1, id2, call2, ...}, oldest first,
--          ms of the grace this tick started because the server was promoted (0: none),
--          how many of the d calls were not done here (their marker lost): done now,
--          ms left of the key's grace (0: none; a store that may have lost done markers:
--          runners send the calls of the batches they ran, the d calls above)}
--   finished: held calls that ran in a batch (their holder acks them, runs nothing);
--   missing: held calls the store does not know (it forgot them): register them again.

-- @include batch/done.lua
-- @include batch/bulk.lua

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local worker = ARGV[1]
local size, wait, ttl = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
redis.call('ZADD', KEYS[4], now + tonumber(ARGV[2]), worker)
local finished, missing, seen_done = {}, {}, {}  -- seen_done: copies of done calls seen

-- New calls: one that already ran (a redelivered message) is finished at once. In a few
-- commands of many arguments (one per call and field: 30 % more of the store's time).
local n = tonumber(ARGV[9])
local at = 10
if n > 0 then
  local ids = {}
  for i = 1, n do ids[i] = ARGV[at + 2 * i - 2] end
  local claimed_now = hmget(KEYS[5], ids)
  local waiting, calls, holders = {}, {}, {}
  for i = 1, n do
    local id = ids[i]
    if redis.call('ZSCORE', KEYS[6], id) then
      finished[#finished + 1], seen_done[#seen_done + 1] = id, id
    else
      if not claimed_now[i] then
        waiting[#waiting + 1] = now
        waiting[#waiting + 1] = id
      end
      calls[#calls + 1] = id
      calls[#calls + 1] = ARGV[at + 2 * i - 1]
      holders[#holders + 1] = id
      holders[#holders + 1] = worker
    end
  end
  bulk('ZADD', KEYS[1], 'NX', waiting)
  bulk('HSET', KEYS[2], nil, calls)
  bulk('HSET', KEYS[3], nil, holders)
  at = at + 2 * n
end
local run_calls = {}
local m = tonumber(ARGV[at])
for i = 1, m do
  local run, id = ARGV[at + 2 * i - 1], ARGV[at + 2 * i]
  run_calls[run] = run_calls[run] or {}
  table.insert(run_calls[run], id)
end
at = at + 2 * m + 1
-- Done again: the batch ran, its runner says so. The store lost the done marker (written
-- on a master that was then replaced by a replica it had not reached): each call is done
-- now, so that neither its holder's copy nor a lapsed claim runs it a second time.
local d = tonumber(ARGV[at])
local keep = now + tonumber(ARGV[at + 1])
for _, id in ipairs(seen_done) do keep_done(id, keep) end
local inbox = {}
local redone = 0
for i = 1, d do
  local id = ARGV[at + 1 + i]
  if not redis.call('ZSCORE', KEYS[6], id) then
    redone = redone + 1
    local holder = mark_done(id, keep)
    if holder == worker then
      finished[#finished + 1] = id
    elseif holder then
      to_inbox(inbox, holder, id)
    end
  end
end
tell_holders(inbox)
at = at + d + 2
local g = tonumber(ARGV[at])
for i = 1, g do
  -- Only while it is this worker's (a copy delivered to another worker since is theirs).
  local id = ARGV[at + i]
  if redis.call('HGET', KEYS[3], id) == worker then
    redis.call('HDEL', KEYS[3], id)
    if not redis.call('HGET', KEYS[5], id) then  -- claimed: its batch's (copies finish)
      redis.call('ZREM', KEYS[1], id)
      redis.call('HDEL', KEYS[2], id)
    end
  end
end
at = at + g + 1
local full = ARGV[at] == '1'
at = at + 1
-- The key in words: written with new calls and at every full check (each holder's, every
-- second), so it lasts as long as a worker ticks the key, and no longer.
if ARGV[7] ~= '' and (n > 0 or full) then
  redis.call('SET', KEYS[10], ARGV[7], 'PX', ARGV[2])
end

-- The key's epoch. Missing: the key is new, or the store forgot it (restarted empty)
-- with batches maybe running. A run from before can only have been claimed before the
-- server started, and lives at most one run ttl after: until then no batch is claimed,
-- so its runner has the time to write it back (below). A server up longer (a key never
-- used, or FLUSHALL of a live server: docs/guides/batching.md) gives no grace.
-- Written on another server's history: the server was promoted from a replica since
-- (master_replid changed, master_replid2 set; gate/epochs.lua), which may have been
-- behind: claims and done markers its old master wrote last (a Sentinel failover: the
-- old master takes writes until each worker sees the switch) may be missing. A grace of
-- one run ttl from now: runners write their runs back and mark their ended batches done
-- again (above) before any batch of the key is claimed. The check reads INFO (on this
-- server, once a second per key: "here").
local grace = 0
local promoted_grace = 0
local epoch = redis.call('GET', KEYS[9])
local checked = redis.call('EXISTS', KEYS[11]) == 1
if epoch and checked then
  grace = tonumber(string.match(epoch, '^(%d+)') or '0')
else
  local repl = redis.pcall('INFO', 'replication')
  if type(repl) ~= 'string' then repl = '' end
  local here = string.match(repl, 'master_replid:(%w+)') or ''
  local second = string.match(repl, 'master_replid2:(%w+)')
  local promoted = second ~= nil and second ~= string.rep('0', 40)
  if epoch then
    local until_ms, seen = string.match(epoch, '^(%d+) ?(%w*)')
    grace = tonumber(until_ms or '0')
    if seen ~= here then
      if seen ~= '' and promoted then
        grace = now + ttl
        promoted_grace = ttl
      end
      redis.call('SET', KEYS[9], string.format('%.0f %s', grace, here))
    end
  else
    local info = redis.pcall('INFO', 'server')
    local up = 0
    if type(info) == 'string' then
      up = tonumber(string.match(info, 'uptime_in_seconds:(%d+)') or '0')
    end
    -- (A promoted server keeps master_replid2 for as long as it runs: a key missing
    -- there is one never used, or first used on its old master within the writes it
    -- lost; only the second would need a grace, and it cannot be told from the first.)
    grace = now - up * 1000 + ttl
    if grace <= now then grace = 0 end
    redis.call('SET', KEYS[9], string.format('%.0f %s', grace, here))
  end
  redis.set_repl(redis.REPL_NONE)  -- this server's own finding (KEYS[11])
  redis.call('SET', KEYS[11], '1', 'PX', 1000)
  redis.set_repl(redis.REPL_ALL)
end

-- This worker's runs: renewed; one the store forgot (within the grace) written back,
-- so that its calls, registered again by their holders, are not claimed twice.
for run in string.gmatch(ARGV[6], '%S+') do
  if redis.call('ZSCORE', KEYS[7], run) then
    redis.call('ZADD', KEYS[7], now + ttl, run)
  elseif now < grace and run_calls[run] then
    redis.call('ZADD', KEYS[7], now + ttl, run)
    for _, id in ipairs(run_calls[run]) do
      if not redis.call('ZSCORE', KEYS[6], id) then
        local since = redis.call('ZSCORE', KEYS[1], id) or now
        redis.call('ZREM', KEYS[1], id)
        redis.call('HSET', KEYS[5], id, run .. ' ' .. since)
      end
    end
  end
end

-- Runs whose lease lapsed (their worker died or stood still) give their calls back.
local lapsed = redis.call('ZRANGEBYSCORE', KEYS[7], '-inf', now)
if #lapsed > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[7], '-inf', now)
  local gone = {}
  for _, run in ipairs(lapsed) do gone[run] = true end
  local claimed = redis.call('HGETALL', KEYS[5])
  for i = 1, #claimed, 2 do
    local run, since = string.match(claimed[i + 1], '^(%S+) (%d+)$')
    if gone[run] then
      redis.call('HDEL', KEYS[5], claimed[i])
      redis.call('ZADD', KEYS[1], since, claimed[i])
    end
  end
end

-- Calls done since this worker's last tick.
local inbox = redis.call('HGET', KEYS[8], worker)
if inbox then
  redis.call('HDEL', KEYS[8], worker)
  for id in string.gmatch(inbox, '[^,]+') do
    finished[#finished + 1] = id
  end
end

if full then
  redis.call('ZREMRANGEBYSCORE', KEYS[6], '-inf', now)
  redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', now)
  -- A waiting call whose holder is gone: its message went back to the broker, which
  -- delivers it again (to a worker that registers it again).
  local waiting = redis.call('ZRANGE', KEYS[1], 0, -1)
  for _, id in ipairs(waiting) do
    local holder = redis.call('HGET', KEYS[3], id)
    if not holder or not redis.call('ZSCORE', KEYS[4], holder) then
      redis.call('ZREM', KEYS[1], id)
      redis.call('HDEL', KEYS[2], id)
      redis.call('HDEL', KEYS[3], id)
    end
  end
  for i = at, #ARGV do
    local id = ARGV[i]
    if redis.call('ZSCORE', KEYS[6], id) then
      finished[#finished + 1] = id
      keep_done(id, keep)  -- a copy held here: its marker kept again
    elseif not redis.call('ZSCORE', KEYS[1], id) and redis.call('HEXISTS', KEYS[5], id) == 0 then
      missing[#missing + 1] = id
    end
  end
end

-- A batch is due when `size` calls wait or the oldest waited `wait` ms; it is claimed
-- by a worker that holds one of its calls (its message carries the run into that
-- worker's pool). Several batches of one key may run at once: a tick claims up to
-- ARGV[8] due ones (the worker's free processes), each carried by a call it holds (one
-- claimed per tick kept a backlog of full batches to 20 a second in a worker).
local due, claims, most = -1, {}, tonumber(ARGV[8])
local waiting = redis.call('ZCARD', KEYS[1])
while waiting > 0 do
  local oldest = tonumber(redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')[2])
  local waited = now - oldest
  if waiting < size and waited < wait then
    due = wait - waited
    break
  end
  due = 0
  if now < grace then
    due = grace - now
    break
  end
  if #claims >= most then break end
  local ids = redis.call('ZRANGE', KEYS[1], 0, size - 1, 'WITHSCORES')
  local members = {}
  for i = 1, #ids, 2 do members[#members + 1] = ids[i] end
  local held_by = hmget(KEYS[3], members)
  local carrier = nil
  for i = 1, #members do
    if held_by[i] == worker then
      carrier = members[i]
      break
    end
  end
  if not carrier then break end
  local run = worker .. '/' .. t[1] .. string.rep('0', 6 - #t[2]) .. t[2]
  if #claims > 0 then run = run .. '.' .. #claims end
  redis.call('ZADD', KEYS[7], now + ttl, run)
  local runs_of = {}
  for i = 1, #ids, 2 do
    runs_of[#runs_of + 1] = ids[i]
    runs_of[#runs_of + 1] = run .. ' ' .. ids[i + 1]
  end
  bulk('HSET', KEYS[5], nil, runs_of)
  bulk('ZREM', KEYS[1], nil, members)
  local encoded = hmget(KEYS[2], members)
  local claim = {run, carrier}
  for i = 1, #members do
    claim[#claim + 1] = members[i]
    claim[#claim + 1] = encoded[i] or ''
  end
  claims[#claims + 1] = claim
  waiting = waiting - #members
end
local grace_left = 0
if grace > now then grace_left = grace - now end
return {finished, missing, due, claims, promoted_grace, redone, grace_left}
