"""Work split across TPU slices without crossing DCN: each slice computes on its own share of a batch.

A mesh's outermost axis ``slice`` (``trace_jax.parallel.mesh``) spans slices joined by the data-center network.
Left to itself, XLA reduces a gradient over every batch axis wherever it is produced, so an optimizer step
accumulated over micro-batches would cross DCN once per micro-batch. :func:`per_slice` runs a function on each
slice apart (``jax.shard_map`` manual over ``slice`` only; the axes within a slice stay automatic) and returns
each slice's own result, stacked along a new leading axis; the caller reduces that axis once, when it must.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from trace_jax.parallel.mesh import SLICE_AXIS


def slice_of(device: jax.Device) -> int:
    """The slice ``device`` belongs to: its ``slice_index`` (TPU slices joined over DCN), else 0."""
    index = getattr(device, "slice_index", None)
    return 0 if index is None else int(index)


def process_slices(devices: Sequence[jax.Device]) -> dict[int, int]:
    """Each process's slice (process index -> slice index) from its devices' ``slice_index``. A host's chips
    belong to one slice, so a process's work (the trees it samples, its engine) stays in its slice; raises
    ValueError when a process's devices lie in two slices."""
    found: dict[int, set[int]] = {}
    for device in devices:
        found.setdefault(device.process_index, set()).add(slice_of(device))
    split = {process: sorted(slices) for process, slices in found.items() if len(slices) > 1}
    if split:
        raise ValueError(f"processes {split} hold devices of several slices: each host must belong to one slice")
    return {process: slices.pop() for process, slices in sorted(found.items())}


def process_devices(devices: Sequence[jax.Device], process: int) -> list[jax.Device]:
    """The devices of ``devices`` that ``process`` drives: where its engine decodes, all within one slice (checked
    by :func:`process_slices`), so sampling and the engine's weight copy never cross DCN."""
    process_slices(devices)
    mine = [device for device in devices if device.process_index == process]
    if not mine:
        raise ValueError(f"process {process} has no device among the {len(devices)} given")
    return mine


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
