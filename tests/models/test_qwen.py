"""The decoder against transformers on tiny random checkpoints, the KV cache, presets and configs."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.helpers import build_hf_checkpoint, torch_logits
from trace_jax.checkpoint.hf import load_hf
from trace_jax.models import abstract_model
from trace_jax.models.qwen import PRESETS, KVCache, ModelConfig, Qwen, num_params

CASES = {
    "qwen3-tied-theta1e6-headdim24": ("qwen3", dict(tie_word_embeddings=True, rope_theta=1e6, head_dim=24)),
    "qwen3-untied-theta1e4-1kv": ("qwen3", dict(tie_word_embeddings=False, rope_theta=1e4, num_key_value_heads=1)),
    "qwen2-tied-theta1e6-1kv": ("qwen2", dict(tie_word_embeddings=True, rope_theta=1e6, num_key_value_heads=1)),
    "qwen2-untied-theta1e4": ("qwen2", dict(tie_word_embeddings=False, rope_theta=1e4)),
}


def load_model(hf_dir, **overrides):
    config, params = load_hf(hf_dir, **overrides)
    return nnx.merge(abstract_model(config)[0], params)


@pytest.fixture(scope="module", params=sorted(CASES))
def checkpoint(request, tmp_path_factory):
    family, fields = CASES[request.param]
    path = tmp_path_factory.mktemp(request.param)
    return path, build_hf_checkpoint(path, family, **fields)


def test_logits_match_transformers(checkpoint):
    path, reference = checkpoint
    ids = np.random.default_rng(0).integers(0, 128, (3, 11))
    ours = load_model(path)(jnp.asarray(ids)).logits_btv
    assert np.abs(np.asarray(ours) - torch_logits(reference, ids)).max() <= 1e-4


def test_sharded_safetensors_with_index_load_the_same(tmp_path):
    reference = build_hf_checkpoint(tmp_path, "qwen3", tie_word_embeddings=False, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len(list(tmp_path.glob("*.safetensors"))) > 2
    ids = np.random.default_rng(1).integers(0, 128, (2, 7))
    ours = load_model(tmp_path)(jnp.asarray(ids)).logits_btv
    assert np.abs(np.asarray(ours) - torch_logits(reference, ids)).max() <= 1e-4


def test_token_by_token_decoding_through_the_cache_equals_one_forward(checkpoint):
    path, _ = checkpoint
    model = load_model(path)
    ids = jnp.asarray(np.random.default_rng(2).integers(0, 128, (2, 10)))
    full = model(ids)
    cache = KVCache.init(model.config, batch=2, max_len=16)
    steps = []
    for t in range(ids.shape[1]):
        out = model(ids[:, t : t + 1], cache=cache)
        cache = out.cache
        steps.append(out.logits_btv)
    np.testing.assert_allclose(np.concatenate(steps, axis=1), full.logits_btv, atol=1e-5)
    np.testing.assert_array_equal(cache.lengths, [10, 10])


def test_slots_of_different_lengths_decode_independently(checkpoint):
    """Per-slot positions: a short and a long prompt share one prefill (right padding, num_new_b) and decode."""
    path, _ = checkpoint
    model = load_model(path)
    rng = np.random.default_rng(3)
    short, long = rng.integers(0, 128, 4), rng.integers(0, 128, 9)
    padded = np.zeros((2, 9), np.int32)
    padded[0, :4], padded[1] = short, long
    cache = KVCache.init(model.config, batch=2, max_len=16)
    cache = model(jnp.asarray(padded), cache=cache, num_new_b=jnp.asarray([4, 9])).cache
    np.testing.assert_array_equal(cache.lengths, [4, 9])
    nxt = rng.integers(0, 128, (2, 1))
    stepped = model(jnp.asarray(nxt), cache=cache).logits_btv[:, 0]
    for slot, prompt in enumerate((short, long)):
        alone = model(jnp.asarray(np.concatenate([prompt, nxt[slot]])[None])).logits_btv[0, -1]
        np.testing.assert_allclose(stepped[slot], alone, atol=1e-5)


def test_cache_writes_past_max_len_are_dropped_not_clipped():
    """Padding that runs past the cache end must not overwrite the last position (mode="drop", not clamp)."""
    model = Qwen(ModelConfig.preset("qwen3-tiny"), rngs=nnx.Rngs(0))
    ids = jnp.asarray(np.random.default_rng(5).integers(0, 512, (2, 8)))
    exact = KVCache.init(model.config, batch=2, max_len=8)
    exact = model(ids, cache=exact, num_new_b=jnp.asarray([8, 5])).cache
    overflow = KVCache.init(model.config, batch=2, max_len=8)
    overflow = model(ids[:, :6], cache=overflow).cache
    # Slot 0 gets 2 real tokens at positions 6, 7 plus 3 padding tokens at 8..10 (past max_len).
    tail = jnp.concatenate([ids[:, 6:], jnp.zeros((2, 3), ids.dtype)], axis=1)
    overflow = model(tail, cache=overflow, num_new_b=jnp.asarray([2, 0])).cache
    assert exact.k.shape == (2, 2, 8, model.config.num_kv_heads, model.config.head_dim)  # [L, B, S, K, E]
    np.testing.assert_array_equal(overflow.lengths, [8, 6])
    np.testing.assert_allclose(overflow.k[:, 0], exact.k[:, 0], atol=1e-5)
    np.testing.assert_allclose(overflow.v[:, 0], exact.v[:, 0], atol=1e-5)
    np.testing.assert_allclose(overflow.k[:, 1, :5], exact.k[:, 1, :5], atol=1e-5)


def test_bfloat16_compute_stays_close_to_float32(checkpoint):
    path, reference = checkpoint
    ids = np.random.default_rng(4).integers(0, 128, (2, 8))
    logits = load_model(path, dtype="bfloat16", param_dtype="bfloat16")(jnp.asarray(ids)).logits_btv
    assert logits.dtype == jnp.float32
    assert np.abs(np.asarray(logits) - torch_logits(reference, ids)).max() < 0.1


def test_from_hf_reads_rope_theta_top_level_and_in_rope_parameters():
    base = dict(
        model_type="qwen3",
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
    )
    assert ModelConfig.from_hf({**base, "rope_theta": 1234.0}).rope_theta == 1234.0
    nested = {**base, "rope_parameters": {"rope_type": "default", "rope_theta": 4321.0}}
    assert ModelConfig.from_hf(nested).rope_theta == 4321.0
    with pytest.raises(ValueError, match="rope_theta"):
        ModelConfig.from_hf(base)


def test_config_round_trips_through_hf_json(tmp_path):
    for name in ("qwen3-tiny", "qwen2-tiny", "qwen2.5-7b", "qwen3-8b"):
        config = PRESETS[name]
        (tmp_path / "config.json").write_text(json.dumps(config.to_hf()))
        assert ModelConfig.from_hf(tmp_path) == config


# Published sizes (billions, as the model cards round them).
PUBLISHED_BILLIONS = {
    "qwen2.5-0.5b": 0.49,
    "qwen2.5-1.5b": 1.54,
    "qwen2.5-3b": 3.09,
    "qwen2.5-7b": 7.61,
    "qwen2.5-14b": 14.7,
    "qwen3-0.6b": 0.6,
    "qwen3-1.7b": 1.7,
    "qwen3-4b": 4.0,
    "qwen3-8b": 8.2,
    "qwen3-14b": 14.8,
    "qwen3-32b": 32.8,
}


@pytest.mark.parametrize("name", sorted(PUBLISHED_BILLIONS))
def test_preset_parameter_counts_match_published_sizes(name):
    # Within one unit of the card's last digit (cards round, sometimes down: Qwen2.5-14B has 14.77e9).
    published = PUBLISHED_BILLIONS[name]
    unit = 10.0 ** -len(str(published).split(".")[1])
    assert abs(num_params(PRESETS[name]) / 1e9 - published) < unit


@pytest.mark.parametrize("name", ["qwen3-tiny", "qwen2-tiny"])
def test_parameter_count_equals_the_built_model(name):
    model = Qwen(PRESETS[name], rngs=nnx.Rngs(0))
    built = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert num_params(PRESETS[name]) == built


def test_bad_configs_are_clear_errors():
    with pytest.raises(ValueError, match="unknown model preset"):
        ModelConfig.preset("qwen9-1t")
    with pytest.raises(ValueError, match="num_kv_heads"):
        ModelConfig.preset("qwen3-tiny", num_kv_heads=3)
    with pytest.raises(ValueError, match="dtype"):
        ModelConfig.preset("qwen3-tiny", dtype="float8")


def test_a_packed_tree_row_equals_its_paths_run_separately():
    # Root A with children B and C, laid out A B C (depth-first): B's tokens must not see C's and vice versa,
    # and C continues A's positions. Two trees share the row: the second (D) must see nothing of the first.
    model = Qwen(ModelConfig.preset("qwen3-tiny"), rngs=nnx.Rngs(0))
    a, b, c, d = [5, 6, 7], [8, 9], [10, 11], [12, 13, 14]
    packed = jnp.asarray([a + b + c + d])
    positions = jnp.asarray([[0, 1, 2, 3, 4, 3, 4, 0, 1, 2]])
    visible_end = jnp.asarray([[7, 7, 7, 5, 5, 7, 7, 10, 10, 10]])
    hidden, _ = model.hidden(packed, positions_bt=positions, kv_visible_end_bt=visible_end)
    paths = [((0, 5), a + b), ((5, 7), a + c), ((7, 10), d)]
    hidden_ab, _ = model.hidden(jnp.asarray([a + b]))
    unpacked, _ = model.hidden(packed)
    assert np.abs(np.asarray(hidden[0, 5:7] - unpacked[0, 5:7])).max() > 1e-3  # the mask matters here
    for (start, stop), path in paths:
        alone, _ = model.hidden(jnp.asarray([path]))
        np.testing.assert_allclose(hidden[0, start:stop], alone[0, start - stop :], atol=1e-5)
    np.testing.assert_allclose(hidden[0, :5], hidden_ab[0], atol=1e-5)
