-- Append a batch of policy steps to the stream, stamped with the sequencer's clock, and return every
-- entry after the caller's last applied one (its own included): one round trip per batch, and the
-- batch is one atomic, totally ordered run of steps.
-- KEYS[1] the stream, KEYS[2] the meta hash (epoch, seq, clock, registering_until)
-- ARGV[1] the epoch the caller holds, ARGV[2] the id of its last applied entry, ARGV[3] its replica id,
-- ARGV[4] '1' if the batch holds an `arrive` (refused while re-registration runs), ARGV[5..] the steps
if redis.replicate_commands then redis.replicate_commands() end  -- TIME before writes (Redis < 5)
local epoch = redis.call('HGET', KEYS[2], 'epoch')
if not epoch then return {'no-epoch'} end
if epoch ~= ARGV[1] then return {'epoch', epoch} end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local last = tonumber(redis.call('HGET', KEYS[2], 'clock') or '0')
if now < last then now = last end  -- the shared clock never runs backwards
if ARGV[4] == '1' then
  local until_us = tonumber(redis.call('HGET', KEYS[2], 'registering_until') or '0')
  if now < until_us then return {'registering', string.format('%.0f', until_us - now)} end
end
local stamp = string.format('%.0f', now)
for i = 5, #ARGV do
  local n = redis.call('HINCRBY', KEYS[2], 'seq', 1)
  redis.call('XADD', KEYS[1], '*', 'n', n, 't', stamp, 'r', ARGV[3], 's', ARGV[i])
end
redis.call('HSET', KEYS[2], 'clock', stamp)
return {'ok', redis.call('XRANGE', KEYS[1], '(' .. ARGV[2], '+')}
