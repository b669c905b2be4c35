-- gate, kind "P": a named limit's penalty (Penalty, `penalize`): denied while KEYS[i]
-- holds an instant (us, server clock) still to come; retry_after = the rest of the
-- penalty. a and b: unused. No write.
--: check
  elseif kind == 'P' then
    local until_us = tonumber(call('GET', key))
    if until_us and until_us > now_us then
      return {0, i, until_us - now_us, '', assigned}
    end
