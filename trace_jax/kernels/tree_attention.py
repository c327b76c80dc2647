"""Flash attention under the tree mask of packed training rows: a Pallas TPU kernel (forward and backward).

The trainer's rows (``trace_jax.rl.packing``) hold several trees each, nodes in depth-first pre-order, and a
token sees exactly its ancestors: key ``s`` is visible to query ``t`` iff ``s <= t < kv_end[s]``
(``kv_end[s]`` = the end of ``s``'s subtree; see ``trace_jax.models.attention``). That mask is data, per row,
so splash attention's static masks cannot hold it and its segment ids cannot either (a token must see its
ancestors, which lie in other "segments" than its siblings'). This kernel is a flash attention whose mask is
computed per (query block, key block) tile from the block's ``kv_end`` slice and two iotas: scores live in
VMEM one tile at a time and never reach HBM, forward or backward. A tile is computed only if it holds a visible
pair (causal, and the key tile's largest ``kv_end`` passes the query tile's first row), so a row of many trees
costs about its trees' own tiles; a partly hidden tile is computed whole. Which tiles are live is a
scalar-prefetched fetch table (``fetch_table``): a skipped tile names the block already resident, so the
pipeline fetches no keys / values (dk / dv: no queries) for it.

Tiles are per chip (``BLOCK_TABLE``, ``choose_blocks``): a large resident block (queries in the forward and
dq kernels, keys / values in dk / dv) against 128 streamed rows, so each streamed byte feeds enough FLOPs to
pass the chip's ridge; the table is read for the chip the program is compiled for (the abstract mesh's
devices).

What goes to HBM per call: the output and its log-sum-exp ``[B, H, T, 128]`` float32 (128 lanes of the same
value, the TPU-friendly layout splash uses too), saved for the backward pass; the backward writes dq and,
per query head, dk / dv (summed over the GQA group outside the kernel, ``g`` x the key/value size in float32).

Layouts: q ``[B, H, T, E]`` (already scaled by 1/sqrt(E)), k / v ``[B, K, S, E]`` with ``H = K * g``, ``kv_end``
int32 ``[B, S]``; T and S multiples of the blocks, E a multiple of 128 (``tree_flash_attention`` pads). Queries
are rows ``0..T-1`` in key order (``in_order``).
``interpret=True`` runs the same kernels in Pallas TPU interpret mode (any backend; the CPU tests).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

BLOCK = 128  # the tile granule: rows are whole multiples of it, every block is one
LANES = 128  # the log-sum-exp is stored broadcast over one vreg's lanes
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


@dataclasses.dataclass(frozen=True)
class Blocks:
    """A grid's tile: ``resident`` rows stay in VMEM along the reduction (queries in the forward and dq
    kernels, keys / values in the dk / dv kernel), ``streamed`` rows are fetched at each reduction step. Each
    streamed byte feeds ``resident`` rows of FLOPs, so ``resident`` above the chip's ridge (peak FLOP/s over
    HBM bytes/s) makes the kernel compute-bound; both are multiples of ``BLOCK``."""

    resident: int
    streamed: int


# The tuning table: (chip generation, head_dim) -> blocks. The resident block is a power-of-two multiple of 128
# past the chip's ridge (bf16 FLOP/s over HBM bytes/s, ``trace_jax.plan.timing.CHIPS``: v5e ~240, v5p ~166,
# v6e ~560) with room to spare, within VMEM at these head dims. Unlisted chips (and CPU interpret mode) take
# ``DEFAULT_BLOCKS``.
BLOCK_TABLE: dict[tuple[str, int], Blocks] = {
    ("v5e", 128): Blocks(512, 128),
    ("v5e", 256): Blocks(512, 128),
    ("v5p", 128): Blocks(512, 128),
    ("v5p", 256): Blocks(512, 128),
    ("v6e", 128): Blocks(1024, 128),
    ("v6e", 256): Blocks(1024, 128),
}
DEFAULT_BLOCKS = Blocks(BLOCK, BLOCK)
# ``device_kind`` of a TPU device -> its generation's name in ``BLOCK_TABLE``.
GENERATIONS = {"TPU v5 lite": "v5e", "TPU v5e": "v5e", "TPU v5": "v5p", "TPU v5p": "v5p", "TPU v6 lite": "v6e"}


def generation() -> str | None:
    """The chip generation the program being traced is compiled for (the abstract mesh's devices), or None."""
    mesh = jax.sharding.get_abstract_mesh()
    device = None if mesh.empty else getattr(mesh, "abstract_device", None)
    return None if device is None else GENERATIONS.get(getattr(device, "device_kind", None))


def choose_blocks(chip: str | None, head_dim: int, t: int, s: int) -> Blocks:
    """The table's blocks for ``chip`` and ``head_dim``, each halved until it divides the rows (``t`` queries,
    ``s`` keys; both whole ``BLOCK`` tiles)."""
    wanted = BLOCK_TABLE.get((chip, head_dim), DEFAULT_BLOCKS)
    fit = lambda size: next(b for b in (size >> k for k in range(8)) if t % b == 0 and s % b == 0)
    return Blocks(fit(wanted.resident), fit(wanted.streamed))


def _tile_mask(end_1k, i, j, block_q, block_k):
    """bool [block_q, block_k]: key ``j * block_k + c`` visible to query ``i * block_q + r``."""
    q_idx = i * block_q + jax.lax.broadcasted_iota(jnp.int32, (block_q, block_k), 0)
    k_idx = j * block_k + jax.lax.broadcasted_iota(jnp.int32, (block_q, block_k), 1)
    return (k_idx <= q_idx) & (q_idx < end_1k)


def _dot(a, b, contract_a, contract_b):
    return jax.lax.dot_general(a, b, (((contract_a,), (contract_b,)), ((), ())), preferred_element_type=jnp.float32)


def _live(fetch_ref, outer, inner):
    """Whether the tile at grid position (outer, inner) is computed: the fetch table names its own block."""
    return fetch_ref[pl.program_id(0), outer, inner] == inner


def fetch_table(end_bs, t: int, block_q: int, block_k: int, keys_outer: bool) -> jax.Array:
    """int32 [B, outer blocks, inner blocks]: the streamed block each grid step fetches, for ``t`` query rows
    and the keys' ``kv_end`` ``end_bs``. A live tile (a key at or before its last query, causal, and a key
    whose ``kv_end`` passes its first query) fetches its own block; a tile the mask skips names the last live
    block before it (or the first live one), already resident, so the pipeline fetches nothing for it. Every
    outer block has a live tile (a query sees its own key), so ``table[b, o, n] == n`` exactly where tile
    (o, n) is computed. ``keys_outer``: the dk / dv grid (key blocks outer); else the forward / dq grid."""
    b, s = end_bs.shape
    tile_end = end_bs.reshape(b, s // block_k, block_k).max(axis=-1)[:, None, :]  # [B, 1, key blocks]
    qi, kj = jnp.arange(t // block_q)[:, None], jnp.arange(s // block_k)[None, :]
    live = (kj * block_k <= qi * block_q + block_q - 1)[None] & (tile_end > qi * block_q)  # [B, q blocks, k blocks]
    if keys_outer:
        live = live.transpose(0, 2, 1)
    inner = jnp.arange(live.shape[2])
    last = jax.lax.cummax(jnp.where(live, inner, -1), axis=2)
    first = jnp.argmax(live, axis=2)[..., None]
    return jnp.where(last >= 0, last, first).astype(jnp.int32)


def _forward_kernel(fetch_ref, end_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, m_sc, l_sc, acc_sc, *, block_q, block_k):

    i, j = pl.program_id(2), pl.program_id(3)

    @pl.when(j == 0)
    def _init():
        m_sc[...] = jnp.full(m_sc.shape, MASK_VALUE, jnp.float32)
        l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

    @pl.when(_live(fetch_ref, i, j))
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


def _dq_kernel(fetch_ref, end_ref, q_ref, k_ref, v_ref, o_ref, do_ref, lse_ref, dq_ref, dq_sc, *, block_q, block_k):

    i, j = pl.program_id(2), pl.program_id(3)

    @pl.when(j == 0)
    def _init():
        dq_sc[...] = jnp.zeros(dq_sc.shape, jnp.float32)

    @pl.when(_live(fetch_ref, i, j))
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
    fetch_ref, end_ref, q_ref, k_ref, v_ref, o_ref, do_ref, lse_ref, dk_ref, dv_ref, dk_sc, dv_sc, **blocks
):
    block_q, block_k = blocks["block_q"], blocks["block_k"]

    j, i = pl.program_id(2), pl.program_id(3)  # key block j, query block i (the reduction)

    @pl.when(i == 0)
    def _init():
        dk_sc[...] = jnp.zeros(dk_sc.shape, jnp.float32)
        dv_sc[...] = jnp.zeros(dv_sc.shape, jnp.float32)

    @pl.when(_live(fetch_ref, j, i))
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


def _query_grid_specs(g, e, blocks: Blocks):
    """BlockSpecs of the forward / dq grids (b, h, query block i, key block j): query blocks resident, key /
    value blocks fetched through the fetch table (a skipped tile re-uses the resident block)."""
    r, c = blocks.resident, blocks.streamed
    q = pl.BlockSpec((None, None, r, e), lambda b_, h_, i, j, _: (b_, h_, i, 0))
    kv = pl.BlockSpec((None, None, c, e), lambda b_, h_, i, j, f: (b_, h_ // g, f[b_, i, j], 0))
    end = pl.BlockSpec((None, 1, c), lambda b_, h_, i, j, f: (b_, 0, f[b_, i, j]))
    row = pl.BlockSpec((None, None, r, LANES), lambda b_, h_, i, j, _: (b_, h_, i, 0))
    return q, kv, end, row


_MATMULS = {"forward": 2, "dq": 3, "dkv": 4}  # [resident, streamed] x E matmuls a computed tile


def _causal_tiles(kind: str, t: int, s: int, blocks: Blocks) -> int:
    """Tiles (outer block, inner block) the causal mask leaves live on ``kind``'s grid: the most any tree mask
    computes."""
    r, c = blocks.resident, blocks.streamed
    if kind == "dkv":  # key block j (r rows) outer: query blocks i (c rows) with a query at or after its first key
        return sum(t // c - (j * r) // c for j in range(s // r))
    return sum(min((i * r + r - 1) // c + 1, s // c) for i in range(t // r))


def _bytes(kind: str, t: int, s: int, e: int, itemsize: int, blocks: Blocks) -> int:
    """HBM bytes of one (row, head) of kernel ``kind``: a block whose index does not change along the inner
    grid axis is fetched once per outer block (the pipeline keeps it), a streamed one once per live tile."""
    r, c = blocks.resident, blocks.streamed
    live = _causal_tiles(kind, t, s, blocks)
    if kind == "forward":  # streams k, v; keeps q; writes o and the log-sum-exp
        return live * 2 * c * e * itemsize + (t // r) * (2 * r * e * itemsize + r * LANES * 4)
    if kind == "dq":  # streams k, v; keeps q, o, do, lse; writes dq
        return live * 2 * c * e * itemsize + (t // r) * (4 * r * e * itemsize + r * LANES * 4)
    # dkv: streams q, o, do, lse; keeps k, v; writes dk and dv per query head in float32
    return live * (3 * c * e * itemsize + c * LANES * 4) + (s // r) * (2 * r * e * itemsize + 2 * r * e * 4)


def cost(kind: str, b: int, h: int, t: int, s: int, e: int, itemsize: int, blocks: Blocks = DEFAULT_BLOCKS):
    """What one call of kernel ``kind`` with ``blocks`` costs at most (a ``pl.CostEstimate``): every causally
    live tile computed (a tree mask skips more, and fetches nothing for what it skips). Handed to the compiler
    with the kernel, so the compiled program states its FLOPs and bytes (``trace_jax.plan.hlo`` reads them)."""
    tiles = b * h * _causal_tiles(kind, t, s, blocks)
    area = blocks.resident * blocks.streamed
    return pl.CostEstimate(
        flops=tiles * _MATMULS[kind] * 2 * area * e,
        transcendentals=tiles * area,
        bytes_accessed=b * h * _bytes(kind, t, s, e, itemsize, blocks),
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


def _forward(q, k, v, end_b1s, interpret, blocks):

    b, h, t, e = q.shape
    kv, s = k.shape[1], k.shape[2]
    r, c = blocks.resident, blocks.streamed
    q_spec, kv_spec, end_spec, row_spec = _query_grid_specs(h // kv, e, blocks)
    out_shape = (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((b, h, t, LANES), jnp.float32))
    scratch = [pltpu.VMEM((r, LANES), jnp.float32)] * 2 + [pltpu.VMEM((r, e), jnp.float32)]
    kernel = functools.partial(_forward_kernel, block_q=r, block_k=c)
    grid = (b, h, t // r, s // c)
    estimate = cost("forward", b, h, t, s, e, q.dtype.itemsize, blocks)
    in_specs = [end_spec, q_spec, kv_spec, kv_spec]
    call = _call(kernel, grid, in_specs, [q_spec, row_spec], out_shape, scratch, interpret, estimate)
    with jax.named_scope("tree_attention_forward"):
        return call(fetch_table(end_b1s[:, 0], t, r, c, False), end_b1s, q, k, v)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _tree_flash(q, k, v, end_b1s, interpret, blocks):
    return _forward(q, k, v, end_b1s, interpret, blocks)[0]


def _tree_flash_fwd(q, k, v, end_b1s, interpret, blocks):
    o, lse = _forward(q, k, v, end_b1s, interpret, blocks)
    return o, (q, k, v, end_b1s, o, lse)


def _tree_flash_bwd(interpret, blocks, residuals, do):

    q, k, v, end_b1s, o, lse = residuals
    b, h, t, e = q.shape
    kv, s = k.shape[1], k.shape[2]
    g = h // kv
    r, c = blocks.resident, blocks.streamed
    q_spec, kv_spec, end_spec, row_spec = _query_grid_specs(g, e, blocks)
    dq_kernel = functools.partial(_dq_kernel, block_q=r, block_k=c)
    with jax.named_scope("tree_attention_dq"):
        dq = _call(
            dq_kernel, (b, h, t // r, s // c), [end_spec, q_spec, kv_spec, kv_spec, q_spec, q_spec, row_spec],
            q_spec, jax.ShapeDtypeStruct(q.shape, q.dtype), [pltpu.VMEM((r, e), jnp.float32)], interpret,
            cost("dq", b, h, t, s, e, q.dtype.itemsize, blocks),
        )(fetch_table(end_b1s[:, 0], t, r, c, False), end_b1s, q, k, v, o, do, lse)  # fmt: skip
    # The dk / dv grid runs over (key block j of ``r`` rows, query block i of ``c`` rows): query-side blocks
    # fetched through the dk / dv fetch table (a skipped tile re-uses the resident block).
    q_t = pl.BlockSpec((None, None, c, e), lambda b_, h_, j, i, f: (b_, h_, f[b_, j, i], 0))
    row_t = pl.BlockSpec((None, None, c, LANES), lambda b_, h_, j, i, f: (b_, h_, f[b_, j, i], 0))
    kv_t = pl.BlockSpec((None, None, r, e), lambda b_, h_, j, i, _: (b_, h_ // g, j, 0))
    end_t = pl.BlockSpec((None, 1, r), lambda b_, h_, j, i, _: (b_, 0, j))
    out_t = pl.BlockSpec((None, None, r, e), lambda b_, h_, j, i, _: (b_, h_, j, 0))
    per_head = jax.ShapeDtypeStruct((b, h, s, e), jnp.float32)
    dkv_kernel = functools.partial(_dkv_kernel, block_q=c, block_k=r)
    with jax.named_scope("tree_attention_dkv"):
        dk_h, dv_h = _call(
            dkv_kernel, (b, h, s // r, t // c), [end_t, q_t, kv_t, kv_t, q_t, q_t, row_t], [out_t, out_t],
            (per_head, per_head), [pltpu.VMEM((r, e), jnp.float32)] * 2, interpret,
            cost("dkv", b, h, t, s, e, q.dtype.itemsize, blocks),
        )(fetch_table(end_b1s[:, 0], t, c, r, True), end_b1s, q, k, v, o, do, lse)  # fmt: skip
    group = lambda x: x.reshape(b, kv, g, s, e).sum(axis=2).astype(k.dtype)
    return dq, group(dk_h), group(dv_h), None


_tree_flash.defvjp(_tree_flash_fwd, _tree_flash_bwd)


def fits(t: int, s: int) -> bool:
    """The kernel's shape constraint: query and key rows are whole tiles."""
    return t % BLOCK == 0 and s % BLOCK == 0


def tree_flash_attention(
    q_bthe, k_bske, v_bske, kv_end_bs, *, interpret: bool = False, blocks: Blocks | None = None
) -> jax.Array:
    """Attention of rows in key order under ``s <= t < kv_end[s]`` (the module docstring), [B, T, H, E] in q's
    dtype; scores and softmax in float32. Differentiable (its own backward kernels). A head_dim that is not a
    multiple of 128 (Qwen2.5-0.5B / 1.5B: 64) runs zero-padded to one, output sliced. ``blocks``: the tile,
    by default the tuning table's for the chip the program is compiled for (``choose_blocks``); one that is
    not a multiple of ``BLOCK`` or does not divide the rows raises ``ValueError`` naming it."""
    t, s, e = q_bthe.shape[1], k_bske.shape[1], q_bthe.shape[3]
    if not fits(t, s):
        raise ValueError(f"tree_flash_attention needs rows in whole tiles of {BLOCK}, got T={t}, S={s}")
    blocks = choose_blocks(generation(), e, t, s) if blocks is None else blocks
    for name, size in dataclasses.asdict(blocks).items():
        if size % BLOCK or t % size or s % size:
            raise ValueError(f"tree_flash_attention: Blocks.{name}={size} must be a multiple of {BLOCK} dividing "
                             f"T={t} and S={s}; pick another or leave blocks=None for the tuning table")  # fmt: skip
    # head_dim padded with zeros to whole lanes (q . k and p v unchanged; the scale is the true head_dim's)
    pad = lambda x: jnp.pad(x, ((0, 0),) * 3 + ((0, -e % LANES),)).transpose(0, 2, 1, 3)
    q = pad((q_bthe * (1.0 / float(e) ** 0.5)).astype(q_bthe.dtype))
    end_b1s = kv_end_bs.astype(jnp.int32)[:, None, :]
    return _tree_flash(q, pad(k_bske), pad(v_bske), end_b1s, interpret, blocks).transpose(0, 2, 1, 3)[..., :e]
