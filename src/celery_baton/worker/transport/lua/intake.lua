-- intake: take up to ARGV[1] more messages from the queue list a BRPOP just answered
-- from, and record each in kombu's unacked index and hash in the same step, as kombu's
-- Redis QoS.append records one (its unacked hash holds the JSON list [payload,
-- exchange, routing key]; the payload is kept byte for byte). kombu pops a message,
-- then records it in a transaction of its own: a worker killed between the two loses
-- it; here nothing stands between.
--
-- KEYS[1]  the queue's list (the key BRPOP answered from: its priority's list)
-- KEYS[2]  kombu's unacked index (sorted set: delivery tag -> when, kombu's clock)
-- KEYS[3]  kombu's unacked hash (delivery tag -> [payload, exchange, routing key])
-- ARGV[1]  at most this many messages
-- ARGV[2]  now, as kombu's QoS.append stamps it (the worker's time())
-- Returns the payloads taken, in the order they are to be delivered.
--
-- A payload this script cannot read (not JSON to cjson: a header it refuses) goes back
-- where it was, next to be popped, and the taking stops: kombu's own BRPOP takes it
-- (a script's writes are not undone when it raises: it must not raise once it popped).
local taken = {}
for i = 1, tonumber(ARGV[1]) do
  local payload = redis.call('RPOP', KEYS[1])
  if not payload then
    break
  end
  local read, envelope = pcall(cjson.decode, payload)
  if not read or type(envelope) ~= 'table' or type(envelope['properties']) ~= 'table'
      or type(envelope['properties']['delivery_info']) ~= 'table'
      or envelope['properties']['delivery_tag'] == nil then
    redis.call('RPUSH', KEYS[1], payload)
    break
  end
  local properties = envelope['properties']
  local info = properties['delivery_info']
  local tag = properties['delivery_tag']
  redis.call('ZADD', KEYS[2], ARGV[2], tag)
  redis.call('HSET', KEYS[3], tag,
    '[' .. payload .. ',' .. cjson.encode(info['exchange']) .. ','
      .. cjson.encode(info['routing_key']) .. ']')
  taken[i] = payload
end
return taken
