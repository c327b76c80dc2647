"""Flash attention under the tree mask of packed training rows: a Pallas TPU kernel (forward and backward).

The trainer's rows (``trace_jax.rl.packing``) hold several trees each, nodes in depth-first pre-order, and a
token sees exactly its ancestors: key ``s`` is visible to query ``t`` iff ``s <= t < kv_end[s]``
(``kv_end[s]`` = the end of ``s``'s subtree; see ``trace_jax.models.attention``). That mask is data, per row,
so splash attention's static masks cannot hold it and its segment ids cannot either (a token must see its
ancestors, which lie in other "segments" than its siblings'). This kernel is a flash attention whose mask is
computed per (query block, key block) tile from the block's ``kv_end`` slice and two iotas: scores live in
VMEM one ``[block_q, block_k]`` tile at a time and never reach HBM, forward or backward. A tile is computed
only if it holds a visible pair (``_live``: causal, and the key tile's largest ``kv_end``, scalar-prefetched,
passes the query tile's first row), so a row of many trees costs about its trees' own tiles; a partly hidden
tile is computed whole, and a skipped tile's keys / values are still fetched unless causality skips it.

What goes to HBM per call: the output and its log-sum-exp ``[B, H, T, 128]`` float32 (128 lanes of the same
value, the TPU-friendly layout splash uses too), saved for the backward pass; the backward writes dq and,
per query head, dk / dv (summed over the GQA group outside the kernel, ``g`` x the key/value size in float32).

Layouts: q ``[B, H, T, E]`` (already scaled by 1/sqrt(E)), k / v ``[B, K, S, E]`` with ``H = K * g``, ``kv_end``
int32 ``[B, S]``; T and S multiples of ``BLOCK``. Queries are rows ``0..T-1`` in key order (``in_order``).
``interpret=True`` runs the same kernels in Pallas TPU interpret mode (any backend; the CPU tests).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

BLOCK = 128  # query and key rows per tile
LANES = 128  # the log-sum-exp is stored broadcast over one vreg's lanes
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def _tile_mask(end_1k, i, j, block_q, block_k):
    """bool [block_q, block_k]: key ``j * block_k + c`` visible to query ``i * block_q + r``."""
    q_idx = i * block_q + jax.lax.broadcasted_iota(jnp.int32, (block_q, block_k), 0)
    k_idx = j * block_k + jax.lax.broadcasted_iota(jnp.int32, (block_q, block_k), 1)
    return (k_idx <= q_idx) & (q_idx < end_1k)


def _dot(a, b, contract_a, contract_b):
    return jax.lax.dot_general(a, b, (((contract_a,), (contract_b,)), ((), ())), preferred_element_type=jnp.float32)


def _live(tile_end_ref, i, j, block_q, block_k):
    """Whether tile (query block i, key block j) holds a visible pair: a key at or before the tile's last query
    (causal) and a key whose ``kv_end`` passes the tile's first query. Exact, since ``kv_end[s] > s``."""

    b = pl.program_id(0)
    return (j * block_k <= i * block_q + block_q - 1) & (tile_end_ref[b, j] > i * block_q)


def _forward_kernel(
    tile_end_ref, end_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, m_sc, l_sc, acc_sc, *, block_q, block_k
):

    i, j = pl.program_id(2), pl.program_id(3)

    @pl.when(j == 0)
    def _init():
        m_sc[...] = jnp.full(m_sc.shape, MASK_VALUE, jnp.float32)
        l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

    @pl.when(_live(tile_end_ref, i, j, block_q, block_k))
    def _tile():
        visible = _tile_mask(end_ref[...], i, j, block_q, block_k)
        s = jnp.where(visible, _dot(q_ref[...], k_ref[...], 1, 1), MASK_VALUE)
        m_prev = m_sc[...][:, :1]
        m_new = jnp.maximum(m_prev, s.max(axis=-1, keepdims=True))
        p = jnp.where(visible, jnp.exp(s - m_new), 0.0)
        alpha = jnp.exp(m_prev - m_new)
        l_sc[...] = jnp.broadcast_to(alpha * l_sc[...][:, :1] + p.sum(axis=-1, keepdims=True), l_sc.shape)
        m_sc[...] = jnp.broadcast_to(m_new, m_sc.shape)
        acc_sc[...] = alpha * acc_sc[...] + _dot(p.astype(v_ref.dtype), v_ref[...], 1, 0)

    @pl.when(j == pl.num_programs(3) - 1)
    def _finish():
        total = l_sc[...][:, :1]
        o_ref[...] = (acc_sc[...] / total).astype(o_ref.dtype)
        lse_ref[...] = jnp.broadcast_to(m_sc[...][:, :1] + jnp.log(total), lse_ref.shape)


def _dq_kernel(tile_end_ref, end_ref, q_ref, k_ref, v_ref, o_ref, do_ref, lse_ref, dq_ref, dq_sc, *, block_q, block_k):

    i, j = pl.program_id(2), pl.program_id(3)

    @pl.when(j == 0)
    def _init():
        dq_sc[...] = jnp.zeros(dq_sc.shape, jnp.float32)

    @pl.when(_live(tile_end_ref, i, j, block_q, block_k))
    def _tile():
        visible = _tile_mask(end_ref[...], i, j, block_q, block_k)
        s = _dot(q_ref[...], k_ref[...], 1, 1)
        p = jnp.where(visible, jnp.exp(s - lse_ref[...][:, :1]), 0.0)
        do = do_ref[...]
        di = jnp.sum(do.astype(jnp.float32) * o_ref[...].astype(jnp.float32), axis=-1, keepdims=True)
        ds = p * (_dot(do, v_ref[...], 1, 1) - di)
        dq_sc[...] += _dot(ds.astype(k_ref.dtype), k_ref[...], 1, 0)

    @pl.when(j == pl.num_programs(3) - 1)
    def _finish():
        dq_ref[...] = dq_sc[...].astype(dq_ref.dtype)


def _dkv_kernel(
    tile_end_ref, end_ref, q_ref, k_ref, v_ref, o_ref, do_ref, lse_ref, dk_ref, dv_ref, dk_sc, dv_sc, **blocks
):
    block_q, block_k = blocks["block_q"], blocks["block_k"]

    j, i = pl.program_id(2), pl.program_id(3)  # key block j, query block i (the reduction)

    @pl.when(i == 0)
    def _init():
        dk_sc[...] = jnp.zeros(dk_sc.shape, jnp.float32)
        dv_sc[...] = jnp.zeros(dv_sc.shape, jnp.float32)

    @pl.when(_live(tile_end_ref, i, j, block_q, block_k))
    def _tile():
        visible = _tile_mask(end_ref[...], i, j, block_q, block_k)
        q, do = q_ref[...], do_ref[...]
        s = _dot(q, k_ref[...], 1, 1)
        p = jnp.where(visible, jnp.exp(s - lse_ref[...][:, :1]), 0.0)
        di = jnp.sum(do.astype(jnp.float32) * o_ref[...].astype(jnp.float32), axis=-1, keepdims=True)
        ds = p * (_dot(do, v_ref[...], 1, 1) - di)
        dv_sc[...] += _dot(p.astype(do.dtype), do, 0, 0)
        dk_sc[...] += _dot(ds.astype(q.dtype), q, 0, 0)

    @pl.when(i == pl.num_programs(3) - 1)
    def _finish():
        dk_ref[...] = dk_sc[...].astype(dk_ref.dtype)
        dv_ref[...] = dv_sc[...].astype(dv_ref.dtype)


def _tile_ends(end_b1s):
    """int32 [B, S / BLOCK]: the largest ``kv_end`` of each key tile (scalar-prefetched: which tiles to skip)."""
    b, _, s = end_b1s.shape
    return end_b1s.reshape(b, s // BLOCK, BLOCK).max(axis=-1)


def _specs(b, h, kv, t, s, e):
    """BlockSpecs of the forward / dq grids (b, h, query block i, key block j): key tiles past a query block's
    last row are clamped to its last visible one (skipped by the kernel; no new copy is fetched)."""

    g = h // kv
    last = lambda i: (i * BLOCK + BLOCK - 1) // BLOCK
    clamp = lambda i, j: jnp.minimum(j, last(i))
    q = pl.BlockSpec((None, None, BLOCK, e), lambda b_, h_, i, j, _: (b_, h_, i, 0))
    kv_spec = pl.BlockSpec((None, None, BLOCK, e), lambda b_, h_, i, j, _: (b_, h_ // g, clamp(i, j), 0))
    end = pl.BlockSpec((None, 1, BLOCK), lambda b_, h_, i, j, _: (b_, 0, clamp(i, j)))
    row = pl.BlockSpec((None, None, BLOCK, LANES), lambda b_, h_, i, j, _: (b_, h_, i, 0))
    return q, kv_spec, end, row


_MATMULS = {"forward": 2, "dq": 3, "dkv": 4}  # [BLOCK, BLOCK] x E matmuls a computed tile


def _causal_tiles(t: int, s: int) -> int:
    """Tiles (query block, key block) the causal mask leaves live: the most any tree mask computes."""
    return sum(min(i + 1, s // BLOCK) for i in range(t // BLOCK))


def _bytes(kind: str, t: int, s: int, e: int, itemsize: int) -> int:
    """HBM bytes of one (row, head) of kernel ``kind``: a block whose index does not change along the inner
    grid axis is fetched once per outer block (the pipeline keeps it), a streamed one once per live tile."""
    block, lse = BLOCK * e * itemsize, BLOCK * LANES * 4
    live, n_q, n_k = _causal_tiles(t, s), t // BLOCK, s // BLOCK
    if kind == "forward":  # streams k, v; keeps q; writes o and the log-sum-exp
        return live * 2 * block + n_q * (2 * block + lse)
    if kind == "dq":  # streams k, v; keeps q, o, do, lse; writes dq
        return live * 2 * block + n_q * (4 * block + lse)
    # dkv: streams q, o, do, lse; keeps k, v; writes dk and dv per query head in float32
    return live * (3 * block + lse) + n_k * (2 * block + 2 * BLOCK * e * 4)


def cost(kind: str, b: int, h: int, t: int, s: int, e: int, itemsize: int) -> pl.CostEstimate:
    """What one call of kernel ``kind`` costs at most: every causally live tile computed (a tree mask skips
    more). Handed to the compiler with the kernel, so the compiled program states its FLOPs and bytes
    (``trace_jax.plan.hlo`` reads them)."""
    tiles = b * h * _causal_tiles(t, s)
    return pl.CostEstimate(
        flops=tiles * _MATMULS[kind] * 2 * BLOCK * BLOCK * e,
        transcendentals=tiles * BLOCK * BLOCK,
        bytes_accessed=b * h * _bytes(kind, t, s, e, itemsize),
    )


def _call(kernel, grid, in_specs, out_specs, out_shape, scratch, interpret, estimate):

    return pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=grid, in_specs=in_specs, out_specs=out_specs, scratch_shapes=scratch
        ),
        out_shape=out_shape,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
        interpret=interpret,
        cost_estimate=estimate,
    )


def _forward(q, k, v, end_b1s, interpret):

    b, h, t, e = q.shape
    kv, s = k.shape[1], k.shape[2]
    q_spec, kv_spec, end_spec, row_spec = _specs(b, h, kv, t, s, e)
    out_shape = (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((b, h, t, LANES), jnp.float32))
    scratch = [pltpu.VMEM((BLOCK, LANES), jnp.float32)] * 2 + [pltpu.VMEM((BLOCK, e), jnp.float32)]
    kernel = functools.partial(_forward_kernel, block_q=BLOCK, block_k=BLOCK)
    grid = (b, h, t // BLOCK, s // BLOCK)
    estimate = cost("forward", b, h, t, s, e, q.dtype.itemsize)
    in_specs = [end_spec, q_spec, kv_spec, kv_spec]
    call = _call(kernel, grid, in_specs, [q_spec, row_spec], out_shape, scratch, interpret, estimate)
    with jax.named_scope("tree_attention_forward"):
        return call(_tile_ends(end_b1s), end_b1s, q, k, v)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _tree_flash(q, k, v, end_b1s, interpret):
    return _forward(q, k, v, end_b1s, interpret)[0]


def _tree_flash_fwd(q, k, v, end_b1s, interpret):
    o, lse = _forward(q, k, v, end_b1s, interpret)
    return o, (q, k, v, end_b1s, o, lse)


def _tree_flash_bwd(interpret, residuals, do):

    q, k, v, end_b1s, o, lse = residuals
    b, h, t, e = q.shape
    kv, s = k.shape[1], k.shape[2]
    g = h // kv
    q_spec, kv_spec, end_spec, row_spec = _specs(b, h, kv, t, s, e)
    dq_kernel = functools.partial(_dq_kernel, block_q=BLOCK, block_k=BLOCK)
    with jax.named_scope("tree_attention_dq"):
        dq = _call(
            dq_kernel, (b, h, t // BLOCK, s // BLOCK), [end_spec, q_spec, kv_spec, kv_spec, q_spec, q_spec, row_spec],
            q_spec, jax.ShapeDtypeStruct(q.shape, q.dtype), [pltpu.VMEM((BLOCK, e), jnp.float32)], interpret,
            cost("dq", b, h, t, s, e, q.dtype.itemsize),
        )(_tile_ends(end_b1s), end_b1s, q, k, v, o, do, lse)  # fmt: skip
    # The dk / dv grid runs over (key block j, query block i): query tiles before a key block's first row are
    # clamped to its first visible one (skipped by the kernel).
    first = lambda j: (j * BLOCK) // BLOCK
    clamp = lambda j, i: jnp.maximum(i, first(j))
    q_t = pl.BlockSpec((None, None, BLOCK, e), lambda b_, h_, j, i, _: (b_, h_, clamp(j, i), 0))
    row_t = pl.BlockSpec((None, None, BLOCK, LANES), lambda b_, h_, j, i, _: (b_, h_, clamp(j, i), 0))
    kv_t = pl.BlockSpec((None, None, BLOCK, e), lambda b_, h_, j, i, _: (b_, h_ // g, j, 0))
    end_t = pl.BlockSpec((None, 1, BLOCK), lambda b_, h_, j, i, _: (b_, 0, j))
    out_t = pl.BlockSpec((None, None, BLOCK, e), lambda b_, h_, j, i, _: (b_, h_, j, 0))
    per_head = jax.ShapeDtypeStruct((b, h, s, e), jnp.float32)
    dkv_kernel = functools.partial(_dkv_kernel, block_q=BLOCK, block_k=BLOCK)
    with jax.named_scope("tree_attention_dkv"):
        dk_h, dv_h = _call(
            dkv_kernel, (b, h, s // BLOCK, t // BLOCK), [end_t, q_t, kv_t, kv_t, q_t, q_t, row_t], [out_t, out_t],
            (per_head, per_head), [pltpu.VMEM((BLOCK, e), jnp.float32)] * 2, interpret,
            cost("dkv", b, h, t, s, e, q.dtype.itemsize),
        )(_tile_ends(end_b1s), end_b1s, q, k, v, o, do, lse)  # fmt: skip
    group = lambda x: x.reshape(b, kv, g, s, e).sum(axis=2).astype(k.dtype)
    return dq, group(dk_h), group(dv_h), None


_tree_flash.defvjp(_tree_flash_fwd, _tree_flash_bwd)


def fits(t: int, s: int) -> bool:
    """The kernel's shape constraint: query and key rows are whole tiles."""
    return t % BLOCK == 0 and s % BLOCK == 0


def tree_flash_attention(q_bthe, k_bske, v_bske, kv_end_bs, *, interpret: bool = False) -> jax.Array:
    """Attention of rows in key order under ``s <= t < kv_end[s]`` (the module docstring), [B, T, H, E] in q's
    dtype; scores and softmax in float32. Differentiable (its own backward kernels)."""
    t, e = q_bthe.shape[1], q_bthe.shape[3]
    if not fits(t, k_bske.shape[1]):
        raise ValueError(f"tree_flash_attention needs rows in whole tiles of {BLOCK}, got T={t}, S={k_bske.shape[1]}")
    q = (q_bthe * (1.0 / float(e) ** 0.5)).astype(q_bthe.dtype).transpose(0, 2, 1, 3)
    k, v = k_bske.transpose(0, 2, 1, 3), v_bske.transpose(0, 2, 1, 3)
    end_b1s = kv_end_bs.astype(jnp.int32)[:, None, :]
    return _tree_flash(q, k, v, end_b1s, interpret).transpose(0, 2, 1, 3)
