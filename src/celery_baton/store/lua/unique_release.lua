-- unique_release: free a unique key, only if this task id holds it.
--
-- KEYS[1]  unique key
-- ARGV[1]  task id
-- returns  1 when freed, 0 when another task id (or nobody) holds it

if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
