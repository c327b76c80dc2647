"""Calibration of success predictions against ``V̂`` backups: weighted Brier score, soft-label AUC and ECE."""

from __future__ import annotations

import numpy as np


def weighted_auc(pred_n: np.ndarray, target_n: np.ndarray, weight_n: np.ndarray) -> float:
    """AUC with soft labels: anchor a counts ``w_a y_a`` times as a positive and ``w_a (1 - y_a)`` as a negative.

    Ties in ``pred`` count one half. NaN when there are no positives or no negatives.
    """
    pred, y, w = (np.asarray(a, np.float64) for a in (pred_n, target_n, weight_n))
    pos, neg = w * y, w * (1.0 - y)
    if pos.sum() <= 0 or neg.sum() <= 0:
        return float("nan")
    unique, inverse = np.unique(pred, return_inverse=True)
    pos_u = np.bincount(inverse, pos, unique.size)
    neg_u = np.bincount(inverse, neg, unique.size)
    neg_below = np.cumsum(neg_u) - neg_u  # negatives with a strictly lower score
    return float((pos_u * (neg_below + 0.5 * neg_u)).sum() / (pos.sum() * neg.sum()))


def calibration_metrics(
    pred_n: np.ndarray, target_n: np.ndarray, weight_n: np.ndarray, num_bins: int = 10
) -> dict[str, float]:
    """Weighted Brier score, AUC and expected calibration error (``num_bins`` equal-width bins) of predictions."""
    pred, y, w = (np.asarray(a, np.float64) for a in (pred_n, target_n, weight_n))
    keep = np.isfinite(y) & (w > 0)
    pred, y, w = pred[keep], y[keep], w[keep]
    if w.sum() <= 0:
        return {"brier": float("nan"), "auc": float("nan"), "ece": float("nan")}
    bins = np.minimum((pred * num_bins).astype(int), num_bins - 1)
    bin_w = np.bincount(bins, w, num_bins)
    gap = np.abs(np.bincount(bins, w * pred, num_bins) - np.bincount(bins, w * y, num_bins))
    return {
        "brier": float((w * (pred - y) ** 2).sum() / w.sum()),
        "auc": weighted_auc(pred, y, w),
        "ece": float(gap.sum() / bin_w.sum()),
    }
