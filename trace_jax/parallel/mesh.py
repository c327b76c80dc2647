"""Device meshes, the logical-axis rules table, and parameters created directly with their shardings.

Models name their axes logically (``nnx.Param(..., logical_axes=("embed", "mlp"))``); this module alone
knows how those names land on the mesh axes ``data``, ``fsdp``, ``expert`` and ``tensor``. Batches shard over
``data``, ``fsdp`` and ``expert`` together; parameters shard their ``embed`` axis over ``fsdp`` (ZeRO-3
style), their head / mlp / vocab axes over ``tensor`` (Megatron style) and a mixture of experts' ``expert``
axis over ``expert`` (expert parallelism: each device group holds a slice of the experts, with fsdp / tensor
still splitting inside an expert). ``expert`` defaults to size 1, where it changes nothing for dense models.
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

MESH_AXES = ("data", "fsdp", "expert", "tensor")

# Logical axis name -> mesh axis (or axes, or None for replicated). One table for the whole framework.
LOGICAL_AXIS_RULES: dict[str, str | tuple[str, ...] | None] = {
    "batch": ("data", "fsdp", "expert"),
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
    data: int = 1, fsdp: int = -1, tensor: int = 1, devices: Sequence[jax.Device] | None = None, *, expert: int = 1
) -> Mesh:
    """A (data, fsdp, expert, tensor) mesh with Auto axis types. One axis may be -1: it takes the remaining
    devices. ``tensor`` is the innermost (fastest-varying) axis of the device grid."""
    devices = list(jax.devices() if devices is None else devices)
    sizes = [data, fsdp, expert, tensor]
    if sizes.count(-1) > 1:
        raise ValueError(f"mesh axes {dict(zip(MESH_AXES, sizes, strict=True))}: at most one may be -1")
    known = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
        if len(devices) % known:
            raise ValueError(f"{len(devices)} devices do not divide into mesh axes {sizes}")
        sizes[sizes.index(-1)] = len(devices) // known
    if math.prod(sizes) != len(devices):
        raise ValueError(
            f"mesh {dict(zip(MESH_AXES, sizes, strict=True))} needs {math.prod(sizes)} devices, "
            f"{len(devices)} are available"
        )
    grid = np.asarray(devices, dtype=object).reshape(sizes)
    return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


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
        axes = tuple(a for a in axes if a not in used and mesh.shape.get(a, 1) > 1)
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
    """Sharding of a [batch, ...] array: the batch over (data, fsdp, expert), the rest replicated."""
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
