"""jax's megablox grouped matmul (Pallas TPU) for mixture-of-experts weights: ``ragged_dot`` with its weight
gradient from the transposed grouped matmul ``tgmm``, its block rule and its cost.

Letters: m (token, expert) rows sorted by expert, e experts, d input width, f output width.

Block rule: ``tgmm`` tiles rows by ``ROW_TILE`` (rows are padded with zeros to a multiple here) and each
width by the largest of 512, 256, 128 dividing it, else the whole width (Mosaic's rule: a multiple of 128 on
the last axis or the array's whole axis). Operands are bfloat16 or float32 (``DTYPES``; ``check_dtypes``
raises naming the one that breaks it). The caller picks this branch for TPU programs
(``lax.platform_dependent``, ``trace_jax.models.moe.grouped_matmul``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

# The weight gradient's row tile: an expert's group starting inside a tile costs that tile once more, so with
# many experts a short tile wastes least (at most m / 128 + e tiles are visited).
ROW_TILE = 128
DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))  # the kernel's operand types


def width_tile(dim: int) -> int:
    """The largest of 512, 256, 128 dividing ``dim``, else ``dim`` whole: Mosaic's block rule (a multiple of
    128 on the last axis, or the array's whole axis) with no partial edge block."""
    return next((tile for tile in (512, 256, 128) if dim % tile == 0), dim)


def takes(*operands: jax.Array) -> bool:
    """Whether every operand is of a dtype ``tgmm`` reads."""
    return all(x.dtype in DTYPES for x in operands)


def check_dtypes(*operands: jax.Array) -> None:
    """Raises ``ValueError`` naming the operand dtype ``tgmm`` refuses."""
    for x in operands:
        if x.dtype not in DTYPES:
            raise ValueError(f"megablox tgmm reads {[d.name for d in DTYPES]} operands, got {x.dtype.name}")


def cost(m: int, e: int, d: int, f: int, itemsize: int) -> pl.CostEstimate:
    """What one weight-gradient call costs: each of the ``m`` rows (padded to ``ROW_TILE``) multiplies into its
    expert's [d, f] once, plus at most one extra row tile per expert boundary; reads x and d_out once per
    visited tile, writes every expert's [d, f] gradient."""
    rows = -(-m // ROW_TILE) * ROW_TILE + e * ROW_TILE
    return pl.CostEstimate(
        flops=2 * rows * d * f, transcendentals=0, bytes_accessed=rows * (d + f) * itemsize + e * d * f * itemsize
    )


def grouped_weight_grad(x_md, d_out_mf, sizes_e, dtype, interpret: bool = False) -> jax.Array:
    """``d w[e] = x[group e]^T @ d_out[group e]`` ([e, d, f], ``dtype``) by megablox's transposed grouped matmul
    (``tgmm``, a Mosaic kernel; ``interpret`` runs it in Pallas interpret mode). Rows after the last group
    (padding) are outside every group and ignored; an empty group's gradient is zero. The rows are padded with
    zeros to a multiple of the row tile, which the kernel needs."""
    from jax.experimental.pallas.ops.tpu.megablox.gmm import tgmm  # TPU kernel, lazy import

    check_dtypes(x_md, d_out_mf)
    pad = -x_md.shape[0] % ROW_TILE
    if pad:
        x_md = jnp.pad(x_md, ((0, pad), (0, 0)))
        d_out_mf = jnp.pad(d_out_mf, ((0, pad), (0, 0)))
    tiling = (ROW_TILE, width_tile(x_md.shape[1]), width_tile(d_out_mf.shape[1]))
    return tgmm(x_md.T, d_out_mf, sizes_e, dtype, tiling, interpret=interpret)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def grouped_matmul_tpu(x_md: jax.Array, w_edf: jax.Array, sizes_e: jax.Array, interpret: bool = False) -> jax.Array:
    """``jax.lax.ragged_dot`` with its weight gradient from ``grouped_weight_grad``. The TPU compiler lowers
    ragged_dot's value and input gradient to grouped kernels, but its weight gradient (ragged contracting
    rows) to a dense contraction of every expert over all rows under a group mask, e / top-k times the work of
    a grouped one (measured: 95% of the FLOPs of the Qwen3-30B-A3B update on v5p-64)."""
    return jax.lax.ragged_dot(x_md, w_edf, sizes_e)


def _grouped_matmul_tpu_fwd(x_md, w_edf, sizes_e, interpret):
    return jax.lax.ragged_dot(x_md, w_edf, sizes_e), (x_md, w_edf, sizes_e)


def _grouped_matmul_tpu_bwd(interpret, residuals, d_out_mf):
    x_md, w_edf, sizes_e = residuals
    d_x_md = jax.lax.ragged_dot(d_out_mf, jnp.swapaxes(w_edf, 1, 2), sizes_e)
    d_w_edf = grouped_weight_grad(x_md, d_out_mf, sizes_e, w_edf.dtype, interpret)
    no_sizes = np.zeros(sizes_e.shape, jax.dtypes.float0)  # integer group sizes have no cotangent
    return d_x_md.astype(x_md.dtype), d_w_edf, no_sizes


grouped_matmul_tpu.defvjp(_grouped_matmul_tpu_fwd, _grouped_matmul_tpu_bwd)
