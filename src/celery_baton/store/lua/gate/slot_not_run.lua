-- gate, kind "B": a scheduled beat slot's run record (SlotNotRun; policy/slot_runs.py),
-- written by release.lua: its entry's slots that ran, as runs of consecutive fired slots
-- in a sorted set (member "<first slot>|<the fired slot before it, or ''>", score the
-- run's last slot). a = the slot (ms), b = its task id. Denied (retry_after -1, holder =
-- b) when the slot lies in a recorded run. No write.
--: check
  elseif kind == 'B' then
    -- The run of the smallest last slot >= a holds a when it starts at or before a.
    local run = call('ZRANGEBYSCORE', key, a, '+inf', 'LIMIT', 0, 1)[1]
    if run and tonumber(string.match(run, '^(%d+)')) <= tonumber(a) then
      return {0, i, -1, b, assigned}
    end
