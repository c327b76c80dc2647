"""Device meshes, the logical-axis rules table, and parameters created directly with their shardings.

Models name their axes logically (``nnx.Param(..., logical_axes=("embed", "mlp"))``); this module alone
knows how those names land on the mesh axes ``data``, ``fsdp``, ``expert`` and ``tensor``. Batches shard over
``data``, ``fsdp`` and ``expert`` together; parameters shard their ``embed`` axis over ``fsdp`` (ZeRO-3
style), their head / mlp / vocab axes over ``tensor`` (Megatron style) and a mixture of experts' ``expert``
axis over ``expert`` (expert parallelism: each device group holds a slice of the experts, with fsdp / tensor
still splitting inside an expert). ``expert`` defaults to size 1, where it changes nothing for dense models.

Several TPU slices run as one job over the data-center network (DCN), far slower per chip than a slice's ICI. The
outermost axis ``slice`` spans them: only the batch shards over it (data parallel across slices), so parameters and
optimizer state shard within a slice and are whole on each slice, and the only traffic over DCN is the gradient
reduction (``trace_jax.rl.trainer`` keeps per-slice partial gradients and reduces them once per optimizer step).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "expert", "tensor")  # the axes within a slice (over ICI)
SLICE_AXIS = "slice"  # across slices (over DCN), outermost
MESH_AXIS_NAMES = (SLICE_AXIS, *MESH_AXES)  # every mesh ``make_mesh`` builds has these axes, in this order

# Logical axis name -> mesh axis (or axes, or None for replicated). One table for the whole framework.
LOGICAL_AXIS_RULES: dict[str, str | tuple[str, ...] | None] = {
    "batch": (SLICE_AXIS, "data", "fsdp", "expert"),
    "length": None,
    "embed": "fsdp",
    "mlp": "tensor",
    "heads": "tensor",
    "kv_heads": "tensor",
    "head_dim": None,
    "vocab": "tensor",
    "expert": "expert",
    "layers": None,
    "cache_length": None,
    "feature": None,
}


def make_mesh(
    data: int = 1,
    fsdp: int = -1,
    tensor: int = 1,
    devices: Sequence[jax.Device] | None = None,
    *,
    expert: int = 1,
    slices: int = 1,
) -> Mesh:
    """A (slice, data, fsdp, expert, tensor) mesh with Auto axis types. One of data / fsdp / expert / tensor may
    be -1: it takes the devices left in a slice. ``tensor`` is the innermost (fastest-varying) axis of the grid.

    ``slices`` splits ``devices`` into that many equal groups along the outermost axis ``slice``: by each device's
    ``slice_index`` when devices carry one (TPU slices joined over DCN), else by ``process_index`` (CPU stand-ins:
    consecutive devices of one process form a group)."""
    devices = _slice_ordered(list(jax.devices() if devices is None else devices), slices)
    per_slice = len(devices) // slices
    sizes = [data, fsdp, expert, tensor]
    if sizes.count(-1) > 1:
        raise ValueError(f"mesh axes {dict(zip(MESH_AXES, sizes, strict=True))}: at most one may be -1")
    known = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
        if per_slice % known:
            raise ValueError(f"{per_slice} devices per slice do not divide into mesh axes {sizes}")
        sizes[sizes.index(-1)] = per_slice // known
    if math.prod(sizes) != per_slice:
        raise ValueError(
            f"mesh {dict(zip(MESH_AXES, sizes, strict=True))} needs {math.prod(sizes)} devices per slice, "
            f"{per_slice} are available in each of {slices} slice(s)"
        )
    grid = np.asarray(devices, dtype=object).reshape([slices, *sizes])
    return Mesh(grid, MESH_AXIS_NAMES, axis_types=(AxisType.Auto,) * len(MESH_AXIS_NAMES))


def _slice_ordered(devices: list[jax.Device], slices: int) -> list[jax.Device]:
    """``devices`` grouped slice by slice (stable within a slice); checks each group is one slice or process."""
    if slices < 1 or len(devices) % slices:
        raise ValueError(f"mesh.slices={slices} must be >= 1 and divide the {len(devices)} devices")
    key = "slice_index" if all(getattr(d, "slice_index", None) is not None for d in devices) else "process_index"
    ordered = sorted(devices, key=lambda d: getattr(d, key))
    per_slice = len(ordered) // slices
    for first in range(0, len(ordered), per_slice):
        group = {getattr(d, key) for d in ordered[first : first + per_slice]}
        if slices > 1 and len(group) > 1:
            raise ValueError(
                f"mesh.slices={slices}: a slice of {per_slice} devices would mix {key} values {sorted(group)}; "
                f"set mesh.slices to the number of distinct {key} values or a multiple of it"
            )
    return ordered


def split_devices(devices: Sequence[jax.Device], sampling: int) -> tuple[list[jax.Device], list[jax.Device]]:
    """``devices`` as (the ones that only sample, the ones that train): the first ``sampling`` sample, the rest
    train. ``sampling = 0`` is the colocated placement: ``([], devices)``, the engine decodes on the trainer's."""
    devices = list(devices)
    if not 0 <= sampling < len(devices):
        raise ValueError(
            f"{sampling} sampling device(s) out of {len(devices)}: allowed 0 (colocated) to {len(devices) - 1} "
            "(at least one device must train)"
        )
    return devices[:sampling], devices[sampling:]


def logical_to_spec(
    logical_axes: Sequence[str | None], mesh: Mesh, shape: Sequence[int] | None = None
) -> PartitionSpec:
    """PartitionSpec for an array with the given logical axis names.

    A mesh axis is used at most once per array (the first logical axis claiming it wins), and when ``shape``
    is given an axis that does not divide evenly stays replicated rather than failing.
    """
    used: set[str] = set()
    spec = []
    for i, name in enumerate(logical_axes):
        if name is not None and name not in LOGICAL_AXIS_RULES:
            raise ValueError(f"logical axis {name!r} has no rule; known: {sorted(LOGICAL_AXIS_RULES)}")
        rule = LOGICAL_AXIS_RULES.get(name) if name else None
        axes = (rule,) if isinstance(rule, str) else tuple(rule or ())
        manual = set(getattr(mesh, "manual_axes", ()))  # inside a shard_map each shard already is its part
        axes = tuple(a for a in axes if a not in used and a not in manual and mesh.shape.get(a, 1) > 1)
        if shape is not None and axes and shape[i] % math.prod(mesh.shape[a] for a in axes):
            axes = ()
        used.update(axes)
        spec.append(axes[0] if len(axes) == 1 else (axes or None))
    return PartitionSpec(*spec)


def constrain(x: jax.Array, logical_axes: Sequence[str | None]) -> jax.Array:
    """Pins an activation's layout by logical axis names when traced under a mesh (``traced_under``,
    ``jax.set_mesh``); a no-op without one. Without such pins XLA may lay activations out like the weights
    (hidden dim split over fsdp, batch whole on every device), multiplying activation memory by the mesh size.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not set(MESH_AXES) <= set(mesh.axis_names):
        return x
    return jax.lax.with_sharding_constraint(x, logical_to_spec(logical_axes, mesh, x.shape))


def traced_under(mesh: Mesh, fn: Callable) -> Callable:
    """``fn`` whose tracing sees ``mesh`` (so ``constrain`` applies); wrap a function before ``jax.jit``."""

    @functools.wraps(fn)  # keeps fn's name in jit's compile logs and profiles
    def wrapped(*args, **kwargs):
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            return fn(*args, **kwargs)

    return wrapped


def logical_sharding(mesh: Mesh, logical_axes: Sequence[str | None], shape: Sequence[int] | None = None):
    return NamedSharding(mesh, logical_to_spec(logical_axes, mesh, shape))


def batch_sharding(mesh: Mesh, ndim: int = 2) -> NamedSharding:
    """Sharding of a [batch, ...] array: the batch over (slice, data, fsdp, expert), the rest replicated."""
    return logical_sharding(mesh, ("batch",) + (None,) * (ndim - 1))


def state_shardings(state: nnx.State, mesh: Mesh) -> nnx.State:
    """The NamedSharding of every variable of an (abstract or concrete) nnx state, from its logical axes."""

    def one(variable: nnx.Variable) -> nnx.Variable:
        shape = variable.value.shape
        axes = getattr(variable, "logical_axes", None) or (None,) * len(shape)
        return variable.replace(logical_sharding(mesh, axes, shape))

    return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def create_sharded(factory: Callable[[], nnx.Module], mesh: Mesh) -> nnx.Module:
    """Builds ``factory()`` with every parameter born on its shards (no full copy on one device).

    The module is traced abstractly first to learn shapes and logical axes, then initialised under a
    ``jax.jit`` whose ``out_shardings`` place each array directly.
    """
    abstract = nnx.eval_shape(factory)
    graphdef, abstract_state = nnx.split(abstract)
    shardings = state_shardings(abstract_state, mesh)

    def init() -> Any:
        return nnx.split(factory())[1]

    state = jax.jit(init, out_shardings=shardings)()
    return nnx.merge(graphdef, state)


def shard_state(state: nnx.State, mesh: Mesh) -> nnx.State:
    """Moves an existing state onto the mesh according to its logical axes."""
    return jax.device_put(state, state_shardings(state, mesh))
