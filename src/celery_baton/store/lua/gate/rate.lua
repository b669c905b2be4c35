-- gate, kinds "R" and "W": a GCRA rate (Rate, WeightedRate), written once. KEYS[i] holds
-- the theoretical arrival time (TAT, us on the server's clock).
--   kind "R"  a rate: a = emission interval in microseconds, b = burst
--   kind "W"  weighted (a named limit shared by tasks, docs/guides/limits-shared.md):
--             a = increment in microseconds (cost x emission interval), b = tolerance in
--             microseconds (burst x emission interval); a <= b (checked by the caller)
-- Denied (retry_after: until the slot comes) unless a slot is free now or within the
-- reservation window (ARGV[3]): then it is reserved, and the run starts at it.
-- Its write: {'R', key, new TAT, stored TAT or nil}
--: setup
-- A rate key expires at the end of the second its TAT falls in (EXPIRE_GRAIN below).
-- While the TAT stays within that second, the key's expiry is already right and the write
-- keeps it (KEEPTTL); so a busy rate key moves its expiry once a second, not on every
-- decision. The key is gone at most a second after its schedule ran out (a missing key
-- means the same as a TAT in the past).
local EXPIRE_GRAIN = 1000000
--: check
  elseif kind == 'R' or kind == 'W' then
    -- In one measure: a start moves TAT by `increment`; `tolerance` is how far ahead of
    -- now TAT may run (burst x interval).
    local increment, tolerance = tonumber(a), tonumber(b)
    if kind == 'R' then tolerance = tolerance * increment end
    local stored = call('GET', key)
    local tat = tonumber(stored) or now_us
    -- Strict GCRA: a late start earns no credit, so in every window of length w at
    -- most burst + w * rate runs start. (Waiters wake on time to keep the rate.)
    if tat < now_us then tat = now_us end
    local new_tat = tat + increment
    local allow_at = new_tat - tolerance
    -- Slots free within the reservation window (for an "F" after this condition: only
    -- ever after an "R").
    if fair_wait and ARGV[base + 4] == 'F' then
      free = math.floor((now_us + reserve_us - tat) / increment) + tolerance / increment
      fair_retry_us = math.max(allow_at + increment - now_us, 1)
    end
    if now_us < allow_at then
      if allow_at - now_us > reserve_us then
        if fair_wait then fair_wait(i) end
        return {0, i, allow_at - now_us, '', assigned}
      end
      -- Reserve the slot: the schedule advances exactly one increment, however late
      -- the waiter wakes, so the rate holds without crediting lateness.
      if allow_at > start_at then start_at = allow_at end
    end
    writes[#writes + 1] = {'R', key, new_tat, stored}
--: write
  elseif w[1] == 'R' then
    local new_tat, old = w[3], tonumber(w[4])
    local expires_at = new_tat - new_tat % EXPIRE_GRAIN + EXPIRE_GRAIN
    if old and old - old % EXPIRE_GRAIN + EXPIRE_GRAIN == expires_at then
      call('SET', key, format('%d', new_tat), 'KEEPTTL')
    else
      call('SET', key, format('%d', new_tat), 'PX', format('%d', (expires_at - now_us) / 1000 + 1))
    end
