-- held_for_later: a worker holds a unique task for later (its countdown or ETA, in
-- Celery's timer) and says so under the task's id, with the unique key it holds, so that
-- baton.cancel(task_id), which knows only the id, can free that key before it marks the
-- task REVOKED (cancel_id.lua reads it). Taken back as the task's time comes
-- (held_start.lua).
--
-- KEYS[1]  the id's held-for-later mark (same hash tag as its cancel record: the id)
-- ARGV[1]  the unique key the task holds
-- ARGV[2]  how long it is kept, ms (until its time, and a margin: a mark that outlives
--          its start is taken back there)
-- returns  1

redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
