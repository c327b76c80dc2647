"""Sequence-level (GSPO) terms of a batch: every root-to-leaf path's ratio from the whole batch's log-probs.

A tree batch trains each sampled token once, in one row, while the path it belongs to may continue in other
rows and share the token with other paths. ``PathTokens`` (built by ``trace_jax.rl.batch.build_batch``) lists,
for every path, where its trained tokens sit in the batch and the advantage each carries on that path;
``sequence_terms`` takes the log-probs of the whole batch at the params of one optimizer step and returns
the per-token inputs of ``trace_jax.rl.losses.gspo_loss`` plus the per-path ratio metrics. Host-side numpy
(the surrogate itself is ``trace_jax.rl.losses.sequence_surrogate``).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import numpy as np

from trace_jax.rl.losses import MAX_LOG_RATIO, LossConfig, Metrics, sequence_surrogate


class PathTokens(NamedTuple):
    """Every path's trained tokens, as (path, position) entries (host numpy).

    path: int64 [E] the path of each entry (0 .. L-1; a token shared by k paths has k entries).
    position: int64 [E] the token's flat index ``row * T + column`` in the batch.
    advantage: float64 [E] A(ℓ, y) of the token's turn y on path ℓ.
    coefficient: float64 [L] the aggregation's path coefficient c_ℓ.
    """

    path: np.ndarray
    position: np.ndarray
    advantage: np.ndarray
    coefficient: np.ndarray

    @property
    def num_paths(self) -> int:
        return int(self.coefficient.shape[0])


def sequence_terms(
    paths: PathTokens, logprobs_bt: np.ndarray, old_logprobs_bt: np.ndarray, config: LossConfig
) -> tuple[np.ndarray, np.ndarray, Metrics]:
    """``(seq_loss [B, T], seq_grad [B, T], metrics)`` of ``trace_jax.rl.losses.gspo_loss``.

    ``logprobs_bt`` are the whole batch's log-probs at the params the gradient is taken at: path ℓ's ratio is
    ``s_ℓ = exp(mean_{t∈ℓ} clip(log π_θ(t) − log π_old(t)))`` over its tokens whose behaviour log-prob is finite
    (the others are left out, as ``mask_nonfinite_behaviour`` leaves them out of the loss). Metrics: ratio,
    ratio_max, clip_fraction (and dual_clip_fraction) per path, as (sum, weight) pairs.
    """
    shape = np.shape(logprobs_bt)
    logprobs = np.asarray(logprobs_bt, np.float64).reshape(-1)[paths.position]
    old = np.asarray(old_logprobs_bt, np.float64).reshape(-1)[paths.position]
    finite = np.isfinite(old)
    diff = np.clip(np.where(finite, logprobs - np.where(finite, old, 0.0), 0.0), -MAX_LOG_RATIO, MAX_LOG_RATIO)
    per_path = lambda values: np.bincount(paths.path, values, minlength=paths.num_paths)
    count = per_path(finite.astype(np.float64))
    coef = paths.coefficient * (count > 0)
    adv = np.where(finite, paths.advantage, 0.0)
    f32 = lambda x: np.asarray(x, np.float32)
    value, slope, metrics = sequence_surrogate(
        f32(per_path(diff) / np.maximum(count, 1.0)),
        f32(coef * per_path(np.maximum(adv, 0.0))),
        f32(coef * per_path(np.minimum(adv, 0.0))),
        f32(coef * count),
        config,
    )
    per_token = lambda per_path_values: np.bincount(
        paths.position,
        np.where(finite, (np.asarray(per_path_values, np.float64) / np.maximum(count, 1.0))[paths.path], 0.0),
        minlength=int(np.prod(shape)),
    ).reshape(shape)
    seq_loss = per_token(value).astype(np.float32)
    seq_grad = per_token(slope).astype(np.float32)
    return seq_loss, seq_grad, jax.device_get(metrics)
