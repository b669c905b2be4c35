-- held_start: a task held for later (held_for_later.lua) reaches its time in its
-- worker: its mark goes, and in the same step the store says whether the id is
-- cancelled. A cancel that read the mark (and so freed the task's unique key) was
-- written before this runs, and is seen here: the task never starts under a freed key.
-- A cancel written after this finds no mark and leaves the key to the run.
--
-- KEYS[1]  the id's held-for-later mark
-- KEYS[2]  the id's cancel record (cancel_id.lua; same hash tag)
-- returns  1 when the id is cancelled, else 0

redis.call('DEL', KEYS[1])
return redis.call('EXISTS', KEYS[2])
