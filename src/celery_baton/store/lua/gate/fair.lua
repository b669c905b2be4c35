-- gate, kind "F": fairness of the shared limit decided by condition i-1 (an "L" or "R")
-- (FairTurn, fairness.py): KEYS[i] hash (n:<key> workers holding <key>, vt), KEYS[i+1]
-- the waiting keys by pass, KEYS[i+2] presences "<key>|<worker>" by expiry (ms),
-- KEYS[i+3] passes of keys that left ahead of vt; those three come as kind "-" (keys
-- only, FairPart: no branch of their own). a = the fair key (a digest), b = "<stride>
-- <more> <presence ms>": more = 1 when the asking worker holds other requests of the
-- key. Passes only if the key is among the first `free` waiting keys by pass (free:
-- what condition i-1 admits now, set by lease.lua and rate.lua). Denied here or by i-1
-- (which calls fair_wait), the key is registered as waiting (the only other writes a
-- denial makes).
-- Its write: {'F', the fairness record, the key's pass}
--: setup
-- fairness ("F"): what the condition before it admits now, and, for a rate, when the
-- slot after the next one comes (a key denied its turn asks again then)
local free, fair_retry_us = 0, 0
-- The fairness functions (kind "F"), made only when a call has an "F": most calls have
-- none, and a function definition run costs every call that runs it (a closure and its
-- upvalues each time). The call sites test `fair_wait` (nil: no "F" in this call).
local fair_of, fair_vt, fair_leave, fair_sweep, fair_pass, fair_touch, fair_present
local fair_wait
for fair_i = 1, n do
  if ARGV[3 * fair_i + 1] == 'F' then
    fair_of = function(i)
      local stride, more, presence = string.match(ARGV[3 * i + 3], '^(%S+) (%S+) (%S+)$')
      return {n = KEYS[i], q = KEYS[i + 1], p = KEYS[i + 2], s = KEYS[i + 3],
        k = ARGV[3 * i + 2], stride = tonumber(stride), more = more == '1',
        presence = tonumber(presence),
        worker = string.match(owner, '^[^|]*|([^|]*)') or owner}  -- of the owner
    end

    -- The pass of the latest grant, read once per call.
    fair_vt = function(f)
      if not f.vt then f.vt = tonumber(call('HGET', f.n, 'vt') or '0') end
      return f.vt
    end

    -- A key no worker holds any more leaves the queue; its pass is kept while ahead of vt.
    fair_leave = function(f, k, pass)
      call('HDEL', f.n, 'n:' .. k)
      pass = pass or tonumber(call('ZSCORE', f.q, k) or '0')
      call('ZREM', f.q, k)
      if pass > fair_vt(f) then call('ZADD', f.s, pass, k) end
    end

    -- Presences not renewed in time: their worker died, or its requests left unannounced.
    fair_sweep = function(f)
      local gone = call('ZRANGEBYSCORE', f.p, '-inf', now_ms, 'LIMIT', 0, 64)
      for _, member in ipairs(gone) do
        call('ZREM', f.p, member)
        local k = string.match(member, '^([^|]*)')
        if call('HINCRBY', f.n, 'n:' .. k, -1) <= 0 then fair_leave(f, k) end
      end
    end

    -- The pass key f.k has, or would have if it started waiting now.
    fair_pass = function(f)
      local pass = call('ZSCORE', f.q, f.k)
      if pass then return tonumber(pass), true end
      local vt = fair_vt(f)
      local saved = tonumber(call('ZSCORE', f.s, f.k) or '0')
      if saved > vt then return saved, false end
      return vt, false
    end

    fair_touch = function(f)
      local ms = 2 * f.presence
      call('PEXPIRE', f.n, ms); call('PEXPIRE', f.q, ms)
      call('PEXPIRE', f.p, ms); call('PEXPIRE', f.s, ms)
    end

    -- This worker holds (other) requests of f.k: the key waits, at `pass`.
    fair_present = function(f, pass)
      call('ZADD', f.q, pass, f.k)
      call('ZREM', f.s, f.k)
      if call('ZADD', f.p, now_ms + f.presence, f.k .. '|' .. f.worker) == 1 then
        call('HINCRBY', f.n, 'n:' .. f.k, 1)
      end
      fair_touch(f)
    end

    -- Condition i (an "L" or "R") denied: if an "F" follows, its key now waits.
    fair_wait = function(i)
      if ARGV[3 * (i + 1) + 1] ~= 'F' then return end
      local f = fair_of(i + 1)
      fair_sweep(f)
      fair_present(f, (fair_pass(f)))
    end
    break
  end
end
--: check
  elseif kind == 'F' then
    local f = fair_of(i)
    fair_sweep(f)
    local pass, waiting = fair_pass(f)
    -- Keys ahead: a lower pass (ties: the one already waiting, then by name).
    local ahead = call('ZCOUNT', f.q, '-inf', '(' .. format('%.17g', pass))
    if waiting then ahead = call('ZRANK', f.q, f.k) end
    if ahead >= free then
      fair_present(f, pass)
      local retry = fair_retry_us
      if ARGV[3 * i - 2] == 'L' then
        call('HSET', KEYS[i - 1], '_w', '1')  -- woken by the next release
        retry = f.presence / 3 * 1000  -- and renews its presence by then
      end
      return {0, i, retry, '', assigned}
    end
    writes[#writes + 1] = {'F', f, pass}
--: write
  elseif w[1] == 'F' then
    -- The turn is taken: the key's pass moves on by its stride (1e6 / weight).
    local f, pass = w[2], w[3]
    if pass > fair_vt(f) then
      f.vt = pass
      call('HSET', f.n, 'vt', format('%.17g', pass))
    end
    call('ZREMRANGEBYSCORE', f.s, '-inf', format('%.17g', f.vt))
    pass = pass + f.stride
    if f.more then
      fair_present(f, pass)
    else
      if call('ZREM', f.p, f.k .. '|' .. f.worker) == 1 then
        call('HINCRBY', f.n, 'n:' .. f.k, -1)
      end
      if tonumber(call('HGET', f.n, 'n:' .. f.k) or '0') <= 0 then
        fair_leave(f, f.k, pass)
      else
        call('ZADD', f.q, pass, f.k)
      end
      fair_touch(f)
    end
