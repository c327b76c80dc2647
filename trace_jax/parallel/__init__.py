"""Device meshes, logical-axis sharding rules, and running as several JAX processes.

    from trace_jax.parallel import make_mesh, shard_state
    mesh = make_mesh(data=1, fsdp=-1, tensor=4)

``mesh``: the (data, fsdp, tensor) mesh and the one logical-axis rules table. ``distributed``: joining the
job and who writes (process 0). ``multihost``: host data across processes (prompt shards, all-gathers,
global batches from local rows, metric reduction, per-process weight copies).
"""

from trace_jax.parallel.distributed import DistributedConfig
from trace_jax.parallel.mesh import make_mesh, shard_state, state_shardings

__all__ = ["DistributedConfig", "make_mesh", "shard_state", "state_shardings"]
