"""Budget bookkeeping and the cost model every policy is charged with."""

import numpy as np
import pytest

from trace_jax.allocation.context import Budget, CostModel, tree_backups
from trace_jax.rollout.tree import RolloutTree


def test_cost_model_learns_the_fresh_continuation_cost_per_depth():
    tree = RolloutTree([1])
    a = tree.add_turn(0, [2] * 100)  # first chain: 100 + 20 tokens
    tree.add_turn(a, [2] * 20, reward=1.0)
    tree.add_turn(a, [2] * 60, reward=0.0)  # a later fork from a: not a sample of the root's cost
    model = CostModel(prior_tokens_per_rollout=500.0, decay=1.0)
    model.update([tree])
    np.testing.assert_allclose(model.remaining_tokens(np.asarray([0, 1, 3])), [120.0, 20.0, 20.0])
    assert CostModel(prior_tokens_per_rollout=500.0).remaining_tokens(np.asarray([2]))[0] == 500.0


def test_an_unfinished_first_turn_is_no_sample_of_the_cost():
    """A first turn left without a leaf (a prompt-selection probe stage 1 did not continue) comes first among the
    root's children; the root's cost sample is the first chain that reached a leaf. Fails if the cost model takes
    the first child whatever it became (it would learn 5 tokens for a fresh rollout)."""
    tree = RolloutTree([1])
    tree.add_turn(0, [2] * 5, observation_ids=[3])  # the unfinished probe
    b = tree.add_turn(0, [2] * 30)
    tree.add_turn(b, [2] * 10, reward=1.0)
    model = CostModel(prior_tokens_per_rollout=500.0, decay=1.0)
    model.update([tree])
    np.testing.assert_allclose(model.remaining_tokens(np.asarray([0, 1])), [40.0, 10.0])


def test_cost_model_state_round_trip_and_budget_validation():
    model = CostModel()
    model.sums[0], model.weights[0] = 300.0, 2.0
    other = CostModel()
    other.load_state_dict(model.state_dict())
    assert other.remaining_tokens(np.asarray([0]))[0] == 150.0
    with pytest.raises(ValueError, match="tokens_per_prompt"):
        Budget()


def test_tree_backups_match_the_tree_methods():
    tree = RolloutTree([1])
    a = tree.add_turn(0, [2])
    tree.add_turn(a, [3], reward=1.0)
    tree.add_turn(a, [3], reward=0.0)
    tree.add_turn(0, [4])  # an anchor with no leaf yet
    counts, values = tree_backups(tree)
    np.testing.assert_array_equal(counts, tree.leaf_counts())
    np.testing.assert_array_equal(values, tree.values())
