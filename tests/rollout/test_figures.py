"""The public figures on hand-made trees whose answers can be counted by hand."""

import pytest

from trace_jax.rollout import figures
from trace_jax.rollout.tree import RolloutTree


def chain_tree(rewards, turn_tokens=10):
    """One prompt, one chain of two turns per reward, all forking at the root."""
    tree = RolloutTree([1, 2, 3])
    for r in rewards:
        mid = tree.add_turn(0, [5] * turn_tokens, observation_ids=[7, 7])
        tree.add_turn(mid, [6] * turn_tokens, reward=r)
    return tree


def test_effective_ratio_counts_prompts_with_both_outcomes_including_unsampled_ones():
    trees = [chain_tree([1, 0]), chain_tree([1, 1]), chain_tree([0]), RolloutTree([1])]
    assert figures.effective_ratio(trees) == 0.25
    assert figures.effective_ratio([]) == 0.0


def test_nonzero_advantage_share_of_leaves_and_tokens():
    mixed, flat = chain_tree([1, 0, 0], turn_tokens=10), chain_tree([1], turn_tokens=30)
    share = figures.nonzero_advantage_share([mixed, flat])
    assert share["leaves"] == pytest.approx(3 / 4)
    assert share["tokens"] == pytest.approx(60 / (60 + 60))
    # tokens a policy generated and then threw away count in the denominator when given
    assert figures.nonzero_advantage_share([mixed, flat], generated_tokens=240)["tokens"] == pytest.approx(0.25)


def test_tokens_per_leaf_counts_shared_prefixes_once():
    tree = RolloutTree([1])
    mid = tree.add_turn(0, [5] * 40)
    tree.add_turn(mid, [6] * 10, reward=1.0)
    tree.add_turn(mid, [6] * 30, reward=0.0)
    assert figures.tokens_per_leaf([tree]) == pytest.approx((40 + 10 + 30) / 2)
    assert figures.tokens_per_leaf([RolloutTree([1])]) == 0.0


def test_mixed_anchor_share_and_batch_figures():
    tree = RolloutTree([1])
    a = tree.add_turn(0, [5])
    tree.add_turn(a, [6], reward=1.0)
    tree.add_turn(a, [6], reward=0.0)
    b = tree.add_turn(0, [5])
    tree.add_turn(b, [6], reward=1.0)
    tree.add_turn(b, [6], reward=1.0)
    assert figures.mixed_anchor_share([tree]) == pytest.approx(2 / 3)  # root and a mixed, b not
    out = figures.batch_figures([tree])
    assert out["effective_ratio"] == 1.0 and out["nonzero_advantage_leaves"] == 1.0
