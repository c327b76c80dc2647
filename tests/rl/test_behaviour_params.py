"""Where the trainer's behaviour log-probs come from: the sampler's kept as they are ("sampler"), or recomputed
under the params that sampled the batch, which are not the trained ones when the rollouts lag."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.rl.test_trainer import _batch, _trainer, shared_setup
from trace_jax.rl.trainer import UpdateConfig


def _moved(params, scale=0.05, seed=3):
    """``params`` plus Gaussian noise: another policy (the one that sampled, one version behind)."""
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    noisy = [x + scale * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys, strict=True)]
    return jax.tree.unflatten(treedef, noisy)


def test_sampler_mode_keeps_the_samplers_logprobs_whatever_the_params():
    """Mutant M10b ("sampler" recomputes the behaviour log-probs under the current params) fails here: the batch's
    behaviour log-probs are the trees' sample log-probs, and the first step's ratio is π_θ / π_sampler (not 1)."""
    graphdef, params, _ = shared_setup()
    trainer = _trainer(graphdef, update=UpdateConfig(ppo_epochs=1, mini_batches=1, behaviour_logprobs="sampler"))
    state = trainer.init_state(jax.tree.map(jnp.copy, params), jax.random.key(0))
    batch = _batch()
    trained = np.asarray(batch.weights) > 0
    # The sampler's log-probs: the current policy's minus 0.1 on every trained token (e.g. a sampler one version
    # behind), so the first step's ratio is exp(0.1) on each.
    sampled = np.where(trained, trainer.logprobs(state.params, batch) - 0.1, 0.0).astype(np.float32)
    batch = batch._replace(old_logprobs=sampled)
    prepared = trainer.prepare(state, batch)
    np.testing.assert_array_equal(np.asarray(prepared.old_logprobs), sampled)
    _, metrics = trainer.update(state, batch)
    assert metrics["ratio"] == pytest.approx(np.exp(0.1), rel=1e-5)
    assert abs(metrics["ratio"] - 1.0) > 1e-2


@pytest.mark.parametrize("mode", ["recompute", "untruncated"])
def test_recomputed_behaviour_logprobs_are_those_of_the_params_that_sampled(mode):
    """With ``behaviour_params`` (trees one version old) the recomputed behaviour log-probs are that policy's, and
    an update of the prepared batch measures the lag in its first ratio; without, the state's own (ratio 1). Fails
    if ``prepare`` ignores ``behaviour_params`` or ``update(already_prepared=True)`` prepares again."""
    graphdef, params, _ = shared_setup()
    trainer = _trainer(graphdef, update=UpdateConfig(ppo_epochs=1, mini_batches=1, behaviour_logprobs=mode))
    batch = _batch()
    trained = np.asarray(batch.weights) > 0
    older = _moved(params)
    state = trainer.init_state(jax.tree.map(jnp.copy, params), jax.random.key(0))
    lagged = trainer.prepare(state, batch, behaviour_params=older)
    np.testing.assert_allclose(np.asarray(lagged.old_logprobs), trainer.logprobs(older, batch), atol=1e-6)
    own = trainer.prepare(state, batch)
    np.testing.assert_allclose(np.asarray(own.old_logprobs), trainer.logprobs(state.params, batch), atol=1e-6)
    assert np.abs(np.asarray(lagged.old_logprobs) - np.asarray(own.old_logprobs))[trained].mean() > 1e-3  # premise
    _, metrics = trainer.update(state, lagged, already_prepared=True)
    assert metrics["behaviour_gap"] > 1e-3
    state = trainer.init_state(jax.tree.map(jnp.copy, params), jax.random.key(0))
    _, metrics = trainer.update(state, batch)
    assert metrics["behaviour_gap"] == pytest.approx(0.0, abs=1e-6)
