-- batch_done: a batch ran and its results are written (from the pool process that ran
-- it): its calls are done. Each holder learns it at its next tick and acks its message;
-- a message of one of them delivered again later finds the done marker and is acked.
--
-- KEYS[1] pending   KEYS[2] calls   KEYS[3] holder   KEYS[4] workers
-- KEYS[5] claimed   KEYS[6] done    KEYS[7] runs     KEYS[8] finished   KEYS[9] epoch
-- KEYS[10] label   KEYS[11] here (unused here)
-- ARGV[1] the run's id   ARGV[2] how long a done call is remembered (ms)
-- ARGV[3..] the batch's call ids
-- returns 1 when the run was still leased, 0 when its lease had lapsed (its calls may
--         have been claimed again: they are marked done all the same).
-- A call the run claimed and did not run (left out so that the batch's cost fits its
-- named limits: worker/batching.py) waits again, with its place in the line.

-- @include batch/done.lua

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local keep = now + tonumber(ARGV[2])
local inbox = {}
for i = 3, #ARGV do
  local holder = mark_done(ARGV[i], keep)
  if holder then
    to_inbox(inbox, holder, ARGV[i])
  end
end
tell_holders(inbox)
return end_run(ARGV[1])
