-- gate, kind "D": the done marker of a task id (NotDone): a sorted set of the publishes
-- whose run finished (member: the publish stamp, '' for a message sent without one;
-- score: when it is forgotten, ms), written by release.lua. a = this delivery's stamp,
-- b = its task id. Denied (retry_after -1, holder = b) when a is recorded (a copy of a
-- publish that ran), or a is '' and the key exists (an unstamped message is judged by
-- its id: any finished run), or the key is an older version's marker (a string: any
-- finished run). No write.
--: check
  elseif kind == 'D' then
    local done
    if a == '' then
      done = call('EXISTS', key) == 1
    else
      local until_ms = redis.pcall('ZSCORE', key, a)
      -- an error: an older version's marker (a string), which refuses any run of the id
      done = type(until_ms) == 'table' or (until_ms and tonumber(until_ms) > now_ms)
    end
    if done then return {0, i, -1, b, assigned} end
