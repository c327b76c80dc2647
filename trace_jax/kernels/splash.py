"""jax's splash attention (Pallas TPU) for plain causal training rows: one shard's call, its block rule, its cost.

Block rule: the default ``BlockSizes`` tile queries and keys by ``BLOCK`` rows, so T and S are whole tiles
(``fits``; ``splash_causal`` raises naming the length that breaks it). Run it under a mesh through
``trace_jax.kernels.sharding.under_mesh``.
"""

from __future__ import annotations

import math

import jax
from jax.experimental import pallas as pl

BLOCK = 128  # splash's default query / key block (``BlockSizes.get_default()``)


def fits(t: int, s: int) -> bool:
    """The kernel's shape constraint: query and key rows are whole ``BLOCK``-row tiles."""
    return t % BLOCK == 0 and s % BLOCK == 0


def cost(b: int, h: int, t: int, s: int, e: int, itemsize: int) -> pl.CostEstimate:
    """What one forward call on causal rows costs at most: every causally live tile computed (two
    ``[BLOCK, BLOCK] x E`` matmuls and ``BLOCK * BLOCK`` exponentials each), q read and o written once, k / v
    streamed once per live tile."""
    tiles = b * h * sum(min(i + 1, s // BLOCK) for i in range(t // BLOCK))
    block = BLOCK * e * itemsize
    return pl.CostEstimate(
        flops=tiles * 2 * 2 * BLOCK * BLOCK * e,
        transcendentals=tiles * BLOCK * BLOCK,
        bytes_accessed=tiles * 2 * block + b * h * (t // BLOCK) * 2 * block,
    )


def splash_causal(q_bthe, k_bske, v_bske, kv_end_bs=None, *, interpret: bool = False) -> jax.Array:
    """One shard's plain causal rows through splash attention (MQA form: one kernel per KV head and row),
    [B, T, H, E] in q's dtype. ``kv_end_bs`` must be None (a tree mask is ``tree_attention``'s); it is in the
    signature so ``under_mesh`` calls both kernels alike."""
    from jax.experimental.pallas.ops.tpu import splash_attention as splash  # TPU kernel, lazy import

    assert kv_end_bs is None, "splash attention takes causal rows only"
    b, t, h, e = q_bthe.shape
    if not fits(t, k_bske.shape[1]):
        raise ValueError(f"splash attention needs rows in whole tiles of {BLOCK}, got T={t}, S={k_bske.shape[1]}")
    kv = k_bske.shape[2]
    g = h // kv
    mask = splash.MultiHeadMask([splash.CausalMask((t, k_bske.shape[1]))] * g)
    kernel = splash.make_splash_mqa_single_device(mask=mask, interpret=interpret)
    q_bkgte = (q_bthe / math.sqrt(e)).reshape(b, t, kv, g, e).transpose(0, 2, 3, 1, 4)
    k_bkse, v_bkse = k_bske.transpose(0, 2, 1, 3), v_bske.transpose(0, 2, 1, 3)
    with jax.named_scope("splash_attention"):  # names the kernels in the compiled HLO (trace_jax.plan.hlo)
        out_bkgte = jax.vmap(jax.vmap(kernel))(q_bkgte, k_bkse, v_bkse)
    return out_bkgte.transpose(0, 3, 1, 2, 4).reshape(b, t, h, e).astype(q_bthe.dtype)
