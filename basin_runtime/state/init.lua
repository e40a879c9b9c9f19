-- Join the shared state's epoch, or open a new one when the store holds none (first start, or a Redis
-- that restarted empty): a new epoch empties the stream and the snapshot and opens a registration
-- window, during which only re-registrations (no `arrive`) are sequenced.
-- KEYS[1] the meta hash, KEYS[2] the stream, KEYS[3] the snapshot
-- ARGV[1] a new epoch id, ARGV[2] the registration window (microseconds), ARGV[3] the policy configuration
-- Returns {epoch, configuration, registering_until, clock now, '1' if this call opened the epoch}.
if redis.replicate_commands then redis.replicate_commands() end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local epoch = redis.call('HGET', KEYS[1], 'epoch')
local opened = '0'
if not epoch then
  redis.call('DEL', KEYS[2], KEYS[3])
  epoch = ARGV[1]
  redis.call('HSET', KEYS[1], 'epoch', epoch, 'seq', 0, 'clock', string.format('%.0f', now), 'config', ARGV[3],
             'registering_until', string.format('%.0f', now + tonumber(ARGV[2])), 'snapshot_n', 0)
  opened = '1'
end
return {epoch, redis.call('HGET', KEYS[1], 'config'), redis.call('HGET', KEYS[1], 'registering_until'),
        string.format('%.0f', now), opened}
