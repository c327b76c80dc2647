"""Policy losses (PPO-clip, GRPO, GSPO), KL-to-reference estimators, entropy bonus and loss aggregation.

Everything is a pure function of [B, T] arrays aligned with the row's tokens: entry ``t`` is about token
``t`` (its log-prob given tokens ``< t``). ``weights_bt`` is the per-token loss weight: 0 on the prompt,
on tool / observation tokens, on padding and on tokens another row already trains; otherwise the dedup
weight of the token's turn (``trace_jax.rl.batch``). No term of the loss reaches a token of weight 0.

The loss is returned as a numerator whose denominator depends on the weights only
(``loss_denominator``), so a trainer that splits a batch into micro-batches computes the denominator once on
the whole batch and sums the micro-batch gradients of ``numerator / denominator``: the result is the
full-batch gradient exactly. Metrics are (weighted sum, weight) pairs for the same reason: sum them across
micro-batches, then divide.

A "sequence" (for GSPO and the seq-mean modes) is a batch row. With ``trace_jax.rl.batch``'s deduplicated
rows a turn shared by several leaves is trained in one row only, so the seq-mean modes average over those
rows, not over leaf paths; ``token-mean`` gives exactly the per-path objective.

Registries, keyed by config strings: ``POLICY_LOSSES`` (ppo, grpo, gspo, gspo_turn), ``KL_ESTIMATORS``
(k1, k2, k3), ``AGGREGATIONS`` (token-mean, seq-mean-token-mean, seq-mean-token-sum-norm).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from trace_jax.registry import Registry

# exp() of a log-ratio beyond this is numerically meaningless and overflows float32 in the backward pass.
MAX_LOG_RATIO = 20.0

Metrics = dict[str, tuple[jax.Array, jax.Array]]  # name -> (weighted sum, total weight)


@dataclasses.dataclass(frozen=True)
class LossConfig:
    """What the RL loss does.

    Attributes:
      policy_loss: key of ``POLICY_LOSSES``.
      clip_low, clip_high: the ratio is clipped to [1 − clip_low, 1 + clip_high] (DAPO's "clip higher").
      dual_clip: None, or c > 1: for A < 0 the per-token loss is capped at −c·A (dual-clip PPO).
      kl_coef: weight of the KL(π ‖ π_ref) penalty added per token (0 disables it; no reference needed).
      kl_estimator: key of ``KL_ESTIMATORS``.
      entropy_coef: weight of the entropy bonus (the loss gets −entropy_coef · H per token).
      aggregation: key of ``AGGREGATIONS``.
      norm_length: the constant length of ``seq-mean-token-sum-norm``; None uses the row length T.
    """

    policy_loss: str = "ppo"
    clip_low: float = 0.2
    clip_high: float = 0.28
    dual_clip: float | None = None
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    entropy_coef: float = 0.0
    aggregation: str = "token-mean"
    norm_length: int | None = None

    def __post_init__(self):
        for key, registry in (
            ("policy_loss", POLICY_LOSSES),
            ("kl_estimator", KL_ESTIMATORS),
            ("aggregation", AGGREGATIONS),
        ):
            if getattr(self, key) not in registry:
                raise ValueError(f"unknown {key} {getattr(self, key)!r}; choose one of {sorted(registry)}")
        if self.dual_clip is not None and self.dual_clip <= 1.0:
            raise ValueError(f"dual_clip must be > 1 (or None), got {self.dual_clip}")
        if self.clip_low < 0 or self.clip_low >= 1 or self.clip_high < 0:
            raise ValueError(f"need 0 <= clip_low < 1 and clip_high >= 0, got {self.clip_low}, {self.clip_high}")


class LossInputs(NamedTuple):
    """Per-token inputs, all [B, T] (float32 unless noted).

    logprobs: log π_θ(token) under the params being trained (differentiated).
    old_logprobs: log-probs under the policy that sampled the data (the PPO "old" policy).
    advantages: the advantage of each token.
    weights: per-token loss weight (0 = no loss at all).
    segment_ids: int32, id of the token's turn within its row (for turn-level GSPO); any value where weight 0.
    ref_logprobs: log-probs under the reference policy, or None (needed when kl_coef > 0).
    entropies: per-token entropy of π_θ, or None (needed when entropy_coef > 0).
    """

    logprobs: jax.Array
    old_logprobs: jax.Array
    advantages: jax.Array
    weights: jax.Array
    segment_ids: jax.Array
    ref_logprobs: jax.Array | None = None
    entropies: jax.Array | None = None


class LossOutput(NamedTuple):
    numerator: jax.Array  # float32 []: loss = numerator / loss_denominator(weights)
    metrics: Metrics


def _metric(values_bt: jax.Array, weights_bt: jax.Array) -> tuple[jax.Array, jax.Array]:
    return jnp.sum(values_bt * weights_bt), jnp.sum(weights_bt)


def _log_ratio(inputs: LossInputs) -> jax.Array:
    mask = inputs.weights > 0
    diff = jnp.where(mask, inputs.logprobs - inputs.old_logprobs, 0.0)
    return jnp.clip(diff, -MAX_LOG_RATIO, MAX_LOG_RATIO)


# ------------------------------------------------------------------------------------- policy losses
PolicyLoss = Callable[[LossInputs, LossConfig], tuple[jax.Array, Metrics]]
# ``fn(inputs, config) -> (per-token loss [B, T], metrics)`` by name.
POLICY_LOSSES: Registry[PolicyLoss] = Registry("policy loss")
register_policy_loss = POLICY_LOSSES.register


def clipped_surrogate(ratio_bt: jax.Array, inputs: LossInputs, config: LossConfig) -> tuple[jax.Array, Metrics]:
    """Per-token ``max(−A·ρ, −A·clip(ρ, 1−ε_low, 1+ε_high))``, then, if dual_clip = c, ``min(·, −c·A)`` for A < 0."""
    adv = inputs.advantages
    unclipped = -adv * ratio_bt
    clipped = -adv * jnp.clip(ratio_bt, 1.0 - config.clip_low, 1.0 + config.clip_high)
    loss = jnp.maximum(unclipped, clipped)
    metrics = {"clip_fraction": _metric((clipped > unclipped).astype(jnp.float32), inputs.weights)}
    if config.dual_clip is not None:
        cap = -config.dual_clip * adv
        dual = (adv < 0) & (loss > cap)
        loss = jnp.where(dual, cap, loss)
        metrics["dual_clip_fraction"] = _metric(dual.astype(jnp.float32), inputs.weights)
    return loss, metrics


@register_policy_loss("ppo")
def ppo_loss(inputs: LossInputs, config: LossConfig) -> tuple[jax.Array, Metrics]:
    """PPO-clip with a token-level ratio ``ρ_t = π_θ(y_t) / π_old(y_t)`` (see ``clipped_surrogate``)."""
    ratio = jnp.exp(_log_ratio(inputs))
    loss, metrics = clipped_surrogate(ratio, inputs, config)
    metrics["ratio"] = _metric(ratio, inputs.weights)
    return loss, metrics


@register_policy_loss("grpo")
def grpo_loss(inputs: LossInputs, config: LossConfig) -> tuple[jax.Array, Metrics]:
    """GRPO's surrogate: the token-level PPO-clip objective; what makes it GRPO is the group advantage
    (``trace_jax.rl.advantages``) and, in the paper, a KL penalty (``kl_coef``, ``kl_estimator="k3"``)."""
    return ppo_loss(inputs, config)


def _segment_mean(values_bt: jax.Array, weights_bt: jax.Array, segment_bt: jax.Array) -> jax.Array:
    """Per token: the unweighted mean of ``values`` over the trained tokens of its (row, segment)."""
    b, t = values_bt.shape
    mask = (weights_bt > 0).astype(values_bt.dtype)
    ids = (jnp.arange(b)[:, None] * t + jnp.clip(segment_bt, 0, t - 1)).reshape(-1)
    sums = jax.ops.segment_sum((values_bt * mask).reshape(-1), ids, num_segments=b * t)
    counts = jax.ops.segment_sum(mask.reshape(-1), ids, num_segments=b * t)
    return (sums / jnp.maximum(counts, 1.0))[ids].reshape(b, t)


def _gspo(inputs: LossInputs, config: LossConfig, segment_bt: jax.Array) -> tuple[jax.Array, Metrics]:
    log_ratio = _log_ratio(inputs)
    seq_log_ratio = _segment_mean(log_ratio, inputs.weights, segment_bt)
    # GSPO-token: the value is the sequence ratio s_i, the gradient flows through each token's own log-prob.
    ratio = jnp.exp(jax.lax.stop_gradient(seq_log_ratio) + inputs.logprobs - jax.lax.stop_gradient(inputs.logprobs))
    loss, metrics = clipped_surrogate(ratio, inputs, config)
    metrics["ratio"] = _metric(ratio, inputs.weights)
    return loss, metrics


@register_policy_loss("gspo")
def gspo_loss(inputs: LossInputs, config: LossConfig) -> tuple[jax.Array, Metrics]:
    """GSPO, sequence-level ratio: ``s_i = exp(mean_{t ∈ row i} log(π_θ/π_old))``, clipped like PPO.

    The "sequence" is a batch row's trained tokens. GSPO's clip ranges are much tighter than PPO's
    (the paper uses ~3e-4 / 4e-4): set clip_low / clip_high accordingly.
    """
    return _gspo(inputs, config, jnp.zeros_like(inputs.segment_ids))


@register_policy_loss("gspo_turn")
def gspo_turn_loss(inputs: LossInputs, config: LossConfig) -> tuple[jax.Array, Metrics]:
    """GSPO with a turn-level ratio: ``s_{i,k} = exp(mean_{t ∈ turn k of row i} log(π_θ/π_old))``."""
    return _gspo(inputs, config, inputs.segment_ids)


# ------------------------------------------------------------------------------------- KL estimators
# Per-token estimators of KL(π_θ ‖ π_ref) from samples of π_θ, as functions of d = log π_θ − log π_ref
# (Schulman, "Approximating KL divergence"): k1 unbiased but noisy, k3 unbiased and always >= 0.
KL_ESTIMATORS: Registry[Callable[[jax.Array], jax.Array]] = Registry(
    "kl estimator",
    {
        "k1": lambda d: d,
        "k2": lambda d: 0.5 * jnp.square(d),
        "k3": lambda d: jnp.exp(-d) + d - 1.0,
    },
)


# -------------------------------------------------------------------------------------- aggregation
Aggregation = Callable[[jax.Array, jax.Array, LossConfig], tuple[jax.Array, jax.Array]]
# ``fn(loss_bt, weights_bt, config) -> (numerator, denominator)`` by name.
AGGREGATIONS: Registry[Aggregation] = Registry("loss aggregation")
register_aggregation = AGGREGATIONS.register


def _rows_with_loss(weights_bt: jax.Array) -> jax.Array:
    return jnp.sum((jnp.sum(weights_bt, axis=1) > 0).astype(jnp.float32))


@register_aggregation("token-mean")
def token_mean(loss_bt: jax.Array, weights_bt: jax.Array, config: LossConfig) -> tuple[jax.Array, jax.Array]:
    """``Σ_{i,t} w·ℓ / Σ_{i,t} w``: every trained token counts the same (DAPO)."""
    return jnp.sum(loss_bt * weights_bt), jnp.sum(weights_bt)


@register_aggregation("seq-mean-token-mean")
def seq_mean_token_mean(loss_bt: jax.Array, weights_bt: jax.Array, config: LossConfig) -> tuple[jax.Array, jax.Array]:
    """``mean_i (Σ_t w·ℓ / Σ_t w)`` over rows with trained tokens (the original GRPO)."""
    row_weight = jnp.sum(weights_bt, axis=1)
    row_mean = jnp.sum(loss_bt * weights_bt, axis=1) / jnp.maximum(row_weight, 1e-8)
    return jnp.sum(jnp.where(row_weight > 0, row_mean, 0.0)), _rows_with_loss(weights_bt)


@register_aggregation("seq-mean-token-sum-norm")
def seq_mean_token_sum_norm(
    loss_bt: jax.Array, weights_bt: jax.Array, config: LossConfig
) -> tuple[jax.Array, jax.Array]:
    """``mean_i (Σ_t w·ℓ) / L`` with a constant L (``norm_length``, default T): no length bias (Dr. GRPO)."""
    length = config.norm_length or loss_bt.shape[1]
    return jnp.sum(loss_bt * weights_bt) / length, _rows_with_loss(weights_bt)


def loss_denominator(weights_bt: jax.Array, config: LossConfig) -> jax.Array:
    """float32 []: the denominator of ``config.aggregation`` over a whole batch (depends on weights only)."""
    _, denominator = AGGREGATIONS[config.aggregation](jnp.zeros_like(weights_bt), weights_bt, config)
    return denominator


# -------------------------------------------------------------------------------------------- total
def compute_loss(inputs: LossInputs, config: LossConfig) -> LossOutput:
    """Policy loss + kl_coef · KL(π_θ ‖ π_ref) − entropy_coef · H, per token, aggregated to a numerator.

    Divide by ``loss_denominator(all weights of the batch, config)`` to get the loss. Metrics: pg_loss,
    approx_kl (k3 of π_old vs π_θ), clip fractions, ratio, and kl_ref / entropy when those are given.
    """
    per_token, metrics = POLICY_LOSSES[config.policy_loss](inputs, config)
    metrics["pg_loss"] = _metric(per_token, inputs.weights)
    log_ratio = _log_ratio(inputs)
    metrics["approx_kl"] = _metric(KL_ESTIMATORS["k3"](log_ratio), inputs.weights)
    if inputs.ref_logprobs is not None:
        d = jnp.where(inputs.weights > 0, inputs.logprobs - inputs.ref_logprobs, 0.0)
        kl = KL_ESTIMATORS[config.kl_estimator](jnp.clip(d, -MAX_LOG_RATIO, MAX_LOG_RATIO))
        metrics["kl_ref"] = _metric(kl, inputs.weights)
        if config.kl_coef:
            per_token = per_token + config.kl_coef * kl
    elif config.kl_coef:
        raise ValueError("kl_coef > 0 needs ref_logprobs (reference policy log-probs) in the batch")
    if inputs.entropies is not None:
        metrics["entropy"] = _metric(inputs.entropies, inputs.weights)
        if config.entropy_coef:
            per_token = per_token - config.entropy_coef * inputs.entropies
    elif config.entropy_coef:
        raise ValueError("entropy_coef > 0 needs per-token entropies")
    numerator, _ = AGGREGATIONS[config.aggregation](per_token, inputs.weights, config)
    return LossOutput(numerator=numerator, metrics=metrics)


def finalize_metrics(metrics: Metrics) -> dict[str, float]:
    """(sum, count) pairs -> plain floats (sum / count; 0 when count is 0). Host side."""
    return {k: float(s) / float(c) if float(c) else 0.0 for k, (s, c) in metrics.items()}
