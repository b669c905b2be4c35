-- gate, kind "L": a lease (TakeLease). KEYS[i] a hash: "o:<owner>" -> "<deadline ms>
-- <fence>" per holder, "_fence" the last token, "_e" a lower bound of the key's expiry,
-- "_w" set while someone waits (release.lua then publishes a notice), "x:<owner>" ->
-- "<until ms>" a lease its run's process freed at the body's end (release.lua; swept
-- here with the expired leases once past).
--   a = limit (1 = exclusive), b = "1" to issue a fencing token
-- Denied while `limit` other owners hold live leases (retry_after: until the earliest
-- runs out, holder: its owner); a retried call of the same owner keeps its lease.
-- Its write: {'L', key, expired fields or nil, fence asked, my current value or nil,
-- last fence, latest deadline of the others, "_e" (key expires no earlier), key existed}
--: check
  if kind == 'L' then
    local limit = tonumber(a)
    local flat = call('HGETALL', key)
    local live, mine, expired = 0, nil, nil
    local earliest, holder, latest, last_fence, expire_at = nil, '', 0, 0, 0
    for j = 1, #flat, 2 do
      local field = flat[j]
      if string.byte(field, 1) == 111 then  -- 'o': "o:<owner>", a lease
        local value = flat[j + 1]
        local deadline = tonumber(string.match(value, '^%d+'))
        if deadline <= now_ms then
          if expired then expired[#expired + 1] = field else expired = {field} end
        elseif field == owner_field then
          mine = value
        else
          live = live + 1
          if deadline > latest then latest = deadline end
          if earliest == nil or deadline < earliest then
            earliest, holder = deadline, field
          end
        end
      elseif string.byte(field, 1) == 120 then  -- 'x': "x:<owner>", a lease its run ended
        if tonumber(flat[j + 1]) <= now_ms then
          if expired then expired[#expired + 1] = field else expired = {field} end
        end
      elseif field == '_fence' then
        last_fence = tonumber(flat[j + 1])
      elseif field == '_e' then
        expire_at = tonumber(flat[j + 1])
      end
    end
    if not mine and live >= limit then
      -- A hint for release: someone waits for this key, so publish a notice.
      call('HSET', key, '_w', '1')
      if fair_wait then fair_wait(i) end
      return {0, i, (earliest - now_ms) * 1000, string.sub(holder, 3), assigned}
    end
    free = limit - live
    if mine then free = 1e9 end  -- a retried call of the same owner keeps its lease
    writes[#writes + 1] = {'L', key, expired, b == '1', mine, last_fence, latest, expire_at,
      #flat > 0}
--: write
  if w[1] == 'L' then
    if w[3] then call('HDEL', key, unpack(w[3])) end
    local deadline = now_ms + ttl_ms
    local token = 0
    local value
    local counter = nil
    if not w[4] then
      value = format('%d 0', deadline)
    elseif w[5] then
      -- The same owner asks again (a retried call): its token does not change.
      local kept = string.match(w[5], ' (%d+)$') or '0'
      value = format('%d %s', deadline, kept)
      token = tonumber(kept)
    else
      -- Strictly increasing per key, even after the key expired: never below the clock
      -- (the start instant, for a reserved slot).
      token = math.max(w[6] + 1, start_at)
      value = format('%d %d', deadline, token)
      counter = format('%d', token)
    end
    if w[4] and fence == 0 then fence = token end
    -- The key must outlive its longest lease. "_e" is a lower bound of when the key
    -- expires (renew only ever extends it). A key in use by others or holding a fence
    -- counter (a busy concurrency or exclusive key) is extended by one more ttl than
    -- needed, so that its next acquisitions need not extend it again; a new key gets
    -- exactly its lease's ttl and vanishes with its release (a task id's guard key).
    local needed = math.max(deadline, w[7])
    local expire_in, expire_field = nil, nil
    if not w[9] then
      expire_in = needed - now_ms
    elseif w[8] < needed then
      expire_in = needed + ttl_ms - now_ms
      expire_field = format('%d', needed + ttl_ms)
    end
    if counter and expire_field then
      call('HSET', key, owner_field, value, '_fence', counter, '_e', expire_field)
    elseif counter then
      call('HSET', key, owner_field, value, '_fence', counter)
    elseif expire_field then
      call('HSET', key, owner_field, value, '_e', expire_field)
    else
      call('HSET', key, owner_field, value)
    end
    if expire_in then call('PEXPIRE', key, expire_in) end
