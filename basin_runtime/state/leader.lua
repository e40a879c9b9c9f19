-- Take or renew the leader lease: held by one replica at a time, for ARGV[2] milliseconds.
-- KEYS[1] the leader key; ARGV[1] the replica id, ARGV[2] the lease (ms). Returns 1 if the caller leads.
local holder = redis.call('GET', KEYS[1])
if not holder then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 1
end
if holder == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
