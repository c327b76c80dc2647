import numpy as np
import pytest

from tests.rl.trees import branching_tree, random_tree
from trace_jax.rl.advantages import ESTIMATORS, compute_advantages
from trace_jax.rollout.tree import RolloutTree

# Leaves b, c, d of branching_tree() have rewards 1, 0, 0: mean 1/3, population std sqrt(2/9).
STD = np.sqrt(2 / 9)
GRPO_LEAF = np.array([2 / 3, -1 / 3, -1 / 3]) / STD


def _expected_from_leaves(leaf_adv):
    """Node values of branching_tree when every node of leaf ℓ's path gets leaf_adv[ℓ]: a is shared by b and c."""
    b, c, d = leaf_adv
    return np.array([0.0, (b + c) / 2, b, c, d])


WEIGHTS = np.array([0.0, 2.0, 1.0, 1.0, 1.0])  # the root is never trained; a is on two leaf paths


@pytest.mark.parametrize(
    "name, leaf_adv",
    [
        ("grpo", GRPO_LEAF),
        ("drgrpo", np.array([2 / 3, -1 / 3, -1 / 3])),
        # leave-one-out: b: 1 − mean(0, 0); c, d: 0 − mean(1, 0)
        ("rloo", np.array([1.0, -0.5, -0.5])),
        # intra: chain a holds b, c (rewards 1, 0 -> +1, −1), chain d holds one leaf (0); inter = GRPO
        ("tree_grpo", np.array([1.0, -1.0, 0.0]) + GRPO_LEAF),
    ],
)
def test_path_estimators_by_hand(name, leaf_adv):
    (out,) = compute_advantages(name, [branching_tree()], eps=0.0)
    np.testing.assert_allclose(out.advantages, _expected_from_leaves(leaf_adv), atol=1e-6)
    np.testing.assert_array_equal(out.weights, WEIGHTS)


def test_shared_segment_weight_times_advantage_is_sum_over_its_leaves():
    (out,) = compute_advantages("grpo", [branching_tree()], eps=0.0)
    # Node a sits on the paths of b and c: trained once with weight 2, it must carry A_b + A_c.
    assert out.weights[1] * out.advantages[1] == pytest.approx(GRPO_LEAF[0] + GRPO_LEAF[1], abs=1e-6)


def test_treerl_by_hand():
    (out,) = compute_advantages("treerl", [branching_tree()])
    v_root, v_a = 1 / 3, 1 / 2
    expected = [
        0.0,
        ((v_a - v_root) + (v_a - v_root)) / np.sqrt(2),  # a: parent is the root
        ((1 - v_root) + (1 - v_a)) / 1,  # b
        ((0 - v_root) + (0 - v_a)) / 1,  # c
        ((0 - v_root) + (0 - v_root)) / 1,  # d
    ]
    np.testing.assert_allclose(out.advantages, expected, atol=1e-6)
    np.testing.assert_array_equal(out.weights, WEIGHTS)


def test_node_value_by_hand():
    (out,) = compute_advantages("node_value", [branching_tree()], eps=0.0)
    values = np.array([1 / 2, 1.0, 0.0, 0.0])  # V̂ of a, b, c, d
    np.testing.assert_allclose(out.advantages[1:], (values - values.mean()) / values.std(), atol=1e-6)
    assert out.advantages[0] == 0.0


@pytest.mark.parametrize("name", sorted(ESTIMATORS))
def test_uniform_rewards_give_zero_advantage(name):
    tree = RolloutTree([1])
    a = tree.add_turn(0, [5], observation_ids=[6])
    tree.add_turn(a, [7], reward=1.0)
    tree.add_turn(a, [8], reward=1.0)
    tree.add_turn(0, [9], reward=1.0)
    (out,) = compute_advantages(name, [tree])
    np.testing.assert_allclose(out.advantages, 0.0, atol=1e-6)


@pytest.mark.parametrize("name", sorted(ESTIMATORS))
def test_unfinished_branch_is_not_trained_and_root_never(name):
    tree = branching_tree()
    dangling = tree.add_turn(1, [40, 41], observation_ids=[92])  # no leaf under it (e.g. budget ran out)
    (out,) = compute_advantages(name, [tree])
    assert out.weights[dangling] == 0 and out.advantages[dangling] == 0
    assert out.weights[0] == 0
    assert np.all(np.isfinite(out.advantages))


@pytest.mark.parametrize("name", ["grpo", "drgrpo", "rloo", "tree_grpo"])
def test_dedup_matches_per_path_sums_on_random_trees(name):
    rng = np.random.default_rng(0)
    for _ in range(20):
        tree = random_tree(rng)
        (out,) = compute_advantages(name, [tree])
        # A leaf is on one path, so its own entry is that path's advantage; a shared node must carry their sum.
        leaf_adv = out.advantages[tree.leaves()]
        for node in tree.nodes[1:]:
            under = [i for i, leaf in enumerate(tree.leaves()) if node.node_id in tree.path(leaf)]
            assert out.weights[node.node_id] == len(under)
            assert out.weights[node.node_id] * out.advantages[node.node_id] == pytest.approx(
                leaf_adv[under].sum(), abs=1e-5
            )


def test_unknown_estimator_names_the_choices():
    with pytest.raises(ValueError, match="treerl"):
        compute_advantages("tree-rl", [branching_tree()])
