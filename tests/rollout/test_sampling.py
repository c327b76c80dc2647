import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trace_jax.rollout.engine.sampling import SamplingConfig, sample, token_sample_logprobs, truncated_logits


def _logits(batch=4, vocab=16, seed=0):
    return jax.random.normal(jax.random.key(seed), (batch, vocab)) * 2.0


def _keys(batch, seed=1):
    return jax.random.split(jax.random.key(seed), batch)


def test_greedy_picks_argmax_with_policy_logprob_and_entropy():
    logits = _logits()
    out = sample(logits, _keys(4), SamplingConfig.make_greedy())
    np.testing.assert_array_equal(out.tokens, np.argmax(logits, -1))
    logp = jax.nn.log_softmax(logits)
    np.testing.assert_allclose(out.logprobs, logp[jnp.arange(4), out.tokens], rtol=1e-6)
    np.testing.assert_allclose(out.sample_logprobs, 0.0)
    np.testing.assert_allclose(out.entropies, -(jnp.exp(logp) * logp).sum(-1), rtol=1e-5)


def test_same_key_same_tokens_and_rows_independent_of_batch():
    logits, keys = _logits(batch=6), _keys(6)
    config = SamplingConfig(temperature=1.3, top_k=8, top_p=0.9)
    full = sample(logits, keys, config)
    again = sample(logits, keys, config)
    np.testing.assert_array_equal(full.tokens, again.tokens)
    alone = sample(logits[2:3], keys[2:3], config)
    assert int(alone.tokens[0]) == int(full.tokens[2])


def test_logprobs_are_untempered_and_sample_logprobs_tempered():
    logits = _logits()
    out = sample(logits, _keys(4), SamplingConfig(temperature=0.5))
    rows = jnp.arange(4)
    np.testing.assert_allclose(out.logprobs, jax.nn.log_softmax(logits)[rows, out.tokens], rtol=1e-5)
    np.testing.assert_allclose(out.sample_logprobs, jax.nn.log_softmax(logits / 0.5)[rows, out.tokens], rtol=1e-5)


@pytest.mark.parametrize(
    "config",
    [SamplingConfig(1.0, top_k=3), SamplingConfig(0.7, top_p=0.5), SamplingConfig(1.5, top_k=5, top_p=0.8)],
)
def test_truncation_support_is_normalised_and_never_left(config):
    logits = _logits(batch=3, vocab=32)
    draw = jax.nn.log_softmax(truncated_logits(logits, config), axis=-1)  # what sample draws from
    np.testing.assert_allclose(jnp.exp(draw).sum(-1), 1.0, rtol=1e-5)
    support = np.isfinite(np.asarray(draw))
    if config.top_k:
        assert (support.sum(-1) <= config.top_k).all()
    draw = jax.jit(lambda seed: sample(logits, jax.random.split(jax.random.key(seed), 3), config).tokens)
    tokens = np.asarray(jax.vmap(draw)(jnp.arange(200)))
    rows = np.broadcast_to(np.arange(3), tokens.shape)
    assert support[rows, np.asarray(tokens)].all()


def test_top_p_keeps_smallest_prefix_reaching_mass():
    logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]]))
    draw = np.asarray(jax.nn.log_softmax(truncated_logits(logits, SamplingConfig(1.0, top_p=0.75)), axis=-1))
    np.testing.assert_array_equal(np.isfinite(draw[0]), [True, True, False, False])
    np.testing.assert_allclose(np.exp(draw[0, :2]), [0.5 / 0.8, 0.3 / 0.8], rtol=1e-5)


def test_top_k_one_equals_greedy():
    logits = _logits()
    out = sample(logits, _keys(4), SamplingConfig(temperature=1.0, top_k=1))
    np.testing.assert_array_equal(out.tokens, np.argmax(logits, -1))


def test_sampled_frequencies_match_tempered_distribution():
    logits = jnp.log(jnp.array([[0.6, 0.3, 0.1]]))
    config = SamplingConfig(temperature=2.0)
    keys = jax.random.split(jax.random.key(3), 4000)
    tokens = np.asarray(jax.vmap(lambda k: sample(logits, k[None], config).tokens[0])(keys))
    expected = np.asarray(jax.nn.softmax(logits[0] / 2.0))
    np.testing.assert_allclose(np.bincount(tokens, minlength=3) / 4000, expected, atol=0.03)


def test_bad_config_names_the_field():
    with pytest.raises(ValueError, match="top_p"):
        SamplingConfig(top_p=0.0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingConfig(temperature=-1.0)


def _numpy_sampling_logprobs(logits, temperature, top_p):
    """The sampling distribution from its definition: temper, keep the smallest top set reaching top_p."""
    scaled = np.asarray(logits, np.float64) / temperature
    out = np.full(scaled.shape, -np.inf)
    for b, row in enumerate(scaled):
        order = np.argsort(-row)
        p = np.exp(row[order] - row.max())
        p /= p.sum()
        keep = order[: int(np.searchsorted(np.cumsum(p), top_p) + 1)]
        out[b, keep] = row[keep] - np.log(np.exp(row[keep]).sum())
    return out


def test_behaviour_logprobs_are_those_of_the_distribution_sampled_at_t07_top_p09():
    logits = _logits(batch=64, vocab=32)
    config = SamplingConfig(temperature=0.7, top_p=0.9)
    out = sample(logits, _keys(64), config)
    want = _numpy_sampling_logprobs(logits, 0.7, 0.9)[np.arange(64), np.asarray(out.tokens)]
    assert np.isfinite(want).all()
    np.testing.assert_allclose(out.sample_logprobs, want, atol=1e-5)
    np.testing.assert_allclose(token_sample_logprobs(logits, out.tokens, config), want, atol=1e-5)
    # The untempered log-probs are not the behaviour ones here: using them would bias PPO's ratio.
    assert np.abs(np.asarray(out.logprobs) - want).mean() > 1e-2
