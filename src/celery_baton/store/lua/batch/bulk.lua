-- batch/bulk.lua, put in place of "-- @include batch/bulk.lua" (one chunk, as if written
-- there): redis commands over many fields at once.

-- Commands of many arguments, in chunks: Lua's unpack() takes a few thousand at most.
local CHUNK = 1000  -- even: pairs stay whole
local function bulk(command, key, option, args)
  for i = 1, #args, CHUNK do
    local last = math.min(i + CHUNK - 1, #args)
    if option then
      redis.call(command, key, option, unpack(args, i, last))
    else
      redis.call(command, key, unpack(args, i, last))
    end
  end
end
local function hmget(key, fields)
  local values = {}
  for i = 1, #fields, CHUNK do
    local part = redis.call('HMGET', key, unpack(fields, i, math.min(i + CHUNK - 1, #fields)))
    for j = 1, #part do values[#values + 1] = part[j] end
  end
  return values
end
