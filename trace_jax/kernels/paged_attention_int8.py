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

Grid ``(slots, KV heads)``; the page table and lengths are scalar-prefetched. Each grid step walks its slot's
pages in blocks of ``pages_per_compute_block`` (only the blocks holding positions below its length), copying
each block's pages and scales from HBM into one of two VMEM buffers while the previous block is computed (the
page-table DMA pattern of jax's paged-attention kernel, without its prefetch across grid steps). Online
softmax in float32 (flash-attention style); the query heads of a KV head (``groups``) share each fetched page.
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


def _kernel(
    lengths_ref, table_ref, q_ref, k_hbm, ks_hbm, v_hbm, vs_hbm, o_ref, k_buf, ks_buf, v_buf, vs_buf, sems,
    *, pages_per_slot: int, block: int,
):  # fmt: skip
    b, h = pl.program_id(0), pl.program_id(1)
    page_size, group = k_buf.shape[2], ks_hbm.shape[2]
    length = lengths_ref[b]
    blocks = pl.cdiv(length, page_size * block)  # page blocks holding the slot's positions

    def copies(i, slot):
        """The DMAs of block ``i``'s pages (values and scales) into buffer ``slot``; past the table's end a block
        re-reads its last page (masked)."""
        out = []
        for p in range(block):
            page = table_ref[b * pages_per_slot + jnp.minimum(i * block + p, pages_per_slot - 1)]
            local = page % (ks_hbm.shape[1] * group)  # the page within the scales' layers (one or all)
            row = (h, local // group, pl.ds(local % group, 1))  # its scales: row local % group of local // group
            out += [
                pltpu.make_async_copy(k_hbm.at[h, page], k_buf.at[slot, p], sems.at[slot, 0]),
                pltpu.make_async_copy(ks_hbm.at[row], ks_buf.at[slot, p], sems.at[slot, 1]),
                pltpu.make_async_copy(v_hbm.at[h, page], v_buf.at[slot, p], sems.at[slot, 2]),
                pltpu.make_async_copy(vs_hbm.at[row], vs_buf.at[slot, p], sems.at[slot, 3]),
            ]
        return out

    @pl.when(blocks > 0)
    def _first():
        for copy in copies(0, 0):
            copy.start()

    q = q_ref[...]  # [G, E], already scaled by 1 / sqrt(E)
    contract_e, contract_z = (((1,), (1,)), ((), ())), (((1,), (0,)), ((), ()))

    def step(i, carry):
        slot = i % 2

        @pl.when(i + 1 < blocks)
        def _prefetch():  # the next block streams in while this one is computed
            for copy in copies(i + 1, 1 - slot):
                copy.start()

        for copy in copies(i, slot):
            copy.wait()
        m, total, acc = carry
        for p in range(block):  # one page at a time: its scales are one [1, page_size] row
            logits = jax.lax.dot_general(
                q, k_buf[slot, p].astype(q.dtype), contract_e, preferred_element_type=jnp.float32
            )
            logits = logits * (ks_buf[slot, p] * (1.0 / QUANT_DIVISOR))  # [G, Z] x [1, Z]: each key's scale
            position = (i * block + p) * page_size + jax.lax.broadcasted_iota(jnp.int32, logits.shape, 1)
            logits = jnp.where(position < length, logits, _MASKED)
            m_new = jnp.maximum(m, jnp.max(logits, axis=1, keepdims=True))
            weights = jnp.exp(logits - m_new)
            alpha = jnp.exp(m - m_new)
            total = alpha * total + jnp.sum(weights, axis=1, keepdims=True)
            weights = (weights * (vs_buf[slot, p] * (1.0 / QUANT_DIVISOR))).astype(q.dtype)  # each value's scale
            values = v_buf[slot, p].astype(q.dtype)
            acc = alpha * acc + jax.lax.dot_general(weights, values, contract_z, preferred_element_type=jnp.float32)
            m = m_new
        return m, total, acc

    groups, e = q.shape
    start = (
        jnp.full((groups, 1), _MASKED, jnp.float32),
        jnp.zeros((groups, 1), jnp.float32),
        jnp.zeros((groups, e), jnp.float32),
    )
    _, total, acc = jax.lax.fori_loop(0, blocks, step, start)
    o_ref[...] = jnp.where(total > 0, acc / jnp.where(total > 0, total, 1.0), 0.0).astype(o_ref.dtype)


def scale_groups(scales):
    """A scale pool ``[K, layers, pages, page_size]`` as ``[K, layers * pages / g, g, page_size]``, g the largest
    of 8, 4, 2, 1 dividing ``pages``: on TPU the pool's two minor axes are tiled (8 rows of pages x the lanes),
    so merging ``layers`` and ``pages`` outright would relayout (copy) the pool at every layer and step, while
    groups of 8 pages are whole tiles and the view is a bitcast. Value page ``p`` (layer-major, ``layer * pages
    + page``) has its scales at ``[:, p // g, p % g]``."""
    kv_heads, layers, pages, page_size = scales.shape
    group = next(g for g in (8, 4, 2, 1) if pages % g == 0)
    return scales.reshape(kv_heads, layers * pages // group, group, page_size)


def paged_decode_int8(
    q_bhe, k_pages, k_scales, v_pages, v_scales, lengths_b, table_bp, *, pages_per_compute_block: int = 1,
    interpret: bool = False,
) -> jax.Array:  # fmt: skip
    """One shard's decode attention ``[B, H, E]`` in the query's dtype: query ``b`` (not yet scaled) over the
    first ``lengths_b[b]`` positions of its pages ``table_bp[b]`` in the int8 ``k_pages`` / ``v_pages``
    ``[K, n, page_size, E]`` with float32 ``k_scales`` / ``v_scales`` ``[K, n / g, g, page_size]`` (value page
    ``p``'s scales at ``[:, p // g, p % g]``; ``scale_groups`` gives that view of ``[K, layers, pages,
    page_size]`` without a copy; both read in place), ``pages_per_compute_block`` pages a DMA block.
    ``interpret`` runs it in Pallas TPU interpret mode."""
    b, h, e = q_bhe.shape
    kv_heads, _, page_size, _ = k_pages.shape
    groups, block = h // kv_heads, pages_per_compute_block
    pages_per_slot = table_bp.shape[1]
    q_bkge = (q_bhe * (1.0 / float(e) ** 0.5)).astype(q_bhe.dtype).reshape(b, kv_heads, groups, e)
    heads = pl.BlockSpec((None, None, groups, e), lambda i, k, *_: (i, k, 0, 0))
    hbm = pl.BlockSpec(memory_space=pl.ANY)
    buffers = [
        pltpu.VMEM((2, block, page_size, e), k_pages.dtype),  # keys, double-buffered blocks of pages
        pltpu.VMEM((2, block, 1, page_size), jnp.float32),  # their scales
        pltpu.VMEM((2, block, page_size, e), v_pages.dtype),
        pltpu.VMEM((2, block, 1, page_size), jnp.float32),
        pltpu.SemaphoreType.DMA((2, 4)),  # per buffer: keys, key scales, values, value scales
    ]
    call = lambda *args: pl.pallas_call(
        functools.partial(_kernel, pages_per_slot=pages_per_slot, block=block),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,  # lengths, page table (flat)
            grid=(b, kv_heads),
            in_specs=[heads, hbm, hbm, hbm, hbm],
            out_specs=heads,
            scratch_shapes=buffers,
        ),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        out_shape=jax.ShapeDtypeStruct(q_bkge.shape, q_bkge.dtype),
        cost_estimate=cost(b, h, kv_heads, pages_per_slot * page_size, e, q_bhe.dtype.itemsize),
        name="paged_attention_int8",
    )(*args)
    args = (
        lengths_b.astype(jnp.int32),
        table_bp.reshape(-1).astype(jnp.int32),
        q_bkge,
        k_pages,
        k_scales,
        v_pages,
        v_scales,
    )
    if interpret:
        with pltpu.force_tpu_interpret_mode():
            return call(*args).reshape(b, h, e)
    return call(*args).reshape(b, h, e)
