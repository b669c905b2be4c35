-- gate, kind "U": a unique claim to free on start (FreeUnique; unique_until="started"):
-- deleted if its value is a (the task id). Never denies.
-- Its write: {'U', key, task id}
--: check
  elseif kind == 'U' then
    writes[#writes + 1] = {'U', key, a}
--: write
  elseif w[1] == 'U' then
    if call('GET', key) == w[3] then call('DEL', key) end
