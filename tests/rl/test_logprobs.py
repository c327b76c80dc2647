"""The log-prob path's memory: no [rows, T, V] tensor, measured from the compiled program (XLA:CPU)."""

import jax
import jax.numpy as jnp

from trace_jax.models import ModelConfig, abstract_model
from trace_jax.optim import make_optimizer
from trace_jax.rl.batch import TrainBatch
from trace_jax.rl.losses import LossConfig
from trace_jax.rl.trainer import RLTrainer, UpdateConfig

ROWS, LENGTH, CHUNK = 4, 256, 16


def _loss_temp_bytes(vocab: int, chunk: int, loss: LossConfig, entropy_metric: bool = False) -> int:
    """Temporary bytes of the compiled gradient of the trainer's loss on one [ROWS, LENGTH] micro-batch."""
    config = ModelConfig.preset(
        "qwen3-tiny", vocab_size=vocab, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
        num_kv_heads=1, head_dim=8,
    )  # fmt: skip
    graphdef, params = abstract_model(config)
    trainer = RLTrainer(
        graphdef,
        make_optimizer(learning_rate=1e-3),
        loss,
        update=UpdateConfig(entropy_metric=entropy_metric),
        logprob_chunk=chunk,
    )
    ints, floats = (jax.ShapeDtypeStruct((ROWS, LENGTH), t) for t in (jnp.int32, jnp.float32))
    batch = TrainBatch(
        tokens=ints, positions=ints, visible_end=ints, predecessor=ints, weights=floats, adv_pos=floats,
        adv_neg=floats, old_logprobs=floats, segment_ids=ints, paths=jax.ShapeDtypeStruct((ROWS,), jnp.float32),
        lengths=jax.ShapeDtypeStruct((ROWS,), jnp.int32),
        ref_logprobs=floats if loss.kl_coef else None,
    )  # fmt: skip
    grad = jax.grad(lambda p, b: trainer._loss_and_metrics(p, b, jnp.float32(1.0))[0])
    compiled = jax.jit(grad).lower(params, batch).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_loss_temporaries_grow_with_the_vocabulary_by_one_chunk_at_most():
    small, large = 1024, 4096
    one_chunk = ROWS * CHUNK * (large - small) * 4  # float32 logits of one chunk
    whole = ROWS * LENGTH * (large - small) * 4  # what materialising [rows, T, V] adds
    grown = lambda chunk, loss, metric=False: (
        _loss_temp_bytes(large, chunk, loss, metric) - _loss_temp_bytes(small, chunk, loss, metric)
    )
    # Premise: the measurement sees a [rows, T, V] tensor when there is one (one chunk = the whole row).
    assert grown(LENGTH, LossConfig()) >= whole
    assert grown(CHUNK, LossConfig()) <= 4 * one_chunk < whole / 2
    # Entropy (a second pass over the vocabulary) and the KL term stay within the chunk too.
    assert grown(CHUNK, LossConfig(entropy_coef=0.01, kl_coef=0.1)) <= 4 * one_chunk
