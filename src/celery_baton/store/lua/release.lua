-- release: free a run's leases (owner compared: never another owner's), and optionally
-- mark its task id done and free its unique claim (or keep it a while longer, for the
-- copy of a message whose ack failed). Publishes each freed lease key on the notice
-- channel, when someone waits for it, so that held requests wake at once instead of
-- polling.
--
-- KEYS[1..n]  lease keys held by ARGV[1]
-- KEYS[n+1]   (optional) done-marker key, when ARGV[3] > 0
-- KEYS[n+2]   (optional) unique key, when ARGV[4] ~= ''
-- ARGV[1]     owner
-- ARGV[2]     n: number of lease keys
-- ARGV[3]     done-marker ttl in milliseconds (0: do not mark)
-- ARGV[4]     task id owning the unique key ('' : leave it)
-- ARGV[5]     notice channel
-- ARGV[6]     (optional) > 0: keep the unique claim this many ms instead of freeing it
--             (taken again if it is free: the run's end freed it already)
-- ARGV[7]     (with ARGV[3] > 0) the stamp of the publish whose run finished ('' : none)
-- ARGV[8]     (with ARGV[3] > 0, optional) a scheduled beat slot: "<slot> <the fired
--             slot before it, or nothing>" (ms); KEYS[n+1] is then its entry's run
--             record, not a task id's done marker
-- ARGV[9]     (optional; ARGV[6..8] then given, '' when unused) an ordered call's end
--             (ordered=, gate/ordered.lua): "<epoch> <position> <final 2|1|0> <hold ms>";
--             KEYS[last] is then its key's order record, and ARGV[10] the key's lease,
--             announced on the notice channel when the position advanced and a call
--             waits. Final: the next position's turn (q = position + 1; its gap clock
--             starts now). Not final (a retry, a message that comes back): the position
--             keeps its turn, its gap clock restarting <hold ms> from now (when the retry
--             is due). 2: the call left without a run (skipped, revoked, cancelled): its
--             position is given up, now if it is q, else marked ("d:<position>") and passed
--             over when q reaches it. 3: final, recorded by the run's pool process while
--             its lease is held: q moves, and the waiters are woken by the release of the
--             lease (a "1" that finds q moved already). Only under that epoch, and only a
--             position not passed:
--             a call skipped by the gap bound, or of a lost record, moves nothing. Passing
--             q moves it over every given-up position after it.
-- ARGV[11]    (optional; ARGV[6..10] then given, '' when unused) > 0: the leases are
--             freed by the run's own process as its body ended, before its worker's
--             main process knows (it may be cut off from the broker for a while, and
--             renews them meanwhile): each freed lease leaves "x:<owner>" -> "<until ms>"
--             for this many ms, which tells renew.lua "ended with its run", not "lost".
--             Without it, a lease this owner no longer holds loses that mark (its
--             worker knows of the end now).
-- returns     number of leases this owner actually held and freed
--
-- The done marker is a sorted set of the task id's publishes that finished: member the
-- publish stamp, score when it is forgotten (ms, the server's clock); the key lives as
-- long as its latest member (gate.lua, "D", reads it). At most MAX_STAMPS are kept (a
-- task that replaces itself in a loop publishes its id again and again): the oldest go.
local MAX_STAMPS = 1000
--
-- A beat slot's run record holds its entry's slots that ran, whatever their number: the
-- runs of consecutive fired slots (each message names the fired slot before its own),
-- member "<first slot>|<the fired slot before it>", score the run's last slot. A slot
-- that ran extends the run that ends with the slot before it, and joins the run that
-- starts after it; in order, an entry keeps one member. A gap is a fired slot that has
-- not run yet (queued, running, or lost): at most MAX_GAPS are kept, and none whose
-- slots are older than the retention (ARGV[3]): such a gap is closed, its slots taken as
-- run. The key lives the retention after its latest run.
local MAX_GAPS = 100
local call = redis.call

local function run_of(member)
  return string.match(member, '^(%d+)|(%d*)$')
end

local function record_slot(key, link, now_ms, keep_ms)
  local slot, before = string.match(link, '^(%d+) ?(%d*)$')
  local after = call('ZRANGEBYSCORE', key, slot, '+inf', 'WITHSCORES', 'LIMIT', 0, 1)
  local after_first, after_before = nil, nil
  if after[1] then after_first, after_before = run_of(after[1]) end
  if not (after_first and tonumber(after_first) <= tonumber(slot)) then  -- not recorded yet
    local first, first_before, last = slot, before, slot
    if before ~= '' then
      local joined = call('ZRANGEBYSCORE', key, before, before, 'LIMIT', 0, 1)[1]
      if joined then
        first, first_before = run_of(joined)
        call('ZREM', key, joined)
      end
    end
    if after_before == slot then
      last = string.format('%d', tonumber(after[2]))
      call('ZREM', key, after[1])
    end
    call('ZADD', key, last, first .. '|' .. first_before)
    -- Close the oldest gap while there are too many or its slots are past the retention.
    while true do
      local oldest = call('ZRANGE', key, 0, 1, 'WITHSCORES')
      if #oldest < 4 then break end
      local second_first, second_before = run_of(oldest[3])
      local newest_missing = tonumber(second_before ~= '' and second_before or second_first)
      if newest_missing > now_ms - keep_ms and call('ZCARD', key) <= MAX_GAPS + 1 then break end
      call('ZREM', key, oldest[1], oldest[3])
      call('ZADD', key, oldest[4], oldest[1])
    end
  end
  call('PEXPIRE', key, keep_ms)
end

local owner_field = 'o:' .. ARGV[1]
local ended_field = 'x:' .. ARGV[1]
local n = tonumber(ARGV[2])
local done_ttl = tonumber(ARGV[3])
local unique_owner = ARGV[4]
local ended_ms = tonumber(ARGV[11] or '') or 0
local ended_until = nil
if ended_ms > 0 and n > 0 then
  local t = redis.call('TIME')
  ended_until = string.format('%d', t[1] * 1000 + math.floor(t[2] / 1000) + ended_ms)
end
local freed = 0
for i = 1, n do
  if redis.call('HDEL', KEYS[i], owner_field) == 1 then
    freed = freed + 1
    if ended_until then
      redis.call('HSET', KEYS[i], ended_field, ended_until)
      -- A key that held only this lease had no expiry of its own to outlive it.
      if redis.call('PTTL', KEYS[i]) < ended_ms then redis.call('PEXPIRE', KEYS[i], ended_ms) end
    end
    -- Only when the gate saw someone wait for this key: most releases have no waiter.
    if redis.call('HDEL', KEYS[i], '_w') == 1 then
      redis.call('PUBLISH', ARGV[5], KEYS[i])
    end
  elseif ended_ms == 0 then
    redis.call('HDEL', KEYS[i], ended_field)
  end
end
local next_key = n + 1
if done_ttl > 0 then
  local key, stamp, link = KEYS[next_key], ARGV[7] or '', ARGV[8] or ''
  local t = redis.call('TIME')
  local now_ms = t[1] * 1000 + math.floor(t[2] / 1000)
  if link ~= '' then
    record_slot(key, link, now_ms, done_ttl)
  else
    local forget_at = string.format('%d', now_ms + done_ttl)
    if type(redis.pcall('ZADD', key, forget_at, stamp)) == 'table' then
      redis.call('DEL', key)  -- an older version's marker (a string)
      redis.call('ZADD', key, forget_at, stamp)
    end
    redis.call('ZREMRANGEBYSCORE', key, '-inf', string.format('%d', now_ms))
    local count = redis.call('ZCARD', key)
    if count > MAX_STAMPS then redis.call('ZREMRANGEBYRANK', key, 0, count - MAX_STAMPS - 1) end
    if redis.call('PTTL', key) < done_ttl then redis.call('PEXPIRE', key, done_ttl) end
  end
  next_key = next_key + 1
end
if unique_owner ~= '' then
  local keep_ms = tonumber(ARGV[6] or '0') or 0
  local holder = redis.call('GET', KEYS[next_key])
  if keep_ms > 0 then
    -- The run's pool process freed the claim before storing its result (a caller who
    -- saw the result gets a new run): taken back for the copy, unless a publish since
    -- took the key.
    if holder == unique_owner or not holder then
      redis.call('SET', KEYS[next_key], unique_owner, 'PX', keep_ms)
    end
  elseif holder == unique_owner then
    redis.call('DEL', KEYS[next_key])
  end
end
local order = ARGV[9] or ''
if order ~= '' then
  local record = KEYS[#KEYS]
  local epoch, seq, final, hold_ms = string.match(order, '^(%d+) (%d+) (%d) (%d+)$')
  local now = call('HMGET', record, 'e', 'q')
  if now[1] == epoch and final == '2' and tonumber(seq) > tonumber(now[2]) then
    call('HSET', record, 'd:' .. seq, '1')  -- given up before its turn
  elseif now[1] == epoch and now[2] == seq then
    local t = call('TIME')
    local now_ms = t[1] * 1000 + math.floor(t[2] / 1000)
    if final ~= '0' then
      local q = tonumber(seq) + 1
      while call('HDEL', record, 'd:' .. q) == 1 do q = q + 1 end
      call('HSET', record, 'q', string.format('%d', q), 't', string.format('%d', now_ms))
      -- "3": recorded by the run's pool process, its lease still held: the waiters are
      -- woken when its worker frees the lease (below), not now, to find it held.
      if final ~= '3' and call('HDEL', record, 'w') == 1 then
        call('PUBLISH', ARGV[5], ARGV[10])
      end
    else
      call('HSET', record, 't', string.format('%d', now_ms + tonumber(hold_ms)))
    end
  elseif now[1] == epoch and final == '1' and freed > 0 then
    -- Its pool process moved the line already; its lease is free now: the next call's
    -- turn has come.
    if call('HDEL', record, 'w') == 1 then call('PUBLISH', ARGV[5], ARGV[10]) end
  end
end
return freed
