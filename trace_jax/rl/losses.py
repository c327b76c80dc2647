"""Policy losses (PPO-clip, GRPO, GSPO-turn), KL-to-reference penalties, entropy bonus and loss aggregation.

Everything is a pure function of [B, T] arrays aligned with the row's tokens: entry ``t`` is about token
``t`` (its log-prob given the tokens before it on its path). The objective is the *per-path* one: every
root-to-leaf path ``ℓ`` is a sequence, its trained tokens carry its advantage ``A(ℓ, y)``, and the
aggregation weighs path ``ℓ`` by a coefficient ``c_ℓ`` (``AGGREGATIONS``) and divides by a denominator. A
token shared by several paths is trained once (``trace_jax.rl.batch``) with

    weights  = Σ_{ℓ ∋ t} c_ℓ,   adv_pos = Σ_{ℓ ∋ t} c_ℓ · max(A(ℓ, y), 0),   adv_neg = Σ_{ℓ ∋ t} c_ℓ · min(A(ℓ, y), 0).

The clipped surrogate is linear in A for each sign of A (``clipped_surrogate``), and the ratio of a shared
token is the same on every path, so the sum over paths is exactly
``−adv_pos · min(ρ, 1 + ε_high) + |adv_neg| · max(ρ, 1 − ε_low)``: the same loss and gradient as
training every path, clipping included. KL and entropy terms are linear in the weight.

The loss is a numerator whose denominator depends on the batch only (``loss_denominator``), so a trainer
that splits a batch into micro-batches computes the denominator once and sums the micro-batch gradients of
``numerator / denominator``: the full-batch gradient exactly. Metrics are (weighted sum, weight) pairs for
the same reason (names ending in ``_max`` are (max, 1) and combine by max).

Registries, keyed by config strings: ``POLICY_LOSSES`` (ppo, grpo, gspo, gspo_turn), ``KL_PENALTIES`` (reverse,
forward: named by the KL whose gradient they give), ``AGGREGATIONS`` (token-mean, seq-mean-token-mean,
seq-mean-token-sum-norm).

GSPO's sequence-level ratio ``s_ℓ`` belongs to a whole path, whose tokens a tree batch spreads over rows and
shares with other paths, so no micro-batch can compute it: ``trace_jax.rl.sequences`` computes every path's
``s_ℓ`` from the whole batch's log-probs at the params of the step and hands the loss, per token, the sums
over its paths of the path's surrogate and of its slope (``sequence_surrogate``); ``gspo_loss`` turns those
into a loss with the right value and gradient.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from trace_jax.config_utils import documented
from trace_jax.registry import Registry

# exp() of a log-ratio beyond this is numerically meaningless and overflows float32 in the backward pass.
MAX_LOG_RATIO = 20.0

Metrics = dict[str, tuple[jax.Array, jax.Array]]  # name -> (weighted sum, total weight), or (max, 1) for *_max


@dataclasses.dataclass(frozen=True)
class LossConfig:
    """What the RL loss does."""

    policy_loss: str = documented(
        "ppo",
        'key of ``POLICY_LOSSES``. GSPO\'s paper objective needs aggregation "seq-mean-token-mean" (token-mean weighs '
        'each sequence by its length); "gspo" has one ratio per whole root-to-leaf path (its batch needs '
        '``RLTrainer.update(..., path_tokens=info.path_tokens)``), "gspo_turn" one per turn.',
    )
    clip_low: float = documented(0.2, 'the ratio is clipped to [1 − clip_low, 1 + clip_high] (DAPO\'s "clip higher").')
    clip_high: float = documented(
        0.28,
        'the ratio is clipped to [1 − clip_low, 1 + clip_high] (DAPO\'s "clip higher").',
    )
    dual_clip: float | None = documented(
        None,
        "None, or c > 1: for A < 0 the per-token loss is capped at −c·A (dual-clip PPO).",
    )
    kl_coef: float = documented(
        0.0,
        "weight of the KL-to-reference penalty per token (0 disables it: no reference log-probs are computed and no "
        "reference policy is needed).",
    )
    kl: str = documented(
        "reverse",
        "key of ``KL_PENALTIES``, named by the KL whose gradient the penalty gives in expectation over on-policy "
        'samples: "reverse" → ∇ KL(π_θ ‖ π_ref) (the k2 estimator ½(log π_θ − log π_ref)² as a loss; the usual meaning '
        'of "a KL penalty"), "forward" → ∇ KL(π_ref ‖ π_θ) (the k3 estimator as a loss, what GRPO\'s paper uses). (The '
        "k1 estimator log π_θ − log π_ref has expected gradient 0 and is not offered.)",
    )
    entropy_coef: float = documented(
        0.0,
        "weight of the entropy bonus (the loss gets −entropy_coef · H per token); 0: the entropy over the vocabulary "
        "is not computed at all.",
    )
    aggregation: str = documented("token-mean", "key of ``AGGREGATIONS``.")
    norm_length: int | None = documented(
        None,
        "the constant length L of ``seq-mean-token-sum-norm`` (Dr. GRPO), the same for every batch of a run; None: the "
        "batch layout's largest row length (``BatchConfig.length_buckets[-1]``, which configs set to the engine's "
        "``max_len``), a bound on any path's trained tokens.",
    )
    router_aux_loss_coef: float = documented(
        0.0,
        "weight of a mixture-of-experts policy's load-balancing loss (``trace_jax.models.moe.router_aux_loss``, "
        "transformers' ``load_balancing_loss_func``) in the RL loss: an additive term, whatever the aggregation (not "
        "divided by the policy loss's denominator). Each optimizer step pools the statistics over every non-padding "
        "token of its rows (prompts and observations included: the router routes them too), as transformers pools over "
        "a batch, and adds ``coef x`` that loss divided by the optimizer steps of an epoch, so an epoch's steps, whose "
        "policy losses sum to the full-batch objective, add ``coef x`` the mean of their load-balancing losses (with "
        "one mini-batch: objective + coef x the batch's). 0 (the default): not added, only logged "
        "(``router_aux_loss``, the steps' mean). Added by the trainer (``trace_jax.rl.trainer``); no effect on a dense "
        "policy. Not the checkpoint's own coefficient (``MoeConfig.hf_router_aux_loss_coef``, kept for export only).",
    )

    def __post_init__(self):
        for key, registry in (
            ("policy_loss", POLICY_LOSSES),
            ("kl", KL_PENALTIES),
            ("aggregation", AGGREGATIONS),
        ):
            if getattr(self, key) not in registry:
                raise ValueError(f"unknown {key} {getattr(self, key)!r}; choose one of {sorted(registry)}")
        if self.dual_clip is not None and self.dual_clip <= 1.0:
            raise ValueError(f"dual_clip must be > 1 (or None), got {self.dual_clip}")
        if self.clip_low < 0 or self.clip_low >= 1 or self.clip_high < 0:
            raise ValueError(f"need 0 <= clip_low < 1 and clip_high >= 0, got {self.clip_low}, {self.clip_high}")
        if self.norm_length is not None and self.norm_length < 1:
            raise ValueError(f"norm_length must be >= 1 (or None), got {self.norm_length}")
        if self.router_aux_loss_coef < 0:
            raise ValueError(f"router_aux_loss_coef must be >= 0, got {self.router_aux_loss_coef}")


class LossInputs(NamedTuple):
    """Per-token inputs, all [B, T] (float32 unless noted); see the module docstring for the weights.

    logprobs: log π_θ(token) under the params being trained (differentiated).
    old_logprobs: log-probs under the behaviour policy (the distribution the tokens were sampled from).
    adv_pos / adv_neg: Σ over the token's paths of c_ℓ · max(A, 0) / c_ℓ · min(A, 0).
    weights: Σ over the token's paths of c_ℓ (0 = no loss at all).
    segment_ids: int32 in [0, T), id of the token's turn within its row (turn-level GSPO); any value where
      weight is 0.
    ref_logprobs: log-probs under the reference policy, or None (needed when kl_coef > 0).
    entropies: per-token entropy of π_θ, or None (needed when entropy_coef > 0).
    seq_loss / seq_grad: sequence-level GSPO only (``trace_jax.rl.sequences.sequence_terms``), else None: Σ over
      the token's paths of V_ℓ / |ℓ| and of (dV_ℓ / d log s_ℓ) / |ℓ|, V_ℓ the path's clipped surrogate at the
      params whose ``logprobs`` these are.
    """

    logprobs: jax.Array
    old_logprobs: jax.Array
    adv_pos: jax.Array
    adv_neg: jax.Array
    weights: jax.Array
    segment_ids: jax.Array
    ref_logprobs: jax.Array | None = None
    entropies: jax.Array | None = None
    seq_loss: jax.Array | None = None
    seq_grad: jax.Array | None = None

    @classmethod
    def from_advantages(cls, logprobs, old_logprobs, advantages, weights, segment_ids, **kwargs) -> LossInputs:
        """Inputs where every token belongs to one path: ``adv_pos / adv_neg`` = weight × the advantage's part."""
        weighted = advantages * weights
        return cls(
            logprobs,
            old_logprobs,
            jnp.maximum(weighted, 0.0),
            jnp.minimum(weighted, 0.0),
            weights,
            segment_ids,
            **kwargs,
        )


class LossOutput(NamedTuple):
    numerator: jax.Array  # float32 []: loss = numerator / loss_denominator(...)
    metrics: Metrics


def _metric(values_bt: jax.Array, weights_bt: jax.Array) -> tuple[jax.Array, jax.Array]:
    return jnp.sum(values_bt * weights_bt), jnp.sum(weights_bt)


def _max_metric(values_bt: jax.Array, weights_bt: jax.Array) -> tuple[jax.Array, jax.Array]:
    return jnp.max(jnp.where(weights_bt > 0, values_bt, -jnp.inf)), jnp.ones((), jnp.float32)


def _log_ratio(inputs: LossInputs) -> jax.Array:
    mask = inputs.weights > 0
    diff = jnp.where(mask, inputs.logprobs - inputs.old_logprobs, 0.0)
    return jnp.clip(diff, -MAX_LOG_RATIO, MAX_LOG_RATIO)


# ------------------------------------------------------------------------------------- policy losses
PolicyLoss = Callable[[LossInputs, LossConfig], tuple[jax.Array, Metrics]]
# ``fn(inputs, config) -> (per-token weighted policy loss [B, T], metrics)`` by name.
POLICY_LOSSES: Registry[PolicyLoss] = Registry("policy loss")
register_policy_loss = POLICY_LOSSES.register


def clipped_surrogate(ratio_bt: jax.Array, inputs: LossInputs, config: LossConfig) -> tuple[jax.Array, Metrics]:
    """Per token, summed over its paths: ``Σ_ℓ c_ℓ max(−A·ρ, −A·clip(ρ, 1−ε_low, 1+ε_high))``.

    For A > 0 that is ``−A·min(ρ, 1+ε_high)``, for A < 0 ``|A|·max(ρ, 1−ε_low)`` (and with dual_clip = c,
    ``|A|·min(max(ρ, 1−ε_low), c)``): linear in A per sign, hence ``adv_pos`` / ``adv_neg``. The clip
    fraction is the share of the |advantage| mass whose gradient the clip removes.
    """
    low, high = 1.0 - config.clip_low, 1.0 + config.clip_high
    negative = jnp.maximum(ratio_bt, low)
    metrics = {}
    if config.dual_clip is not None:
        dual = (inputs.adv_neg < 0) & (negative > config.dual_clip)
        negative = jnp.minimum(negative, config.dual_clip)
        metrics["dual_clip_fraction"] = _metric(dual.astype(jnp.float32), -inputs.adv_neg)
    loss = -inputs.adv_pos * jnp.minimum(ratio_bt, high) - inputs.adv_neg * negative
    clipped = inputs.adv_pos * (ratio_bt > high) - inputs.adv_neg * (ratio_bt < low)
    metrics["clip_fraction"] = (jnp.sum(clipped), jnp.sum(inputs.adv_pos - inputs.adv_neg))
    return loss, metrics


def _ratio_metrics(ratio_bt: jax.Array, inputs: LossInputs) -> Metrics:
    value = jax.lax.stop_gradient(ratio_bt)
    return {"ratio": _metric(value, inputs.weights), "ratio_max": _max_metric(value, inputs.weights)}


@register_policy_loss("ppo")
def ppo_loss(inputs: LossInputs, config: LossConfig) -> tuple[jax.Array, Metrics]:
    """PPO-clip with a token-level ratio ``ρ_t = π_θ(y_t) / π_old(y_t)`` (see ``clipped_surrogate``)."""
    ratio = jnp.exp(_log_ratio(inputs))
    loss, metrics = clipped_surrogate(ratio, inputs, config)
    return loss, {**metrics, **_ratio_metrics(ratio, inputs)}


@register_policy_loss("grpo")
def grpo_loss(inputs: LossInputs, config: LossConfig) -> tuple[jax.Array, Metrics]:
    """GRPO's surrogate: the token-level PPO-clip objective; what makes it GRPO is the group advantage
    (``trace_jax.rl.advantages``) and, in the paper, a KL penalty (``kl_coef``, ``kl="forward"``)."""
    return ppo_loss(inputs, config)


def _segment_mean(values_bt: jax.Array, weights_bt: jax.Array, segment_bt: jax.Array) -> jax.Array:
    """Per token: the unweighted mean of ``values`` over the trained tokens of its (row, segment)."""
    b, t = values_bt.shape
    mask = (weights_bt > 0).astype(values_bt.dtype)
    ids = (jnp.arange(b)[:, None] * t + jnp.clip(segment_bt, 0, t - 1)).reshape(-1)
    sums = jax.ops.segment_sum((values_bt * mask).reshape(-1), ids, num_segments=b * t)
    counts = jax.ops.segment_sum(mask.reshape(-1), ids, num_segments=b * t)
    return (sums / jnp.maximum(counts, 1.0))[ids].reshape(b, t)


@register_policy_loss("gspo")
def gspo_loss(inputs: LossInputs, config: LossConfig) -> tuple[jax.Array, Metrics]:
    """GSPO, sequence-level ratio: ``s_ℓ = exp(mean_{t ∈ ℓ} log(π_θ(t) / π_old(t)))`` over the trained tokens
    of path ℓ, shared-prefix tokens included in every path through them, clipped like PPO.

    Path ℓ contributes ``V_ℓ = c_ℓ Σ_{t∈ℓ} surrogate(s_ℓ, A(ℓ, t))``; its gradient is
    ``(dV_ℓ / d log s_ℓ) / |ℓ| · Σ_{t∈ℓ} ∇ log π_θ(t)``. A token of several paths therefore gets the value
    ``seq_loss = Σ_{ℓ∋t} V_ℓ / |ℓ|`` and the coefficient ``seq_grad = Σ_{ℓ∋t} (dV_ℓ / d log s_ℓ) / |ℓ|`` on
    its own log-prob, both computed from the whole batch at the current params
    (``trace_jax.rl.sequences.sequence_terms``): value and gradient are the per-path objective's, clipping
    included. With ``aggregation="seq-mean-token-mean"`` (c_ℓ = 1 / |ℓ|) it is the paper's objective;
    under ``token-mean`` path ℓ weighs |ℓ| / mean |ℓ| instead of 1. Ratio and clip metrics are per path and
    come with the terms. GSPO's clip ranges are much tighter than PPO's (the paper uses ~3e-4 / 4e-4): set
    clip_low / clip_high accordingly.
    """
    if inputs.seq_loss is None or inputs.seq_grad is None:
        raise ValueError(
            "policy_loss 'gspo' needs every path's sequence ratio from the whole batch: train with "
            "RLTrainer.update(state, batch, path_tokens=info.path_tokens) (info from build_batch)"
        )
    own = inputs.logprobs - jax.lax.stop_gradient(inputs.logprobs)  # value 0, gradient ∇ log π_θ(t)
    mask = inputs.weights > 0
    return jnp.where(mask, inputs.seq_loss + inputs.seq_grad * own, 0.0), {}


def sequence_surrogate(
    log_ratio_l: jax.Array, adv_pos_l: jax.Array, adv_neg_l: jax.Array, weights_l: jax.Array, config: LossConfig
) -> tuple[jax.Array, jax.Array, Metrics]:
    """Per sequence ℓ with ratio ``s_ℓ = exp(log_ratio_l)``: ``(V_ℓ, dV_ℓ / d log s_ℓ, metrics)``.

    ``V_ℓ`` is ``clipped_surrogate`` at ``s_ℓ`` with ``adv_pos_l / adv_neg_l`` the sums over the sequence's
    tokens of c_ℓ·max(A, 0) / c_ℓ·min(A, 0); ``weights_l`` (c_ℓ |ℓ|) weighs the ratio metrics. 1-D arrays.
    """
    zeros = jnp.zeros_like(log_ratio_l)
    inputs = LossInputs(zeros, zeros, adv_pos_l, adv_neg_l, weights_l, zeros.astype(jnp.int32))

    def total(log_ratio):
        ratio = jnp.exp(jnp.clip(log_ratio, -MAX_LOG_RATIO, MAX_LOG_RATIO))
        value, metrics = clipped_surrogate(ratio, inputs, config)
        return jnp.sum(value), (value, {**metrics, **_ratio_metrics(ratio, inputs)})

    slope, (value, metrics) = jax.grad(total, has_aux=True)(log_ratio_l)
    return value, slope, metrics


@register_policy_loss("gspo_turn")
def gspo_turn_loss(inputs: LossInputs, config: LossConfig) -> tuple[jax.Array, Metrics]:
    """GSPO with a turn-level ratio: ``s_y = exp(mean_{t ∈ turn y} log(π_θ/π_old))``, the same on every path
    through the turn, hence exact under sharing; the GSPO-token form: the value is ``s_y``, the gradient flows
    through each token's own log-prob. For one-turn paths with ``aggregation="seq-mean-token-mean"`` it is
    GSPO's objective; under ``token-mean`` a path weighs its length (see ``gspo_loss``)."""
    seq_log_ratio = _segment_mean(_log_ratio(inputs), inputs.weights, inputs.segment_ids)
    ratio = jnp.exp(jax.lax.stop_gradient(seq_log_ratio) + inputs.logprobs - jax.lax.stop_gradient(inputs.logprobs))
    loss, metrics = clipped_surrogate(ratio, inputs, config)
    return loss, {**metrics, **_ratio_metrics(ratio, inputs)}


# ------------------------------------------------------------------------------------- KL penalties
# Per-token penalties as functions of d = log π_θ(y) − log π_ref(y), y sampled from π_θ. As a loss, the
# expected gradient of ½d² is E[d ∇log π_θ] = ∇ KL(π_θ ‖ π_ref); that of exp(−d) + d − 1 (k3) is
# E[(1 − π_ref/π_θ) ∇log π_θ] = −Σ π_ref ∇log π_θ = ∇ KL(π_ref ‖ π_θ). Checked by exact enumeration in tests.
KL_PENALTIES: Registry[Callable[[jax.Array], jax.Array]] = Registry(
    "kl penalty",
    {
        "reverse": lambda d: 0.5 * jnp.square(d),
        "forward": lambda d: jnp.expm1(-d) + d,  # exp(−d) + d − 1 without float32 cancellation near d = 0
    },
)


def kl_value_estimate(d: jax.Array) -> jax.Array:
    """k3 = exp(−d) + d − 1 >= 0 with d = log π_θ(y) − log π_ref(y), y sampled from π_θ: an unbiased per-token
    estimate of the *value* KL(π_θ ‖ π_ref) (for metrics)."""
    return jnp.expm1(-d) + d


def behaviour_kl_estimate(d: jax.Array, truncated: bool = False) -> jax.Array:
    """A per-token estimate of KL(π_old ‖ π_θ) from d = log π_θ(y) − log π_old(y), y sampled from π_old (the
    batch's tokens). ``truncated=False``: k3 = (r − 1) − log r >= 0 with r = exp(d), unbiased because
    E_old[r] = Σ_{y: π_old(y) > 0} π_θ(y) = 1. When π_old is a top-k / top-p truncation, E_old[r] is the mass
    π_θ puts on the kept tokens, m < 1, and k3 would estimate KL(π_old ‖ π_θ) + (m − 1), not a KL: there
    (``truncated=True``) it is k1 = −d, unbiased for KL(π_old ‖ π_θ) whatever the support (noisier, and a single
    token's value can be negative)."""
    return -d if truncated else jnp.expm1(d) - d


# -------------------------------------------------------------------------------------- aggregation
class Aggregation(NamedTuple):
    """How paths are weighed: ``c_ℓ = path_coefficients(trained tokens per path [L], config, max_len)`` on the
    host, and a denominator of Σ weights (``per_path=False``) or of the number of paths (``per_path=True``)."""

    path_coefficients: Callable[[np.ndarray, LossConfig, int], np.ndarray]
    per_path: bool


AGGREGATIONS: Registry[Aggregation] = Registry(
    "loss aggregation",
    {
        # Σ_ℓ Σ_{t∈ℓ} ℓ_t / Σ_ℓ |ℓ|: every trained path token counts the same (DAPO).
        "token-mean": Aggregation(lambda n, config, max_len: np.ones(n.shape), per_path=False),
        # mean_ℓ (Σ_{t∈ℓ} ℓ_t / |ℓ|) (the original GRPO).
        "seq-mean-token-mean": Aggregation(lambda n, config, max_len: 1.0 / np.maximum(n, 1), per_path=True),
        # mean_ℓ (Σ_{t∈ℓ} ℓ_t) / L with a constant L: no length bias (Dr. GRPO).
        "seq-mean-token-sum-norm": Aggregation(
            lambda n, config, max_len: np.full(n.shape, 1.0 / (config.norm_length or max_len)), per_path=True
        ),
    },
)


def loss_denominator(weights_bt: jax.Array, paths_b: jax.Array | None, config: LossConfig) -> jax.Array:
    """float32 []: the denominator of ``config.aggregation`` over a whole batch: Σ weights, or the number of
    paths (``paths_b``: float32 [B], paths whose leaf trains in each row). Numpy or jax arrays alike."""
    if AGGREGATIONS[config.aggregation].per_path:
        if paths_b is None:
            raise ValueError(f"aggregation {config.aggregation!r} needs the batch's path counts")
        return paths_b.sum()
    return weights_bt.sum()  # numpy in, numpy out: the trainer computes it on the host too


# -------------------------------------------------------------------------------------------- total
def mask_nonfinite_behaviour(inputs: LossInputs) -> tuple[LossInputs, jax.Array]:
    """``inputs`` with every trained token whose behaviour log-prob is −inf or NaN untrained (weight and
    advantages 0), and the number of such tokens (float32 []).

    Such a token's ratio is unbounded: clipped at ``exp(MAX_LOG_RATIO)`` it would add ~4.9e8·|A| to the loss
    with zero gradient. ``trace_jax.rl.trainer.RLTrainer.update`` reports the count as
    ``masked_nonfinite_tokens``; the denominator is left as built.
    """
    bad = (inputs.weights > 0) & ~jnp.isfinite(inputs.old_logprobs)
    zero = lambda x: jnp.where(bad, 0.0, x)
    fixed = inputs._replace(
        weights=zero(inputs.weights),
        adv_pos=zero(inputs.adv_pos),
        adv_neg=zero(inputs.adv_neg),
        old_logprobs=jnp.where(jnp.isfinite(inputs.old_logprobs), inputs.old_logprobs, 0.0),
    )
    return fixed, jnp.sum(bad.astype(jnp.float32))


def compute_loss(inputs: LossInputs, config: LossConfig, truncated_behaviour: bool = False) -> LossOutput:
    """Policy loss + kl_coef · KL penalty − entropy_coef · H, per token, summed to a numerator.

    Divide by ``loss_denominator(...)`` of the whole batch to get the loss. Trained tokens with a non-finite
    behaviour log-prob are left out (``mask_nonfinite_behaviour``). Metrics: pg_loss, approx_kl (KL(π_old ‖ π_θ)
    by ``behaviour_kl_estimate``: k1 when ``truncated_behaviour``, i.e. the behaviour log-probs are those of a
    top-k / top-p truncated distribution, else k3), behaviour_gap (the mean |log π_θ − log π_old| a trained
    token, clipped as the ratio is: how far the trained policy is from the one that sampled), clip fractions,
    ratio and ratio_max, and kl_ref / entropy when those are given.
    """
    inputs, _ = mask_nonfinite_behaviour(inputs)
    per_token, metrics = POLICY_LOSSES[config.policy_loss](inputs, config)
    metrics["pg_loss"] = (jnp.sum(per_token), jnp.sum(inputs.weights))
    log_ratio = _log_ratio(inputs)
    kl = behaviour_kl_estimate(jax.lax.stop_gradient(log_ratio), truncated_behaviour)
    metrics["approx_kl"] = _metric(kl, inputs.weights)
    metrics["behaviour_gap"] = _metric(jnp.abs(jax.lax.stop_gradient(log_ratio)), inputs.weights)
    if inputs.ref_logprobs is not None:
        d = jnp.where(inputs.weights > 0, inputs.logprobs - inputs.ref_logprobs, 0.0)
        d = jnp.clip(d, -MAX_LOG_RATIO, MAX_LOG_RATIO)
        metrics["kl_ref"] = _metric(kl_value_estimate(jax.lax.stop_gradient(d)), inputs.weights)
        if config.kl_coef:
            per_token = per_token + config.kl_coef * inputs.weights * KL_PENALTIES[config.kl](d)
    elif config.kl_coef:
        raise ValueError("kl_coef > 0 needs ref_logprobs (reference policy log-probs) in the batch")
    if inputs.entropies is not None:
        metrics["entropy"] = _metric(jax.lax.stop_gradient(inputs.entropies), inputs.weights)
        if config.entropy_coef:
            per_token = per_token - config.entropy_coef * inputs.weights * inputs.entropies
    elif config.entropy_coef:
        raise ValueError("entropy_coef > 0 needs per-token entropies")
    return LossOutput(numerator=jnp.sum(per_token), metrics=metrics)


def combine_metrics(a: Metrics, b: Metrics) -> Metrics:
    """Adds (sum, weight) pairs; ``*_max`` pairs combine by max."""
    out = {}
    for k in a:
        op = jnp.maximum if k.endswith("_max") else jnp.add
        out[k] = (op(a[k][0], b[k][0]), op(a[k][1], b[k][1]))
    return out


def finalize_metrics(metrics: Metrics) -> dict[str, float]:
    """(sum, count) pairs -> plain floats (sum / count; 0 when count is 0). Host side."""
    return {k: float(s) / float(c) if float(c) and np.isfinite(float(s)) else 0.0 for k, (s, c) in metrics.items()}
