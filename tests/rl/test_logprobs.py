"""The log-prob path's memory: no [rows, T, V] tensor, measured from the compiled program (XLA:CPU)."""

import jax
import jax.numpy as jnp
import numpy as np

from trace_jax.models import ModelConfig, abstract_model
from trace_jax.optim import make_optimizer
from trace_jax.rl.batch import TrainBatch
from trace_jax.rl.logprobs import map_chunks
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
    # A chunk's logits, their softmax and gradients, and the copies of the conditional that skips untrained
    # chunks: a handful of chunks (4.25 measured with the entropy), never the row's 16. Catches the scan
    # stacking the conditional's residuals (6.2 chunks here, growing with the row).
    assert grown(CHUNK, LossConfig()) <= 5 * one_chunk < whole / 2
    # Entropy (a second pass over the vocabulary) and the KL term stay within the chunk too.
    assert grown(CHUNK, LossConfig(entropy_coef=0.01, kl_coef=0.1)) <= 5 * one_chunk


def test_trained_only_runs_the_head_over_the_chunks_that_hold_trained_tokens():
    rng = np.random.default_rng(0)
    hidden = jnp.asarray(rng.normal(size=(2, 40, 3)), jnp.float32)
    targets = jnp.asarray(rng.integers(1, 9, size=(2, 40)), jnp.int32)
    needed = np.zeros((2, 40), bool)
    needed[0, [3, 17, 30]] = True
    needed[1, [5, 6, 7, 8, 9, 39]] = True  # 6 at most a row: chunks of 4 starting at 0 and 4 run, 8 skipped
    calls = []

    def head(h_bcd, y_bc):
        jax.debug.callback(lambda: calls.append(1))
        return {"value": jnp.sum(h_bcd, axis=-1) * y_bc}

    run = lambda needed_bt: jax.jit(lambda h: map_chunks(head, h, targets, 4, needed_bt))(hidden)
    every = run(None)
    assert len(calls) == 10  # premise: the callback counts the chunks that run
    calls.clear()
    only = run(jnp.asarray(needed))
    assert len(calls) == 2  # catches every chunk running (no skip), whatever the outputs
    np.testing.assert_array_equal(only["value"][needed], every["value"][needed])
    assert np.all(np.asarray(only["value"])[~needed] == 0)
    # The gradient reaches each needed position's own hidden state, and no other.
    grad = lambda needed_bt: jax.grad(lambda h: jnp.sum(map_chunks(head, h, targets, 4, needed_bt)["value"]))(hidden)
    expected = np.where(needed[..., None], np.asarray(targets, np.float32)[..., None], 0.0) * np.ones(3)
    np.testing.assert_allclose(grad(jnp.asarray(needed)), expected)
