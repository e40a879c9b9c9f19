-- Keep a snapshot of the replicated state and trim the stream before it, never going back to an older one.
-- KEYS[1] the meta hash, KEYS[2] the snapshot, KEYS[3] the stream
-- ARGV[1] the epoch, ARGV[2] the snapshot (JSON), ARGV[3] its last entry id, ARGV[4] its entry number n
-- Returns 1 if kept, 0 if the epoch moved on or a newer snapshot is there.
if redis.call('HGET', KEYS[1], 'epoch') ~= ARGV[1] then return 0 end
if tonumber(redis.call('HGET', KEYS[1], 'snapshot_n') or '0') >= tonumber(ARGV[4]) then return 0 end
redis.call('SET', KEYS[2], ARGV[2])
redis.call('HSET', KEYS[1], 'snapshot_n', ARGV[4])
redis.call('XTRIM', KEYS[3], 'MINID', ARGV[3])
return 1
