-- gate, kind "S": the publish order of an exclusive key whose duplicates supersede each
-- other (PublishOrder; exclusive_conflict "replace"/"keep_last"), a hash {n: last order
-- given, top: the newest order seen here, id: its task id}: a = this delivery's order
-- (from its publish; '' : given one now, max(n + 1, now_us), and returned as `assigned`),
-- b = its task id. Denied (retry_after -1, holder = the newer task id) when a newer
-- publish reached the gate already; else it becomes the newest. This record is written
-- on denial too (in the check: no write of its own): what a later condition refuses
-- still supersedes what came before it. Kept for a day.
--: setup
local SUPERSEDE_TTL_MS = 86400000
--: check
  elseif kind == 'S' then
    local order = call('HMGET', key, 'n', 'top', 'id')
    local seq = tonumber(a)
    if not seq then
      seq = math.max((tonumber(order[1]) or 0) + 1, now_us)
      call('HSET', key, 'n', format('%d', seq))
      assigned = seq
    end
    local newest = tonumber(order[2]) or 0
    if seq < newest then return {0, i, -1, order[3] or '', assigned} end
    if seq > newest then
      call('HSET', key, 'top', format('%d', seq), 'id', b)
      call('PEXPIRE', key, SUPERSEDE_TTL_MS)
    end
