-- batch/done.lua, put in place of "-- @include batch/done.lua" in the batch scripts (one
-- chunk, as if written there): a call's end, and its holders told.
-- KEYS as in those scripts: [1] pending [2] calls [3] holder [5] claimed [6] done
-- [7] runs [8] finished.

-- Marks call ``id`` done (remembered until ``keep``, ms) and takes it out of the key's
-- waiting, claimed and held calls; returns the worker that held its message, if any.
local function mark_done(id, keep)
  local holder = redis.call('HGET', KEYS[3], id)
  redis.call('ZADD', KEYS[6], keep, id)
  redis.call('HDEL', KEYS[5], id)
  redis.call('ZREM', KEYS[1], id)
  redis.call('HDEL', KEYS[2], id)
  redis.call('HDEL', KEYS[3], id)
  return holder
end

-- Keeps done call ``id``'s marker until ``until_ms`` at least: a copy of it was seen, and
-- one whose ack fails again comes back later still; a chain of redeliveries outlived a
-- marker kept from the run's end only (the 25-minute soak, seed 263512648).
local function keep_done(id, until_ms)
  local score = tonumber(redis.call('ZSCORE', KEYS[6], id))
  if score and score < until_ms then redis.call('ZADD', KEYS[6], until_ms, id) end
end

-- Adds ``id`` to ``holder``'s line of ``inbox`` (holder -> "id,id,...").
local function to_inbox(inbox, holder, id)
  inbox[holder] = (inbox[holder] and (inbox[holder] .. ',') or '') .. id
end

-- Each holder of ``inbox`` learns its done calls at its next tick (batch_tick).
local function tell_holders(inbox)
  for holder, ids in pairs(inbox) do
    local before = redis.call('HGET', KEYS[8], holder)
    redis.call('HSET', KEYS[8], holder, before and (before .. ',' .. ids) or ids)
  end
end

-- Ends run ``run``'s lease; the calls it still holds claimed (not marked done: a run
-- that failed, or calls left out of it) wait again, each with its place in the line.
-- Returns 1 when the run was still leased.
local function end_run(run)
  if redis.call('ZREM', KEYS[7], run) == 0 then return 0 end
  local claimed = redis.call('HGETALL', KEYS[5])
  for i = 1, #claimed, 2 do
    local by, since = string.match(claimed[i + 1], '^(%S+) (%d+)$')
    if by == run then
      redis.call('HDEL', KEYS[5], claimed[i])
      redis.call('ZADD', KEYS[1], since, claimed[i])
    end
  end
  return 1
end
