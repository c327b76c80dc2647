"""Calibration metrics of success predictions: soft-label AUC, Brier score, ECE."""

import numpy as np
import pytest

from trace_jax.allocation.calibration import calibration_metrics, weighted_auc


def test_weighted_auc_matches_pairwise_counting_with_ties():
    rng = np.random.default_rng(0)
    pred, y, w = np.round(rng.random(40), 1), rng.random(40), rng.random(40)
    pos, neg = w * y, w * (1 - y)
    pairs = sum(
        pos[i] * neg[j] * (1.0 if pred[i] > pred[j] else 0.5 if pred[i] == pred[j] else 0.0)
        for i in range(40)
        for j in range(40)
    )
    assert weighted_auc(pred, y, w) == pytest.approx(pairs / (pos.sum() * neg.sum()))


def test_calibration_metrics_on_hand_made_predictions():
    y = np.asarray([1.0, 0.0, 1.0, 0.0])
    w = np.ones(4)
    perfect = calibration_metrics(y * 0.98 + 0.01, y, w)
    assert perfect["brier"] < 1e-3 and perfect["auc"] == 1.0 and perfect["ece"] < 0.02
    assert calibration_metrics(1 - y, y, w)["auc"] == 0.0
    assert calibration_metrics(np.full(4, 0.5), y, w)["ece"] == pytest.approx(0.0)
