"""Whole-train-state checkpoints (orbax) with resume from the latest *good* checkpoint.

A train state is a dict of named pytrees (policy params, optimizer state, predictor params and its optimizer
state, rng, step, ...) plus JSON-able metadata (data-iterator state, scheduler counters, config, ...)::

    ckpt = StateCheckpointer(workdir / "checkpoints", save_every=50, keep=3)
    ckpt.save(step, {"params": params, "opt_state": opt_state, "rng": rng}, metadata={"data": it.get_state()})
    restored = ckpt.restore_latest(target={"params": abstract_params, ...})   # None when nothing saved yet
    if restored is not None:
        step, state, metadata = restored.step, restored.state, restored.metadata

Layout: one orbax step directory per saved step; each state entry is its own orbax item (so a consumer such
as evaluation can restore just ``params``) and ``metadata`` is a JSON item that also lists the saved keys.

Resume: orbax writes a step into a temporary directory and renames it when complete, so a run killed while
saving leaves no half-step in ``all_steps()``. A step that is listed but unreadable (files truncated or lost)
is skipped with a warning and the previous one is tried.

Restoring into shardings: pass ``target`` with the same structure as what was saved; leaves may be concrete
arrays or ``jax.ShapeDtypeStruct`` with a ``sharding`` (abstract target): arrays are read directly into those
shardings. Typed PRNG keys (``jax.random.key``) are stored as their key data and re-wrapped when the target
leaf is a typed key. Without a target, arrays come back as saved (nested dicts for custom pytree nodes), on the
devices they were saved from, or on this process's first device when those devices are not all here (a
checkpoint of a 2-process run read by one process, a pod's checkpoint read on a laptop).

Old per-layer checkpoints: params saved before the decoder's layers were stacked (``layers.0``, ``layers.1``,
..., each layer its own arrays) restore into a target with the stacked layout (``layers`` with a leading layer
axis): each ``layers`` entry of the target is read layer by layer, in the target's shardings less the layer
axis, and stacked (optimizer moments and gradients that mirror the params included).
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from trace_jax import paths

METADATA_ITEM = "metadata"
_KEYS_FIELD = "__state_keys__"
_WRAP = "tree"
_PRNG_FIELD = "__prng_impls__"  # {state key: {leaf path: impl name}} for typed keys turned into key data


class MissingEntryError(KeyError):
    """A requested state entry was never saved in the checkpoint."""


@dataclasses.dataclass
class RestoredState:
    """What ``restore`` returns: the step, the dict of pytrees, and the JSON metadata as saved."""

    step: int
    state: dict[str, Any]
    metadata: dict[str, Any]


def _is_typed_key(leaf: Any) -> bool:
    return isinstance(leaf, jax.Array | jax.ShapeDtypeStruct) and jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key)


def _keys_to_data(tree: Any) -> tuple[Any, dict[str, str]]:
    """Replaces typed PRNG keys by their uint32 key data; returns the impl name of each replaced leaf."""
    impls: dict[str, str] = {}

    def convert(path, leaf):
        if _is_typed_key(leaf):
            impls[jax.tree_util.keystr(path)] = str(jax.random.key_impl(leaf))
            return jax.random.key_data(leaf)
        return leaf

    return jax.tree_util.tree_map_with_path(convert, tree), impls


def _data_to_keys(tree: Any, target: Any, impls: dict[str, str]) -> Any:
    """Inverse of ``_keys_to_data`` where the target leaf is a typed key."""

    def convert(path, data, target_leaf):
        return (
            jax.random.wrap_key_data(data, impl=impls[jax.tree_util.keystr(path)])
            if _is_typed_key(target_leaf)
            else data
        )

    return jax.tree_util.tree_map_with_path(convert, tree, target)


def _abstract_key_data(leaf: Any) -> jax.ShapeDtypeStruct:
    """Restore target for the key data of a typed-key target leaf (same sharding)."""
    data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(leaf.shape, leaf.dtype))
    return jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=getattr(leaf, "sharding", None))


LAYERS = "layers"  # the stacked decoder layers' entry (``trace_jax.models.qwen.Qwen.layers``)


def _saved_per_layer(saved: Any) -> bool:
    """Whether an orbax metadata tree holds a ``layers`` mapping keyed by layer number (the old layout)."""
    if isinstance(saved, Mapping):
        layers = saved.get(LAYERS)
        if isinstance(layers, Mapping) and layers and all(str(k).isdigit() for k in layers):
            return True
        return any(_saved_per_layer(v) for v in saved.values())
    if isinstance(saved, list | tuple):
        return any(_saved_per_layer(v) for v in saved)
    return False


def _map_layers(tree: Any, fn: Callable[[Any], Any]) -> Any:
    """``tree`` with ``fn`` applied to the value of every ``layers`` key of its mappings, at any depth (through
    nnx.State, dicts, tuples and optax's NamedTuples); every other node keeps its exact pytree type."""
    children, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: x is not tree)
    if jax.tree_util.treedef_is_leaf(treedef):
        return tree
    mapped = [
        fn(child) if isinstance(path[-1], jax.tree_util.DictKey) and path[-1].key == LAYERS else _map_layers(child, fn)
        for path, child in children
    ]
    return jax.tree_util.tree_unflatten(treedef, mapped)


def _without_leading_axis(sharding: Any) -> Any:
    if isinstance(sharding, jax.sharding.NamedSharding):
        return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*sharding.spec[1:]))
    return sharding  # single-device or None: the same place


def _per_layer_target(stacked: Any) -> dict[int, Any]:
    """Abstract per-layer view {0: layer 0, 1: ...} of a stacked ``layers`` target (leading axis = layer)."""
    leaves = jax.tree.leaves(stacked)
    count = leaves[0].shape[0]
    one = lambda x: jax.ShapeDtypeStruct(
        x.shape[1:], x.dtype, sharding=_without_leading_axis(getattr(x, "sharding", None))
    )
    return {i: jax.tree.map(one, stacked) for i in range(count)}


def _stack_layers(per_layer: Mapping[Any, Any], stacked: Any) -> Any:
    """Stacks restored per-layer trees (keys 0..L-1) into ``stacked``'s structure and shardings."""
    layers = [per_layer[i] for i in range(len(per_layer))]

    def stack(target_leaf, *rows):
        sharding = getattr(target_leaf, "sharding", None)
        if isinstance(sharding, jax.sharding.NamedSharding):
            return jax.jit(lambda *xs: jnp.stack(xs), out_shardings=sharding)(*rows)
        return jax.device_put(jnp.stack(rows), sharding)

    return jax.tree.map(stack, stacked, *layers)


def _portable_target(saved: Any) -> Any:
    """None when an entry's orbax metadata tree ``saved`` names only devices this process has (restore as
    saved); else an abstract target of the same arrays on this process's first device."""
    here = {d.id for d in jax.devices()}

    def devices_of(leaf: Any) -> set[int]:
        mesh = getattr(getattr(leaf, "sharding", None), "device_mesh", None)
        return {d.id for d in jax.tree.leaves(mesh.mesh)} if mesh is not None else set()

    leaves = jax.tree.leaves(saved)
    if all(devices_of(leaf) <= here for leaf in leaves):
        return None
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    return jax.tree.map(
        lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device) if hasattr(m, "shape") else m, saved
    )


class StateCheckpointer:
    """Saves a train state every ``save_every`` steps, keeps the newest ``keep``; restores the latest good one.

    Args:
      directory: where step directories go (created if missing): a local path or a bucket URL (``gs://...``),
        kept a URL all the way to orbax (``trace_jax.paths.as_path``).
      save_every: ``save`` writes only when ``step % save_every == 0`` (or ``force=True``).
      keep: number of most recent checkpoints to keep; None keeps all.
      async_save: write in a background thread (call ``wait()`` before reading the files).
    """

    def __init__(
        self, directory: str | os.PathLike, save_every: int = 1, keep: int | None = 3, async_save: bool = False
    ):
        if save_every < 1:
            raise ValueError(f"save_every must be >= 1, got {save_every}")
        if keep is not None and keep < 1:
            raise ValueError(f"keep must be >= 1 or None, got {keep}")
        self.directory = paths.as_path(directory)  # gs://... stays a URL (pathlib would make it gs:/...)
        self.save_every = save_every
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep,
            create=True,
            cleanup_tmp_directories=True,  # a run killed mid-save leaves a tmp dir; remove it on the next start
            enable_async_checkpointing=async_save,
        )
        self._manager = ocp.CheckpointManager(self.directory, options=options)

    # ------------------------------------------------------------------------------------------- save
    def should_save(self, step: int) -> bool:
        return step % self.save_every == 0

    def save(
        self, step: int, state: Mapping[str, Any], metadata: Mapping[str, Any] | None = None, force: bool = False
    ) -> bool:
        """Writes ``state`` (dict of pytrees) and ``metadata`` (JSON-able) as ``step``; returns True if written
        (False when ``step`` is not a multiple of ``save_every`` and not forced, or is already saved).

        Entries that are None or have no array leaves are recorded as absent and restored as None.
        """
        if not force and not self.should_save(step):
            return False
        if step in self.all_steps():
            return False  # e.g. a final save right after resuming at that step: the files are already there
        if METADATA_ITEM in state:
            raise ValueError(f"state key {METADATA_ITEM!r} is reserved; pass JSON-able values via metadata=")
        items: dict[str, Any] = {}
        prng: dict[str, dict[str, str]] = {}
        for key, tree in state.items():
            if tree is None or not jax.tree.leaves(tree):
                continue
            tree, impls = _keys_to_data(tree)
            if impls:
                prng[key] = impls
            items[key] = ocp.args.StandardSave({_WRAP: tree})  # StandardSave rejects a bare array
        meta = dict(metadata or {})
        meta[_KEYS_FIELD] = sorted(items)
        meta[_PRNG_FIELD] = prng
        items[METADATA_ITEM] = ocp.args.JsonSave(meta)
        # force=True: our own save_every decides; orbax's interval would only duplicate it.
        return bool(self._manager.save(step, args=ocp.args.Composite(**items), force=True))

    def wait(self) -> None:
        """Blocks until an async save has finished."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()

    # ---------------------------------------------------------------------------------------- restore
    def all_steps(self) -> list[int]:
        """Finished checkpoint steps, ascending (saves still in progress or interrupted are not listed)."""
        self._manager.reload()
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        steps = self.all_steps()
        return steps[-1] if steps else None

    def restore(
        self, step: int, target: Mapping[str, Any] | None = None, keys: list[str] | None = None
    ) -> RestoredState:
        """Reads checkpoint ``step``; raises if it is missing or unreadable.

        Args:
          step: a step from ``all_steps()``.
          target: optional dict of pytrees (concrete or abstract with shardings) giving structure and placement.
          keys: restore only these state entries (default: all entries of ``target`` or, without one, all saved).
        """
        meta = self._manager.restore(step, args=ocp.args.Composite(**{METADATA_ITEM: ocp.args.JsonRestore()}))[
            METADATA_ITEM
        ]
        meta = dict(meta)
        saved_keys: list[str] = meta.pop(_KEYS_FIELD)
        prng: dict[str, dict[str, str]] = meta.pop(_PRNG_FIELD, {})
        wanted = list(keys if keys is not None else (target.keys() if target is not None else saved_keys))
        missing = [k for k in wanted if k not in saved_keys and (target is None or target.get(k) is not None)]
        if missing:
            raise MissingEntryError(
                f"checkpoint step {step} in {self.directory} has no entries {missing}; it has {saved_keys}"
            )
        args, per_layer = {}, set()
        for key in wanted:
            if key not in saved_keys:
                continue
            saved = self._saved_metadata(step, key)  # read once: placement and layout both come from it
            key_target = None if target is None else target.get(key)
            if key_target is None:
                key_target = _portable_target(saved)
            if key_target is not None:
                key_target = jax.tree.map(lambda x: _abstract_key_data(x) if _is_typed_key(x) else x, key_target)
                if target is not None and _saved_per_layer(saved):
                    per_layer.add(key)  # saved before the layers were stacked: read per layer, stack below
                    key_target = _map_layers(key_target, _per_layer_target)
            args[key] = ocp.args.StandardRestore(None if key_target is None else {_WRAP: key_target})
        restored = self._manager.restore(step, args=ocp.args.Composite(**args)) if args else {}
        state: dict[str, Any] = {}
        for key in wanted:
            if key not in saved_keys:
                state[key] = None
                continue
            tree = restored[key][_WRAP]
            if key in per_layer:
                tree = self._stacked(tree, target[key])
            if target is not None and target.get(key) is not None and prng.get(key):
                tree = _data_to_keys(tree, target[key], prng[key])
            state[key] = tree
        return RestoredState(step=step, state=state, metadata=meta)

    def _saved_metadata(self, step: int, key: str) -> Any:
        return ocp.StandardCheckpointHandler().metadata(self.directory / str(step) / key).tree[_WRAP]

    @staticmethod
    def _stacked(tree: Any, target: Any) -> Any:
        """A per-layer restored ``tree`` in ``target``'s stacked layout: each ``layers`` entry stacked."""
        stacked_targets: list[Any] = []
        _map_layers(target, lambda layers: stacked_targets.append(layers) or layers)
        found = iter(stacked_targets)
        return _map_layers(tree, lambda per_layer: _stack_layers(per_layer, next(found)))

    def restore_latest(
        self, target: Mapping[str, Any] | None = None, keys: list[str] | None = None
    ) -> RestoredState | None:
        """The newest readable checkpoint, or None when there is none.

        A listed step that fails to restore (corrupt, partly deleted) is skipped with a warning and the
        previous step is tried; if every step fails, the last error is raised.
        """
        steps = self.all_steps()
        error: Exception | None = None
        for step in reversed(steps):
            try:
                return self.restore(step, target=target, keys=keys)
            except MissingEntryError:
                raise  # the caller asked for something never saved: falling back would not help
            except Exception as e:  # orbax raises many types for damaged files; any of them means "unreadable"
                warnings.warn(
                    f"checkpoint step {step} in {self.directory} is unreadable ({type(e).__name__}: {e}); "
                    "falling back to the previous one",
                    RuntimeWarning,
                    stacklevel=2,
                )
                error = e
        if error is not None:
            raise RuntimeError(f"no readable checkpoint in {self.directory} (steps {steps})") from error
        return None
