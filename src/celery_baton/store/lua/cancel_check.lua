-- cancel_check: whether a task id is cancelled (a delivery, asked only while the cancel
-- marker says cancels by id live; core/cancels.py).
--
-- KEYS[1]  the id's cancel record (cancel_id.lua)
-- returns  1 when the id is cancelled, else 0

return redis.call('EXISTS', KEYS[1])
