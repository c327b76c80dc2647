"""Work split across TPU slices without crossing DCN: each slice computes on its own share of a batch.

A mesh's outermost axis ``slice`` (``trace_jax.parallel.mesh``) spans slices joined by the data-center network.
Left to itself, XLA reduces a gradient over every batch axis wherever it is produced, so an optimizer step
accumulated over micro-batches would cross DCN once per micro-batch. :func:`per_slice` runs a function on each
slice apart (``jax.shard_map`` manual over ``slice`` only; the axes within a slice stay automatic) and returns
each slice's own result, stacked along a new leading axis; the caller reduces that axis once, when it must.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from trace_jax.parallel.mesh import SLICE_AXIS


def slice_count(mesh: Mesh | None) -> int:
    """How many slices ``mesh`` spans (1 without a mesh or a ``slice`` axis)."""
    return 1 if mesh is None else mesh.shape.get(SLICE_AXIS, 1)


def per_slice(fn: Callable[..., Any], mesh: Mesh, split: Collection[int]) -> Callable[..., Any]:
    """``fn`` run on each slice of ``mesh`` apart. Positional arguments at indices ``split`` are pytrees of
    ``[B, ...]`` arrays whose rows divide over the slices (each slice gets its own rows); the others are whole on
    every slice. Every output leaf gains a leading axis of size ``slice_count(mesh)``, sharded over ``slice``:
    slice i's result at index i. No collective crosses slices."""

    def stacked(*args: Any) -> Any:
        return jax.tree.map(lambda x: x[None], fn(*args))

    def run(*args: Any) -> Any:
        specs = tuple(PartitionSpec(SLICE_AXIS) if i in split else PartitionSpec() for i in range(len(args)))
        return jax.shard_map(
            stacked,
            mesh=mesh,
            in_specs=specs,
            out_specs=PartitionSpec(SLICE_AXIS),
            axis_names={SLICE_AXIS},
            check_vma=False,  # fn is written for one device group (its lax.cond branches are not slice-aware)
        )(*args)

    return run


def stacked_sharding(sharding: NamedSharding) -> NamedSharding:
    """The sharding of a per-slice stack (:func:`per_slice`'s outputs) of arrays laid out as ``sharding``."""
    return NamedSharding(sharding.mesh, PartitionSpec(SLICE_AXIS, *sharding.spec))
