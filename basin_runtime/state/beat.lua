-- A replica's heartbeat: stamp it with Redis's clock, take or renew the leader lease, and return what the
-- leader needs to tell the living from the dead.
-- KEYS[1] the heartbeats hash (replica -> last beat, microseconds), KEYS[2] the meta hash, KEYS[3] the leader key
-- ARGV[1] the replica id, ARGV[2] the leader lease (ms)
-- Returns {epoch ('' if none), clock now, 1 if the caller leads, heartbeats as a flat list}.
if redis.replicate_commands then redis.replicate_commands() end
local t = redis.call('TIME')
local stamp = string.format('%.0f', tonumber(t[1]) * 1000000 + tonumber(t[2]))
redis.call('HSET', KEYS[1], ARGV[1], stamp)
local holder = redis.call('GET', KEYS[3])
local leads = 0
if not holder then
  redis.call('SET', KEYS[3], ARGV[1], 'PX', ARGV[2])
  leads = 1
elseif holder == ARGV[1] then
  redis.call('PEXPIRE', KEYS[3], ARGV[2])
  leads = 1
end
return {redis.call('HGET', KEYS[2], 'epoch') or '', stamp, leads, redis.call('HGETALL', KEYS[1])}
