-- gate, kind "C": a unique claim made where the call arrives (ClaimUnique), for a call
-- published where its task's options were unknown (nothing was claimed at its publish).
-- a = the task id, b = the claim's ttl in ms. Denied (retry_after -1, holder = the task
-- id that holds the key) while another task id holds it: waiting cannot help, the call
-- is a duplicate. Its write: {'C', key, task id, ttl in ms}
--: check
  elseif kind == 'C' then
    local holder = call('GET', key)
    if holder and holder ~= a then return {0, i, -1, holder, assigned} end
    writes[#writes + 1] = {'C', key, a, b}
--: write
  elseif w[1] == 'C' then
    call('SET', key, w[3], 'PX', w[4])
