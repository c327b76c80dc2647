"""Running a Mosaic kernel on a mesh: XLA cannot partition a Pallas TPU call, so it runs in ``jax.shard_map``."""

from __future__ import annotations

from collections.abc import Callable

import jax
from jax.sharding import PartitionSpec as P

from trace_jax.parallel.mesh import MESH_AXES, logical_to_spec


def _mesh_specs(q_bthe, k_bske, mesh):
    """PartitionSpecs of q / k (and v), kv_end and the output for a kernel run in ``shard_map`` over every axis of
    ``mesh``: rows over the batch axes, heads over ``tensor`` when the KV heads split evenly (else whole)."""
    q_spec = logical_to_spec(("batch", "length", "heads", None), mesh, q_bthe.shape)
    kv_spec = logical_to_spec(("batch", "length", "kv_heads", None), mesh, k_bske.shape)
    if kv_spec[2] is None:  # a query shard must hold the KV heads its query heads use
        q_spec = P(q_spec[0], None, None, None)
    return q_spec, kv_spec, P(q_spec[0], None)


def under_mesh(kernel: Callable[..., jax.Array], q_bthe, k_bske, v_bske, kv_end_bs):
    """``kernel(q, k, v, kv_end)`` on each shard when traced under a mesh (Mosaic kernels cannot be partitioned by
    XLA; every axis manual, ``check_vma=False``: jax 0.10.2 refuses both a partly automatic mesh and the vma
    check of these kernels), else called directly. q ``[B, T, H, E]``, k / v ``[B, S, K, E]``, kv_end ``[B, S]``
    or None; the output is laid out as q."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not set(MESH_AXES) <= set(mesh.axis_names):
        return kernel(q_bthe, k_bske, v_bske, kv_end_bs)
    q_spec, kv_spec, end_spec = _mesh_specs(q_bthe, k_bske, mesh)
    if kv_end_bs is None:
        run = jax.shard_map(
            lambda q, k, v: kernel(q, k, v, None),
            mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec), out_specs=q_spec, check_vma=False,
        )  # fmt: skip
        return run(q_bthe, k_bske, v_bske)
    run = jax.shard_map(
        kernel, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec, end_spec), out_specs=q_spec, check_vma=False
    )
    return run(q_bthe, k_bske, v_bske, kv_end_bs)
