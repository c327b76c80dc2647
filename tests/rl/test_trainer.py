import dataclasses
import functools
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.rl.trees import branching_tree, random_tree
from trace_jax.models.qwen import ModelConfig, Qwen
from trace_jax.optim import make_optimizer
from trace_jax.rl.advantages import compute_advantages
from trace_jax.rl.batch import BatchConfig, build_batch
from trace_jax.rl.losses import LossConfig
from trace_jax.rl.trainer import RLTrainer, chunked_token_logprobs, token_logprobs

ROOT = Path(__file__).resolve().parents[2]


# Smaller than qwen3-tiny to keep compiles short; the trees' token ids are all < 100.
CONFIG = ModelConfig.preset(
    "qwen3-tiny", vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=1, head_dim=8
)


def _model(seed=0):
    return Qwen(CONFIG, rngs=nnx.Rngs(seed))


# One length bucket and few row buckets: the batches of these tests share a shape, so a trainer compiles once.
BATCH_CONFIG = BatchConfig(length_buckets=(32,), row_buckets=(16, 32))


def _batch(row_multiple=1, seed=0, n_trees=3):
    rng = np.random.default_rng(seed)
    trees = [branching_tree()] + [random_tree(rng) for _ in range(n_trees - 1)]
    config = dataclasses.replace(BATCH_CONFIG, row_multiple=row_multiple)
    return build_batch(trees, compute_advantages("grpo", trees), config)[0]


def _host(tree):
    return jax.tree.map(lambda x: np.array(x), tree)


@functools.cache
def shared_setup():
    """(graphdef, initial params, trainer) reused across tests so the step compiles once per process.

    The trainer's reference policy is the initial params; give ``init_state`` a copy (the state is donated).
    """
    graphdef, params = nnx.split(_model(), nnx.Param)
    return graphdef, params, _trainer(graphdef, reference_params=jax.tree.map(jnp.copy, params))


def fresh_state(seed=0):
    _, params, trainer = shared_setup()
    return trainer.init_state(jax.tree.map(jnp.copy, params), jax.random.key(seed))


def _trainer(graphdef, micro_batches=1, eps=1e-8, **kwargs):
    optimizer = make_optimizer(learning_rate=1e-3, warmup_steps=0, total_steps=10, schedule="constant", eps=eps)
    return RLTrainer(graphdef, optimizer, kwargs.pop("loss", LossConfig()), micro_batches=micro_batches, **kwargs)


def test_token_logprobs_match_the_model():
    model = _model()
    tokens = jnp.asarray([[3, 5, 7, 9], [1, 2, 0, 0]], jnp.int32)
    graphdef, params = nnx.split(model, nnx.Param)
    logprobs, entropies = token_logprobs(lambda p, t: nnx.merge(graphdef, p)(t).logits_btv, params, tokens)
    logp = jax.nn.log_softmax(model(tokens).logits_btv, axis=-1)
    np.testing.assert_allclose(logprobs[0, 1:], [logp[0, t - 1, tokens[0, t]] for t in range(1, 4)], rtol=1e-5)
    assert logprobs[0, 0] == 0 and entropies[0, 0] == 0
    assert np.all(entropies[:, 1:] > 0) and np.all(entropies <= np.log(CONFIG.vocab_size) + 1e-4)


def test_chunked_logprobs_match_full_logprobs_and_gradients():
    graphdef, params = nnx.split(_model(), nnx.Param)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, CONFIG.vocab_size, (2, 11)), jnp.int32)
    weights = jnp.asarray(np.random.default_rng(1).random((2, 11)), jnp.float32)

    def objective(stats):
        return lambda p: jnp.sum(weights * (stats(p)[0] + 0.1 * stats(p)[1]))

    full = lambda p: token_logprobs(lambda q, t: nnx.merge(graphdef, q)(t).logits_btv, p, tokens)
    chunked = lambda p: chunked_token_logprobs(graphdef, p, tokens, chunk=4)  # 10 targets: 3 chunks, padded
    # One compile per variant: the stats and the gradient of an objective built on them.
    (stats_full, grads_full), (stats_chunked, grads_chunked) = [
        jax.jit(lambda p, f=f: (f(p), jax.grad(objective(f))(p)))(params) for f in (full, chunked)
    ]
    for a, b in zip(stats_full, stats_chunked, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    for a, b in zip(jax.tree.leaves(grads_full), jax.tree.leaves(grads_chunked), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_micro_batches_give_the_same_update():
    graphdef, params, shared = shared_setup()
    batch = _batch(row_multiple=2)
    results = []
    for trainer in (shared, _trainer(graphdef, micro_batches=2)):
        state = trainer.init_state(jax.tree.map(jnp.copy, params), jax.random.key(0))
        state, metrics = trainer.train_step(state, batch)
        results.append((_host(state.params), metrics))
    (p1, m1), (p2, m2) = results
    for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p2), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert m1["loss"] == pytest.approx(m2["loss"], rel=1e-5)
    assert m1["clip_fraction"] == pytest.approx(m2["clip_fraction"], abs=1e-6)
    assert m1["update_applied"] == 1.0


def test_training_raises_the_likelihood_of_the_better_leaf():
    _, _, trainer = shared_setup()
    tree = branching_tree()  # leaf b (node 2) succeeded, its sibling c (node 3) failed
    batch, _ = build_batch([tree], compute_advantages("grpo", [tree]), BATCH_CONFIG)
    state = fresh_state()
    before = np.asarray(trainer.logprobs(state.params, batch))
    first = None
    for _ in range(5):
        state, metrics = trainer.train_step(state, trainer.prepare(state, batch, recompute_old_logprobs=True))
        first = first or metrics
    after = np.asarray(trainer.logprobs(state.params, batch))
    assert after[0, 7] > before[0, 7]  # b's token (row 0, position 7)
    assert after[1, 7:9].sum() < before[1, 7:9].sum()  # c's tokens (row 1)
    # First step on fresh log-probs: ratio 1, nothing clipped, no drift from the reference yet.
    assert first["ratio"] == pytest.approx(1.0, abs=1e-5)
    assert first["clip_fraction"] == 0.0 and first["kl_ref"] == pytest.approx(0.0, abs=1e-6)
    assert metrics["kl_ref"] > 0 and int(state.step) == 5


def test_non_finite_loss_skips_the_update_and_training_goes_on():
    _, _, trainer = shared_setup()
    batch = _batch()
    state = fresh_state()
    before = _host(state.params)
    poisoned = batch._replace(advantages=np.where(batch.weights > 0, np.nan, 0.0).astype(np.float32))
    state, metrics = trainer.train_step(state, poisoned)
    assert metrics["update_applied"] == 0.0 and metrics["skipped_steps"] == 1.0
    for a, b in zip(jax.tree.leaves(_host(state.params)), jax.tree.leaves(before), strict=True):
        np.testing.assert_array_equal(a, b)
    state, metrics = trainer.train_step(state, batch)
    assert metrics["update_applied"] == 1.0 and metrics["skipped_steps"] == 1.0 and int(state.step) == 2
    assert any(
        not np.array_equal(a, b)
        for a, b in zip(jax.tree.leaves(_host(state.params)), jax.tree.leaves(before), strict=True)
    )


def test_wrong_row_count_and_missing_reference_are_clear_errors():
    graphdef, params = nnx.split(_model(), nnx.Param)
    trainer = _trainer(graphdef, micro_batches=3)
    state = trainer.init_state(params, jax.random.key(0))
    with pytest.raises(ValueError, match="row_multiple"):
        trainer.train_step(state, _batch(row_multiple=1))
    kl_trainer = _trainer(graphdef, loss=LossConfig(kl_coef=0.1))
    with pytest.raises(ValueError, match="reference_params"):
        kl_trainer.prepare(state, _batch())


@pytest.mark.slow
def test_sharded_step_matches_one_device():
    # 8 fake CPU devices must be configured before jax starts, hence a fresh interpreter.
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    result = subprocess.run(
        [sys.executable, "-m", "tests.rl.sharded_step_check"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "SHARDED_OK" in result.stdout
