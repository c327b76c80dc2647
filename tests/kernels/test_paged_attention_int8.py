"""The int8 paged-decode kernel (``trace_jax.kernels.paged_attention_int8``) in Pallas TPU interpret mode against
the reference: attention over the pages dequantized with their own scales, and over the float values they
quantize (within the int8 error)."""

import jax.numpy as jnp
import numpy as np

from trace_jax.kernels import paged_attention_int8 as int8_kernel
from trace_jax.rollout.engine import pages

B, H, KV, E, PAGE, PAGES_PER_SLOT, POOL, BLOCK = 3, 4, 2, 128, 8, 4, 16, 2
LENGTHS = (1, 13, 32)  # one position (one block); a page and a part (one block); every page (two blocks)


def _case(seed=0):
    rng = np.random.default_rng(seed)
    # Rows of very different magnitudes, so every position's scale matters.
    magnitude = rng.uniform(0.05, 4.0, size=(KV, POOL, PAGE, 1))
    k, v = (rng.normal(size=(KV, POOL, PAGE, E)) * magnitude for _ in range(2))
    q = rng.normal(size=(B, H, E))
    table = np.stack([rng.permutation(np.arange(1, POOL))[:PAGES_PER_SLOT] for _ in range(B)]).astype(np.int32)
    return jnp.asarray(q, jnp.float32), jnp.asarray(k, jnp.float32), jnp.asarray(v, jnp.float32), table


def _by_layer(scales):
    """Scales ``[K, POOL, PAGE]`` as the engine hands them over: two layers of ``POOL // 2`` pages in
    ``scale_groups``' view (the table's pages lie in both layers and in several groups)."""
    grouped = int8_kernel.scale_groups(scales.reshape(KV, 2, POOL // 2, PAGE))
    assert grouped.shape == (KV, 2, 8, PAGE)  # premise: 8 pages a group, two groups
    return grouped


def _reference(q, k, v, table, lengths):
    """Attention of each slot's query over its first ``length`` positions, gathered through the table, f32."""
    out = np.zeros(q.shape, np.float32)
    for b, length in enumerate(lengths):
        keys = np.asarray(k)[:, table[b]].reshape(KV, -1, E)[:, :length]  # [KV, length, E]
        values = np.asarray(v)[:, table[b]].reshape(KV, -1, E)[:, :length]
        for h in range(H):
            logits = keys[h // (H // KV)] @ np.asarray(q)[b, h] / np.sqrt(E)
            p = np.exp(logits - logits.max())
            out[b, h] = (p / p.sum()) @ values[h // (H // KV)]
    return out


def _kernel(q, kq, ks, vq, vs, table):
    """The int8 kernel in interpret mode over quantized pages and their scales (one layer's, as the engine
    hands them over), at the case's lengths."""
    lengths = jnp.asarray(LENGTHS, jnp.int32)
    return int8_kernel.paged_decode_int8(
        q,
        kq,
        _by_layer(ks),
        vq,
        _by_layer(vs),
        lengths,
        jnp.asarray(table),
        pages_per_compute_block=BLOCK,
        interpret=True,
    )


def test_the_kernels_quantization_convention_is_the_engines():
    assert int8_kernel.QUANT_DIVISOR == pages.QUANT_DIVISOR


def test_the_int8_kernel_equals_attention_over_the_dequantized_pages():
    """Interpret mode, float32 queries: equal to the reference over the pages dequantized with their scales
    within 1e-5 (same float32 math in another order), and within 0.15 of the reference over the float values
    quantized (rows up to ~12 in magnitude: a value step is up to 12 / 254; premise: the two references differ).
    Mutants caught: the scales ignored (``ks_ref`` / ``vs_ref`` read as 1: off by ~1); another page's scales
    (the scale blocks indexed by the next page of the table: off by ~0.5); the length mask off by one."""
    q, k, v, table = _case()
    (kq, ks), (vq, vs) = pages.quantize(k), pages.quantize(v)
    assert kq.dtype == jnp.int8 and ks.shape == (KV, POOL, PAGE)
    got = np.asarray(_kernel(q, kq, ks, vq, vs, table))
    dequantized = _reference(q, pages.dequantize(kq, ks), pages.dequantize(vq, vs), table, LENGTHS)
    exact = _reference(q, k, v, table, LENGTHS)
    np.testing.assert_allclose(got, dequantized, atol=1e-5)
    gap = np.abs(dequantized - exact).max()
    assert 0 < gap < 0.15, gap  # premise: quantizing moves the result (measured 0.072)
    assert np.abs(got - exact).max() < 0.15


def test_the_int8_kernel_takes_bf16_queries():
    """The engine's queries are bf16: the pages are cast to bf16 in VMEM (int8 is exact there) and the result
    stays within bf16 rounding of the float32 one (a few bf16 steps, 2**-6 of the largest output; measured
    0.054 of outputs up to ~8)."""
    q, k, v, table = _case(1)
    (kq, ks), (vq, vs) = pages.quantize(k), pages.quantize(v)
    run = lambda q: _kernel(q, kq, ks, vq, vs, table)
    low = run(q.astype(jnp.bfloat16))
    assert low.dtype == jnp.bfloat16
    high = np.asarray(run(q))
    np.testing.assert_allclose(np.asarray(low, np.float32), high, atol=2**-6 * np.abs(high).max())


def test_the_tpu_engine_decodes_an_int8_cache_through_the_int8_kernel_reading_the_pool_in_place():
    """``Engine.lower_generate`` compiled for v5p:2x2x1 (data 4) with ``cache_dtype="int8"``: one
    ``paged_attention_int8`` Mosaic call, and no array of one layer's pages of a shard in the compute dtype (the
    dequantized copy the previous path made a layer and step), and no copy of a whole scale pool (XLA lays it
    out pages-minor; the kernel reads pages-major, so only one layer's scales may be relaid out per call).
    Mutants caught: the int8 cache routed to jax's kernel through a dequantized layer again (its Mosaic call, a
    bf16 ``[kv_heads, pages, page, head_dim]``); the kernel handed every layer's scales (a copy of the pool)."""
    from tests.kernels.test_tpu_kernels import TPU_QWEN
    from tests.models.tpu_topology import MOSAIC, tpu_devices
    from trace_jax.parallel import mesh as mesh_lib
    from trace_jax.plan import hlo
    from trace_jax.rollout.engine.engine import Engine, EngineConfig
    from trace_jax.rollout.engine.layout import SamplingLayout

    config = EngineConfig(max_slots=8, max_len=256, steps_per_call=4, page_size=16, cache_dtype="int8")
    layout = SamplingLayout(mesh_lib.make_mesh(fsdp=1, devices=tpu_devices(), data=4, tensor=1))
    engine = Engine.for_model(TPU_QWEN, config, layout)
    assert engine.decode_attention == "pallas_paged_int8"
    text = engine.lower_generate().compile().as_text()
    assert MOSAIC in text
    assert hlo.kernel_names(text) == {"paged_attention_int8": 1}
    pages = config.pool_pages // 4
    layer = f"bf16[{TPU_QWEN.num_kv_heads},{pages},{config.page},{TPU_QWEN.head_dim}]"
    assert layer not in text, f"one layer's pages dequantized: {layer}"
    pool = f"f32[{TPU_QWEN.num_kv_heads},{TPU_QWEN.num_layers},{pages},{config.page}]"
    copies = [line for line in text.splitlines() if f"= {pool}" in line and " copy(" in line]
    assert not copies, f"the scale pool relaid out whole each layer: {copies[0][:160]}"
