-- gate, kind "Q": the turn of one call of an ordered key (InOrder, core/ordered.py).
-- KEYS[i] the key's order record, a hash (ordered_stamp.lua writes it at publish):
--   e  the record's epoch (us when it was created)    n  the last position given
--   q  the next position to start ("next")            t  since when q's gap clock runs (ms)
--   w  set while a call waits (release.lua announces the advance then)
--   g  positions skipped so far   gl  the last skip, "<from>-<to> <ms>"
--   s  the latest skipped ranges, "<from>-<to>,...", to tell a late call why it is late
-- KEYS[i+1] the key's exclusive lease (condition i+1, an "L": one run at a time).
-- a = "<epoch>:<position>" from the publish ('' : a message without one, given the next
-- position here, and returned in `note` as "assigned <epoch>:<position>");
-- b = "<gap bound ms> <record life ms>".
-- Passes when the position is q. A later position is denied (holder "wait <q>") until
-- q's call ends for good (release.lua advances q, and wakes the waiters), retry_after:
-- until the lease of a running call would run out, else until the gap bound: a position
-- whose call has not run for the bound (no lease on the key since q became next, or since
-- its last lease ran out, or since its retry was due) is skipped, and the asking call
-- passes (note "skip <from>-<to>"). An earlier position than q is denied for good
-- (retry_after -1, holder "gap <q>" when it was skipped, "ran <q>" else). A message whose
-- epoch is not the record's (the record was lost: the store restarted empty, or it
-- expired) passes, note "lost": it runs in arrival order, one at a time.
-- Its write: {'Q', key, position, skipped from or nil, record life ms}
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
      writes[#writes + 1] = {'Q', key, 0, nil, life_ms}
    else
      if not seq then
        seq = call('HINCRBY', key, 'n', 1)
        note = 'assigned ' .. rec[1] .. ':' .. format('%d', seq)
      end
      local q = tonumber(rec[2])
      if seq < q then
        local why = 'ran'
        for from, to in string.gmatch(rec[4] or '', '(%d+)-(%d+)') do
          if seq >= tonumber(from) and seq <= tonumber(to) then why = 'gap' end
        end
        return {0, i, -1, format('%s %d', why, q), assigned, note}
      end
      local skip_from = nil
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
        call('HSET', key, 'w', '1')
        if live_until > 0 then
          return {0, i, (live_until - now_ms) * 1000, format('wait %d', q), assigned, note}
        end
        if since + gap_ms > now_ms then
          return {0, i, (since + gap_ms - now_ms) * 1000, format('wait %d', q), assigned, note}
        end
        skip_from = q
        note = format('skip %d-%d', q, seq - 1)
      end
      writes[#writes + 1] = {'Q', key, seq, skip_from, life_ms}
    end
--: write
  elseif w[1] == 'Q' then
    -- Its turn taken: a skip moves q past the missing positions (their calls, if they
    -- come, are refused) and says so in the record, for `celery baton locks`.
    if w[4] then
      local from, to = w[4], w[3] - 1
      local ranges = format('%d-%d', from, to)
      local kept = call('HGET', key, 's')
      if kept then
        local n_kept = 0
        for range in string.gmatch(kept, '[^,]+') do
          n_kept = n_kept + 1
          if n_kept < 64 then ranges = ranges .. ',' .. range end
        end
      end
      call('HSET', key, 'q', format('%d', w[3]), 's', ranges,
        'gl', format('%d-%d %d', from, to, now_ms))
      call('HINCRBY', key, 'g', to - from + 1)
    end
    if w[3] > 0 then call('PEXPIRE', key, w[5]) end
