-- beat_resign: give up the beat leader lease at once (SIGTERM), so a follower takes over
-- on its next poll instead of waiting for the lease to expire.
--
-- KEYS[1]  leader hash
-- ARGV[1]  owner token of the calling beat process
--
-- Returns 1 if the caller held the lease and it is now free, else 0 (never frees
-- another beat's lease).
if redis.call('HGET', KEYS[1], 'owner') == ARGV[1] then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
