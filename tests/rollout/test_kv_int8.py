"""The int8 KV cache (``EngineConfig.cache_dtype="int8"``): its quantization bound, the decode kernel's int8 path
against the reference path, an engine with forks and appends against the float cache, and the default left bf16."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh

from trace_jax.models import ModelConfig, Qwen, abstract_model
from trace_jax.rollout.engine import pages
from trace_jax.rollout.engine.engine import AppendItem, Engine, EngineConfig
from trace_jax.rollout.engine.sampling import SamplingConfig


def _int8_cache(num_pages: int, page_size: int, head_dim: int, table_bp, lengths_b, layers: int = 1, kv: int = 1):
    shape = (kv, layers, num_pages, page_size, head_dim)
    return pages.PagedKVCache(
        jnp.zeros(shape, jnp.int8), jnp.zeros(shape, jnp.int8), jnp.asarray(table_bp, jnp.int32),
        jnp.asarray(lengths_b, jnp.int32), jnp.arange(len(table_bp[0]) * page_size), jnp.int8,
        k_scales=jnp.ones(shape[:-1], jnp.float32), v_scales=jnp.ones(shape[:-1], jnp.float32),
    )  # fmt: skip


def test_the_int8_cache_round_trips_each_position_within_half_a_step_of_its_own_row():
    """Keys / values written through the page table and read back: each (position, head) row within half a
    quantization step of its own largest magnitude, ``max|row| / 254``, though the rows' magnitudes span 1e-3..1e3.
    Mutants caught: one scale for the whole cache (the small rows lose every digit), a dequantization
    that divides by 127 instead of the stored convention's 127.5 (the largest values off by 0.4%)."""
    rng = np.random.default_rng(0)
    b, t, kv, e, page_size = 2, 8, 2, 16, 4
    table_bp = [[1, 2], [3, 4]]
    magnitudes_btk1 = 10.0 ** rng.uniform(-3, 3, (b, t, kv, 1))
    k_btke = jnp.asarray(rng.standard_normal((b, t, kv, e)) * magnitudes_btk1, jnp.float32)
    v_btke = jnp.asarray(rng.standard_normal((b, t, kv, e)) * magnitudes_btk1[::-1], jnp.float32)
    cache = _int8_cache(5, page_size, e, table_bp, [t, t], kv=kv)
    positions_bt = jnp.broadcast_to(jnp.arange(t), (b, t))
    cache = cache.write_layer(0, positions_bt, k_btke, v_btke)
    keys, values = cache.read_layer(0)
    assert cache.k_pages.dtype == jnp.int8 and keys.shape == (b, t, kv, e)  # premise: int8 pools, the whole window
    for read, written in ((keys, k_btke), (values, v_btke)):
        error = np.abs(np.asarray(read) - np.asarray(written))
        bound = np.abs(np.asarray(written)).max(-1, keepdims=True) / 254 * (1 + 1e-5)
        assert (error <= bound).all(), float((error / bound).max())
        assert error.max() > 0  # premise: quantized, not stored exact


def test_the_decode_kernel_reads_an_int8_cache_like_the_reference_path():
    """One new token per slot through the int8 paged-attention kernel (``paged_attention_int8``, TPU interpret
    mode, one shard) on an int8 cache: the same pools written (values and scales) and the same attention output
    as the reference path's write + read + attention (the tolerance of bf16 rounding, kept from jax's kernel;
    ours computes in the query's dtype, float32 here). Mutants caught: the kernel fed the int8 values without
    their scales, another layer's scales, the new token's scale not written."""
    from trace_jax.models import attention as attention_lib

    rng = np.random.default_rng(1)
    page_size, pages_per_slot, num_pages, head_dim, layers = 8, 2, 5, 128, 2
    max_len = page_size * pages_per_slot
    table_bp, lengths = [[1, 2], [3, 4]], [11, 5]
    cache = _int8_cache(num_pages, page_size, head_dim, table_bp, lengths, layers=layers)
    history = lambda: jnp.asarray(rng.standard_normal((2, max_len, 1, head_dim)) * [[[[1.0]]], [[[30.0]]]], jnp.float32)
    for layer in range(layers):  # earlier positions of both layers, different magnitudes per slot
        cache = cache.write_layer(layer, jnp.broadcast_to(jnp.arange(max_len), (2, max_len)), history(), history())
    q = jnp.asarray(rng.standard_normal((2, 1, 2, head_dim)), jnp.float32)
    new = lambda: jnp.asarray(rng.standard_normal((2, 1, 1, head_dim)), jnp.float32)
    k_new, v_new, positions_bt = new(), new(), jnp.asarray([[11], [5]], jnp.int32)
    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
    kernel = pages.DecodeKernel(mesh, ("data",), None, pages_per_slot, interpret=True)
    out_kernel, by_kernel = kernel.decode(cache, 1, q, k_new, v_new, positions_bt)
    by_reference = cache.write_layer(1, positions_bt, k_new, v_new)
    keys, values = by_reference.read_layer(1)
    out_reference = attention_lib.attention(q, keys, values, positions_bt)
    for name in pages.POOL_FIELDS:
        np.testing.assert_array_equal(getattr(by_kernel, name), getattr(by_reference, name), err_msg=name)
    assert not np.array_equal(by_reference.k_scales, cache.k_scales)  # premise: the new token's scale was written
    np.testing.assert_allclose(out_kernel, out_reference, atol=2e-2, rtol=2e-2)
    assert float(jnp.abs(out_reference).max()) > 0.1  # premise: attention outputs of a size the tolerance tests


CONFIG = ModelConfig.preset("qwen3-tiny", vocab_size=96)


def _rollout(cache_dtype: str | None):
    """Greedy tokens and log-probs of a fork + append + decode sequence (pages shared, copied and appended)."""
    params = nnx.split(Qwen(CONFIG, rngs=nnx.Rngs(3)), nnx.Param)[1]
    params["embed"][...] = params["embed"][...] * 0.05
    engine_config = EngineConfig(
        max_slots=4, max_len=32, steps_per_call=6, max_turn_tokens=6, length_buckets=(32,), row_buckets=(4,),
        page_size=4, sampling=SamplingConfig.make_greedy(), weight_dtype=None, cache_dtype=cache_dtype,
    )  # fmt: skip
    engine = Engine(abstract_model(CONFIG)[0], CONFIG, engine_config)
    engine.set_params(params)
    state = engine.init_decode_state()
    state, first = engine.insert(None, state, [[5, 17, 3, 9, 42, 8, 1]], [0], [0], keep=True)
    state = engine.fork(state, [first.prefixes[0]] * 2, [1, 2], [1, 2])
    state, out = engine.generate(None, state)
    state, _ = engine.append(None, state, [AppendItem(1, [40, 41, 42])])
    state, more = engine.generate(None, state)
    return np.concatenate([out.tokens[:3], more.tokens[:3]], 1), out.logprobs[:3], state


def test_an_int8_engine_forks_and_appends_like_the_float_engine_to_its_first_tokens():
    """The tiny model (float32 compute) with an int8 cache against a float32 cache through a fork, a decode, an
    append and another decode: the scale pools are int8's only, forks copy them with the pages (the forked
    slots decode alike), and the first greedy tokens agree, with log-probs within 0.05 there. Mutant caught:
    a fork that copies the values' pages but not their scales (the forks' first tokens differ)."""
    tokens_f, logprobs_f, state_f = _rollout(None)
    tokens_q, logprobs_q, state_q = _rollout("int8")
    assert state_f.device.k_scales is None and state_q.device.k_scales.dtype == jnp.float32
    assert state_q.device.k_pages.dtype == jnp.int8
    np.testing.assert_array_equal(tokens_q[1, :6], tokens_q[2, :6])  # forks of one prefix decode alike
    np.testing.assert_array_equal(tokens_q[:, :3], tokens_f[:, :3])
    np.testing.assert_allclose(logprobs_q[:, :3], logprobs_f[:, :3], atol=0.05)


def test_the_cache_stays_the_compute_dtype_by_default_and_refuses_an_unknown_dtype():
    """The default engine (and the default run's config) keep the bf16 cache, no scale pools; a cache dtype that
    is neither a float nor int8 is refused naming the key. Mutant caught: int8 made the default."""
    from trace_jax import configs

    assert EngineConfig().cache_dtype is None
    assert configs.load("configs/default.py").engine.cache_dtype is None
    bf16 = ModelConfig.preset("qwen3-tiny", dtype="bfloat16")
    engine = Engine(abstract_model(bf16)[0], bf16, EngineConfig(max_slots=4, max_len=32))
    shapes = engine.state_shapes()
    assert shapes.k_pages.dtype == pages.pool_dtype(jnp.bfloat16, "cpu") and shapes.k_scales is None
    with pytest.raises(ValueError, match=r"EngineConfig\.cache_dtype='int4'"):
        EngineConfig(cache_dtype="int4")
