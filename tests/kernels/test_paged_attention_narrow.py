"""Decode attention at head_dim 64 through the paged-attention kernel body (Pallas TPU interpret mode on CPU)."""

import jax.numpy as jnp
import numpy as np
import pytest

from trace_jax.kernels import paged_attention


def _decode_case(rng, e, groups=2, kv_heads=2, slots=3, page_size=8, pages_per_slot=4, pages=16):
    """A query per slot, a float32 pool and each slot's own pages and length."""
    draw = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
    q = draw(slots, kv_heads * groups, e)
    k_pages, v_pages = draw(kv_heads, pages, page_size, e), draw(kv_heads, pages, page_size, e)
    table = jnp.asarray(rng.permutation(pages)[: slots * pages_per_slot].reshape(slots, pages_per_slot), jnp.int32)
    lengths = jnp.asarray([5, page_size * pages_per_slot, 17][:slots], jnp.int32)
    return q, k_pages, v_pages, lengths, table


def _reference(q, k_pages, v_pages, lengths, table):
    """Softmax attention of each slot's query over its first ``length`` positions, float64 on the host."""
    q, k_pages, v_pages = (np.asarray(x, np.float64) for x in (q, k_pages, v_pages))
    kv_heads, _, _, e = k_pages.shape
    groups = q.shape[1] // kv_heads
    out = np.zeros_like(q)
    for b, length in enumerate(np.asarray(lengths)):
        keys = k_pages[:, np.asarray(table[b])].reshape(kv_heads, -1, e)[:, :length]
        values = v_pages[:, np.asarray(table[b])].reshape(kv_heads, -1, e)[:, :length]
        for h in range(q.shape[1]):
            scores = keys[h // groups] @ q[b, h] / np.sqrt(e)
            weights = np.exp(scores - scores.max())
            out[b, h] = weights @ values[h // groups] / weights.sum()
    return out


def _decode(q, k_pages, v_pages, lengths, table):
    return paged_attention.paged_decode(q, k_pages, v_pages, lengths, table, pages_per_compute_block=2, interpret=True)


@pytest.mark.parametrize("groups", [2, 8], ids=["groups2", "groups8"])
def test_head_dim_64_decodes_like_the_128_lane_kernel_on_zero_padded_heads(groups):
    """The narrow call at head_dim 64 equals jax's kernel on the same heads zero-padded to 128 lanes (sliced back,
    the same 1/sqrt(64) scale), and the float reference to the kernel's bf16 page rounding. Mutant caught: the
    page table flattened column-major (another slot's pages read)."""
    rng = np.random.default_rng(0)
    q, k_pages, v_pages, lengths, table = _decode_case(rng, 64, groups=groups)
    assert paged_attention.problems(64, "float32", 8) == []
    narrow = _decode(q, k_pages, v_pages, lengths, table)
    assert narrow.shape == q.shape
    pad = lambda x: jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, 64)])
    # Pre-scaled so that jax's kernel (scale from its 128 lanes) sees the scale of the true head_dim.
    wide = _decode(pad(q) * np.sqrt(128 / 64), pad(k_pages), pad(v_pages), lengths, table)[..., :64]
    np.testing.assert_allclose(narrow, wide, atol=1e-6)
    np.testing.assert_allclose(narrow, _reference(q, k_pages, v_pages, lengths, table), atol=3e-2)


def test_head_dims_the_kernel_cannot_take_are_named():
    assert paged_attention.problems(128, "bfloat16", 16) == []
    assert any("head_dim=32" in p for p in paged_attention.problems(32, "bfloat16", 16))
