-- gate, kind "O": runtime override of the NEXT condition's a and b (Override): read field
-- a of the hash KEYS[i] ("<a> [<b>]"), set at runtime by `celery baton limits set`. The
-- next condition reads it (gate.lua, at the top of each condition). No write.
--: check
  elseif kind == 'O' then
    local value = call('HGET', key, a)
    local limit, extra = nil, nil
    if value then limit, extra = string.match(value, '^(%S+)%s*(%S*)$') end
    if limit then override = {limit, extra} end  -- (`limits set` validates what it writes)
