-- gate, kind "D": the done marker of a task id (NotDone): a sorted set of the publishes
-- whose run finished (member: the publish stamp, '' for a message sent without one;
-- or "<stamp>@<retries>" for an attempt that retried; score: when it is forgotten, ms),
-- written by release.lua. a = "<this delivery's stamp>@<its retries>", b = its task
-- id. Denied (retry_after -1, holder = b) when its stamp is recorded (a copy of a
-- publish that ran), or a itself is (a copy of an attempt that retried: the retry, one
-- attempt later, runs), or the stamp is '' and the key exists (an unstamped message is
-- judged by its id: any finished run), or the key is an older version's marker (a
-- string: any finished run). No write.
--: check
  elseif kind == 'D' then
    local done
    local stamp = string.sub(a, 1, (string.find(a, '@%d+$') or #a + 1) - 1)
    if stamp == '' then
      done = call('EXISTS', key) == 1
    else
      for _, member in ipairs({stamp, a}) do
        local until_ms = redis.pcall('ZSCORE', key, member)
        -- an error: an older version's marker (a string), which refuses any run of the id
        if type(until_ms) == 'table' or (until_ms and tonumber(until_ms) > now_ms) then
          done = true
          break
        end
      end
    end
    if done then return {0, i, -1, b, assigned} end
