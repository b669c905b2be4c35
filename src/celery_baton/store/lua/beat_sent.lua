-- beat_sent: the messages of claimed slots were published; drop them from the outbox.
--
-- KEYS[1]  outbox hash (task id -> claimed slot)
-- ARGV     task ids that were sent
--
-- Returns how many outbox items were removed.
if #ARGV == 0 then return 0 end
return redis.call('HDEL', KEYS[1], unpack(ARGV))
