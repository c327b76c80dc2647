"""Paged decode attention over an int8 KV pool that reads the int8 pages and their compact scales (Pallas TPU).

The engine's int8 cache (``trace_jax.rollout.engine.pages``) holds int8 keys / values ``[K, pages, page_size, E]``
and one float32 scale per position and KV head ``[K, pages, page_size]``: ``value = q * scale / QUANT_DIVISOR``.
This kernel DMAs a slot's int8 pages and the matching rows of scales into VMEM and dequantizes there, so a
decode step reads ``2 * E`` bytes of keys and values plus 8 bytes of scales a position and KV head (bf16: ``4 * E``).
jax's kernel has an int8 mode too, but its wrapper broadcasts the scales ``E`` wide in HBM before the call (a
float32 operand the size of the pool).

A scale belongs to a position, so it factors out of the position's dot products: the logits are
``(q . k_int8) * k_scale / QUANT_DIVISOR`` and the output is ``sum_z (p_z * v_scale_z / QUANT_DIVISOR) * v_int8_z``;
int8 values are exact in the query's dtype, so the matmuls run on the int8 pages cast in VMEM, and the scales
multiply ``[groups, page_size]`` rows, never a ``[page_size, E]`` tile.

Grid ``(slots, KV heads, pages of a slot)``, one page a step; the page table and lengths are scalar-prefetched
and each page's block index is looked up in the table (pages past a slot's length re-name its last page, so
nothing new is fetched, and are skipped). Online softmax in float32 over the pages (flash-attention style); the
query heads of a KV head (``groups``) share each fetched page. Blocks are whole pages (their last two dimensions
are the arrays'), so any ``page_size`` and ``head_dim`` lower.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

# value = int8 * scale / QUANT_DIVISOR (``trace_jax.rollout.engine.pages``; kernels sit below rollout, so the
# convention is restated here and tests/kernels/test_paged_attention_int8.py checks the two agree).
QUANT_DIVISOR = 127.5
_MASKED = -1e30  # the logit of a position past the slot's length (finite: no inf - inf)


def cost(b: int, h: int, kv: int, s: int, e: int, itemsize: int) -> pl.CostEstimate:
    """What one decode step of ``b`` slots costs at most (every slot at ``s`` positions): per query head two
    ``s x e`` dot products and ``s`` exponentials; every slot's int8 keys and values read once per KV head, with
    their float32 scales (one per position, each), the queries read and the outputs written in ``itemsize``."""
    return pl.CostEstimate(
        flops=b * h * 2 * 2 * s * e,
        transcendentals=b * h * s,
        bytes_accessed=b * kv * 2 * s * (e + 4) + 2 * b * h * e * itemsize,
    )


def _kernel(lengths_ref, table_ref, q_ref, k_ref, ks_ref, v_ref, vs_ref, o_ref, m_ref, l_ref, acc_ref, *, page_size):
    b, j = pl.program_id(0), pl.program_id(2)
    length = lengths_ref[b]

    @pl.when(j == 0)
    def _start():
        m_ref[...] = jnp.full(m_ref.shape, _MASKED, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    @pl.when(j * page_size < length)
    def _page():
        q = q_ref[...]  # [G, E], already scaled by 1 / sqrt(E)
        contract_e = (((1,), (1,)), ((), ()))
        logits = jax.lax.dot_general(q, k_ref[...].astype(q.dtype), contract_e, preferred_element_type=jnp.float32)
        logits = logits * (ks_ref[...] * (1.0 / QUANT_DIVISOR))  # [G, Z] x [1, Z]: each position's key scale
        position = j * page_size + jax.lax.broadcasted_iota(jnp.int32, logits.shape, 1)
        logits = jnp.where(position < length, logits, _MASKED)
        m_prev = m_ref[...]
        m_new = jnp.maximum(m_prev, jnp.max(logits, axis=1, keepdims=True))
        p = jnp.exp(logits - m_new)
        alpha = jnp.exp(m_prev - m_new)
        l_ref[...] = alpha * l_ref[...] + jnp.sum(p, axis=1, keepdims=True)
        weights = (p * (vs_ref[...] * (1.0 / QUANT_DIVISOR))).astype(q.dtype)  # each position's value scale
        contract_z = (((1,), (0,)), ((), ()))
        acc_ref[...] = alpha * acc_ref[...] + jax.lax.dot_general(
            weights, v_ref[...].astype(q.dtype), contract_z, preferred_element_type=jnp.float32
        )
        m_ref[...] = m_new

    @pl.when(j == pl.num_programs(2) - 1)
    def _finish():
        total = l_ref[...]
        o_ref[...] = jnp.where(total > 0, acc_ref[...] / jnp.where(total > 0, total, 1.0), 0.0).astype(o_ref.dtype)


def paged_decode_int8(
    q_bhe, k_pages, k_scales, v_pages, v_scales, lengths_b, table_bp, *, interpret: bool = False
) -> jax.Array:
    """One shard's decode attention ``[B, H, E]`` in the query's dtype: query ``b`` (not yet scaled) over the
    first ``lengths_b[b]`` positions of its pages ``table_bp[b]`` in the int8 ``k_pages`` / ``v_pages``
    ``[K, pages, page_size, E]`` with float32 ``k_scales`` / ``v_scales`` ``[K, pages, page_size]`` (read in
    place). ``interpret`` runs it in Pallas TPU interpret mode."""
    b, h, e = q_bhe.shape
    kv_heads, pages, page_size, _ = k_pages.shape
    groups = h // kv_heads
    pages_per_slot = table_bp.shape[1]
    q_bkge = (q_bhe * (1.0 / float(e) ** 0.5)).astype(q_bhe.dtype).reshape(b, kv_heads, groups, e)
    # Scales as [K, pages, 1, page_size] (a bitcast): a page's scales are one lane-major row, its block's last
    # two dimensions the array's.
    k_rows, v_rows = (s.reshape(kv_heads, pages, 1, page_size) for s in (k_scales, v_scales))

    def page(i, k, j, lengths_ref, table_ref):  # pages past the length re-name the last one: no new fetch
        last = jnp.maximum(lengths_ref[i] - 1, 0) // page_size
        return k, table_ref[i * pages_per_slot + jnp.minimum(j, last)], 0, 0

    heads = pl.BlockSpec((None, None, groups, e), lambda i, k, j, *_: (i, k, 0, 0))
    values = pl.BlockSpec((None, None, page_size, e), page)
    scales = pl.BlockSpec((None, None, 1, page_size), page)
    call = lambda *args: pl.pallas_call(
        functools.partial(_kernel, page_size=page_size),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,  # lengths, page table (flat)
            grid=(b, kv_heads, pages_per_slot),
            in_specs=[heads, values, scales, values, scales],
            out_specs=heads,
            scratch_shapes=[
                pltpu.VMEM((groups, 1), jnp.float32),  # running max
                pltpu.VMEM((groups, 1), jnp.float32),  # running sum
                pltpu.VMEM((groups, e), jnp.float32),  # running output
            ],
        ),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        out_shape=jax.ShapeDtypeStruct(q_bkge.shape, q_bkge.dtype),
        cost_estimate=cost(b, h, kv_heads, pages_per_slot * page_size, e, q_bhe.dtype.itemsize),
        name="paged_attention_int8",
    )(*args)
    args = (
        lengths_b.astype(jnp.int32),
        table_bp.reshape(-1).astype(jnp.int32),
        q_bkge,
        k_pages,
        k_rows,
        v_pages,
        v_rows,
    )
    if interpret:
        with pltpu.force_tpu_interpret_mode():
            return call(*args).reshape(b, h, e)
    return call(*args).reshape(b, h, e)
