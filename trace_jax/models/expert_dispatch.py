"""How a mixture of experts' (token, expert) rows meet the experts under a mesh (``MoeConfig.expert_dispatch``).

Both dispatches run inside ``jax.shard_map``, each device on its own batch shard (``batch``: data x fsdp x
expert), so no device sorts the global token order; the experts' width stays split over ``tensor`` and the
partial outputs are summed (``psum``). ``compute`` is the expert compute (``models.moe``: grouped or dense)
with the signature ``compute(x_nd, top_i_nk, top_w_nk, gate_edf, up_edf, down_efd) -> [n, d]``.

* ``gather``: every device computes every expert for its own tokens. A layer's experts enter gathered over
  ``expert`` and ``embed`` (as FSDP gathers a dense layer's weights), so each device moves the layer's whole
  expert set (E x 3 x d x f) in the forward pass and again in the backward pass, and no activations cross
  devices. The default; the cheaper one when the experts are small next to the tokens' rows.
* ``all_to_all``: expert parallelism. A layer's experts stay split over ``expert`` (a device holds E / S of
  them, S the size of ``expert``; gathered over ``embed`` only). Each device sends each (token, choice) row
  to the shard owning its expert (``jax.lax.all_to_all`` over ``expert``), the owner runs ``compute`` on the
  rows it received for its own experts, and a second all_to_all returns the outputs to the tokens' devices,
  which apply the gate weights and sum the top-k outputs per token.

  Dropless, so sized for the worst case: every destination's block of the send buffer holds all of the
  device's rows, C = local tokens x top-k (the case where every row goes to one shard). The send and receive
  buffers are [S, C, d] each way (4 x S x C x d activations a sparse layer, S times the rows the gather
  dispatch holds), and the owner computes over its S x C received rows, the rows after its experts' groups
  being padding (zero rows in no group: the CPU scan leaves them zero; whether ``ragged_dot`` on TPU or GPU
  skips their work is not measured here). Pick it when one sparse layer's experts weigh more than those
  buffers (large expert sets, few tokens per device) or when the experts' gather traffic dominates the step.
  With ``expert`` of size 1, no mesh, or experts not divisible by the ``expert`` size it runs as ``gather``.

Letters as in ``models.moe``; s shards of ``expert``, c rows per destination block, r = s x c received rows.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from trace_jax.parallel.mesh import MESH_AXES, logical_to_spec

ExpertCompute = Callable[..., jax.Array]


def _dispatch_mesh():
    """The abstract mesh traced under, or None without one (or with one lacking the framework's axes)."""
    mesh = jax.sharding.get_abstract_mesh()
    return None if mesh.empty or not set(MESH_AXES) <= set(mesh.axis_names) else mesh


def _tensor_axis(mesh, gate_edf: jax.Array) -> str | None:
    """``tensor`` where it splits the experts' width (f), else None."""
    return "tensor" if mesh.shape["tensor"] > 1 and gate_edf.shape[2] % mesh.shape["tensor"] == 0 else None


def _per_batch_shard(local: ExpertCompute, mesh, expert_axis: str | None, args: tuple) -> jax.Array:
    """``local`` on each batch shard's tokens, the experts split over ``expert_axis`` (None: gathered) and over
    ``tensor`` on their width (partial outputs summed)."""
    x_nd, gate_edf = args[0], args[3]
    rows = logical_to_spec(("batch", None), mesh, x_nd.shape)
    tensor = _tensor_axis(mesh, gate_edf)
    in_proj, out_proj = P(expert_axis, None, tensor), P(expert_axis, tensor, None)
    specs = (rows, rows, rows, in_proj, in_proj, out_proj)

    def summed(*shards):
        out_nd = local(*shards)
        return out_nd if tensor is None else jax.lax.psum(out_nd, tensor)

    # check_vma off: the CPU scans' carries start as constants, the same on every shard
    return jax.shard_map(summed, mesh=mesh, in_specs=specs, out_specs=rows, check_vma=False)(*args)


def gather_dispatch(compute: ExpertCompute, *args: jax.Array) -> jax.Array:
    """``compute`` on each batch shard's tokens against the layer's experts gathered over ``expert`` and
    ``embed``; without a mesh ``compute`` runs as is."""
    mesh = _dispatch_mesh()
    if mesh is None:
        return compute(*args)
    return _per_batch_shard(compute, mesh, None, (*args[:3], *_split_by_expert(mesh, *args[3:])))


def _split_by_expert(mesh, gate_edf: jax.Array, up_edf: jax.Array, down_efd: jax.Array) -> tuple[jax.Array, ...]:
    """A layer's expert weights (stored split over ``expert`` on E and over ``fsdp`` on ``embed``) resharded so
    only whole experts are split: E over ``expert`` x ``fsdp`` (those of them that divide it), the width kept
    over ``tensor``. Gathered from there, the expert set arrives as the contiguous ``[E, in, out]`` the grouped
    matmul reads; gathered from the stored layout, a device's piece interleaves ``embed`` halves inside E and
    the compiler copies the whole gathered set into order in every forward pass and recompute (qwen3-30b-a3b
    on v5p-64, fsdp 2 x expert 16: an update call's HBM bytes 1.64 TB stored layout, 1.44 TB resharded;
    ``docs/tpu_speed.md``). The reshard moves a device's own share of the layer, 1 / (expert x fsdp)."""
    axes, shards = [], 1
    for axis in ("expert", "fsdp"):
        if mesh.shape[axis] > 1 and gate_edf.shape[0] % (shards * mesh.shape[axis]) == 0:
            axes.append(axis)
            shards *= mesh.shape[axis]
    experts, tensor = tuple(axes) or None, _tensor_axis(mesh, gate_edf)
    in_proj, out_proj = P(experts, None, tensor), P(experts, tensor, None)
    pin = jax.lax.with_sharding_constraint
    return pin(gate_edf, in_proj), pin(up_edf, in_proj), pin(down_efd, out_proj)


def all_to_all_dispatch(compute: ExpertCompute, *args: jax.Array) -> jax.Array:
    """Expert parallelism: each (token, choice) row travels to its expert's shard and back (module docstring).
    Falls back to ``gather_dispatch`` where there is nothing to exchange."""
    mesh = _dispatch_mesh()
    experts = args[3].shape[0]
    if mesh is None or mesh.shape["expert"] == 1 or experts % mesh.shape["expert"]:
        return gather_dispatch(compute, *args)
    exchange = functools.partial(_exchange_rows, compute, mesh.shape["expert"])
    return _per_batch_shard(exchange, mesh, "expert", args)


def _exchange_rows(compute, shards, x_nd, top_i_nk, top_w_nk, gate_edf, up_edf, down_efd) -> jax.Array:
    """One device's side of the exchange (inside ``shard_map``; its experts are ``gate_edf[e]``, global ids
    ``axis_index * local + e``)."""
    n, k = top_i_nk.shape
    local = gate_edf.shape[0]
    c = n * k  # dropless: a destination block holds every row of this device
    position_m = jnp.arange(n * k, dtype=jnp.int32)  # a row's place in the sorted order
    expert_m = top_i_nk.reshape(-1)
    order_m = jnp.argsort(expert_m, stable=True)  # rows grouped by shard, then by the shard's local expert
    shard_m = jnp.take(expert_m, order_m) // local
    sizes_se = jnp.bincount(expert_m, length=shards * local).astype(jnp.int32).reshape(shards, local)
    rows_s = jnp.sum(sizes_se, axis=1)
    slot_m = shard_m * c + position_m - (jnp.cumsum(rows_s) - rows_s)[shard_m]
    send_rd = jnp.zeros((shards * c, x_nd.shape[1]), x_nd.dtype).at[slot_m].set(jnp.take(x_nd, order_m // k, axis=0))

    def exchange(a):  # block i goes to shard i; block j of the result came from shard j
        return jax.lax.all_to_all(a.reshape(shards, -1, *a.shape[1:]), "expert", 0, 0).reshape(a.shape)

    recv_rd, recv_se = exchange(send_rd), exchange(sizes_se)
    # Received row j of block s belongs to local expert #(group ends <= j); past the block's rows: padding,
    # expert id ``local`` (no group, zero weight), sorted after every group by ``compute``.
    ends_se = jnp.cumsum(recv_se, axis=1)
    row_c = jnp.arange(c, dtype=jnp.int32)
    expert_sc = jax.vmap(functools.partial(jnp.searchsorted, side="right"), (0, None))(ends_se, row_c)
    expert_r1 = expert_sc.reshape(-1, 1).astype(jnp.int32)
    weight_r1 = (expert_r1 < local).astype(top_w_nk.dtype)
    out_rd = exchange(compute(recv_rd, expert_r1, weight_r1, gate_edf, up_edf, down_efd))
    out_md = jnp.take(out_rd, slot_m, axis=0)
    out_md = out_md * jnp.take(top_w_nk.reshape(-1), order_m)[:, None].astype(out_md.dtype)
    return jnp.zeros((n, x_nd.shape[1]), out_md.dtype).at[order_m // k].add(out_md)


EXPERT_DISPATCH: dict[str, Callable[..., jax.Array]] = {"gather": gather_dispatch, "all_to_all": all_to_all_dispatch}
