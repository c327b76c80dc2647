"""Host-side data across JAX processes: who owns which prompts, gathered host floats, global batches, metrics.

On a pod each host runs one process with its own local devices. The pieces of an RL step map onto these:

- ``process_slice`` / ``shard_for_process``: every process takes a disjoint, deterministic block of the
  step's prompts (same answer on every host, no communication);
- ``exchange``: any picklable value from every process, in process order;
- ``allgather_rows``: host rows of any dtype (e.g. per-anchor floats, or the pickled new turns that
  ``sharded_rollouts.ProcessShardedBackend`` shares) gathered exactly and in process order, so every host
  runs the same allocation solver on the same inputs and reaches the same decision;
- ``global_batch``: a ``jax.Array`` over the whole mesh from each process's local train rows
  (``jax.make_array_from_process_local_data``), after ``common_row_count`` agreed on one padded size;
  ``rows_to_global``: the same from a batch every process holds whole, each feeding only its devices' rows;
- ``reduce_metrics``: scalar metrics combined across processes (weighted mean, sum, max or min);
- ``to_host``: a whole array as numpy on every process, also when it spans other hosts' devices;
- ``local_mesh`` / ``copy_to_each_process``: sampling needs no other host: each process gets a full copy of
  the (globally sharded) weights laid out on its own devices, and runs its engine there independently.

Every function here is collective when ``process_count() > 1``: all processes must call it, in the same
order, with the same structure (same keys, same trailing shapes). With one process they are cheap no-ops.
"""

from __future__ import annotations

import itertools
import pickle
import zlib
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from trace_jax.parallel.mesh import MESH_AXIS_NAMES, batch_sharding, make_mesh
from trace_jax.parallel.slices import process_devices

T = TypeVar("T")
REDUCTIONS = ("mean", "sum", "max", "min")
PROCESS_AXIS = "process"


def process_slice(n: int, index: int | None = None, count: int | None = None) -> slice:
    """The block of ``range(n)`` that process ``index`` (default: this one) of ``count`` owns.

    Blocks are contiguous, disjoint, cover ``range(n)`` in process order, and differ in size by at most one
    (the first ``n % count`` processes take one more). Deterministic: no communication.
    """
    index = jax.process_index() if index is None else index
    count = jax.process_count() if count is None else count
    if not 0 <= index < count:
        raise ValueError(f"process index {index} is not in [0, {count})")
    base, extra = divmod(n, count)
    start = index * base + min(index, extra)
    return slice(start, start + base + (index < extra))


def shard_for_process(items: Sequence[T]) -> list[T]:
    """This process's share of ``items`` (see ``process_slice``); e.g. the prompts it samples this step."""
    return list(items[process_slice(len(items))])


def _gather(x: np.ndarray) -> np.ndarray:
    """[P, *x.shape]: ``x`` from every process, in process order (one shape and dtype everywhere).

    Exact for every dtype: the bytes travel, so float64 and int64 survive JAX's default 32-bit mode
    (which would otherwise round them on the way).
    """
    x = np.ascontiguousarray(x)
    if jax.process_count() == 1:
        return x[None]
    gathered = np.asarray(multihost_utils.process_allgather(x.reshape(-1).view(np.uint8)))
    return gathered.view(x.dtype).reshape(jax.process_count(), *x.shape)


def allgather_rows(local: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Concatenates every process's rows in process order.

    Args:
      local: [n_local, ...] on this process; n_local may differ between processes, trailing dims and dtype
        may not.
    Returns:
      (rows [sum n_local, ...], counts [P] int64): identical on every process. Rows of process p are
      ``rows[counts[:p].sum() : counts[:p + 1].sum()]``.
    """
    local = np.asarray(local)
    counts = _gather(np.asarray([local.shape[0]], np.int64))[:, 0]
    padded = np.zeros((int(counts.max()), *local.shape[1:]), local.dtype)
    padded[: local.shape[0]] = local
    gathered = _gather(padded)
    return np.concatenate([gathered[p, :c] for p, c in enumerate(counts)]), counts


def exchange(payload: Any) -> list[Any]:
    """Every process's ``payload`` (pickled; processes of one job run the same code), in process order."""
    data = np.frombuffer(pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL), np.uint8)
    rows, counts = allgather_rows(data)
    ends = np.cumsum(counts)
    return [pickle.loads(rows[end - n : end].tobytes()) for n, end in zip(counts, ends, strict=True)]


def common_row_count(n_local: int, multiple: int = 1) -> int:
    """The largest ``n_local`` over processes rounded up to ``multiple``: one padded row count for all.

    ``jax.make_array_from_process_local_data`` needs the same number of rows from every process.
    """
    largest = int(_gather(np.asarray([n_local], np.int64)).max())
    return max(multiple, -(-largest // multiple) * multiple)


def global_batch(local_rows: Any, mesh: Mesh) -> Any:
    """A pytree of global ``jax.Array`` [P * n_local, ...] batch-sharded over the mesh from local rows.

    Args:
      local_rows: pytree of host arrays [n_local, ...], the same ``n_local`` on every process (pad with
        ``common_row_count``; padded rows should carry a zero loss mask). ``n_local`` must divide over this
        process's devices along the batch axes.
      mesh: the training mesh; its batch axes (data, fsdp) must give each process whole rows.
    Returns:
      the same pytree of global arrays; the rows a process gave are the ones its devices hold.
    """

    def one(x: Any) -> jax.Array:
        x = np.asarray(x)
        return jax.make_array_from_process_local_data(batch_sharding(mesh, x.ndim), x)

    return jax.tree.map(one, local_rows)


def _local_rows(sharding: NamedSharding, shape: tuple[int, ...]) -> slice:
    """The contiguous block of rows (axis 0) that this process's devices hold under ``sharding``."""
    indices = sharding.addressable_devices_indices_map(shape).values()
    blocks = sorted({index[0].indices(shape[0])[:2] for index in indices})
    if any(a[1] != b[0] for a, b in itertools.pairwise(blocks)):
        raise ValueError(f"this process's devices hold rows {blocks} of {shape[0]}: not one block")
    return slice(blocks[0][0], blocks[-1][1])


def rows_to_global(full_rows: Any, mesh: Mesh) -> Any:
    """A pytree of global ``jax.Array`` batch-sharded over ``mesh`` from host arrays every process holds whole.

    Args:
      full_rows: pytree of host arrays [n, ...], identical on every process (e.g. a train batch built on each
        process from the same all-gathered trees); ``n`` must divide over the mesh's batch axes.
    Returns:
      the same pytree of global arrays. Each process passes only the rows its own devices hold to
      ``jax.make_array_from_process_local_data``: nothing crosses hosts. With one process, a ``device_put``.
    """

    def one(x: Any) -> jax.Array:
        x = np.asarray(x)
        sharding = batch_sharding(mesh, x.ndim)
        if jax.process_count() == 1:
            return jax.device_put(x, sharding)
        return jax.make_array_from_process_local_data(sharding, x[_local_rows(sharding, x.shape)], x.shape)

    return jax.tree.map(one, full_rows)


def to_host(x: Any) -> np.ndarray:
    """The whole value of an array as numpy on every process (``np.asarray`` fails on arrays that span
    other hosts' devices). Collective when ``x`` is not fully addressable; free when it is."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


def _key_hash(keys: Sequence[str]) -> int:
    return zlib.crc32("\0".join(keys).encode())


def reduce_metrics(
    metrics: Mapping[str, float],
    how: Mapping[str, str] | None = None,
    default: str = "mean",
    weight: float = 1.0,
) -> dict[str, float]:
    """Combines scalar metrics over processes; every process gets the same dict.

    Args:
      metrics: this process's scalars; every process must pass the same keys.
      how: per-key reduction ("mean", "sum", "max", "min"); keys not listed use ``default``.
      weight: this process's weight in the means (e.g. its number of rollouts), so a mean of per-process
        means equals the mean over all items.
    Raises:
      ValueError on every process when the processes passed different keys (instead of a hang or a
      silently wrong pairing).
    """
    how = dict(how or {})
    for key, op in [*how.items(), ("<default>", default)]:
        if op not in REDUCTIONS:
            raise ValueError(f"reduction {op!r} for {key}: choose one of {REDUCTIONS}")
    keys = sorted(metrics)
    shapes = _gather(np.asarray([len(keys), _key_hash(keys)], np.int64))
    if (shapes != shapes[0]).any():
        raise ValueError(
            f"processes report different metric keys (process {jax.process_index()} has {keys}); "
            "every process must log the same keys"
        )
    values = np.asarray([float(metrics[k]) for k in keys] + [float(weight)], np.float64)
    table = _gather(values)  # [P, K + 1]
    weights = table[:, -1]
    if weights.sum() <= 0:
        raise ValueError(f"reduce_metrics: weights must sum to > 0, got {weights.tolist()}")
    out = {}
    for j, key in enumerate(keys):
        column = table[:, j]
        op = how.get(key, default)
        if op == "mean":
            out[key] = float((column * weights).sum() / weights.sum())
        else:
            out[key] = float(getattr(np, op)(column))
    return out


def _process_devices(index: int) -> list[jax.Device]:
    return [d for d in jax.devices() if d.process_index == index]


def local_mesh(
    data: int = 1,
    fsdp: int = -1,
    tensor: int = 1,
    *,
    devices: Sequence[jax.Device] | None = None,
    process: int | None = None,
) -> Mesh:
    """A (data, fsdp, tensor) mesh over one process's devices only (default: this process of ``jax.devices()``),
    laid out the same way on every process; they lie in one slice (``slices.process_devices``).

    Arrays on it are fully addressable: a jit over them runs on this host alone (no collective with other
    processes or slices), which is what per-process sampling needs.
    """
    devices = jax.devices() if devices is None else devices
    process = jax.process_index() if process is None else process
    return make_mesh(data, fsdp, tensor, devices=process_devices(devices, process))


def process_copies(mesh: Mesh, devices: Sequence[jax.Device] | None = None, process: int | None = None) -> Mesh | None:
    """The mesh ``(process, *mesh's axes)`` that ``copy_to_each_process`` lays its copies on: block p is process p's
    devices at the positions ``mesh`` takes among ``process``'s (default: this one of ``jax.devices()``), so every
    copy sits on one host, in its slice. None when ``mesh`` covers only part of ``process``'s devices."""
    devices = jax.devices() if devices is None else devices
    process = jax.process_index() if process is None else process
    mine = process_devices(devices, process)
    positions = [mine.index(d) for d in mesh.devices.flat]
    if sorted(positions) != list(range(len(mine))):
        return None
    processes = sorted({d.process_index for d in devices})
    grids = [
        np.asarray(process_devices(devices, p), dtype=object)[positions].reshape(mesh.devices.shape) for p in processes
    ]
    return Mesh(np.stack(grids), (PROCESS_AXIS, *MESH_AXIS_NAMES))


def copy_to_each_process(tree: Any, mesh: Mesh, shardings: Any = None) -> Any:
    """Every process gets the full value of each (global) array of ``tree``, laid out on its own ``mesh``.

    Args:
      tree: pytree of ``jax.Array`` (e.g. the trainer's FSDP-sharded params over all processes' devices).
      mesh: a mesh over this process's devices, e.g. ``local_mesh(...)``; every process must pass the mesh
        over the same local positions (same shape, same order).
      shardings: pytree like ``tree`` of ``NamedSharding`` over ``mesh`` (e.g. ``state_shardings(params,
        mesh)`` for tensor-parallel sampling); None replicates each array over the local mesh.
    Returns:
      pytree of fully addressable arrays on ``mesh``. Collective: one cross-process reshard per array
      (``tree`` must live on all of the job's devices). When ``mesh`` covers only some of this process's
      devices, every local device briefly holds a full copy on the way.
    """
    count, me = jax.process_count(), jax.process_index()
    mine = _process_devices(me)
    if mesh.axis_names != MESH_AXIS_NAMES or not all(d in mine for d in mesh.devices.flat):
        raise ValueError("copy_to_each_process needs a (data, fsdp, tensor) mesh of this process's devices")
    if shardings is None:
        shardings = jax.tree.map(lambda _: NamedSharding(mesh, PartitionSpec()), tree)
    # A cross-host reshard keeps the device set: first onto every process's devices (replicated across
    # processes), then, if ``mesh`` is a subset of this process's devices, a host-local move onto it.
    stacked = process_copies(mesh)
    whole = stacked is not None
    if not whole:
        stacked = Mesh(np.asarray([_process_devices(p) for p in range(count)], dtype=object), (PROCESS_AXIS, "local"))
        everything_here = Mesh(np.asarray(mine, dtype=object), ("local",))

    def one(x: jax.Array, sharding: NamedSharding) -> jax.Array:
        target = NamedSharding(mesh, sharding.spec)
        spread = jax.device_put(x, NamedSharding(stacked, sharding.spec if whole else PartitionSpec()))
        shards = [s.data for s in spread.addressable_shards]
        if whole:
            return jax.make_array_from_single_device_arrays(x.shape, target, shards)
        here = jax.make_array_from_single_device_arrays(
            x.shape, NamedSharding(everything_here, PartitionSpec()), shards
        )
        return jax.device_put(here, target)  # host-local: no other process takes part

    return jax.tree.map(one, tree, shardings)
