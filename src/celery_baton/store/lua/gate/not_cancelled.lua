-- gate, kind "X": not cancelled (NotCancelled; baton.cancel by id, core/cancels.py):
-- denied (retry_after -1, holder = a, the task id) while KEYS[i], the id's cancel
-- record (cancel_id.lua), exists. Asked first, and only while cancels by id live; on one
-- server only: the record's hash tag is the id, so on Redis Cluster the worker checks
-- it in a call of its own (cancel_check.lua). No write.
--: check
  elseif kind == 'X' then
    if call('EXISTS', key) == 1 then return {0, i, -1, a, assigned} end
