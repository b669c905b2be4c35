-- gate, kind "N": not superseded (NotSuperseded; unique_conflict "replace"): denied
-- (retry_after -1, holder = the replacing task id) when KEYS[i] names a task id; on
-- grant set to 'run' for a milliseconds, so a replace that comes later leaves this run
-- alone.
-- Its write: {'N', key, ttl in ms}
--: check
  elseif kind == 'N' then
    local by = call('GET', key)
    if by and by ~= 'q' and by ~= 'run' then return {0, i, -1, by, assigned} end
    writes[#writes + 1] = {'N', key, a}
--: write
  elseif w[1] == 'N' then
    call('SET', key, 'run', 'PX', w[3])
