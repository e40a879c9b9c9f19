"""Admission state backends: in process, or shared by gateway replicas (Redis/Valkey).

Where the admission state lives: in process (the default), or shared by gateway replicas through
Redis/Valkey, the policy core still its only implementation (state-machine replication).

Modules, one job each:
  steps.py          Step: one policy step as serialisable data; apply_step, the one translation to the core
  replica.py        ReplicatedState: the core plus session ownership and orphans, moved by sequenced entries
  backend.py        StateBackend (the waiting room's seam), InProcessBackend, StateUnavailableError
  redis_backend.py  RedisBackend: Redis as the sequencer (one Lua script per batch of steps), the tail, snapshots
  leases.py         Coordinator: replica leases, the leader lease and the leader's work (reaping, snapshots,
                    the deployment's signals)
  signals.py        the deployment's hit rate and first-token latency from every replica's report
  task_peaks.py     RedisTaskPeaks: the gateway's memory of finished tasks, shared by the replicas
"""
