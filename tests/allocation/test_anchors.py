"""Anchor gathering: predictor inputs and V-hat targets read from rollout trees."""

import numpy as np
import pytest

from trace_jax.allocation.anchors import gather_anchors, training_anchors
from trace_jax.rollout.tree import RolloutTree


def test_training_anchors_carry_backups_and_leaf_counts():
    tree = RolloutTree([1, 2])
    mid = tree.add_turn(0, [3], feature=np.ones(4))
    tree.add_turn(mid, [4], reward=1.0)
    tree.add_turn(mid, [4], reward=0.0)
    tree.add_turn(0, [5], reward=0.0)
    anchors = training_anchors([tree])
    assert anchors.depths_n.tolist() == [0, 1]
    np.testing.assert_allclose(anchors.targets_n, [1 / 3, 1 / 2])
    np.testing.assert_allclose(anchors.weights_n, [3, 2])
    assert anchors.has_feature_n.tolist() == [False, True]


def test_gather_anchors_rejects_features_of_different_sizes():
    tree = RolloutTree([1])
    a = tree.add_turn(0, [2], feature=np.ones(4))
    b = tree.add_turn(0, [3], feature=np.ones(3))
    with pytest.raises(ValueError, match="different sizes"):
        gather_anchors([tree], [(0, a), (0, b)])


def test_gather_anchors_without_targets_leaves_them_unknown_and_reads_prefix_ids():
    tree = RolloutTree([1, 2])
    mid = tree.add_turn(0, [3])
    tree.add_turn(mid, [4], reward=1.0)
    anchors = gather_anchors([tree], [(0, mid)], with_prefix_ids=True)
    assert np.isnan(anchors.targets_n).all() and anchors.weights_n.tolist() == [0.0]
    assert anchors.features_nd.shape == (1, 0)
    assert anchors.prefix_ids[0].tolist() == [1, 2, 3]
