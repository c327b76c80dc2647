"""Low-rank adapters (LoRA) on a policy's projections, written as nnx variables of their own.

A projection ``W`` (stacked over layers: ``[l, *in, *out]``) with adapters computes with
``W_eff = stop_gradient(W) + s * A @ B``, ``A [l, *in, r]``, ``B [l, r, *out]``, ``s = alpha / r``. ``A`` starts
random (scaled by its fan-in) and ``B`` at zero, so a freshly adapted model computes exactly what the base does.
The factors are ``LoRAParam`` (an ``nnx.Param`` subclass): ``nnx.split(model, LoRAParam, nnx.Param)`` parts
the trained adapters from the frozen base, and ``frozen_base`` keeps an optimizer off the base.

The gradient reaching the factors is the dense weight gradient ``G = dL/dW_eff`` projected through them:
``dL/dA = s * G @ B^T`` and ``dL/dB = s * A^T @ G``; the base gets none (``stop_gradient``), so a backward pass
computes no base weight gradient. The merge happens where the layer takes its weight (``weight``), inside the
layer scan, one layer at a time: training and the decode programs run base + adapters with no merged copy kept,
and a weight sync after an update needs only the ``LoRAParam`` leaves.

Why our own variables rather than ``qwix.LoraProvider``: qwix intercepts ``dot_general``/``einsum`` by the
module path of the op, while these models run their layers by ``lax.scan`` over ``nnx.split`` state and
contract through ``token_matmul``'s reshapes, so the interception point is not the projection's; adapters as
variables of the layer ride the scan, the sharding table (their ``logical_axes``) and checkpoints unchanged.

QLoRA (``base_quant``): ``quantize_base`` replaces each adapted projection's base by frozen integer storage
(``QuantizedBase``): ``<projection>`` holds symmetric absmax integers per output channel and
``<projection>_scale`` one float32 scale per output column (``[l, 1 per input axis, *out]``, the output axes'
logical names), so the base takes one byte a weight in memory. ``weight`` dequantizes it before adding ``A @ B``.
Which formats are offered is measured, not assumed (``trace_jax.bench.qlora_error``; docs/lora.md): int8 per
channel keeps nearly all of the policy's greedy tokens, int4 (per channel or per group of 32) does not.

Which projections take adapters: a module lists them in its class attribute ``LORA_TARGETS`` (projection
attribute -> number of leading input axes after the layers axis); the dense ``Attention`` and ``MLP`` do, a
mixture of experts' expert stacks do not (not adapted here).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from trace_jax.config_utils import documented

# A config target name -> the projection attribute it adapts.
TARGETS = {
    "q": "q_proj",
    "k": "k_proj",
    "v": "v_proj",
    "o": "o_proj",
    "gate": "gate_proj",
    "up": "up_proj",
    "down": "down_proj",
}


class LoRAParam(nnx.Param):
    """A LoRA factor (``A`` or ``B``): the trained part of an adapted model."""


class QuantizedBase(nnx.Param):
    """Frozen quantized storage of an adapted projection's base: its integer values (``<projection>``) or their
    per-output-channel float32 scales (``<projection>_scale``). Never trained: no gradient reaches it
    (``weight`` reads it under ``stop_gradient`` and the trainer differentiates the adapters alone)."""


# ``lora.base_quant`` -> the integer bits of the frozen base (None: the base keeps its dtype).
BASE_QUANT = {"none": None, "int8": 8}
# Formats measured and refused, with the measurement (``python -m trace_jax.bench.qlora_error``, docs/lora.md).
REFUSED_BASE_QUANT = {
    "int4": "on the default job's policy, int4 moves the logits by up to 6.45 with one scale per output channel "
    "and 4.83 with one per 32 input rows (int8 per channel: 0.295) and changes 31% and 30% of its greedy tokens "
    "(int8: 1.2%)",
}


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
    """Low-rank adapters on the policy: the base weights stay frozen and only the adapters train."""

    rank: int = documented(0, "adapter rank r; 0 (the default) trains every weight of the policy (no adapters).")
    alpha: float = documented(16.0, "adapter scale numerator: the update is (alpha / rank) * A @ B.")
    targets: str = documented(
        "q,k,v,o,gate,up,down",
        "comma-separated projections that take adapters, from q, k, v, o (attention) and gate, up, down (the "
        "dense feed-forward block; a mixture of experts' expert weights take none).",
    )
    base_quant: str = documented(
        "none",
        "storage of the frozen base of every adapted projection (QLoRA): 'none' keeps its dtype; 'int8' stores "
        "symmetric absmax int8 values with one float32 scale per output channel (a byte a weight; dequantized "
        "before the adapters are added). Needs lora.rank > 0. int4 is refused: measured not exact enough "
        "(docs/lora.md).",
    )

    def __post_init__(self):
        if self.rank < 0:
            raise ValueError(f"lora.rank={self.rank}; use 0 (no adapters) or a positive rank")
        unknown = sorted(set(self.target_names) - set(TARGETS))
        if unknown:
            raise ValueError(f"lora.targets names {unknown}; choose from {', '.join(TARGETS)}")
        if self.rank and not self.target_names:
            raise ValueError("lora.targets is empty; name at least one projection (e.g. 'q,v')")
        if self.base_quant in REFUSED_BASE_QUANT:
            raise ValueError(
                f"lora.base_quant={self.base_quant!r} is refused: {REFUSED_BASE_QUANT[self.base_quant]}; "
                "use lora.base_quant=int8"
            )
        if self.base_quant not in BASE_QUANT:
            raise ValueError(f"lora.base_quant={self.base_quant!r}; choose one of {', '.join(BASE_QUANT)}")
        if BASE_QUANT[self.base_quant] and not self.rank:
            raise ValueError(
                f"lora.base_quant={self.base_quant!r} quantizes the frozen base under adapters; set lora.rank > 0"
            )

    @property
    def target_names(self) -> tuple[str, ...]:
        return tuple(name.strip() for name in self.targets.split(",") if name.strip())

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def _a_name(projection: str) -> str:
    return f"{projection}_lora_a"


def _b_name(projection: str) -> str:
    return f"{projection}_lora_b"


def _scale_name(projection: str) -> str:
    return f"{projection}_scale"


def quantize(w: jax.Array, bits: int, in_axes: int) -> tuple[jax.Array, jax.Array]:
    """``w`` (``[l, *in, *out]``: the layers axis, ``in_axes`` input axes, the output axes) as symmetric absmax
    ``bits``-bit integers per output channel of each layer: ``(int8 values, float32 scale)``, the scale
    ``[l, 1 per input axis, *out]``, ``values * scale`` the dequantized weight. An all-zero column gets scale 1."""
    top = 2 ** (bits - 1) - 1
    w = w.astype(jnp.float32)
    scale = jnp.max(jnp.abs(w), axis=tuple(range(1, 1 + in_axes)), keepdims=True) / top
    scale = jnp.where(scale == 0, 1.0, scale)
    return jnp.clip(jnp.round(w / scale), -top, top).astype(jnp.int8), scale


def dequantize(values: jax.Array, scale: jax.Array) -> jax.Array:
    """``values * scale`` in float32 (``quantize``'s inverse up to rounding); broadcasts with or without the
    layers axis (the scale keeps a size-1 axis per input axis)."""
    return values.astype(jnp.float32) * scale


def weight(module: nnx.Module, projection: str) -> jax.Array:
    """The weight ``module.<projection>`` computes with: the base alone, or with adapters
    ``stop_gradient(W) + s * A @ B`` in the adapters' dtype (``s`` is ``module.lora_scale``). A quantized base
    (``quantize_base``) is dequantized first, in float32, and the sum rounded once to the adapters' dtype."""
    base = getattr(module, projection).value
    a = getattr(module, _a_name(projection), None)
    if a is None:
        return base
    b = getattr(module, _b_name(projection)).value
    delta = jnp.tensordot(a.value.astype(jnp.float32), b.astype(jnp.float32), axes=1) * module.lora_scale
    scale = getattr(module, _scale_name(projection), None)
    if scale is not None:
        dense = jax.lax.stop_gradient(dequantize(base, scale.value))
        return (dense + delta).astype(a.value.dtype)
    return jax.lax.stop_gradient(base) + delta.astype(base.dtype)


def _projections(model: nnx.Module) -> Iterator[tuple[nnx.Module, str, int]]:
    """``(module, projection, in_axes)`` for every projection a module of ``model`` lists in ``LORA_TARGETS``
    (taken as a list first: the caller may set attributes on the modules)."""
    for _, module in list(nnx.iter_graph(model)):
        targets = getattr(type(module), "LORA_TARGETS", None)
        if isinstance(module, nnx.Module) and targets:
            yield from ((module, projection, in_axes) for projection, in_axes in targets.items())


def add_adapters(model: nnx.Module, config: LoRAConfig, rngs: nnx.Rngs) -> int:
    """Attaches ``A``/``B`` factors (``LoRAParam``) to every targeted projection of ``model`` in place and
    returns how many projections took them (0 with ``config.rank == 0``: the model is left untouched).

    Each adapted module gets ``<projection>_lora_a`` ``[l, *in, r]`` (normal / sqrt(fan-in)),
    ``<projection>_lora_b`` ``[l, r, *out]`` (zeros) and ``lora_scale``; factors carry the base's logical axes
    (the rank axis unnamed, never sharded) and its dtype."""
    if not config.rank:
        return 0
    wanted = {TARGETS[name] for name in config.target_names}
    adapted = 0
    for module, projection, in_axes in _projections(model):
        if projection in wanted:
            base = getattr(module, projection)
            axes = base.get_metadata()["logical_axes"]
            split = 1 + in_axes  # the layers axis, then the input axes
            fan_in = math.prod(base.value.shape[1:split])
            a_shape = (*base.value.shape[:split], config.rank)
            b_shape = (base.value.shape[0], config.rank, *base.value.shape[split:])
            a = jax.random.normal(rngs.params(), a_shape, jnp.float32) / math.sqrt(fan_in)
            setattr(
                module, _a_name(projection), LoRAParam(a.astype(base.value.dtype), logical_axes=(*axes[:split], None))
            )
            b = jnp.zeros(b_shape, base.value.dtype)
            setattr(module, _b_name(projection), LoRAParam(b, logical_axes=(axes[0], None, *axes[split:])))
            module.lora_scale = config.scale
            adapted += 1
    return adapted


def quantize_base(model: nnx.Module, config: LoRAConfig) -> int:
    """Replaces, in place, the base weight of every projection of ``model`` that carries adapters by its frozen
    quantized storage (``config.base_quant``; ``QuantizedBase``): ``<projection>`` the integer values (the
    base's logical axes) and ``<projection>_scale`` the float32 scales (the output axes' logical names, ``None``
    on the size-1 input axes). Returns how many projections it quantized (0 with ``base_quant='none'``). Call it
    after ``add_adapters`` (the factors take the base's floating dtype)."""
    bits = BASE_QUANT[config.base_quant]
    if not bits:
        return 0
    quantized = 0
    for module, projection, in_axes in _projections(model):
        base = getattr(module, projection, None)
        if hasattr(module, _a_name(projection)) and not isinstance(base, QuantizedBase):
            axes = base.get_metadata()["logical_axes"]
            values, scale = quantize(base.value, bits, in_axes)
            setattr(module, projection, QuantizedBase(values, logical_axes=axes))
            scale_axes = (axes[0], *(None,) * in_axes, *axes[1 + in_axes :])
            setattr(module, _scale_name(projection), QuantizedBase(scale, logical_axes=scale_axes))
            quantized += 1
    return quantized


def is_adapter_path(path: tuple[Any, ...]) -> bool:
    """Whether a state path names a LoRA factor (its last key ends in ``_lora_a`` / ``_lora_b``)."""
    return str(path[-1]).endswith(("_lora_a", "_lora_b"))


def has_adapters(params: Any) -> bool:
    """Whether ``params`` is an ``nnx.State`` that holds LoRA factors."""
    return isinstance(params, nnx.State) and any(is_adapter_path(path) for path, _ in nnx.to_flat_state(params))


def frozen_base(optimizer: optax.GradientTransformation, params: Any) -> optax.GradientTransformation:
    """``optimizer`` on the LoRA factors only: its state holds the adapters' moments alone, clipping and weight
    decay see only them, and every base leaf gets a zero update. ``params`` (unused beyond the signature shared
    with other wrappers) is the state it will run on.

    A wrapper rather than ``optax.multi_transform``: the latter's masked state leaves ``MaskedNode`` where the
    base is, which ``optax.tree_map_params`` (the sharded init, ``trace_jax.optim.optimizer_shardings``) cannot
    pair with the full params tree."""
    del params

    def init(params: Any) -> Any:
        # ``optax.tree_map_params`` initialises with a placeholder standing for the (already chosen) subset.
        return optimizer.init(adapter_state(params) if isinstance(params, nnx.State) else params)

    def update(grads: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        updates, state = optimizer.update(
            adapter_state(grads), state, None if params is None else adapter_state(params)
        )
        base = grads.filter(lambda path, _: not is_adapter_path(path))
        return nnx.merge_state(jax.tree.map(jnp.zeros_like, base), updates), state

    return TrainedSubset(init, update, adapter_state)


class TrainedSubset(NamedTuple):
    """An optax transformation whose state covers only ``subset(params)`` (``trace_jax.optim``'s sharded init
    reads ``subset`` to pair the state's moments with those params' shardings)."""

    init: Any
    update: Any
    subset: Any


def adapter_state(params: Any) -> Any:
    """The LoRA factors of an ``nnx.State`` of params (what a weight sync or an adapter export moves)."""
    return params.filter(lambda path, _: is_adapter_path(path))


def trained_part(params: Any) -> Any:
    """The part of a policy's params that training changes: the adapters when ``params`` has them, else all of
    ``params``. What a checkpoint keeps (the frozen base is rebuilt from the run's start, never saved) and what a
    weight sync sends once the engine holds the base (``received``)."""
    return adapter_state(params) if has_adapters(params) else params


def adapters_only(params: Any) -> bool:
    """Whether an ``nnx.State`` holds LoRA factors and nothing else (what ``trained_part`` gives with adapters)."""
    if not isinstance(params, nnx.State):
        return False
    paths = [path for path, _ in nnx.to_flat_state(params)]
    return bool(paths) and all(is_adapter_path(path) for path in paths)


def received(held: Any, incoming: Any) -> Any:
    """The weights a holder of ``held`` (None: nothing yet) holds after a sync sends it ``incoming``: ``incoming``
    when it is a whole policy; ``held`` with its LoRA factors replaced when ``incoming`` holds factors alone."""
    if not adapters_only(incoming):
        return incoming
    if held is None or not has_adapters(held):
        raise ValueError(
            "a weight sync sent LoRA adapters alone to a holder without the adapted base; send the whole policy first"
        )
    return nnx.merge_state(held, incoming)


def with_trained_part(params: Any, trained: Any) -> Any:
    """``params`` with its trained part replaced by ``trained`` (what ``trained_part`` gave): the adapters merged
    into ``params``' base, or ``trained`` itself when there are no adapters."""
    return nnx.merge_state(params, trained) if has_adapters(params) else trained


def base_path(path: tuple[Any, ...]) -> tuple[Any, ...]:
    """The state path of the base projection a factor's path adapts (``(..., "q_proj_lora_a")`` ->
    ``(..., "q_proj")``)."""
    return (*path[:-1], str(path[-1]).removesuffix("_lora_a").removesuffix("_lora_b"))


def merged(params: Any, scale: float) -> Any:
    """The params of the same model without adapters: every adapted base ``W`` replaced by
    ``W + scale * A @ B`` (computed in float32, stored in ``W``'s dtype, as ``weight`` computes it) and the
    factors dropped. ``scale`` is the adapters' ``alpha / rank``. A quantized base (``quantize_base``) is
    dequantized (float32) first and the sum stored, as a plain ``nnx.Param``, in the adapters' dtype; its
    scales are dropped."""
    flat = dict(nnx.to_flat_state(params))
    out = []
    for path, variable in flat.items():
        if is_adapter_path(path) or _is_scale_of(path, flat):
            continue
        a = flat.get((*path[:-1], _a_name(str(path[-1]))))
        if a is not None:
            b = flat[(*path[:-1], _b_name(str(path[-1])))]
            per_layer = jax.vmap(lambda a, b: jnp.tensordot(a, b, axes=1))  # factors stack over the layers axis
            delta = per_layer(a.value.astype(jnp.float32), b.value.astype(jnp.float32)) * scale
            quant_scale = flat.get((*path[:-1], _scale_name(str(path[-1]))))
            if quant_scale is None:
                variable = variable.replace(variable.value + delta.astype(variable.value.dtype))
            else:
                dense = dequantize(variable.value, quant_scale.value) + delta
                variable = nnx.Param(dense.astype(a.value.dtype), **variable.get_metadata())
        out.append((path, variable))
    return nnx.from_flat_state(out)


def _is_scale_of(path: tuple[Any, ...], flat: dict[tuple[Any, ...], Any]) -> bool:
    """Whether ``path`` is a quantized base's scale (``<projection>_scale`` beside a ``QuantizedBase``)."""
    name = str(path[-1])
    if not name.endswith("_scale"):
        return False
    return isinstance(flat.get((*path[:-1], name.removesuffix("_scale"))), QuantizedBase)


def without_adapters(params: Any) -> Any:
    """``params`` with every ``B`` factor zero: the base policy (the reference), sharing the base arrays."""
    return nnx.map_state(lambda path, x: jnp.zeros_like(x) if str(path[-1]).endswith("_lora_b") else x, params)
