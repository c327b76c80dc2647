"""jax's paged attention (Pallas TPU) for single-token decoding: one shard's call, its block rules, its cost.

Why that kernel (``jax.experimental.pallas.ops.tpu.paged_attention``) and not the ragged paged attention jax
also ships: ours reads pages laid out ``[kv_heads, pages, page_size, head_dim]``, the engine pool's own layout
(``trace_jax.rollout.engine.pages.PagedKVCache``), and decoding runs one query per slot, its case. The ragged
kernel wants keys and values interleaved in one ``[pages, page_size, 2 * kv_heads, head_dim]`` pool, a relayout
of every program that touches the pool (append, fork), for mixed prefill + decode batches ``generate`` does
not have.

Block rules (``problems`` names each value that breaks one): ``head_dim`` a multiple of 128 (the kernel's
(8, 128) block rule) or 64 (``paged_attention_narrow``: the same kernel body, unpadded), pages of a multiple of
8 positions (the sublane tile), values in ``DTYPES``, and the page table's width a multiple of the pages one
kernel step reads (``pages_per_compute_block``).

Numerics: the kernel loads key / value pages into VMEM and casts them to bf16 before its dot products
(``MultiPageAsyncCopyDescriptor._maybe_dequantize`` defaults to bf16), so a float32 cache matches the float32
reference only to bf16 rounding (tests/rollout/test_decode_kernel.py). An int8 cache takes its own kernel
(``paged_attention_int8``), not this kernel's int8 mode (``QuantizedTensor``), whose wrapper broadcasts the
scales head_dim wide before the call: an operand the size of the pool in float32.

The engine runs it in ``jax.shard_map`` (Mosaic kernels cannot be partitioned by XLA) and chooses it by the
platform of its mesh's devices (``trace_jax.rollout.engine.pages.choose_decode_kernel``).
"""

from __future__ import annotations

import jax
import numpy as np
from jax.experimental import pallas as pl

from trace_jax.kernels import paged_attention_narrow as narrow

# Page-table columns one kernel step reads (a divisor of the table's width), the largest of these that divides.
PAGES_PER_COMPUTE_BLOCK = (8, 4, 2, 1)
# Value dtypes the kernel reads (it loads pages into VMEM and computes in bf16 / f32).
DTYPES = ("bfloat16", "float32")


def pages_per_compute_block(pages_per_slot: int) -> int:
    """The pages one kernel step reads: the largest of ``PAGES_PER_COMPUTE_BLOCK`` dividing the table's width."""
    return max(d for d in PAGES_PER_COMPUTE_BLOCK if pages_per_slot % d == 0)


def problems(head_dim: int, dtype: str, page_size: int) -> list[str]:
    """The block rules that ``head_dim``, the cache ``dtype`` (a name) and ``page_size`` break, each naming the
    value; empty where the kernel applies."""
    found = []
    if head_dim % 128 and head_dim not in narrow.HEAD_DIMS:
        found.append(
            f"head_dim={head_dim} is neither a multiple of 128 (the kernel's (8, 128) block rule) nor one of "
            f"{narrow.HEAD_DIMS} (paged_attention_narrow)"
        )
    if dtype not in DTYPES:
        found.append(f"cache dtype {dtype} is not one of {DTYPES}")
    if page_size % 8:
        found.append(f"page_size={page_size} is not a multiple of 8 (the kernel's sublane tile)")
    return found


def cost(b: int, h: int, kv: int, s: int, e: int, itemsize: int) -> pl.CostEstimate:
    """What one decode step of ``b`` slots costs at most (every slot at ``s`` positions): per query head two
    ``s x e`` dot products and ``s`` exponentials; every slot's keys and values read once per KV head."""
    return pl.CostEstimate(
        flops=b * h * 2 * 2 * s * e,
        transcendentals=b * h * s,
        bytes_accessed=b * kv * 2 * s * e * itemsize + 2 * b * h * e * itemsize,
    )


def paged_decode(
    q_bhe, k_pages, v_pages, lengths_b, table_bp, *, pages_per_compute_block: int, interpret: bool = False
) -> jax.Array:
    """One shard's decode attention, ``[B, H, E]`` in the kernel's output dtype: query ``b`` (not yet scaled)
    over the first ``lengths_b[b]`` positions of its pages ``table_bp[b]`` in ``k_pages`` / ``v_pages``
    ``[K, pages, page_size, E]`` (read in place). ``interpret`` runs it in Pallas TPU interpret mode."""
    from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention  # TPU kernel, lazy import

    scale = 1.0 / float(np.sqrt(q_bhe.shape[-1]))
    wrapper = paged_attention if q_bhe.shape[-1] % 128 == 0 else narrow.narrow_paged_decode
    call = lambda: wrapper(
        (q_bhe * scale).astype(q_bhe.dtype),
        k_pages,
        v_pages,
        lengths_b,
        table_bp,
        pages_per_compute_block=pages_per_compute_block,
    )
    if not interpret:
        return call()
    from jax.experimental.pallas import tpu as pltpu  # interpret mode (tests on CPU) only

    with pltpu.force_tpu_interpret_mode():
        return call()
