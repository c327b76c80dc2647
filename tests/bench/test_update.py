"""The FLOP/s benchmark's synthetic step: a batch the job's update takes, every token trained."""

import jax
import numpy as np
from flax import nnx

from trace_jax.bench.update import synthetic_batch
from trace_jax.models import ModelConfig, create_model
from trace_jax.optim import make_optimizer
from trace_jax.rl.batch import TrainBatch
from trace_jax.rl.losses import LossConfig
from trace_jax.rl.trainer import RLTrainer, UpdateConfig


def test_the_synthetic_batch_fills_every_required_field_and_updates_once():
    batch = synthetic_batch(rows=2, seq_len=16, vocab=64)
    assert isinstance(batch, TrainBatch) and batch.tokens.shape == (2, 16)
    assert np.all(batch.weights == 1.0)  # a fully busy step: the LM head runs over every position
    config = ModelConfig.preset("qwen3-tiny", vocab_size=64, num_layers=1)
    graphdef, params = nnx.split(create_model(config, nnx.Rngs(0)), nnx.Param)
    update = UpdateConfig(ppo_epochs=1, mini_batches=1, micro_rows=2)
    trainer = RLTrainer(graphdef, make_optimizer(learning_rate=1e-3), LossConfig(), update=update)
    state = trainer.init_state(params, jax.random.key(0))
    _, metrics = trainer.update(state, batch)
    assert np.isfinite(metrics["loss"]) and metrics["update_applied"] == 1.0
    assert (metrics["steps"], metrics["micro_batches"]) == (1.0, 1.0)  # one optimizer step, one call
