-- unique_keep: extend the unique claim of a running task (renewed with the run's leases,
-- while the run lives: a run lost with its worker lets its claim lapse).
--
-- KEYS[1]  unique key
-- ARGV[1]  task id of the running task
-- ARGV[2]  ttl in milliseconds from now
-- returns  1 when extended, 0 when the key is gone or another task id's. A claim that
--          was freed or lapsed is never written back: it may be a later publish's now.

if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
