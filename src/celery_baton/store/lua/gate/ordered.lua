-- gate, kind "Q": the turn of one call of an ordered key (InOrder, core/ordered.py).
-- KEYS[i] the key's order record, a hash (ordered_stamp.lua writes it at publish):
--   e  the record's epoch (us when it was created)    n  the last position given
--   q  the next position to start ("next")            t  since when q's gap clock runs (ms)
--   w  set while a call waits (release.lua announces the advance then)
--   g  positions skipped so far   gl  the last skip, "<from>-<to> <ms>"
--   s  the latest skipped ranges, "<from>-<to>,...", to tell a late call why it is late
--   p:<position>  a waiting call of that position is present until then (ms): it asked
--      and was denied, and asks again within its presence
--   d:<position>  that call left without a run before its turn (release.lua passes it)
-- KEYS[i+1] the key's exclusive lease (condition i+1, an "L": one run at a time).
-- a = "<epoch>:<position>" from the publish ('' : a message without one, given the next
-- position here, and returned in `note` as "assigned <epoch>:<position>");
-- b = "<gap bound ms> <record life ms>".
-- Passes when the position is q. A later position is denied (holder "wait <q>") until
-- q's call ends for good (release.lua advances q, and wakes the waiters), retry_after:
-- until the lease of a running call would run out, else until the gap bound: a position
-- whose call has not run for the bound (no lease on the key since q became next, or since
-- its last lease ran out, or since its retry was due) is skipped, up to the first
-- position whose call is present (note "skip <from>-<to>", written at once, whatever
-- the conditions after it say): the asking call passes when it is that first one, else
-- waits for it. An earlier position than q is denied for good
-- (retry_after -1, holder "gap <q>" when it was skipped, "ran <q>" else). A message whose
-- epoch is not the record's (the record was lost: the store restarted empty, or it
-- expired) passes, note "lost": it runs in arrival order, one at a time.
-- Its write: {'Q', key, position, record life ms}: the position's presence goes.
--: check
  elseif kind == 'Q' then
    local gap_ms, life_ms = string.match(b, '^(%d+) (%d+)$')
    gap_ms = tonumber(gap_ms)
    local rec = call('HMGET', key, 'e', 'q', 't', 's')
    local epoch, seq = string.match(a, '^(%d+):(%d+)$')
    seq = tonumber(seq)
    if not seq and not rec[1] then
      -- An unstamped message of a key with no record: the record starts here.
      rec[1] = format('%d', now_us)
      rec[2], rec[3] = '1', format('%d', now_ms)
      call('HSET', key, 'e', rec[1], 'q', '1', 'n', '0', 't', rec[3])
      call('PEXPIRE', key, life_ms)
    end
    if seq and epoch ~= rec[1] then
      note = 'lost'
      writes[#writes + 1] = {'Q', key, 0, life_ms}
    else
      local q = tonumber(rec[2])
      if not seq then
        seq = call('HINCRBY', key, 'n', 1)
        note = 'assigned ' .. rec[1] .. ':' .. format('%d', seq)
        if seq == q then
          -- The key was idle: its gap clock starts with this position (ordered_stamp.lua).
          rec[3] = format('%d', now_ms)
          call('HSET', key, 't', rec[3])
        end
      end
      if seq < q then
        local why = 'ran'
        for from, to in string.gmatch(rec[4] or '', '(%d+)-(%d+)') do
          if seq >= tonumber(from) and seq <= tonumber(to) then why = 'gap' end
        end
        return {0, i, -1, format('%s %d', why, q), assigned, note}
      end
      if seq > q then
        -- Someone else's turn. Its call runs while it holds the lease; else the gap
        -- clock runs from the latest of: q became next, its retry was due, its
        -- last lease ran out.
        local flat = call('HGETALL', KEYS[i + 1])
        local live_until, latest = 0, 0
        for j = 1, #flat, 2 do
          if string.byte(flat[j], 1) == 111 then  -- 'o': "o:<owner>", a lease
            local deadline = tonumber(string.match(flat[j + 1], '^%d+'))
            if deadline > latest then latest = deadline end
            if deadline > now_ms and deadline > live_until then live_until = deadline end
          end
        end
        local since = tonumber(rec[3]) or now_ms
        if latest > since then
          since = latest
          call('HSET', key, 't', format('%d', latest))
        end
        -- This call waits, and is present ("p:<position>") for as long as it asks again
        -- within a lease ttl or a gap bound: the gap bound never skips a present call.
        local presence_ms = 2 * math.max(ttl_ms, gap_ms, 1000)
        call('HSET', key, 'w', '1', 'p:' .. seq, format('%d', now_ms + presence_ms))
        if live_until > 0 then
          return {0, i, (live_until - now_ms) * 1000, format('wait %d', q), assigned, note}
        end
        if since + gap_ms > now_ms then
          return {0, i, (since + gap_ms - now_ms) * 1000, format('wait %d', q), assigned, note}
        end
        -- The gap bound passed: skip the positions up to the first that waits (a call
        -- that asked within its presence), which is this one or an earlier one.
        local first = seq
        local fields = call('HGETALL', key)
        for j = 1, #fields, 2 do
          local dead = string.match(fields[j], '^d:(%d+)$')
          if dead and tonumber(dead) < q then call('HDEL', key, fields[j]) end
          local waiting = string.match(fields[j], '^p:(%d+)$')
          if waiting then
            waiting = tonumber(waiting)
            if tonumber(fields[j + 1]) <= now_ms or waiting < q then
              call('HDEL', key, fields[j])  -- gone quiet (its worker died), or passed
            elseif waiting < first then
              first = waiting
            end
          end
        end
        if first > q then
          -- Positions q..first-1 are skipped: q moves on, the skip is recorded.
          local ranges = format('%d-%d', q, first - 1)
          local n_kept = 0
          for range in string.gmatch(rec[4] or '', '[^,]+') do
            n_kept = n_kept + 1
            if n_kept < 64 then ranges = ranges .. ',' .. range end
          end
          call('HSET', key, 'q', format('%d', first), 's', ranges,
            'gl', format('%d-%d %d', q, first - 1, now_ms), 't', format('%d', now_ms))
          call('HINCRBY', key, 'g', first - q)
          note = format('skip %d-%d', q, first - 1)
        end
        if first < seq then
          -- An earlier call waits: its turn now (it asks at its own timer, due now).
          return {0, i, gap_ms * 1000, format('wait %d', first), assigned, note}
        end
      end
      writes[#writes + 1] = {'Q', key, seq, life_ms}
    end
--: write
  elseif w[1] == 'Q' then
    if w[3] > 0 then
      call('HDEL', key, 'p:' .. w[3])
      call('PEXPIRE', key, w[4])
    end
