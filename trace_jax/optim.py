"""Optimizers shared by SFT and RL: AdamW with warmup + schedule + global-norm clipping, and a non-finite guard.

``make_optimizer`` takes an ``OptimizerConfig`` and/or keyword arguments naming its fields (they win)::

    tx = make_optimizer(learning_rate=1e-5, warmup_steps=10, total_steps=200)
    tx = make_optimizer(schema.optimizer_config(run))     # the run's typed optim section, lengths derived

``guarded_update`` applies one optimizer step only when the loss and every gradient are finite; otherwise
params and optimizer state come back unchanged (same arrays, same shardings) and ``finite`` is False so the
caller can count the skip. It is a pure function, usable inside ``jax.jit``.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from trace_jax.config_utils import documented
from trace_jax.registry import Registry

# ``fn(peak_lr, warmup_steps, decay_steps) -> optax.Schedule`` by name.
SCHEDULES: Registry[Callable[[float, int, int], optax.Schedule]] = Registry("learning-rate schedule")
register_schedule = SCHEDULES.register


@register_schedule("cosine")
def _cosine(peak: float, warmup_steps: int, decay_steps: int) -> optax.Schedule:
    # Linear warmup from 0 to the peak, then cosine down to 10% of it by total_steps.
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=peak,
        warmup_steps=warmup_steps,
        decay_steps=warmup_steps + decay_steps,
        end_value=0.1 * peak,
    )


@register_schedule("constant")
def _constant(peak: float, warmup_steps: int, decay_steps: int) -> optax.Schedule:
    del decay_steps
    if warmup_steps == 0:
        return optax.constant_schedule(peak)
    return optax.join_schedules(
        [optax.linear_schedule(0.0, peak, warmup_steps), optax.constant_schedule(peak)], [warmup_steps]
    )


@register_schedule("linear")
def _linear(peak: float, warmup_steps: int, decay_steps: int) -> optax.Schedule:
    return optax.join_schedules(
        [optax.linear_schedule(0.0, peak, warmup_steps), optax.linear_schedule(peak, 0.0, max(decay_steps, 1))],
        [warmup_steps],
    )


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """Fields ``make_optimizer`` reads (any mapping / ConfigDict with a subset of them works).

    Attributes:
    """

    learning_rate: float = documented(1e-5, "peak learning rate (reached after warmup).")
    warmup_steps: int = documented(0, "linear warmup from 0 over this many optimizer steps.")
    total_steps: int = documented(
        1000,
        "length of the run in optimizer steps; the schedule decays over ``total_steps - warmup``. The main job derives "
        "both from ``rl.steps`` and ``rl.warmup_steps`` (``trace_jax.configs.schema.derived``).",
    )
    weight_decay: float = documented(
        0.0,
        "decoupled AdamW weight decay, applied to params with ndim >= 2 only (not to norms, biases).",
    )
    max_grad_norm: float | None = documented(1.0, "clip gradients to this global norm; 0 or None disables clipping.")
    b1: float = documented(0.9, "Adam moments.")
    b2: float = documented(0.999, "Adam moments.")
    eps: float = documented(1e-8, "Adam moments.")
    schedule: str = documented("cosine", 'a key of ``SCHEDULES`` ("cosine", "constant", "linear").')
    master_dtype: str | None = documented(
        None,
        'None (the optimizer works in the params\' dtype) or "float32": keep a float32 master copy of the params in '
        "the optimizer state, with float32 Adam moments, and write each update back rounded to the params' dtype. "
        'Use it with ``ModelConfig(param_dtype="bfloat16")`` (bf16 weights, fp32 optimizer state: 2 + 4 + 8 = 14 '
        'bytes per parameter). ``param_dtype="float32", dtype="bfloat16"`` without it (12 bytes per parameter, bf16 '
        "compute) is the cheaper choice when weights may stay fp32.",
    )


def _resolve(config: OptimizerConfig | None, fields: dict[str, Any]) -> OptimizerConfig:
    """``config`` (default: ``OptimizerConfig()``) with ``fields`` replaced; an unknown field is a ValueError
    naming the nearest ones."""
    known = [f.name for f in dataclasses.fields(OptimizerConfig)]
    for key in fields:
        if key not in known:
            near = difflib.get_close_matches(key, known, n=3)
            hint = f"; did you mean {' or '.join(near)}?" if near else ""
            raise ValueError(f"OptimizerConfig has no field {key!r}{hint} (fields: {', '.join(known)})")
    return dataclasses.replace(config or OptimizerConfig(), **fields)


def make_schedule(config: OptimizerConfig | None = None, **kwargs: Any) -> optax.Schedule:
    """The learning-rate schedule ``make_optimizer`` uses (step -> lr), for logging the current lr."""
    cfg = _resolve(config, kwargs)
    if cfg.warmup_steps < 0 or cfg.total_steps <= 0:
        raise ValueError(f"need warmup_steps >= 0 and total_steps > 0, got {cfg.warmup_steps}, {cfg.total_steps}")
    return SCHEDULES[cfg.schedule](cfg.learning_rate, cfg.warmup_steps, max(cfg.total_steps - cfg.warmup_steps, 1))


def decay_mask(params: Any) -> Any:
    """Weight-decay mask: True for matrices (ndim >= 2), False for norm scales and biases."""
    return jax.tree.map(lambda x: jnp.ndim(x) >= 2, params)


def make_optimizer(config: OptimizerConfig | None = None, **kwargs: Any) -> optax.GradientTransformation:
    """AdamW + warmup + schedule, after global-norm gradient clipping.

    Args:
      config: an ``OptimizerConfig`` (default: its defaults).
      **kwargs: the same fields as keywords; they override ``config``.

    Returns:
      An ``optax.GradientTransformation`` whose state works on any params pytree (e.g. ``nnx.State``).
    """
    cfg = _resolve(config, kwargs)
    schedule = make_schedule(cfg)
    parts = []
    if cfg.max_grad_norm:
        parts.append(optax.clip_by_global_norm(cfg.max_grad_norm))
    parts.append(
        optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay, mask=decay_mask)
    )
    optimizer = optax.chain(*parts)
    if cfg.master_dtype is None:
        return optimizer
    if cfg.master_dtype != "float32":
        raise ValueError(f"master_dtype={cfg.master_dtype!r}; use None or 'float32'")
    return with_master_weights(optimizer, jnp.float32)


class MasterWeightsState(NamedTuple):
    """``master``: the params in the master dtype (sharded like them); ``inner``: the wrapped optimizer's state."""

    master: Any
    inner: Any


def with_master_weights(inner: optax.GradientTransformation, dtype: Any) -> optax.GradientTransformation:
    """Runs ``inner`` on a ``dtype`` master copy of the params (moments in ``dtype`` too).

    The update it returns is ``new_master - params`` in ``dtype``, so ``optax.apply_updates`` (which adds in the
    promoted dtype, then casts back) leaves the params equal to the new master rounded to their own dtype:
    small steps accumulate in the master copy instead of rounding away in bf16.
    """

    def init(params):
        master = jax.tree.map(lambda p: jnp.asarray(p, dtype), params)
        return MasterWeightsState(master, inner.init(master))

    def update(grads, state, params=None):
        grads = jax.tree.map(lambda g: jnp.asarray(g, dtype), grads)
        updates, inner_state = inner.update(grads, state.inner, state.master)
        master = optax.apply_updates(state.master, updates)
        reference = state.master if params is None else params
        delta = jax.tree.map(lambda m, p: m - jnp.asarray(p, dtype), master, reference)
        return delta, MasterWeightsState(master, inner_state)

    return optax.GradientTransformation(init, update)


# ------------------------------------------------------------------------------------------- shardings
def optimizer_shardings(optimizer: optax.GradientTransformation, params: Any, param_shardings: Any, other: Any) -> Any:
    """The sharding of every optimizer-state leaf: each copy of the params tree inside the state (Adam's
    ``mu`` and ``nu``, master weights, ...) gets ``param_shardings`` leaf for leaf; every other leaf (step
    counts, schedule state) gets ``other`` (typically replicated over the mesh).

    ``params`` may be abstract (``jax.ShapeDtypeStruct``); nothing is allocated. Use the result as
    ``jax.jit(optimizer.init, out_shardings=...)`` so the state is born sharded, never whole on a device.
    """
    subset = getattr(optimizer, "subset", None)  # a state over some params only (``models.lora.TrainedSubset``)
    if subset is not None:
        params, param_shardings = subset(params), subset(param_shardings)
    abstract_state = jax.eval_shape(optimizer.init, params)
    return optax.tree_map_params(
        optimizer,
        lambda _, sharding: sharding,
        abstract_state,
        param_shardings,
        transform_non_params=lambda _: other,
    )


def init_sharded(optimizer: optax.GradientTransformation, params: Any, other: Any) -> Any:
    """``optimizer.init(params)`` with every state leaf created on its shards (see ``optimizer_shardings``):
    moments take their parameter's sharding, the rest ``other``. ``params`` must be placed arrays."""
    shardings = optimizer_shardings(optimizer, params, jax.tree.map(lambda x: x.sharding, params), other)
    return jax.jit(optimizer.init, out_shardings=shardings)(params)


# --------------------------------------------------------------------------------------- non-finite guard
class GuardedUpdate(NamedTuple):
    """Result of ``guarded_update``; every field is a jax value, so it can leave a jit'd step as is."""

    params: Any
    opt_state: Any
    finite: jax.Array  # bool []: the update was applied
    grad_norm: jax.Array  # float32 []: global norm of the raw gradients (before clipping)


def all_finite(*trees: Any) -> jax.Array:
    """bool []: True when every leaf of every tree is finite (no NaN / inf)."""
    leaves = [leaf for tree in trees for leaf in jax.tree.leaves(tree)]
    if not leaves:
        return jnp.asarray(True)
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(leaf)) for leaf in leaves]))


def guarded_update(
    optimizer: optax.GradientTransformation, grads: Any, opt_state: Any, params: Any, loss: jax.Array | None = None
) -> GuardedUpdate:
    """One optimizer step, skipped when ``loss`` or any gradient is non-finite.

    On a skip, params and optimizer state (including its step count, so the schedule does not advance)
    are the inputs unchanged. Selection is elementwise (``jnp.where``) so shardings are preserved.
    """
    finite = all_finite(grads) if loss is None else jnp.logical_and(all_finite(grads), jnp.all(jnp.isfinite(loss)))
    grad_norm = optax.global_norm(grads)
    # Zero the grads on a skip so NaNs never flow through the optimizer arithmetic.
    safe_grads = jax.tree.map(lambda g: jnp.where(finite, g, jnp.zeros_like(g)), grads)
    updates, new_opt_state = optimizer.update(safe_grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)

    def keep(new, old):
        return jnp.where(finite, new, old)

    return GuardedUpdate(
        params=jax.tree.map(keep, new_params, params),
        opt_state=jax.tree.map(keep, new_opt_state, opt_state),
        finite=finite,
        grad_norm=grad_norm,
    )
