"""jax's paged-attention kernel body at a head_dim narrower than a lane tile (64: Qwen2.5-0.5B / 1.5B).

jax's wrapper (``paged_attention``) gives the kernel's running max and sum outputs ``[..., 1]`` arrays under
the query's block ``(..., head_dim)``: at head_dim 128 the block is lane-aligned and the compiler takes it; at
64 it is neither a multiple of 128 nor the array's last dimension, and lowering refuses it. Here the same kernel
body (``paged_flash_attention_kernel_inline_seq_dim``) is called with those two outputs as wide as the head,
so every block equals its array's last dimension; the pool is read in place, unpadded. Only the unquantized,
single-core case (no megacore split, no logit soft cap): what the engine's decode uses.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

# Head dims this wrapper serves (compiled for TPU by tests/kernels/test_tpu_kernels.py); wider heads take jax's.
HEAD_DIMS = (64,)


def narrow_paged_decode(q_bhe, k_pages, v_pages, lengths_b, table_bp, *, pages_per_compute_block: int) -> jax.Array:
    """``[B, H, E]`` attention of ``q_bhe`` (already scaled) over the first ``lengths_b[b]`` positions of the pages
    ``table_bp[b]`` of ``k_pages`` / ``v_pages`` ``[K, pages, page_size, E]``, as jax's ``paged_attention``
    computes it, for ``E`` in ``HEAD_DIMS``. Runs in interpret mode where ``pltpu.force_tpu_interpret_mode`` is
    active."""
    from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention_kernel as body  # TPU, lazy

    b, h, e = q_bhe.shape
    kv_heads, _, page_size, _ = k_pages.shape
    groups = h // kv_heads
    if groups % 8:  # as jax's wrapper: a [groups, 1, E] float32 query block keeps a <1x128> layout
        q = q_bhe.reshape(b, h, 1, e).astype(jnp.float32)
        spec = pl.BlockSpec((None, groups, None, e), lambda _core, i, k, *_: (i, k, 0, 0))
    else:
        q = q_bhe
        spec = pl.BlockSpec((None, groups, e), lambda _core, i, k, *_: (i, k, 0))
    kernel = functools.partial(
        body.paged_flash_attention_kernel_inline_seq_dim,
        pages_per_sequence=table_bp.shape[1],
        batch_size=b,
        pages_per_compute_block=pages_per_compute_block,
        mask_value=body.DEFAULT_MASK_VALUE,
        attn_logits_soft_cap=None,
        megacore_mode=None,
    )
    buffer = lambda dtype: pltpu.VMEM((2, pages_per_compute_block, page_size, e), dtype)  # double-buffered pages
    hbm = pl.BlockSpec(memory_space=pl.ANY)
    semaphores = [pltpu.SemaphoreType.DMA((2,))] * 2  # the key and the value page copies
    out, _, _ = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4,  # lengths, page table, buffer index, init flag
            in_specs=[spec, hbm, None, hbm, None],
            out_specs=[spec, spec, spec],
            grid=(1, b, kv_heads),
            scratch_shapes=(buffer(k_pages.dtype), None, buffer(v_pages.dtype), None, *semaphores),
        ),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary", "arbitrary")),
        # The running max and sum as wide as the head (jax's wrapper: [..., 1]), so their block is the array's.
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype)] + [jax.ShapeDtypeStruct(q.shape, jnp.float32)] * 2,
    )(
        lengths_b,
        table_bp.reshape(-1),
        jnp.zeros((1,), jnp.int32),
        jnp.ones((1,), jnp.int32),
        q,
        k_pages,
        None,
        v_pages,
        None,
    )
    return out.reshape(b, h, e).astype(q_bhe.dtype)
