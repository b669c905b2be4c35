-- gate: decide ALL of a request's conditions at once; grant all of them or none.
--
-- One script, written as fragments joined when it is loaded (store/scripts.py,
-- join_gate; nothing is joined or looked up when it runs): this file is the frame, each
-- kind of condition is a file in gate/ with its check and its write together, and
-- gate/epochs.lua holds the store epochs, read once every condition passed.
--
-- KEYS[i]   the key of condition i, 1 <= i <= n (n: the number of kind/a/b triples in
--           ARGV); same {hash tag} for all, so Cluster can run it
-- KEYS[n+1] (only when a lease is asked for) the family's store epoch ("E",
--           gate/epochs.lua)
-- KEYS[n+2] (with KEYS[n+1], on one server only) the store-wide epoch ("G", ibid.)
-- ARGV[1]   owner: "<task id>|<worker>|<nonce>", unique per delivery
-- ARGV[2]   lease ttl in milliseconds
-- ARGV[3]   reservation window in microseconds (0: none): a rate slot that comes free
--           within it is reserved now, and the run starts when the slot comes
-- ARGV[4+3(i-1)..]  per condition i, three values: kind, a, b; the kind's file says
--           what a and b are (core/gate.py's encode writes them):
--   "L" gate/lease.lua            "R", "W" gate/rate.lua (GCRA)   "P" gate/penalty.lua
--   "O" gate/override.lua         "F", "-" gate/fair.lua          "D" gate/done.lua
--   "S" gate/order.lua            "N" gate/not_superseded.lua  "B" gate/slot_not_run.lua
--   "U" gate/free_unique.lua      "K" gate/keep_unique.lua     "X" gate/not_cancelled.lua
--   "Q" gate/ordered.lua          "C" gate/claim_unique.lua
-- returns   {1, fence, start_in_us, at_us, epoch, order, note} granted (fence 0 when no lease
--                                         asked for one; epoch '' without KEYS[n+1]);
--                                         start no earlier than start_in_us from now,
--                                         which is at_us on the server's clock (us)
--           {0, i, retry_after_us, holder, order} denied by condition i; nothing was
--                                         written (but an "S" record, and its order).
--           order: what an "S" condition without one was given (0: none).
--           note: what a "Q" condition did besides ('' : nothing; gate/ordered.lua).
--           retry_after_us (microseconds) is -1 when waiting cannot help (a done marker).
-- Time is the server's TIME, so workers' clocks never matter.
--
-- Every admitted task runs this script, so it is written for the store's CPU: numbers
-- are formatted with %d (exact for integers, and a third of the cost of %.0f), tables
-- are made only when something needs them, and expiries are set only when they must
-- move (a key's expiry is the costliest part of a write).

local call, format = redis.call, string.format
local t = call('TIME')
local now_us = t[1] * 1000000 + t[2]
local now_ms = (now_us - now_us % 1000) / 1000
local owner = ARGV[1]
local ttl_ms = tonumber(ARGV[2])
local owner_field = 'o:' .. owner
local reserve_us = tonumber(ARGV[3])
-- What to write once every condition passed, one record per condition (positional: the
-- script runs for every admitted task, and array tables are the cheapest); each kind's
-- file says what its record holds.
local writes = {}
local override = nil
local epoch = ''
local start_at = now_us  -- a reserved rate slot may start later than now

local n = (#ARGV - 3) / 3
local assigned = 0  -- the publish order an "S" condition was given here
local note = ''  -- what a "Q" condition did besides passing (gate/ordered.lua)
-- @setup: each kind's (rate, fair, order)

for i = 1, n do
  local key = KEYS[i]
  local base = 3 * i
  local kind, a, b = ARGV[base + 1], ARGV[base + 2], ARGV[base + 3]
  if override then  -- the condition before was an "O" (gate/override.lua)
    a = override[1]
    if override[2] ~= '' then b = override[2] end
    override = nil
  end
  -- @check: each kind's check, in the order of store/scripts.py's GATE_KINDS
  end
end

-- @epochs: gate/epochs.lua

local fence = 0
for n_write = 1, #writes do
  local w = writes[n_write]
  local key = w[2]
  -- @write: each kind's write
  end
end
return {1, fence, start_at - now_us, start_at, epoch, assigned, note}
