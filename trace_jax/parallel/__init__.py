"""Device meshes, logical-axis sharding rules, and running as several JAX processes.

``mesh``: the (data, fsdp, tensor) mesh and the one logical-axis rules table. ``distributed``: joining the
job and who writes (process 0). ``multihost``: host data across processes (prompt shards, all-gathers,
global batches from local rows, metric reduction, per-process weight copies). ``sharded_rollouts``: a
rollout backend under which each process samples its own prompts while all keep identical trees.
"""
