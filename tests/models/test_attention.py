"""The one attention function: blockwise reference = one block = jax.nn.dot_product_attention, all masks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trace_jax.models import attention as attention_lib
from trace_jax.models.attention import attention, visible_mask


def _qkv(b=2, t=40, h=4, k=2, e=8, seed=0, dtype=jnp.float32):
    keys = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(keys[0], (b, t, h, e), dtype)
    kk = jax.random.normal(keys[1], (b, t, k, e), dtype)
    v = jax.random.normal(keys[2], (b, t, k, e), dtype)
    return q, kk, v


def _tree_ends(b, t):
    # Each key is seen up to a random end past itself: a valid (nested or not) visibility bound.
    rng = np.random.default_rng(0)
    index = np.arange(t)
    return jnp.asarray(np.minimum(index + 1 + rng.integers(0, t, (b, t)), t), jnp.int32)


def _naive(q, k, v, visible_bts):
    h, e = q.shape[2:]
    k_h = jnp.repeat(k, h // k.shape[2], axis=2)
    v_h = jnp.repeat(v, h // v.shape[2], axis=2)
    scores = jnp.einsum("bthe,bshe->bhts", q, k_h) / np.sqrt(e)
    scores = jnp.where(visible_bts[:, None], scores, -jnp.inf)
    return jnp.einsum("bhts,bshe->bthe", jax.nn.softmax(scores, axis=-1), v_h)


@pytest.mark.parametrize("unrolled", [False, True])
@pytest.mark.parametrize("tree", [False, True])
def test_reference_blockwise_equals_naive_attention(monkeypatch, tree, unrolled):
    q, k, v = _qkv()
    b, t = q.shape[:2]
    index = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    ends = _tree_ends(b, t) if tree else None
    want = _naive(q, k, v, visible_mask(index, t, ends))
    monkeypatch.setattr(attention_lib, "REFERENCE_BLOCK", 16)  # 40 queries: 3 blocks, the last one short
    # Unrolled: each block reads only the keys before its end; else one block shape mapped over all keys.
    monkeypatch.setattr(attention_lib, "IN_ORDER_MAX_BLOCKS", 3 if unrolled else 2)
    got = attention(q, k, v, index, ends, in_order=True, implementation="reference")
    np.testing.assert_allclose(got, want, atol=1e-5)
    grad = jax.grad(lambda q: attention(q, k, v, index, ends, in_order=True, implementation="reference").sum())(q)
    want_grad = jax.grad(lambda q: _naive(q, k, v, visible_mask(index, t, ends)).sum())(q)
    assert np.abs(np.asarray(want_grad)).max() > 1e-3  # premise: the gradient is not zero
    np.testing.assert_allclose(grad, want_grad, atol=1e-4)
    # The XLA path of jax.nn.dot_product_attention takes the same masks.
    fused = attention(q, k, v, index, ends, in_order=True, implementation="xla")
    np.testing.assert_allclose(fused, want, atol=1e-5)
    if tree:  # the premise: the tree bound changes the result
        assert np.abs(np.asarray(want - _naive(q, k, v, visible_mask(index, t, None)))).max() > 1e-3


def test_cached_attention_sees_the_slot_positions_written_so_far():
    q = _qkv(t=1)[0]
    cache_k, cache_v = _qkv(t=12, seed=1)[1:]
    positions = jnp.asarray([[3], [9]], jnp.int32)  # slot 0 has 3 earlier keys, slot 1 has 9
    got = attention(q, cache_k, cache_v, positions, implementation="reference")
    for slot, position in enumerate((3, 9)):
        sl = slice(slot, slot + 1)
        alone = _naive(
            q[sl], cache_k[sl, : position + 1], cache_v[sl, : position + 1], jnp.ones((1, 1, position + 1), bool)
        )
        np.testing.assert_allclose(got[sl], alone, atol=1e-5)


def test_bfloat16_inputs_accumulate_in_float32():
    q, k, v = _qkv(t=64, e=64)
    index = jnp.broadcast_to(jnp.arange(64, dtype=jnp.int32), (2, 64))
    exact = attention(q, k, v, index, in_order=True, implementation="reference")
    half = attention(*(x.astype(jnp.bfloat16) for x in (q, k, v)), index, in_order=True, implementation="reference")
    assert half.dtype == jnp.bfloat16
    assert np.abs(np.asarray(half, np.float32) - np.asarray(exact)).max() < 0.05


def test_auto_is_the_reference_on_cpu_and_unknown_names_are_clear():
    """ "auto" follows the compile target: on this CPU host, with or without a CPU mesh, it is the reference
    program (no Mosaic call). Mutant caught: "auto" resolved to a TPU kernel off TPU."""
    assert attention_lib.resolve("auto") == "auto" and attention_lib.target_platform() == "cpu"
    q, k, v = _qkv(t=16)
    index = jnp.broadcast_to(jnp.arange(16, dtype=jnp.int32), (2, 16))
    auto = jax.jit(lambda q, k, v: attention(q, k, v, index, in_order=True)).lower(q, k, v).as_text()
    reference = jax.jit(lambda q, k, v: attention(q, k, v, index, in_order=True, implementation="reference"))
    assert "tpu_custom_call" not in auto and auto == reference.lower(q, k, v).as_text()
    with pytest.raises(ValueError, match="unknown attention implementation 'flash3'"):
        attention_lib.resolve("flash3")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_rows_read_on_their_bits_are_the_rows_and_differentiate_as_a_gather(dtype):
    """``take_rows`` (the embedding lookup) gives ``jnp.take``'s values and gradient. Fails if its derivative
    rule is dropped: a bitcast has none, so an embedding table would learn nothing from its lookups."""
    table = jax.random.normal(jax.random.PRNGKey(0), (11, 4)).astype(dtype)
    ids = jnp.array([[3, 3, 0], [10, 5, 3]])
    weights = jax.random.normal(jax.random.PRNGKey(1), (2, 3, 4)).astype(dtype)

    def loss(take):
        return lambda t: jnp.sum(take(t, ids).astype(jnp.float32) * weights.astype(jnp.float32))

    plain = lambda t, i: jnp.take(t, i, axis=0)
    assert np.array_equal(attention_lib.take_rows(table, ids), plain(table, ids))
    expected = jax.grad(loss(plain))(table)
    assert float(jnp.abs(expected.astype(jnp.float32)).sum()) > 0  # premise: the lookups carry gradient
    np.testing.assert_array_equal(jax.grad(loss(attention_lib.take_rows))(table), expected)
