"""Tree-aware RL: advantage estimators, policy losses, packed train batches and the jit-compiled update.

from trace_jax.rl import RLTrainer, UpdateConfig, build_batch, compute_advantages
"""

from trace_jax.rl.advantages import ESTIMATORS, compute_advantages
from trace_jax.rl.batch import BatchConfig, TrainBatch, build_batch
from trace_jax.rl.losses import LossConfig
from trace_jax.rl.trainer import RLTrainer, TrainState, UpdateConfig

__all__ = [
    "ESTIMATORS",
    "BatchConfig",
    "LossConfig",
    "RLTrainer",
    "TrainBatch",
    "TrainState",
    "UpdateConfig",
    "build_batch",
    "compute_advantages",
]
