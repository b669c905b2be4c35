-- gate, kind "K": a unique claim to keep for the run (KeepUnique): if its value is a (the
-- task id), it expires b milliseconds from now. Never denies.
-- Its write: {'K', key, task id, ttl in ms}
--: check
  elseif kind == 'K' then
    writes[#writes + 1] = {'K', key, a, b}
--: write
  elseif w[1] == 'K' then
    -- Only this task id's claim: a claim that lapsed may belong to a later publish now.
    if call('GET', key) == w[3] then call('PEXPIRE', key, w[4]) end
