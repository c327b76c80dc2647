import numpy as np
import pytest

from trace_jax.rollout.tree import ROOT, RolloutTree


def _tree():
    """root -> a (obs) -> {leaf a1 r=1, leaf a2 r=0};  root -> leaf b r=1;  root -> c (obs, unfinished)."""
    tree = RolloutTree([1, 2, 3], task="t", prompt_index=7)
    a = tree.add_turn(ROOT, [10, 11], logprobs=[-0.1, -0.2], observation_ids=[90, 91, 92])
    a1 = tree.add_turn(a, [12], logprobs=[-0.3], reward=1.0)
    a2 = tree.add_turn(a, [13, 14], reward=0.0)
    b = tree.add_turn(ROOT, [20], reward=1.0)
    c = tree.add_turn(ROOT, [30, 31], observation_ids=[93], feature=np.ones(4))
    return tree, dict(a=a, a1=a1, a2=a2, b=b, c=c)


def test_leaves_anchors_and_paths():
    tree, ids = _tree()
    assert tree.leaves() == [ids["a1"], ids["a2"], ids["b"]]
    assert tree.anchors() == [ROOT, ids["a"], ids["c"]]
    assert tree.path(ids["a2"]) == [ROOT, ids["a"], ids["a2"]]
    assert tree[ids["a2"]].depth == 2
    np.testing.assert_array_equal(tree.prefix_ids(ids["a2"]), [1, 2, 3, 10, 11, 90, 91, 92, 13, 14])
    assert tree.prefix_length(ids["a2"]) == 10


def test_leaf_counts_and_value_backups_by_hand():
    tree, ids = _tree()
    counts = tree.leaf_counts()
    assert counts[ROOT] == 3 and counts[ids["a"]] == 2 and counts[ids["c"]] == 0 and counts[ids["b"]] == 1
    values = tree.values()
    np.testing.assert_allclose(values[[ROOT, ids["a"], ids["a1"], ids["a2"], ids["b"]]], [2 / 3, 0.5, 1, 0, 1])
    assert np.isnan(values[ids["c"]])
    assert tree.is_mixed()
    assert tree.num_sampled_tokens() == 2 + 1 + 2 + 1 + 2


def test_loss_mask_zero_on_observations_and_root():
    tree, ids = _tree()
    np.testing.assert_array_equal(tree[ids["a"]].loss_mask, [1, 1, 0, 0, 0])
    np.testing.assert_array_equal(tree.root.loss_mask, [0, 0, 0])


def test_leaf_cannot_be_continued_and_lengths_checked():
    tree, ids = _tree()
    with pytest.raises(ValueError, match="leaf"):
        tree.add_turn(ids["b"], [1])
    with pytest.raises(ValueError, match="logprobs"):
        tree.add_turn(ROOT, [1, 2], logprobs=[0.0])


def test_dict_round_trip_keeps_everything():
    tree, ids = _tree()
    back = RolloutTree.from_dict(tree.to_dict())
    assert back.task == "t" and back.prompt_index == 7 and len(back) == len(tree)
    np.testing.assert_array_equal(back.prefix_ids(ids["a2"]), tree.prefix_ids(ids["a2"]))
    np.testing.assert_allclose(back.values(), tree.values())
    np.testing.assert_allclose(back[ids["a"]].logprobs, [-0.1, -0.2])
    np.testing.assert_allclose(back[ids["c"]].feature, np.ones(4))


def test_single_outcome_tree_is_not_mixed():
    tree = RolloutTree([1])
    tree.add_turn(ROOT, [2], reward=1.0)
    tree.add_turn(ROOT, [3], reward=1.0)
    assert not tree.is_mixed()


def test_record_routing_puts_each_position_on_its_node_three_turns_deep():
    """One record of a three-turn history (observations after the first two turns) lands each position's row
    on the node that holds it; a second record from inside the history fills only what was unset. Mutant
    caught: ancestors' offsets walked by ``len(node.token_ids)`` (their observations left out)."""
    tree = RolloutTree([1, 2, 3])
    a = tree.add_turn(ROOT, [4, 5], observation_ids=[6])
    b = tree.add_turn(a, [7], observation_ids=[8, 9])
    c = tree.add_turn(b, [10, 11])
    assert tree[c].depth == 3 and tree.prefix_length(c) == 11  # premise: observations on the walked path
    position_rows = lambda first, last: np.arange(first, last, dtype=np.int32).reshape(-1, 1, 1)
    tree.record_routing(c, position_rows(0, 9), start=0)  # every position but c's last two
    tree.record_routing(c, position_rows(1005, 1011), start=5)  # positions 5..10: only c's are unset
    expected = {ROOT: [0, 1, 2], a: [3, 4, 5], b: [6, 7, 8], c: [1009, 1010]}
    for node_id, rows in expected.items():
        np.testing.assert_array_equal(tree[node_id].routed_experts[:, 0, 0], rows)
